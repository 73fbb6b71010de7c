//! Runs on emulated links (`gradsync-bench cluster`): the link each group's cost model is
//! fitted to, the measured step and communication beside the model's prediction, and the
//! parameter server against the ring with BytePS's claim checked, each over complete repeats.

use super::page::ClusterView;
use super::tables::{Grid, Td, Tr};
use crate::charts::Group;
use crate::cost::{self, Link};
use crate::emulated::{ClusterRun, DilationRecord};
use crate::results::{Cell, Summary, overlap};
use crate::scenario::ModeKind;

/// The emulated link of a group's runs for the cost model: the medians of the runs' measured
/// bandwidth and latency; `None` where some run measured no latency and no delay was added,
/// since nothing then gives the latency the model needs.
pub fn group_link(g: &Group, cluster: &[ClusterRun]) -> Option<Link> {
    let runs: Vec<&ClusterRun> =
        cluster.iter().filter(|r| g.cells.iter().any(|c| c.runs.contains(&r.id))).collect();
    let latency_known = runs.iter().all(|r| r.measured_latency_us.is_some() || r.delay_us > 0);
    if runs.is_empty() || !latency_known {
        return None;
    }
    let median = |f: fn(Link) -> f64| {
        crate::results::median(&runs.iter().map(|r| f(cluster_link(r))).collect::<Vec<_>>())
    };
    Some(Link { a: median(|l| l.a)?, b: median(|l| l.b)? })
}

/// A cluster run's link for the cost model: the latency and bandwidth measured between two of
/// its hosts (for runs that did not measure them, the two shaped hops' added delay and the
/// shaped rate).
fn cluster_link(r: &ClusterRun) -> Link {
    let a = r.measured_latency_us.map_or(2.0 * r.delay_us as f64, |us| us) * 1e-6;
    Link { a, b: cost::gbit(r.measured_gbit.unwrap_or(r.rate_gbit)) }
}

/// The gradient exchange the cost model predicts for a cluster run's link, seconds. Ranks
/// sharing a host (`ranks_per_host`) share its link; among themselves they meet over the
/// host's loopback, which the cluster does not shape, so ddp-hier's step inside each host is
/// priced at nothing (dilated, it shrinks by D with the CPU work that sets it).
pub fn cluster_prediction(r: &ClusterRun, params: usize) -> Option<f64> {
    placed_prediction(r, 4.0 * params as f64, cluster_link(r))
}

/// [`cluster_prediction`] for `s` bytes of gradients on link `l`.
pub(crate) fn placed_prediction(r: &ClusterRun, s: f64, l: Link) -> Option<f64> {
    let m = r.ranks_per_host.max(1);
    let hosts = r.workers.div_ceil(m);
    if r.mode.is_compressed() {
        // The model prices f32 gradients only.
        None
    } else if r.mode.is_ps() {
        Some(cost::ps_placed(hosts, m, r.shards.max(1), r.colocated, s, s, l))
    } else if r.mode == ModeKind::Zero1Tcp {
        Some(cost::zero1(r.workers, s, l))
    } else if r.mode.is_ring() {
        Some(cost::flat_across_hosts(hosts, m, s, l))
    } else if r.mode.compared().through_hosts() {
        let loopback = Link { a: 0.0, b: f64::INFINITY };
        Some(cost::hierarchical(hosts, m, s, l, loopback))
    } else {
        None
    }
}

/// The advisor's step for a cluster run ([`crate::advise::predict`], `advise`'s per-bucket
/// timeline): the built-in profile its replay names, with forward and backward as the run
/// measured them, on the run's hosts, ranks a host and link as measured. None for a model
/// trained for real or replayed from a file, for a compressed mode (its codecs would be priced
/// at this machine's rates, not the run's), and for one worker.
pub fn advisor_step_ms(r: &ClusterRun, s: &Summary) -> Option<f64> {
    advisor_prediction_ms(r, s, true)
}

/// [`advisor_step_ms`], with the run's measured compute (`measured_compute`) or the profile's
/// own (what `advise` predicts before anything runs).
pub fn advisor_prediction_ms(r: &ClusterRun, s: &Summary, measured_compute: bool) -> Option<f64> {
    use crate::advise::{codec::CodecRates, config::Config, predict, spec::ClusterSpec};
    let name = s.widths.strip_prefix(gradsync_core::model::REPLAY_TOKEN)?.split(':').next()?;
    let profile = gradsync_core::profile::builtin(name, gradsync_core::profile::DeviceRate::H100)?;
    if r.mode.is_compressed() {
        return None;
    }
    let mut w = predict::Workload::new(&profile, s.batch).ok()?;
    if measured_compute {
        w = w.timed_as(s.forward_ms? / 1e3, s.backward_ms? / 1e3);
    }
    let m = r.ranks_per_host.max(1);
    let c = ClusterSpec::emulated(r.workers.div_ceil(m), m, cluster_link(r)).ok()?;
    let cfg = Config::of_mode(
        r.mode,
        s.bucket_mb.unwrap_or(gradsync_worker::cli::flag::DEFAULT_BUCKET_MB),
        false,
        (r.shards, r.colocated),
        0.01,
    )?;
    Some(predict::predict(&w, &c, &cfg, &CodecRates::free()).ok()?.step_s * 1e3)
}

/// How far a measured PS-to-ring communication ratio may sit from BytePS's prediction for the
/// claim to count as reproduced.
const BYTEPS_TOLERANCE: f64 = 0.15;

/// BytePS's claim (OSDI'20) checked against a measurement: with one server shard per worker a
/// parameter server communicates in n / (2(n-1)) of the ring's time, since each worker's link
/// carries S each way instead of the ring's 2(n-1)/n S.
pub fn byteps_claim(n: usize, rate_gbit: f64, measured: f64) -> String {
    let predicted = n as f64 / (2.0 * (n as f64 - 1.0));
    let off = measured / predicted - 1.0;
    format!(
        "BytePS's claim at {rate_gbit} Gbit/s, {n} workers, {n} shards each on its own host: a parameter server \
         communicates in n/(2(n-1)) = {predicted:.2} x the ring's time; measured {measured:.2} x ({:+.0}% off). \
         The claim {} here (tolerance {:.0}%).",
        100.0 * off,
        if off.abs() <= BYTEPS_TOLERANCE { "holds" } else { "does not hold" },
        100.0 * BYTEPS_TOLERANCE
    )
}

fn opt(v: Option<f64>, digits: usize) -> String {
    v.map(|x| format!("{x:.digits$}")).unwrap_or_else(|| "-".into())
}

/// Runs on emulated links: measured step and communication beside the model's prediction, per
/// link rate, and the PS-to-ring ratio measured and predicted; none without such runs.
pub fn section(runs: &[ClusterRun], all: &[Summary], dilations: &[DilationRecord]) -> Option<ClusterView> {
    if runs.is_empty() {
        return None;
    }
    let words = |t: &str| Td { text: t.into(), left: true };
    let figures = |t: &str| Td { text: t.into(), left: false };
    let head = vec![
        words("link"),
        words("mode"),
        figures("workers"),
        figures("shards"),
        words("status"),
        figures("step ms"),
        figures("advisor's step ms (predicted)"),
        figures("communication ms"),
        figures("model ms"),
        figures("model ms, push then pull"),
        figures("communication / model"),
        figures("CPU s per GB"),
        figures("one core keeps up with, Gbit/s"),
    ];
    let rows = runs
        .iter()
        .filter_map(|r| {
            let s = all.iter().find(|s| s.id == r.id)?;
            let pred = cluster_prediction(r, s.params).map(|t| t * 1e3);
            // A PS that pulls only after its whole push pays the busiest link twice.
            let seq = pred.filter(|_| r.mode.is_ps()).map(|p| 2.0 * p - 2e3 * cluster_link(r).a);
            // The worker's BSP step pulls the next version block by block while it pushes, so a
            // PS run is held to the pipelined model; push-then-pull stays beside it for reference.
            let ratio = s.comm_ms.zip(pred).map(|(m, p)| m / p);
            let per_gb = cpu_per_gb(s);
            let link = format!(
                "{} Gbit/s{}, {} us delay{}, {}% loss, NIC queue {}{}",
                r.rate_gbit,
                r.measured_gbit.map(|g| format!(" ({g:.3} measured)")).unwrap_or_default(),
                r.delay_us,
                r.measured_latency_us
                    .map(|us| format!(" ({us:.0} us one way, measured)"))
                    .unwrap_or_default(),
                r.loss_pct,
                r.queue.label(),
                if r.dilation > 1.0 { format!(", dilated x{}", r.dilation) } else { String::new() },
            );
            Some(Tr {
                class: s.status.clone(),
                cells: vec![
                    words(&link),
                    words(&if r.colocated {
                        format!("{} (servers colocated)", r.mode.label())
                    } else {
                        r.mode.label().to_string()
                    }),
                    figures(&if r.ranks_per_host > 1 {
                        format!("{} ({} a host)", r.workers, r.ranks_per_host)
                    } else {
                        r.workers.to_string()
                    }),
                    figures(&r.shards.to_string()),
                    words(&s.status),
                    figures(&opt(s.step_ms, 1)),
                    figures(&opt(advisor_step_ms(r, s), 1)),
                    figures(&opt(s.comm_ms, 1)),
                    figures(&opt(pred, 1)),
                    figures(&opt(seq, 1)),
                    figures(&opt(ratio, 2)),
                    figures(&opt(per_gb, 2)),
                    figures(&opt(per_gb.map(core_keeps_up_gbit), 1)),
                ],
            })
        })
        .collect();
    let table = Grid {
        title: "Each run on its emulated link".into(),
        caption: "Each host a network namespace (a worker's ranks, and a colocated shard, sharing it), every \
                  host's link shaped with tc in both directions; the model's latency is half the round trip of a small message, its bandwidth what one \
                  plain TCP stream carried, both between two hosts of the run's cluster, measured just before the \
                  run (where they were not measured, the two hops' added delay and the shaped rate)."
            .into(),
        head,
        rows,
    };
    let mut readings = dilation_readings(dilations);
    readings.extend(ps_against_ring(runs, all));
    Some(ClusterView { table, readings })
}

/// The CPU seconds a run's processes spent on communication per GB of its workers' traffic
/// (what each sent and received, summed over the workers), servers' CPU included, start-up
/// included: the per-byte CPU work a dilated world shrinks by its factor. A replayed model's
/// processes compute nothing, so all their CPU counts; a dilated run trained for real has its
/// recorded compute (its thread CPU time, which pacing made it last) taken off; an undilated run
/// trained for real, whose recorded compute is wall time, has no figure.
pub fn cpu_per_gb(s: &Summary) -> Option<f64> {
    let traffic = s.bytes_per_step_worker? * s.workers as f64 * s.steps as f64;
    let compute_s = if s.widths.starts_with(gradsync_core::model::REPLAY_TOKEN) {
        0.0
    } else if s.dilation.is_some() {
        let per_step = s.forward_ms? + s.backward_ms? + s.update_ms.unwrap_or(0.0);
        per_step * s.workers as f64 * s.steps as f64 / 1e3
    } else {
        return None;
    };
    let cpu = s.cpu_s? - compute_s;
    (traffic > 0.0 && cpu > 0.0).then(|| cpu / (traffic / 1e9))
}

/// The worker traffic one core keeps up with at `per_gb` CPU seconds per GB, Gbit/s: past it a
/// real host's own CPU, not its link, would bound it, which a dilated emulation does not show.
pub fn core_keeps_up_gbit(per_gb: f64) -> f64 {
    8.0 / per_gb
}

/// What a dilated cluster says of its dilation, a line per link rate: the factor, how `auto`
/// chose it, and the self-check at twice it.
fn dilation_readings(dilations: &[DilationRecord]) -> Vec<String> {
    dilations
        .iter()
        .map(|d| {
            let how = match &d.probe {
                None => "as given".to_string(),
                Some(p) => format!(
                    "picked by auto: probed at x{}, the busiest probe ({}) kept the cores {:.0}% busy{}",
                    p.at,
                    p.busiest,
                    p.busy * 100.0,
                    if p.capped { "; held at the cap, which leaves them busier than half" } else { "" }
                ),
            };
            // The checked run's own factor and its repetition's.
            let again = |c: &crate::emulated::Check| c.at.unwrap_or(2.0 * d.dilation);
            let check = match &d.check {
                None => " No run finished to check the factor against.".to_string(),
                Some(c) => match (c.step_ms, c.step_ms_2x, c.diff_pct()) {
                    (Some(a), Some(b), Some(p)) => format!(
                        " Self-check: {} again at x{}: a step of {b:.1} ms against {a:.1} ms ({p:+.1}%){}",
                        c.id,
                        again(c),
                        match (c.differs, c.push_overlap) {
                            (true, Some((x, y))) if c.phase_changed() => format!(
                                ": more than 5% apart, and not for the cores: its asynchronous workers fell into \
                                 another phase, their pushes overlapping at the server {:.0}% of the time at x{} \
                                 and {:.0}% at x{} (an asynchronous step on a shared server link is set by that \
                                 phase, which timing decides and a repetition may find otherwise at any factor). \
                                 With no synchronous run here to vouch for the factor, this rate's runs are not \
                                 ranked.",
                                x * 100.0,
                                again(c) / 2.0,
                                y * 100.0,
                                again(c)
                            ),
                            (true, _) => ": more than 5% apart, so the factor was too small for the cores and this \
                                 rate's runs are not ranked (run again with a larger --dilate)."
                                .to_string(),
                            (false, _) => ": within 5%.".to_string(),
                        }
                    ),
                    _ => format!(
                        " Self-check: {} again at x{} did not finish, so nothing vouches for the factor: this \
                         rate's runs are not ranked.",
                        c.id,
                        again(c)
                    ),
                },
            };
            // Designs at factors of their own: each measures the same link, at a factor that
            // keeps the cores about as busy as the others' keeps them.
            let own = if d.designs.is_empty() {
                String::new()
            } else {
                format!(
                    "; {} at factors of their own",
                    d.designs.iter().map(|(n, f)| format!("{n} x{f}")).collect::<Vec<_>>().join(", ")
                )
            };
            format!(
                "At {} Gbit/s the runs ran dilated x{} ({how}{own}): links at rate / the factor, every clock that \
                 many times slower, figures divided back.{check} Dilation shrinks per-byte CPU work by the factor \
                 too: the table's CPU seconds per GB say where a real host's CPU, not its link, would be the limit.",
                d.rate_gbit, d.dilation
            )
        })
        .collect()
}

/// The cluster's readings: on each link and at each worker count, every PS-BSP cell against the
/// ring's (DDP-TCP), each the median over its complete repeats; the step ratio beside the
/// model's, and BytePS's claim where there is a shard per worker. A cell with fewer than two
/// complete repeats is listed with its figures, never compared.
fn ps_against_ring(runs: &[ClusterRun], all: &[Summary]) -> Vec<String> {
    let mine: Vec<Summary> = all.iter().filter(|s| runs.iter().any(|r| r.id == s.id)).cloned().collect();
    let cells = Cell::all(&mine);
    let run_of = |id: &str| runs.iter().find(|r| r.id == id);
    // `f` of each of a cell's complete repeats (with its cluster record).
    let over = |c: &Cell, f: &dyn Fn(&ClusterRun, &Summary) -> Option<f64>| -> Vec<f64> {
        c.runs
            .iter()
            .filter_map(|id| Some((run_of(id)?, mine.iter().find(|s| &s.id == id)?)))
            .filter_map(|(r, s)| f(r, s))
            .collect()
    };
    let mut out = Vec::new();
    for ps in cells.iter().filter(|c| c.median.mode == ModeKind::PsBsp.label()) {
        let m = &ps.median;
        let Some(ring) = cells.iter().find(|c| {
            let r = &c.median;
            r.mode == ModeKind::DdpTcp.label()
                && (r.link.as_str(), r.workers, &r.model, r.global_batch, r.slow_ms)
                    == (m.link.as_str(), m.workers, &m.model, m.global_batch, m.slow_ms)
        }) else {
            continue;
        };
        let (Some(ps_t), Some(ring_t)) = (m.step_ms, ring.median.step_ms) else { continue };
        let head = format!("At {} with {} workers", m.link, m.workers);
        let (p, q) = (ps.runs.len(), ring.runs.len());
        if p < 2 || q < 2 {
            out.push(format!(
                "{head}: a PS-BSP step ({} shard(s)) {ps_t:.1} ms ({p} of {} repeats complete), a ring step \
                 {ring_t:.1} ms ({q} of {}). Not compared: a cell with fewer than two complete repeats has \
                 no spread to set a difference against (run `gradsync-bench cluster --repeats 3`).",
                m.shards, ps.attempts, ring.attempts
            ));
            continue;
        }
        let step = |c: &Cell| crate::table::spread(&over(c, &|_, s| s.step_ms)).map(|(_, lo, hi)| (lo, hi));
        let (Some(a), Some(b)) = (step(ps), step(ring)) else { continue };
        let predicted = |c: &Cell| crate::results::median(&over(c, &|r, s| cluster_prediction(r, s.params)));
        let model = match (predicted(ps), predicted(ring)) {
            (Some(x), Some(y)) => format!(
                "; the model (push and pull pipelined) predicts {:.2} x for the gradient exchange alone",
                x / y
            ),
            _ => String::new(),
        };
        let level = if overlap(a, b) {
            "; the repeats' ranges overlap, so the two are level within their spread"
        } else {
            ""
        };
        out.push(format!(
            "{head}, a PS-BSP step ({} shard(s)) takes {:.2} x a ring step (medians of {p} and {q} complete \
             repeats: {:.1}-{:.1} against {:.1}-{:.1} ms){level}{model}.",
            m.shards,
            ps_t / ring_t,
            a.0,
            a.1,
            b.0,
            b.1
        ));
        let first = ps.runs.first().and_then(|id| run_of(id));
        if let (Some(pc), Some(rc), Some(r)) = (m.comm_ms, ring.median.comm_ms, first)
            && m.shards == m.workers
            && !m.colocated
            && m.workers > 1
            && r.ranks_per_host == 1
        {
            out.push(byteps_claim(m.workers, r.rate_gbit, pc / rc));
        }
    }
    out
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod cluster_tests {
    use super::*;

    /// The advisor's line beside a replayed run: compute as the run measured it, the exchange
    /// over the link as measured. ResNet-50's 102.2 MB over a ring of 2 at 1 Gbit/s (0.125
    /// GB/s, 30 us): 2 x 1/2 x 102.2e6 / 0.125e9 = 818 ms of exchange, beside 30 ms of
    /// backward, so the step is forward + about the exchange; 8x slower a link, 8x the exchange.
    #[test]
    fn the_advisor_predicts_a_replayed_cluster_run_from_its_own_compute_and_link() {
        let (mut r, mut s) = run(ModeKind::DdpTcp, 0, "ok", 900.0);
        (r.rate_gbit, r.measured_gbit) = (1.0, Some(1.0));
        let p =
            gradsync_core::profile::builtin("resnet50", gradsync_core::profile::DeviceRate::H100).unwrap();
        let spec = gradsync_core::model::ModelSpec::replay(p.clone());
        (s.widths, s.batch, s.params) = (spec.widths_str(), p.batch, p.parameters());
        (s.forward_ms, s.backward_ms, s.bucket_mb) = (Some(10.0), Some(30.0), Some(25.0));
        let step = advisor_step_ms(&r, &s).unwrap();
        let exchange = 2.0 * 0.5 * 4.0 * p.parameters() as f64 / 0.125e9 * 1e3;
        assert!(
            step > 10.0 + exchange && step < 10.0 + 30.0 + exchange + 5.0,
            "{step} ms against {exchange} ms of exchange"
        );
        r.measured_gbit = Some(0.125);
        let slow = advisor_step_ms(&r, &s).unwrap();
        assert!(((slow - 10.0) / (step - 10.0) - 8.0).abs() < 0.3, "{slow} against {step}");
        // A model trained for real, a compressed mode: no line.
        let mut real = s.clone();
        real.widths = "784-256-10".into();
        assert_eq!(advisor_step_ms(&r, &real), None);
        r.mode = ModeKind::DdpTcpFp16;
        assert_eq!(advisor_step_ms(&r, &s), None);
    }

    /// A run on a 10 Gbit/s link: its cluster record and its summary.
    fn run(mode: ModeKind, repeat: usize, status: &str, step_ms: f64) -> (ClusterRun, Summary) {
        let id = format!("runs/{}-r{repeat}", mode.label());
        let shards = usize::from(mode.is_ps());
        let c = ClusterRun {
            id: id.clone(),
            mode,
            workers: 2,
            shards,
            colocated: false,
            ranks_per_host: 1,
            hosts: 2 + shards,
            rate_gbit: 10.0,
            measured_gbit: Some(9.0),
            measured_latency_us: Some(30.0),
            delay_us: 0,
            loss_pct: 0.0,
            queue: crate::net::Queue::Fair,
            dilation: 1.0,
        };
        let s = Summary {
            id,
            mode: mode.label().into(),
            workers: 2,
            shards,
            model: "mnist".into(),
            global_batch: 128,
            link: c.label(),
            params: 1_000_000,
            step_ms: Some(step_ms),
            comm_ms: Some(step_ms / 2.0),
            status: status.into(),
            repeat,
            ..Summary::default()
        };
        (c, s)
    }

    fn reading(runs: &[(ClusterRun, Summary)]) -> Vec<String> {
        let (c, s): (Vec<ClusterRun>, Vec<Summary>) = runs.iter().cloned().unzip();
        ps_against_ring(&c, &s)
    }

    /// The PS-to-ring ratio is the medians' over complete repeats (not the first run of each),
    /// with the ranges beside it; a failed repeat counts for neither.
    #[test]
    fn the_ps_to_ring_ratio_is_taken_over_complete_repeats() {
        let runs = [
            run(ModeKind::PsBsp, 0, "ok", 20.0),
            run(ModeKind::PsBsp, 1, "ok", 22.0),
            run(ModeKind::PsBsp, 2, "failed", 90.0),
            run(ModeKind::DdpTcp, 0, "ok", 10.0),
            run(ModeKind::DdpTcp, 1, "ok", 14.0),
        ];
        let r = reading(&runs);
        assert_eq!(r.len(), 1, "{r:?}");
        assert!(
            r[0].contains("takes 1.75 x a ring step (medians of 2 and 2 complete repeats: 20.0-22.0 against 10.0-14.0 ms)"),
            "{r:?}"
        );
        assert!(!r[0].contains("level"), "{r:?}");
    }

    /// With one complete repeat a cell is listed with its figures and not compared; ranges that
    /// overlap are called level.
    #[test]
    fn cells_run_once_are_not_compared_and_overlaps_are_level() {
        let once = [run(ModeKind::PsBsp, 0, "ok", 20.0), run(ModeKind::DdpTcp, 0, "ok", 10.0)];
        let r = reading(&once);
        assert!(r[0].contains("Not compared") && !r[0].contains(" x a ring step"), "{r:?}");
        let close = [
            run(ModeKind::PsBsp, 0, "ok", 11.0),
            run(ModeKind::PsBsp, 1, "ok", 13.0),
            run(ModeKind::DdpTcp, 0, "ok", 10.0),
            run(ModeKind::DdpTcp, 1, "ok", 12.0),
        ];
        let r = reading(&close);
        assert!(r[0].contains("level within their spread"), "{r:?}");
    }

    /// Each dilated rate says its factor, how it was chosen and its self-check; a check that
    /// differed or did not finish says the rate is not ranked.
    #[test]
    fn a_dilated_rate_says_its_factor_and_its_check() {
        use crate::emulated::{Check, Probe};
        let check = |a: Option<f64>, b: Option<f64>, differs: bool| Check {
            id: "runs/x".into(),
            at: None,
            again: "checks/runs/y".into(),
            step_ms: a,
            step_ms_2x: b,
            differs,
            push_overlap: None,
        };
        let rec = |probe: Option<Probe>, check: Option<Check>| DilationRecord {
            rate_gbit: 10.0,
            dilation: 8.0,
            designs: Default::default(),
            probe,
            check,
        };
        let said = dilation_readings(&[rec(None, Some(check(Some(100.0), Some(103.0), false)))]);
        assert!(said[0].starts_with("At 10 Gbit/s the runs ran dilated x8 (as given)"), "{said:?}");
        assert!(
            said[0].contains("again at x16: a step of 103.0 ms against 100.0 ms (+3.0%): within 5%"),
            "{said:?}"
        );
        let probe = Probe { at: 4.0, busy: 0.9, busiest: "runs/probe".into(), chose: 8.0, capped: false };
        let said = dilation_readings(&[rec(Some(probe), Some(check(Some(100.0), Some(110.0), true)))]);
        assert!(said[0].contains(
            "picked by auto: probed at x4, the busiest probe (runs/probe) kept the cores 90% busy"
        ));
        assert!(
            said[0].contains("(+10.0%): more than 5% apart") && said[0].contains("not ranked"),
            "{said:?}"
        );
        let said = dilation_readings(&[rec(None, Some(check(Some(100.0), None, true)))]);
        assert!(said[0].contains("did not finish") && said[0].contains("not ranked"), "{said:?}");
        // An asynchronous check whose workers found another phase says so, not "too small";
        // one in the same phase that differs is the cores' after all.
        let phased =
            |x: f64, y: f64| Check { push_overlap: Some((x, y)), ..check(Some(75.9), Some(146.2), true) };
        let said = dilation_readings(&[rec(None, Some(phased(0.02, 0.97)))]);
        assert!(
            said[0].contains("not for the cores: its asynchronous workers fell into another phase")
                && said[0].contains("overlapping at the server 2% of the time at x8 and 97% at x16")
                && said[0].contains("not ranked")
                && !said[0].contains("too small"),
            "{said:?}"
        );
        let said = dilation_readings(&[rec(None, Some(phased(0.90, 0.97)))]);
        assert!(said[0].contains("the factor was too small"), "{said:?}");
        // A design at a factor of its own is named with it, and a check of one of its runs
        // says the factor it ran again at, twice that run's own.
        let own = DilationRecord {
            designs: [("ddp-tcp".to_string(), 4.0)].into(),
            ..rec(None, Some(Check { at: Some(8.0), ..check(Some(100.0), Some(101.0), false) }))
        };
        let said = dilation_readings(&[own]);
        assert!(
            said[0].starts_with(
                "At 10 Gbit/s the runs ran dilated x8 (as given; ddp-tcp x4 at factors of their own)"
            ),
            "{said:?}"
        );
        assert!(said[0].contains("again at x8: a step of 101.0 ms"), "{said:?}");
    }

    #[test]
    fn cpu_per_gb_is_the_runs_communication_cpu_over_its_workers_traffic() {
        let s = Summary {
            workers: 2,
            steps: 10,
            widths: format!("{}resnet50", gradsync_core::model::REPLAY_TOKEN),
            bytes_per_step_worker: Some(50e6),
            cpu_s: Some(2.0),
            forward_ms: Some(20.0),
            backward_ms: Some(30.0),
            ..Summary::default()
        };
        // A replay: 2 workers x 10 steps x 50 MB = 1 GB for 2 CPU seconds: one core keeps up
        // with 4 Gbit/s.
        assert_eq!(cpu_per_gb(&s), Some(2.0));
        assert_eq!(core_keeps_up_gbit(2.0), 4.0);
        assert_eq!(cpu_per_gb(&Summary { cpu_s: None, ..s.clone() }), None);
        // Trained for real and dilated: its compute, 2 x 10 x 50 ms = 1 s, is not communication.
        let real = Summary { widths: "64-1024-10".into(), dilation: Some(4.0), ..s.clone() };
        assert_eq!(cpu_per_gb(&real), Some(1.0));
        // Trained for real, undilated: its recorded compute is wall time, not CPU: no figure.
        assert_eq!(cpu_per_gb(&Summary { dilation: None, ..real }), None);
    }
}
