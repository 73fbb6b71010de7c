//! `gradsync-bench cluster`: the comparison's runs on an emulated multi-host cluster. Each
//! run gets a fresh cluster ([`crate::net`]): server shard `i` on host `i` and worker rank `r`
//! on host `k + r / m` (`m` ranks a host), or with `--servers colocated` shard `i` on worker
//! host `i` beside its workers, every process started by the comparison runner's own command lines
//! ([`crate::modes`]) inside its host's namespace. The run directory is a comparison
//! run directory plus `cluster.json` (which run had which link), so `plot` renders it, with a
//! section setting each measured step beside the cost model's prediction for that link.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use gradsync_worker::modes::Wire;
use indicatif::{MultiProgress, ProgressBar};

pub use crate::emulated::{
    CHECKS_DIR, CLUSTER_FILE, Check, ClusterRun, DILATION_FILE, DilationRecord, Probe,
};
use crate::machine::Machine;
use crate::modes::{self, Placement};
use crate::net::{self, Cluster, Queue, Shape};
use crate::results::Outcome;
use crate::scenario::{Dilate, ModeKind, RunSpec, Scenario, Servers, Shards};
use crate::site::Slot;

/// Steps per cluster run unless `--steps` says otherwise.
const CLUSTER_STEPS: u64 = 30;

/// Runs of each cell with a step budget unless `--repeats` says otherwise: the report ranks
/// modes only by repeats' medians and ranges.
const CLUSTER_REPEATS: usize = 3;

/// `dilate = auto`: the trial factor the probe starts from.
const PROBE_START: f64 = 4.0;
/// `dilate = auto`: steps of each probe run (fewer when the scenario has fewer).
const PROBE_STEPS: u64 = 6;
/// `dilate = auto`: a probe whose cores were this busy says only "more": it is run again slower.
const PROBE_SATURATED: f64 = 0.9;
/// `dilate = auto`: the busy share the factor is picked for (the bound is half busy;
/// a tenth of margin for the probe's noise).
const AUTO_BUSY: f64 = 0.45;
/// `dilate = auto`: a probe busier than this has its factor probed again before it is taken.
const CONFIRM_BUSY: f64 = 0.6;
/// `dilate = auto`: how many times a factor is probed again.
const CONFIRM_TRIES: usize = 2;
/// `dilate = auto`: the largest factor it picks (a 10 ms step then lasts 5 s; a cluster that
/// needs more is said to, and runs at this). A dilated step costs its CPU work whatever D is,
/// so a large D costs wall time only where the emulated step is long: 32 ResNet-50 ranks at
/// 100 Gbit/s need about x400 on 2 cores.
pub const AUTO_CAP: f64 = 512.0;
/// The self-check: the step times at D and 2D may differ by this share before the rate's
/// runs are flagged "D too small" and left unranked.
const CHECK_TOLERANCE: f64 = 0.05;

/// Small-message round trips timed between two of a run's hosts for the cost model's latency
/// (the machine's own loopback figure takes 2000; a shaped link's is steadier, and each run
/// measures its own cluster).
const LATENCY_ROUNDS: usize = 200;

/// Flags of `gradsync-bench cluster`.
#[derive(Debug, Clone, Args)]
pub struct ClusterArgs {
    /// Scenario file (TOML) for the modes, workers (or hosts and ranks per host), shards,
    /// model, batch, steps and optimiser; the built-in default when absent (its modes, workers
    /// and shards then the flags' defaults below). Each flag below replaces its key.
    pub scenario: Option<PathBuf>,
    /// Run directory (default: runs/cluster-<UTC timestamp>).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Directory holding gradsync-worker and gradsync-server (default: beside this program).
    #[arg(long, env = "GRADSYNC_BIN_DIR")]
    pub bin_dir: Option<PathBuf>,
    /// Link rates to emulate, Gbit/s; one cluster each.
    #[arg(long, value_delimiter = ',', default_value = "1,10")]
    pub rates: Vec<f64>,
    /// Delay added to each direction of each host's link, microseconds (host to host: twice);
    /// needs the kernel's netem qdisc.
    #[arg(long, default_value_t = 0)]
    pub delay_us: u64,
    /// Packet loss on each direction of each link, percent (a BPF classifier drops them; no
    /// netem needed).
    #[arg(long, default_value_t = 0.0)]
    pub loss: f64,
    /// How each NIC's queue shares its link among the peer hosts sending through it: `fair`
    /// (a queue per peer, served in turn: what the advisor's predictor assumes) or `fifo` (one
    /// queue for all: TCP windows share it as unevenly as they grew; docs/cluster.md).
    #[arg(long, value_enum, default_value_t = Queue::Fair)]
    pub nic_queue: Queue,
    /// Worker process counts (default without a scenario file: 4).
    #[arg(long, value_delimiter = ',')]
    pub workers: Option<Vec<usize>>,
    /// Worker ranks on each worker host (default 1): that many share each host's link, and
    /// ddp-hier reduces among them first.
    #[arg(long, value_delimiter = ',')]
    pub ranks_per_host: Option<Vec<usize>>,
    /// Parameter-server shard counts, each shard on its own host: numbers, `hosts` (one per
    /// worker host) or `hosts/N` (default without a scenario file: 1).
    #[arg(long, value_delimiter = ',')]
    pub shards: Option<Vec<Shards>>,
    /// Where the parameter server's shards go: `apart` (each on a host of its own) or
    /// `colocated` (shard `i` on worker host `i`, sharing its NIC); both, comma-separated, run
    /// every PS cell both ways (default: the scenario's `servers`, else apart).
    #[arg(long, value_enum, value_delimiter = ',')]
    pub servers: Option<Vec<Servers>>,
    /// Modes to run (default without a scenario file: ps-bsp,ddp-tcp).
    #[arg(long, value_delimiter = ',')]
    pub modes: Option<Vec<ModeKind>>,
    /// Override the scenario's models.
    #[arg(long, value_delimiter = ',')]
    pub models: Option<Vec<String>>,
    /// Override the scenario's step budget.
    #[arg(long)]
    pub steps: Option<u64>,
    /// Keep the scenario's convergence measurement (its epochs or steps, evaluation, target
    /// accuracy and repeats) instead of a short step budget with no evaluation: time to
    /// accuracy on the emulated links, where bytes cost what the link makes them cost.
    #[arg(long)]
    pub to_accuracy: bool,
    /// Dilated time (docs/cluster.md): a factor from 1, every link at rate / D and every clock
    /// of the run D times slower, its figures divided back by D; or `auto`, a factor picked
    /// per rate from a short probe so the cores stay under half busy (at most x512). Default:
    /// the scenario's `dilate`, else none.
    #[arg(long)]
    pub dilate: Option<Dilate>,
    /// A design dilated by a factor of its own, `DESIGN=FACTOR` as the report names the design
    /// (`ddp-tcp=12`, `ps-bsp k=4=12`, `ps-bsp k=8 colocated=20`); repeat for more. Its runs
    /// and its self-check run at it instead of --dilate's: a design that costs the cores less
    /// CPU a byte measures the same link at a smaller factor, in less wall time. Default: the
    /// scenario's `dilate_for`.
    #[arg(long, value_name = "DESIGN=FACTOR", value_parser = design_factor)]
    pub dilate_for: Vec<(String, f64)>,
    /// DDP's and ZeRO-1's bucket size, MB (default: the scenario's `bucket_mb`, else the
    /// worker's 25).
    #[arg(long)]
    pub bucket_mb: Option<f64>,
    /// Runs of each cell (default: 3 with the step budget, the scenario's with
    /// --to-accuracy). With 1 the report lists the figures without ranking them: one run has
    /// no spread to set a difference against.
    #[arg(long)]
    pub repeats: Option<usize>,
}

/// The scenario a cluster runs: `s` with the flags' modes, workers, shards and models, and
/// either a step budget with no evaluation (the step's communication), each cell run
/// [`CLUSTER_REPEATS`] times, or, with `--to-accuracy`, the scenario's own convergence
/// measurement; `--repeats` replaces either count.
pub fn cluster_scenario(mut s: Scenario, a: &ClusterArgs) -> anyhow::Result<Scenario> {
    if a.scenario.is_none() {
        (s.modes, s.workers, s.hosts, s.shards) =
            (vec![ModeKind::PsBsp, ModeKind::DdpTcp], vec![4], Vec::new(), vec![Shards::Count(1)]);
    }
    if let Some(m) = &a.modes {
        s.modes = m.clone();
    }
    if let Some(w) = &a.workers {
        (s.workers, s.hosts) = (w.clone(), Vec::new());
    }
    if let Some(m) = &a.ranks_per_host {
        s.ranks_per_host = m.clone();
    }
    if let Some(k) = &a.shards {
        s.shards = k.clone();
    }
    if let Some(p) = &a.servers {
        s.servers = p.clone();
    }
    if let Some(m) = &a.models {
        s.models = m.clone();
    }
    if a.to_accuracy {
        anyhow::ensure!(
            s.target_accuracy.is_some() && s.eval_samples.is_some(),
            "--to-accuracy needs a scenario with target_accuracy and eval_samples (as \
             bench/scenarios/compression.toml has)"
        );
        if let Some(steps) = a.steps {
            (s.steps, s.epochs) = (Some(steps), None);
        }
    } else {
        // A scenario file with a step budget keeps it and its repeats (sized for its cells).
        let own = if a.scenario.is_some() { s.steps.map(|n| (n, s.repeats)) } else { None };
        let (steps, repeats) = own.unwrap_or((CLUSTER_STEPS, CLUSTER_REPEATS));
        (s.steps, s.epochs) = (Some(a.steps.unwrap_or(steps)), None);
        (s.repeats, s.eval_samples, s.target_accuracy) = (repeats, None, None);
    }
    if let Some(r) = a.repeats {
        anyhow::ensure!(r >= 1, "--repeats {r}: each cell must run at least once");
        s.repeats = r;
    }
    if let Some(mb) = a.bucket_mb {
        anyhow::ensure!(
            mb > 0.0 && mb.is_finite(),
            "--bucket-mb {mb}: a bucket must hold a positive size in MB"
        );
        s.bucket_mb = Some(mb);
    }
    if let Some(d) = a.dilate {
        s.dilate = Some(d);
    }
    if !a.dilate_for.is_empty() {
        s.dilate_for = a.dilate_for.iter().cloned().collect();
    }
    Scenario::parse(&toml::to_string(&s).context("writing the scenario")?, "the cluster scenario")
}

/// `--dilate-for DESIGN=FACTOR`: the design's name (which holds `=` in `k=4`) before the last
/// `=`, the factor after it.
fn design_factor(v: &str) -> Result<(String, f64), String> {
    let (name, d) = v
        .rsplit_once('=')
        .ok_or_else(|| format!("'{v}': give DESIGN=FACTOR, as in ddp-tcp=12 or 'ps-bsp k=4=12'"))?;
    let d: f64 = d.trim().parse().map_err(|_| format!("'{v}': the factor '{d}' is not a number"))?;
    gradsync_core::dilation::Dilation::new(&format!("'{v}'"), d).map_err(|e| e.to_string())?;
    Ok((name.trim().to_string(), d))
}

/// Run `cluster`.
pub fn run(a: &ClusterArgs) -> anyhow::Result<()> {
    if let Err(e) = net::available() {
        eprintln!("gradsync-bench cluster: skipped: {e}");
        return Ok(());
    }
    net::guard("gradsync-bench cluster");
    anyhow::ensure!(
        !a.rates.is_empty() && a.rates.iter().all(|r| *r > 0.0),
        "--rates must be positive Gbit/s"
    );
    anyhow::ensure!((0.0..100.0).contains(&a.loss), "--loss must be a percentage below 100");
    let s = cluster_scenario(Scenario::load(a.scenario.as_deref())?, a)?;
    let bins = modes::Bins::find(a.bin_dir.as_deref())?;
    let out = a
        .out
        .clone()
        .unwrap_or_else(|| PathBuf::from("runs").join(format!("cluster-{}", crate::utc_stamp())));
    let shape = |rate: f64| Shape {
        rate_bit: Some(rate * 1e9),
        delay: Duration::from_micros(a.delay_us),
        loss_pct: a.loss,
        rto_min: None,
        queue: a.nic_queue,
    };
    run_cluster(&s, &bins, &out, &a.rates, shape, s.dilate)?;
    let html = crate::plot(std::slice::from_ref(&out), &out)?;
    eprintln!("gradsync-bench cluster: report in {}", html.display());
    Ok(())
}

/// Run every cell of `scenario` once per rate in `rates`, each rate on a fresh cluster shaped
/// by `shape(rate)` (dilated as `dilate` says, the scenario's own when `None`), into the run
/// directory `out`. A dilated cluster also reruns one cell of each rate at twice the factor
/// (the self-check) and, under `auto`, probes the runs first; both go to `out/checks`, and
/// what they found to `dilation.json`. Returns the runs with their links.
pub fn run_cluster(
    scenario: &Scenario,
    bins: &modes::Bins,
    out: &Path,
    rates: &[f64],
    shape: impl Fn(f64) -> Shape,
    dilate: Option<Dilate>,
) -> anyhow::Result<Vec<ClusterRun>> {
    anyhow::ensure!(
        !out.join("outcomes.jsonl").exists(),
        "{} already holds a comparison; choose another --out",
        out.display()
    );
    std::fs::create_dir_all(out.join("runs")).with_context(|| format!("creating {}", out.display()))?;
    let write = |name: &str, text: &str| -> anyhow::Result<()> {
        let p = out.join(name);
        std::fs::write(&p, text).with_context(|| format!("writing {}", p.display()))
    };
    write("scenario.toml", &toml::to_string(scenario).context("writing the scenario")?)?;
    write("machine.json", &(serde_json::to_string_pretty(&Machine::detect())? + "\n"))?;
    let dilate = dilate.or(scenario.dilate);
    let specs = scenario.expand();
    let multi = MultiProgress::new();
    let overall = multi.add(ProgressBar::new((specs.len() * rates.len()) as u64));
    let outcomes_path = out.join("outcomes.jsonl");
    let mut outcomes = std::fs::File::create(&outcomes_path)
        .with_context(|| format!("creating {}", outcomes_path.display()))?;
    let runner = Runner { scenario, bins, multi: &multi, overall: &overall };
    let mut runs = Vec::new();
    let mut dilations: Vec<DilationRecord> = Vec::new();
    for &rate in rates {
        let (d, probe) = match dilate {
            None => (1.0, None),
            Some(Dilate::Factor(d)) => (d, None),
            Some(Dilate::Auto) => {
                // The designs given factors of their own are not probed.
                let probed: Vec<RunSpec> = specs
                    .iter()
                    .filter(|s| !scenario.dilate_for.contains_key(&s.design()))
                    .cloned()
                    .collect();
                let last = dilations.last().map(|r| (r.rate_gbit, r.dilation));
                let p = runner.probe(&probed, rate, &shape, out, probe_start(last, rate))?;
                (p.chose, Some(p))
            }
        };
        let mut at_rate = Vec::new();
        for spec in &specs {
            let (o, run) = runner.run(spec, rate, &shape, runner.factor(spec, d), out)?;
            writeln!(outcomes, "{}", serde_json::to_string(&o)?)
                .and_then(|_| outcomes.flush())
                .with_context(|| format!("writing {}", outcomes_path.display()))?;
            at_rate.push((spec, o));
            runs.push(run);
            overall.inc(1);
        }
        let dilated = d > 1.0 || scenario.dilate_for.values().any(|&f| f > 1.0);
        let check = if dilated { runner.check(&at_rate, rate, &shape, d, out)? } else { None };
        let designs = scenario.dilate_for.clone();
        dilations.push(DilationRecord { rate_gbit: rate, dilation: d, designs, probe, check });
    }
    overall.finish_and_clear();
    write(CLUSTER_FILE, &(serde_json::to_string_pretty(&runs)? + "\n"))?;
    if dilate.is_some() || !scenario.dilate_for.is_empty() {
        write(DILATION_FILE, &(serde_json::to_string_pretty(&dilations)? + "\n"))?;
    }
    Ok(runs)
}

/// What one cluster run needs besides its cell.
struct Runner<'a> {
    scenario: &'a Scenario,
    bins: &'a modes::Bins,
    multi: &'a MultiProgress,
    overall: &'a ProgressBar,
}

impl Runner<'_> {
    /// The factor `spec` runs at where the rate's is `d`: its design's own (`dilate_for`), else
    /// `d`.
    fn factor(&self, spec: &RunSpec, d: f64) -> f64 {
        self.scenario.dilate_for.get(&spec.design()).copied().unwrap_or(d)
    }

    /// Run `spec` at `rate` dilated `d` times on a fresh cluster, into the run directory `out`.
    fn run(
        &self,
        spec: &RunSpec,
        rate: f64,
        shape: &dyn Fn(f64) -> Shape,
        d: f64,
        out: &Path,
    ) -> anyhow::Result<(Outcome, ClusterRun)> {
        let sh = shape(rate).dilated(d);
        let k = if spec.mode.is_ps() { spec.shards.max(1) } else { 0 };
        let m = spec.ranks_per_host.max(1);
        // Colocated shards sit on the first worker hosts; else hosts 0 .. k hold the servers
        // (one, unused, for the modes without: the first worker host stays host 1).
        let colocated = spec.colocated && k > 0;
        let first_worker = if colocated { 0 } else { k.max(1) };
        let hosts = first_worker + spec.workers.div_ceil(m);
        let mut spec = spec.clone();
        spec.id = format!(
            "{}-{}g{}",
            spec.id,
            fmt_rate(rate),
            if d > 1.0 { format!("-x{}", fmt_rate(d)) } else { String::new() }
        );
        spec.dilate = d;
        // A fresh cluster per run: no queue or socket state carries over.
        let (placement, skip, cluster) = match Cluster::create(hosts, sh) {
            Ok(c) => {
                let h = c.hosts();
                let slots = |h: &[crate::net::HostSlot]| h.iter().map(Slot::from).collect();
                // Rank r on worker host r / m: ranks r m .. (r + 1) m - 1 share a host.
                let per_rank: Vec<_> =
                    h[first_worker..].iter().flat_map(|x| std::iter::repeat_n(x, m)).cloned().collect();
                let p = Placement::Hosts { servers: slots(&h[..k.max(1)]), workers: slots(&per_rank) };
                (p, None, Some(c))
            }
            Err(e) => (Placement::Loopback, Some(format!("{e}")), None),
        };
        // The link as TCP sees it: from the last host to the first, crossing two shaped ends
        // as every message between hosts does (in the emulated world's units: times d).
        let (measured_gbit, measured_latency_us) = cluster.as_ref().map_or((None, None), |c| {
            let emulated = crate::hosts::Hosts::Emulated(c);
            let said = |what: &str, e: anyhow::Error| {
                self.multi.suspend(|| eprintln!("{}: measuring the link's {what}: {e:#}", spec.id))
            };
            // The yardstick every benchmark uses: the median of three measurements.
            let each = Duration::from_secs_f64(self.scenario.rawtcp_s / 3.0);
            let rate = crate::rawtcp::Yardstick::measure(3, each, || emulated.pair(hosts - 1, 0));
            let gbit = rate.map_err(|e| said("bandwidth", e)).ok().map(|y| y.median() * 8.0 / 1e9 * d);
            let latency = emulated
                .pair(hosts - 1, 0)
                .and_then(|(tx, rx)| crate::rawtcp::latency_between(tx, rx, LATENCY_ROUNDS));
            (gbit, latency.map_err(|e| said("latency", e)).ok().map(|s| s * 1e6 / d))
        });
        let skip = skip.or_else(|| match spec.mode.compared() {
            c if c.wire == Wire::Nccl => Some("NCCL does not run over emulated links".to_string()),
            c if c.needs.one_host && spec.workers > m => {
                Some("shared memory does not cross hosts".to_string())
            }
            _ => None,
        });
        let o = crate::run_spec(
            self.scenario,
            &spec,
            self.bins,
            out,
            placement,
            None,
            skip,
            self.multi,
            self.overall,
        )?;
        drop(cluster);
        let run = ClusterRun {
            id: o.id.clone(),
            mode: spec.mode,
            workers: spec.workers,
            shards: spec.shards,
            colocated,
            ranks_per_host: m,
            hosts,
            rate_gbit: rate,
            measured_gbit,
            measured_latency_us,
            delay_us: shape(rate).delay.as_micros() as u64,
            loss_pct: sh.loss_pct,
            queue: sh.queue,
            dilation: d,
        };
        Ok((o, run))
    }

    /// `auto`: the factor for `rate`, from short runs of each mode's largest cell. Each is run
    /// at a trial factor (from [`PROBE_START`]); where the cores were nearly all busy the trial
    /// says too little and is repeated four times slower; else the factor that would bring
    /// the busiest mode's share to [`AUTO_BUSY`] is taken (the busy share falls as 1/D, the
    /// CPU work per step staying what it is), within [`AUTO_CAP`].
    fn probe(
        &self,
        specs: &[RunSpec],
        rate: f64,
        shape: &dyn Fn(f64) -> Shape,
        out: &Path,
        start: f64,
    ) -> anyhow::Result<Probe> {
        let dir = out.join(CHECKS_DIR);
        let mut cells: Vec<RunSpec> = Vec::new();
        for s in specs.iter().filter(|s| s.skip.is_none() && s.repeat == 0) {
            match cells.iter_mut().find(|c| c.mode == s.mode) {
                Some(c) if s.workers + s.shards > c.workers + c.shards => *c = s.clone(),
                Some(_) => {}
                None => cells.push(s.clone()),
            }
        }
        let mut short = self.scenario.clone();
        (short.steps, short.epochs, short.eval_samples, short.target_accuracy) =
            (Some(self.scenario.steps.unwrap_or(PROBE_STEPS).min(PROBE_STEPS)), None, None, None);
        let probe = Runner { scenario: &short, ..*self };
        let mut at = start;
        let mut confirmed = 0;
        loop {
            let mut busiest: Option<(String, f64)> = None;
            for c in &cells {
                let mut c = c.clone();
                c.id = format!("probe-{}", c.id);
                let (o, _) = probe.run(&c, rate, shape, at, &dir)?;
                if let Some(b) = o.cpu_busy.filter(|_| o.status == "ok")
                    && busiest.as_ref().is_none_or(|(_, x)| b > *x)
                {
                    busiest = Some((o.id.clone(), b));
                }
            }
            let Some((id, busy)) = busiest else {
                anyhow::bail!("dilate = auto: no probe run at {rate} Gbit/s finished (see {})", dir.display())
            };
            let chose = match auto_factor(at, busy) {
                AutoStep::Slower(next) => {
                    at = next;
                    continue;
                }
                // Busy falls more slowly than 1/D where the probe was busy (the kernel's
                // per-packet work, the processes' start): a factor extrapolated far from a busy
                // probe is probed again before it is taken (measured: x4 at 82% said x8, whose
                // runs kept the cores 66-68% busy and whose check failed).
                AutoStep::Chose(d) if busy > CONFIRM_BUSY && d > at && confirmed < CONFIRM_TRIES => {
                    (at, confirmed) = (d, confirmed + 1);
                    continue;
                }
                AutoStep::Chose(d) => d,
            };
            self.multi.suspend(|| {
                eprintln!(
                    "gradsync-bench cluster: {rate} Gbit/s: dilating x{chose} (probed at x{at}: {id} kept the cores \
                     {:.0}% busy)",
                    busy * 100.0
                )
            });
            return Ok(Probe {
                at,
                busy,
                busiest: id,
                chose,
                capped: chose >= AUTO_CAP && busy * at / AUTO_CAP > AUTO_BUSY,
            });
        }
    }

    /// The self-check of a rate dilated `d` times: the cell whose run kept the cores busiest
    /// run again at 2d; their step times (emulated) should agree. A synchronous run is checked
    /// where the rate has one: an asynchronous step is set by the phase its workers fall into
    /// (`crate::results::push_overlap`), which timing decides, so its repetition may differ for
    /// that alone; checked all the same, its overlaps are recorded to tell the two apart.
    fn check(
        &self,
        at_rate: &[(&RunSpec, Outcome)],
        rate: f64,
        shape: &dyn Fn(f64) -> Shape,
        d: f64,
        out: &Path,
    ) -> anyhow::Result<Option<Check>> {
        let Some(&(spec, ref o)) = check_cell(at_rate) else { return Ok(None) };
        let at = 2.0 * self.factor(spec, d);
        let mut spec = spec.clone();
        spec.id = format!("check-{}", spec.id);
        let dir = out.join(CHECKS_DIR);
        let (again, _) = self.run(&spec, rate, shape, at, &dir)?;
        let summary = |root: &Path, id: &str| -> Option<crate::results::Summary> {
            let c = crate::results::collect(&[root.to_path_buf()], None).ok()?;
            c.summaries.into_iter().find(|s| s.id == id)
        };
        let (a, b) = (summary(out, &o.id), summary(&dir, &again.id));
        let figure =
            |f: fn(&crate::results::Summary) -> Option<f64>| (a.as_ref().and_then(f), b.as_ref().and_then(f));
        let (step_a, step_b) = figure(|s| s.step_ms);
        let overlap = match figure(|s| s.push_overlap) {
            (Some(x), Some(y)) => Some((x, y)),
            _ => None,
        };
        Ok(Some(Check {
            id: o.id.clone(),
            again: format!("{CHECKS_DIR}/{}", again.id),
            at: Some(at),
            step_ms: step_a,
            step_ms_2x: step_b,
            differs: match (step_a, step_b) {
                (Some(a), Some(b)) => (b - a).abs() / a > CHECK_TOLERANCE,
                // A check that did not finish cannot vouch for the factor.
                _ => true,
            },
            push_overlap: overlap,
        }))
    }
}

/// The run a rate's self-check repeats: of the runs that finished, the one that kept the cores
/// busiest, a synchronous one where there is any (an asynchronous step moves with its workers'
/// phase, which a repetition may find otherwise whatever the factor).
fn check_cell<'a>(at_rate: &'a [(&'a RunSpec, Outcome)]) -> Option<&'a (&'a RunSpec, Outcome)> {
    let busiest = |sync: bool| {
        at_rate
            .iter()
            .filter(|(s, o)| o.status == "ok" && s.mode.is_async() != sync)
            .max_by(|a, b| a.1.cpu_busy.unwrap_or(0.0).total_cmp(&b.1.cpu_busy.unwrap_or(0.0)))
    };
    busiest(true).or_else(|| busiest(false))
}

/// What `auto` does after a probe at factor `at` kept the cores `busy` (a share).
#[derive(Debug, Clone, Copy, PartialEq)]
enum AutoStep {
    /// The cores were nearly all busy: the probe says only "more"; probe again at this factor.
    Slower(f64),
    /// Run at this factor.
    Chose(f64),
}

/// The factor that brings the busy share to [`AUTO_BUSY`] (it falls as 1/D, the CPU work per
/// step staying what it is), within 1 and [`AUTO_CAP`]; or, from a probe that saturated the
/// cores below the cap, a probe four times slower.
fn auto_factor(at: f64, busy: f64) -> AutoStep {
    if busy >= PROBE_SATURATED && at < AUTO_CAP {
        AutoStep::Slower((at * 4.0).min(AUTO_CAP))
    } else {
        AutoStep::Chose((at * busy / AUTO_BUSY).ceil().clamp(1.0, AUTO_CAP))
    }
}

/// `auto`'s first trial factor at `rate`: [`PROBE_START`], or, after a rate `last` = (rate,
/// factor chosen), that factor scaled by the rates (the CPU work per step stays what it is, so
/// the factor that keeps the cores half busy grows with the rate), within [`PROBE_START`] and
/// [`AUTO_CAP`]. A big cluster's probe costs its CPU work at every trial; starting near the
/// answer saves the trials that would only say "more".
fn probe_start(last: Option<(f64, f64)>, rate: f64) -> f64 {
    match last {
        Some((r, d)) if r > 0.0 => (d * rate / r).round().clamp(PROBE_START, AUTO_CAP),
        _ => PROBE_START,
    }
}

/// `1`, `10`, `2.5`: a rate as it appears in run ids.
fn fmt_rate(r: f64) -> String {
    let s = format!("{r}");
    s.replace('.', "p")
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::{ClusterArgs, ModeKind, Scenario, Shards, check_cell, cluster_scenario};
    use crate::results::Outcome;
    use crate::scenario::RunSpec;

    /// A run of `mode` that finished as `status`, having kept the cores `busy`.
    fn ran(mode: ModeKind, status: &str, busy: f64) -> (RunSpec, Outcome) {
        let spec = RunSpec {
            id: format!("runs/{}", mode.label()),
            mode,
            workers: 2,
            model: "mnist".into(),
            global_batch: 64,
            batch: 32,
            shards: 1,
            colocated: false,
            ranks_per_host: 1,
            slow_ms: 0,
            repeat: 0,
            skip: None,
            dilate: 4.0,
        };
        let o = Outcome {
            id: spec.id.clone(),
            mode,
            workers: 2,
            model: spec.model.clone(),
            global_batch: 64,
            shards: 1,
            slow_ms: 0,
            repeat: 0,
            status: status.into(),
            error: None,
            seconds: 1.0,
            cpu_s: None,
            cpu_busy: Some(busy),
            restarts: Vec::new(),
        };
        (spec, o)
    }

    /// The check repeats the busiest finished run, a synchronous one where any finished: an
    /// asynchronous step moves with its workers' phase whatever the factor.
    #[test]
    fn the_self_check_repeats_the_busiest_synchronous_run_where_there_is_one() {
        let runs = [
            ran(ModeKind::PsAsp, "ok", 0.40),
            ran(ModeKind::PsBsp, "ok", 0.20),
            ran(ModeKind::DdpTcp, "failed", 0.30),
            ran(ModeKind::Zero1Tcp, "ok", 0.25),
        ];
        let at: Vec<(&RunSpec, Outcome)> = runs.iter().map(|(s, o)| (s, o.clone())).collect();
        assert_eq!(check_cell(&at).map(|c| c.0.mode), Some(ModeKind::Zero1Tcp));
        let only_async: Vec<(&RunSpec, Outcome)> =
            at.iter().filter(|c| c.0.mode.is_async()).cloned().collect();
        assert_eq!(check_cell(&only_async).map(|c| c.0.mode), Some(ModeKind::PsAsp));
        let none: Vec<(&RunSpec, Outcome)> = at.iter().filter(|c| c.1.status != "ok").cloned().collect();
        assert!(check_cell(&none).is_none());
    }

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        a: ClusterArgs,
    }

    fn args(flags: &[&str]) -> ClusterArgs {
        Cli::parse_from([&["cluster"][..], flags].concat()).a
    }

    /// Without a scenario file the cluster runs ps-bsp and ddp-tcp on 4 workers and 1 shard;
    /// a scenario file's modes, hosts, ranks per host and shards are kept; each flag replaces
    /// its key.
    #[test]
    fn a_scenario_file_places_its_runs_unless_a_flag_says_otherwise() {
        let defaults = Scenario::load(None).unwrap();
        let s = cluster_scenario(defaults.clone(), &args(&[])).unwrap();
        assert_eq!(
            (s.modes.as_slice(), s.workers.as_slice()),
            (&[ModeKind::PsBsp, ModeKind::DdpTcp][..], &[4][..])
        );
        assert_eq!(s.shards, [Shards::Count(1)]);
        assert_eq!((s.steps, s.repeats), (Some(super::CLUSTER_STEPS), super::CLUSTER_REPEATS));
        let mut file = defaults.clone();
        (file.modes, file.workers, file.hosts) = (vec![ModeKind::Zero1Tcp], Vec::new(), vec![8, 16]);
        (file.ranks_per_host, file.shards) = (vec![1, 2], vec![Shards::PerHosts(1), Shards::PerHosts(2)]);
        (file.steps, file.epochs, file.repeats) = (Some(4), None, 2);
        let s = cluster_scenario(file.clone(), &args(&["scale.toml"])).unwrap();
        // Its step budget and repeats too, its evaluation off.
        assert_eq!((s.steps, s.repeats, s.eval_samples), (Some(4), 2, None));
        assert_eq!(
            (s.modes, s.hosts, s.ranks_per_host, s.shards),
            (file.modes.clone(), file.hosts.clone(), file.ranks_per_host.clone(), file.shards.clone())
        );
        let s = cluster_scenario(
            file,
            &args(&["scale.toml", "--workers", "4", "--ranks-per-host", "2", "--shards", "hosts/2"]),
        )
        .unwrap();
        assert_eq!(
            (s.workers, s.hosts, s.ranks_per_host, s.shards),
            (vec![4], vec![], vec![2], vec![Shards::PerHosts(2)])
        );
    }

    /// `--bucket-mb` replaces the scenario's bucket size; a size not above 0 is refused by name.
    #[test]
    fn the_bucket_size_flag_replaces_the_scenarios_and_refuses_nonsense() {
        let defaults = Scenario::load(None).unwrap();
        let s = cluster_scenario(defaults.clone(), &args(&["--bucket-mb", "1"])).unwrap();
        assert_eq!(s.bucket_mb, Some(1.0));
        assert_eq!(cluster_scenario(defaults.clone(), &args(&[])).unwrap().bucket_mb, defaults.bucket_mb);
        for bad in ["--bucket-mb=0", "--bucket-mb=-5", "--bucket-mb=inf"] {
            let e = cluster_scenario(defaults.clone(), &args(&[bad])).unwrap_err().to_string();
            assert!(e.contains("--bucket-mb"), "{e}");
        }
    }

    /// `--dilate-for DESIGN=FACTOR` names a design the way the report does (`k=4` holds its
    /// own `=`) and joins `--dilate` in the scenario; a design the cluster does not run, a
    /// factor below 1 or one without `--dilate` is refused by name.
    #[test]
    fn a_design_takes_a_factor_of_its_own_by_the_name_the_report_gives_it() {
        let base =
            ["--modes", "ddp-tcp,ps-bsp", "--workers", "4", "--shards", "hosts,hosts/2", "--dilate", "12"];
        let with = |extra: &[&str]| {
            cluster_scenario(Scenario::load(None).unwrap(), &args(&[&base[..], extra].concat()))
        };
        let s = with(&["--dilate-for", "ddp-tcp=6", "--dilate-for", "ps-bsp k=2=6.5"]).unwrap();
        assert_eq!(s.dilate, Some(crate::scenario::Dilate::Factor(12.0)));
        assert_eq!(s.dilate_for, [("ddp-tcp".to_string(), 6.0), ("ps-bsp k=2".to_string(), 6.5)].into());
        // Each run finds its own by its design.
        let designs: Vec<(String, f64)> = s
            .expand()
            .iter()
            .map(|r| (r.design(), s.dilate_for.get(&r.design()).copied().unwrap_or(12.0)))
            .collect();
        assert!(
            designs.contains(&("ps-bsp k=4".into(), 12.0)) && designs.contains(&("ps-bsp k=2".into(), 6.5))
        );
        let e = format!("{:#}", with(&["--dilate-for", "ps-bsp k=3=6"]).unwrap_err());
        assert!(
            e.contains("'ps-bsp k=3': no run of this scenario is that design; it runs 'ddp-tcp', 'ps-bsp k=2', 'ps-bsp k=4'"),
            "{e}"
        );
        for (bad, says) in
            [("ddp-tcp", "give DESIGN=FACTOR"), ("ddp-tcp=fast", "not a number"), ("ddp-tcp=0.5", "from 1")]
        {
            let e = Cli::try_parse_from(["cluster", "--dilate-for", bad]).err().expect("refused").to_string();
            assert!(e.contains(bad) && e.contains("--dilate-for") && e.contains(says), "{bad}: {e}");
        }
        let e = format!(
            "{:#}",
            cluster_scenario(Scenario::load(None).unwrap(), &args(&["--dilate-for", "ddp-tcp=6"]))
                .unwrap_err()
        );
        assert!(e.contains("`dilate_for` needs `dilate` (--dilate)"), "{e}");
    }

    /// `auto` starts each rate after the first near the factor the first chose, scaled by the
    /// rates.
    #[test]
    fn a_later_rates_probe_starts_from_the_last_factor_scaled_by_the_rates() {
        use super::probe_start;
        assert_eq!(probe_start(None, 10.0), 4.0);
        assert_eq!(probe_start(Some((10.0, 20.0)), 25.0), 50.0);
        assert_eq!(probe_start(Some((10.0, 200.0)), 100.0), 512.0);
        assert_eq!(probe_start(Some((10.0, 8.0)), 1.0), 4.0);
    }

    /// `auto`: a saturated probe asks for one four times slower, up to the cap; else the factor
    /// that brings the cores to 45% busy, at least 1, at most 64.
    #[test]
    fn auto_picks_the_factor_for_45_percent_busy_within_its_bounds() {
        use super::{AutoStep, auto_factor};
        assert_eq!(auto_factor(4.0, 0.95), AutoStep::Slower(16.0));
        assert_eq!(auto_factor(16.0, 0.99), AutoStep::Slower(64.0));
        // At the cap a saturated probe is what it is: run at the cap.
        assert_eq!(auto_factor(64.0, 0.99), AutoStep::Slower(256.0));
        assert_eq!(auto_factor(256.0, 0.99), AutoStep::Slower(512.0));
        assert_eq!(auto_factor(512.0, 0.99), AutoStep::Chose(512.0));
        assert_eq!(auto_factor(256.0, 0.85), AutoStep::Chose(484.0));
        assert_eq!(auto_factor(256.0, 0.89), AutoStep::Chose(507.0));
        assert_eq!(auto_factor(512.0, 0.5), AutoStep::Chose(512.0));
        // 4 x 0.6 / 0.45 = 5.33: x6.
        assert_eq!(auto_factor(4.0, 0.6), AutoStep::Chose(6.0));
        // 4 x 0.3 / 0.45 = 2.67: x3.
        assert_eq!(auto_factor(4.0, 0.3), AutoStep::Chose(3.0));
        // Cores nearly idle at x4: no dilation needed.
        assert_eq!(auto_factor(4.0, 0.05), AutoStep::Chose(1.0));
        assert_eq!(auto_factor(16.0, 0.85), AutoStep::Chose(31.0));
    }

    #[test]
    fn a_step_budget_unless_asked_for_time_to_accuracy() {
        let defaults = Scenario::load(None).unwrap();
        let s = cluster_scenario(defaults.clone(), &args(&["--workers", "3"])).unwrap();
        assert_eq!(
            (s.steps, s.epochs, s.repeats),
            (Some(super::CLUSTER_STEPS), None, super::CLUSTER_REPEATS)
        );
        assert!(s.repeats > 1, "a ranking needs repeats");
        assert_eq!((s.eval_samples, s.target_accuracy, s.workers.as_slice()), (None, None, &[3][..]));
        let s = cluster_scenario(defaults.clone(), &args(&["--repeats", "1"])).unwrap();
        assert_eq!(s.repeats, 1);
        let e = cluster_scenario(defaults.clone(), &args(&["--repeats", "0"])).unwrap_err().to_string();
        assert!(e.contains("--repeats 0"), "{e}");

        // --to-accuracy keeps the scenario's epochs, evaluation, target and repeats.
        let s = cluster_scenario(defaults.clone(), &args(&["--to-accuracy"])).unwrap();
        assert_eq!((s.steps, s.epochs, s.repeats), (defaults.steps, defaults.epochs, defaults.repeats));
        assert!(s.repeats > 1 && s.epochs.is_some());
        assert_eq!((s.eval_samples, s.target_accuracy), (defaults.eval_samples, defaults.target_accuracy));
        // ... and --steps replaces only the budget.
        let s = cluster_scenario(defaults.clone(), &args(&["--to-accuracy", "--steps", "12"])).unwrap();
        assert_eq!((s.steps, s.epochs, s.target_accuracy), (Some(12), None, defaults.target_accuracy));

        // Without a target there is no time to accuracy to measure: said, not run.
        let mut no_target = defaults;
        no_target.target_accuracy = None;
        let e = cluster_scenario(no_target, &args(&["--to-accuracy"])).unwrap_err().to_string();
        assert!(e.contains("--to-accuracy needs a scenario with target_accuracy"), "{e}");
    }
}
