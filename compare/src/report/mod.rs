//! `report.html`: one self-contained page (SVGs inlined, no scripts, no external files), read
//! top down: a verdict card per group (the pick at each worker count, its margin against the
//! repeats' spread, its reason, how sure; or, where the machine was too small, that first, with
//! the commands that would decide), then one table of every mode at every worker count, the
//! charts, the readings folded under their findings, and the tables that go into detail.
//! Nothing in it depends on when or where it was rendered.
//!
//! Here: what the page is made of, in order. Below it: `card` (the verdict card, over
//! `verdict`'s judgement), `reading` (the list of readings: `ranking`, `links`, `regime`,
//! `sparse`, `runs`), all over `context` (what every reading reads from), computed from the
//! figures and refusing to read failed, diverged or partial runs; `tables` and `cluster` (the
//! tables, and the runs on emulated links); `page` (the page as data, rendered through
//! `templates/report.html`, which escapes every value), over `text` (its words: text with code
//! stretches, a reading's finding).

use std::path::{Path, PathBuf};

use anyhow::Context as _;

use super::charts::{Charts, Group, groups};
use super::cost::Link;
use super::emulated::ClusterRun;
use super::machine::Machine;
use super::results::Collected;

mod card;
pub(crate) mod cluster;
pub(crate) mod context;
pub(crate) mod links;
mod page;
mod ranking;
mod reading;
mod regime;
mod runs;
mod sparse;
mod tables;
mod text;
mod verdict;

pub use cluster::{byteps_claim, cluster_prediction};
pub use reading::reading;
pub use runs::straggler_reading;

use page::{Figure, MachineView, Page, Section};
use text::{Finding, Text};

/// The link the model is fitted to, when the run directory measured one.
pub fn link_of(m: Option<&Machine>) -> Option<Link> {
    let m = m?;
    (m.tcp_bandwidth > 0.0 && m.tcp_latency_s > 0.0)
        .then_some(Link { a: m.tcp_latency_s, b: m.tcp_bandwidth })
}

/// Draw the charts and write the report into `out`; returns its path.
pub fn write(
    c: &Collected,
    machine: Option<&Machine>,
    scenario: Option<&str>,
    cluster: &[ClusterRun],
    out: &Path,
) -> anyhow::Result<PathBuf> {
    let link = link_of(machine);
    let mut charts = Charts::new(out)?;
    let mut gs = groups(c);
    if gs.is_empty() {
        // No run produced figures: the charts still exist, each saying so.
        gs.push(Group {
            suffix: String::new(),
            model: "no data".into(),
            global_batch: 0,
            link: String::new(),
            params: 0,
            rows: vec![],
            runs: vec![],
            sweep: vec![],
            cells: vec![],
            target: c.target,
        });
    }
    let (mut cards, mut sections) = (Vec::new(), Vec::new());
    for g in &gs {
        // The cost model's link: the machine's loopback, or the group's emulated link.
        let link = if g.link.is_empty() { link } else { cluster::group_link(g, cluster) };
        // The card says once why runs are left unranked; the readings name the cause.
        let cx =
            context::Context::new(g, link, machine, &c.summaries).with_cluster(cluster).reasons_said_once();
        cards.push(card::card(&cx));
        charts.draw_group(g, link)?;
        let figures = charts
            .charts
            .iter()
            .filter(|ch| ch.name.ends_with(&g.suffix))
            .map(|ch| Figure {
                name: ch.name.clone(),
                title: ch.title.clone(),
                svg: ch.svg.find("<svg").map_or(ch.svg.as_str(), |i| &ch.svg[i..]).to_string(),
            })
            .collect();
        let tables = [
            tables::convergence(g),
            Some(tables::efficiency(g)),
            tables::extrapolation(g, link),
            tables::designs(g, link),
        ];
        sections.push(Section {
            heading: (gs.len() > 1).then(|| format!("{} at global batch {}", g.model, g.global_batch)),
            results: tables::results(&cx),
            figures,
            readings: reading::paragraphs(&cx).iter().map(|p| Finding::of(p)).collect(),
            tables: tables.into_iter().flatten().collect(),
        });
    }
    let page = Page {
        title: "gradsync: local, DP, parameter server and ring all-reduce compared".into(),
        cards,
        sections,
        machine: machine.map(|m| machine_view(m, !cluster.is_empty())),
        cluster: cluster::section(cluster, &c.summaries, &c.dilations),
        runs: tables::every_run(&c.summaries),
        warnings: c.warnings.clone(),
        scenario: scenario.map(str::to_string),
    };
    let path = out.join("report.html");
    let html = page::render(&page).context("rendering report.html")?;
    std::fs::write(&path, html).with_context(|| format!("writing {}", path.display()))?;
    Ok(path)
}

/// The machine, and the wire its runs crossed: loopback, the hosts' network, or (`emulated`)
/// the cluster's links.
fn machine_view(m: &Machine, emulated: bool) -> MachineView {
    let same = if emulated {
        "each process on a host of its own, every link emulated (the emulated cluster's table names each run's \
         link), the same links for both"
    } else if !m.hosts.is_empty() {
        "the same network between the hosts below"
    } else {
        "the same loopback wire"
    };
    MachineView {
        rows: tables::machine_rows(m),
        wires: Text::from(
            format!(
                "Wires: the parameter server speaks gRPC over TCP and `ddp-tcp` rings over TCP sockets, {same}, so \
                 those two compare directly; `ddp-shm` rings over shared memory and `dp` inside one process, \
                 neither a network."
            )
            .as_str(),
        ),
        hosts_said: tables::hosts_said(m),
        hosts: tables::hosts(m),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::results::{Cell, Summary};

    /// On hosts, the machine table has a row per kind of host with its count and names (not
    /// the machine the comparison started from, nor the hosts' cores summed into one), and a
    /// one-node allocation's link is named as loopback.
    #[test]
    fn the_machine_table_has_a_row_per_kind_of_host() {
        let host = |name: &str, cpu: &str, cores| crate::site::HostFacts {
            name: name.into(),
            cpu: cpu.into(),
            cores,
            memory_bytes: 16 << 30,
            ..Default::default()
        };
        let m = Machine {
            host: "login1".into(),
            cpu: "Login CPU".into(),
            cores: 40,
            hosts: vec![host("n1", "EPYC 9654", 16), host("n2", "EPYC 9654", 16), host("g1", "Xeon 8480", 8)],
            link: Some("n1 to n2".into()),
            launcher: Some("Slurm".into()),
            ..Machine::default()
        };
        // The machine's rows, a heading and a value each, and what is said of the hosts.
        let said = |m: &Machine| {
            let v = machine_view(m, false);
            let rows: Vec<String> = v.rows.iter().map(|(h, d)| format!("{h} | {d}")).collect();
            format!("{}\n{}", rows.join("\n"), v.hosts_said.unwrap_or_default())
        };
        let h = said(&m);
        assert!(h.contains("2 x | EPYC 9654, 16 logical cores, 16.0 GiB, GPU: none (n1, n2)"), "{h}");
        assert!(h.contains("1 x | Xeon 8480, 8 logical cores"), "{h}");
        assert!(h.contains("started from | login1"), "{h}");
        assert!(!h.contains("Login CPU") && !h.contains("40 logical cores"), "{h}");
        assert!(
            h.contains("raw host-to-host (n1 to n2) TCP") && h.contains("as job steps of a Slurm allocation"),
            "{h}"
        );
        let one = Machine {
            hosts: vec![host("n1", "EPYC 9654", 16)],
            link: Some("loopback (one node: n1)".into()),
            ..m
        };
        let h = said(&one);
        assert!(
            h.contains("raw loopback (one node: n1) TCP") && h.contains("on the one host's loopback"),
            "{h}"
        );
    }

    fn row(mode: &str, slow_ms: u64, samples_per_s: f64) -> Summary {
        Summary {
            id: format!("{mode}-{slow_ms}"),
            mode: mode.into(),
            workers: 4,
            shards: usize::from(mode.starts_with("ps")),
            model: "mnist".into(),
            global_batch: 128,
            samples_per_s: Some(samples_per_s),
            slow_ms,
            status: "ok".into(),
            ..Summary::default()
        }
    }

    fn collected(rows: Vec<Summary>) -> Collected {
        Collected { cells: Cell::all(&rows), summaries: rows, ..Collected::default() }
    }

    #[test]
    fn straggler_reading_measures_the_share_of_the_delay_paid() {
        // Undelayed: 1000 samples/s, 128 ms per global step. BSP pays the whole 100 ms
        // (228 ms per step); ASP pays 10 ms of it.
        let rows = [
            row("ps-bsp", 0, 1000.0),
            row("ps-bsp", 100, 128.0 / 0.228),
            row("ps-asp", 0, 1000.0),
            row("ps-asp", 100, 128.0 / 0.138),
            row("ddp-tcp", 0, 1000.0),
        ];
        // Each cell twice: what ranking the modes needs.
        let twice = |r: &Summary| {
            (0..2)
                .map(|k| Summary { id: format!("{}-r{k}", r.id), repeat: k, ..r.clone() })
                .collect::<Vec<_>>()
        };
        let c = collected(rows.iter().flat_map(twice).collect());
        let g = &crate::charts::groups(&c)[0];
        assert_eq!(g.rows.len(), 3, "the other charts see only the undelayed runs");
        let s = g.slowdowns();
        assert_eq!(s.len(), 2, "ddp-tcp has no delayed run: {s:?}");
        let text = straggler_reading(g).join("\n");
        assert!(
            text.contains(
                "ps-bsp k=1 (gRPC over TCP) (4 workers): with one rank 100 ms slower per step, a global step takes 1.78x"
            ),
            "{text}"
        );
        assert!(text.contains("pays 100% of the injected delay"), "{text}");
        assert!(text.contains("pays 10% of the injected delay"), "{text}");
        assert!(text.contains("ps-asp k=1 (gRPC over TCP) (4 workers) absorbs the straggler best"), "{text}");
        assert!(text.contains("80% or more paid): ps-bsp k=1 (gRPC over TCP) (4 workers)."), "{text}");
        // Each cell once: the shares are read, the modes not ranked.
        let c = collected(rows.to_vec());
        let text = straggler_reading(&crate::charts::groups(&c)[0]).join("\n");
        assert!(text.contains("pays 10% of the injected delay"), "{text}");
        assert!(!text.contains("absorbs the straggler best ("), "{text}");
        assert!(text.contains("Which mode absorbs the straggler best: Not ranked"), "{text}");
    }

    fn rep_row(mode: &str, repeat: usize, status: &str, thr: f64, tt: Option<f64>) -> Summary {
        Summary {
            id: format!("runs/{mode}-r{repeat}"),
            repeat,
            status: status.into(),
            time_to_target_s: tt,
            samples_to_target: tt.map(|t| (t * thr) as u64),
            epochs_to_target: tt.map(|_| 3.0),
            ..row(mode, 0, thr)
        }
    }

    #[test]
    fn a_ring_fit_that_cannot_separate_latency_says_so_instead_of_a_zero() {
        let ring = |workers: usize, comm_ms: f64| Summary {
            workers,
            params: 1_000_000,
            comm_ms: Some(comm_ms),
            ..row("ddp-tcp", 0, 1000.0)
        };
        let link = Some(Link { a: 5e-6, b: 2e9 });
        // Exactly a = -100 us, B = 1 GB/s: no latency the data can support.
        let c = collected(vec![ring(2, 3.8), ring(4, 5.4)]);
        let text = reading(&crate::charts::groups(&c)[0], link, None, &c.summaries).join("\n");
        assert!(
            text.contains("do not separate a per-message latency") && !text.contains("a = 0.0 us"),
            "{text}"
        );
        // a = 20 us, B = 1 GB/s: both fitted.
        let c = collected(vec![ring(2, 4.04), ring(4, 6.12)]);
        let text = reading(&crate::charts::groups(&c)[0], link, None, &c.summaries).join("\n");
        assert!(text.contains("a = 20.0 us per message"), "{text}");
    }

    #[test]
    fn the_staleness_reading_says_the_asynchronous_workers_phase() {
        let asp = |id: &str, repeat: usize, overlap: Option<f64>| Summary {
            id: id.into(),
            repeat,
            workers: 2,
            staleness_mean: Some(1.0),
            staleness_max: Some(1),
            push_overlap: overlap,
            ..row("ps-asp", 0, 800.0)
        };
        let c = collected(vec![asp("a", 0, Some(0.97)), asp("b", 1, Some(0.97))]);
        let text = reading(&crate::charts::groups(&c)[0], None, None, &c.summaries).join("\n");
        assert!(
            text.contains(
                "beside another rank's 97% of the time (in phase: each push shared the server's link)"
            ) && text.contains("a repeat may find the other"),
            "{text}"
        );
        let c = collected(vec![asp("a", 0, Some(0.02)), asp("b", 1, Some(0.02))]);
        let text = reading(&crate::charts::groups(&c)[0], None, None, &c.summaries).join("\n");
        assert!(text.contains("2% of the time (taking turns: one pushing while another pulled)"), "{text}");
        // Repeats in different phases are said each, not as a median no run had.
        let c = collected(vec![asp("a", 0, Some(0.64)), asp("b", 1, Some(0.04))]);
        let text = reading(&crate::charts::groups(&c)[0], None, None, &c.summaries).join("\n");
        assert!(text.contains("another rank's 64%, 4% of the time: they found different phases"), "{text}");
        // An older server recorded no arrivals: staleness alone, no word of phases.
        let c = collected(vec![asp("a", 0, None), asp("b", 1, None)]);
        let text = reading(&crate::charts::groups(&c)[0], None, None, &c.summaries).join("\n");
        assert!(text.contains("mean 1.00, max 1.") && !text.contains("phase"), "{text}");
    }

    /// "All processes share one machine" is the undilated world's caveat; a dilated group's
    /// processes had the cores' time dilated away, and its report must not say otherwise.
    #[test]
    fn contention_is_said_of_undilated_runs_only() {
        let m = Machine { cores: 2, ..Machine::default() };
        let eight = |dilation: Option<f64>, repeat: usize| Summary {
            id: format!("r{repeat}"),
            repeat,
            workers: 8,
            dilation,
            ..row("ddp-tcp", 0, 1000.0)
        };
        let c = collected(vec![eight(None, 0), eight(None, 1)]);
        let text = reading(&crate::charts::groups(&c)[0], None, Some(&m), &c.summaries).join("\n");
        assert!(text.contains("All processes share one machine with 2 logical cores"), "{text}");
        let c = collected(vec![eight(Some(23.0), 0), eight(Some(23.0), 1)]);
        let text = reading(&crate::charts::groups(&c)[0], None, Some(&m), &c.summaries).join("\n");
        assert!(!text.contains("share one machine"), "{text}");
    }

    #[test]
    fn the_byteps_claim_is_judged_within_its_tolerance() {
        assert!(
            byteps_claim(4, 1.0, 0.70)
                .contains("0.67 x the ring's time; measured 0.70 x (+5% off). The claim holds")
        );
        assert!(byteps_claim(4, 1.0, 0.90).contains("does not hold"));
        assert!(byteps_claim(4, 1.0, 0.50).contains("does not hold"));
    }

    #[test]
    fn readings_rank_medians_call_overlaps_level_and_ignore_runs_that_did_not_complete() {
        let rows = vec![
            // ddp-tcp: 1000-1100; ps-bsp 1050-1300 (overlapping: level); dp clearly slower.
            rep_row("ddp-tcp", 0, "ok", 1000.0, Some(4.0)),
            rep_row("ddp-tcp", 1, "ok", 1100.0, Some(4.2)),
            rep_row("ddp-tcp", 2, "ok", 1050.0, Some(4.1)),
            rep_row("ps-bsp", 0, "ok", 1300.0, Some(3.0)),
            rep_row("ps-bsp", 1, "ok", 1050.0, Some(3.1)),
            rep_row("ps-bsp", 2, "ok", 1200.0, Some(3.2)),
            rep_row("dp", 0, "ok", 500.0, None),
            // Far faster, but interrupted, diverged or failed: never a reading.
            rep_row("ps-asp", 0, "interrupted", 90000.0, Some(0.1)),
            rep_row("ps-ssp", 0, "diverged", 80000.0, None),
            Summary { error: "rank0: gradsync-worker: error: diverged at step 35: the loss is NaN; lower the learning rate (--lr 0.05)".into(), ..rep_row("ps-ssp", 1, "diverged", 1.0, None) },
            rep_row("ddp-shm", 0, "failed", 70000.0, Some(0.1)),
        ];
        let c = collected(rows);
        let mut gs = crate::charts::groups(&c);
        let g = gs.remove(0);
        let g = Group { target: Some(0.97), ..g };
        let text = reading(&g, None, None, &c.summaries).join("\n");
        assert!(text.contains("the fastest are level"), "{text}");
        assert!(text.contains("ps-bsp k=1 (gRPC over TCP) 1200 (median of 3, 1050-1300)"), "{text}");
        for never in ["ps-asp", "90000", "80000", "70000"] {
            let readings: Vec<&str> =
                text.lines().filter(|l| !l.contains("diverged") && !l.contains("did not run")).collect();
            assert!(
                readings.iter().all(|l| !l.contains(never)),
                "{never} read from a run that did not complete:\n{text}"
            );
        }
        assert!(
            text.contains("ps-bsp k=1 (gRPC over TCP) reaches 97.0% held-out accuracy first, in 3.10 s"),
            "{text}"
        );
        assert!(text.contains("Not reached in most repeats: dp"), "{text}");
        assert!(text.contains("2 runs diverged (ps-ssp w4, ps-ssp w4 at step 35)"), "{text}");
        assert!(text.contains("lower the learning rate"), "{text}");
        assert!(text.contains("1 run(s) did not run to their end"), "{text}");
    }

    /// A cell that ran once is listed, never ranked: not as fastest, not as first to the
    /// target, not in the ring-against-PS verdict, not against DDP; beside cells with repeats
    /// it is set apart, however fast it was.
    #[test]
    fn cells_that_ran_once_are_listed_not_ranked() {
        let with_step = |mode: &str, repeat: usize, thr: f64, tt: f64| Summary {
            step_ms: Some(1e5 / thr),
            ..rep_row(mode, repeat, "ok", thr, Some(tt))
        };
        let once = vec![
            with_step("ddp-tcp", 0, 1000.0, 4.0),
            with_step("ps-bsp", 0, 800.0, 3.0),
            with_step("zero1-tcp", 0, 900.0, 5.0),
        ];
        let c = collected(once);
        let g = Group { target: Some(0.97), ..crate::charts::groups(&c).remove(0) };
        let text = reading(&g, None, None, &c.summaries).join("\n");
        for ranked in
            ["is fastest", "are level", "first, in", "is ahead", "faster than DDP", "slower than DDP"]
        {
            assert!(!text.contains(ranked), "'{ranked}' from single runs:\n{text}");
        }
        assert!(text.contains("At 4 workers, in samples/s: ddp-tcp"), "{text}");
        assert!(text.contains("ps-bsp k=1 (gRPC over TCP) 800 (one run)"), "{text}");
        assert!(text.contains("time to 97.0% held-out accuracy: ps-bsp"), "{text}");
        assert!(text.matches("Not ranked: a cell measured once").count() >= 3, "{text}");
        assert!(text.contains("not ranked (one run"), "{text}");

        // Repeated cells are ranked; a faster cell that ran once stands apart.
        let mut rows: Vec<Summary> = (0..3)
            .flat_map(|r| {
                [
                    with_step("ddp-tcp", r, 1000.0 + r as f64, 4.0),
                    with_step("ps-bsp", r, 800.0 + r as f64, 3.0),
                ]
            })
            .collect();
        rows.push(with_step("dp", 0, 5000.0, 1.0));
        let c = collected(rows);
        let g = Group { target: Some(0.97), ..crate::charts::groups(&c).remove(0) };
        let text = reading(&g, None, None, &c.summaries).join("\n");
        assert!(text.contains("At 4 workers: ddp-tcp (TCP sockets) is fastest"), "{text}");
        assert!(
            text.contains("Ran once, not ranked: dp (in one process) 5000 samples/s (one run)."),
            "{text}"
        );
        assert!(text.contains("ps-bsp k=1 (gRPC over TCP) reaches 97.0% held-out accuracy first"), "{text}");
        assert!(text.contains("Ran once, not ranked: dp (in one process) 1.00 s (one run)."), "{text}");
    }

    /// Without a one-worker run the efficiency table says there is no baseline, rather than
    /// describing bracketed ratios against a baseline of "-".
    #[test]
    fn the_efficiency_table_names_a_missing_baseline() {
        // The caption, then every cell in brackets.
        let said = |c: &Collected| {
            let t = tables::efficiency(&crate::charts::groups(c)[0]);
            let cells: String =
                t.rows.iter().flat_map(|r| &r.cells).map(|c| format!("[{}]", c.text)).collect();
            format!("{}\n{cells}", t.caption)
        };
        let c = collected(vec![row("ddp-tcp", 0, 1000.0), row("ps-bsp", 0, 800.0)]);
        let h = said(&c);
        assert!(h.contains("No one-worker run completed") && !h.contains("baseline at -"), "{h}");
        assert!(h.contains("[1000]"), "{h}");
        let one = Summary { workers: 1, ..row("local", 0, 300.0) };
        let h = said(&collected(vec![row("ddp-tcp", 0, 1000.0), one]));
        assert!(h.contains("baseline at 300 samples/s") && h.contains("1000 (83%)"), "{h}");
    }

    /// The bytes chart's model lines are drawn at every worker count up to the largest, so a
    /// run of one worker count still shows them (a dashed line of one point draws nothing).
    #[test]
    fn the_bytes_model_shows_with_one_worker_count() {
        let with = |mode: &str| Summary { params: 1_000_000, ..row(mode, 0, 1000.0) };
        let c = collected(vec![with("ddp-tcp"), with("ps-bsp")]);
        let g = &crate::charts::groups(&c)[0];
        let dir = gradsync_testkit::Scratch::new("bytes-chart");
        let mut charts = crate::charts::Charts::new(&dir).unwrap();
        charts.draw_group(g, None).unwrap();
        let svg = &charts.charts.iter().find(|c| c.name.starts_with("bytes")).unwrap().svg;
        // "PS, per worker (theory)" in ps-bsp's colour: its legend swatch and its dashes.
        let ps = "stroke=\"#2CA02C\"";
        assert!(svg.matches(ps).count() >= 2, "{} strokes of {ps}", svg.matches(ps).count());
    }

    #[test]
    fn compressed_modes_are_read_against_the_mode_they_compress() {
        let with = |mode: &str, sent: f64, acc: f64, tt: Option<f64>| Summary {
            bytes_sent_per_step_worker: Some(sent),
            final_accuracy: Some(acc),
            ..rep_row(mode, 0, "ok", 1000.0, tt)
        };
        let rows = vec![
            with("ps-bsp", 4.0e6, 0.975, Some(3.0)),
            with("ps-bsp-topk", 8.0e4, 0.972, Some(3.5)),
            with("ddp-tcp", 4.0e6, 0.975, Some(2.0)),
            with("ddp-tcp-topk", 1.6e5, 0.95, None),
        ];
        let c = collected(rows);
        let g = Group { target: Some(0.97), ..crate::charts::groups(&c).remove(0) };
        let text = reading(&g, None, None, &c.summaries).join("\n");
        assert!(
            text.contains(
                "ps-bsp-topk at 4 workers sends 0.080 MB per step per worker against ps-bsp's 4.000 (50.0x fewer); \
                 final held-out accuracy 97.2% against 97.5% (-0.3 points); time to 97% 3.5 s against 3.0 s."
            ),
            "{text}"
        );
        assert!(
            text.contains("ddp-tcp-topk at 4 workers")
                && text.contains("time to 97% not reached against 2.0 s"),
            "{text}"
        );
        // Runs without a target (no evaluation) reached nothing and missed nothing: no time.
        let g = Group { target: None, ..g };
        let text = reading(&g, None, None, &c.summaries).join("\n");
        assert!(text.contains("(-0.3 points).") && !text.contains("time to"), "{text}");
    }

    /// The ring is set against the best uncompressed PS: a faster compressed PS is read against
    /// ps-bsp, not named as the ring's rival.
    #[test]
    fn the_ring_is_read_against_the_uncompressed_parameter_server() {
        let rows = vec![
            rep_row("ddp-tcp", 0, "ok", 1000.0, None),
            rep_row("ps-bsp", 0, "ok", 800.0, None),
            rep_row("ps-bsp-fp16", 0, "ok", 1500.0, None),
        ];
        let c = collected(rows);
        let g = crate::charts::groups(&c).remove(0);
        let text = reading(&g, None, None, &c.summaries).join("\n");
        assert!(text.contains("ring/PS = 1.25 (vs ps-bsp k=1"), "{text}");
    }

    /// Runs on different emulated links are never repeats of one another, nor rows of one
    /// group: each link gets its own group, named in its titles, so no reading ranks a mode on
    /// one link against a mode on another.
    #[test]
    fn runs_on_different_links_are_read_apart() {
        let on = |mode: &str, link: &str, thr: f64| Summary {
            id: format!("runs/{mode}-{link}"),
            link: link.into(),
            ..rep_row(mode, 0, "ok", thr, None)
        };
        let rows = vec![
            on("ddp-tcp", "1 Gbit/s", 900.0),
            on("ddp-tcp", "0.1 Gbit/s", 100.0),
            on("ps-bsp", "1 Gbit/s", 800.0),
            on("ps-bsp", "0.1 Gbit/s", 50.0),
        ];
        let c = collected(rows);
        assert_eq!(c.cells.len(), 4, "a cell per mode and link: {:?}", c.cells);
        let gs = crate::charts::groups(&c);
        assert_eq!(gs.len(), 2);
        for g in &gs {
            assert!(g.model.ends_with(&format!("on emulated links of {}", g.link)), "{}", g.model);
            assert!(g.rows.iter().all(|r| r.link == g.link) && g.rows.len() == 2, "{:?}", g.rows);
            assert!(!g.suffix.is_empty() && g.suffix.ends_with("gbits"), "{}", g.suffix);
            let text = reading(g, None, None, &c.summaries).join("\n");
            let (fast, slow) = if g.link == "1 Gbit/s" { ("900", "800") } else { ("100", "50") };
            assert!(text.contains(fast) && text.contains(slow), "{}: {text}", g.link);
        }
    }

    /// A cell of `mode` at `workers`, repeat `repeat`, with throughput `thr`.
    fn cell_row(mode: &str, workers: usize, repeat: usize, thr: f64) -> Summary {
        Summary { id: format!("runs/{mode}-w{workers}-r{repeat}"), workers, repeat, ..row(mode, 0, thr) }
    }

    /// Every "N% of" in `text`, as N.
    fn shares_of(text: &str) -> Vec<f64> {
        text.match_indices("% of")
            .filter_map(|(i, _)| {
                let head = &text[..i];
                let start = head.rfind(|c: char| !(c.is_ascii_digit() || c == '.')).map_or(0, |j| j + 1);
                head[start..].parse().ok()
            })
            .collect()
    }

    /// The figures of a 16-core machine's report that once read "the busiest parameter-server
    /// shard moves 5.75 GB/s, 123% of the raw TCP link" and "ps-bsp k=1 reaches 114% of what
    /// the raw link allows" against one TCP stream of 4.67 GB/s: read against as many streams
    /// as the modes keep busy, and with only one stream measured, no share of a limit passes
    /// 100%.
    #[test]
    fn no_reading_puts_a_figure_above_its_limit() {
        // S = 7.1875 MB; 4 workers, one shard: the shard moves 2nS = 57.5 MB a step at 100
        // steps/s; the alpha-beta model at one stream gives 6.196 ms, measured 5.435 ms.
        let params = 1_796_875;
        let ps = |r: usize| Summary {
            params,
            bytes_per_step_server: Some(5.75e7),
            comm_ms: Some(5.435),
            ..cell_row("ps-bsp", 4, r, 12_800.0 + r as f64)
        };
        let ring = |r: usize| Summary {
            params,
            comm_ms: Some(2.0),
            ..cell_row("ddp-tcp", 4, r, 9_000.0 + r as f64)
        };
        let c = collected((0..3).flat_map(|r| [ps(r), ring(r)]).collect());
        let g = &crate::charts::groups(&c)[0];
        let one = Machine { cores: 16, tcp_bandwidth: 4.67e9, tcp_latency_s: 20e-6, ..Machine::default() };
        let text = reading(g, link_of(Some(&one)), Some(&one), &c.summaries).join("\n");
        assert!(text.contains("moves 5.75 GB/s in and out, 1.23x what one raw TCP stream carries"), "{text}");
        assert!(text.contains("the implementation reaches 1.14x what one raw TCP stream carries"), "{text}");
        assert!(shares_of(&text).iter().all(|&p| p <= 100.0), "{:?}\n{text}", shares_of(&text));

        let streams = |n: usize, gbs: f64| crate::machine::Parallel {
            streams: n,
            yardstick: crate::rawtcp::Yardstick { samples: vec![gbs * 1e9] },
        };
        let many = Machine { tcp_parallel: vec![streams(4, 12.0), streams(8, 20.0)], ..one };
        let text = reading(g, link_of(Some(&many)), Some(&many), &c.summaries).join("\n");
        assert!(
            text.contains("5.75 GB/s in and out, 29% of what 8 raw TCP streams at once carry (20.00 GB/s)"),
            "{text}"
        );
        // 57.5 MB over 8 streams at 20 GB/s, plus 2a: 2.915 ms of the 5.435 measured.
        assert!(
            text.contains("ps-bsp k=1 (gRPC over TCP) at 4 workers: 5.43 ms")
                && text.contains("take 2.92 ms"),
            "{text}"
        );
        assert!(text.contains("54% of what 8 raw TCP streams at once carry"), "{text}");
        assert!(shares_of(&text).iter().all(|&p| p <= 100.0), "{:?}\n{text}", shares_of(&text));
    }

    /// Two workers sharing what one worker does 17x faster, computing for a tenth of the step:
    /// the reading names fixed per-step costs with the figures; with compute most of the step
    /// it says nothing.
    #[test]
    fn fixed_per_step_costs_are_named_when_compute_is_a_small_share() {
        let local = Summary { workers: 1, ..row("local", 0, 343_404.0) };
        let two = |fwd: f64| Summary {
            workers: 2,
            step_ms: Some(6.2),
            forward_ms: Some(fwd),
            backward_ms: Some(0.4),
            update_ms: Some(0.1),
            ..row("ddp-tcp", 0, 20_624.0)
        };
        let c = collected(vec![local.clone(), two(0.2)]);
        let g = &crate::charts::groups(&c)[0];
        let text = runs::fixed_costs(&context::Context::new(g, None, None, &c.summaries)).join("\n");
        assert!(text.contains("Fixed per-step costs decide the speed"), "{text}");
        assert!(
            text.contains(
                "computes (forward, backward and update, measured) for 0.70 ms of its 6.20 ms step (11%)"
            ),
            "{text}"
        );
        assert!(
            text.contains(
                "One worker alone runs 343404 samples/s against 20624 here (3% scaling efficiency)"
            ),
            "{text}"
        );
        let c = collected(vec![local.clone(), two(5.0)]);
        let g = &crate::charts::groups(&c)[0];
        assert!(runs::fixed_costs(&context::Context::new(g, None, None, &c.summaries)).is_empty());
        // A replayed VGG-16's step was once read so: 16.7 ms of compute in a 101 ms step, whose
        // rest was exposed communication, not fixed costs.
        let exposed = Summary { comm_exposed_ms: Some(5.0), ..two(0.2) };
        let c = collected(vec![local, exposed]);
        let g = &crate::charts::groups(&c)[0];
        assert!(runs::fixed_costs(&context::Context::new(g, None, None, &c.summaries)).is_empty());
    }

    fn verdict_of(rows: Vec<Summary>, m: Option<&Machine>) -> Vec<String> {
        let c = collected(rows);
        let g = &crate::charts::groups(&c)[0];
        let v = verdict::verdict(&context::Context::new(g, Some(Link { a: 20e-6, b: 4e9 }), m, &c.summaries));
        assert!(!v.is_empty() && v.len() <= 3, "{v:?}");
        v
    }

    #[test]
    fn the_verdict_names_the_hosts_a_comparison_ran_on() {
        let rows: Vec<Summary> = (0..3).map(|r| cell_row("ddp-tcp", 4, r, 1000.0 + r as f64)).collect();
        assert!(verdict_of(rows.clone(), None)[0].contains("on this machine's loopback"));
        let host = |n: &str| crate::site::HostFacts { name: n.into(), ..Default::default() };
        let m = Machine {
            hosts: vec![host("node0"), host("node1")],
            link: Some("node0 to node1".into()),
            ..Machine::default()
        };
        let v = verdict_of(rows.clone(), Some(&m));
        assert!(v[0].contains("on 2 hosts (the link measured from node0 to node1)"), "{v:?}");
        // A Slurm allocation of one node: its loopback, said once, and no "1 hosts".
        let one =
            Machine { hosts: vec![host("node0")], link: Some("loopback (one node: node0)".into()), ..m };
        let v = verdict_of(rows, Some(&one));
        assert!(v[0].contains("on one host, node0 (the link measured on its loopback)"), "{v:?}");
    }

    #[test]
    fn the_verdict_picks_a_clear_winner() {
        let rows = (0..3).flat_map(|r| {
            [cell_row("ddp-tcp", 4, r, 1000.0 + r as f64), cell_row("ps-bsp", 4, r, 800.0 + r as f64)]
        });
        let v = verdict_of(rows.collect(), None);
        assert!(
            v[0].contains(
                "pick ddp-tcp (TCP sockets): at 4 workers it runs 1001 samples/s (median of 3, 1000-1002)"
            ),
            "{v:?}"
        );
        assert!(v[0].contains("next: ps-bsp k=1 (gRPC over TCP)"), "{v:?}");
        assert!(
            v[1].starts_with(
                "By the cost model, a parameter server with a shard per worker beats the ring from"
            ),
            "{v:?}"
        );
        assert!(v[2].starts_with("Sure as far as 3 complete repeats per cell at 4 workers go"), "{v:?}");
        // One mode alone is picked as what it is, the only one measured; a time to the target
        // below a second reads in milliseconds.
        let rows = (0..2).map(|r| Summary {
            time_to_target_s: Some(0.004 + 0.001 * r as f64),
            ..cell_row("local", 1, r, 5000.0)
        });
        let c = collected(rows.collect());
        let g = crate::charts::Group { target: Some(0.6), ..crate::charts::groups(&c).remove(0) };
        let v = verdict::verdict(&context::Context::new(&g, None, None, &c.summaries));
        assert!(
            v[0].contains("pick local: at 1 worker it reaches 60.0% held-out accuracy in 4.5 ms (median of 2, 4.0 ms to 5.0 ms), the only mode measured there"),
            "{v:?}"
        );
    }

    #[test]
    fn the_verdict_calls_overlapping_modes_level() {
        let rows = (0..3).flat_map(|r| {
            [cell_row("ddp-tcp", 4, r, 1000.0 + 10.0 * r as f64), cell_row("ps-bsp", 4, r, 1015.0 + r as f64)]
        });
        let v = verdict_of(rows.collect(), None);
        assert!(v[0].contains("no single pick: at 4 workers") && v[0].contains("are level"), "{v:?}");
        // Each mode's figure follows its name, one bracket deep.
        assert!(v[0].contains("(TCP sockets), which runs") && v[0].contains("; and "), "{v:?}");
        assert!(!v[0].contains(") ("), "brackets in brackets: {v:?}");
        assert!(!v.join(" ").contains(" pick ps-bsp") && !v.join(" ").contains(" pick ddp-tcp"), "{v:?}");
        // Ran once: no pick at all.
        let v = verdict_of(vec![cell_row("ddp-tcp", 4, 0, 1000.0), cell_row("ps-bsp", 4, 0, 500.0)], None);
        assert!(v[0].contains("no pick: at 4 workers a cell that could decide ran once"), "{v:?}");
        // Nothing complete: nothing concluded.
        let c = collected(vec![Summary { status: "diverged".into(), ..cell_row("ddp-tcp", 4, 0, 9e9) }]);
        let one = collected(vec![cell_row("dp", 4, 0, 1.0)]);
        let none = crate::charts::Group { rows: vec![], ..crate::charts::groups(&one).remove(0) };
        let v = verdict::verdict(&context::Context::new(&none, None, None, &c.summaries));
        assert_eq!(
            v,
            ["No pick: no run completed, so there is nothing to compare (the table below says why)."]
        );
    }

    /// On emulated links, with the parameter server's processes (2 workers and a server)
    /// outnumbering 2 cores: the verdict names the links once, and says why the ring is the
    /// only mode left to pick rather than calling it the only one measured.
    #[test]
    fn an_emulated_verdict_names_its_links_once_and_why_a_mode_stood_alone() {
        let rows: Vec<Summary> =
            (0..2)
                .flat_map(|r| {
                    let r_ = r as f64;
                    [cell_row("ps-bsp", 2, r, 14.0 + r_), cell_row("ddp-tcp", 2, r, 28.0 + r_)].map(|s| {
                        Summary { link: "1gbits".into(), shards: if s.mode == "ps-bsp" { 1 } else { 0 }, ..s }
                    })
                })
                .collect();
        let small = Machine { cores: 2, ..Machine::default() };
        let v = verdict_of(rows, Some(&small));
        assert_eq!(v[0].matches("emulated links of").count(), 1, "{v:?}");
        assert!(
            v[0].contains("pick ddp-tcp (TCP sockets)")
                && v[0].contains(&format!(
                    "; ps-bsp k=1 (gRPC over TCP) {}, so it is the only mode left there.",
                    context::SATURATED
                )),
            "{v:?}"
        );
        assert!(v[2].contains("and 2 run(s) that saturated the CPU (more processes than cores"), "{v:?}");
    }

    /// Runs that saturated the CPU (more processes than cores) rank nothing in the readings
    /// either: the fastest mode, the ring against the PS, the scaling and the time to the
    /// target leave them out and say why, as the verdict does (the readings once ranked them:
    /// "ddp-shm fastest, 2.70x the next", "the ring ahead at every worker count").
    #[test]
    fn readings_rank_no_run_that_saturated_the_cpu() {
        let rows: Vec<Summary> = (0..2)
            .flat_map(|r| {
                let r_ = r as f64;
                let tt = |t: f64| Some(t + r_);
                [
                    Summary { time_to_target_s: tt(9.0), ..cell_row("ps-bsp", 2, r, 900.0 + r_) },
                    Summary { time_to_target_s: tt(5.0), ..cell_row("ddp-tcp", 2, r, 700.0 + r_) },
                    Summary { time_to_target_s: tt(8.0), ..cell_row("ps-bsp", 4, r, 1000.0 + r_) },
                    Summary { time_to_target_s: tt(3.0), ..cell_row("ddp-tcp", 4, r, 2000.0 + r_) },
                    Summary { time_to_target_s: tt(12.0), ..cell_row("local", 1, r, 500.0 + r_) },
                ]
            })
            .map(|s| Summary { samples_to_target: s.time_to_target_s.map(|t| t as u64 * 100), ..s })
            .collect();
        let c = Collected { cells: Cell::all(&rows), summaries: rows, ..Collected::default() };
        let mut g = crate::charts::groups(&c).remove(0);
        g.target = Some(0.9);
        let link = Some(Link { a: 20e-6, b: 4e9 });
        let read = |m: Option<&Machine>| {
            let cx = context::Context::new(&g, link, m, &c.summaries);
            [
                ranking::fastest(&cx),
                ranking::ring_against_ps(&cx),
                ranking::scaling(&cx),
                ranking::first_to_target(&cx),
            ]
            .concat()
            .join("\n")
        };
        // On a big machine every cell is read.
        let all = read(None);
        assert!(all.contains("At 4 workers: ddp-tcp (TCP sockets) is fastest"), "{all}");
        assert!(all.contains("The ring pulls ahead at 4 workers"), "{all}");
        // On 3 cores every 4-worker run saturates the CPU; 2 workers and a server are 3 processes.
        let small = Machine { cores: 3, ..Machine::default() };
        let text = read(Some(&small));
        assert!(!text.contains("is fastest with 2001"), "{text}");
        assert!(
            text.contains("At 4 workers nothing is ranked. Not ranked, since they saturated the CPU"),
            "{text}"
        );
        assert!(
            text.contains("4 workers: ring/PS = 2.00 (vs ps-bsp k=1 (gRPC over TCP)), not read"),
            "{text}"
        );
        assert!(!text.contains("pulls ahead") && text.contains("ahead at every worker count read"), "{text}");
        assert!(text.contains("ddp-tcp (TCP sockets) 3.50 s; ps-bsp k=1 (gRPC over TCP) 8.50 s."), "{text}");
        assert!(
            text.contains("Scaling efficiency at 4 workers is not read. Left out, since they saturated"),
            "{text}"
        );
        assert!(text.contains("At 4 workers nothing is ranked by time to 90.0%"), "{text}");
        // A worker count with one mode that ran says so, rather than calling it the fastest.
        assert!(text.contains("At 1 worker only local") && text.contains(" ran: 500 samples/s"), "{text}");
    }

    /// The parameter server leads at 2 workers, the ring at 8: the pick is made at 8 and the
    /// crossing named; on a machine of 4 cores the 8-worker runs decide nothing.
    #[test]
    fn the_verdict_names_a_crossing_with_worker_count() {
        let rows: Vec<Summary> = (0..2)
            .flat_map(|r| {
                let r_ = r as f64;
                [
                    cell_row("ps-bsp", 2, r, 900.0 + r_),
                    cell_row("ddp-tcp", 2, r, 700.0 + r_),
                    cell_row("ps-bsp", 8, r, 1000.0 + r_),
                    cell_row("ddp-tcp", 8, r, 2000.0 + r_),
                ]
            })
            .collect();
        let v = verdict_of(rows.clone(), None);
        assert!(v[0].contains("pick ddp-tcp (TCP sockets): at 8 workers"), "{v:?}");
        assert!(
            v[1].contains("the measured leader changes with the worker count (ps-bsp k=1 (gRPC over TCP) at 2, ddp-tcp (TCP sockets) at 8)"),
            "{v:?}"
        );
        let small = Machine { cores: 4, ..Machine::default() };
        let v = verdict_of(rows, Some(&small));
        assert!(v[0].contains("pick ps-bsp k=1 (gRPC over TCP): at 2 workers"), "{v:?}");
        assert!(!v[1].contains("leader changes") && v[1].starts_with("By the cost model"), "{v:?}");
        assert!(
            v[2].contains("and 4 run(s) that saturated the CPU") && v[2].contains("decide nothing"),
            "{v:?}"
        );
    }

    /// The page `write` makes of `rows` on `machine`, with `warnings` as problems in the input.
    fn page_of(name: &str, rows: Vec<Summary>, machine: Option<&Machine>, warnings: Vec<String>) -> String {
        let c = Collected { warnings, ..collected(rows) };
        let dir = gradsync_testkit::Scratch::new(name);
        let path = write(&c, machine, Some("name = \"test\""), &[], &dir).unwrap();
        std::fs::read_to_string(path).unwrap()
    }

    /// Each cell of `modes` at 2 and 4 workers, twice, faster the later it is listed; a
    /// parameter server with one shard.
    fn matrix(modes: &[&str]) -> Vec<Summary> {
        let mut rows = Vec::new();
        for r in 0..2 {
            for (i, m) in modes.iter().enumerate() {
                for n in [2, 4] {
                    let thr = 1000.0 * (i + 1) as f64 + r as f64;
                    rows.push(Summary {
                        step_ms: Some(64e3 / thr),
                        comm_exposed_ms: Some(10.0 / (i + 1) as f64),
                        ..cell_row(m, n, r, thr)
                    });
                }
            }
        }
        rows
    }

    /// The page reads top down: the verdict card, then the table of every mode at every worker
    /// count, then the charts; and every value it writes is escaped, a mode's name, a run's
    /// error or a problem in the input alike (the charts' SVG escapes its own labels).
    #[test]
    fn the_page_opens_with_the_verdict_and_escapes_what_it_writes() {
        let mut rows = matrix(&["ps-bsp", "ddp-tcp"]);
        rows.push(Summary {
            status: "failed".into(),
            error: "rank0: <script>alert(1)</script>".into(),
            ..cell_row("<script>alert(2)</script>", 2, 0, 1.0)
        });
        rows.push(cell_row("<script>alert(3)</script>", 2, 0, 1.0));
        let html = page_of("page-order", rows, None, vec!["x.jsonl:1: <script>alert(4)</script>".into()]);
        let at = |s: &str| html.find(s).unwrap_or_else(|| panic!("no {s} in the page"));
        assert!(at("class=\"card\"") < at("class=\"results\""), "the card after the table");
        assert!(at("class=\"results\"") < at("<figure"), "the table after a chart");
        let card = &html[at("class=\"card\"")..at("class=\"results\"")];
        assert!(card.contains("Pick ddp-tcp"), "no pick in the card:\n{card}");
        assert!(!html.contains("<script"), "a value written unescaped");
        for k in 1..=4 {
            assert!(html.contains(&format!("&lt;script&gt;alert({k})")), "alert({k}) missing");
        }
    }

    /// However many cells are left unranked, why is said once (with the cells listed); where
    /// most are, the card says first that the machine is too small and names the commands that
    /// would decide.
    #[test]
    fn why_runs_are_unranked_is_said_once_and_a_small_machine_is_named_first() {
        let mut rows = matrix(&["ddp-shm", "ps-bsp", "ddp-tcp"]);
        rows.push(cell_row("zero1-tcp", 2, 0, 5000.0));
        // Saturated cells: ps-bsp at 4 (5 processes) on 4 cores; every 4-worker cell on 3; on
        // 2, the parameter server at 2 workers too: 4 of the 7 cells.
        for (cores, crowded) in [(4, 1), (3, 3), (2, 4)] {
            let m = Machine { cores, ..Machine::default() };
            let html = page_of("page-unranked", rows.clone(), Some(&m), vec![]);
            assert_eq!(html.matches(context::SATURATED).count(), 1, "{cores} cores:\n{html}");
            assert!(html.matches("not ranked: saturated the CPU").count() >= crowded, "{cores} cores");
            assert_eq!(html.matches("a cell measured once has no spread").count(), 1, "{cores} cores");
            let small = html.find("Too small to decide");
            assert_eq!(small.is_some(), cores == 2, "{cores} cores");
            if let Some(at) = small {
                let card = &html[at..html.find("class=\"results\"").unwrap()];
                assert!(
                    card.contains("4 of the 7 cells") && card.contains("at 4 workers: every mode"),
                    "{card}"
                );
                assert!(
                    card.contains("<pre>gradsync-bench compare scenario.toml --hosts hosts.txt</pre>"),
                    "{card}"
                );
                assert!(card.contains("at least 5 cores"), "{card}");
                // The dilated emulated cluster decides on this machine; only an undilated one does not.
                assert!(
                    card.contains(
                        "<pre>gradsync-bench cluster scenario.toml --to-accuracy --dilate auto</pre>"
                    ) && card.contains("without dilation would not decide it"),
                    "{card}"
                );
                assert!(at < html.find("<table class=\"stack\"").unwrap(), "the banner after the rows");
            }
        }
    }

    /// A pick's row: how much sooner it reaches the target than the runner-up, the part of the
    /// step that makes the difference, and that margin against the repeats' spread.
    #[test]
    fn the_card_gives_a_picks_margin_reason_and_sureness() {
        let rows: Vec<Summary> = (0..3)
            .flat_map(|r| {
                let r_ = r as f64;
                let at = |mode: &str, tt: f64, exposed: f64| Summary {
                    time_to_target_s: Some(tt + 0.1 * r_),
                    samples_to_target: Some(3000),
                    comm_exposed_ms: Some(exposed),
                    wait_ms: Some(0.5),
                    ..cell_row(mode, 4, r, 1000.0 + r_)
                };
                [at("ddp-tcp", 3.0, 1.0), at("ps-bsp", 5.0, 3.0)]
            })
            .collect();
        let c = collected(rows);
        let g = Group { target: Some(0.97), ..crate::charts::groups(&c).remove(0) };
        let cx = context::Context::new(&g, None, None, &c.summaries).reasons_said_once();
        let card = card::card(&cx);
        assert!(card.too_small.is_none() && card.rows.len() == 1, "{card:?}");
        let row = &card.rows[0];
        assert_eq!((row.kind, row.verdict.as_str()), ("pick", "ddp-tcp (TCP sockets)"), "{row:?}");
        assert_eq!(row.margin, "1.65x sooner to 97.0% than ps-bsp k=1 (3.10 s against 5.10 s)");
        assert_eq!(row.reason, "less exposed communication: 1.00 ms a step against 3.00 ms");
        assert_eq!(row.sure, "margin 10.0x the spread over 3 repeats");
        let headline: String = card.headline.iter().flat_map(|t| &t.spans).map(|s| s.text.as_str()).collect();
        assert!(
            headline.starts_with("Pick ddp-tcp (TCP sockets): at 4 workers it reaches 97.0%"),
            "{headline}"
        );
    }
}
