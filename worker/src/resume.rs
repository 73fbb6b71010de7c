//! Checkpoints of a run in progress (`--checkpoint DIR --checkpoint-every N`) and the resumed
//! run that ends where an unbroken one would (`--resume`).
//!
//! Each checkpoint is a folder `DIR/step-NNNNNNNNNN/`:
//! - `model.safetensors`: the parameters and running statistics under PyTorch's names
//!   (`model.load_state_dict(safetensors.torch.load_file(...))` reads it);
//! - `optimizer.safetensors`: the SGD momentum, one tensor per parameter, named
//!   `momentum.<parameter>`;
//! - `run.json`: the step and epoch reached, what must match for a run to resume from it
//!   (model fingerprint, mode, world size, batch, optimiser, seeds), and each file's SHA-256.
//!
//! A checkpoint is written into a hidden folder beside its final name, every file and the
//! folder fsynced, then renamed into place and the parent fsynced: a process killed at any
//! moment leaves either the previous checkpoints alone or the new one complete. The newest
//! `keep` complete checkpoints are kept. A resumed run takes the newest checkpoint whose files
//! match their checksums, naming any it passes over.
//!
//! Each strategy decides what its checkpoint holds and which rank writes it
//! (`Strategy::checkpoint`, handed a [`CheckpointAt`]), and takes it back in its start (handed a
//! [`Resume`]): the one engine's state, written by rank 0 where every rank holds the same
//! (local, DP, DDP; ZeRO-1's momentum shards gathered for it) and read before the ranks agree
//! on it ([`Resume::engine`]); a parameter-server worker's own (its data position and top-k
//! residual; the servers keep the parameters), written by every worker in its folder
//! `DIR/rank-R` and read once the servers have said where the run is ([`Resume::worker`]). A
//! mode that cannot be checkpointed yet says why before it starts
//! ([`crate::setup::ModeConfig::checkpoint_support`]). The data order needs no state of its
//! own: the sampler's order is a function of the seed and the epoch, so the resumed run draws
//! the batches the unbroken run would.
//!
//! What goes wrong is a [`ResumeError`]: a file or folder that cannot be read or written (named
//! with what was being done to it), a checkpoint that cannot be read (its format, a checksum),
//! one written by a run unlike this one, or none that meets the servers' version.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use gradsync_core::Engine;
use gradsync_core::state_dict::{self, Entry, Tensors};
use gradsync_core::trace::Trace;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// Everything the checkpoints of a run refuse or fail at.
#[derive(Debug, thiserror::Error)]
pub enum ResumeError {
    /// A file or folder of the checkpoints could not be listed, created, written, synced,
    /// renamed, removed or read: `what` says which and what was being done to it.
    #[error("{what}")]
    Io {
        /// What was being done, to which path.
        what: String,
        /// The system's error.
        source: std::io::Error,
    },
    /// A checkpoint's `run.json` could not be made or read as JSON.
    #[error("{what} {RUN}")]
    Json {
        /// `parsing` or `serialising`.
        what: &'static str,
        /// The parser's error.
        source: serde_json::Error,
    },
    /// Writing a step's checkpoint failed; what it had begun was removed and the checkpoints
    /// before it stay.
    #[error("--checkpoint {}: writing the checkpoint of step {step}", dir.display())]
    Write {
        /// The checkpoints' folder.
        dir: PathBuf,
        /// The step.
        step: u64,
        /// Why.
        source: Box<ResumeError>,
    },
    /// A checkpoint in a format this gradsync does not read.
    #[error("format {found} (this gradsync reads {FORMAT})")]
    Format {
        /// Its format.
        found: u32,
    },
    /// A checkpoint file whose bytes do not match the checksum `run.json` gives.
    #[error("{file} does not match its checksum (a torn or altered file)")]
    Checksum {
        /// The file.
        file: &'static str,
    },
    /// A `run.json` that names the model's file without the optimiser's, or the other way.
    #[error("{RUN} names only one of {MODEL} and {OPTIMIZER}")]
    Incomplete,
    /// A checkpoint written by a run unlike this one.
    #[error("--resume {}: written by a run with {diff}; resume with the same settings", path.display())]
    Mismatch {
        /// The checkpoint's folder.
        path: PathBuf,
        /// How the runs differ (the checkpoint's value, then this run's).
        diff: String,
    },
    /// An engine's run resuming from a parameter-server worker's checkpoint, which holds no
    /// model.
    #[error(
        "--resume {}: holds no model (a parameter-server worker's checkpoint); resume with --mode {mode}",
        path.display()
    )]
    NoModel {
        /// The checkpoint's folder.
        path: PathBuf,
        /// The mode that wrote it.
        mode: String,
    },
    /// A checkpoint's optimiser file that lacks one of the model's parameters, or holds it
    /// in another shape.
    #[error("--resume {}: {why}", path.display())]
    Optimizer {
        /// The file.
        path: PathBuf,
        /// What does not fit.
        why: String,
    },
    /// Every checkpoint of a parameter-server worker was written after the version the
    /// servers resumed at.
    #[error(
        "--resume {}: this worker's oldest checkpoint (step {step}) was written at the servers' version \
         {at}, and the servers are at version {servers}: they resumed from an older checkpoint than any \
         this worker kept, so the two do not meet. Resume the servers from a checkpoint at version {at} \
         or later, or start the workers without --resume",
        dir.display()
    )]
    AheadOfServers {
        /// The worker's checkpoints' folder.
        dir: PathBuf,
        /// The step of its oldest checkpoint.
        step: u64,
        /// The servers' version it was written at.
        at: u64,
        /// The servers' version now.
        servers: u64,
    },
    /// A strategy's gathered momentum whose length is not the model's.
    #[error("the gathered momentum holds {got} values, not the model's {want}")]
    Momentum {
        /// Its length.
        got: usize,
        /// The model's.
        want: usize,
    },
    /// The engine failed: its state read or written, a tensor file encoded or decoded.
    #[error(transparent)]
    Core(#[from] gradsync_core::Error),
}

/// The result type of the checkpoints.
pub type Result<T, E = ResumeError> = std::result::Result<T, E>;

/// Name what was being done when a file operation failed, as [`ResumeError::Io`].
trait Doing<T> {
    /// The error, if any, as a [`ResumeError::Io`] saying `what` was being done.
    fn doing(self, what: impl FnOnce() -> String) -> Result<T>;
}

impl<T> Doing<T> for std::io::Result<T> {
    fn doing(self, what: impl FnOnce() -> String) -> Result<T> {
        self.map_err(|source| ResumeError::Io { what: what(), source })
    }
}

/// `e` and every error under it, joined as the binary's edge prints an error (for the
/// checkpoints passed over, which are named here and not returned).
fn chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        out.push_str(": ");
        out.push_str(&c.to_string());
        cur = c.source();
    }
    out
}

/// `--checkpoint` and its companions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Checkpoints {
    /// The folder holding the checkpoints.
    pub dir: PathBuf,
    /// Steps between checkpoints.
    pub every: u64,
    /// Checkpoints kept.
    pub keep: usize,
    /// Continue from the newest one.
    pub resume: bool,
}

/// What must be the same for a run to continue from a checkpoint, as `run.json` records it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Identity {
    /// The model fingerprint (architecture, sizes and initialisation seed).
    pub fingerprint: String,
    /// The mode (`local`, `ddp`, ...).
    pub mode: String,
    /// Workers the global batch is split over.
    pub world_size: usize,
    /// Rows per worker and step.
    pub batch: usize,
    /// Learning rate.
    pub lr: f32,
    /// Momentum.
    pub momentum: f32,
    /// Weight decay.
    pub weight_decay: f32,
    /// The data order's seed.
    pub order_seed: u64,
}

impl Identity {
    /// The first way `self` (this run) differs from `saved` (the checkpoint's run), worded for
    /// the user.
    fn difference(&self, saved: &Identity) -> Option<String> {
        let mut diffs = Vec::new();
        let mut cmp = |what: &str, ours: String, theirs: String| {
            if ours != theirs {
                diffs.push(format!("{what} {theirs} (this run: {ours})"));
            }
        };
        cmp("model", self.fingerprint.clone(), saved.fingerprint.clone());
        cmp("mode", self.mode.clone(), saved.mode.clone());
        cmp("world size", self.world_size.to_string(), saved.world_size.to_string());
        cmp("batch", self.batch.to_string(), saved.batch.to_string());
        cmp("learning rate", self.lr.to_string(), saved.lr.to_string());
        cmp("momentum", self.momentum.to_string(), saved.momentum.to_string());
        cmp("weight decay", self.weight_decay.to_string(), saved.weight_decay.to_string());
        cmp("order seed", self.order_seed.to_string(), saved.order_seed.to_string());
        (!diffs.is_empty()).then(|| diffs.join(", "))
    }
}

/// `run.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunState {
    /// The format's version.
    pub format: u32,
    /// Steps completed.
    pub step: u64,
    /// The epoch of the last completed step.
    pub epoch: u64,
    /// The loss of the run's first step (the divergence check's yardstick).
    pub first_loss: f64,
    /// What a resumed run must match.
    pub identity: Identity,
    /// Under BSP on parameter servers, the servers' version after this step (the parameters
    /// the worker held): a resumed worker's step is found from the servers' version then.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub server_version: Option<u64>,
    /// SHA-256 of each file of the checkpoint, by name.
    pub files: std::collections::BTreeMap<String, String>,
    /// gradsync's version.
    pub version: String,
}

const FORMAT: u32 = 1;
const MODEL: &str = "model.safetensors";
const OPTIMIZER: &str = "optimizer.safetensors";
const RUN: &str = "run.json";
const STATE: &str = "state.safetensors";

/// What one checkpoint holds besides its run state.
#[derive(Default)]
pub struct Contents<'a> {
    /// The engine, where it holds the run's parameters (every mode but PS, whose servers do).
    pub engine: Option<&'a Engine>,
    /// The whole optimiser state, where the engine does not hold it (ZeRO-1's gathered shards).
    pub momentum: Option<&'a [f32]>,
    /// What the strategy keeps between steps (top-k residuals), as tensors.
    pub state: Option<Tensors>,
    /// See [`RunState::server_version`].
    pub server_version: Option<u64>,
}

/// A checkpoint a run resumes from.
#[derive(Debug)]
pub struct Restored {
    /// Its folder.
    pub path: PathBuf,
    /// Its run state.
    pub state: RunState,
    /// What the strategy kept ([`Contents::state`]).
    pub extra: Option<Tensors>,
}

impl<'a> Contents<'a> {
    /// The engine's state: its parameters, running statistics and momentum.
    pub fn engine(engine: &'a Engine) -> Self {
        Contents { engine: Some(engine), ..Contents::default() }
    }
}

/// Where a run starts, as the loop hands it to its strategy's start: from the beginning, or
/// (`--resume`) from the newest checkpoint, read where the strategy keeps its state.
#[derive(Debug, Clone)]
pub struct Resume {
    /// The checkpoints to continue from; `None`: the run starts from the beginning.
    from: Option<Checkpoints>,
    /// What the checkpoint's run must match.
    identity: Identity,
    /// This process's rank: where every rank reads the same checkpoint, rank 0 alone says so.
    rank: usize,
    /// Print nothing but errors.
    quiet: bool,
}

/// Where a resumed run continues, as its strategy found it.
#[derive(Debug)]
pub struct Resumed {
    /// Steps taken before: the run continues with the next.
    pub step: u64,
    /// The loss of the run's first step (the divergence check's yardstick), where a
    /// checkpoint recorded it.
    pub first_loss: Option<f64>,
    /// What the strategy kept between steps (top-k residuals), for it to take back.
    pub state: Option<Tensors>,
}

impl Resume {
    /// Process `rank`'s start: from `checkpoints` when they ask to resume, else from the
    /// beginning; `identity` is what their run must match.
    pub fn new(checkpoints: Option<&Checkpoints>, identity: Identity, rank: usize, quiet: bool) -> Resume {
        Resume { from: checkpoints.filter(|c| c.resume).cloned(), identity, rank, quiet }
    }

    /// Whether the run continues from its checkpoints (a rank coming back).
    pub fn resuming(&self) -> bool {
        self.from.is_some()
    }

    /// The engine's state from the run's newest checkpoint, read by every rank before they
    /// agree on it (rank 0's wins); `None` from the beginning or when there is none yet.
    pub fn engine(&self, engine: &mut Engine) -> Result<Option<Resumed>> {
        let Some(ck) = &self.from else { return Ok(None) };
        let Some(r) = ck.restore(engine, &self.identity)? else { return Ok(None) };
        if self.rank == 0 {
            let (step, epoch) = (r.state.step, r.state.epoch);
            self.say(&format!("resuming after step {step} (epoch {epoch}) from {}", r.path.display()));
        }
        Ok(Some(Resumed { step: r.state.step, first_loss: Some(r.state.first_loss), state: r.extra }))
    }

    /// A parameter-server worker's own state from its newest checkpoint (in its folder
    /// `DIR/rank-R`), once it has met the servers: at version `servers` under BSP (`None`
    /// under ASP and SSP). Under BSP a step is a version: the servers went on (or waited)
    /// while this worker was away, and it continues at the step their version stands for;
    /// with no checkpoint of its own yet (killed before its first), their version is the step.
    pub fn worker(&self, servers: Option<u64>) -> Result<Option<Resumed>> {
        let Some(ck) = &self.from else { return Ok(None) };
        let ck = ck.own(self.rank);
        let Some(r) = ck.restore_worker(&self.identity, servers)? else {
            return Ok(match servers {
                Some(now) if now > 0 => {
                    self.say(&format!(
                        "resuming at step {} (the servers' version {now}; no checkpoint in {} yet)",
                        now + 1,
                        ck.dir.display()
                    ));
                    Some(Resumed { step: now, first_loss: None, state: None })
                }
                _ => None,
            });
        };
        let (step, how) = continued_at(&r.state, servers);
        if step != r.state.step && r.extra.is_some() {
            eprintln!(
                "gradsync: --resume: the top-k residual is that of step {} (version {}): what the gradients \
                 of the {} steps since had left unsent is lost",
                r.state.step,
                r.state.server_version.unwrap_or_default(),
                step - r.state.step
            );
        }
        self.say(&format!("resuming {how} from {}", r.path.display()));
        Ok(Some(Resumed { step, first_loss: Some(r.state.first_loss), state: r.extra }))
    }

    fn say(&self, what: &str) {
        if !self.quiet {
            eprintln!("gradsync: {what}");
        }
    }
}

/// The steps a parameter-server worker's checkpoint `state` stands for once the servers are at
/// version `servers`, and how to say where it continues: under BSP the steps the servers made
/// since its checkpoint are added to it.
fn continued_at(state: &RunState, servers: Option<u64>) -> (u64, String) {
    match (state.server_version, servers) {
        (Some(at), Some(now)) if now != at => {
            let step = state.step + now.saturating_sub(at);
            let how = format!(
                "at step {} (the servers' version {now}; its checkpoint of step {} was at version {at})",
                step + 1,
                state.step
            );
            (step, how)
        }
        _ => (state.step, format!("after step {} (epoch {})", state.step, state.epoch)),
    }
}

/// The checkpoint due after a step, as the loop hands it to the strategy, which gathers what
/// it holds and says which rank writes it.
pub struct CheckpointAt<'a> {
    /// The run's checkpoints.
    pub checkpoints: &'a Checkpoints,
    /// What a run resuming from it must match.
    pub identity: &'a Identity,
    /// The step just taken.
    pub step: u64,
    /// Its epoch.
    pub epoch: u64,
    /// The loss of the run's first step.
    pub first_loss: f64,
    /// This process's rank.
    pub rank: usize,
    /// Where the writing is timed (`--trace`).
    pub trace: &'a Trace,
}

impl CheckpointAt<'_> {
    /// Write `contents` as the run's checkpoint of this step (the state every rank holds,
    /// written once). Returns its folder.
    pub fn write(&self, contents: Contents<'_>) -> Result<PathBuf> {
        self.write_in(self.checkpoints, contents)
    }

    /// Write `contents` as this rank's own checkpoint of this step, in its folder `DIR/rank-R`
    /// (a parameter-server worker's). Returns its folder.
    pub fn write_own(&self, contents: Contents<'_>) -> Result<PathBuf> {
        self.write_in(&self.checkpoints.own(self.rank), contents)
    }

    fn write_in(&self, ck: &Checkpoints, contents: Contents<'_>) -> Result<PathBuf> {
        let t = Instant::now();
        let at = ck.write_contents(contents, self.step, self.epoch, self.first_loss, self.identity)?;
        self.trace.span("checkpoint", "compute", "compute", t);
        Ok(at)
    }
}

/// The folder name of the checkpoint after `step` steps (zero-padded, so names sort by step).
fn folder(step: u64) -> String {
    format!("step-{step:010}")
}

fn sha256(bytes: &[u8]) -> String {
    Sha256::digest(bytes).iter().map(|b| format!("{b:02x}")).collect()
}

/// Fsync the folder `dir` (what it lists: a file made or renamed in it).
fn sync_folder(dir: &Path) -> Result<()> {
    std::fs::File::open(dir).and_then(|f| f.sync_all()).doing(|| format!("syncing {}", dir.display()))
}

/// Write `bytes` to `path` and fsync it.
fn write_synced(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let mut f = std::fs::File::create(path)?;
    f.write_all(bytes)?;
    f.sync_all()
}

/// The momentum as tensors named after their parameters: `held`, the whole of it gathered from
/// where a strategy keeps it (ZeRO-1's shards), else the engine's.
fn momentum_tensors(engine: &Engine, held: Option<&[f32]>) -> Result<Tensors> {
    let layout = engine.layout();
    let mut m = vec![0.0; layout.len];
    match held {
        Some(h) if h.len() == layout.len => m.copy_from_slice(h),
        Some(h) => {
            return Err(ResumeError::Momentum { got: h.len(), want: layout.len });
        }
        None => engine.read_momentum(&mut m)?,
    }
    Ok(layout
        .params
        .iter()
        .map(|t| (format!("momentum.{}", t.name), Entry::f32(t.shape.clone(), m[t.range.clone()].to_vec())))
        .collect())
}

impl Checkpoints {
    /// Rank `rank`'s own checkpoints, in the folder `rank-R` of these (a parameter-server
    /// worker's state is its own).
    pub fn own(&self, rank: usize) -> Checkpoints {
        Checkpoints { dir: self.dir.join(format!("rank-{rank}")), ..self.clone() }
    }

    /// Whether a checkpoint is due after `step`.
    pub fn due(&self, step: u64) -> bool {
        step.is_multiple_of(self.every)
    }

    /// Write the checkpoint after `step` (in `epoch`), then remove all but the newest `keep`;
    /// `momentum` is the whole optimiser state where the engine does not hold it. Returns its
    /// folder.
    pub fn write(
        &self,
        engine: &Engine,
        momentum: Option<&[f32]>,
        step: u64,
        epoch: u64,
        first_loss: f64,
        identity: &Identity,
    ) -> Result<PathBuf> {
        let contents = Contents { engine: Some(engine), momentum, ..Contents::default() };
        self.write_contents(contents, step, epoch, first_loss, identity)
    }

    /// [`Checkpoints::write`] of whatever `contents` holds.
    pub fn write_contents(
        &self,
        contents: Contents<'_>,
        step: u64,
        epoch: u64,
        first_loss: f64,
        identity: &Identity,
    ) -> Result<PathBuf> {
        let name = folder(step);
        let fin = self.dir.join(&name);
        let tmp = self.dir.join(format!(".{name}.tmp-{}", std::process::id()));
        let written = (|| -> Result<()> {
            std::fs::create_dir_all(&self.dir).doing(|| format!("creating {}", self.dir.display()))?;
            if tmp.exists() {
                std::fs::remove_dir_all(&tmp).doing(|| format!("removing {}", tmp.display()))?;
            }
            std::fs::create_dir(&tmp).doing(|| format!("creating {}", tmp.display()))?;
            let mut files = std::collections::BTreeMap::new();
            let mut written = Vec::new();
            if let Some(engine) = contents.engine {
                written.push((MODEL, engine.state_dict()?));
                written.push((OPTIMIZER, momentum_tensors(engine, contents.momentum)?));
            }
            if let Some(t) = contents.state {
                written.push((STATE, t));
            }
            for (file, tensors) in written {
                let bytes = state_dict::to_bytes(&tmp.join(file), &tensors, &[])?;
                write_synced(&tmp.join(file), &bytes)
                    .doing(|| format!("writing {file} in {}", tmp.display()))?;
                files.insert(file.to_string(), sha256(&bytes));
            }
            let state = RunState {
                format: FORMAT,
                step,
                epoch,
                first_loss,
                identity: identity.clone(),
                server_version: contents.server_version,
                files,
                version: gradsync_core::VERSION.into(),
            };
            let json = serde_json::to_vec_pretty(&state)
                .map_err(|source| ResumeError::Json { what: "serialising", source })?;
            write_synced(&tmp.join(RUN), &json).doing(|| format!("writing {RUN} in {}", tmp.display()))?;
            sync_folder(&tmp)?;
            if fin.exists() {
                // A checkpoint of this step from an earlier attempt of the run: replaced whole.
                std::fs::remove_dir_all(&fin).doing(|| format!("removing {}", fin.display()))?;
            }
            std::fs::rename(&tmp, &fin)
                .doing(|| format!("renaming {} to {}", tmp.display(), fin.display()))?;
            sync_folder(&self.dir)
        })();
        if let Err(e) = written {
            let _ = std::fs::remove_dir_all(&tmp);
            return Err(ResumeError::Write { dir: self.dir.clone(), step, source: Box::new(e) });
        }
        self.prune()?;
        Ok(fin)
    }

    /// The complete checkpoints, oldest first, by step.
    fn listed(&self) -> Result<Vec<(u64, PathBuf)>> {
        let mut out = Vec::new();
        let entries = match std::fs::read_dir(&self.dir) {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(out),
            Err(e) => return Err(e).doing(|| format!("--checkpoint {}", self.dir.display())),
        };
        for entry in entries {
            let entry = entry.doing(|| format!("--checkpoint {}", self.dir.display()))?;
            let name = entry.file_name().to_string_lossy().into_owned();
            if let Some(step) = name.strip_prefix("step-").and_then(|s| s.parse::<u64>().ok()) {
                out.push((step, entry.path()));
            }
        }
        out.sort();
        Ok(out)
    }

    /// Remove all but the newest `keep` checkpoints, and what interrupted writes left.
    fn prune(&self) -> Result<()> {
        let listed = self.listed()?;
        for (_, path) in &listed[..listed.len().saturating_sub(self.keep)] {
            std::fs::remove_dir_all(path).doing(|| format!("removing {}", path.display()))?;
        }
        self.clear_interrupted()
    }

    /// Remove what killed writers left (`.step-N.tmp-PID` folders, never read) once their
    /// processes are gone, so that kills during writes do not pile up copies of the model: after
    /// every write, and when a run resumes.
    fn clear_interrupted(&self) -> Result<()> {
        if !self.dir.is_dir() {
            return Ok(());
        }
        for entry in std::fs::read_dir(&self.dir).doing(|| format!("--checkpoint {}", self.dir.display()))? {
            let entry = entry.doing(|| format!("--checkpoint {}", self.dir.display()))?;
            let name = entry.file_name().to_string_lossy().into_owned();
            let Some(pid) = name.strip_prefix(".step-").and_then(|r| r.rsplit_once(".tmp-")).map(|(_, p)| p)
            else {
                continue;
            };
            let gone = pid.parse::<u32>().is_ok_and(|p| p != std::process::id())
                && !Path::new("/proc").join(pid).exists();
            if gone {
                std::fs::remove_dir_all(entry.path())
                    .doing(|| format!("removing {}", entry.path().display()))?;
            }
        }
        Ok(())
    }

    /// The newest complete checkpoint whose files match their checksums, read; `None` when
    /// the folder holds none. Each one passed over is named on stderr with why.
    fn newest(&self) -> Result<Option<(PathBuf, Verified)>> {
        for (_, path) in self.listed()?.into_iter().rev() {
            match verify(&path) {
                Ok(v) => return Ok(Some((path, v))),
                Err(e) => eprintln!("gradsync: --resume: passing over {}: {}", path.display(), chain(&e)),
            }
        }
        Ok(None)
    }

    /// Continue from the newest checkpoint (`--resume`): its state into `engine` after checking
    /// it was written by a run like this one. Returns it; `None` when there is none (the run
    /// starts from the beginning).
    pub fn restore(&self, engine: &mut Engine, identity: &Identity) -> Result<Option<Restored>> {
        self.clear_interrupted()?;
        let Some((path, v)) = self.newest()? else {
            return Ok(None);
        };
        Self::check(&path, identity, &v.state)?;
        let (Some(tensors), Some(saved)) = (v.model, v.optimizer) else {
            return Err(ResumeError::NoModel { path, mode: v.state.identity.mode });
        };
        let (params, buffers) = state_dict::to_model(&path.join(MODEL), engine.layout(), &tensors)?;
        engine.write_params(0, &params)?;
        if let Some(b) = buffers {
            engine.write_buffers(&b)?;
        }
        if let Some(n) = tensors
            .iter()
            .find(|(k, _)| k.ends_with(".num_batches_tracked"))
            .and_then(|(_, e)| tracked_count(e))
        {
            engine.set_batches_tracked(n);
        }
        let optimizer = path.join(OPTIMIZER);
        let layout = engine.layout();
        let mut m = vec![0.0; layout.len];
        for t in &layout.params {
            let name = format!("momentum.{}", t.name);
            let refuse = |why| ResumeError::Optimizer { path: optimizer.clone(), why };
            let e = saved.get(&name).ok_or_else(|| refuse(format!("no {name}")))?;
            if e.shape != t.shape {
                return Err(refuse(format!("{name} is {:?}, the model's is {:?}", e.shape, t.shape)));
            }
            m[t.range.clone()].copy_from_slice(&e.to_f32());
        }
        engine.write_momentum(&m)?;
        Ok(Some(Restored { path, state: v.state, extra: v.state_tensors }))
    }

    /// Continue a parameter-server worker (`--resume`): its own newest checkpoint, which holds
    /// no parameters (the servers do). Under BSP the servers are at version `servers` (`None`
    /// under ASP and SSP, whose versions do not count steps): a checkpoint written after the
    /// servers' version is passed over (the servers resumed from an older checkpoint of their
    /// own), and none written at or before it is refused naming both.
    pub fn restore_worker(&self, identity: &Identity, servers: Option<u64>) -> Result<Option<Restored>> {
        self.clear_interrupted()?;
        let mut ahead = Vec::new();
        for (_, path) in self.listed()?.into_iter().rev() {
            let v = match verify(&path) {
                Ok(v) => v,
                Err(e) => {
                    eprintln!("gradsync: --resume: passing over {}: {}", path.display(), chain(&e));
                    continue;
                }
            };
            Self::check(&path, identity, &v.state)?;
            if let (Some(at), Some(theirs)) = (v.state.server_version, servers)
                && at > theirs
            {
                eprintln!(
                    "gradsync: --resume: passing over {}: written at the servers' version {at} (step {}), the \
                     servers are at version {theirs}",
                    path.display(),
                    v.state.step
                );
                ahead.push((v.state.step, at));
                continue;
            }
            return Ok(Some(Restored { path, state: v.state, extra: v.state_tensors }));
        }
        if let (Some(servers), Some(&(step, at))) = (servers, ahead.last()) {
            return Err(ResumeError::AheadOfServers { dir: self.dir.clone(), step, at, servers });
        }
        Ok(None)
    }

    /// Refuse a checkpoint written by a run unlike this one, naming the differences.
    fn check(path: &Path, identity: &Identity, state: &RunState) -> Result<()> {
        match identity.difference(&state.identity) {
            Some(diff) => Err(ResumeError::Mismatch { path: path.to_path_buf(), diff }),
            None => Ok(()),
        }
    }
}

/// An integer tensor's first value, exactly.
fn tracked_count(e: &Entry) -> Option<u64> {
    match &e.values {
        state_dict::Values::I64(v) => v.first().map(|&n| n.max(0) as u64),
        _ => None,
    }
}

/// A checkpoint read whole: its state, and its model's and optimiser's tensors, once each
/// file matched its checksum.
struct Verified {
    state: RunState,
    model: Option<Tensors>,
    optimizer: Option<Tensors>,
    state_tensors: Option<Tensors>,
}

/// Read the checkpoint in `path`, checking its format and each file's checksum.
fn verify(path: &Path) -> Result<Verified> {
    let json = std::fs::read(path.join(RUN)).doing(|| format!("reading {RUN}"))?;
    let state: RunState =
        serde_json::from_slice(&json).map_err(|source| ResumeError::Json { what: "parsing", source })?;
    if state.format != FORMAT {
        return Err(ResumeError::Format { found: state.format });
    }
    let read = |file: &'static str| -> Result<Option<Tensors>> {
        let Some(want) = state.files.get(file) else { return Ok(None) };
        let bytes = std::fs::read(path.join(file)).doing(|| format!("reading {file}"))?;
        if &sha256(&bytes) != want {
            return Err(ResumeError::Checksum { file });
        }
        Ok(Some(state_dict::from_bytes(&path.join(file), &bytes)?))
    };
    let (model, optimizer, state_tensors) = (read(MODEL)?, read(OPTIMIZER)?, read(STATE)?);
    if model.is_some() != optimizer.is_some() {
        return Err(ResumeError::Incomplete);
    }
    Ok(Verified { state, model, optimizer, state_tensors })
}

#[cfg(test)]
mod tests {
    use super::*;
    use gradsync_core::device::Device;
    use gradsync_core::model::ModelSpec;

    fn identity() -> Identity {
        Identity {
            fingerprint: "mlp:8-4:f32:seed=1".into(),
            mode: "local".into(),
            world_size: 1,
            batch: 4,
            lr: 0.05,
            momentum: 0.9,
            weight_decay: 1e-4,
            order_seed: 1,
        }
    }

    fn engine(seed: u64) -> Engine {
        Engine::new(Device::Cpu { threads: 1 }, ModelSpec::parse("8-4").unwrap(), seed).unwrap()
    }

    #[test]
    fn checkpoints_round_trip_and_the_newest_k_are_kept() {
        let dir = gradsync_testkit::Scratch::new("resume-round-trip");
        let ck = Checkpoints { dir: dir.join("ck"), every: 2, keep: 2, resume: true };
        let mut a = engine(1);
        let m: Vec<f32> = (0..a.layout().len).map(|i| i as f32 * 0.5).collect();
        a.write_momentum(&m).unwrap();
        for step in [2, 4, 6] {
            ck.write(&a, None, step, step / 4, 2.3, &identity()).unwrap();
        }
        let kept: Vec<u64> = ck.listed().unwrap().into_iter().map(|(s, _)| s).collect();
        assert_eq!(kept, [4, 6]);
        let mut b = engine(2);
        let state = ck.restore(&mut b, &identity()).unwrap().unwrap().state;
        assert_eq!((state.step, state.epoch), (6, 1));
        assert_eq!(b.params().unwrap(), a.params().unwrap());
        let mut got = vec![0.0; m.len()];
        b.read_momentum(&mut got).unwrap();
        assert_eq!(got, m);
    }

    #[test]
    fn a_torn_checkpoint_is_passed_over_for_the_one_before() {
        let dir = gradsync_testkit::Scratch::new("resume-torn");
        let ck = Checkpoints { dir: dir.join("ck"), every: 1, keep: 3, resume: true };
        let a = engine(1);
        ck.write(&a, None, 1, 0, 2.3, &identity()).unwrap();
        let newest = ck.write(&a, None, 2, 0, 2.3, &identity()).unwrap();
        // A write cut short: the model file loses its tail.
        let model = newest.join(MODEL);
        let bytes = std::fs::read(&model).unwrap();
        std::fs::write(&model, &bytes[..bytes.len() / 2]).unwrap();
        // And an interrupted write's hidden folder, which is never read.
        std::fs::create_dir_all(dir.join("ck/.step-0000000003.tmp-1")).unwrap();
        let (path, v) = ck.newest().unwrap().unwrap();
        assert_eq!(v.state.step, 1, "{}", path.display());
    }

    #[test]
    fn another_runs_checkpoint_is_refused_naming_the_difference() {
        let dir = gradsync_testkit::Scratch::new("resume-refused");
        let ck = Checkpoints { dir: dir.join("ck"), every: 1, keep: 3, resume: true };
        ck.write(&engine(1), None, 1, 0, 2.3, &identity()).unwrap();
        let other = Identity { world_size: 2, lr: 0.1, ..identity() };
        let err = format!("{:#}", ck.restore(&mut engine(1), &other).unwrap_err());
        assert!(
            err.contains("world size 1 (this run: 2)") && err.contains("learning rate 0.05 (this run: 0.1)"),
            "{err}"
        );
    }

    #[test]
    fn a_workers_checkpoint_is_the_newest_at_or_before_the_servers_version() {
        let dir = gradsync_testkit::Scratch::new("resume-worker");
        let ck = Checkpoints { dir: dir.join("ck"), every: 5, keep: 3, resume: true };
        let id = Identity { mode: "ps".into(), ..identity() };
        for step in [5, 10] {
            let residual =
                Tensors::from_iter([("residual".to_string(), Entry::f32(vec![2], vec![step as f32, 1.0]))]);
            let c = Contents { state: Some(residual), server_version: Some(step), ..Contents::default() };
            ck.write_contents(c, step, 0, 2.3, &id).unwrap();
        }
        let at = |v| ck.restore_worker(&id, Some(v)).unwrap().unwrap();
        assert_eq!(at(12).state.step, 10);
        assert_eq!(at(10).state.step, 10);
        let older = at(7);
        assert_eq!(older.state.step, 5, "the newer one is passed over");
        assert_eq!(older.extra.unwrap()["residual"].to_f32(), [5.0, 1.0]);
        assert_eq!(ck.restore_worker(&id, None).unwrap().unwrap().state.step, 10, "ASP/SSP: the newest");
        let err = format!("{:#}", ck.restore_worker(&id, Some(3)).unwrap_err());
        assert!(
            err.contains("(step 5) was written at the servers' version 5, and the servers are at version 3"),
            "{err}"
        );
        // An engine run cannot resume from a worker's checkpoint, which holds no model.
        let err = format!("{:#}", ck.restore(&mut engine(1), &id).unwrap_err());
        assert!(err.contains("holds no model"), "{err}");
    }

    #[test]
    fn a_bsp_workers_step_adds_the_versions_the_servers_made_since_its_checkpoint() {
        let state = |server_version| RunState {
            format: FORMAT,
            step: 10,
            epoch: 2,
            first_loss: 2.3,
            identity: identity(),
            server_version,
            files: Default::default(),
            version: "test".into(),
        };
        assert_eq!(continued_at(&state(Some(10)), Some(10)), (10, "after step 10 (epoch 2)".into()));
        let (step, how) = continued_at(&state(Some(10)), Some(13));
        assert_eq!(step, 13);
        assert_eq!(how, "at step 14 (the servers' version 13; its checkpoint of step 10 was at version 10)");
        assert_eq!(continued_at(&state(None), None).0, 10, "ASP and SSP: versions do not count steps");
    }

    #[test]
    fn a_failed_write_names_the_step_then_what_was_being_done_then_the_cause() {
        let io = std::io::Error::other("No space left on device");
        let e = Err::<(), _>(io)
            .doing(|| "writing model.safetensors in ck/.step-0000000020.tmp-1".into())
            .unwrap_err();
        let e = ResumeError::Write { dir: "ck".into(), step: 20, source: Box::new(e) };
        assert_eq!(e.to_string(), "--checkpoint ck: writing the checkpoint of step 20");
        assert_eq!(
            chain(&e),
            "--checkpoint ck: writing the checkpoint of step 20: writing model.safetensors in \
             ck/.step-0000000020.tmp-1: No space left on device"
        );
    }

    #[test]
    fn an_empty_folder_resumes_nothing() {
        let dir = gradsync_testkit::Scratch::new("resume-empty");
        let ck = Checkpoints { dir: dir.join("none-yet"), every: 1, keep: 3, resume: true };
        assert!(ck.restore(&mut engine(1), &identity()).unwrap().is_none());
    }
}
