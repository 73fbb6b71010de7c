//! `advise --check N`: the advice put to the test. The top N configurations the advisor
//! ranked, and plain DDP (the flat ring at the worker's default 25 MB buckets, uncompressed),
//! each run as a short replay of the model where the [`Testbed`] says: on an emulated cluster
//! matching the SPEC (its hosts and ranks a host, its NIC rate), dilated so that this machine's
//! cores are not what sets the figures (`gradsync-bench cluster --dilate auto`: each
//! configuration probed, run twice and checked at twice the factor); or, with `--hosts` and
//! `--slurm`, on the very hosts the advice measured, undilated, as `compare --hosts` runs a
//! scenario there. Each measured step (the median of its sound repeats) is set beside the step
//! predicted for the SPEC and for the link as measured (the emulated cluster's own, or the
//! hosts' as the advice measured it), and the configurations are ranked by measurement where
//! the two orders disagree.
//!
//! What a testbed cannot run is said, not hidden, with why ([`Testbed::unrunnable`]: a
//! colocated parameter server on the emulated cluster, servers on hosts of their own on real
//! hosts that the workers fill, bf16 anywhere), and so is what it is not (the page's caveats).

use std::path::{Path, PathBuf};

use anyhow::Context;
use gradsync_core::compress::Compression;
use serde::Serialize;

use super::codec::CodecRates;
use super::config::{Config, Exchange};
use super::predict::{Prediction, Workload, predict};
use super::spec::ClusterSpec;
use super::testbed::{Kind, Testbed};
use crate::modes::Bins;
use crate::results::{self, REPLAY_BUSY, Summary};
use crate::scenario::Scenario;

/// Steps of each checked run (the first, the warm-up, left out of its mean).
pub const CHECK_STEPS: u64 = 6;
/// Runs of each checked configuration: the least that gives a range.
pub const CHECK_REPEATS: usize = 2;
/// The bucket size of plain DDP, the worker's default (`--bucket-mb`).
const PLAIN_DDP_MB: f64 = 25.0;

/// The model each checked run replays, as the flags name it.
#[derive(Debug, Clone, Copy)]
pub struct Replayed<'a> {
    /// The model as `--model` names it.
    pub model: &'a str,
    /// `--batch`, if given.
    pub batch: Option<usize>,
    /// `--device-tflops`, `--device-tbps`.
    pub rates: (Option<f64>, Option<f64>),
}

/// What the check needs besides the advice.
pub struct CheckPlan<'a> {
    /// The model replayed.
    pub replayed: Replayed<'a>,
    /// Where the runs go.
    pub testbed: &'a Testbed,
    /// The configurations to run: the top N the testbed can run, then plain DDP.
    pub configs: Vec<Prediction>,
    /// Configurations ranked above the last checked one that the testbed cannot run, and why.
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
    /// The step predicted for the link as measured (the emulated cluster's, or the real
    /// hosts' as the advice measured it), ms.
    pub predicted_measured_link_ms: Option<f64>,
    /// The median step of its sound repeats, ms.
    pub measured_ms: Option<f64>,
    /// Their range, ms.
    pub range_ms: Option<(f64, f64)>,
    /// Sound repeats of those run ([`sound`]).
    pub sound: usize,
    /// Repeats run.
    pub runs: usize,
    /// The factor its emulated cluster ran at (none on real hosts, which are not dilated).
    pub dilation: Option<f64>,
    /// The codecs' time the advice prices a step at this machine's rates, ms (0 uncompressed).
    /// Dilated, the cluster ran them `dilation` times faster ([`CodecRates::dilated`]), so
    /// its measurement does not test them.
    pub codec_ms: f64,
    /// Why it has no measurement, when it has none.
    pub why_not: Option<String>,
    /// Its run directory.
    pub dir: PathBuf,
}

impl Checked {
    /// The codec time a dilated run left out of its measurement, ms: what the advice prices at
    /// this machine's rates less what the cluster, `dilation` times faster, spent. None where
    /// nothing was left out (uncompressed, or undilated).
    pub fn untested_codec_ms(&self) -> Option<f64> {
        let d = self.dilation.filter(|&d| d > 1.0)?;
        (self.codec_ms > 0.0).then(|| self.codec_ms * (1.0 - 1.0 / d))
    }

    /// "X's codecs (12.3 ms a step at this machine's rates) ran 8x faster on the dilated
    /// cluster ...": why its measurement does not test them.
    fn codecs_note(&self) -> String {
        format!(
            "{}'s codecs ({:.1} ms a step at this machine's rates) ran {}x faster on the dilated cluster, \
             which shrinks every per-byte CPU step but compute by its factor, so its measurement tests its \
             bytes and not its codecs",
            self.label,
            self.codec_ms,
            self.dilation.unwrap_or(1.0)
        )
    }

    /// (predicted on the measured link - measured) / measured, where both exist.
    pub fn error(&self) -> Option<f64> {
        let m = self.measured_ms?;
        Some((self.predicted_measured_link_ms? - m) / m)
    }
}

/// The check's outcome.
#[derive(Debug, Clone, Serialize)]
pub struct CheckReport {
    /// What it ran on.
    pub testbed: Kind,
    /// Where: hosts, ranks a host, rate ([`Testbed::describe`]).
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

/// The configurations `--check n` runs on `testbed` for the cluster `spec`: the top `n` of
/// `ranked` it can run, then plain DDP when it is not among them; those skipped on the way,
/// with the reason.
pub fn plan<'a>(
    replayed: Replayed<'a>,
    testbed: &'a Testbed,
    spec: &ClusterSpec,
    ranked: &[Prediction],
    pick: Option<usize>,
    n: usize,
) -> CheckPlan<'a> {
    let unrunnable = |c: &Config| testbed.unrunnable(c, spec);
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
    CheckPlan { replayed, testbed, configs, not_checked, steps: CHECK_STEPS, repeats: CHECK_REPEATS }
}

/// The scenario one checked configuration runs: the model replayed on `spec`'s ranks, placed
/// as the testbed places them ([`Testbed::placement`]), the configuration's mode, servers and
/// bucket size.
pub fn scenario(plan: &CheckPlan, spec: &ClusterSpec, p: &Prediction) -> anyhow::Result<Scenario> {
    let (c, r) = (&p.config, &plan.replayed);
    let mut t = format!(
        "name = 'advise-check'\nmodes = ['{}']\nmodels = ['{}']\nsteps = {}\nrepeats = {}\nseed = 42\n\
         device = 'cpu'\nthreads = 1\nrun_timeout_s = 900\nrawtcp_s = 1.0\n",
        p.mode.label(),
        r.model.replace('\'', ""),
        plan.steps,
        plan.repeats
    );
    t += &plan.testbed.placement(spec, c);
    t += &match c.exchange {
        Exchange::Ps { servers, .. } => format!("shards = [{servers}]\n"),
        _ => "shards = [1]\n".into(),
    };
    if let Some(mb) = c.bucket_mb {
        t += &format!("bucket_mb = {mb}\n");
    }
    if let Some(ratio) = c.compression.ratio() {
        t += &format!("topk_ratio = {ratio}\n");
    }
    if let Some(b) = r.batch {
        t += &format!("batches = [{}]\n", b * spec.workers());
    }
    if let Some(tf) = r.rates.0 {
        t += &format!("device_tflops = {tf}\n");
    }
    if let Some(tb) = r.rates.1 {
        t += &format!("device_tbps = {tb}\n");
    }
    Scenario::parse(&t, "the check's scenario")
}

/// Run the plan on its testbed under `out`, one directory per configuration, and set what
/// each measured beside its predictions.
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
    plan.testbed.ready()?;
    let mut checked = Vec::new();
    for (i, p) in plan.configs.iter().enumerate() {
        let s = scenario(plan, spec, p)?;
        let dir = out.join(format!("{:02}-{}", i + 1, sanitize(&p.label)));
        let on = plan.testbed.describe(spec);
        eprintln!("gradsync-bench advise --check: {} on {on} ({})", p.label, dir.display());
        plan.testbed.run(&s, spec, bins, &dir).with_context(|| format!("running {}", p.label))?;
        let rank = ranked.iter().position(|r| r.config == p.config).map_or(0, |r| r + 1);
        let link = plan.testbed.measured_link(spec, &dir)?;
        let mut c = measured(p, rank, link.as_ref(), w, codecs, &dir)?;
        c.is_pick = pick.is_some_and(|i| i + 1 == rank);
        checked.push(c);
    }
    Ok(report(plan.testbed, spec, checked, plan.not_checked.clone()))
}

/// A repeat that counts: complete, and its figures the design's rather than the cores'
/// where its summary says so: a dilated run's cores kept up with the factor
/// ([`Summary::dilated_saturated`]); an undilated one's were at most [`REPLAY_BUSY`] busy
/// where its runner measured them (this machine's cores say nothing of other hosts', and so
/// a run there is not held to them).
pub fn sound(s: &Summary) -> bool {
    let saturated = match s.dilation {
        Some(_) => s.dilated_saturated(),
        None => s.cpu_busy.is_some_and(|b| b > REPLAY_BUSY),
    };
    s.complete() && !saturated
}

/// One configuration's measurement from its run directory, with the step predicted for
/// `link`, the cluster as measured (none where it was not).
fn measured(
    p: &Prediction,
    predicted_rank: usize,
    link: Option<&ClusterSpec>,
    w: &Workload,
    codecs: &CodecRates,
    dir: &Path,
) -> anyhow::Result<Checked> {
    let c = results::collect(&[dir.to_path_buf()], None)?;
    let ran: Vec<&Summary> = c.summaries.iter().filter(|s| s.status != "skipped").collect();
    let sound: Vec<f64> = ran.iter().filter(|s| sound(s)).filter_map(|s| s.step_ms).collect();
    let why_not = if sound.is_empty() {
        Some(match c.summaries.iter().find(|s| !s.error.is_empty()) {
            Some(s) => format!("{}: {}", s.status, s.error),
            None if ran.is_empty() => "not run".into(),
            None if ran.iter().any(|s| s.dilation.is_some()) => {
                "no sound repeat: the cores did not keep up with the factor".into()
            }
            None => format!("no sound repeat: the cores were over {:.0}% busy", REPLAY_BUSY * 100.0),
        })
    } else {
        None
    };
    // What auto chose (1 where the cores were nearly idle: the run is then undilated); none on
    // real hosts.
    let dilation = c.dilations.first().map(|d| d.dilation).or_else(|| ran.iter().find_map(|s| s.dilation));
    let on_link = on_measured_link(p, link, w, codecs, dilation)?;
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
        dilation,
        codec_ms: p.codec_s * 1e3,
        why_not,
        dir: dir.to_path_buf(),
    })
}

/// The step predicted beside a measurement, ms: for the link as measured (none where it was
/// not), and the codecs as the run had them, a cluster dilated D times running them D times
/// faster than this machine's core ([`CodecRates::dilated`]).
fn on_measured_link(
    p: &Prediction,
    link: Option<&ClusterSpec>,
    w: &Workload,
    codecs: &CodecRates,
    dilation: Option<f64>,
) -> anyhow::Result<Option<f64>> {
    let world = codecs.dilated(dilation.unwrap_or(1.0));
    Ok(match link {
        Some(l) => Some(predict(w, l, &p.config, &world)?.step_s * 1e3),
        None => None,
    })
}

/// The measured order, the errors and the verdict of what ran on `testbed` for `spec`.
pub fn report(
    testbed: &Testbed,
    spec: &ClusterSpec,
    checked: Vec<Checked>,
    not_checked: Vec<(String, String)>,
) -> CheckReport {
    let mut measured_order: Vec<usize> =
        (0..checked.len()).filter(|&i| checked[i].measured_ms.is_some()).collect();
    measured_order.sort_by(|&a, &b| {
        checked[a].measured_ms.partial_cmp(&checked[b].measured_ms).unwrap_or(std::cmp::Ordering::Equal)
    });
    let errors: Vec<f64> = checked.iter().filter_map(Checked::error).map(f64::abs).collect();
    let verdict = verdict(&checked, &measured_order);
    CheckReport {
        testbed: testbed.kind(),
        cluster: testbed.describe(spec),
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
    let verdict = match pick {
        Some(p) if p.label == b.label && b.untested_codec_ms().is_some() => format!(
            "{said} It is the advisor's pick, and measurement and prediction agree on its bytes; {}.",
            b.codecs_note()
        ),
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
                Some(m) => match b.untested_codec_ms() {
                    // The measured fastest won on codecs the dilated cluster ran D times faster.
                    Some(left_out) => {
                        let estimate = b.measured_ms.unwrap_or(0.0) + left_out;
                        format!(
                            "{said} The advisor picked {}, which measured {m:.1} ms ({:+.0}%), but {}: with the rest \
                             of that codec time added back it would take about {estimate:.1} ms a step (an \
                             estimate), {}.",
                            p.label,
                            (m / b.measured_ms.unwrap_or(m) - 1.0) * 100.0,
                            b.codecs_note(),
                            if estimate > m {
                                "slower than the pick: the advice's order stands"
                            } else {
                                "still faster than the pick: the measured order is the one to go by"
                            }
                        )
                    }
                    None => format!(
                        "{said} The advisor picked {}, which measured {m:.1} ms ({:+.0}%): they disagree, and \
                         the measured order is the one to go by.",
                        p.label,
                        (m / b.measured_ms.unwrap_or(m) - 1.0) * 100.0
                    ),
                },
                None => format!("{said} The advisor's pick, {}, has no sound measurement.", p.label),
            }
        }
        None => said,
    };
    // Every compressed configuration measured dilated is read with the caveat, once.
    let others: Vec<String> = checked
        .iter()
        .filter(|c| c.measured_ms.is_some() && c.untested_codec_ms().is_some())
        .map(Checked::codecs_note)
        .filter(|note| !verdict.contains(note.as_str()))
        .collect();
    if others.is_empty() { verdict } else { format!("{verdict} Beside it, {}.", others.join("; ")) }
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

    /// The real hosts of `--hosts h1,h2` (binaries never read: nothing is run).
    fn hosts() -> Testbed {
        let local = crate::binaries::LocalBinaries {
            paths: ["w", "s", "b"].map(PathBuf::from),
            expected: Vec::new(),
        };
        let pool = crate::pools::PoolSpec::Hosts { list: "h1,h2".into(), ssh: Default::default() };
        Testbed::Real { pool, local }
    }

    fn replayed(batch: Option<usize>, tflops: Option<f64>) -> Replayed<'static> {
        Replayed { model: "resnet50", batch, rates: (tflops, None) }
    }

    /// On every testbed: the top N it can run, those it cannot named with the reason, and
    /// plain DDP added where the top N leave it out.
    #[test]
    fn the_plan_is_the_runnable_top_n_and_plain_ddp() {
        let (c, r) = ranked("4x1:10gbit");
        for testbed in [Testbed::Emulated, hosts()] {
            let unrunnable = |p: &Prediction| testbed.unrunnable(&p.config, &c);
            let plan = plan(replayed(None, None), &testbed, &c, &r, None, 3);
            let top: Vec<&Prediction> = r.iter().filter(|p| unrunnable(p).is_none()).take(3).collect();
            let plain = |p: &Prediction| p.label == "ddp-tcp flat ring, 25 MB buckets";
            assert_eq!(plan.configs.len(), top.len() + usize::from(!top.iter().any(|p| plain(p))));
            assert!(
                plan.configs.iter().any(plain),
                "{:?}",
                plan.configs.iter().map(|p| &p.label).collect::<Vec<_>>()
            );
            assert!(plan.configs.iter().all(|p| unrunnable(p).is_none()));
            // Those skipped are the ones ranked above the last checked, each with why.
            let last = r.iter().position(|p| p.config == top.last().unwrap().config).unwrap();
            let skipped: Vec<&str> =
                r[..last].iter().filter(|p| unrunnable(p).is_some()).map(|p| p.label.as_str()).collect();
            assert_eq!(plan.not_checked.iter().map(|(l, _)| l.as_str()).collect::<Vec<_>>(), skipped);
            for (label, why) in &plan.not_checked {
                assert!(why.contains("not checked"), "{label}: {why}");
            }
            // The pick goes first, wherever it ranks (top-k may rank above it).
            let at = r.iter().position(|p| unrunnable(p).is_none() && p.label != r[0].label).unwrap();
            let with_pick = super::plan(replayed(None, None), &testbed, &c, &r, Some(at), 2);
            assert_eq!(with_pick.configs[0].label, r[at].label);
            assert_eq!(with_pick.configs.iter().filter(|p| p.label == r[at].label).count(), 1);
        }
        // What each cannot run differs: the emulated cluster places servers either way, the
        // real hosts (all of them the workers') cannot give servers hosts of their own.
        let coloc = |colocated| Config {
            exchange: Exchange::Ps { servers: 4, colocated },
            bucket_mb: None,
            compression: Compression::None,
        };
        assert_eq!(Testbed::Emulated.unrunnable(&coloc(true), &c), None);
        assert_eq!(hosts().unrunnable(&coloc(true), &c), None);
        assert!(hosts().unrunnable(&coloc(false), &c).unwrap().contains("hosts of their own"));
        assert_eq!(Testbed::Emulated.unrunnable(&coloc(false), &c), None);
    }

    /// Each configuration's scenario: its mode, its servers and bucket size, the model's
    /// batch and rate; on the emulated cluster its hosts and ranks a host, dilated
    /// automatically; on real hosts its ranks, undilated, as `compare --hosts` takes them.
    #[test]
    fn a_configurations_scenario_places_it_as_the_testbed_says() {
        let (c, r) = ranked("4x2:10gbit:pcie");
        for testbed in [Testbed::Emulated, hosts()] {
            let plan = plan(replayed(Some(32), Some(100.0)), &testbed, &c, &r, None, 50);
            let hier = plan
                .configs
                .iter()
                .find(|p| p.config.exchange == Exchange::Hierarchical && p.config.compression.is_none())
                .unwrap();
            let s = scenario(&plan, &c, hier).unwrap();
            assert_eq!(s.modes[0].label(), "ddp-hier");
            assert_eq!(
                (s.bucket_mb, s.batches.as_slice(), s.device_tflops),
                (hier.config.bucket_mb, &[32 * 8][..], Some(100.0))
            );
            let ps = plan.configs.iter().find(|p| matches!(p.config.exchange, Exchange::Ps { .. })).unwrap();
            let ps_run = scenario(&plan, &c, ps).unwrap().expand().remove(0);
            let Exchange::Ps { servers, .. } = ps.config.exchange else { unreachable!() };
            assert_eq!((ps_run.shards, ps_run.workers), (servers, 8));
            match testbed {
                Testbed::Emulated => {
                    assert_eq!((s.hosts.as_slice(), s.ranks_per_host.as_slice()), (&[4][..], &[2][..]));
                    assert_eq!(s.dilate, Some(crate::scenario::Dilate::Auto));
                    // The servers where the configuration puts them.
                    assert_eq!(Some(ps_run.colocated), ps.config.servers().map(|(_, c)| c));
                }
                Testbed::Real { .. } => {
                    // What `compare` takes: its ranks alone, no emulated hosts, no factor.
                    assert_eq!((s.workers.as_slice(), s.hosts.is_empty()), (&[8][..], true));
                    assert_eq!((s.ranks_per_host.as_slice(), s.dilate), (&[1][..], None));
                    assert_eq!(ps.config.servers(), Some((4, true)), "colocated, one a host");
                    assert!(!ps_run.colocated, "compare's placement puts the servers");
                }
            }
        }
    }

    /// A repeat counts when complete and, where its summary says so, not saturated: a
    /// dilated one by its factor's checks, an undilated one by its cores' busy share, and one
    /// on other hosts (no share measured) when complete.
    #[test]
    fn a_sound_repeat_is_complete_and_not_saturated_where_measured() {
        let run = |status: &str, busy: Option<f64>, dilation: Option<f64>| Summary {
            status: status.into(),
            cpu_busy: busy,
            dilation,
            ..Summary::default()
        };
        assert!(sound(&run("ok", None, None)), "on real hosts: complete is enough");
        assert!(!sound(&run("failed", None, None)));
        assert!(sound(&run("ok", Some(0.5), None)) && !sound(&run("ok", Some(0.9), None)));
        assert!(sound(&run("ok", Some(0.4), Some(8.0))));
        let short = Summary { dilation_too_small: true, ..run("ok", Some(0.4), Some(8.0)) };
        assert!(!sound(&short));
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
            codec_ms: 0.0,
            why_not: meas.is_none().then(|| "skipped: needs about 30 GiB".into()),
            dir: PathBuf::new(),
        }
    }

    /// A dilated run's codecs ran D times faster: the prediction beside it prices them so, and
    /// the verdict says what its measurement leaves out rather than taking its order as the
    /// one to go by.
    #[test]
    fn a_dilated_compressed_run_is_predicted_and_read_with_its_codecs_d_times_faster() {
        let (c, r) = ranked("4x1:10gbit");
        let w = Workload::new(&builtin("resnet50", DeviceRate::H100).unwrap(), 64).unwrap();
        let codecs = CodecRates {
            half_encode_s: 1e-9,
            half_decode_s: 1e-9,
            topk_select_s: 3e-9,
            topk_add_s: 5e-9,
            source: "test".into(),
        };
        let fp16 = r.iter().find(|p| p.config.compression == Compression::Fp16).unwrap();
        let at = |d: Option<f64>| on_measured_link(fp16, Some(&c), &w, &codecs, d).unwrap().unwrap();
        let plain = predict(&w, &c, &fp16.config, &codecs).unwrap().step_s * 1e3;
        let fast = predict(&w, &c, &fp16.config, &codecs.dilated(8.0)).unwrap().step_s * 1e3;
        assert!(fast < plain, "{fast} against {plain}");
        assert_eq!((at(None), at(Some(1.0)), at(Some(8.0))), (plain, plain, fast));

        let spec = ClusterSpec::parse("4x1:10gbit").unwrap();
        let compressed = |codec_ms: f64, meas: f64| Checked {
            codec_ms,
            is_pick: false,
            ..checked("fp16", 2, 95.0, Some(meas), Some((meas - 1.0, meas + 1.0)))
        };
        let pick = checked("ring", 1, 100.0, Some(100.0), Some((99.0, 101.0)));
        // 90 ms measured with 40 ms of codecs priced, 35 of them left out at x8: about 125.
        let stands = report(&Testbed::Emulated, &spec, vec![pick.clone(), compressed(40.0, 90.0)], vec![]);
        let v = &stands.verdict;
        assert!(v.contains("Measured fastest: fp16") && v.contains("ran 8x faster"), "{v}");
        assert!(v.contains("about 125.0 ms") && v.contains("the advice's order stands"), "{v}");
        assert!(!v.contains("they disagree, and the measured order"), "{v}");
        // 2 ms of codecs: 91.8 ms, still faster.
        let still = report(&Testbed::Emulated, &spec, vec![pick.clone(), compressed(2.0, 90.0)], vec![]);
        assert!(still.verdict.contains("still faster than the pick"), "{}", still.verdict);
        // The pick fastest, a compressed one behind it: the caveat is said of it too, once.
        let behind = report(&Testbed::Emulated, &spec, vec![pick.clone(), compressed(40.0, 110.0)], vec![]);
        let v = &behind.verdict;
        assert!(v.contains("agree") && v.matches("fp16's codecs").count() == 1, "{v}");
        // Undilated, nothing is left out and nothing is said.
        let real = |mut c: Checked| {
            c.dilation = None;
            c
        };
        let undilated = report(&hosts(), &spec, vec![real(pick), real(compressed(40.0, 90.0))], vec![]);
        let v = &undilated.verdict;
        assert!(v.contains("they disagree, and the measured order") && !v.contains("codecs"), "{v}");
    }

    /// Ranked by measurement; the errors over the measured ones; the verdict says whether the
    /// pick held, was level or lost, and the page and the text carry every row.
    #[test]
    fn the_verdict_ranks_by_measurement_and_states_the_error() {
        let spec = ClusterSpec::parse("4x1:10gbit").unwrap();
        let lost = report(
            &Testbed::Emulated,
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
            &Testbed::Emulated,
            &spec,
            vec![
                checked("a", 1, 100.0, Some(104.0), Some((98.0, 110.0))),
                checked("b", 2, 110.0, Some(101.0), Some((99.0, 103.0))),
            ],
            vec![],
        );
        assert!(level.verdict.contains("level with it"), "{}", level.verdict);
        let held = report(
            &Testbed::Emulated,
            &spec,
            vec![checked("a", 1, 100.0, Some(99.0), Some((98.0, 100.0)))],
            vec![],
        );
        assert!(held.verdict.contains("agree"), "{}", held.verdict);
        let none = report(&Testbed::Emulated, &spec, vec![checked("a", 1, 100.0, None, None)], vec![]);
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

        // On real hosts: the same table and verdict, no factor anywhere, the page's caveats
        // and its sentence on how the runs were made the hosts'.
        let undilated = |mut c: Checked| {
            c.dilation = None;
            c
        };
        let real = report(
            &hosts(),
            &spec,
            vec![undilated(checked("a", 1, 100.0, Some(99.0), Some((98.0, 100.0))))],
            vec![(
                "ps-bsp, 4 servers on their own hosts".into(),
                "need 4 host(s) beyond: not checked".into(),
            )],
        );
        assert_eq!(real.testbed, Kind::Hosts);
        assert!(real.verdict.contains("agree"), "{}", real.verdict);
        let text = crate::advise::page::text(&real);
        assert!(
            text.contains(
                "check: measured on 4 host(s) x 1 rank(s) at 10 Gbit/s as measured, the real hosts of \
                 --hosts h1,h2"
            ) && text.contains("99.0 (2 of 2) ")
                && text.contains("not checked: ps-bsp, 4 servers on their own hosts"),
            "{text}"
        );
        let html = crate::advise::page::html("resnet50", &real).unwrap();
        assert!(
            html.contains("What the check on the hosts is not")
                && html.contains("gradsync-bench compare --hosts")
                && !html.contains("dilat")
                && !html.contains("factor"),
            "{html}"
        );
    }
}
