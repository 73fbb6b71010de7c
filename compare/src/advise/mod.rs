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
//! - [`error`]: what the advisor refuses.
//! - this file: the flags and the command.

pub mod codec;
pub mod config;
pub mod error;
pub mod measure;
pub mod predict;
pub mod report;
pub mod search;
pub mod spec;

use std::time::Instant;

use clap::Args;
use gradsync_core::model::ModelSpec;
use gradsync_core::profile::Profile;

use codec::CodecRates;
use error::AdviseError;
use predict::Workload;
use report::{ModelFacts, NOT_MODELLED, Report};
use search::Space;
use spec::{ClusterSpec, IntraKind};

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
    /// Print the advice as JSON (every configuration with its bucket timeline).
    #[arg(long)]
    pub json: bool,
}

/// Run `gradsync-bench advise`.
pub fn run(a: &AdviseArgs) -> anyhow::Result<()> {
    let cluster = cluster(a)?;
    let t = Instant::now();
    let report = advise(a, cluster)?;
    let took = t.elapsed();
    if a.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", report.text(a.top));
    }
    eprintln!(
        "gradsync-bench advise: {} configurations predicted, and again to find where the pick changes, in {:.0} ms",
        report.advice.ranked.len(),
        took.as_secs_f64() * 1e3
    );
    Ok(())
}

/// The cluster the flags name: a SPEC or TOML file, or hosts measured.
fn cluster(a: &AdviseArgs) -> anyhow::Result<ClusterSpec> {
    if let Some(spec) = &a.cluster {
        if a.intra.is_some() {
            anyhow::bail!("--intra goes with --hosts or --slurm; with --cluster name the link in the SPEC");
        }
        return Ok(ClusterSpec::parse_arg(spec)?);
    }
    let m = match &a.hosts {
        Some(list) => measure::Measured::Hosts { list: list.clone(), ssh_opts: a.ssh_opts.clone() },
        None => measure::Measured::Slurm,
    };
    // The hosts' check writes nothing here: their files stay on them until tidied.
    measure::cluster(&m, a.intra, &std::env::temp_dir())
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
        kind: "prediction",
        model: ModelFacts::of(&w),
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
