//! `advise --check N`: the advice put to the test. The top N configurations the advisor
//! ranked, and plain DDP (the flat ring at the worker's default 25 MB buckets, uncompressed),
//! each run as a short replay of the model on an emulated cluster matching the SPEC (its hosts
//! and ranks a host, its NIC rate), dilated so that this machine's cores are not what sets the
//! figures (`gradsync-bench cluster --dilate auto`: each configuration probed, run twice and
//! checked at twice the factor). Each measured step (the median of its sound repeats) is set
//! beside the step predicted for the SPEC and for the link as the cluster measured it, and the
//! configurations are ranked by measurement where the two orders disagree.
//!
//! What the emulated cluster cannot be is said, not hidden: a host's ranks meet over its
//! loopback (not NVLink or PCIe), the NIC's latency is the namespaces' own (no netem here to
//! add the SPEC's), and servers always get hosts of their own (a colocated parameter server is
//! not checked), as is a configuration no compared mode runs (bf16).

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;
use gradsync_core::compress::Compression;
use serde::Serialize;

use super::codec::CodecRates;
use super::config::{Config, Exchange};
use super::predict::{Prediction, Workload, predict};
use super::spec::ClusterSpec;
use crate::cost::Link;
use crate::emulated;
use crate::modes::Bins;
use crate::net::{Queue, Shape};
use crate::results::{self, Summary};
use crate::scenario::{Dilate, Scenario};

/// Steps of each checked run (the first, the warm-up, left out of its mean).
pub const CHECK_STEPS: u64 = 6;
/// Runs of each checked configuration: the least that gives a range.
pub const CHECK_REPEATS: usize = 2;
/// The bucket size of plain DDP, the worker's default (`--bucket-mb`).
const PLAIN_DDP_MB: f64 = 25.0;

/// What the check needs besides the advice.
pub struct CheckPlan<'a> {
    /// The model as `--model` names it.
    pub model: &'a str,
    /// `--batch`, if given.
    pub batch: Option<usize>,
    /// `--device-tflops`, `--device-tbps`.
    pub rates: (Option<f64>, Option<f64>),
    /// The configurations to run: the top N the cluster can run, then plain DDP.
    pub configs: Vec<Prediction>,
    /// Configurations ranked above the last checked one that the cluster cannot run, and why.
    pub not_checked: Vec<(String, String)>,
    /// Steps and repeats of each run.
    pub steps: u64,
    /// Repeats of each configuration.
    pub repeats: usize,
}

/// One configuration, predicted and measured.
#[derive(Debug, Clone, Serialize)]
pub struct Checked {
    /// Its name in tables.
    pub label: String,
    /// Its predicted rank among every configuration (1: the fastest).
    pub predicted_rank: usize,
    /// Whether it is the advisor's pick (top-k may rank above the pick, and is never picked).
    pub is_pick: bool,
    /// The step predicted for the SPEC, ms.
    pub predicted_ms: f64,
    /// The step predicted for the emulated cluster's link as measured, ms.
    pub predicted_measured_link_ms: Option<f64>,
    /// The median step of its sound repeats, ms.
    pub measured_ms: Option<f64>,
    /// Their range, ms.
    pub range_ms: Option<(f64, f64)>,
    /// Sound repeats (complete, the cores keeping up with the factor) of those run.
    pub sound: usize,
    /// Repeats run.
    pub runs: usize,
    /// The factor its cluster ran at.
    pub dilation: Option<f64>,
    /// Why it has no measurement, when it has none.
    pub why_not: Option<String>,
    /// Its run directory.
    pub dir: PathBuf,
}

impl Checked {
    /// (predicted on the measured link - measured) / measured, where both exist.
    pub fn error(&self) -> Option<f64> {
        let m = self.measured_ms?;
        Some((self.predicted_measured_link_ms? - m) / m)
    }
}

/// The check's outcome.
#[derive(Debug, Clone, Serialize)]
pub struct CheckReport {
    /// The emulated cluster: hosts, ranks a host, rate.
    pub cluster: String,
    /// Every configuration checked, in predicted order.
    pub checked: Vec<Checked>,
    /// Configurations ranked above the last checked one that were not run, and why.
    pub not_checked: Vec<(String, String)>,
    /// The measured order: indices into `checked`, fastest first (measured ones only).
    pub measured_order: Vec<usize>,
    /// The median and largest |error| over the measured configurations.
    pub error_median: Option<f64>,
    /// The largest.
    pub error_max: Option<f64>,
    /// The verdict, one paragraph.
    pub verdict: String,
}

/// The configurations `--check n` runs: the top `n` of `ranked` the emulated cluster can run,
/// then plain DDP when it is not among them; those skipped on the way, with the reason.
pub fn plan<'a>(
    model: &'a str,
    batch: Option<usize>,
    rates: (Option<f64>, Option<f64>),
    ranked: &[Prediction],
    pick: Option<usize>,
    n: usize,
) -> CheckPlan<'a> {
    let mut configs: Vec<Prediction> = Vec::new();
    let mut not_checked = Vec::new();
    // The advisor's pick first (top-k may rank above it, never picked), then the ranking.
    let first = pick.and_then(|i| ranked.get(i)).filter(|p| unrunnable(&p.config).is_none());
    configs.extend(first.cloned());
    for p in ranked.iter().filter(|p| first.is_none_or(|f| f.config != p.config)) {
        if configs.len() == n {
            break;
        }
        match unrunnable(&p.config) {
            Some(why) => not_checked.push((p.label.clone(), why)),
            None => configs.push(p.clone()),
        }
    }
    let plain =
        Config { exchange: Exchange::Ring, bucket_mb: Some(PLAIN_DDP_MB), compression: Compression::None };
    if !configs.iter().any(|p| p.config == plain)
        && let Some(p) = ranked.iter().find(|p| p.config == plain)
    {
        configs.push(p.clone());
    }
    CheckPlan { model, batch, rates, configs, not_checked, steps: CHECK_STEPS, repeats: CHECK_REPEATS }
}

/// Why the emulated cluster cannot run `c`, if it cannot.
fn unrunnable(c: &Config) -> Option<String> {
    if let Exchange::Ps { colocated: true, .. } = c.exchange {
        return Some(
            "the emulated cluster gives servers hosts of their own: a colocated server is not checked".into(),
        );
    }
    let mode = c.mode();
    (mode.compress(c.compression.ratio().unwrap_or(1.0)).unwrap_or(Compression::None) != c.compression)
        .then(|| format!("no compared mode runs {} with {}: not checked", mode.label(), c.compression))
}

/// The scenario one checked configuration runs: the model replayed on `spec`'s hosts and ranks
/// a host, the configuration's mode, servers and bucket size, dilated automatically.
pub fn scenario(plan: &CheckPlan, spec: &ClusterSpec, p: &Prediction) -> anyhow::Result<Scenario> {
    let c = &p.config;
    let mut t = format!(
        "name = 'advise-check'\nmodes = ['{}']\nhosts = [{}]\nranks_per_host = [{}]\nmodels = ['{}']\n\
         steps = {}\nrepeats = {}\nseed = 42\ndevice = 'cpu'\nthreads = 1\ndilate = 'auto'\nrun_timeout_s = 900\n\
         rawtcp_s = 1.0\n",
        p.mode.label(),
        spec.hosts,
        spec.per_host,
        plan.model.replace('\'', ""),
        plan.steps,
        plan.repeats
    );
    t += &match c.exchange {
        Exchange::Ps { servers, .. } => format!("shards = [{servers}]\n"),
        _ => "shards = [1]\n".into(),
    };
    if let Some(mb) = c.bucket_mb {
        t += &format!("bucket_mb = {mb}\n");
    }
    if let Some(r) = c.compression.ratio() {
        t += &format!("topk_ratio = {r}\n");
    }
    if let Some(b) = plan.batch {
        t += &format!("batches = [{}]\n", b * spec.workers());
    }
    if let Some(tf) = plan.rates.0 {
        t += &format!("device_tflops = {tf}\n");
    }
    if let Some(tb) = plan.rates.1 {
        t += &format!("device_tbps = {tb}\n");
    }
    Scenario::parse(&t, "the check's scenario")
}

/// Run the plan on emulated clusters under `out`, one directory per configuration, and set
/// what each measured beside its predictions.
#[allow(clippy::too_many_arguments)]
pub fn run(
    plan: &CheckPlan,
    spec: &ClusterSpec,
    w: &Workload,
    codecs: &CodecRates,
    ranked: &[Prediction],
    pick: Option<usize>,
    bins: &Bins,
    out: &Path,
) -> anyhow::Result<CheckReport> {
    crate::net::available().map_err(|e| anyhow::anyhow!("--check runs on an emulated cluster: {e}"))?;
    crate::net::guard("gradsync-bench advise --check");
    let gbit = spec.nic.b * 8.0 / 1e9;
    let shape = move |rate: f64| Shape {
        rate_bit: Some(rate * 1e9),
        delay: Duration::ZERO,
        loss_pct: 0.0,
        rto_min: None,
        queue: Queue::Fair,
    };
    let mut checked = Vec::new();
    for (i, p) in plan.configs.iter().enumerate() {
        let s = scenario(plan, spec, p)?;
        let dir = out.join(format!("{:02}-{}", i + 1, sanitize(&p.label)));
        eprintln!("gradsync-bench advise --check: {} on {} ({})", p.label, spec.describe(), dir.display());
        crate::cluster::run_cluster(&s, bins, &dir, &[gbit], shape, Some(Dilate::Auto))
            .with_context(|| format!("running {}", p.label))?;
        let rank = ranked.iter().position(|r| r.config == p.config).map_or(0, |r| r + 1);
        let mut c = measured(p, rank, spec, w, codecs, &dir)?;
        c.is_pick = pick.is_some_and(|i| i + 1 == rank);
        checked.push(c);
    }
    Ok(report(spec, checked, plan.not_checked.clone()))
}

/// One configuration's measurement from its run directory.
fn measured(
    p: &Prediction,
    predicted_rank: usize,
    spec: &ClusterSpec,
    w: &Workload,
    codecs: &CodecRates,
    dir: &Path,
) -> anyhow::Result<Checked> {
    let c = results::collect(&[dir.to_path_buf()], None)?;
    let ran: Vec<&Summary> = c.summaries.iter().filter(|s| s.status != "skipped").collect();
    let sound: Vec<f64> =
        ran.iter().filter(|s| s.complete() && !s.dilated_saturated()).filter_map(|s| s.step_ms).collect();
    let why_not = if sound.is_empty() {
        Some(match c.summaries.iter().find(|s| !s.error.is_empty()) {
            Some(s) => format!("{}: {}", s.status, s.error),
            None if ran.is_empty() => "not run".into(),
            None => "no sound repeat: the cores did not keep up with the factor".into(),
        })
    } else {
        None
    };
    let links = emulated::load(&[dir.to_path_buf()]);
    let med = |f: &dyn Fn(&emulated::ClusterRun) -> Option<f64>| {
        results::median(&links.iter().filter_map(f).collect::<Vec<_>>())
    };
    let link = med(&|r| r.measured_gbit)
        .map(|g| Link { a: med(&|r| r.measured_latency_us).unwrap_or(0.0) * 1e-6, b: g * 1e9 / 8.0 });
    let on_link = match link {
        Some(l) => Some(predict(w, &emulated_spec(spec, l)?, &p.config, codecs)?.step_s * 1e3),
        None => None,
    };
    Ok(Checked {
        label: p.label.clone(),
        predicted_rank,
        is_pick: false,
        predicted_ms: p.step_s * 1e3,
        predicted_measured_link_ms: on_link,
        measured_ms: results::median(&sound),
        range_ms: crate::table::spread(&sound).map(|(_, lo, hi)| (lo, hi)),
        sound: sound.len(),
        runs: ran.len(),
        // What auto chose (1 where the cores were nearly idle: the run is then undilated).
        dilation: c.dilations.first().map(|d| d.dilation).or_else(|| ran.iter().find_map(|s| s.dilation)),
        why_not,
        dir: dir.to_path_buf(),
    })
}

/// `spec`'s hosts with the NIC measured on the emulated cluster ([`ClusterSpec::emulated`]).
fn emulated_spec(spec: &ClusterSpec, nic: Link) -> anyhow::Result<ClusterSpec> {
    ClusterSpec::emulated(spec.hosts, spec.per_host, nic)
        .map_err(|e| anyhow::anyhow!("the emulated cluster's link: {e}"))
}

/// The measured order, the errors and the verdict.
pub fn report(spec: &ClusterSpec, checked: Vec<Checked>, not_checked: Vec<(String, String)>) -> CheckReport {
    let mut measured_order: Vec<usize> =
        (0..checked.len()).filter(|&i| checked[i].measured_ms.is_some()).collect();
    measured_order.sort_by(|&a, &b| {
        checked[a].measured_ms.partial_cmp(&checked[b].measured_ms).unwrap_or(std::cmp::Ordering::Equal)
    });
    let errors: Vec<f64> = checked.iter().filter_map(Checked::error).map(f64::abs).collect();
    let cluster = format!(
        "{} host(s) x {} rank(s) at {}, emulated",
        spec.hosts,
        spec.per_host,
        super::spec::gbit_text(spec.nic.b)
    );
    let verdict = verdict(&checked, &measured_order);
    CheckReport {
        cluster,
        checked,
        not_checked,
        measured_order,
        error_median: results::median(&errors),
        error_max: errors.iter().copied().reduce(f64::max),
        verdict,
    }
}

/// One paragraph: the measured best against the predicted pick, and whether to trust the
/// prediction's order.
fn verdict(checked: &[Checked], order: &[usize]) -> String {
    let Some(&best) = order.first() else {
        return "Nothing was measured soundly, so the prediction stands unchecked: see why beside each \
                configuration."
            .into();
    };
    let b = &checked[best];
    let pick = checked.iter().find(|c| c.is_pick);
    // Fastest only among what was measured soundly: say so where that is not everything.
    let among = match (order.len(), checked.len()) {
        (k, n) if k == n => String::new(),
        (1, n) => format!(" (the only one of the {n} checked measured soundly)"),
        (k, n) => format!(" (of the {k} of {n} checked measured soundly)"),
    };
    let said = format!(
        "Measured fastest: {}{among} at {:.1} ms a step (median of {}, {}), predicted {:.1} ms for the link as measured.",
        b.label,
        b.measured_ms.unwrap_or(0.0),
        b.sound,
        b.range_ms.map_or("one run".into(), |(lo, hi)| format!("{lo:.1}-{hi:.1}")),
        b.predicted_measured_link_ms.unwrap_or(b.predicted_ms)
    );
    match pick {
        Some(p) if p.label == b.label => {
            format!("{said} It is the advisor's pick: measurement and prediction agree.")
        }
        Some(p) => {
            let level = match (p.range_ms, b.range_ms) {
                (Some(x), Some(y)) => x.0 <= y.1 && y.0 <= x.1,
                _ => false,
            };
            match p.measured_ms {
                Some(m) if level => format!(
                    "{said} The advisor's pick, {}, measured {m:.1} ms, level with it within their ranges: \
                     either will do.",
                    p.label
                ),
                Some(m) => format!(
                    "{said} The advisor picked {}, which measured {m:.1} ms ({:+.0}%): they disagree, and the \
                     measured order is the one to go by.",
                    p.label,
                    (m / b.measured_ms.unwrap_or(m) - 1.0) * 100.0
                ),
                None => format!("{said} The advisor's pick, {}, has no sound measurement.", p.label),
            }
        }
        None => said,
    }
}

/// A directory name: [`crate::scenario::sanitize`]'s, without runs of dashes.
fn sanitize(s: &str) -> String {
    crate::scenario::sanitize(s).split('-').filter(|p| !p.is_empty()).collect::<Vec<_>>().join("-")
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use gradsync_core::profile::{DeviceRate, builtin};

    use super::*;
    use crate::advise::search::{Space, rank};

    fn ranked(spec: &str) -> (ClusterSpec, Vec<Prediction>) {
        let c = ClusterSpec::parse(spec).unwrap();
        let w = Workload::new(&builtin("resnet50", DeviceRate::H100).unwrap(), 64).unwrap();
        let space = Space::new(vec![5.0, 25.0], None).unwrap();
        (c.clone(), rank(&w, &c, &CodecRates::free(), &space).unwrap())
    }

    /// The top N the emulated cluster can run, those it cannot named with the reason, and
    /// plain DDP added where the top N leave it out.
    #[test]
    fn the_plan_is_the_runnable_top_n_and_plain_ddp() {
        let (_, r) = ranked("4x1:10gbit");
        let plan = plan("resnet50", None, (None, None), &r, None, 3);
        let runnable = r.iter().filter(|p| unrunnable(&p.config).is_none()).take(3).count();
        let plain = |p: &Prediction| p.label == "ddp-tcp flat ring, 25 MB buckets";
        assert_eq!(
            plan.configs.len(),
            runnable + usize::from(!r.iter().filter(|p| unrunnable(&p.config).is_none()).take(3).any(plain))
        );
        assert!(
            plan.configs.iter().any(plain),
            "{:?}",
            plan.configs.iter().map(|p| &p.label).collect::<Vec<_>>()
        );
        assert!(plan.configs.iter().all(|p| unrunnable(&p.config).is_none()));
        for (label, why) in &plan.not_checked {
            assert!(why.contains("not checked"), "{label}: {why}");
        }
        // The pick goes first, wherever it ranks (top-k may rank above it).
        let with_pick = super::plan("resnet50", None, (None, None), &r, Some(4), 2);
        assert_eq!(with_pick.configs[0].label, r[4].label);
        assert_eq!(with_pick.configs.iter().filter(|p| p.label == r[4].label).count(), 1);
        // A colocated server and bf16 are what it cannot run.
        let coloc = Config {
            exchange: Exchange::Ps { servers: 2, colocated: true },
            bucket_mb: None,
            compression: Compression::None,
        };
        assert!(unrunnable(&coloc).unwrap().contains("colocated"));
        let bf16 = Config { exchange: Exchange::Ring, bucket_mb: Some(25.0), compression: Compression::Bf16 };
        assert!(unrunnable(&bf16).unwrap().contains("bf16"));
        let fp16 = Config { compression: Compression::Fp16, ..bf16 };
        assert_eq!(unrunnable(&fp16), None);
    }

    /// Each configuration's scenario: its mode, its hosts and ranks a host, its servers and
    /// bucket size, dilated automatically.
    #[test]
    fn a_configurations_scenario_places_it_as_the_spec_says() {
        let (c, r) = ranked("4x2:10gbit:pcie");
        let plan = plan("resnet50", Some(32), (Some(100.0), None), &r, None, 50);
        let hier = plan
            .configs
            .iter()
            .find(|p| p.config.exchange == Exchange::Hierarchical && p.config.compression.is_none())
            .unwrap();
        let s = scenario(&plan, &c, hier).unwrap();
        assert_eq!(
            (s.modes[0].label(), s.hosts.as_slice(), s.ranks_per_host.as_slice()),
            ("ddp-hier", &[4][..], &[2][..])
        );
        assert_eq!(
            (s.bucket_mb, s.batches.as_slice(), s.device_tflops),
            (hier.config.bucket_mb, &[32 * 8][..], Some(100.0))
        );
        assert_eq!(s.dilate, Some(Dilate::Auto));
        let ps = plan.configs.iter().find(|p| matches!(p.config.exchange, Exchange::Ps { .. })).unwrap();
        let s = scenario(&plan, &c, ps).unwrap();
        let Exchange::Ps { servers, .. } = ps.config.exchange else { unreachable!() };
        assert_eq!((s.expand()[0].shards, s.bucket_mb), (servers, None));
    }

    fn checked(label: &str, rank: usize, pred: f64, meas: Option<f64>, range: Option<(f64, f64)>) -> Checked {
        Checked {
            label: label.into(),
            predicted_rank: rank,
            is_pick: rank == 1,
            predicted_ms: pred,
            predicted_measured_link_ms: Some(pred),
            measured_ms: meas,
            range_ms: range,
            sound: usize::from(meas.is_some()) * 2,
            runs: 2,
            dilation: Some(8.0),
            why_not: meas.is_none().then(|| "skipped: needs about 30 GiB".into()),
            dir: PathBuf::new(),
        }
    }

    /// Ranked by measurement; the errors over the measured ones; the verdict says whether the
    /// pick held, was level or lost, and the page and the text carry every row.
    #[test]
    fn the_verdict_ranks_by_measurement_and_states_the_error() {
        let spec = ClusterSpec::parse("4x1:10gbit").unwrap();
        let lost = report(
            &spec,
            vec![
                checked("a", 1, 100.0, Some(125.0), Some((120.0, 130.0))),
                checked("b", 2, 110.0, Some(105.0), Some((100.0, 108.0))),
                checked("c", 5, 300.0, None, None),
            ],
            vec![("d".into(), "not checked: colocated".into())],
        );
        assert_eq!(lost.measured_order, [1, 0]);
        assert!(
            lost.verdict.contains("Measured fastest: b") && lost.verdict.contains("they disagree"),
            "{}",
            lost.verdict
        );
        // |100 - 125| / 125 = 20%, |110 - 105| / 105 = 4.76%.
        assert!(
            (lost.error_max.unwrap() - 0.2).abs() < 1e-9 && (lost.error_median.unwrap() - 0.124).abs() < 1e-3
        );
        let level = report(
            &spec,
            vec![
                checked("a", 1, 100.0, Some(104.0), Some((98.0, 110.0))),
                checked("b", 2, 110.0, Some(101.0), Some((99.0, 103.0))),
            ],
            vec![],
        );
        assert!(level.verdict.contains("level with it"), "{}", level.verdict);
        let held = report(&spec, vec![checked("a", 1, 100.0, Some(99.0), Some((98.0, 100.0)))], vec![]);
        assert!(held.verdict.contains("agree"), "{}", held.verdict);
        let none = report(&spec, vec![checked("a", 1, 100.0, None, None)], vec![]);
        assert!(none.verdict.contains("unchecked") && none.error_median.is_none());

        let text = crate::advise::page::text(&lost);
        assert!(
            text.contains("skipped: needs about 30 GiB")
                && text.contains("+4.8%")
                && text.contains("not checked: d"),
            "{text}"
        );
        let html = crate::advise::page::html("resnet50", &lost).unwrap();
        let card = html.find("class=\"card\"").unwrap();
        assert!(
            card < html.find("<table>").unwrap()
                && html.find("<table>").unwrap() < html.find("<svg").unwrap(),
            "card, table, chart"
        );
        assert!(html.contains("Measured fastest: b") && html.contains("loopback"), "{html}");
    }
}
