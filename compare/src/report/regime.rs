//! Readings about the model: how long a step computes against how long it communicates, per
//! mode (measured, and by the cost model), which of the two bounds each mode, and, where the
//! scenario trained several models, how the ring's standing against the parameter server moves
//! with each model's share of communication.

use gradsync_worker::modes::Family;

use super::context::Context;
use crate::charts::Group;
use crate::results::Summary;
use crate::scenario::ModeKind;

/// A row's compute per step (forward and backward, measured in the run) and communication
/// (measured), in ms.
fn compute_and_comm(r: &Summary) -> Option<(f64, f64)> {
    let compute = r.forward_ms? + r.backward_ms?;
    Some((compute, r.comm_ms?)).filter(|&(c, m)| c > 0.0 && m > 0.0)
}

/// "compute-bound (communication 10% of compute)" or "communication-bound (1.3x compute)".
fn regime(compute: f64, comm: f64) -> String {
    if comm < compute {
        format!("compute-bound (communication {:.0}% of compute)", 100.0 * comm / compute)
    } else {
        format!("communication-bound ({:.1}x compute)", comm / compute)
    }
}

/// At the largest worker count: each synchronising mode's compute per step against its
/// communication, measured and modelled, and the regime that puts it in. A run whose processes
/// saturated the CPU is left out (its compute measures the crowding), and named.
pub fn compute_against_communication(cx: &Context) -> Vec<String> {
    let Some(n) = cx.most_workers().filter(|&n| n > 1) else { return Vec::new() };
    let s = cx.g.grad_bytes();
    let at_n =
        || cx.g.rows.iter().filter(|r| r.workers == n && r.slow_ms == 0 && compute_and_comm(r).is_some());
    let crowded: Vec<String> = at_n().filter(|r| cx.cpu_saturated(r)).map(|r| Group::series(r)).collect();
    let parts: Vec<String> = at_n()
        .filter(|r| !cx.cpu_saturated(r))
        .filter_map(|r| {
            let (compute, comm) = compute_and_comm(r)?;
            let model = cx
                .link
                .and_then(|l| super::links::exchange_model(cx, r, s, l))
                .map_or(String::new(), |t| format!(", {:.1} ms by the cost model", t * 1e3));
            Some(format!(
                "{} computes {compute:.1} ms and communicates {comm:.1} ms measured{model}: {}",
                Group::series(r),
                regime(compute, comm)
            ))
        })
        .collect();
    if parts.is_empty() {
        return Vec::new();
    }
    let left_out = if crowded.is_empty() {
        String::new()
    } else {
        format!(" ({} left out: they {})", crowded.join(", "), cx.saturated())
    };
    vec![format!(
        "Compute against communication per step at {n} workers ({:.1} MB of gradients in {}): {}{left_out}.",
        s / 1e6,
        cx.g.model,
        parts.join("; ")
    )]
}

/// A replayed model's group opens with what a replay is, where its compute came from, and how
/// early its backward makes the bytes ready (what the rings can hide behind backward).
pub fn replay(cx: &Context) -> Vec<String> {
    let Some(widths) = cx.g.rows.first().map(|r| r.widths.as_str()) else { return Vec::new() };
    if !cx.g.replay() {
        return Vec::new();
    }
    let what = "each layer's compute waited out as its profile says, its gradients real buffers that every \
                mode moves with its real communication. Speed only: a replay has no accuracy, so no time to \
                accuracy is read";
    let Ok(spec) = gradsync_core::model::ModelSpec::from_token(widths) else {
        return vec![format!("{} is replayed from a profile file (measured compute): {what}.", cx.g.model)];
    };
    let Some(p) = spec.profile() else { return Vec::new() };
    let (_, backward) = p.compute_ns();
    let total = p.parameters() as f64;
    let (mut done, mut at, mut half) = (0.0, 0u64, None);
    for l in &p.layers {
        at += l.backward_ns;
        done += l.tensors.iter().map(|(_, s)| s.iter().product::<usize>() as f64).sum::<f64>();
        if half.is_none() && done >= 0.5 * total {
            half = Some(at);
        }
    }
    let half = half.map_or(String::new(), |t| {
        format!(
            " Half of its {:.1} MB of gradients is ready {:.0}% of the way through backward, so at most the \
             backward time after that can hide the exchange of the rest.",
            4.0 * total / 1e6,
            100.0 * t as f64 / backward.max(1) as f64
        )
    });
    vec![format!(
        "{} is replayed, its compute {} ({}): {what}.{half}",
        cx.g.model,
        if p.estimated { "estimated from each layer's FLOPs and bytes" } else { "measured" },
        p.device
    )]
}

/// Where the model has batch norm: what each mode of the group does with its statistics, since
/// the modes differ there as PyTorch's do, and a parameter server never sees them.
pub fn batch_norm(cx: &Context) -> Vec<String> {
    let Some(widths) = cx.g.rows.first().map(|r| r.widths.as_str()) else { return Vec::new() };
    let Ok(spec) = gradsync_core::model::ModelSpec::from_token(widths) else { return Vec::new() };
    if gradsync_core::model::Layout::new(&spec).buffers_len == 0 {
        return Vec::new();
    }
    let mut modes: Vec<&str> = Vec::new();
    for r in &cx.g.rows {
        let m = match r.mode.parse::<ModeKind>().map(|m| m.compared().family) {
            Ok(Family::Local) => "local training normalises with its batch",
            Ok(Family::Dp) => {
                "DP's replicas each normalise with their share and keep replica 0's running statistics"
            }
            Ok(Family::Ps) => {
                "each parameter-server worker keeps its own running statistics (the servers hold parameters only; \
                 rank 0 evaluates with its own)"
            }
            Ok(_) => {
                "the rings broadcast rank 0's running statistics every step, each rank normalising with its own \
                      batch (DDP's broadcast_buffers)"
            }
            Err(_) => continue,
        };
        if !modes.contains(&m) {
            modes.push(m);
        }
    }
    vec![format!(
        "{} has batch norm, which the modes treat as PyTorch's do: {}. Held-out accuracy uses the running \
         statistics.",
        cx.g.model,
        modes.join("; ")
    )]
}

/// One model's standing at `n` workers, from every complete run: the ring's (ddp-tcp) median
/// throughput over the best parameter server's (ps-bsp, any shard count), and the ring's
/// median communication over its compute.
#[derive(Debug, Clone, PartialEq)]
struct Standing {
    widths: String,
    model: String,
    ring_over_ps: f64,
    comm_share: f64,
    /// The fewest runs behind either median: a direction needs two or more of each.
    runs: usize,
}

/// The median of `v`, none when it is empty.
fn median(v: Vec<f64>) -> Option<f64> {
    (!v.is_empty()).then(|| crate::table::median(&v))
}

fn standing(cx: &Context, widths: &str, link: &str, n: usize) -> Option<Standing> {
    let runs = |mode: &'static str, shards: Option<usize>| {
        cx.all.iter().filter(move |r| {
            r.status == "ok"
                && !cx.cpu_saturated(r)
                && r.widths == widths
                && r.link == link
                && r.workers == n
                && r.slow_ms == 0
                && r.mode == mode
                && shards.is_none_or(|k| r.shards == k)
        })
    };
    let ring = median(runs("ddp-tcp", None).filter_map(|r| r.samples_per_s).collect())?;
    let mut fewest = runs("ddp-tcp", None).count();
    let mut shards: Vec<usize> = runs("ps-bsp", None).map(|r| r.shards).collect();
    shards.sort_unstable();
    shards.dedup();
    let (ps, ps_runs) = shards
        .iter()
        .filter_map(|&k| {
            let v: Vec<f64> = runs("ps-bsp", Some(k)).filter_map(|r| r.samples_per_s).collect();
            Some((median(v.clone())?, v.len()))
        })
        .fold(None, |best: Option<(f64, usize)>, t| {
            Some(best.map_or(t, |b| if t.0 > b.0 { t } else { b }))
        })?;
    fewest = fewest.min(ps_runs);
    let comm_share = median(
        runs("ddp-tcp", None).filter_map(compute_and_comm).map(|(compute, comm)| comm / compute).collect(),
    )?;
    Some(Standing {
        widths: widths.to_string(),
        model: gradsync_core::model::label_of(widths),
        ring_over_ps: ring / ps.max(1e-9),
        comm_share,
        runs: fewest,
    })
}

/// Where the scenario trained more than one model: at this group's largest worker count, the
/// ring's standing against the parameter server for each model beside the ring's share of
/// communication in its step, and whether the ring's lead follows that share. Runs whose
/// saturated the CPU take no part.
pub fn across_models(cx: &Context) -> Vec<String> {
    let Some(n) = cx.most_workers().filter(|&n| n > 1) else { return Vec::new() };
    let mut models: Vec<&str> =
        cx.all.iter().filter(|r| r.link == cx.g.link).map(|r| r.widths.as_str()).collect();
    models.sort_unstable();
    models.dedup();
    if models.len() < 2 {
        return Vec::new();
    }
    let mut st: Vec<Standing> = models.iter().filter_map(|w| standing(cx, w, &cx.g.link, n)).collect();
    if st.len() < 2 {
        return Vec::new();
    }
    st.sort_by(|a, b| a.comm_share.total_cmp(&b.comm_share));
    // Said once, under the model that communicates most.
    if cx.g.rows.first().map(|r| r.widths.as_str()) != st.last().map(|s| s.widths.as_str()) {
        return Vec::new();
    }
    let listed: Vec<String> = st
        .iter()
        .map(|s| {
            // Under its compute as a share; above it as a multiple ("149x", not "14894%").
            let share = if s.comm_share < 1.0 {
                format!("{:.0}% of its compute", 100.0 * s.comm_share)
            } else {
                format!("{:.1}x its compute", s.comm_share)
            };
            format!("{} ring/PS = {:.2}, the ring communicating {share}", s.model, s.ring_over_ps)
        })
        .collect();
    let follows = st.windows(2).all(|w| w[1].ring_over_ps >= w[0].ring_over_ps);
    let against = st.windows(2).all(|w| w[1].ring_over_ps <= w[0].ring_over_ps);
    let verdict = if st.iter().any(|s| s.runs < 2) {
        "with one run behind some of these figures, no direction is read from them (run two or more repeats)"
    } else if follows {
        "the more a model communicates per unit of compute, the further the ring leads (or the less it trails)"
    } else if against {
        "the more a model communicates per unit of compute, the better the parameter server stands"
    } else {
        "the ring's standing does not follow the models' share of communication here"
    };
    let few = if st.len() == 2 { " (two models: a direction, not a trend)" } else { "" };
    vec![format!(
        "Across the models of this run at {n} workers (medians of complete runs, ranked by the ring's share of \
         communication): {}; {verdict}{few}.",
        listed.join("; ")
    )]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::charts::groups;
    use crate::results::{Cell, Collected};

    fn row(widths: &str, mode: &str, shards: usize, thr: f64, compute: f64, comm: f64) -> Summary {
        Summary {
            mode: mode.into(),
            workers: 2,
            shards,
            widths: widths.into(),
            status: "ok".into(),
            samples_per_s: Some(thr),
            forward_ms: Some(compute / 2.0),
            backward_ms: Some(compute / 2.0),
            comm_ms: Some(comm),
            ..Summary::default()
        }
    }

    #[test]
    fn the_ring_standing_is_set_against_each_models_share_of_communication() {
        let all = vec![
            row("resnet18:3x32x32-10", "ddp-tcp", 0, 41.0, 380.0, 38.0),
            row("resnet18:3x32x32-10", "ps-bsp", 1, 37.0, 360.0, 52.0),
            row("resnet18:3x32x32-10", "ps-bsp", 2, 36.0, 360.0, 42.0),
            row("vgg11:3x32x32-10", "ddp-tcp", 0, 77.0, 160.0, 92.0),
            row("vgg11:3x32x32-10", "ps-bsp", 1, 60.0, 150.0, 111.0),
        ];
        let c = Collected { cells: Cell::all(&all), summaries: all, ..Collected::default() };
        let g = &groups(&c)[0];
        let cx = Context::new(g, None, None, &c.summaries);
        let all = &cx;
        let s = standing(all, "vgg11:3x32x32-10", "", 2).expect("both modes ran");
        assert!((s.ring_over_ps - 77.0 / 60.0).abs() < 1e-9 && (s.comm_share - 92.0 / 160.0).abs() < 1e-9);
        let r = standing(all, "resnet18:3x32x32-10", "", 2).expect("both modes ran");
        assert!((r.ring_over_ps - 41.0 / 37.0).abs() < 1e-9, "the best shard count is the PS's: {r:?}");
        assert_eq!(regime(380.0, 38.0), "compute-bound (communication 10% of compute)");
        assert_eq!(regime(100.0, 130.0), "communication-bound (1.3x compute)");
        assert_eq!(standing(all, "cnn8:1x8x8-10", "", 2), None);
    }

    /// The cost model prices a run as placed: servers on the workers' hosts (`cost::ps_placed`)
    /// put the servers' traffic on the workers' NICs too, 2(n-1)/n of the gradient each way
    /// against one gradient for servers apart (`cost::ps`), so 1.5x at 4 workers.
    #[test]
    fn the_cost_model_line_prices_a_placed_run_as_placed() {
        use crate::cost::{self, Link};
        use crate::emulated::ClusterRun;
        let at = |id: &str, colocated: bool| Summary {
            id: id.into(),
            workers: 4,
            colocated,
            params: 25_557_032,
            ..row("replay:resnet50", "ps-bsp", 4, 20.0, 10.0, 120.0)
        };
        let all = vec![at("apart", false), at("colocated", true)];
        let placed = |id: &str, colocated: bool| ClusterRun {
            id: id.into(),
            mode: ModeKind::PsBsp,
            workers: 4,
            shards: 4,
            colocated,
            ranks_per_host: 1,
            hosts: if colocated { 4 } else { 8 },
            rate_gbit: 10.0,
            measured_gbit: None,
            measured_latency_us: None,
            delay_us: 0,
            loss_pct: 0.0,
            queue: crate::net::Queue::Fair,
            dilation: 1.0,
        };
        let two = ClusterRun { ranks_per_host: 2, hosts: 6, ..placed("two-a-host", false) };
        let cluster = vec![placed("apart", false), placed("colocated", true), two];
        let c = Collected { cells: Cell::all(&all), summaries: all, ..Collected::default() };
        let g = &groups(&c)[0];
        let l = Link { a: 20e-6, b: cost::gbit(10.0) };
        let s = g.grad_bytes();
        let ms = |t: f64| format!("{:.1} ms by the cost model", t * 1e3);
        let (apart, colocated) = (cost::ps(4, 4, s, l), cost::ps_placed(4, 1, 4, true, s, s, l));
        assert!((colocated / apart - 1.5).abs() < 0.01, "{colocated} against {apart}");
        for cx in [
            Context::new(g, Some(l), None, &c.summaries),
            Context::new(g, Some(l), None, &c.summaries).with_cluster(&cluster),
        ] {
            let said = compute_against_communication(&cx).join(" ");
            assert!(said.contains(&ms(apart)), "{said}");
            assert!(said.contains(&ms(colocated)), "the colocated run priced as apart: {said}");
            assert!(said.contains("communication-bound (12.0x compute)"), "{said}");
        }
        let (one_a_host, two_a_host) = (cost::ps(4, 4, s, l), cost::ps_placed(2, 2, 4, false, s, s, l));
        assert!(two_a_host > 1.5 * one_a_host, "{two_a_host} against {one_a_host}");
        // Two workers a host: the host's NIC carries both pushes (known only from the cluster's
        // record).
        let all = vec![at("two-a-host", false)];
        let c = Collected { cells: Cell::all(&all), summaries: all, ..Collected::default() };
        let g = &groups(&c)[0];
        let unplaced = compute_against_communication(&Context::new(g, Some(l), None, &c.summaries)).join(" ");
        assert!(unplaced.contains(&ms(one_a_host)), "{unplaced}");
        let placed = Context::new(g, Some(l), None, &c.summaries).with_cluster(&cluster);
        let placed = compute_against_communication(&placed).join(" ");
        assert!(placed.contains(&ms(two_a_host)) && !placed.contains(&ms(one_a_host)), "{placed}");
    }

    /// A direction across models is read only from cells that ran twice or more.
    #[test]
    fn a_direction_across_models_needs_repeats() {
        let base = [
            row("resnet18:3x32x32-10", "ddp-tcp", 0, 41.0, 380.0, 38.0),
            row("resnet18:3x32x32-10", "ps-bsp", 1, 37.0, 360.0, 52.0),
            row("vgg11:3x32x32-10", "ddp-tcp", 0, 77.0, 160.0, 92.0),
            row("vgg11:3x32x32-10", "ps-bsp", 1, 60.0, 150.0, 111.0),
        ];
        let said = |repeats: usize| {
            let all: Vec<Summary> = (0..repeats)
                .flat_map(|k| {
                    base.iter().map(move |r| Summary {
                        id: format!("{}-{}-r{k}", r.widths, r.mode),
                        model: r.widths.split(':').next().unwrap_or_default().into(),
                        repeat: k,
                        ..r.clone()
                    })
                })
                .collect();
            let c = Collected { cells: Cell::all(&all), summaries: all, ..Collected::default() };
            groups(&c)
                .iter()
                .flat_map(|g| across_models(&Context::new(g, None, None, &c.summaries)))
                .collect::<Vec<_>>()
        };
        let once = said(1);
        assert!(once.len() == 1 && once[0].contains("no direction is read from them"), "{once:?}");
        let twice = said(2);
        assert!(twice.len() == 1 && twice[0].contains("the further the ring leads"), "{twice:?}");
        // vgg11's ring communicates 92 ms of 160: a share; resnet18's 38 of 380: a share too.
        assert!(
            twice[0].contains("57% of its compute") && twice[0].contains("10% of its compute"),
            "{twice:?}"
        );
    }

    /// A replayed VGG-16's ring once read "communicating 45505% of its compute": above its
    /// compute, communication is said as a multiple.
    #[test]
    fn communication_above_compute_reads_as_a_multiple() {
        let all: Vec<Summary> = (0..2)
            .flat_map(|k| {
                [
                    row("resnet18:3x32x32-10", "ddp-tcp", 0, 41.0, 10.0, 1489.0),
                    row("resnet18:3x32x32-10", "ps-bsp", 1, 48.0, 10.0, 925.0),
                    row("vgg11:3x32x32-10", "ddp-tcp", 0, 36.0, 15.8, 7169.0),
                    row("vgg11:3x32x32-10", "ps-bsp", 1, 45.0, 15.8, 4899.0),
                ]
                .into_iter()
                .map(move |r| Summary {
                    id: format!("{}-{}-r{k}", r.widths, r.mode),
                    model: r.widths.split(':').next().unwrap_or_default().into(),
                    repeat: k,
                    ..r
                })
            })
            .collect();
        let c = Collected { cells: Cell::all(&all), summaries: all, ..Collected::default() };
        let said: Vec<String> = groups(&c)
            .iter()
            .flat_map(|g| across_models(&Context::new(g, None, None, &c.summaries)))
            .collect();
        assert!(said.len() == 1, "{said:?}");
        assert!(said[0].contains("148.9x its compute") && said[0].contains("453.7x its compute"), "{said:?}");
        assert!(!said[0].contains('%'), "{said:?}");
    }

    /// On 2 cores a parameter server's 2 workers and its server crowd the machine: its runs
    /// are named and left out of the regime reading, and no cross-model standing rests on them.
    #[test]
    fn runs_that_outnumbered_the_cores_are_left_out_and_named() {
        let all = vec![
            row("vgg11:3x32x32-10", "ddp-tcp", 0, 77.0, 160.0, 92.0),
            row("vgg11:3x32x32-10", "ps-bsp", 1, 60.0, 150.0, 111.0),
        ];
        let c = Collected { cells: Cell::all(&all), summaries: all, ..Collected::default() };
        let g = &groups(&c)[0];
        let small = crate::machine::Machine { cores: 2, ..Default::default() };
        let cx = Context::new(g, None, Some(&small), &c.summaries);
        let said = compute_against_communication(&cx);
        assert!(
            said.len() == 1
                && said[0]
                    .contains("ddp-tcp (TCP sockets) computes 160.0 ms and communicates 92.0 ms measured")
                && !said[0].contains("ps-bsp k=1 (gRPC over TCP) computes")
                && said[0]
                    .contains("(ps-bsp k=1 (gRPC over TCP) left out: they saturated the CPU (more processes"),
            "{said:?}"
        );
        assert_eq!(standing(&cx, "vgg11:3x32x32-10", "", 2), None);
    }

    /// A replay's processes sleep through their compute: more of them than cores saturates
    /// nothing, while cores kept over 80% busy (by its communication) do, whatever the count.
    /// Its group opens by saying what a replay is and how early its bytes are ready.
    #[test]
    fn a_replay_is_saturated_by_busy_cores_not_by_process_count() {
        let vgg = gradsync_core::model::ModelSpec::parse("vgg16").unwrap().widths_str();
        let rows = |busy: f64| {
            vec![
                Summary { cpu_busy: Some(busy), ..row(&vgg, "ddp-tcp", 0, 77.0, 16.0, 92.0) },
                Summary { cpu_busy: Some(busy), ..row(&vgg, "ps-bsp", 1, 60.0, 16.0, 111.0) },
            ]
        };
        let small = crate::machine::Machine { cores: 2, ..Default::default() };
        for (busy, saturated) in [(0.5, false), (0.9, true)] {
            let all = rows(busy);
            let c = Collected { cells: Cell::all(&all), summaries: all, ..Collected::default() };
            let g = &groups(&c)[0];
            let cx = Context::new(g, None, Some(&small), &c.summaries);
            assert!(g.rows.iter().all(|r| cx.cpu_saturated(r) == saturated), "busy {busy}");
            let said = replay(&cx).join(" ");
            assert!(
                said.contains("vgg16 (replay) is replayed, its compute estimated from each layer's FLOPs")
                    && said.contains("Speed only")
                    && said.contains(
                        "Half of its 553.4 MB of gradients is ready 1% of the way through backward"
                    ),
                "{said}"
            );
        }
    }

    /// A dilated run is paced: processes may outnumber the cores. It is left unranked only
    /// where the cores were over 80% busy, its compute overran the factor by more than 5%, or
    /// its rate's check at twice the factor differed.
    #[test]
    fn a_dilated_run_is_saturated_by_busy_cores_overrun_or_a_failed_check_not_by_process_count() {
        let small = crate::machine::Machine { cores: 2, ..Default::default() };
        let dilated = |busy: f64, overrun: f64, too_small: bool| {
            // Four workers and a shard on two cores: saturated, were it not dilated.
            let r = Summary {
                workers: 4,
                shards: 1,
                cpu_busy: Some(busy),
                dilation: Some(8.0),
                overrun_share: Some(overrun),
                dilation_too_small: too_small,
                ..row("64-64-10", "ps-bsp", 0, 70.0, 16.0, 90.0)
            };
            let all = vec![r];
            let c = Collected { cells: Cell::all(&all), summaries: all, ..Collected::default() };
            let g = &groups(&c)[0];
            let cx = Context::new(g, None, Some(&small), &c.summaries);
            // A dilated group says why in its own words, which name no process count.
            assert_eq!(cx.saturation_reason(), super::super::context::SATURATED_DILATED);
            cx.cpu_saturated(g.rows[0])
        };
        assert!(!dilated(0.3, 0.01, false), "a dilated run is not saturated by its process count");
        assert!(dilated(0.85, 0.01, false), "cores over 80% busy");
        assert!(dilated(0.3, 0.08, false), "compute overran the factor");
        assert!(dilated(0.3, 0.0, true), "the check at twice the factor differed");
    }

    #[test]
    fn batch_norm_is_named_only_for_a_model_that_has_it() {
        let said = |rows: Vec<Summary>| {
            let c = Collected { cells: Cell::all(&rows), summaries: rows, ..Collected::default() };
            let g = &groups(&c)[0];
            batch_norm(&Context::new(g, None, None, &c.summaries))
        };
        let conv = said(vec![
            row("cnn8:1x8x8-10", "ps-bsp", 1, 1.0, 1.0, 1.0),
            row("cnn8:1x8x8-10", "ddp-tcp", 0, 1.0, 1.0, 1.0),
        ]);
        assert!(
            conv.len() == 1
                && conv[0].contains("keeps its own running statistics")
                && conv[0].contains("broadcast_buffers"),
            "{conv:?}"
        );
        assert!(said(vec![row("64-1024-10", "ps-bsp", 1, 1.0, 1.0, 1.0)]).is_empty());
    }
}
