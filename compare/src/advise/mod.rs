//! `gradsync-bench advise --model M --cluster SPEC`: which configuration to train `M` with on a
//! cluster (parameter server or ring, how many servers and where, which bucket size, whether
//! to compress), answered by predicting one step of every configuration, in well under a
//! second, without running anything. Every figure it prints is a prediction and says so.
//!
//! The model is a profile (a built-in, estimated at `--device-tflops` / `--device-tbps`, an
//! H100's by default; or `profile:FILE`, measured by `bench/pytorch/profile_model.py` or, for
//! gradsync's own presets, `gradsync-bench replay record`). The cluster is a SPEC string or
//! TOML file ([`spec`]), or hosts whose NIC is measured (`--hosts`, `--slurm`: [`measure`]).
//!
//! # Layout
//! - [`spec`]: the cluster: the SPEC grammar, the TOML form, the links inside a host and the
//!   sources of their default figures.
//! - [`config`]: one configuration: its exchange, bucket size and compression, the compared
//!   mode it runs as and its flags, what it does to accuracy.
//! - [`predict`]: the step predictor, a per-bucket timeline over the real bucket plan, the
//!   model it implements and its assumptions.
//! - [`codec`]: the compression codecs' time per value, measured here.
//! - [`search`]: the configurations searched, the ranking, the pick and the term that decides
//!   it, and where the pick would change.
//! - [`measure`]: a cluster from `--hosts` or `--slurm`, its NIC measured by the raw-TCP
//!   yardstick.
//! - [`report`]: the advice as JSON and as text.
//! - [`check`]: `--check N`, the top configurations and plain DDP run as short replays and
//!   measured beside predicted, written once for every testbed.
//! - [`testbed`]: where the check runs them and what differs there: a dilated emulated
//!   cluster matching the SPEC, or the real hosts of `--hosts` and `--slurm`, undilated; what
//!   each can run, and where its link as measured comes from.
//! - [`validate`]: `gradsync-bench validate`, the predictions against emulated clusters'
//!   runs (the validation matrix): the errors, the alpha-beta model's beside, the picks.
//! - [`loopback`]: `validate --loopback`, the same against `compare`'s runs of real models on
//!   this machine's loopback, their profiles recorded by `replay record`.
//! - [`page`]: the check's table and its `report.html` (template in `templates/check.html`).
//! - [`error`]: what the advisor refuses.
//! - this file: the flags and the commands (`advise`, and `validate`'s over [`validate`] and
//!   [`loopback`]).

pub mod check;
pub mod codec;
pub mod config;
pub mod error;
pub mod loopback;
pub mod measure;
pub mod page;
pub mod predict;
pub mod report;
pub mod search;
pub mod spec;
pub mod testbed;
pub mod validate;

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::Context;
use clap::Args;
use gradsync_core::model::ModelSpec;
use gradsync_core::profile::Profile;

use crate::binaries::LocalBinaries;
use crate::modes::Bins;
use crate::pools::PoolSpec;
use crate::ssh::SshArgs;
use codec::CodecRates;
use error::AdviseError;
use predict::Workload;
use report::{NOT_MODELLED, Report};
use search::Space;
use spec::{ClusterSpec, IntraKind};
use testbed::Testbed;

/// Flags of `gradsync-bench advise`.
#[derive(Debug, Clone, Args)]
pub struct AdviseArgs {
    /// The model: a built-in profile (resnet50, vgg16, bert-base, gpt2) or profile:FILE
    /// (bench/pytorch/profile_model.py writes one for any PyTorch module; `gradsync-bench
    /// replay record` for gradsync's own presets).
    #[arg(long)]
    pub model: String,
    /// The cluster: HOSTSxPERHOST:RATE[,LATENCY][:INTRA[,RATE][,LATENCY]], e.g.
    /// 8x8:100gbit:nvlink, 4x1:10gbit,20us or 16x8:25gbit,5us:pcie; INTRA is nvlink, pcie or
    /// shm. Or a TOML file of the same fields (docs/advisor.md).
    #[arg(long, required_unless_present_any = ["hosts", "slurm"], conflicts_with_all = ["hosts", "slurm"])]
    pub cluster: Option<String>,
    /// Measure the cluster instead: these hosts over ssh (a hostfile of `node0 slots=8` lines,
    /// or node0:8,node1:8; slots are ranks a host), the NIC by the raw-TCP yardstick between
    /// the first two.
    #[arg(long, conflicts_with = "slurm")]
    pub hosts: Option<String>,
    /// Measure the cluster instead: the nodes of the Slurm allocation this runs in.
    #[arg(long)]
    pub slurm: bool,
    /// With --hosts or --slurm and several slots a host: the link between one host's ranks.
    #[arg(long, value_enum)]
    pub intra: Option<IntraKind>,
    /// More ssh options for --hosts (`-F FILE -o User=me`).
    #[arg(long, requires = "hosts")]
    pub ssh_opts: Option<String>,
    /// Samples per step per worker (default: the profile's batch); compute scales with it.
    #[arg(long)]
    pub batch: Option<usize>,
    /// A built-in profile's sustained TFLOP/s (default: an H100 SXM's).
    #[arg(long)]
    pub device_tflops: Option<f64>,
    /// A built-in profile's memory bandwidth, TB/s (default: an H100 SXM's).
    #[arg(long)]
    pub device_tbps: Option<f64>,
    /// DDP and ZeRO-1 bucket sizes searched, MB (`--bucket-mb` of `train`).
    #[arg(long, value_delimiter = ',', default_value = "1,5,25,100")]
    pub bucket_mb: Vec<f64>,
    /// Top-k's ratio (the share of values sent).
    #[arg(long, default_value_t = 0.01)]
    pub topk_ratio: f64,
    /// Leave top-k out of the search.
    #[arg(long)]
    pub no_topk: bool,
    /// Price compression by its bytes alone, its codecs taking no time, instead of measuring
    /// gradsync's codecs on this machine.
    #[arg(long)]
    pub free_codecs: bool,
    /// Rows of the ranked table (--json holds every configuration).
    #[arg(long, default_value_t = 15)]
    pub top: usize,
    /// Print the advice as JSON (every configuration with its bucket timeline; with --check,
    /// the measurements too).
    #[arg(long)]
    pub json: bool,
    /// Run the top N configurations and plain DDP as short replays, put measured beside
    /// predicted and write report.html (docs/advisor.md): with --cluster on a dilated emulated
    /// cluster matching it (needs root and iproute2); with --hosts or --slurm on those hosts
    /// themselves, as `compare --hosts` / `--slurm` runs a scenario there. 0: predict only.
    #[arg(long, default_value_t = 0)]
    pub check: usize,
    /// With --check: steps of each run (the first, the warm-up, left out of its mean).
    #[arg(long, default_value_t = check::CHECK_STEPS, requires = "check", value_parser = clap::value_parser!(u64).range(2..))]
    pub check_steps: u64,
    /// With --check: the run directory (default: runs/advise-<UTC timestamp>).
    #[arg(long, requires = "check")]
    pub out: Option<std::path::PathBuf>,
    /// With --check: the directory holding gradsync-worker and gradsync-server (default:
    /// beside this program).
    #[arg(long, env = "GRADSYNC_BIN_DIR")]
    pub bin_dir: Option<std::path::PathBuf>,
}

/// Run `gradsync-bench advise`.
pub fn run(a: &AdviseArgs) -> anyhow::Result<()> {
    let pool = pool(a);
    // What the advisor cannot predict for, and what --check cannot run with, is refused
    // before any host is reached.
    if let Some(p) = &pool {
        measure::listed(p, a.intra)?;
    }
    let checking = match a.check {
        0 => None,
        _ => Some(check_setup(a)?),
    };
    let local = match &pool {
        Some(_) => Some(LocalBinaries::of(&Bins::find(a.bin_dir.as_deref())?)?),
        None => None,
    };
    let cluster = cluster(a, pool.as_ref().zip(local.as_ref()))?;
    let t = Instant::now();
    let mut report = advise(a, cluster)?;
    let took = t.elapsed();
    if !a.json {
        print!("{}", report.text(a.top));
    }
    eprintln!(
        "gradsync-bench advise: {} configurations predicted, and again to find where the pick changes, in {:.0} ms",
        report.advice.ranked.len(),
        took.as_secs_f64() * 1e3
    );
    if let Some((bins, out)) = checking {
        let testbed = match (pool, local) {
            (Some(pool), Some(local)) => Testbed::Real { pool, local },
            _ => Testbed::Emulated,
        };
        let checked = run_check(a, &report, &testbed, &bins, &out)?;
        if !a.json {
            print!("{}", page::text(&checked));
        }
        report.check = Some(checked);
    }
    if a.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    }
    Ok(())
}

/// The hosts the flags name to be measured (`--hosts`, `--slurm`), if any.
fn pool(a: &AdviseArgs) -> Option<PoolSpec> {
    let ssh = |list: &String| PoolSpec::Hosts {
        list: list.clone(),
        ssh: SshArgs { ssh_opts: a.ssh_opts.clone(), ..SshArgs::default() },
    };
    match (&a.hosts, a.slurm) {
        (Some(list), _) => Some(ssh(list)),
        (None, true) => Some(PoolSpec::Slurm { copy_binaries: false }),
        (None, false) => None,
    }
}

/// What `--check` runs with, found before anything is measured: the binaries and the run
/// directory, which must not exist yet.
fn check_setup(a: &AdviseArgs) -> anyhow::Result<(Bins, PathBuf)> {
    let bins = Bins::find(a.bin_dir.as_deref())?;
    let out =
        a.out.clone().unwrap_or_else(|| PathBuf::from("runs").join(format!("advise-{}", crate::utc_stamp())));
    anyhow::ensure!(!out.exists(), "{} already exists; choose another --out", out.display());
    Ok((bins, out))
}

/// `--check`: the plan run on `testbed`, the page written beside the runs in `out`.
fn run_check(
    a: &AdviseArgs,
    report: &Report,
    testbed: &Testbed,
    bins: &Bins,
    out: &Path,
) -> anyhow::Result<check::CheckReport> {
    let profile = profile(&a.model, a.device_tflops, a.device_tbps)?;
    let w = Workload::new(&profile, a.batch.unwrap_or(profile.batch))?;
    let (ranked, pick) = (&report.advice.ranked, report.advice.verdict.as_ref().map(|v| v.pick));
    let replayed =
        check::Replayed { model: &a.model, batch: a.batch, rates: (a.device_tflops, a.device_tbps) };
    let mut plan = check::plan(replayed, testbed, &report.cluster, ranked, pick, a.check);
    plan.steps = a.check_steps;
    let checked = check::run(&plan, &report.cluster, &w, &report.codecs, ranked, pick, bins, out)?;
    let html = out.join("report.html");
    std::fs::write(&html, page::html(&a.model, &checked)?)
        .with_context(|| format!("writing {}", html.display()))?;
    let json = out.join("check.json");
    std::fs::write(&json, serde_json::to_string_pretty(&checked)? + "\n")
        .with_context(|| format!("writing {}", json.display()))?;
    eprintln!("gradsync-bench advise --check: report in {}", html.display());
    Ok(checked)
}

/// The cluster the flags name: a SPEC or TOML file, or the hosts of `pool` measured (with
/// this machine's binaries, which they must have).
fn cluster(a: &AdviseArgs, pool: Option<(&PoolSpec, &LocalBinaries)>) -> anyhow::Result<ClusterSpec> {
    let Some((pool, local)) = pool else {
        let spec = a.cluster.as_deref().context("--cluster, --hosts or --slurm names the cluster")?;
        if a.intra.is_some() {
            anyhow::bail!("--intra goes with --hosts or --slurm; with --cluster name the link in the SPEC");
        }
        return Ok(ClusterSpec::parse_arg(spec)?);
    };
    // The hosts' check writes nothing here: their files stay on them until tidied.
    measure::cluster(pool, local, a.intra, &std::env::temp_dir())
}

/// The advice for the flags' model on `cluster`.
pub fn advise(a: &AdviseArgs, cluster: ClusterSpec) -> anyhow::Result<Report> {
    let profile = profile(&a.model, a.device_tflops, a.device_tbps)?;
    let w = Workload::new(&profile, a.batch.unwrap_or(profile.batch))?;
    let space = Space::new(a.bucket_mb.clone(), (!a.no_topk).then_some(a.topk_ratio))?;
    let codecs =
        if a.free_codecs { CodecRates::free() } else { CodecRates::measure(a.topk_ratio.clamp(1e-6, 1.0))? };
    let advice = search::advise(&w, &cluster, &codecs, &space)?;
    Ok(Report {
        check: None,
        kind: "prediction",
        model: w,
        cluster,
        codecs,
        space,
        advice,
        not_modelled: NOT_MODELLED.to_vec(),
    })
}

/// The profile `model` names, at the device rate given (built-ins only).
pub fn profile(model: &str, tflops: Option<f64>, tbps: Option<f64>) -> Result<Profile, AdviseError> {
    let bad = |why: String| AdviseError::Model { model: model.to_string(), why };
    let spec = ModelSpec::parse(model).map_err(|e| bad(e.to_string()))?;
    let spec = spec.with_rates(tflops, tbps).map_err(|e| bad(e.to_string()))?;
    spec.profile().cloned().ok_or_else(|| {
        bad(format!(
            "gradsync trains it for real and holds no profile of it to predict from: record one with \
             `gradsync-bench replay record --model {model} --out {model}.json`, then give --model profile:{model}.json"
        ))
    })
}

/// `gradsync-bench validate`'s flags.
#[derive(Debug, clap::Args)]
pub struct ValidateArgs {
    /// Emulated clusters' run directories (`gradsync-bench cluster --out`), or directories
    /// holding them (`scripts/advisor-matrix.sh OUT`).
    #[arg(required_unless_present_any = ["loopback", "with"])]
    pub dirs: Vec<PathBuf>,
    /// A validation saved with `--json` (docs/advisor-matrix.json): its groups that the
    /// directories do not hold are kept beside theirs, and the errors are over both.
    #[arg(long, value_name = "FILE")]
    pub with: Option<PathBuf>,
    /// A comparison's directory on this machine's loopback (`gradsync-bench compare --out`),
    /// its models trained for real; repeatable. Needs `--profile` for each model.
    #[arg(long, value_name = "DIR")]
    pub loopback: Vec<PathBuf>,
    /// A profile of a model the `--loopback` runs trained (`gradsync-bench replay record`);
    /// repeatable.
    #[arg(long, value_name = "FILE", requires = "loopback")]
    pub profile: Vec<PathBuf>,
    /// Print JSON instead of Markdown: `{"clusters": ..., "loopback": ...}`, either null
    /// where not asked for.
    #[arg(long)]
    pub json: bool,
}

/// Run `gradsync-bench validate`.
pub fn run_validate(a: &ValidateArgs) -> anyhow::Result<()> {
    let fresh = (!a.dirs.is_empty()).then(|| validate::validate(&a.dirs)).transpose()?;
    let saved = a.with.as_deref().map(validate::load_saved).transpose()?;
    let clusters = match (fresh, saved) {
        (Some(f), Some(s)) => Some(validate::merged(f, s)),
        (f, s) => f.or(s),
    };
    let loopback =
        (!a.loopback.is_empty()).then(|| loopback::validate(&a.loopback, &a.profile)).transpose()?;
    if a.json {
        let v = serde_json::json!({ "clusters": clusters, "loopback": loopback });
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    if let Some(v) = &clusters {
        print!("{}", validate::markdown(v));
    }
    if let Some(v) = &loopback {
        if clusters.is_some() {
            println!();
        }
        println!("On this machine's loopback (`compare`'s runs of models trained for real):\n");
        print!("{}", validate::markdown(v));
    }
    Ok(())
}
