//! The experiment matrix: a TOML scenario and its expansion into runs. Every run of a scenario
//! shares the seed, the data, the global batch and the step budget, so the modes differ only in
//! how they synchronise.

use std::fmt;
use std::path::Path;
use std::str::FromStr;

use anyhow::Context;
use gradsync_core::compress::Compression;
use gradsync_core::optim::SgdConfig;
use gradsync_worker::modes::{self, COMPARED, Compared};
use serde::{Deserialize, Serialize};

/// The scenario `gradsync-bench compare` runs when given none.
pub const DEFAULT: &str = include_str!("../../bench/scenarios/default.toml");

/// One way of training that the comparison runs: an entry of the worker's table of compared
/// modes ([`gradsync_worker::modes::COMPARED`]), which says what each is, the flags that make
/// it, its servers, its wire and what it needs. Ordered as that table (the report's order);
/// read and written by its name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ModeKind(usize);

// The modes this crate's code and tests name, under the names they had as variants, so that
// such code reads as it did; a mode needs none of these to be compared.
#[allow(non_upper_case_globals)]
impl ModeKind {
    /// local.
    pub const Local: ModeKind = ModeKind::named("local");
    /// dp.
    pub const Dp: ModeKind = ModeKind::named("dp");
    /// ps-bsp.
    pub const PsBsp: ModeKind = ModeKind::named("ps-bsp");
    /// ps-asp.
    pub const PsAsp: ModeKind = ModeKind::named("ps-asp");
    /// ps-ssp.
    pub const PsSsp: ModeKind = ModeKind::named("ps-ssp");
    /// ddp-tcp.
    pub const DdpTcp: ModeKind = ModeKind::named("ddp-tcp");
    /// ddp-hier.
    pub const DdpHier: ModeKind = ModeKind::named("ddp-hier");
    /// ddp-shm.
    pub const DdpShm: ModeKind = ModeKind::named("ddp-shm");
    /// ddp-nccl.
    pub const DdpNccl: ModeKind = ModeKind::named("ddp-nccl");
    /// zero1-tcp.
    pub const Zero1Tcp: ModeKind = ModeKind::named("zero1-tcp");
    /// ps-bsp-fp16.
    pub const PsBspFp16: ModeKind = ModeKind::named("ps-bsp-fp16");
    /// ps-bsp-topk.
    pub const PsBspTopk: ModeKind = ModeKind::named("ps-bsp-topk");
    /// ddp-tcp-topk.
    pub const DdpTcpTopk: ModeKind = ModeKind::named("ddp-tcp-topk");
    /// ddp-tcp-fp16.
    pub const DdpTcpFp16: ModeKind = ModeKind::named("ddp-tcp-fp16");
    /// ps-sparse.
    pub const PsSparse: ModeKind = ModeKind::named("ps-sparse");
    /// ddp-dense.
    pub const DdpDense: ModeKind = ModeKind::named("ddp-dense");
    /// ddp-allgather (`ddp-sparse` names it too).
    pub const DdpAllgather: ModeKind = ModeKind::named("ddp-allgather");
    /// hybrid.
    pub const Hybrid: ModeKind = ModeKind::named("hybrid");
}

impl ModeKind {
    /// Every mode, in report order.
    pub const ALL: [ModeKind; COMPARED.len()] = {
        let mut all = [ModeKind(0); COMPARED.len()];
        let mut i = 0;
        while i < all.len() {
            all[i] = ModeKind(i);
            i += 1;
        }
        all
    };

    /// The mode named `name`, checked as the code compiles.
    const fn named(name: &str) -> ModeKind {
        match modes::position(name) {
            Some(i) => ModeKind(i),
            None => panic!("no compared mode of this name in gradsync_worker::modes::COMPARED"),
        }
    }

    /// Its entry in the worker's table.
    pub fn compared(self) -> &'static Compared {
        &COMPARED[self.0]
    }

    /// The label used in file names, tables and charts.
    pub fn label(self) -> &'static str {
        self.compared().name
    }

    /// The uncompressed mode it compresses (itself for the others).
    pub fn base(self) -> ModeKind {
        ModeKind(modes::base(self.0))
    }

    /// Whether it compresses its gradients on the wire.
    pub fn is_compressed(self) -> bool {
        self.base() != self
    }

    /// Its `--compress` value (none for the uncompressed modes), top-k at `topk_ratio`.
    pub fn compress(self, topk_ratio: f64) -> Option<Compression> {
        self.compared().compression(topk_ratio)
    }

    /// What carries its traffic, for every label a reader sees: modes are only compared as
    /// like for like when this says so.
    pub fn wire(self) -> &'static str {
        self.compared().wire.describe()
    }

    /// Whether its traffic crosses TCP (so its figures compare with each other's).
    pub fn over_tcp(self) -> bool {
        self.compared().wire.over_tcp()
    }

    /// Whether it runs parameter servers (and so is crossed with shard counts): the hybrid's
    /// servers hold the table.
    pub fn is_ps(self) -> bool {
        self.compared().servers.is_some()
    }

    /// Whether its servers apply gradients as they arrive (ASP, SSP).
    pub fn is_async(self) -> bool {
        self.compared().servers.is_some_and(|s| !s.sync.is_synchronous())
    }

    /// Whether it is one of the comparison's ways of moving an embedding table, which only a
    /// model with a table can run (`ps-sparse`, `ddp-dense`, `ddp-allgather`, `hybrid`).
    pub fn needs_table(self) -> bool {
        self.compared().needs.table
    }

    /// Why it cannot train a model with an embedding table, if it cannot (the binaries refuse
    /// such a run; the scenario is refused before any starts).
    pub fn refuses_table(self) -> Option<&'static str> {
        self.compared().refuses_table
    }

    /// The mode a run of this one reads as from its metrics alone, where two names start the
    /// same processes: on a model with a table, ps-bsp is ps-sparse and ddp-tcp ddp-dense.
    /// The runner's record (`outcomes.jsonl`) keeps the name the scenario gave.
    pub fn same_run_as(self, other: ModeKind) -> bool {
        self.compared().same_processes(other.compared())
    }

    /// Whether it moves the ring all-reduce's bytes over the ring (DDP's all-reduce, or
    /// ZeRO-1's reduce-scatter and all-gather: the same two halves, split around the update):
    /// ddp-dense all-reduces the whole model, table included.
    pub fn is_ring(self) -> bool {
        self.compared().is_ring()
    }

    /// The mode a metrics header describes ([`modes::HeaderMode`]: `mode`, `variant`, for the
    /// TCP backend the transport it ran over and its all-reduce, the compression), if any. On
    /// a model with a table a PS worker under BSP is ps-sparse, and a DDP rank over TCP sockets
    /// ddp-allgather or ddp-dense by its `extra.sparse_grads`.
    pub fn from_header(h: &modes::HeaderMode) -> Option<ModeKind> {
        modes::from_header(h).map(ModeKind)
    }
}

impl fmt::Display for ModeKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.label())
    }
}

impl FromStr for ModeKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        modes::position(s).map(ModeKind).ok_or_else(|| {
            let names: Vec<_> = ModeKind::ALL.iter().map(|m| m.label()).collect();
            format!("unknown mode '{s}' (modes: {})", names.join(", "))
        })
    }
}

impl Serialize for ModeKind {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.label())
    }
}

impl<'de> Deserialize<'de> for ModeKind {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Name;
        impl serde::de::Visitor<'_> for Name {
            type Value = ModeKind;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("the name of a compared mode")
            }
            fn visit_str<E: serde::de::Error>(self, s: &str) -> Result<ModeKind, E> {
                modes::position(s).map(ModeKind).ok_or_else(|| E::unknown_variant(s, &modes::NAMES))
            }
        }
        d.deserialize_str(Name)
    }
}

impl clap::ValueEnum for ModeKind {
    fn value_variants<'a>() -> &'a [Self] {
        &ModeKind::ALL
    }

    fn to_possible_value(&self) -> Option<clap::builder::PossibleValue> {
        let c = self.compared();
        let value = clap::builder::PossibleValue::new(c.name).help(c.about);
        Some(c.aliases.iter().fold(value, |v, a| v.alias(a)))
    }
}

/// A scenario file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Scenario {
    /// A name for the report.
    pub name: String,
    /// Modes to run.
    pub modes: Vec<ModeKind>,
    /// Worker counts (give these or `hosts`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub workers: Vec<usize>,
    /// Worker host counts, instead of `workers`: each run has hosts x ranks_per_host workers
    /// (an emulated cluster's hosts, `gradsync-bench cluster`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub hosts: Vec<usize>,
    /// Worker ranks on each worker host (`gradsync-bench cluster`: that many ranks share each
    /// host's link; ddp-hier reduces inside each host first). Default `[1]`.
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub ranks_per_host: Vec<usize>,
    /// Model presets or widths.
    pub models: Vec<String>,
    /// Global batch sizes. Left out when every model is replayed: each worker then takes its
    /// profile's batch (local training one worker's).
    #[serde(default)]
    pub batches: Vec<usize>,
    /// A built-in replayed model's sustained TFLOP/s (the workers' `--device-tflops`).
    #[serde(default)]
    pub device_tflops: Option<f64>,
    /// A built-in replayed model's memory bandwidth, TB/s (`--device-tbps`).
    #[serde(default)]
    pub device_tbps: Option<f64>,
    /// Server shard counts (PS modes): numbers, or `"hosts"` (a shard per worker host) and
    /// `"hosts/N"` (one per N worker hosts).
    #[serde(default = "one_shard")]
    pub shards: Vec<Shards>,
    /// Where an emulated cluster puts a parameter server's shards (`gradsync-bench cluster`):
    /// `"apart"`, each on a host of its own (the default), and `"colocated"`, shard `i` on
    /// worker host `i`, sharing its NIC with that host's workers (it needs no more shards than
    /// worker hosts). Given both, every PS cell runs both ways.
    #[serde(default = "apart", skip_serializing_if = "is_apart")]
    pub servers: Vec<Servers>,
    /// SSP staleness bound.
    #[serde(default = "two")]
    pub ssp_staleness: u64,
    /// Steps per run (leave out to run `epochs`).
    #[serde(default)]
    pub steps: Option<u64>,
    /// Epochs per run, when `steps` is not given: every mode sees the same samples.
    #[serde(default)]
    pub epochs: Option<u64>,
    /// Held-out evaluation every this many samples (all workers together), in every mode.
    #[serde(default)]
    pub eval_samples: Option<u64>,
    /// Held-out accuracy (0..1) whose first crossing is each run's time-to-accuracy.
    #[serde(default)]
    pub target_accuracy: Option<f64>,
    /// Stop each run as soon as rank 0 measures `target_accuracy` (the budget then only bounds
    /// runs that never get there).
    #[serde(default)]
    pub stop_at_target: bool,
    /// Runs of every cell; repeat `r` (from 0) draws the data in the order of seed `seed + r`
    /// from the same initial parameters.
    #[serde(default = "three")]
    pub repeats: usize,
    /// ASP/SSP servers' staleness policy: `none` or `inverse` (lr / (staleness + 1)).
    #[serde(default)]
    pub staleness_lr: gradsync_core::optim::StalenessLr,
    /// Optional wall-clock budget per run, seconds: workers still running then are stopped and
    /// the run keeps the steps it took.
    #[serde(default)]
    pub time_s: Option<f64>,
    /// Seed of every run.
    #[serde(default = "seed")]
    pub seed: u64,
    /// Data source (the workers' `--data`); default: synthetic data shaped for the model.
    #[serde(default)]
    pub data: Option<String>,
    /// Worker device: cpu, cuda, auto.
    #[serde(default = "cpu")]
    pub device: String,
    /// CPU threads per process.
    #[serde(default = "one_usize")]
    pub threads: usize,
    /// Learning rate (default: the binaries' own, `SgdConfig::DEFAULT`).
    #[serde(default = "lr")]
    pub lr: f32,
    /// Momentum (default: the binaries' own).
    #[serde(default = "momentum")]
    pub momentum: f32,
    /// Weight decay (default: the binaries' own).
    #[serde(default = "weight_decay")]
    pub weight_decay: f32,
    /// DDP bucket size in MB (default: the worker's).
    #[serde(default)]
    pub bucket_mb: Option<f64>,
    /// Parameter-server chunk size in bytes, pushes and pulls (default: the tuned 1 MiB). The
    /// pipelined BSP step pulls a block once every worker has pushed it, so a shard of only a
    /// chunk or two has nothing to overlap.
    #[serde(default)]
    pub ps_chunk_bytes: Option<usize>,
    /// The top-k ratio of the `-topk` modes (`--compress topk:R`).
    #[serde(default = "topk_ratio")]
    pub topk_ratio: f64,
    /// Record Chrome trace-event timelines.
    #[serde(default)]
    pub trace: bool,
    /// Seconds before a run is stopped and reported as failed.
    #[serde(default = "timeout")]
    pub run_timeout_s: f64,
    /// Seconds of raw TCP bandwidth measurement.
    #[serde(default = "rawtcp")]
    pub rawtcp_s: f64,
    /// Straggler sweep: every run is repeated with `slow_rank` delayed by each of these
    /// milliseconds per step (`--slow-rank`); 0 is the undelayed run. Default `[0]`: no sweep.
    #[serde(default = "no_delay")]
    pub slow_ms: Vec<u64>,
    /// The rank (DP: replica) the sweep delays.
    #[serde(default)]
    pub slow_rank: usize,
    /// When a worker fails, stop the run's workers and start them all again from their newest
    /// checkpoint (`--resume`), up to this many times per run, as `gradsync-worker launch
    /// --max-restarts` does; the servers keep running. 0: a failure ends the run.
    #[serde(default)]
    pub max_restarts: u32,
    /// Faults injected into every run: this many times, a worker drawn at random (from `seed`
    /// and the repeat) is SIGKILLed once rank 0 has recorded a step drawn at random. Needs
    /// `steps` and rank 0 on this machine; the workers then keep checkpoints.
    #[serde(default)]
    pub kills: u32,
    /// With `max_restarts` or `kills`: the workers write a checkpoint every this many steps
    /// (default 5).
    #[serde(default = "five")]
    pub checkpoint_every: u64,
    /// Dilated time on an emulated cluster (`gradsync-bench cluster`; docs/cluster.md): a
    /// factor from 1 (`dilate = 8`), or `"auto"` to pick one from a short probe of the run.
    /// Left out: none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dilate: Option<Dilate>,
    /// Designs dilated by a factor of their own (`gradsync-bench cluster --dilate-for`),
    /// named as the report names them (`ddp-tcp`, `ps-bsp k=4`, `ps-bsp k=4 colocated`): each
    /// such run, and its self-check at twice it, at this factor instead of `dilate`'s. A ring
    /// costs the cores about half a parameter server's CPU per byte, so at one factor it idles
    /// them; at its own it measures the same emulated link in less wall time. Needs `dilate`.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub dilate_for: std::collections::BTreeMap<String, f64>,
}

/// Where a parameter server's shards go on an emulated cluster (a scenario's `servers`,
/// `cluster --servers`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Servers {
    /// Each shard on a host of its own, beside the worker hosts.
    Apart,
    /// Shard `i` on worker host `i`: its own workers' share of the exchange stays inside the
    /// host, and the host's NIC carries its workers' traffic and its shard's.
    Colocated,
}

/// How many parameter-server shards a run has (a scenario's `shards`, `cluster --shards`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shards {
    /// This many, from 1.
    Count(usize),
    /// One per this many worker hosts (`"hosts"`: 1, `"hosts/2"`: 2), at least one.
    PerHosts(usize),
}

impl Shards {
    /// Fixed counts.
    pub fn counts(k: &[usize]) -> Vec<Shards> {
        k.iter().map(|&k| Shards::Count(k)).collect()
    }

    /// The count for a run on `hosts` worker hosts.
    pub fn of(self, hosts: usize) -> usize {
        match self {
            Shards::Count(k) => k,
            Shards::PerHosts(d) => (hosts / d).max(1),
        }
    }
}

impl std::str::FromStr for Shards {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let bad = || format!("shards '{s}': expected a count from 1, `hosts` or `hosts/N`");
        let t = s.trim();
        let per = match t.strip_prefix("hosts") {
            Some("") => Some(1),
            Some(rest) => Some(rest.strip_prefix('/').and_then(|n| n.trim().parse().ok()).ok_or_else(bad)?),
            None => None,
        };
        match per {
            Some(0) => Err(bad()),
            Some(d) => Ok(Shards::PerHosts(d)),
            None => match t.parse() {
                Ok(k) if k > 0 => Ok(Shards::Count(k)),
                _ => Err(bad()),
            },
        }
    }
}

impl std::fmt::Display for Shards {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Shards::Count(k) => write!(f, "{k}"),
            Shards::PerHosts(1) => f.write_str("hosts"),
            Shards::PerHosts(d) => write!(f, "hosts/{d}"),
        }
    }
}

impl Serialize for Shards {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Shards::Count(k) => s.serialize_u64(*k as u64),
            Shards::PerHosts(_) => s.serialize_str(&self.to_string()),
        }
    }
}

impl<'de> Deserialize<'de> for Shards {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Number(i64),
            Text(String),
        }
        let text = match Raw::deserialize(d)? {
            Raw::Number(n) => n.to_string(),
            Raw::Text(t) => t,
        };
        text.parse().map_err(|e: String| serde::de::Error::custom(format!("`shards`: {e}")))
    }
}

/// How much a cluster's time is dilated (the scenario's `dilate`, `cluster --dilate`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Dilate {
    /// This factor, from 1.
    Factor(f64),
    /// Picked per link from a short probe of the runs, so that the cores stay below half busy.
    Auto,
}

impl std::str::FromStr for Dilate {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        if s.trim() == "auto" {
            return Ok(Dilate::Auto);
        }
        let d: f64 = s.trim().parse().map_err(|_| format!("'{s}': expected a factor from 1, or auto"))?;
        gradsync_core::dilation::Dilation::new("dilate", d).map_err(|e| e.to_string())?;
        Ok(Dilate::Factor(d))
    }
}

impl std::fmt::Display for Dilate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Dilate::Factor(d) => write!(f, "{d}"),
            Dilate::Auto => f.write_str("auto"),
        }
    }
}

impl Serialize for Dilate {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Dilate::Factor(d) => s.serialize_f64(*d),
            Dilate::Auto => s.serialize_str("auto"),
        }
    }
}

impl<'de> Deserialize<'de> for Dilate {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Number(f64),
            Text(String),
        }
        let text = match Raw::deserialize(d)? {
            Raw::Number(n) => n.to_string(),
            Raw::Text(t) => t,
        };
        text.parse().map_err(|e: String| serde::de::Error::custom(format!("`dilate`: {e}")))
    }
}

fn one() -> Vec<usize> {
    vec![1]
}
fn is_one(v: &[usize]) -> bool {
    v == [1]
}
fn one_shard() -> Vec<Shards> {
    vec![Shards::Count(1)]
}
fn apart() -> Vec<Servers> {
    vec![Servers::Apart]
}
fn is_apart(v: &[Servers]) -> bool {
    v == [Servers::Apart]
}
fn two() -> u64 {
    2
}
fn five() -> u64 {
    5
}
fn three() -> usize {
    3
}
fn seed() -> u64 {
    42
}
fn cpu() -> String {
    "cpu".into()
}
fn one_usize() -> usize {
    1
}
fn lr() -> f32 {
    SgdConfig::DEFAULT.lr
}
fn momentum() -> f32 {
    SgdConfig::DEFAULT.momentum
}
fn weight_decay() -> f32 {
    SgdConfig::DEFAULT.weight_decay
}
fn timeout() -> f64 {
    300.0
}
fn rawtcp() -> f64 {
    1.0
}
fn topk_ratio() -> f64 {
    0.01
}
fn no_delay() -> Vec<u64> {
    vec![0]
}

impl Scenario {
    /// Whether the workers keep checkpoints to restart from (`max_restarts` or `kills`).
    pub fn restarts(&self) -> bool {
        self.max_restarts > 0 || self.kills > 0
    }

    /// The faults `kills` injects into repeat `repeat` of a run of `workers` workers: for each,
    /// the step after which rank 0 has recorded it and the worker killed, in step order; drawn
    /// from `seed` and the repeat, so a run can be replayed.
    pub fn kill_plan(&self, repeat: usize, workers: usize) -> Vec<(u64, usize)> {
        let Some(steps) = self.steps.filter(|_| self.kills > 0 && workers > 0) else { return Vec::new() };
        // splitmix64
        let mut x = self.seed ^ (repeat as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        let mut next = move || {
            x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = x;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^ (z >> 31)
        };
        let mut at: Vec<u64> = Vec::new();
        // Distinct steps from 1 to steps - 1 (validated: more than kills + 1 of them).
        while at.len() < self.kills as usize {
            let s = 1 + next() % (steps - 1);
            if !at.contains(&s) {
                at.push(s);
            }
        }
        at.sort_unstable();
        at.into_iter().map(|s| (s, (next() % workers as u64) as usize)).collect()
    }

    /// Parse and check a scenario's TOML text; `origin` names it in errors.
    pub fn parse(text: &str, origin: &str) -> anyhow::Result<Scenario> {
        let s: Scenario = toml::from_str(text).with_context(|| format!("scenario {origin}"))?;
        s.validate().with_context(|| format!("scenario {origin}"))?;
        Ok(s)
    }

    /// Read a scenario file, or the default one.
    pub fn load(path: Option<&Path>) -> anyhow::Result<Scenario> {
        match path {
            Some(p) => {
                let text = std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?;
                Scenario::parse(&text, &p.display().to_string())
            }
            None => Scenario::parse(DEFAULT, "default.toml (built in)"),
        }
    }

    /// `dilate_for`: each factor from 1, `dilate` given (the factor of every other design),
    /// and each name a design this scenario runs (else the error lists the ones it runs).
    fn check_dilate_for(&self) -> anyhow::Result<()> {
        if self.dilate_for.is_empty() {
            return Ok(());
        }
        anyhow::ensure!(
            self.dilate.is_some(),
            "`dilate_for` needs `dilate` (--dilate): the factor of the designs it does not name"
        );
        let runs = self.expand();
        let designs: std::collections::BTreeSet<String> =
            runs.iter().filter(|r| r.skip.is_none()).map(RunSpec::design).collect();
        for (name, &d) in &self.dilate_for {
            gradsync_core::dilation::Dilation::new(&format!("`dilate_for` '{name}'"), d)?;
            anyhow::ensure!(
                designs.contains(name),
                "`dilate_for` '{name}': no run of this scenario is that design; it runs {}",
                designs.iter().map(|d| format!("'{d}'")).collect::<Vec<_>>().join(", ")
            );
        }
        Ok(())
    }

    fn validate(&self) -> anyhow::Result<()> {
        let nonempty = |name: &str, n: usize| -> anyhow::Result<()> {
            anyhow::ensure!(n > 0, "`{name}` is empty");
            Ok(())
        };
        nonempty("modes", self.modes.len())?;
        anyhow::ensure!(
            self.workers.is_empty() != self.hosts.is_empty(),
            "give `workers` (worker counts) or `hosts` (worker host counts, each of `ranks_per_host` \
             ranks), one of them"
        );
        nonempty("ranks_per_host", self.ranks_per_host.len())?;
        nonempty("models", self.models.len())?;
        self.device
            .parse::<gradsync_core::device::DeviceRequest>()
            .map_err(|e| anyhow::anyhow!("`device`: {e}"))?;
        nonempty("shards", self.shards.len())?;
        nonempty("servers", self.servers.len())?;
        nonempty("slow_ms", self.slow_ms.len())?;
        for (name, v) in [
            ("workers", &self.workers),
            ("hosts", &self.hosts),
            ("ranks_per_host", &self.ranks_per_host),
            ("batches", &self.batches),
        ] {
            anyhow::ensure!(v.iter().all(|&x| x > 0), "`{name}` must hold positive numbers, not {v:?}");
        }
        match (self.steps, self.epochs) {
            (Some(0), _) => anyhow::bail!("`steps` must be at least 1"),
            (_, Some(0)) => anyhow::bail!("`epochs` must be at least 1"),
            (Some(_), Some(_)) => anyhow::bail!("give `steps` or `epochs`, not both"),
            (None, None) => anyhow::bail!("give a budget: `steps` or `epochs`"),
            _ => {}
        }
        anyhow::ensure!(self.repeats >= 1, "`repeats` must be at least 1");
        if let Some(t) = self.target_accuracy {
            anyhow::ensure!(t > 0.0 && t <= 1.0, "`target_accuracy` must be in (0, 1], not {t}");
        }
        anyhow::ensure!(
            !self.stop_at_target || (self.target_accuracy.is_some() && self.eval_samples.is_some()),
            "`stop_at_target` needs `target_accuracy` and `eval_samples`"
        );
        if let Some(e) = self.eval_samples {
            anyhow::ensure!(e > 0, "`eval_samples` must be at least 1");
        }
        if let Some(d) = &self.data {
            d.parse::<gradsync_core::data::DataSource>().map_err(|e| anyhow::anyhow!("`data`: {e}"))?;
        }
        if let Some(mb) = self.bucket_mb {
            anyhow::ensure!(
                mb > 0.0 && mb.is_finite(),
                "`bucket_mb` must be a positive size in MB, not {mb}"
            );
        }
        anyhow::ensure!(self.run_timeout_s > 0.0, "`run_timeout_s` must be positive");
        anyhow::ensure!(self.checkpoint_every >= 1, "`checkpoint_every` must be at least 1");
        if self.kills > 0 {
            let Some(steps) = self.steps else {
                anyhow::bail!("`kills` draws the steps to kill at from `steps`: give `steps`, not `epochs`")
            };
            anyhow::ensure!(
                steps > u64::from(self.kills) + 1,
                "`kills = {}` needs more `steps` than kills plus one (it is {steps}): each kill falls after \
                 a different step before the last",
                self.kills
            );
        }
        anyhow::ensure!(
            self.topk_ratio > 0.0 && self.topk_ratio <= 1.0,
            "`topk_ratio` must be above 0 and at most 1, not {}",
            self.topk_ratio
        );
        anyhow::ensure!(self.rawtcp_s > 0.0 && self.rawtcp_s <= 60.0, "`rawtcp_s` must be in (0, 60]");
        self.check_dilate_for()?;
        if let Some(t) = self.time_s {
            anyhow::ensure!(t > 0.0, "`time_s` must be positive");
        }
        let shape = match &self.data {
            Some(d) => d.parse::<gradsync_core::data::DataSource>().ok().and_then(|d| d.shape()),
            None => None,
        };
        for m in &self.models {
            let spec =
                gradsync_core::model::ModelSpec::parse(m).with_context(|| format!("`models`: '{m}'"))?;
            anyhow::ensure!(
                !self.batches.is_empty() || spec.profile().is_some(),
                "`batches` is empty, and '{m}' is trained for real: give global batch sizes (only a replayed \
                 model has a batch of its own)"
            );
            spec.clone()
                .with_rates(self.device_tflops, self.device_tbps)
                .with_context(|| format!("`device_tflops` for '{m}'"))?;
            // A model that cannot take the data (a conv net on flat data) is refused now, by name.
            let spec = match shape {
                Some((input, classes)) => {
                    spec.fit(input, classes).with_context(|| format!("`models`: '{m}' on `data`"))?
                }
                None => spec,
            };
            // Every mode crosses every model, so a mode and a model that cannot meet are
            // refused now, by name, rather than failing run by run.
            let table = spec.table();
            for &mode in &self.modes {
                match table {
                    None if mode.needs_table() => anyhow::bail!(
                        "`modes`: {mode} moves an embedding table, and '{m}' has none; train an embedding \
                         model (embedding[:ROWS:DIM[:HIDDEN...]] on clicks or libsvm data){}",
                        if mode == ModeKind::DdpDense { ", or name the dense ring ddp-tcp" } else { "" }
                    ),
                    Some((rows, dim)) => {
                        if let Some(why) = mode.refuses_table() {
                            anyhow::bail!("`modes`: {mode} cannot train '{m}' ({rows} x {dim} table): {why}");
                        }
                    }
                    None => {}
                }
            }
        }
        Ok(())
    }

    /// The worker counts it runs, each with its ranks per host: `workers` each at every
    /// `ranks_per_host`, or `hosts` times each.
    pub fn placements(&self) -> Vec<(usize, usize)> {
        let per = &self.ranks_per_host;
        if self.hosts.is_empty() {
            self.workers.iter().flat_map(|&w| per.iter().map(move |&m| (w, m))).collect()
        } else {
            self.hosts.iter().flat_map(|&h| per.iter().map(move |&m| (h * m, m))).collect()
        }
    }

    /// The runs, in a fixed order: model, batch, mode, workers, shards. A combination that
    /// cannot run (a global batch that does not split over the workers) is kept with the
    /// reason, so the results say why it is missing.
    pub fn expand(&self) -> Vec<RunSpec> {
        let mut out = Vec::new();
        for model in &self.models {
            // Without `batches`, a replayed model's own batch per worker.
            let own =
                gradsync_core::model::ModelSpec::parse(model).ok().and_then(|m| m.profile().map(|p| p.batch));
            let batches: Vec<Option<usize>> = if self.batches.is_empty() {
                vec![None]
            } else {
                self.batches.iter().copied().map(Some).collect()
            };
            for batch in batches {
                for &mode in &self.modes {
                    // (workers, global batch) of each cell. A replayed model's own batch is per
                    // worker, so local training runs once per worker count at that count's
                    // global batch: the same step's compute, in the same chart group.
                    let own = own.unwrap_or(1);
                    let mut cells: Vec<(usize, usize, usize)> = match (mode == ModeKind::Local, batch) {
                        (true, Some(b)) => vec![(1, 1, b)],
                        (true, None) => self.placements().iter().map(|&(n, _)| (1, 1, own * n)).collect(),
                        (false, b) => {
                            self.placements().iter().map(|&(w, m)| (w, m, b.unwrap_or(own * w))).collect()
                        }
                    };
                    cells.dedup();
                    for (w, m, global_batch) in cells {
                        let mut shards: Vec<usize> = if mode.is_ps() {
                            self.shards.iter().map(|k| k.of(w.div_ceil(m))).collect()
                        } else {
                            vec![0]
                        };
                        shards.dedup();
                        let mut places: Vec<bool> = if mode.is_ps() {
                            self.servers.iter().map(|s| *s == Servers::Colocated).collect()
                        } else {
                            vec![false]
                        };
                        places.sort_unstable();
                        places.dedup();
                        for (k, colocated) in shards.iter().flat_map(|&k| places.iter().map(move |&c| (k, c)))
                        {
                            for (&slow_ms, repeat) in
                                self.slow_ms.iter().flat_map(|d| (0..self.repeats).map(move |r| (d, r)))
                            {
                                let skip = if w % m != 0 {
                                    Some(format!("{w} workers do not fill hosts of {m} ranks"))
                                } else if colocated && k > w / m {
                                    Some(format!(
                                        "{k} shards colocated one a worker host need {k} worker hosts, not {}",
                                        w / m
                                    ))
                                } else if global_batch % w != 0 {
                                    Some(format!(
                                        "global batch {global_batch} does not split over {w} workers"
                                    ))
                                } else if slow_ms > 0 && self.slow_rank >= w {
                                    Some(format!("slow_rank {} is not among {w} workers", self.slow_rank))
                                } else {
                                    None
                                };
                                let id = format!(
                                    "{:03}-{}-w{w}{}-{}-b{global_batch}{}{}{}{}",
                                    out.len() + 1,
                                    mode.label(),
                                    if m > 1 { format!("-m{m}") } else { String::new() },
                                    sanitize(model),
                                    if k > 0 { format!("-k{k}") } else { String::new() },
                                    if colocated { "-colocated" } else { "" },
                                    if slow_ms > 0 { format!("-slow{slow_ms}") } else { String::new() },
                                    if self.repeats > 1 {
                                        format!("-r{}", repeat + 1)
                                    } else {
                                        String::new()
                                    }
                                );
                                out.push(RunSpec {
                                    id,
                                    mode,
                                    workers: w,
                                    model: model.clone(),
                                    global_batch,
                                    batch: (global_batch / w).max(1),
                                    shards: k,
                                    colocated,
                                    ranks_per_host: m,
                                    slow_ms,
                                    repeat,
                                    skip,
                                    dilate: 1.0,
                                });
                            }
                        }
                    }
                }
            }
        }
        out
    }
}

/// Keep file names to letters, digits and dashes.
pub(crate) fn sanitize(s: &str) -> String {
    s.chars().map(|c| if c.is_ascii_alphanumeric() { c } else { '-' }).collect()
}

/// A design as lists name it: `mode`, with ` k=<shards>` where it has shards and ` colocated`
/// where they sat on worker hosts.
pub fn design_name(mode: &str, shards: usize, colocated: bool) -> String {
    match (shards, colocated) {
        (0, _) => mode.to_string(),
        (k, false) => format!("{mode} k={k}"),
        (k, true) => format!("{mode} k={k} colocated"),
    }
}

/// One cell of the matrix.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunSpec {
    /// Directory name under `runs/`, unique within the scenario.
    pub id: String,
    /// Mode.
    pub mode: ModeKind,
    /// Worker processes (replicas for DP).
    pub workers: usize,
    /// Model preset or widths.
    pub model: String,
    /// Samples per step across all workers.
    pub global_batch: usize,
    /// Samples per step per worker.
    pub batch: usize,
    /// Server shards (0 when the mode has none).
    pub shards: usize,
    /// Its shards on worker hosts, one a host (the scenario's `servers`: an emulated
    /// cluster's placement); else each on a host of its own.
    #[serde(default)]
    pub colocated: bool,
    /// Workers on each worker host (an emulated cluster's placement; 1 elsewhere).
    #[serde(default = "one_rank")]
    pub ranks_per_host: usize,
    /// Milliseconds the scenario's `slow_rank` is delayed per step (0: none).
    #[serde(default)]
    pub slow_ms: u64,
    /// Which repeat of its cell, from 0 (its data order's seed is the scenario's seed + this).
    #[serde(default)]
    pub repeat: usize,
    /// Why the run is not started, when it cannot be.
    pub skip: Option<String>,
    /// The time dilation its processes run under (`--dilate`; 1: none). Set by the cluster
    /// runner, which shapes the links to match.
    #[serde(default = "undilated")]
    pub dilate: f64,
}

impl RunSpec {
    /// The design it runs, as the report names it ([`design_name`]).
    pub fn design(&self) -> String {
        design_name(self.mode.label(), self.shards, self.colocated)
    }

    /// Whether its model is replayed from a profile (its compute a wait), not trained for real.
    pub fn replayed(&self) -> bool {
        gradsync_core::model::ModelSpec::parse(&self.model).is_ok_and(|m| m.profile().is_some())
    }
}

fn undilated() -> f64 {
    1.0
}

fn one_rank() -> usize {
    1
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn a_bucket_size_not_above_zero_is_refused_by_name() {
        let base = toml::to_string(&Scenario::load(None).unwrap()).unwrap();
        for bad in ["0", "-5.0"] {
            let e =
                format!("{:#}", Scenario::parse(&format!("bucket_mb = {bad}\n{base}"), "test").unwrap_err());
            assert!(e.contains("`bucket_mb`"), "{e}");
        }
        assert_eq!(
            Scenario::parse(&format!("bucket_mb = 1.0\n{base}"), "test").unwrap().bucket_mb,
            Some(1.0)
        );
    }

    #[test]
    fn dilate_is_a_factor_from_one_or_auto_and_anything_else_is_refused_by_name() {
        let base = toml::to_string(&Scenario::load(None).unwrap()).unwrap();
        let with = |v: &str| Scenario::parse(&format!("dilate = {v}\n{base}"), "test");
        assert_eq!(with("8").unwrap().dilate, Some(Dilate::Factor(8.0)));
        assert_eq!(with("2.5").unwrap().dilate, Some(Dilate::Factor(2.5)));
        assert_eq!(with("'auto'").unwrap().dilate, Some(Dilate::Auto));
        for bad in ["0.5", "'fast'", "5000"] {
            let e = format!("{:#}", with(bad).unwrap_err());
            assert!(e.contains("dilate"), "{bad}: {e}");
        }
        assert_eq!(Scenario::load(None).unwrap().dilate, None);
        assert!(Scenario::load(None).unwrap().expand().iter().all(|r| r.dilate == 1.0));
        // The flag's spelling is the key's.
        assert_eq!("auto".parse::<Dilate>(), Ok(Dilate::Auto));
        assert_eq!("16".parse::<Dilate>(), Ok(Dilate::Factor(16.0)));
        assert!("0".parse::<Dilate>().unwrap_err().contains("dilate"));
    }

    /// `shards` takes counts and shares of the worker hosts; `hosts` and `ranks_per_host`
    /// place the workers; anything else is refused by name.
    #[test]
    fn hosts_ranks_per_host_and_shards_per_host_expand_to_placed_runs() {
        let base = "name = 'x'\nmodels = ['resnet50']\nsteps = 2\nrepeats = 1\n";
        let parse = |keys: &str| Scenario::parse(&format!("{base}{keys}"), "test");
        let s = parse("modes = ['ps-bsp', 'ddp-hier']\nhosts = [2, 4]\nranks_per_host = [1, 2]\nshards = ['hosts', 'hosts/2', 3]\n")
            .unwrap();
        assert_eq!(s.placements(), [(2, 1), (4, 2), (4, 1), (8, 2)]);
        let runs = s.expand();
        let ps: Vec<(usize, usize, usize)> = runs
            .iter()
            .filter(|r| r.mode == ModeKind::PsBsp)
            .map(|r| (r.workers, r.ranks_per_host, r.shards))
            .collect();
        // 2 hosts: 2, 1, 3 shards; 4 hosts: 4, 2, 3 (whatever the ranks on each).
        assert_eq!(
            ps,
            [
                (2, 1, 2),
                (2, 1, 1),
                (2, 1, 3),
                (4, 2, 2),
                (4, 2, 1),
                (4, 2, 3),
                (4, 1, 4),
                (4, 1, 2),
                (4, 1, 3),
                (8, 2, 4),
                (8, 2, 2),
                (8, 2, 3)
            ]
        );
        let hier: Vec<&str> =
            runs.iter().filter(|r| r.mode == ModeKind::DdpHier).map(|r| r.id.as_str()).collect();
        assert!(hier[1].contains("-w4-m2-") && !hier[0].contains("-m"), "{hier:?}");
        assert!(runs.iter().all(|r| r.skip.is_none()));
        // hosts/2 of one host is one shard, said once.
        let one = parse("modes = ['ps-bsp']\nhosts = [1]\nshards = ['hosts', 'hosts/2']\n").unwrap().expand();
        assert_eq!(one.iter().map(|r| r.shards).collect::<Vec<_>>(), [1]);
        // Workers that do not fill their hosts are kept with the reason.
        let odd = parse("modes = ['ddp-tcp']\nworkers = [3]\nranks_per_host = [2]\n").unwrap().expand();
        assert_eq!(odd[0].skip.as_deref(), Some("3 workers do not fill hosts of 2 ranks"));
        // The keys round-trip through the file the run directory keeps.
        assert_eq!(Scenario::parse(&toml::to_string(&s).unwrap(), "again").unwrap(), s);
        for (keys, says) in [
            ("modes = ['ps-bsp']\nworkers = [2]\nhosts = [2]\n", "give `workers`"),
            ("modes = ['ps-bsp']\n", "give `workers`"),
            (
                "modes = ['ps-bsp']\nhosts = [2]\nranks_per_host = [0]\n",
                "`ranks_per_host` must hold positive",
            ),
            ("modes = ['ps-bsp']\nhosts = [2]\nshards = ['hosts/0']\n", "shards 'hosts/0'"),
            ("modes = ['ps-bsp']\nhosts = [2]\nshards = ['half']\n", "shards 'half'"),
            ("modes = ['ps-bsp']\nhosts = [2]\nshards = [0]\n", "shards '0'"),
        ] {
            let e = format!("{:#}", parse(keys).unwrap_err());
            assert!(e.contains(says), "{keys}: {e}");
        }
    }

    /// `servers` runs each PS cell apart and colocated, the other modes once; colocated shards
    /// beyond the worker hosts are kept with the reason; anything but the two places is refused.
    #[test]
    fn servers_run_each_parameter_server_cell_apart_and_colocated() {
        let base = "name = 'x'\nmodels = ['resnet50']\nsteps = 2\nrepeats = 1\nhosts = [4]\n";
        let parse = |keys: &str| Scenario::parse(&format!("{base}{keys}"), "test");
        let s =
            parse("modes = ['ps-bsp', 'ddp-tcp']\nshards = ['hosts', 8]\nservers = ['colocated', 'apart']\n")
                .unwrap();
        let runs = s.expand();
        let ps: Vec<(usize, bool, Option<&str>)> = runs
            .iter()
            .filter(|r| r.mode == ModeKind::PsBsp)
            .map(|r| (r.shards, r.colocated, r.skip.as_deref()))
            .collect();
        let beyond = Some("8 shards colocated one a worker host need 8 worker hosts, not 4");
        assert_eq!(ps, [(4, false, None), (4, true, None), (8, false, None), (8, true, beyond)]);
        let ids: std::collections::BTreeSet<&str> = runs.iter().map(|r| r.id.as_str()).collect();
        assert_eq!(ids.len(), runs.len(), "every run its own directory");
        assert!(
            runs.iter()
                .filter(|r| r.colocated)
                .all(|r| r.id.ends_with("-k4-colocated") || r.id.ends_with("-k8-colocated"))
        );
        let rings: Vec<_> = runs.iter().filter(|r| r.mode == ModeKind::DdpTcp).collect();
        assert!(rings.len() == 1 && !rings[0].colocated);
        // Round-trips; left out, every shard is apart and the key is not written.
        assert_eq!(Scenario::parse(&toml::to_string(&s).unwrap(), "again").unwrap(), s);
        let apart = parse("modes = ['ps-bsp']\n").unwrap();
        assert_eq!(apart.servers, [Servers::Apart]);
        assert!(apart.expand().iter().all(|r| !r.colocated));
        assert!(!toml::to_string(&apart).unwrap().contains("servers"));
        for (keys, says) in [("servers = ['near']\n", "near"), ("servers = []\n", "`servers` is empty")] {
            let e = format!("{:#}", parse(&format!("modes = ['ps-bsp']\n{keys}")).unwrap_err());
            assert!(e.contains(says), "{keys}: {e}");
        }
    }

    #[test]
    fn default_parses_and_expands() {
        let s = Scenario::load(None).unwrap();
        let runs = s.expand();
        // local once; dp, ddp-tcp, ddp-shm, ddp-nccl, zero1-tcp per worker count; ps per worker
        // count and shards; every cell `repeats` times.
        let w = s.workers.len();
        assert_eq!(runs.len(), s.repeats * (1 + 5 * w + 3 * w * s.shards.len()));
        assert!(runs.iter().all(|r| r.global_batch == s.batches[0]));
        let ids: std::collections::BTreeSet<_> = runs.iter().map(|r| &r.id).collect();
        assert_eq!(ids.len(), runs.len());
        // Real data, a convergence target, and the repeats of a cell one after another.
        assert_eq!(s.data.as_deref(), Some("digits"));
        assert!(s.target_accuracy.is_some() && s.eval_samples.is_some() && s.repeats >= 3);
        let reps: Vec<usize> = runs.iter().take(s.repeats).map(|r| r.repeat).collect();
        assert_eq!(reps, (0..s.repeats).collect::<Vec<_>>());
        assert!(runs[0].id.ends_with("-r1") && runs[1].id.ends_with("-r2"), "{}", runs[1].id);
    }

    /// Every mode of the worker's table, by its name and by each alias, reads back as that mode
    /// wherever a name comes in (a scenario's TOML, `--modes`, `FromStr`), and is written as its
    /// name (file names, `outcomes.jsonl`); the modes keep the table's order.
    #[test]
    fn every_mode_name_round_trips() {
        #[derive(Debug, PartialEq, Serialize, Deserialize)]
        struct One {
            mode: ModeKind,
        }
        assert_eq!(ModeKind::ALL.len(), COMPARED.len());
        for (i, m) in ModeKind::ALL.into_iter().enumerate() {
            let c = m.compared();
            assert_eq!(c, &COMPARED[i]);
            for name in std::iter::once(c.name).chain(c.aliases.iter().copied()) {
                assert_eq!(name.parse::<ModeKind>(), Ok(m), "{name}");
                assert_eq!(<ModeKind as clap::ValueEnum>::from_str(name, false), Ok(m), "{name}");
                assert_eq!(toml::from_str::<One>(&format!("mode = '{name}'")).unwrap(), One { mode: m });
            }
            assert_eq!((m.to_string(), m.label()), (c.name.to_string(), c.name));
            assert_eq!(
                serde_json::to_string(&One { mode: m }).unwrap(),
                format!("{{\"mode\":\"{}\"}}", c.name)
            );
            assert_eq!(toml::to_string(&One { mode: m }).unwrap(), format!("mode = \"{}\"\n", c.name));
            let listed = <ModeKind as clap::ValueEnum>::to_possible_value(&m).unwrap();
            assert_eq!(
                (listed.get_name(), listed.get_help().map(|h| h.to_string())),
                (c.name, Some(c.about.into()))
            );
        }
        let e = toml::from_str::<One>("mode = 'warp'").unwrap_err().to_string();
        assert!(e.contains("unknown variant `warp`, expected one of `local`, `dp`, `ps-bsp`"), "{e}");
        assert!(e.contains("`ddp-allgather`, `ddp-sparse`, `hybrid`"), "{e}");
        assert!("warp".parse::<ModeKind>().unwrap_err().contains("(modes: local, dp, ps-bsp,"));
    }

    #[test]
    fn the_optimiser_defaults_are_the_binaries_own() {
        let text = "name='x'\nmodes=['local']\nworkers=[1]\nmodels=['tiny']\nbatches=[8]\nsteps=3";
        let s = Scenario::parse(text, "t").unwrap();
        let sgd = SgdConfig { lr: s.lr, momentum: s.momentum, weight_decay: s.weight_decay };
        assert_eq!(sgd, SgdConfig::DEFAULT);
    }

    /// Every scenario shipped in bench/scenarios parses, and its models fit its data.
    #[test]
    fn every_shipped_scenario_is_valid() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../bench/scenarios");
        let mut seen = 0;
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_some_and(|e| e == "toml") {
                let s = Scenario::load(Some(&path)).unwrap_or_else(|e| panic!("{}: {e:#}", path.display()));
                assert!(!s.expand().is_empty(), "{}: no runs", path.display());
                seen += 1;
            }
        }
        assert!(seen >= 5, "found {seen} scenarios in {}", dir.display());
    }

    /// Without `batches`, each replayed model runs at its profile's batch per worker, local
    /// training once per worker count at that count's global batch; a model trained for real
    /// needs `batches`, and a rate for it is refused.
    #[test]
    fn replayed_models_run_at_their_own_batch() {
        let s = Scenario::parse(
            "name='x'\nmodes=['local','ddp-tcp']\nworkers=[2,4]\nmodels=['resnet50','gpt2']\nsteps=1\nrepeats=1",
            "t",
        )
        .unwrap();
        let cells: Vec<(String, String, usize, usize, usize)> = s
            .expand()
            .into_iter()
            .map(|r| (r.model, r.mode.label().to_string(), r.workers, r.global_batch, r.batch))
            .collect();
        let want = |m: &str, mode: &str, w, g, b| (m.to_string(), mode.to_string(), w, g, b);
        assert_eq!(
            cells,
            vec![
                want("resnet50", "local", 1, 128, 128),
                want("resnet50", "local", 1, 256, 256),
                want("resnet50", "ddp-tcp", 2, 128, 64),
                want("resnet50", "ddp-tcp", 4, 256, 64),
                want("gpt2", "local", 1, 16, 16),
                want("gpt2", "local", 1, 32, 32),
                want("gpt2", "ddp-tcp", 2, 16, 8),
                want("gpt2", "ddp-tcp", 4, 32, 8),
            ]
        );
        let e = Scenario::parse(
            "name='x'\nmodes=['local']\nworkers=[1]\nmodels=['resnet50','tiny']\nsteps=1",
            "t",
        )
        .unwrap_err();
        assert!(format!("{e:#}").contains("`batches` is empty, and 'tiny' is trained for real"), "{e:#}");
        let e = Scenario::parse(
            "name='x'\nmodes=['local']\nworkers=[1]\nmodels=['tiny']\nbatches=[8]\nsteps=1\ndevice_tflops=100.0",
            "t",
        )
        .unwrap_err();
        assert!(format!("{e:#}").contains("applies to a replayed model"), "{e:#}");
    }

    #[test]
    fn a_conv_net_on_flat_data_is_refused_by_name() {
        let text = "name='x'\nmodes=['local']\nworkers=[1]\nmodels=['resnet20']\nbatches=[8]\nsteps=1\n\
                    data='synthetic:64:20:5'";
        let e = format!("{:#}", Scenario::parse(text, "t").unwrap_err());
        assert!(e.contains("'resnet20' on `data`") && e.contains("needs images"), "{e}");
    }

    #[test]
    fn rejects_bad_scenarios_by_name() {
        let e = Scenario::parse(
            "name='x'\nmodes=['warp']\nworkers=[1]\nmodels=['tiny']\nbatches=[8]\nsteps=1",
            "t",
        )
        .unwrap_err();
        assert!(format!("{e:#}").contains("warp"), "{e:#}");
        let e = Scenario::parse(
            "name='x'\nmodes=['dp']\nworkers=[0]\nmodels=['tiny']\nbatches=[8]\nsteps=1",
            "t",
        )
        .unwrap_err();
        assert!(format!("{e:#}").contains("workers"), "{e:#}");
        let e = Scenario::parse(
            "name='x'\nmodes=['dp']\nworkers=[1]\nmodels=['huge']\nbatches=[8]\nsteps=1",
            "t",
        )
        .unwrap_err();
        assert!(format!("{e:#}").contains("huge"), "{e:#}");
        let e = Scenario::parse(
            "name='x'\nmodes=['dp']\nworkers=[1]\nmodels=['tiny']\nbatches=[8]\nsteps=1\ndevice='tpu'",
            "t",
        )
        .unwrap_err();
        assert!(format!("{e:#}").contains("`device`") && format!("{e:#}").contains("tpu"), "{e:#}");
    }

    #[test]
    fn straggler_sweep_crosses_every_run_with_each_delay() {
        let s = Scenario::parse(
            "name='x'\nmodes=['ps-bsp','local']\nworkers=[2]\nmodels=['tiny']\nbatches=[8]\nsteps=1\n\
             slow_ms=[0,20]\nslow_rank=1\nrepeats=1",
            "t",
        )
        .unwrap();
        let r = s.expand();
        let got: Vec<(&str, u64, bool)> =
            r.iter().map(|r| (r.mode.label(), r.slow_ms, r.skip.is_some())).collect();
        // ps-bsp at 0 and 20 ms; local has one worker, so rank 1 cannot be delayed there.
        assert_eq!(
            got,
            [("ps-bsp", 0, false), ("ps-bsp", 20, false), ("local", 0, false), ("local", 20, true)]
        );
        assert!(r[1].id.ends_with("-slow20"), "{}", r[1].id);
        assert!(r[3].skip.as_deref().unwrap_or("").contains("slow_rank 1"));
        let e = Scenario::parse(
            "name='x'\nmodes=['dp']\nworkers=[1]\nmodels=['tiny']\nbatches=[8]\nsteps=1\nslow_ms=[]",
            "t",
        )
        .unwrap_err();
        assert!(format!("{e:#}").contains("slow_ms"), "{e:#}");
    }

    #[test]
    fn budgets_and_targets_are_checked() {
        let base = "name='x'\nmodes=['dp']\nworkers=[1]\nmodels=['tiny']\nbatches=[8]\n";
        for (extra, wanted) in [
            ("", "give a budget"),
            ("steps=2\nepochs=1", "not both"),
            ("epochs=0", "`epochs`"),
            ("steps=2\nrepeats=0", "`repeats`"),
            ("steps=2\ntarget_accuracy=97", "`target_accuracy`"),
            ("steps=2\ndata='digits:5'", "`data`"),
            ("steps=2\nstaleness_lr='half'", "half"),
            ("steps=2\nstop_at_target=true", "`stop_at_target`"),
        ] {
            let e = Scenario::parse(&format!("{base}{extra}"), "t").unwrap_err();
            assert!(format!("{e:#}").contains(wanted), "{extra}: {e:#}");
        }
        let s = Scenario::parse(&format!("{base}epochs=2\nrepeats=2\nstaleness_lr='inverse'"), "t").unwrap();
        assert_eq!((s.steps, s.epochs, s.repeats), (None, Some(2), 2));
        assert_eq!(s.staleness_lr, gradsync_core::optim::StalenessLr::Inverse);
        let r = s.expand();
        assert_eq!(r.iter().map(|r| r.repeat).collect::<Vec<_>>(), [0, 1]);
    }

    /// A header of a model without a table.
    fn no_table(mode: &str, variant: &str, transport: Option<&str>, c: Option<&str>) -> Option<ModeKind> {
        ModeKind::from_header(&modes::HeaderMode {
            mode,
            variant,
            transport,
            compression: c,
            ..Default::default()
        })
    }

    #[test]
    fn ddp_modes_are_told_apart_by_their_transport() {
        assert_eq!(no_table("ddp", "tcp", Some("tcp"), None), Some(ModeKind::DdpTcp));
        assert_eq!(no_table("ddp", "tcp", Some("shm"), None), Some(ModeKind::DdpShm));
        assert_eq!(no_table("ddp", "tcp", None, None), Some(ModeKind::DdpTcp));
        assert_eq!(no_table("ddp", "nccl", None, None), Some(ModeKind::DdpNccl));
        assert!(ModeKind::DdpTcp.over_tcp() && ModeKind::PsAsp.over_tcp() && !ModeKind::DdpShm.over_tcp());
        assert_ne!(ModeKind::DdpTcp.wire(), ModeKind::DdpShm.wire());
        // ZeRO-1 over the ring's sockets, compared with ddp-tcp like for like.
        assert_eq!(no_table("zero1", "tcp", Some("tcp"), None), Some(ModeKind::Zero1Tcp));
        assert_eq!(no_table("ps", "bsp", None, Some("none")), Some(ModeKind::PsBsp));
        assert_eq!(no_table("ps", "bsp", None, Some("fp16")), Some(ModeKind::PsBspFp16));
        assert_eq!(no_table("ps", "bsp", None, Some("topk:0.01")), Some(ModeKind::PsBspTopk));
        assert_eq!(no_table("ddp", "tcp", Some("tcp"), Some("topk:0.01")), Some(ModeKind::DdpTcpTopk));
        assert_eq!(no_table("ps", "asp", None, Some("fp16")), None);
        assert_eq!(no_table("ddp", "tcp", Some("tcp"), Some("fp16")), Some(ModeKind::DdpTcpFp16));
        for m in [ModeKind::PsBspFp16, ModeKind::PsBspTopk, ModeKind::DdpTcpTopk, ModeKind::DdpTcpFp16] {
            assert_eq!(m.label().parse::<ModeKind>(), Ok(m));
            assert!(m.compress(0.01).is_some() && m.base().compress(0.01).is_none());
        }
        assert_eq!("zero1-tcp".parse::<ModeKind>(), Ok(ModeKind::Zero1Tcp));
        assert!(ModeKind::Zero1Tcp.over_tcp() && ModeKind::Zero1Tcp.is_ring());
        assert_eq!(ModeKind::Zero1Tcp.wire(), ModeKind::DdpTcp.wire());
    }

    /// The ways of moving a table need a model with one; the modes that cannot train a table
    /// are refused on one; every other mode takes both.
    #[test]
    fn sparse_modes_and_models_with_a_table_meet_or_are_refused_by_name() {
        let scenario = |modes: &str, model: &str, data: &str| {
            Scenario::parse(
                &format!(
                    "name='x'\nmodes=[{modes}]\nworkers=[2]\nmodels=['{model}']\nbatches=[8]\nsteps=1\n\
                     data='{data}'"
                ),
                "t",
            )
        };
        // `ddp-sparse`, the and PyTorch users' name, is ddp-allgather in a scenario
        // file and on the command line.
        let s = scenario("'ddp-sparse'", "embedding:4096:8", "clicks:512:4096").unwrap();
        assert_eq!(s.modes, [ModeKind::DdpAllgather]);
        assert_eq!("ddp-sparse".parse::<ModeKind>(), Ok(ModeKind::DdpAllgather));
        assert_eq!(<ModeKind as clap::ValueEnum>::from_str("ddp-sparse", false), Ok(ModeKind::DdpAllgather));
        for mode in ["ps-sparse", "ddp-dense", "ddp-allgather", "hybrid"] {
            let e = format!("{:#}", scenario(&format!("'{mode}'"), "tiny", "digits").unwrap_err());
            assert!(e.contains(&format!("{mode} moves an embedding table, and 'tiny' has none")), "{e}");
            assert_eq!(e.contains("name the dense ring ddp-tcp"), mode == "ddp-dense", "{e}");
        }
        for (mode, why) in
            [("zero1-tcp", "not lazy"), ("ps-bsp-fp16", "uncompressed"), ("ps-bsp-topk", "uncompressed")]
        {
            let e = format!(
                "{:#}",
                scenario(&format!("'{mode}'"), "embedding:4096:8", "clicks:512:4096").unwrap_err()
            );
            assert!(e.contains(&format!("{mode} cannot train 'embedding:4096:8' (4096 x 8 table)")), "{e}");
            assert!(e.contains(why), "{e}");
        }
        // Without ROWS the table is fitted to the data's ids, and named so.
        let e = format!("{:#}", scenario("'zero1-tcp'", "embedding", "clicks:512:1000").unwrap_err());
        assert!(e.contains("(1000 x 16 table)"), "{e}");
        let every = "'local','dp','ps-bsp','ps-asp','ps-ssp','ddp-tcp','ddp-shm','ps-sparse','ddp-dense',\
                     'ddp-allgather','hybrid','ddp-tcp-fp16'";
        let s = scenario(every, "embedding:4096:8", "clicks:512:4096").unwrap();
        let runs = s.expand();
        // The hybrid runs servers, so it is crossed with the shard counts like the PS.
        assert!(runs.iter().any(|r| r.mode == ModeKind::Hybrid && r.shards == 1));
        assert!(runs.iter().any(|r| r.mode == ModeKind::DdpAllgather && r.shards == 0));
        for m in [ModeKind::PsSparse, ModeKind::DdpDense, ModeKind::DdpAllgather, ModeKind::Hybrid] {
            assert_eq!(m.label().parse::<ModeKind>(), Ok(m));
            assert!(m.over_tcp() && m.needs_table() && m.compress(0.01).is_none() && !m.is_compressed());
        }
        assert!(ModeKind::Hybrid.is_ps() && ModeKind::PsSparse.is_ps() && !ModeKind::DdpAllgather.is_ps());
        assert!(
            ModeKind::DdpDense.is_ring() && !ModeKind::DdpAllgather.is_ring() && !ModeKind::Hybrid.is_ring()
        );
        assert_eq!(ModeKind::PsSparse.wire(), ModeKind::PsBsp.wire());
        assert_eq!(ModeKind::DdpAllgather.wire(), ModeKind::DdpTcp.wire());
        assert!(ModeKind::Hybrid.wire().contains("TCP sockets") && ModeKind::Hybrid.wire().contains("gRPC"));
    }

    /// A metrics header names the table's way: its model's table, DDP's `sparse_grads`, the
    /// hybrid's own mode; without a table the dense names stay.
    #[test]
    fn sparse_modes_are_read_back_from_their_headers() {
        let read = |mode, variant, transport, table, sg| {
            ModeKind::from_header(&modes::HeaderMode {
                mode,
                variant,
                transport,
                table,
                sparse_grads: sg,
                ..Default::default()
            })
        };
        assert_eq!(read("ps", "bsp", None, true, None), Some(ModeKind::PsSparse));
        assert_eq!(read("ps", "bsp", None, false, None), Some(ModeKind::PsBsp));
        assert_eq!(read("ps", "asp", None, true, None), Some(ModeKind::PsAsp));
        assert_eq!(read("ddp", "tcp", Some("tcp"), true, Some("dense")), Some(ModeKind::DdpDense));
        assert_eq!(read("ddp", "tcp", Some("tcp"), true, Some("allgather")), Some(ModeKind::DdpAllgather));
        assert_eq!(read("ddp", "tcp", Some("tcp"), false, Some("dense")), Some(ModeKind::DdpTcp));
        assert_eq!(read("ddp", "tcp", Some("shm"), true, Some("dense")), Some(ModeKind::DdpShm));
        assert_eq!(read("hybrid", "tcp", Some("tcp"), true, Some("servers")), Some(ModeKind::Hybrid));
        // ps-bsp and ps-sparse on a table are one run under two names; ddp-allgather is not ddp-tcp.
        assert!(
            ModeKind::PsBsp.same_run_as(ModeKind::PsSparse)
                && ModeKind::DdpTcp.same_run_as(ModeKind::DdpDense)
        );
        assert!(
            !ModeKind::DdpTcp.same_run_as(ModeKind::DdpAllgather)
                && !ModeKind::PsAsp.same_run_as(ModeKind::PsSparse)
        );
    }

    #[test]
    fn uneven_split_is_kept_with_a_reason() {
        let s = Scenario::parse(
            "name='x'\nmodes=['dp']\nworkers=[3]\nmodels=['tiny']\nbatches=[8]\nsteps=1\nrepeats=1",
            "t",
        )
        .unwrap();
        let r = s.expand();
        assert_eq!(r.len(), 1);
        assert!(r[0].skip.as_deref().unwrap_or("").contains("does not split"));
    }
}
