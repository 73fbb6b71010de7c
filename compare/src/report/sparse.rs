//! The reading of a sparse model (an embedding table): where the parameter server's ways of
//! moving the table (ps-sparse, hybrid) win over the ring's dense all-reduce (ddp-dense) and
//! why, in bytes (measured, and by the cost model with the rows the runs named) and in time
//! (measured, ranked only where the runs may be ranked), and how the bytes and the time would
//! change with the table's rows and the ids per sample (the cost model, an estimate).

use std::fmt::Write as _;

use super::context::Context;
use crate::charts::Group;
use crate::cost::{self, Link, Sparse};
use crate::results::{Summary, overlap};
use crate::scenario::ModeKind;

/// The tables the estimate is taken to, rows.
const ROWS: [usize; 3] = [1 << 16, 1 << 20, 1 << 24];
/// Ids per sample of the estimate: the built-in data's, and four times as many.
const IDS_SCALE: [usize; 2] = [1, 4];

/// The group's table (rows, width) and dense bytes, when its model has one.
pub fn table(cx: &Context) -> Option<(usize, usize, f64)> {
    let widths = cx.g.rows.first()?.widths.as_str();
    let spec = gradsync_core::model::ModelSpec::from_token(widths).ok()?;
    let (rows, dim) = spec.table()?;
    let dense = 4.0 * cx.g.params.checked_sub(rows * dim)? as f64;
    Some((rows, dim, dense))
}

fn mode(r: &Summary) -> Option<ModeKind> {
    r.mode.parse().ok()
}

fn kb(bytes: f64) -> String {
    if bytes >= 1e6 { format!("{:.2} MB", bytes / 1e6) } else { format!("{:.1} KB", bytes / 1e3) }
}

/// Where ps-sparse and the hybrid win over ddp-dense, in bytes and in time, and how that
/// would move with the table's rows and the ids per sample.
pub fn ps_against_dense(cx: &Context) -> Vec<String> {
    let Some((rows, dim, dense)) = table(cx) else { return Vec::new() };
    let mut out = Vec::new();
    for &n in cx.workers.iter().filter(|&&n| n > 1) {
        let at = |m: ModeKind| -> Vec<&Summary> {
            cx.g.rows.iter().copied().filter(|r| r.workers == n && mode(r) == Some(m)).collect()
        };
        let Some(&dense_row) = at(ModeKind::DdpDense).first() else { continue };
        let ps_rows: Vec<&Summary> = at(ModeKind::PsSparse).into_iter().chain(at(ModeKind::Hybrid)).collect();
        if ps_rows.is_empty() {
            continue;
        }
        out.push(in_bytes(n, dense_row, &ps_rows, (rows, dim, dense)));
        out.push(in_time(cx, n, dense_row, &ps_rows, (rows, dim, dense)));
    }
    if let Some(line) = extrapolated(cx, (rows, dim, dense)) {
        out.push(line);
    }
    out
}

/// The bytes each moves per step per worker, measured, beside the cost model's with the rows
/// the run named.
fn in_bytes(n: usize, d: &Summary, ps: &[&Summary], t: (usize, usize, f64)) -> String {
    let (rows, dim, dense) = t;
    let dense_bytes = d.bytes_per_step_worker.unwrap_or(f64::NAN);
    let modelled = |r: &Summary| -> Option<f64> {
        let sp = Sparse { rows, dim, dense, unique: r.rows_per_step? };
        sp.bytes_per_worker(mode(r)?, n)
    };
    let whole = Sparse { rows, dim, dense, unique: 0.0 }.whole();
    let mut line = format!(
        "Sparse table ({rows} rows x {dim}, {} of {} of parameters), {n} workers, bytes sent and received \
         per step per worker: {} moves {} measured ({} by the cost model: 2(n-1)/n of the whole model each \
         way, zeros included)",
        kb(4.0 * (rows * dim) as f64),
        kb(whole),
        Group::series(d),
        kb(dense_bytes),
        kb(cost::ring_bytes_per_worker(n, whole)),
    );
    for r in ps {
        let measured = r.bytes_per_step_worker.unwrap_or(f64::NAN);
        let _ = write!(line, "; {} moves {} measured", Group::series(r), kb(measured));
        if let (Some(u), Some(m)) = (r.rows_per_step, modelled(r)) {
            let _ = write!(
                line,
                " ({} by the cost model from the {u:.0} rows its batch named, {:.2}% of the table, at {} \
                 bytes a row plus the dense layers' {}; {:.2}x the model)",
                kb(m),
                100.0 * u / rows as f64,
                cost::row_bytes(dim),
                kb(dense),
                measured / m
            );
        }
        if measured > 0.0 && dense_bytes.is_finite() {
            let _ = write!(line, ", {:.0}x fewer than {}", dense_bytes / measured, d.mode);
        }
    }
    line.push_str(
        ". Why: a parameter-server worker sends and receives only the rows its batch named, by id, while \
         the ring cannot add sparse vectors hop by hop and all-reduces every row of the table every step.",
    );
    line
}

/// Time to the target (or throughput, without one), ranked only between cells that ran more
/// than once and did not saturate the CPU; the cost model's step beside it.
fn in_time(cx: &Context, n: usize, d: &Summary, ps: &[&Summary], t: (usize, usize, f64)) -> String {
    let (rows, dim, dense) = t;
    let by_target = cx.g.target.is_some();
    let figure = |r: &Summary| -> String {
        match (by_target, r.time_to_target_s, r.step_ms) {
            (true, Some(s), _) => format!("{s:.2} s to the target"),
            (true, None, _) => "the target not reached in most repeats".into(),
            (false, _, Some(ms)) => format!("{ms:.2} ms a step"),
            (false, _, None) => "no step time".into(),
        }
    };
    let modelled = |r: &Summary| -> Option<f64> {
        let sp = Sparse { rows, dim, dense, unique: r.rows_per_step.unwrap_or(0.0) };
        sp.seconds(mode(r)?, n, r.shards, cx.link?)
    };
    let mut line = format!("In time at {n} workers: {} {}", Group::series(d), figure(d));
    if let Some(s) = modelled(d) {
        let _ = write!(line, " (its exchange {:.2} ms a step by the cost model)", s * 1e3);
    }
    for r in ps {
        let _ = write!(line, "; {} {}", Group::series(r), figure(r));
        if let Some(s) = modelled(r) {
            let _ = write!(line, " ({:.2} ms by the cost model)", s * 1e3);
        }
        let crowded: Vec<String> =
            [d, *r].iter().filter(|x| cx.cpu_saturated(x)).map(|x| Group::series(x)).collect();
        if !crowded.is_empty() {
            let _ = write!(line, ": not ranked, {} {}", crowded.join(" and "), cx.saturated());
            continue;
        }
        if !(cx.repeated(d) && cx.repeated(r)) {
            let _ = write!(line, ": {}", cx.unranked());
            continue;
        }
        let tt = |x: &Summary| cx.g.cell_of(x).and_then(|c| c.time_to_target);
        let (level, faster) = if by_target {
            match (tt(r), tt(d), r.time_to_target_s, d.time_to_target_s) {
                (Some(a), Some(b), Some(x), Some(y)) => (overlap(a, b), x < y),
                (_, _, Some(_), None) => (false, true),
                (_, _, None, Some(_)) => (false, false),
                _ => (true, false),
            }
        } else {
            (cx.level(r, d), Context::thr(r) > Context::thr(d))
        };
        let _ = write!(
            line,
            ": {}",
            match (level, faster) {
                (true, _) => format!("level with {} (their repeats' ranges overlap)", d.mode),
                (false, true) => format!("ahead of {}", d.mode),
                (false, false) => format!("behind {}", d.mode),
            }
        );
    }
    line.push('.');
    line
}

/// The cost model taken to other tables and more ids per sample (an estimate from the built-in
/// clicks' law of ids), at the most workers, one shard: the bytes ddp-dense moves over what
/// ps-sparse moves, and the step time of each on this group's link.
fn extrapolated(cx: &Context, t: (usize, usize, f64)) -> Option<String> {
    use gradsync_core::data::{CLICKS_IDS, CLICKS_ZIPF};
    let (_, dim, dense) = t;
    let n = cx.most_workers().filter(|&n| n > 1)?;
    let link = cx.link?;
    let batch = cx.g.rows.iter().find(|r| r.workers == n)?.batch;
    let mut parts = Vec::new();
    for scale in IDS_SCALE {
        let ids = (CLICKS_IDS.0 * scale, CLICKS_IDS.1 * scale);
        for rows in ROWS {
            let unique = cost::clicks_unique_rows(rows, ids, CLICKS_ZIPF, batch);
            let sp = Sparse { rows, dim, dense, unique };
            let (ps, ring) =
                (sp.bytes_per_worker(ModeKind::PsSparse, n)?, sp.bytes_per_worker(ModeKind::DdpDense, n)?);
            let (t_ps, t_ring) = (cost::sparse_ps(n, 1, &sp, link), cost::ring(n, sp.whole(), link));
            parts.push(format!(
                "{rows} rows, {}-{} ids a sample: {unique:.0} rows a batch ({:.3}% of the table), ddp-dense \
                 moves {:.0}x ps-sparse's bytes, its exchange {:.2} ms against {:.2} ms",
                ids.0,
                ids.1,
                100.0 * sp.touched(),
                ring / ps,
                t_ring * 1e3,
                t_ps * 1e3
            ));
        }
    }
    // Where ddp-dense would catch up with one shard: the server's link carries every worker's
    // rows, n u (4d+4), against the ring's 2(n-1)/n of the table, 4Rd.
    let share = 2.0 * (n as f64 - 1.0) / (n as f64 * n as f64) * 4.0 * dim as f64 / cost::row_bytes(dim);
    Some(format!(
        "Estimate (the cost model on {}, the built-in clicks' law of ids: Zipf {CLICKS_ZIPF} over the ranks, \
         {}-{} ids a sample; {n} workers of {batch} samples, one shard): {}. The parameter server's bytes \
         follow the rows a batch names, which grow with the ids per sample and only slowly with the table \
         (popular ids repeat), while the dense ring's follow the table: the more rows, the larger its \
         lead. With one shard the server's link carries every worker's rows, so ddp-dense would catch up \
         only once a batch named about {:.0}% of the table (2(n-1)/n^2 x 4d/(4d+4)).",
        link_name(link),
        CLICKS_IDS.0,
        CLICKS_IDS.1,
        parts.join("; "),
        100.0 * share
    ))
}

fn link_name(l: Link) -> String {
    format!("this group's link, {:.2} GB/s and {:.1} us", l.b / 1e9, l.a * 1e6)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::machine::Machine;
    use crate::results::{Cell, Collected};

    const WIDTHS: &str = "embedding:65536:16:64:mean/40-2";
    const PARAMS: usize = 65536 * 16 + 16 * 64 + 64 + 64 * 2 + 2;

    /// Repeat `k` of `mode` at 2 workers: its bytes and rows per step, its time to the target.
    fn run(mode: ModeKind, k: usize, bytes: f64, rows: Option<f64>, tt: f64) -> Summary {
        Summary {
            id: format!("runs/{}-r{k}", mode.label()),
            mode: mode.label().into(),
            workers: 2,
            shards: usize::from(mode.is_ps()),
            model: "embedding".into(),
            widths: WIDTHS.into(),
            params: PARAMS,
            global_batch: 64,
            batch: 32,
            status: "ok".into(),
            repeat: k,
            samples_per_s: Some(1000.0),
            step_ms: Some(10.0),
            bytes_per_step_worker: Some(bytes),
            rows_per_step: rows,
            time_to_target_s: Some(tt + k as f64),
            ..Summary::default()
        }
    }

    fn read(rows: Vec<Summary>, cores: usize) -> String {
        let c =
            Collected { cells: Cell::all(&rows), summaries: rows, target: Some(0.7), ..Collected::default() };
        let mut gs = crate::charts::groups(&c);
        gs[0].target = Some(0.7);
        let machine = Machine { cores, ..Machine::default() };
        let cx = Context::new(&gs[0], Some(Link { a: 10e-6, b: 1e9 }), Some(&machine), &c.summaries);
        ps_against_dense(&cx).join("\n")
    }

    #[test]
    fn the_ps_wins_in_bytes_by_the_rows_and_in_time_only_where_ranking_is_allowed() {
        let dense = 4.0 * (PARAMS - 65536 * 16) as f64;
        // 500 rows a worker's batch: push and pull of rows and dense values.
        let ps_bytes = 2.0 * (500.0 * 68.0 + dense);
        let ring = cost::ring_bytes_per_worker(2, 4.0 * PARAMS as f64);
        let rows: Vec<Summary> = (0..2)
            .flat_map(|k| {
                [
                    run(ModeKind::DdpDense, k, ring, None, 20.0),
                    run(ModeKind::PsSparse, k, ps_bytes * 1.02, Some(500.0), 5.0),
                    run(ModeKind::Hybrid, k, 70_000.0, Some(500.0), 6.0),
                ]
            })
            .collect();
        // Many cores: ranked by time to the target.
        let text = read(rows.clone(), 64);
        assert!(text.contains("Sparse table (65536 rows x 16"), "{text}");
        assert!(text.contains("ps-sparse k=1 (gRPC over TCP) moves 79.3 KB measured"), "{text}");
        assert!(
            text.contains("from the 500 rows its batch named, 0.76% of the table, at 68 bytes a row"),
            "{text}"
        );
        assert!(text.contains("1.02x the model"), "{text}");
        assert!(text.contains("fewer than ddp-dense"), "{text}");
        assert!(text.contains("ps-sparse k=1 (gRPC over TCP) 5.50 s to the target"), "{text}");
        assert!(text.contains(": ahead of ddp-dense"), "{text}");
        assert!(text.contains("Estimate (the cost model on"), "{text}");
        assert!(text.contains("1048576 rows, 10-40 ids a sample"), "{text}");
        assert!(text.contains("1048576 rows, 40-160 ids a sample"), "{text}");
        // Two cores: 2 workers and a server outnumber them; bytes are read, time is not ranked.
        let text = read(rows.clone(), 2);
        assert!(text.contains("moves 79.3 KB measured"), "{text}");
        assert!(text.contains("not ranked, ps-sparse k=1 (gRPC over TCP) saturated the CPU"), "{text}");
        assert!(!text.contains("ahead of"), "{text}");
        // The dense cost model's crossing and extrapolation (a push and pull of the whole
        // model) are not this model's: the sparse reading replaces them.
        let c = Collected {
            cells: Cell::all(&rows),
            summaries: rows.clone(),
            target: Some(0.7),
            ..Collected::default()
        };
        let gs = crate::charts::groups(&c);
        let machine = Machine { cores: 64, ..Machine::default() };
        let cx = Context::new(&gs[0], Some(Link { a: 10e-6, b: 1e9 }), Some(&machine), &c.summaries);
        assert!(super::super::links::extrapolated(&cx).is_empty());
        let verdict = super::super::verdict::verdict(&cx).join("\n");
        assert!(!verdict.contains("beats the ring from"), "{verdict}");
        // One repeat: figures, no ranking.
        let once: Vec<Summary> = rows.into_iter().filter(|r| r.repeat == 0).collect();
        let text = read(once, 64);
        assert!(text.contains("Not ranked: a cell measured once"), "{text}");
    }

    #[test]
    fn a_model_without_a_table_has_no_sparse_reading() {
        let r =
            Summary { widths: "64-32-10".into(), params: 2410, ..run(ModeKind::DdpTcp, 0, 1.0, None, 1.0) };
        assert_eq!(read(vec![r], 64), "");
    }
}
