//! The parameter-server client: one worker's connections to every shard of a parameter server,
//! with ps-lite's `KVWorker` shape for one flat buffer. [`PsClient::register`] learns each
//! shard's range; [`PsClient::push`] sends a gradient (each shard its range),
//! [`PsClient::pull`] fetches the parameters, and [`PsClient::exchange`] does both for one
//! step (under BSP at once, the pull streaming the next version as the servers make it);
//! [`PsClient::heartbeat`] and [`PsClient::deregister`] keep and end membership. Every call
//! goes to all shards concurrently and has a deadline.
//!
//! # Layout
//! Each file imports only from the ones listed after it.
//! - `engine.rs`: the engine's memory as a push's source and a pull's destination, in place
//!   (host) or staged (device), behind one [`EngineLink`].
//! - `table.rs`: what a worker keeps of a sparse model's table between steps
//!   ([`TableRows`]), the rows of the next batch pulled with each step's push.
//! - `client.rs`: [`PsClient`].
//! - `rows.rs`: a sparse model's table on the wire (PushRows, PullRows), each shard its own
//!   rows ([`RowsStep`]).
//! - `bulk.rs`: one shard's PushGradients and PullParameters, straight over HTTP/2 frames or
//!   through tonic's codec, and what one push or pull moved ([`Transfer`]).
//! - `connect.rs`: a shard as this worker sees it (its connections, range, version, chunk
//!   size), dialling it, the token, deadlines, errors that name the server.
//! - `chunks.rs`: where a push's values come from ([`Gradients`]) and a pull's go
//!   ([`ChunkSink`]), for host buffers; a host buffer pushes send from without copying
//!   ([`SharedGrads`]); a gradient compressed for the wire ([`Encoded`]).
//! - `error.rs`: [`PsError`], what every other file returns.
//!
//! `gradsync-worker --mode ps` drives it through `strategy::ps`; `gradsync-bench ps` directly.

mod bulk;
mod chunks;
mod client;
mod connect;
mod engine;
mod error;
mod rows;
mod table;

pub use bulk::Transfer;
pub use chunks::{ChunkSink, Encoded, Gradients, HostGrads, HostSlice, SharedGrads};
pub use client::PsClient;
pub use engine::EngineLink;
pub use error::{PsError, Result};
pub use rows::RowsStep;
pub use table::TableRows;
