//! gradsync's comparison: `gradsync-bench compare` and `gradsync-bench plot` (and `cluster`,
//! the comparison on emulated hosts). Run an experiment matrix with real server and worker
//! processes on this machine, on emulated hosts, on hosts over ssh or in a Slurm allocation,
//! then turn every process's metrics into merged tables, charts and one self-contained report.
//!
//! A run directory holds `scenario.toml`, `machine.json`, `outcomes.jsonl` (how each run ended),
//! `runs/<id>/` (each process's metrics, traces and logs), and what `plot` derives from them:
//! `runs.jsonl`, `summary.csv`, the charts (`*.svg`, `*.png`) and `report.html`.
//!
//! # Layout
//! - this file: the flags of `compare` and `plot`, the matrix run cell by cell into a run
//!   directory, and the report rebuilt from run directories.
//! - [`scenario`]: the TOML matrix and the runs it expands to.
//! - [`modes`]: each mode's command lines, a [`modes::Plan`] of processes per run.
//! - [`exec`]: one plan run to its end (interruption, injected kills, restarts).
//! - [`site`]: where a process runs ([`site::Site`]: how it is launched, its files copied back,
//!   the link between two sites measured, written once) and the sites a comparison places its
//!   runs on ([`site::Pool`]). One implementation per file, each over [`site`] alone:
//!   - [`local`]: this machine;
//!   - [`netns`]: an emulated host's network namespace;
//!   - [`ssh`]: `compare --hosts`, the hosts reached over ssh (read from a [`hostfile`]);
//!   - [`slurm`]: `compare --slurm`, the nodes of a Slurm allocation, and `--emit-sbatch`.
//! - [`pools`]: which of those pools the flags name (`--hosts`, `--slurm`), its slots as
//!   listed, and the pool reached and checked: for `compare` and for `advise`.
//! - [`binaries`]: the gradsync binaries a host or node runs, checked there at the start
//!   (`--copy-binaries`: this machine's put where they are missing).
//! - [`place`]: where a run's processes go on hosts or nodes, and whether they can take them.
//! - [`child`]: the runner's child processes (one piped into another among them) and every
//!   wait on one with a deadline.
//! - [`machine`]: the machine and link record (`machine.json`) and what a machine or a host
//!   cannot take.
//! - [`results`]: what a run reduces to, read from its files.
//! - [`cost`]: the alpha-beta cost models.
//! - [`advise`]: `gradsync-bench advise`, the configuration to train a model with on a cluster,
//!   picked by a per-step timeline predictor over the cost models and the real bucket plan.
//! - [`charts`], [`report`]: the charts and the report page.
//! - [`emulated`]: the record of runs on emulated links (`cluster.json`).
//! - [`cluster`]: `gradsync-bench cluster`, the comparison's runs on emulated hosts.
//! - [`net`]: emulated hosts (network namespaces, veth, a bridge, tc-shaped links).
//! - [`hosts`]: where plain sockets live: loopback, or emulated hosts.
//! - [`rawtcp`]: the raw-TCP yardstick every network figure is read against, and
//!   `rawtcp-peer`, its two ends on two hosts.
//! - [`table`]: plain-text tables.

pub mod advise;
pub mod binaries;
pub mod charts;
pub mod child;
pub mod cluster;
pub mod cost;
pub mod emulated;
pub mod exec;
pub mod hostfile;
pub mod hosts;
pub mod local;
pub mod machine;
pub mod modes;
pub mod net;
pub mod netns;
pub mod place;
pub mod pools;
pub mod rawtcp;
pub mod report;
pub mod results;
pub mod scenario;
pub mod site;
pub mod slurm;
pub mod ssh;
pub mod table;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;
use indicatif::{MultiProgress, ProgressBar, ProgressStyle};

use machine::Machine;
use results::Outcome;
use scenario::{ModeKind, Scenario};

/// Flags of `gradsync-bench compare`.
#[derive(Debug, Clone, Args)]
pub struct CompareArgs {
    /// Scenario file (TOML); the built-in default scenario when absent.
    pub scenario: Option<PathBuf>,
    /// Run directory (default: runs/<UTC timestamp>).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Directory holding gradsync-worker and gradsync-server (default: beside this program).
    #[arg(long, env = "GRADSYNC_BIN_DIR")]
    pub bin_dir: Option<PathBuf>,
    /// Override the scenario's budget with this many steps per run.
    #[arg(long, conflicts_with = "epochs")]
    pub steps: Option<u64>,
    /// Override the scenario's budget with this many epochs per run.
    #[arg(long)]
    pub epochs: Option<u64>,
    /// Override the scenario's repeats per cell.
    #[arg(long)]
    pub repeats: Option<usize>,
    /// Finish an interrupted comparison in DIR: run the cells it has no outcome for (and the
    /// one that was interrupted) with its own scenario and machine record; the finished runs
    /// stay as they are.
    #[arg(long, value_name = "DIR", conflicts_with_all = ["scenario", "out", "steps", "epochs", "repeats", "models", "workers", "modes", "device", "trace"])]
    pub resume: Option<PathBuf>,
    /// Override the scenario's model list.
    #[arg(long, value_delimiter = ',')]
    pub models: Option<Vec<String>>,
    /// Override the scenario's worker counts.
    #[arg(long, value_delimiter = ',')]
    pub workers: Option<Vec<usize>>,
    /// Override the scenario's modes.
    #[arg(long, value_delimiter = ',')]
    pub modes: Option<Vec<ModeKind>>,
    /// Override the scenario's worker device (cpu, cuda, cuda:N, auto).
    #[arg(long)]
    pub device: Option<String>,
    /// Record Chrome trace-event timelines of every process.
    #[arg(long)]
    pub trace: bool,
    /// Run every server and worker on these hosts over ssh: a hostfile (`node0 slots=4` a
    /// line, DeepSpeed's form) or a list (`node0:4,node1:4`, Horovod's). Each host needs the
    /// same gradsync binaries at the same path (or --remote-bin-dir; or --copy-binaries).
    #[arg(long, value_name = "FILE|LIST", conflicts_with = "slurm", group = "sites")]
    pub hosts: Option<String>,
    /// Run inside the Slurm allocation this runs in (SLURM_JOB_ID, SLURM_JOB_NODELIST): every
    /// server and worker a job step started with srun on the node its run's placement gives
    /// it. Each node needs the same gradsync binaries at the same path (or --copy-binaries).
    #[arg(long, group = "sites")]
    pub slurm: bool,
    /// Write a Slurm batch script (DIR/compare.sbatch, with the scenario beside it) that runs
    /// this comparison with --slurm in an allocation sized from its largest run, instead of
    /// running it.
    #[arg(long, value_name = "DIR", conflicts_with_all = ["slurm", "hosts", "resume", "out"], group = "sites")]
    pub emit_sbatch: Option<PathBuf>,
    /// Put this machine's gradsync binaries on every host (into --remote-bin-dir) or Slurm node
    /// (into a directory of its own, removed at the end) that lacks them or has another build,
    /// each replacing the old by a rename, then check it again; without it such a host or node
    /// is refused. Nothing is copied where every one has them already (a shared file system).
    #[arg(long, requires = "sites")]
    pub copy_binaries: bool,
    /// The processes the batch script of --emit-sbatch places on each node (its cores, or GPUs).
    #[arg(long, default_value_t = 1, requires = "emit_sbatch")]
    pub tasks_per_node: usize,
    /// More options for every ssh command (split at white space: `-F FILE -o User=me`); unused
    /// without --hosts (so the variable may stay set for a comparison on this machine).
    #[arg(long, env = "GRADSYNC_SSH_OPTS", allow_hyphen_values = true)]
    pub ssh_opts: Option<String>,
    /// Where processes write on the hosts before their files are copied back (default: a
    /// fresh /tmp/gradsync-compare-<stamp>-<pid>).
    #[arg(long, requires = "hosts")]
    pub remote_dir: Option<PathBuf>,
    /// Where the gradsync binaries are on the hosts (default: where they are here).
    #[arg(long, requires = "hosts")]
    pub remote_bin_dir: Option<PathBuf>,
    /// The parameter servers serve TLS with this certificate chain (PEM, the same path on
    /// every host); needs --tls-key and --tls-ca.
    #[arg(long, requires_all = ["tls_key", "tls_ca"])]
    pub tls_cert: Option<PathBuf>,
    /// The private key of --tls-cert (PEM).
    #[arg(long, requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// The CA the workers trust for the servers' certificates (PEM).
    #[arg(long, requires = "tls_cert")]
    pub tls_ca: Option<PathBuf>,
    /// The name the servers' certificate carries (default: each server's address).
    #[arg(long, requires = "tls_cert")]
    pub tls_domain: Option<String>,
}

/// How a comparison's processes are started: on this machine, on `--hosts` over ssh, or as
/// steps of a Slurm allocation (`--slurm`); with the parameter server's TLS when asked for.
#[derive(Default)]
pub struct Launching {
    /// The hosts, checked, or the allocation's nodes; none on this machine.
    pub pool: Option<Box<dyn site::Pool>>,
    /// The certificates.
    pub tls: Option<modes::Tls>,
}

impl Launching {
    /// From the flags: the hosts checked (reachable, the same binaries as `bins`), for a
    /// comparison written to `out`.
    pub fn from_args(a: &CompareArgs, bins: &modes::Bins, out: &Path) -> anyhow::Result<Launching> {
        let tls = match (&a.tls_cert, &a.tls_key, &a.tls_ca) {
            (Some(cert), Some(key), Some(ca)) => Some(modes::Tls {
                cert: cert.clone(),
                key: key.clone(),
                ca: ca.clone(),
                domain: a.tls_domain.clone(),
            }),
            _ => None,
        };
        let pool = match (a.slurm, &a.hosts) {
            (true, _) => pools::PoolSpec::Slurm { copy_binaries: a.copy_binaries },
            (false, Some(list)) => pools::PoolSpec::Hosts {
                list: list.clone(),
                ssh: ssh::SshArgs {
                    ssh_opts: a.ssh_opts.clone(),
                    remote_dir: a.remote_dir.clone(),
                    remote_bin_dir: a.remote_bin_dir.clone(),
                    copy_binaries: a.copy_binaries,
                },
            },
            (false, None) => return Ok(Launching { pool: None, tls }),
        };
        let local = binaries::LocalBinaries::of(bins)?;
        Ok(Launching { pool: Some(pool.connect(&local, out, "gradsync-bench compare")?), tls })
    }
}

/// Flags of `gradsync-bench plot`.
#[derive(Debug, Clone, Args)]
pub struct PlotArgs {
    /// Run directories (or any directories holding metrics files, walked recursively).
    #[arg(required = true)]
    pub dirs: Vec<PathBuf>,
    /// Where to write the tables, charts and report (default: the first directory).
    #[arg(long)]
    pub out: Option<PathBuf>,
}

/// Run `compare`.
pub fn run_compare(a: &CompareArgs) -> anyhow::Result<()> {
    exec::catch_interrupts();
    if let Some(dir) = &a.resume {
        let bins = modes::Bins::find(a.bin_dir.as_deref())?;
        let path = dir.join("scenario.toml");
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("--resume {}: reading {}", dir.display(), path.display()))?;
        let scenario = Scenario::parse(&text, &path.display().to_string())?;
        let launching = Launching::from_args(a, &bins, dir)?;
        let outcomes = compare_into(&scenario, &bins, dir, true, &launching)?;
        return finish(&outcomes, dir);
    }
    let mut scenario = Scenario::load(a.scenario.as_deref())?;
    if let Some(s) = a.steps {
        (scenario.steps, scenario.epochs) = (Some(s), None);
    }
    if let Some(e) = a.epochs {
        (scenario.steps, scenario.epochs) = (None, Some(e));
    }
    if let Some(r) = a.repeats {
        scenario.repeats = r;
    }
    if let Some(m) = &a.models {
        scenario.models = m.clone();
    }
    if let Some(w) = &a.workers {
        scenario.workers = w.clone();
    }
    if let Some(m) = &a.modes {
        scenario.modes = m.clone();
    }
    if let Some(d) = &a.device {
        scenario.device = d.clone();
    }
    scenario.trace |= a.trace;
    let text = toml::to_string(&scenario).context("writing the scenario")?;
    // Re-parse what will be recorded, so overrides are checked like the file.
    let scenario = Scenario::parse(&text, "the scenario with command-line overrides")?;
    if let Some(dir) = &a.emit_sbatch {
        let bench = std::env::current_exe().context("locating gradsync-bench")?;
        let script = slurm::emit_sbatch(
            &scenario,
            dir,
            &bench,
            a.bin_dir.as_deref(),
            a.copy_binaries,
            a.tasks_per_node,
        )?;
        eprintln!("gradsync-bench compare: wrote {}; submit it with sbatch", script.display());
        return Ok(());
    }
    let bins = modes::Bins::find(a.bin_dir.as_deref())?;
    let out = a.out.clone().unwrap_or_else(|| PathBuf::from("runs").join(utc_stamp()));
    let launching = Launching::from_args(a, &bins, &out)?;
    let outcomes = compare_into(&scenario, &bins, &out, false, &launching)?;
    finish(&outcomes, &out)
}

/// After the runs (all, or those finished before an interruption): the report, and what to
/// do next when the comparison was interrupted.
fn finish(outcomes: &[Outcome], out: &Path) -> anyhow::Result<()> {
    let html = plot(&[out.to_path_buf()], out)?;
    if exec::interrupted() {
        let done = outcomes.iter().filter(|o| o.status != "interrupted").count();
        eprintln!(
            "gradsync-bench compare: interrupted; the summary and report in {} cover the {done} finished              run(s) (the interrupted one is listed apart and feeds no reading). Finish the comparison with              `gradsync-bench compare --resume {}`.",
            html.display(),
            out.display()
        );
        std::process::exit(130);
    }
    eprintln!("gradsync-bench compare: report in {}", html.display());
    Ok(())
}

/// Run `plot`.
pub fn run_plot(a: &PlotArgs) -> anyhow::Result<()> {
    let out = a.out.clone().unwrap_or_else(|| a.dirs[0].clone());
    let html = plot(&a.dirs, &out)?;
    eprintln!("gradsync-bench plot: report in {}", html.display());
    Ok(())
}

/// Run every cell of `scenario` into `out`: the scenario, the machine (with its link measured
/// now), each run's processes, and `outcomes.jsonl`. A failed run is recorded and the next one
/// starts.
pub fn compare(scenario: &Scenario, bins: &modes::Bins, out: &Path) -> anyhow::Result<Vec<Outcome>> {
    compare_on(scenario, bins, out, &Launching::default())
}

/// [`compare`] with its processes started as `launching` says: on the hosts or nodes of its
/// pool (which it tidies at the end), as `compare --hosts` and `--slurm` run a scenario.
pub fn compare_on(
    scenario: &Scenario,
    bins: &modes::Bins,
    out: &Path,
    launching: &Launching,
) -> anyhow::Result<Vec<Outcome>> {
    compare_into(scenario, bins, out, false, launching)
}

/// [`compare`], or with `resume` the cells of `out` that have no outcome yet (an interrupted
/// run's outcome and files are dropped first, so nothing partial is merged).
fn compare_into(
    scenario: &Scenario,
    bins: &modes::Bins,
    out: &Path,
    resume: bool,
    launching: &Launching,
) -> anyhow::Result<Vec<Outcome>> {
    // Links that are not emulated cannot be slowed with the rest of the world.
    if let Some(d) = scenario.dilate {
        anyhow::bail!(
            "the scenario's `dilate = {d}` needs emulated links, which a dilated world slows with its clocks: \
             run it with `gradsync-bench cluster` (loopback, --hosts and --slurm links run at their own rate)"
        );
    }
    // Where ranks go is the sites' to say here (one per slot), not the scenario's.
    anyhow::ensure!(
        scenario.hosts.is_empty() && scenario.ranks_per_host == [1],
        "the scenario's `hosts` and `ranks_per_host` place ranks on emulated hosts: run it with \
         `gradsync-bench cluster` (give `workers` here)"
    );
    anyhow::ensure!(
        scenario.servers == [scenario::Servers::Apart],
        "the scenario's `servers` places shards on emulated worker hosts: run it with `gradsync-bench cluster` \
         (here the sites place the servers: on loopback all share one machine, across hosts `place.rs` puts them)"
    );
    let outcomes_path = out.join("outcomes.jsonl");
    let mut outcomes = if resume { finished_outcomes(out)? } else { Vec::new() };
    // Old metrics left beside new ones would be merged into this comparison's results.
    anyhow::ensure!(
        resume || !outcomes_path.exists(),
        "{} already holds a comparison; choose another --out (or finish it with --resume)",
        out.display()
    );
    std::fs::create_dir_all(out.join("runs")).with_context(|| format!("creating {}", out.display()))?;
    let machine = if resume { read_machine(out)? } else { record_machine(scenario, out, launching)? };
    eprintln!("gradsync-bench compare: {}", describe_machine(&machine));
    // The file is rewritten with what stays, then appended to run by run.
    let mut kept = String::new();
    for o in &outcomes {
        kept.push_str(&serde_json::to_string(o)?);
        kept.push('\n');
    }
    std::fs::write(&outcomes_path, kept).with_context(|| format!("writing {}", outcomes_path.display()))?;
    let specs: Vec<_> = scenario
        .expand()
        .into_iter()
        .filter(|s| !outcomes.iter().any(|o| o.id == format!("runs/{}", s.id)))
        .collect();
    if resume {
        eprintln!("gradsync-bench compare: resuming {}: {} run(s) to go", out.display(), specs.len());
    }
    run_cells(scenario, specs, bins, out, &machine, launching, &mut outcomes)?;
    if let Some(pool) = &launching.pool {
        pool.tidy();
    }
    let n = |s: &str| outcomes.iter().filter(|o| o.status == s).count();
    eprintln!(
        "gradsync-bench compare: {} runs: {} ok, {} diverged, {} stopped by the time budget, {} failed, {} \
         skipped, {} interrupted",
        outcomes.len(),
        n("ok"),
        n("diverged"),
        n("stopped"),
        n("failed"),
        n("skipped"),
        n("interrupted")
    );
    Ok(outcomes)
}

/// For `--resume`: the outcomes `out` holds of runs that finished; an interrupted run's files
/// are removed, so that it runs again from nothing.
fn finished_outcomes(out: &Path) -> anyhow::Result<Vec<Outcome>> {
    let outcomes_path = out.join("outcomes.jsonl");
    let text = std::fs::read_to_string(&outcomes_path)
        .with_context(|| format!("--resume: reading {}", outcomes_path.display()))?;
    let mut outcomes = Vec::new();
    for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let o: Outcome = serde_json::from_str(line)
            .with_context(|| format!("--resume: {}:{}", outcomes_path.display(), i + 1))?;
        if o.status == "interrupted" {
            let dir = out.join(&o.id);
            if dir.exists() {
                std::fs::remove_dir_all(&dir).with_context(|| format!("removing {}", dir.display()))?;
            }
        } else {
            outcomes.push(o);
        }
    }
    Ok(outcomes)
}

/// For `--resume`: the machine record `out` holds.
fn read_machine(out: &Path) -> anyhow::Result<Machine> {
    let p = out.join("machine.json");
    let text = std::fs::read_to_string(&p).with_context(|| format!("--resume: reading {}", p.display()))?;
    serde_json::from_str(&text).with_context(|| format!("--resume: {}", p.display()))
}

/// Write the scenario and the machine into `out`, the machine with its link measured now:
/// between two of the hosts or nodes the processes are started on, else over this machine's
/// loopback with as many streams as the scenario's modes keep busy.
fn record_machine(scenario: &Scenario, out: &Path, launching: &Launching) -> anyhow::Result<Machine> {
    let write = |name: &str, text: &str| -> anyhow::Result<()> {
        let p = out.join(name);
        std::fs::write(&p, text).with_context(|| format!("writing {}", p.display()))
    };
    write("scenario.toml", &toml::to_string(scenario).context("writing the scenario")?)?;
    let mut machine = Machine::detect();
    if let Some(pool) = &launching.pool {
        machine.measure_pool(pool.as_ref(), scenario.rawtcp_s)?;
    } else {
        let streams: Vec<usize> = scenario
            .expand()
            .iter()
            .filter_map(|s| machine::tcp_streams(s.mode, s.workers, s.shards))
            .flat_map(|s| [s.total, s.busiest])
            .collect();
        machine.measure_link(scenario.rawtcp_s, &streams)?;
    }
    write("machine.json", &(serde_json::to_string_pretty(&machine)? + "\n"))?;
    Ok(machine)
}

/// `Intel Xeon (8 cores); raw TCP 2.10 GB/s, latency 9.8 us`: what the runs ran on.
fn describe_machine(machine: &Machine) -> String {
    let what = if machine.hosts.is_empty() {
        format!("{} ({} cores)", machine.cpu, machine.cores)
    } else {
        machine
            .host_kinds()
            .iter()
            .map(|(f, names)| format!("{} x {} ({} cores)", names.len(), f.cpu, f.cores))
            .collect::<Vec<_>>()
            .join(", ")
    };
    format!(
        "{what}; raw TCP {:.2} GB/s{}, latency {:.1} us",
        machine.tcp_bandwidth / 1e9,
        machine.link.as_deref().map(|l| format!(" ({l})")).unwrap_or_default(),
        machine.tcp_latency_s * 1e6
    )
}

/// Run the cells `specs` one after the other into `out`, each placed by `launching` (or on
/// this machine, which `machine` says whether it can take), under an overall progress bar;
/// each outcome appended to `outcomes.jsonl` as it comes, and to `outcomes`. Stops early once
/// the runner is interrupted.
fn run_cells(
    scenario: &Scenario,
    specs: Vec<scenario::RunSpec>,
    bins: &modes::Bins,
    out: &Path,
    machine: &Machine,
    launching: &Launching,
    outcomes: &mut Vec<Outcome>,
) -> anyhow::Result<()> {
    let outcomes_path = out.join("outcomes.jsonl");
    let multi = MultiProgress::new();
    let overall = multi.add(ProgressBar::new(specs.len() as u64));
    overall.set_style(
        ProgressStyle::with_template("{prefix:>10} [{bar:30}] {pos}/{len} runs, {elapsed} {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    overall.set_prefix("overall");
    let mut outcomes_file = std::fs::OpenOptions::new()
        .append(true)
        .open(&outcomes_path)
        .with_context(|| format!("opening {}", outcomes_path.display()))?;
    for spec in specs {
        if exec::interrupted() {
            break;
        }
        let (placement, skip) = match launching.pool.as_ref().map(|p| p.place_slots(&spec)) {
            Some(Ok((servers, workers))) => (modes::Placement::Hosts { servers, workers }, spec.skip.clone()),
            Some(Err(why)) => (modes::Placement::Loopback, Some(why)),
            None => (
                modes::Placement::Loopback,
                spec.skip.clone().or_else(|| machine.cannot_run(spec.mode, spec.workers)),
            ),
        };
        let o =
            run_spec(scenario, &spec, bins, out, placement, launching.tls.clone(), skip, &multi, &overall)?;
        writeln!(outcomes_file, "{}", serde_json::to_string(&o)?)
            .and_then(|_| outcomes_file.flush())
            .with_context(|| format!("writing {}", outcomes_path.display()))?;
        outcomes.push(o);
        overall.inc(1);
    }
    overall.finish_and_clear();
    Ok(())
}

/// User and system CPU seconds of every child process this one has waited for
/// (`getrusage(RUSAGE_CHILDREN)`), which includes their own waited-for children.
fn children_cpu_s() -> f64 {
    // SAFETY: getrusage writes one rusage struct we own; RUSAGE_CHILDREN is always valid.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    if unsafe { libc::getrusage(libc::RUSAGE_CHILDREN, &mut u) } != 0 {
        return 0.0;
    }
    let s = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    s(u.ru_utime) + s(u.ru_stime)
}

/// Run one cell of the matrix into `out/runs/<id>` with its processes placed by `placement`
/// (unless `skip` or the spec's own skip says why it cannot run), print its line above the
/// progress bars, and return its outcome. Only a run directory that cannot be made is an
/// error; a run that fails is an outcome.
#[allow(clippy::too_many_arguments)]
pub fn run_spec(
    scenario: &Scenario,
    spec: &scenario::RunSpec,
    bins: &modes::Bins,
    out: &Path,
    placement: modes::Placement,
    tls: Option<modes::Tls>,
    skip: Option<String>,
    multi: &MultiProgress,
    overall: &ProgressBar,
) -> anyhow::Result<Outcome> {
    let rel = format!("runs/{}", spec.id);
    let dir = out.join(&rel);
    let t = Instant::now();
    let cpu0 = children_cpu_s();
    // Processes on other hosts are not this machine's children: their CPU is not counted here,
    // and their memory is checked against their hosts' when they are placed, not this machine's.
    let remote = matches!(&placement, modes::Placement::Hosts { workers, .. } if workers.iter().any(|w| !w.site.is_child()));
    let skip = spec
        .skip
        .clone()
        .or(skip)
        .or_else(|| if remote { None } else { machine::Machine::memory_short(spec) });
    let (status, error, steady_busy, restarts) = match skip {
        Some(why) => ("skipped", Some(why), None, Vec::new()),
        None => {
            std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
            let bar = run_bar(scenario, spec, multi, overall);
            // Processes on hosts that others can reach get tokens of their own, fresh each run.
            let env = if placement.needs_tokens() { modes::fresh_tokens()? } else { Vec::new() };
            let ctx = modes::Ctx {
                scenario: scenario.clone(),
                spec: spec.clone(),
                dir: placement.files_dir(&dir),
                bins: bins.clone(),
                placement,
                env,
                tls,
            };
            let result = execute_spec(&ctx, &dir, &bar);
            bar.finish_and_clear();
            multi.remove(&bar);
            let steady_busy = result.as_ref().ok().and_then(|f| f.cpu_busy);
            let restarts = result.as_ref().map(|f| f.restarts.clone()).unwrap_or_default();
            let (status, error) = status_of(result.map(|f| f.ended), scenario);
            (status, error, steady_busy, restarts)
        }
    };
    let o = Outcome {
        id: rel,
        mode: spec.mode,
        workers: spec.workers,
        model: spec.model.clone(),
        global_batch: spec.global_batch,
        shards: spec.shards,
        slow_ms: spec.slow_ms,
        repeat: spec.repeat,
        status: status.into(),
        error,
        seconds: t.elapsed().as_secs_f64(),
        cpu_s: (status != "skipped" && !remote).then(|| children_cpu_s() - cpu0),
        // The machine's cores while the steps ran; for a run too short to measure so, its
        // processes' own CPU time over the whole run (every process has been waited for, its
        // launcher's ranks by the launcher, so it is in this process's account of its
        // children), start-up included.
        cpu_busy: steady_busy.or_else(|| {
            (status != "skipped" && !remote).then(|| {
                let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
                (children_cpu_s() - cpu0) / (t.elapsed().as_secs_f64() * cores).max(1e-9)
            })
        }),
        restarts,
    };
    let line = format!(
        "{:<44} {:<8} {:>8}{}",
        spec.id,
        o.status,
        gradsync_core::metrics::elapsed(o.seconds),
        o.error.as_deref().map(|e| format!("  {}", first_chars(e, 160))).unwrap_or_default()
    );
    multi.suspend(|| eprintln!("{line}"));
    Ok(o)
}

/// The progress bar of one run, above the overall one: rank 0's steps out of the budget, or
/// counted where an epoch budget makes the step count depend on the data.
fn run_bar(
    scenario: &Scenario,
    spec: &scenario::RunSpec,
    multi: &MultiProgress,
    overall: &ProgressBar,
) -> ProgressBar {
    let bar = multi.insert_before(overall, ProgressBar::new(scenario.steps.unwrap_or(0)));
    let template = if scenario.steps.is_some() {
        "{prefix:>10} [{bar:30}] {pos}/{len} steps {per_sec} {msg}"
    } else {
        "{prefix:>10} {pos} steps {per_sec} {msg}"
    };
    bar.set_style(
        ProgressStyle::with_template(template)
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    bar.set_prefix(short(&spec.id));
    bar
}

/// Plan the processes of the run `ctx` describes and run them into `dir`, with its
/// scenario's time limits and injected faults.
fn execute_spec(ctx: &modes::Ctx, dir: &Path, bar: &ProgressBar) -> anyhow::Result<exec::Finished> {
    let (scenario, spec) = (&ctx.scenario, &ctx.spec);
    // A dilated run's clocks all run `dilate` times slower: so do the runner's limits.
    let waits = exec::Waits {
        timeout: Duration::from_secs_f64(scenario.run_timeout_s * spec.dilate),
        budget: scenario.time_s.map(|t| Duration::from_secs_f64(t * spec.dilate)),
        stop_at: scenario.target_accuracy.filter(|_| scenario.stop_at_target),
    };
    let faults = exec::Faults {
        max_restarts: scenario.max_restarts,
        kills: scenario.kill_plan(spec.repeat, spec.workers),
    };
    modes::plan(ctx).and_then(|plan| exec::execute(plan, dir, waits, faults, bar))
}

/// A run's status in `outcomes.jsonl` and why, from how it ended.
fn status_of(ended: anyhow::Result<exec::Ended>, scenario: &Scenario) -> (&'static str, Option<String>) {
    match ended {
        Ok(exec::Ended::Finished) => ("ok", None),
        Ok(exec::Ended::TimeBudget) => ("stopped", Some(format!("time budget of {:?} s", scenario.time_s))),
        Ok(exec::Ended::Diverged(why)) => ("diverged", Some(why)),
        Ok(exec::Ended::Interrupted) => ("interrupted", Some("stopped by Ctrl-C or SIGTERM".into())),
        Ok(exec::Ended::Target) => ("ok", None),
        // Its restarts spent: failed, and never ranked.
        Ok(exec::Ended::Exhausted(why)) => ("failed", Some(why)),
        Err(e) => ("failed", Some(format!("{e:#}"))),
    }
}

/// Rebuild tables, charts and the report of `dirs` into `out`; returns the report's path.
/// Deterministic: the output depends only on the input files.
pub fn plot(dirs: &[PathBuf], out: &Path) -> anyhow::Result<PathBuf> {
    let scenario: Option<String> =
        dirs.iter().find_map(|d| std::fs::read_to_string(d.join("scenario.toml")).ok());
    // The target is read leniently: a scenario of an older gradsync still plots.
    let target = scenario
        .as_deref()
        .and_then(|t| toml::from_str::<toml::Table>(t).ok())
        .and_then(|t| t.get("target_accuracy").and_then(toml::Value::as_float));
    let collected = results::collect(dirs, target)?;
    for w in &collected.warnings {
        eprintln!("gradsync-bench plot: warning: {w}");
    }
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    results::write_merged(&collected, out)?;
    let machine: Option<Machine> = dirs.iter().find_map(|d| {
        let text = std::fs::read_to_string(d.join("machine.json")).ok()?;
        serde_json::from_str(&text).ok()
    });
    let cluster = emulated::load(dirs);
    let html = report::write(&collected, machine.as_ref(), scenario.as_deref(), &cluster, out)?;
    Ok(html)
}

fn first_chars(s: &str, n: usize) -> String {
    let one_line = s.replace('\n', " ");
    if one_line.chars().count() <= n {
        one_line
    } else {
        one_line.chars().take(n).collect::<String>() + "..."
    }
}

/// A progress-bar prefix: the run id without its leading number.
fn short(id: &str) -> String {
    id.split_once('-').map_or(id, |(_, r)| r).chars().take(24).collect()
}

/// `YYYYMMDD-HHMMSS` in UTC, from the system clock (civil-from-days, Howard Hinnant).
pub(crate) fn utc_stamp() -> String {
    let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let (days, rem) = ((secs / 86400) as i64, secs % 86400);
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}{m:02}{d:02}-{:02}{:02}{:02}", rem / 3600, rem % 3600 / 60, rem % 60)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        compare: CompareArgs,
    }

    #[test]
    fn copy_binaries_goes_with_hosts_slurm_or_a_batch_script() {
        let parse = |args: &[&str]| Cli::try_parse_from([&["compare"], args].concat());
        for with in [&["--hosts", "n1:2"][..], &["--slurm"], &["--emit-sbatch", "jobs/x"]] {
            assert!(!parse(with).unwrap().compare.copy_binaries, "{with:?}");
            let a = parse(&[with, &["--copy-binaries"]].concat()).unwrap().compare;
            assert!(a.copy_binaries, "{with:?}");
        }
        let e = parse(&["--copy-binaries"]).unwrap_err().to_string();
        assert!(e.contains("--copy-binaries") && e.contains("--hosts"), "{e}");
        assert!(parse(&["--hosts", "n1:2", "--slurm"]).is_err());
    }
}
