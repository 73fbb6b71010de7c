//! `gradsync-bench validate --loopback DIR --profile FILE`: the advisor against `compare`'s
//! runs on one machine's loopback, the models trained for real (the MLP and conv presets),
//! their profiles recorded by `replay record`.
//!
//! Each cell of the comparison (mode, workers, shards over their repeats) becomes a
//! [`Row`]: its median step beside the advisor's (`predict.rs`'s timeline, with the cell's
//! own forward, backward, update and the rest of its step outside them, the batch's
//! assembly, and the loopback as the run directory's probe measured it) and the alpha-beta model's (the same compute, then the exchange priced as `compare`'s
//! report prices it: one raw stream's rate a link, nothing hidden behind backward). Every
//! process on one machine shares its cores and its loopback, so the link the advisor is
//! given is each process's share of what the loopback carried with as many raw TCP streams
//! at once as the mode keeps busy ([`share_of_loopback`]). A cell counts, as `compare`'s
//! ranking counts it, when two or more repeats completed and its processes did not outnumber
//! the cores. In each (model, workers) group the advisor's pick (from the profile's own
//! compute) is judged against the fastest measured, as over the emulated clusters.

use std::path::{Path, PathBuf};

use anyhow::Context as _;
use gradsync_core::profile::Profile;

use super::codec::CodecRates;
use super::config::Config;
use super::predict::{self, Workload};
use super::spec::{ClusterSpec, Intra, IntraKind};
use super::validate::{self, Row, Validation};
use crate::cost::Link;
use crate::machine::{self, Machine};
use crate::report::context::cpu_saturated;
use crate::report::links::per_link_model;
use crate::results::{self, Cell, Summary};
use crate::scenario::ModeKind;

/// The modes the advisor prices on one machine: the ring and ZeRO-1 over TCP, the
/// bulk-synchronous parameter server.
const PRICED: [ModeKind; 3] = [ModeKind::DdpTcp, ModeKind::Zero1Tcp, ModeKind::PsBsp];

/// The rows of the comparison in `dir` (`gradsync-bench compare --out DIR`), each model's
/// predicted from the profile in `profiles` that names it.
pub fn rows(dir: &Path, profiles: &[Profile]) -> anyhow::Result<(String, Vec<Row>)> {
    let machine_path = dir.join("machine.json");
    let text = std::fs::read_to_string(&machine_path).with_context(|| {
        format!("{} is not a comparison's directory: reading {}", dir.display(), machine_path.display())
    })?;
    let m: Machine =
        serde_json::from_str(&text).with_context(|| format!("reading {}", machine_path.display()))?;
    anyhow::ensure!(
        !dir.join(crate::emulated::CLUSTER_FILE).exists(),
        "{} holds an emulated cluster's runs: give it to validate without --loopback",
        dir.display()
    );
    let c = results::collect(&[dir.to_path_buf()], None)?;
    anyhow::ensure!(!c.summaries.is_empty(), "{} holds no runs", dir.display());
    let mut out = Vec::new();
    for cell in &c.cells {
        let s = &cell.median;
        let Ok(mode) = s.mode.parse::<ModeKind>() else { continue };
        if !PRICED.contains(&mode) || s.workers < 2 || s.slow_ms > 0 {
            continue;
        }
        let profile = profiles.iter().find(|p| p.model == s.model).with_context(|| {
            format!(
                "{}: no profile of {} was given (record one: gradsync-bench replay record --model {} --data digits --out FILE)",
                dir.display(),
                s.model,
                s.model
            )
        })?;
        out.push(row(cell, mode, profile, &m));
    }
    // Each (model, workers) group's rows together.
    out.sort_by(|a, b| a.group.cmp(&b.group));
    anyhow::ensure!(
        !out.is_empty(),
        "{} holds no runs of {} with two or more workers",
        dir.display(),
        PRICED.map(|m| m.label()).join(", ")
    );
    Ok((format!("{}, {} cores", m.cpu, m.cores), out))
}

/// Validate the comparisons in `dirs` against the profiles in `profile_files`.
pub fn validate(dirs: &[PathBuf], profile_files: &[PathBuf]) -> anyhow::Result<Validation> {
    anyhow::ensure!(
        !profile_files.is_empty(),
        "--loopback needs --profile FILE for each model the runs trained"
    );
    let profiles = profile_files
        .iter()
        .map(|f| Profile::load(f).map_err(anyhow::Error::from))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let (mut cpu, mut all) = (String::new(), Vec::new());
    for d in dirs {
        let (c, rows) = rows(d, &profiles)?;
        if cpu.is_empty() {
            cpu = c;
        }
        all.extend(rows);
    }
    Ok(validate::summarise(cpu, all))
}

/// Each process's share of the loopback for a run of `mode` with `workers` and `shards`:
/// what the probe's raw TCP streams carried together at the run's count of streams at once
/// (the nearest count measured), over the processes that move the exchange's bytes at once
/// (a ring's ranks; the parameter server's busier side, servers or workers); the latency is
/// the probe's small-message one. None where the directory measured no loopback.
pub fn share_of_loopback(m: &Machine, mode: ModeKind, workers: usize, shards: usize) -> Option<Link> {
    let streams = machine::tcp_streams(mode, workers, shards)?;
    let measured: Vec<usize> = std::iter::once(1).chain(m.tcp_parallel.iter().map(|p| p.streams)).collect();
    let nearest = measured.into_iter().min_by_key(|&n| n.abs_diff(streams.total))?;
    let together = m.streams_bandwidth(nearest)?;
    let movers = if mode.is_ps() { shards.clamp(1, workers) } else { workers };
    (m.tcp_latency_s > 0.0).then(|| Link { a: m.tcp_latency_s, b: together / movers as f64 })
}

/// One cell, measured and predicted.
fn row(cell: &Cell, mode: ModeKind, profile: &Profile, m: &Machine) -> Row {
    let s = &cell.median;
    let design = crate::scenario::design_name(mode.label(), if mode.is_ps() { s.shards } else { 0 }, false);
    let link = share_of_loopback(m, mode, s.workers, s.shards);
    let predicted = |measured_compute: bool| -> Option<f64> {
        let mut w = Workload::new(profile, s.batch).ok()?;
        if measured_compute {
            // The rest of the run's step (the batch's assembly) comes before its forward.
            w = w.timed_as((s.forward_ms? + s.other_ms.unwrap_or(0.0)) / 1e3, s.backward_ms? / 1e3);
            w.update_s = s.update_ms? / 1e3;
        }
        let l = link?;
        let c =
            ClusterSpec::checked(1, s.workers, l, Some(Intra { kind: IntraKind::Shm, link: l }), "loopback")
                .ok()?;
        let cfg = Config::of_mode(
            mode,
            s.bucket_mb.unwrap_or(gradsync_worker::cli::flag::DEFAULT_BUCKET_MB),
            false,
            (s.shards, false),
            0.01,
        )?;
        Some(predict::predict(&w, &c, &cfg, &CodecRates::free()).ok()?.step_s * 1e3)
    };
    let compute = s
        .forward_ms
        .zip(s.backward_ms)
        .map(|(f, b)| f + b + s.update_ms.unwrap_or(0.0) + s.other_ms.unwrap_or(0.0));
    let one_stream = crate::report::link_of(Some(m));
    let exchange = one_stream.and_then(|l| per_link_model(s, 4.0 * s.params as f64, l)).map(|t| t * 1e3);
    let unsound = why_not_ranked(cell, m);
    Row {
        group: format!("{}-{}w-loopback", s.model, s.workers),
        design,
        model: s.model.clone(),
        hosts: 1,
        ranks_per_host: s.workers,
        rate_gbit: link.map_or(0.0, |l| l.b * 8.0 / 1e9),
        dilation: 1.0,
        cpu_busy: s.cpu_busy,
        sound: unsound.is_none(),
        unsound,
        measured_ms: s.step_ms,
        advisor_ms: predicted(true),
        advisor_profile_ms: predicted(false),
        alpha_beta_ms: compute.zip(exchange).map(|(c, x)| c + x),
    }
}

/// Why `compare` would not rank a cell, if it would not: fewer than two complete repeats, or
/// its processes outnumbering the machine's cores.
fn why_not_ranked(cell: &Cell, m: &Machine) -> Option<String> {
    let s: &Summary = &cell.median;
    if cell.runs.len() < 2 {
        return Some(format!("{} of {} repeats complete", cell.runs.len(), cell.attempts));
    }
    cpu_saturated(s, Some(m))
        .then(|| format!("CPU-saturated: {} processes on {} cores", s.workers + s.shards, m.cores))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::machine::Parallel;
    use crate::rawtcp::Yardstick;

    fn machine() -> Machine {
        let at =
            |streams: usize, gb: f64| Parallel { streams, yardstick: Yardstick { samples: vec![gb * 1e9] } };
        Machine {
            cores: 2,
            tcp_bandwidth: 3e9,
            tcp_latency_s: 20e-6,
            tcp_parallel: vec![at(2, 4.0), at(4, 4.4), at(8, 4.8)],
            ..Machine::default()
        }
    }

    #[test]
    fn a_process_gets_its_share_of_what_the_loopback_carried_at_the_runs_streams() {
        let m = machine();
        // A ring of 4 ranks keeps 4 streams busy: 4.4 GB/s over 4 ranks.
        let ring = share_of_loopback(&m, ModeKind::DdpTcp, 4, 0).unwrap();
        assert!((ring.b - 1.1e9).abs() < 1.0 && ring.a == 20e-6, "{ring:?}");
        // A parameter server of 2 workers and 2 shards: 8 streams (push and pull per worker per
        // shard), its bytes moved by the 2 servers at once.
        let ps = share_of_loopback(&m, ModeKind::PsBsp, 2, 2).unwrap();
        assert!((ps.b - 2.4e9).abs() < 1.0, "{ps:?}");
        // One shard for 4 workers: 8 streams, one server moving every byte.
        let one = share_of_loopback(&m, ModeKind::PsBsp, 4, 1).unwrap();
        assert!((one.b - 4.8e9).abs() < 1.0, "{one:?}");
        // 3 ranks, 3 streams: the nearest count measured (2 and 4 equally near: the first).
        let three = share_of_loopback(&m, ModeKind::DdpTcp, 3, 0).unwrap();
        assert!((three.b - 4.0e9 / 3.0).abs() < 1.0, "{three:?}");
        // Nothing measured: no link.
        assert!(share_of_loopback(&Machine::default(), ModeKind::DdpTcp, 2, 0).is_none());
        // A mode that does not cross TCP: none.
        assert!(share_of_loopback(&m, ModeKind::DdpShm, 2, 0).is_none());
    }

    #[test]
    fn a_directory_that_is_not_a_comparison_is_refused_by_name() {
        let d = gradsync_testkit::Scratch::new("loopback-empty");
        let e = rows(&d, &[]).unwrap_err().to_string();
        assert!(e.contains("is not a comparison's directory") && e.contains("machine.json"), "{e}");
    }
}
