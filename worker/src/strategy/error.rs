//! [`StrategyError`], everything a strategy refuses or fails at, the module's [`Result`], and
//! [`During`], which names what a strategy was doing when a collective or the engine failed.
//!
//! It lives in a file of its own, at the bottom of the module: every strategy returns it, and
//! it imports none of them, only the errors of the areas the strategies drive (the
//! collectives' [`CollectiveError`], the parameter-server client's [`PsError`], the
//! checkpoints' [`ResumeError`], the engine's [`gradsync_core::Error`]).
//!
//! What a strategy itself refuses (a setting, a checkpoint that does not fit, shards at
//! different versions) is a variant whose message is whole. Where a strategy only says what
//! it was doing when something under it failed, as a `.context(..)` would, the variant's
//! message is that phrase and the failure is its source, kept typed: at the binary's edge,
//! which prints an error with its sources (`{:#}`), the line reads `what it was doing: why it
//! failed`.

use std::ops::Range;

use crate::collective::CollectiveError;
use crate::ps::PsError;
use crate::resume::ResumeError;

/// Everything a strategy refuses or fails at.
#[derive(Debug, thiserror::Error)]
pub enum StrategyError {
    /// A setting the strategy cannot run with (a flag, or a flag beside the model or the
    /// servers it meets); the message names the flag.
    #[error("{0}")]
    Config(String),
    /// What the strategy keeps in a checkpoint (a top-k residual) is missing from the one a
    /// run resumes from, or does not fit this run.
    #[error("restoring the strategy's state from the checkpoint: {0}")]
    Restore(String),
    /// A parameter-server worker came back under BSP while the shards stood at different
    /// versions: the step it died in was applied by some shards and not by others.
    #[error(
        "came back while the shards were at different versions ({versions}): the step in progress when this \
         rank died was applied by some shards and not by others; restart the servers from their \
         checkpoints and the workers with --resume"
    )]
    Versions {
        /// Each shard's address and version (`addr at V, ...`).
        versions: String,
    },
    /// A flag of this worker's contradicts the optimiser the parameter servers apply.
    #[error("{0}")]
    Optimiser(gradsync_core::Error),
    /// The parameter servers' TLS settings (`--tls-ca`) cannot be used.
    #[error(transparent)]
    Tls(gradsync_proto::Error),
    /// The runtime the parameter-server client runs on could not be started.
    #[error("starting the PS client runtime")]
    Runtime(#[source] std::io::Error),
    /// A worker coming back could not pull the version it joins at.
    #[error("pulling version {version}, the step this rank joins at")]
    Rejoin {
        /// The servers' version the worker joins at.
        version: u64,
        /// Why the last attempt failed.
        source: PsError,
    },
    /// The store DDP's ranks meet at answered without the NCCL id rank 0 puts there.
    #[error("the store at {master} sent no NCCL id")]
    NoNcclId {
        /// The store's address.
        master: String,
    },
    /// This rank could not join the ring of the TCP backend.
    #[error("joining the ring of {world} ranks at {master}")]
    Ring {
        /// The ranks in the ring.
        world: usize,
        /// The store's address.
        master: String,
        /// Why.
        source: CollectiveError,
    },
    /// A DP replica's engine could not be made on its device.
    #[error("replica {replica} on {device}")]
    ReplicaEngine {
        /// The replica.
        replica: usize,
        /// Its device.
        device: String,
        /// Why.
        source: gradsync_core::Error,
    },
    /// A DP replica failed in a step: its error, or its thread's panic, is the source.
    #[error("replica {replica}")]
    Replica {
        /// The replica.
        replica: usize,
        /// How it failed.
        source: Box<StrategyError>,
    },
    /// A DP replica's thread panicked.
    #[error("the replica's thread panicked: {0}")]
    Panicked(String),
    /// The device error injected into a DP replica (`--fail-replica K:N:error`).
    #[error("injected device error (--fail-replica {replica}:{step}:error)")]
    Injected {
        /// The replica.
        replica: usize,
        /// The step it fails in.
        step: u64,
    },
    /// A batch that does not split evenly over DP's replicas.
    #[error("a batch of {rows} rows does not split over {replicas} replicas")]
    Split {
        /// The batch's rows.
        rows: usize,
        /// The replicas.
        replicas: usize,
    },
    /// A gradient value that a half-precision push cannot carry (`--compress fp16`).
    #[error("{0}")]
    Overflow(String),
    /// A reduce-scatter left a different segment of a bucket summed on this rank than the
    /// one ZeRO-1 assigned it.
    #[error("reduce-scatter of bucket {index} left {got:?} summed here, not {want:?}")]
    Segment {
        /// The bucket's index in the plan.
        index: usize,
        /// The segment summed here.
        got: Range<usize>,
        /// The segment this rank owns.
        want: Range<usize>,
    },
    /// A rank's all-gathered table rows name a row that cannot be one.
    #[error("rank {rank} sent row id {id}")]
    RowId {
        /// The rank.
        rank: usize,
        /// What it sent.
        id: f32,
    },
    /// A call made before [`crate::strategy::Strategy::start`] prepared what it needs.
    #[error("{0} before start")]
    NotStarted(&'static str),
    /// A collective failed while the strategy did `what` (a broadcast, a bucket's
    /// all-reduce, an all-gather).
    #[error("{what}")]
    Exchange {
        /// What the strategy was doing.
        what: String,
        /// The collective's failure.
        source: CollectiveError,
    },
    /// The engine failed while the strategy did `what`.
    #[error("{what}")]
    Engine {
        /// What the strategy was doing.
        what: String,
        /// The engine's failure.
        source: gradsync_core::Error,
    },
    /// A checkpoint could not be gathered or written: `what` is the part of it the strategy
    /// was doing.
    #[error("{what}")]
    Checkpoint {
        /// What the strategy was doing.
        what: &'static str,
        /// Why it failed.
        source: Box<StrategyError>,
    },
    /// A collective failed (the bucketed backward, a table's rows).
    #[error(transparent)]
    Collective(#[from] CollectiveError),
    /// The parameter servers or the link to them failed.
    #[error(transparent)]
    Ps(#[from] PsError),
    /// The checkpoints could not be read or written.
    #[error(transparent)]
    Resume(#[from] ResumeError),
    /// The engine failed (forward, backward, the update, reading or writing its buffers).
    #[error(transparent)]
    Core(#[from] gradsync_core::Error),
}

/// The result type of the strategies.
pub type Result<T, E = StrategyError> = std::result::Result<T, E>;

/// Name what a strategy was doing when the call under it failed: the phrase becomes the
/// error's message and the failure its source (a typed `with_context`).
pub trait During<T> {
    /// The error, if any, as the [`StrategyError`] variant that says `what` was being done.
    fn during<S: Into<String>>(self, what: impl FnOnce() -> S) -> Result<T>;
}

impl<T> During<T> for std::result::Result<T, CollectiveError> {
    fn during<S: Into<String>>(self, what: impl FnOnce() -> S) -> Result<T> {
        self.map_err(|source| StrategyError::Exchange { what: what().into(), source })
    }
}

impl<T> During<T> for std::result::Result<T, gradsync_core::Error> {
    fn during<S: Into<String>>(self, what: impl FnOnce() -> S) -> Result<T> {
        self.map_err(|source| StrategyError::Engine { what: what().into(), source })
    }
}

impl StrategyError {
    /// A failure while the strategy did `what` for a checkpoint, as
    /// [`StrategyError::Checkpoint`] (for `map_err`).
    pub fn checkpoint(what: &'static str) -> impl FnOnce(StrategyError) -> StrategyError {
        move |e| StrategyError::Checkpoint { what, source: Box::new(e) }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    /// `e` and its sources, as the binary's edge prints them.
    fn line(e: &dyn std::error::Error) -> String {
        let mut out = e.to_string();
        let mut cur = e.source();
        while let Some(c) = cur {
            out = format!("{out}: {c}");
            cur = c.source();
        }
        out
    }

    #[test]
    fn what_a_strategy_was_doing_leads_the_line_and_the_failure_stays_typed_under_it() {
        let silent = CollectiveError::Timeout { peer: 2, op: "broadcast", timeout: Duration::from_secs(1) };
        let e = Err::<(), _>(silent).during(|| "broadcasting the momentum").unwrap_err();
        assert_eq!(e.to_string(), "broadcasting the momentum");
        let under = std::error::Error::source(&e).and_then(|s| s.downcast_ref::<CollectiveError>());
        assert_eq!(under.and_then(CollectiveError::culprit), Some(2), "{e:?}");
        assert_eq!(
            line(&e),
            "broadcasting the momentum: rank 2 did not answer within 1.0 s during broadcast (dead, hung, or much \
             slower?)"
        );

        let engine = Err::<(), _>(gradsync_core::Error::Codec("index 9 out of range".into()));
        let e = engine.during(|| "the top-k pairs gathered for bucket 0..4").unwrap_err();
        assert!(matches!(e, StrategyError::Engine { .. }), "{e:?}");
        assert_eq!(
            line(&e),
            "the top-k pairs gathered for bucket 0..4: compressed payload: index 9 out of range"
        );
    }

    #[test]
    fn a_failed_replica_and_a_failed_checkpoint_name_themselves_before_the_cause() {
        let panicked =
            StrategyError::Replica { replica: 1, source: Box::new(StrategyError::Panicked("boom".into())) };
        assert_eq!(line(&panicked), "replica 1: the replica's thread panicked: boom");
        let gather = Err::<(), _>(CollectiveError::Panicked("the communication thread"))
            .during(|| "all-gathering the top-k residuals")
            .map_err(StrategyError::checkpoint("gathering the checkpoint's state"))
            .unwrap_err();
        assert_eq!(
            line(&gather),
            "gathering the checkpoint's state: all-gathering the top-k residuals: the communication thread panicked"
        );
        // Wrapped whole, an area's error reads as it did alone.
        let alone = StrategyError::from(CollectiveError::Panicked("the ring"));
        assert_eq!(line(&alone), "the ring panicked");
    }
}
