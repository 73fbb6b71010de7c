//! The step predictor: one training step of a model (its profile) on a cluster (its links) in
//! one configuration, as a timeline rather than one formula. Pure and fast (microseconds a
//! configuration), so a search can run it thousands of times and a check can set what it
//! measured beside each figure.
//!
//! The timeline, for a step of `F` forward and `B` backward seconds from the profile (each
//! layer's time scaled to the batch as the replay scales it):
//!
//! ```text
//!  0        F                                   F+B
//!  |forward |backward: layer by layer ..........|
//!               bucket 0 ready -> [ring 0 ]               the communication thread takes
//!                          bucket 1 ready -> [ring 1  ][ring 2]   buckets in order, one at
//!                                                              |update|   a time
//!                                                      exposed: ^ from F+B to the last end
//! ```
//!
//! - **Buckets** are the real plan's: the profile replayed into gradsync's flat layout
//!   (`ModelSpec::replay`, `Layout`) and cut by `BucketPlan::with_cap` at the cap
//!   `--bucket-mb` makes (`gradsync_worker::setup::bucket_values`), the same calls DDP and
//!   ZeRO-1 make. A bucket is ready when backward has finished the layer holding its last
//!   tensor, as the replay hands gradients out (gradsync has no smaller first bucket).
//! - **Overlap** is the communication thread's: one bucket at a time, in order, each starting
//!   when it is ready and the one before has ended. The update waits for backward and for the
//!   last bucket. Exposed communication is what the step takes beyond forward, backward and the
//!   worker's update.
//! - **Each bucket's exchange** is priced by `crate::cost`, the one home of those formulas:
//!   the flat ring over every rank (its slowest hop, the NIC once hosts are several:
//!   `ring_compressed`), the hierarchical all-reduce cut into the pieces the real one cuts
//!   (`gradsync_worker::collective::hierarchical_pieces`) and run as its pipeline over the two
//!   links (`hierarchical_pipelined`), ZeRO-1's reduce-scatter behind backward and its
//!   all-gather after the update (`zero1`, `zero1_exposed`).
//! - **The parameter server** pushes the whole gradient after backward and pulls the new
//!   parameters, pipelined; the busiest NIC direction decides (`ps_placed`: incast at a server,
//!   colocated servers sharing the workers' NICs), plus the round's fill: a server streams a block
//!   of the new parameters once every worker's block has arrived, so the pull ends one block
//!   (the server's chunk) after the push, that block crossing the busiest link once more. The
//!   servers' work (the update of their `1/k` of the model, the decoding of the pushes) streams
//!   with the exchange: the slower of the two decides.
//! - **Compression** changes the bytes (`Compression::wire_bytes`) and costs codec time at the
//!   measured rates ([`CodecRates`]), on the communication thread: half precision encodes and
//!   decodes each bucket once and each hop of the reduce-scatter decodes, adds and encodes
//!   `(n-1)/n` of it again; top-k selects over the bucket and adds every rank's pairs.
//! - **The update** is the profile's optimiser time (all of it for DDP, `1/n` for ZeRO-1, `1/k`
//!   on each server for the PS, at the profile's device rate).
//! - **Memory per worker** is model state: parameters, gradients, optimiser state and the
//!   codec's buffers (activations are not in a profile, so not counted).
//!
//! Assumptions: links are full duplex and every host's are alike; the TCP backend's costs
//! beyond alpha-beta (framing, copies, GPU staging through pinned memory) and NCCL's protocols
//! are not modelled; compute does not slow down while communication runs.

use std::collections::{BTreeMap, HashMap};

use gradsync_core::compress::{Compression, topk_count};
use gradsync_core::model::{BucketPlan, Layout, ModelSpec};
use gradsync_core::profile::Profile;
use gradsync_worker::collective::hierarchical_pieces;
use gradsync_worker::setup::bucket_values;
use serde::Serialize;

use super::codec::CodecRates;
use super::config::{Accuracy, Config, Exchange};
use super::error::AdviseError;
use super::spec::ClusterSpec;
use crate::cost::{self, Link};
use crate::scenario::ModeKind;

/// A model as the predictor sees it: its compute at one batch, and when backward makes each
/// tensor's gradient ready (the advice's JSON holds its public fields).
#[derive(Debug, Clone, Serialize)]
pub struct Workload {
    /// The model's name.
    #[serde(rename = "name")]
    pub model: String,
    /// Where its profile came from.
    pub source: String,
    /// The device its times belong to, in words.
    pub device: String,
    /// Whether its times are estimated (or scaled from another batch).
    pub estimated: bool,
    /// Samples per step per worker.
    pub batch: usize,
    /// Parameters.
    pub params: usize,
    /// Forward seconds.
    pub forward_s: f64,
    /// Backward seconds.
    pub backward_s: f64,
    /// The optimiser step over the whole model, seconds.
    pub update_s: f64,
    #[serde(skip)]
    layout: Layout,
    /// Seconds from the start of backward until each tensor's gradient is ready, by the
    /// tensor's first value in the flat buffer.
    #[serde(skip)]
    ready: BTreeMap<usize, f64>,
}

/// A bucket of the real plan and when backward has filled it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ReadyBucket {
    /// Its f32 values.
    pub values: usize,
    /// Seconds from the start of backward.
    pub ready_s: f64,
}

impl Workload {
    /// `p` at `batch` samples a worker: each layer's times scaled by `batch / p.batch`, as the
    /// replay scales them; the optimiser's not (it does not depend on the batch).
    pub fn new(p: &Profile, batch: usize) -> Result<Self, AdviseError> {
        if batch == 0 {
            return Err(AdviseError::invalid("--batch", "must be at least 1"));
        }
        let scale = batch as f64 / p.batch.max(1) as f64;
        let layout = Layout::new(&ModelSpec::replay(p.clone()));
        let mut at = 0.0;
        let mut done: HashMap<&str, f64> = HashMap::new();
        for l in &p.layers {
            at += l.backward_ns as f64 * 1e-9 * scale;
            done.extend(l.tensors.iter().map(|(name, _)| (name.as_str(), at)));
        }
        let mut ready = BTreeMap::new();
        for t in &layout.params {
            let Some(&s) = done.get(t.name.as_str()) else {
                return Err(AdviseError::Model {
                    model: p.model.clone(),
                    why: format!("tensor '{}' of its layout is in none of its layers", t.name),
                });
            };
            ready.insert(t.range.start, s);
        }
        if layout.len != p.parameters() || layout.len == 0 {
            return Err(AdviseError::Model {
                model: p.model.clone(),
                why: format!("its layout holds {} values for {} parameters", layout.len, p.parameters()),
            });
        }
        Ok(Workload {
            model: p.model.clone(),
            source: p.source.clone(),
            device: p.device.clone(),
            estimated: p.estimated_at(batch),
            batch,
            params: p.parameters(),
            forward_s: p.layers.iter().map(|l| l.forward_ns as f64 * 1e-9 * scale).sum(),
            backward_s: at,
            update_s: p.optimizer_ns as f64 * 1e-9,
            layout,
            ready,
        })
    }

    /// The same model with forward and backward lasting `forward_s` and `backward_s` (as a run
    /// measured them), each gradient ready at the same share of backward.
    pub fn timed_as(mut self, forward_s: f64, backward_s: f64) -> Self {
        let k = if self.backward_s > 0.0 { backward_s / self.backward_s } else { 0.0 };
        self.ready.values_mut().for_each(|t| *t *= k);
        (self.forward_s, self.backward_s) = (forward_s, backward_s);
        self.estimated = false;
        self
    }

    /// The buckets `--bucket-mb mb` makes, in the order backward fills them.
    pub fn buckets(&self, mb: f64) -> Vec<ReadyBucket> {
        BucketPlan::with_cap(&self.layout, bucket_values(mb))
            .buckets
            .iter()
            .map(|r| ReadyBucket {
                values: r.len(),
                // Every bucket starts at a tensor's first value; the end of backward otherwise.
                ready_s: self.ready.get(&r.start).copied().unwrap_or(self.backward_s),
            })
            .collect()
    }

    /// Bytes of the f32 parameters.
    pub fn bytes(&self) -> f64 {
        4.0 * self.params as f64
    }
}

/// One bucket's exchange in a step's timeline, seconds from the start of the step.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct BucketSpan {
    /// Its f32 values.
    pub values: usize,
    /// Bytes of one copy of it on the wire (compressed).
    pub wire_bytes: f64,
    /// When backward had filled it.
    pub ready_s: f64,
    /// When the communication thread took it.
    pub start_s: f64,
    /// When its exchange (and codec work) ended.
    pub end_s: f64,
}

/// A stretch of the step, seconds from its start.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Span {
    /// What runs: `forward`, `backward`, `update`, `all-gather`, `encode`, `push-pull`.
    pub what: &'static str,
    /// Start.
    pub start_s: f64,
    /// End.
    pub end_s: f64,
}

/// One configuration's predicted step. Every figure is a prediction.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Prediction {
    /// The configuration.
    pub config: Config,
    /// Its name in tables.
    pub label: String,
    /// The compared mode it runs as.
    pub mode: ModeKind,
    /// The `train` flags that make it, as a command line's words (`--mode`, `ddp`, ...).
    pub flags: Vec<String>,
    /// What it does to accuracy.
    pub accuracy: Accuracy,
    /// The step, seconds.
    pub step_s: f64,
    /// Forward, seconds.
    pub forward_s: f64,
    /// Backward, seconds.
    pub backward_s: f64,
    /// The worker's own update (none for the PS, whose servers update), seconds.
    pub update_s: f64,
    /// What the step takes beyond forward, backward and the worker's update, seconds.
    pub exposed_s: f64,
    /// Time the exchange keeps the communication busy (hidden or not), seconds.
    pub comm_s: f64,
    /// Of which encoding and decoding, seconds.
    pub codec_s: f64,
    /// Bytes the busiest worker sends plus receives over all its links a step.
    pub bytes_per_worker: f64,
    /// Bytes one server sends plus receives a step (the PS only).
    pub bytes_per_server: Option<f64>,
    /// Model state a worker holds: parameters, gradients, optimiser state, codec buffers.
    pub memory_per_worker: f64,
    /// Model state a server holds (the PS only).
    pub memory_per_server: Option<f64>,
    /// Hosts it needs beyond the cluster's (servers on hosts of their own).
    pub extra_hosts: usize,
    /// Each bucket's exchange (one for the PS: the whole gradient).
    pub buckets: Vec<BucketSpan>,
    /// The step's stretches in order.
    pub spans: Vec<Span>,
}

/// What a timeline adds up to, before the prediction is assembled.
#[derive(Default)]
struct Timeline {
    step_s: f64,
    update_s: f64,
    comm_s: f64,
    codec_s: f64,
    bytes: f64,
    buckets: Vec<BucketSpan>,
    spans: Vec<Span>,
}

/// Predict one step of `w` on `c` in configuration `cfg`, codecs at `codecs`' rates; refuses a
/// configuration gradsync cannot run there ([`Config::check`]).
pub fn predict(
    w: &Workload,
    c: &ClusterSpec,
    cfg: &Config,
    codecs: &CodecRates,
) -> Result<Prediction, AdviseError> {
    cfg.check(c)?;
    let t = match cfg.exchange {
        Exchange::Ring | Exchange::Hierarchical | Exchange::Zero1 => data_parallel(w, c, cfg, codecs),
        Exchange::Ps { servers, colocated } => parameter_server(w, c, cfg, codecs, servers, colocated),
    };
    let (memory_per_worker, memory_per_server) = memory(w, c, cfg);
    let servers = cfg.servers();
    Ok(Prediction {
        config: *cfg,
        label: cfg.label(),
        mode: cfg.mode(),
        flags: cfg.flags().into_iter().flat_map(|(k, v)| [format!("--{k}"), v]).collect(),
        accuracy: cfg.accuracy(),
        step_s: t.step_s,
        forward_s: w.forward_s,
        backward_s: w.backward_s,
        update_s: t.update_s,
        exposed_s: (t.step_s - w.forward_s - w.backward_s - t.update_s).max(0.0),
        comm_s: t.comm_s,
        codec_s: t.codec_s,
        bytes_per_worker: t.bytes,
        bytes_per_server: servers.map(|(k, _)| c.workers() as f64 * t.bytes / k as f64),
        memory_per_worker,
        memory_per_server,
        extra_hosts: servers.map_or(0, |(k, colocated)| if colocated { 0 } else { k }),
        buckets: t.buckets,
        spans: t.spans,
    })
}

/// The link a flat collective's slowest hop crosses: the NIC once there are several hosts.
fn flat_link(c: &ClusterSpec) -> Link {
    if c.hosts > 1 { c.nic } else { c.intra_link() }
}

/// One bucket's exchange: network seconds, codec seconds, bytes the busiest worker moves.
struct Exchanged {
    net_s: f64,
    codec_s: f64,
    bytes: f64,
}

/// A DDP bucket of `values` values all-reduced (flat or hierarchical), compressed as `cfg`
/// says.
fn all_reduce(c: &ClusterSpec, cfg: &Config, values: usize, codecs: &CodecRates) -> Exchanged {
    let (n, s, comp) = (c.workers(), 4.0 * values as f64, cfg.compression);
    let wire = comp.wire_bytes(values) as f64;
    let (net_s, bytes) = if cfg.exchange == Exchange::Hierarchical {
        // The all-reduce cuts the buffer it is given (half values packed two a slot) into pieces.
        let pieces: Vec<f64> =
            hierarchical_pieces((wire / 4.0).ceil() as usize).into_iter().map(|p| 4.0 * p as f64).collect();
        (
            cost::hierarchical_pipelined(c.hosts, c.per_host, &pieces, c.nic, c.intra_link()),
            cost::hierarchical_bytes_per_worker(c.hosts, c.per_host, wire),
        )
    } else {
        (cost::ring_compressed(n, s, comp, flat_link(c)), cost::ring_compressed_bytes_per_worker(n, s, comp))
    };
    Exchanged { net_s, codec_s: ring_codec_s(comp, values, n, codecs), bytes }
}

/// Codec seconds of one all-reduced bucket of `values` values over `n` ranks.
fn ring_codec_s(comp: Compression, values: usize, n: usize, r: &CodecRates) -> f64 {
    let v = values as f64;
    match comp {
        Compression::None => 0.0,
        // Encoded and decoded once, and (n-1)/n of it decoded, added and encoded again on the
        // reduce-scatter's hops.
        Compression::Fp16 | Compression::Bf16 => {
            v * (r.half_encode_s + r.half_decode_s) * (2.0 - 1.0 / n as f64)
        }
        // Selected over the bucket; every rank's k pairs added into it.
        Compression::TopK(ratio) => {
            v * r.topk_select_s + (n * topk_count(ratio, values)) as f64 * r.topk_add_s
        }
    }
}

/// DDP (flat or hierarchical) and ZeRO-1: buckets behind backward on one communication
/// thread, then the update (ZeRO-1: of its shard, then every bucket all-gathered).
fn data_parallel(w: &Workload, c: &ClusterSpec, cfg: &Config, codecs: &CodecRates) -> Timeline {
    let n = c.workers();
    let zero1 = cfg.exchange == Exchange::Zero1;
    let (f, backward_end) = (w.forward_s, w.forward_s + w.backward_s);
    let mut t = Timeline::default();
    let (mut free, mut gather_s) = (f, 0.0);
    for b in w.buckets(cfg.bucket_mb.unwrap_or(f64::INFINITY)) {
        let x = if zero1 {
            // The reduce-scatter now; the all-gather, the other half, after the update.
            let (s, l) = (4.0 * b.values as f64, flat_link(c));
            gather_s += cost::zero1_exposed(n, s, l);
            let rs = cost::zero1(n, s, l) - cost::zero1_exposed(n, s, l);
            Exchanged { net_s: rs, codec_s: 0.0, bytes: cost::ring_bytes_per_worker(n, s) }
        } else {
            all_reduce(c, cfg, b.values, codecs)
        };
        let ready = f + b.ready_s;
        let start = ready.max(free);
        free = start + x.net_s + x.codec_s;
        t.comm_s += x.net_s + x.codec_s;
        t.codec_s += x.codec_s;
        t.bytes += x.bytes;
        let wire_bytes = cfg.compression.wire_bytes(b.values) as f64;
        t.buckets.push(BucketSpan {
            values: b.values,
            wire_bytes,
            ready_s: ready,
            start_s: start,
            end_s: free,
        });
    }
    t.update_s = if zero1 { w.update_s / n as f64 } else { w.update_s };
    let synced = backward_end.max(free);
    t.spans = vec![
        Span { what: "forward", start_s: 0.0, end_s: f },
        Span { what: "backward", start_s: f, end_s: backward_end },
        Span { what: "update", start_s: synced, end_s: synced + t.update_s },
    ];
    t.step_s = synced + t.update_s;
    if zero1 {
        t.spans.push(Span { what: "all-gather", start_s: t.step_s, end_s: t.step_s + gather_s });
        t.step_s += gather_s;
        t.comm_s += gather_s;
    }
    t
}

/// The parameter server: backward, the push encoded, then push and pull pipelined with the
/// servers' decoding and update.
fn parameter_server(
    w: &Workload,
    c: &ClusterSpec,
    cfg: &Config,
    r: &CodecRates,
    k: usize,
    colocated: bool,
) -> Timeline {
    let (n, p) = (c.workers(), w.params);
    let comp = cfg.compression;
    let (push, pull) = (comp.wire_bytes(p) as f64, w.bytes());
    // On one host every worker reaches the servers over the host's own link.
    let (net_s, link) = if c.hosts == 1 {
        let l = c.intra_link();
        (cost::ps_placed(n, 1, k, false, push, pull, l), l)
    } else {
        (cost::ps_placed(c.hosts, c.per_host, k, colocated, push, pull, c.nic), c.nic)
    };
    let (encode_s, decode_s) = match comp {
        Compression::None => (0.0, 0.0),
        Compression::Fp16 | Compression::Bf16 => {
            (p as f64 * r.half_encode_s, (n * p) as f64 / k as f64 * r.half_decode_s)
        }
        Compression::TopK(ratio) => {
            (p as f64 * r.topk_select_s, (n * topk_count(ratio, p)) as f64 / k as f64 * r.topk_add_s)
        }
    };
    let server_s = 2.0 * link.a + decode_s + w.update_s / k as f64;
    let exchange_s = (net_s + pipeline_fill(c, k, colocated, p, push, link)).max(server_s);
    let end_backward = w.forward_s + w.backward_s;
    let sent = end_backward + encode_s;
    Timeline {
        step_s: sent + exchange_s,
        update_s: 0.0,
        comm_s: encode_s + exchange_s,
        codec_s: encode_s + decode_s,
        bytes: push + pull,
        buckets: vec![BucketSpan {
            values: p,
            wire_bytes: push,
            ready_s: end_backward,
            start_s: end_backward,
            end_s: sent + exchange_s,
        }],
        spans: vec![
            Span { what: "forward", start_s: 0.0, end_s: w.forward_s },
            Span { what: "backward", start_s: w.forward_s, end_s: end_backward },
            Span { what: "encode", start_s: end_backward, end_s: sent },
            Span { what: "push-pull", start_s: sent, end_s: sent + exchange_s },
        ],
    }
}

/// The bulk-synchronous round's fill, seconds: a server steps its block `b` (the chunk its
/// pushes are cut into, `ShardSpec::chunk_bytes`, as the server picks it) once every worker's
/// block `b` has arrived, and streams it to the pulls then, so the pull runs one block behind
/// the push and ends one block after it. That block crosses the busiest link once more: each
/// worker host's NIC carries its ranks' blocks to all `k` servers, a server's NIC every
/// worker's block (`push` wire bytes of the `params`-value gradient scale it for a codec).
/// Measured: 8 workers and 8 servers of ResNet-50 at 10 Gbit/s communicated 93.6 ms a step
/// against the 85.0 ms of the busiest link alone; the fill of 1 MiB blocks is 7.0 ms.
fn pipeline_fill(c: &ClusterSpec, k: usize, colocated: bool, params: usize, push: f64, link: Link) -> f64 {
    let k = k.max(1);
    let block_values = gradsync_server::config::ShardSpec { index: 0, count: k }.chunk_bytes(params) / 4;
    let block = block_values as f64 * push / params.max(1) as f64;
    // On one host every worker reaches the servers over the host's own link, as its own
    // (`parameter_server` prices it so).
    let (n, m, k) = (c.workers() as f64, if c.hosts == 1 { 1.0 } else { c.per_host as f64 }, k as f64);
    let blocks = if colocated && c.hosts > 1 {
        // Out of a host: its workers' blocks to the other servers; in: the other hosts' workers'.
        (m * (k - 1.0)).max(n - m)
    } else {
        // A worker host's NIC sends its ranks' blocks to every server; a server's takes every
        // worker's.
        (m * k).max(n)
    };
    blocks * block / link.b
}

/// Model state a worker holds, and a server (for the PS), bytes: f32 parameters `P`,
/// gradients `G` and momentum `M` (each `4 x params`), and the codec's buffers.
fn memory(w: &Workload, c: &ClusterSpec, cfg: &Config) -> (f64, Option<f64>) {
    let (v, n) = (w.bytes(), c.workers() as f64);
    let biggest =
        cfg.bucket_mb.map_or(w.params, |mb| w.buckets(mb).iter().map(|b| b.values).max().unwrap_or(0));
    match cfg.exchange {
        Exchange::Ring | Exchange::Hierarchical => {
            let codec = match cfg.compression {
                Compression::None => 0.0,
                // The packed bucket, two bytes a value.
                Compression::Fp16 | Compression::Bf16 => 2.0 * biggest as f64,
                // Every bucket's residual, and every rank's pairs of the largest bucket.
                Compression::TopK(r) => v + 8.0 * n * topk_count(r, biggest) as f64,
            };
            (3.0 * v + codec, None)
        }
        // The momentum of its shard only.
        Exchange::Zero1 => (2.0 * v + v / n, None),
        Exchange::Ps { servers, .. } => {
            // No momentum: the servers own the optimiser. A compressed push reads the gradient
            // to the host first.
            let codec = match cfg.compression {
                Compression::None => 0.0,
                Compression::Fp16 | Compression::Bf16 => v + v / 2.0,
                Compression::TopK(r) => 2.0 * v + 8.0 * topk_count(r, w.params) as f64,
            };
            // A server: its shard's parameters, momentum and the sum of the pushes.
            (2.0 * v + codec, Some(3.0 * v / servers as f64))
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use gradsync_core::profile::{FORMAT, FileLayer, FileTensor, ProfileFile, VERSION};

    use super::*;

    /// A profile of layers in backward order, each `(name, forward ms, backward ms, values of
    /// its one tensor if any)`, at batch 1.
    fn profile(layers: &[(&str, f64, f64, Option<usize>)], optimizer_ms: f64) -> Profile {
        let layers = layers
            .iter()
            .map(|&(name, forward_ms, backward_ms, values)| FileLayer {
                name: name.into(),
                forward_ms,
                backward_ms,
                tensors: values
                    .map(|v| vec![FileTensor { name: format!("{name}.w"), shape: vec![v] }])
                    .unwrap_or_default(),
            })
            .collect();
        let file = ProfileFile {
            format: FORMAT.into(),
            version: VERSION,
            model: "toy".into(),
            batch: 1,
            device: "test".into(),
            estimated: false,
            layers,
            optimizer_ms,
            note: String::new(),
        };
        Profile::from_file(file, "test").unwrap()
    }

    /// 1 MiB a tensor: two layers of 1 ms forward and 2 ms backward, 0.5 ms of update.
    fn two_buckets() -> Workload {
        let mib = 1 << 18;
        Workload::new(&profile(&[("b", 1.0, 2.0, Some(mib)), ("a", 1.0, 2.0, Some(mib))], 0.5), 1).unwrap()
    }

    fn ring(mb: f64) -> Config {
        Config { exchange: Exchange::Ring, bucket_mb: Some(mb), compression: Compression::None }
    }

    fn ps(servers: usize, colocated: bool, compression: Compression) -> Config {
        Config { exchange: Exchange::Ps { servers, colocated }, bucket_mb: None, compression }
    }

    fn close(got: f64, want: f64) {
        assert!((got - want).abs() <= 1e-9 * want.abs().max(1e-6), "{got} against {want}");
    }

    fn ms(s: f64) -> f64 {
        s * 1e3
    }

    #[test]
    fn two_buckets_on_a_ring_of_four_by_hand() {
        let w = two_buckets();
        // 4 hosts of one rank, 1 GB/s NICs (8 Gbit/s), 10 us.
        let c = ClusterSpec::parse("4x1:8gbit,10us").unwrap();
        let p = predict(&w, &c, &ring(1.0), &CodecRates::free()).unwrap();
        // 1 MiB buckets: one tensor each, the last layer's first.
        assert_eq!(p.buckets.len(), 2);
        // A bucket: 2 (4-1) 10 us + 2 (4-1)/4 1048576 B / 1e9 B/s = 0.06 + 1.572864 ms.
        let t = 1.632864;
        // Forward 2 ms. Bucket 0 ready at 2 + 2 = 4 ms, done at 5.632864; bucket 1 ready at
        // 2 + 4 = 6 ms (the end of backward), done at 7.632864; the update's 0.5 ms after it.
        close(ms(p.buckets[0].ready_s), 4.0);
        close(ms(p.buckets[0].end_s), 4.0 + t);
        close(ms(p.buckets[1].start_s), 6.0);
        close(ms(p.step_s), 6.0 + t + 0.5);
        // Exposed: the last bucket, whole.
        close(ms(p.exposed_s), t);
        close(ms(p.comm_s), 2.0 * t);
        // 2 x 2 (4-1)/4 of each MiB, sent plus received.
        close(p.bytes_per_worker, 2.0 * 3.0 * 1048576.0);
        // Parameters, gradients, momentum.
        close(p.memory_per_worker, 3.0 * 2.0 * 1048576.0);
        assert_eq!((p.bytes_per_server, p.extra_hosts), (None, 0));
        // One bucket of both tensors: ready at the end of backward, 2 x the bytes.
        let one = predict(&w, &c, &ring(25.0), &CodecRates::free()).unwrap();
        assert_eq!(one.buckets.len(), 1);
        close(ms(one.step_s), 6.0 + 0.06 + 2.0 * 1.572864 + 0.5);
    }

    #[test]
    fn communication_hides_behind_a_long_backward_and_shows_after_a_short_one() {
        // Two 1 MiB tensors ready 1 and 2 ms into backward, then an input layer without
        // parameters whose backward takes `tail` ms.
        let c = ClusterSpec::parse("4x1:8gbit,10us").unwrap();
        let exposed = |tail: f64| {
            let p = profile(
                &[("b", 1.0, 1.0, Some(1 << 18)), ("a", 1.0, 1.0, Some(1 << 18)), ("input", 0.0, tail, None)],
                0.0,
            );
            let w = Workload::new(&p, 1).unwrap();
            ms(predict(&w, &c, &ring(1.0), &CodecRates::free()).unwrap().exposed_s)
        };
        // Bucket 0 runs 1 to 2.632864 ms into backward, bucket 1 from then to 4.265728 ms; the
        // parameter layers end at 2 ms, so `tail` hides up to 2.265728 ms of it.
        close(exposed(10.0), 0.0);
        close(exposed(2.265728), 0.0);
        close(exposed(1.0), 1.265728);
        close(exposed(0.0), 2.265728);
    }

    #[test]
    fn one_server_carries_every_workers_push_incast() {
        let w = two_buckets();
        let c = ClusterSpec::parse("8x1:8gbit,10us").unwrap();
        let s = 2.0 * 1048576.0;
        let one = predict(&w, &c, &ps(1, false, Compression::None), &CodecRates::free()).unwrap();
        let eight = predict(&w, &c, &ps(8, false, Compression::None), &CodecRates::free()).unwrap();
        // One server's NIC receives 8 pushes of 2 MiB (and sends 8 pulls): 2 x 10 us + 8 S / B,
        // and the round's fill: the pull ends one block after the push, a block (the server's
        // chunk, an eighth of its 2 MiB shard: 256 KiB) from each of the 8 workers crossing its
        // NIC once more.
        let fill_one = 8.0 * 262144.0 / 1e6;
        close(ms(one.exposed_s), 0.02 + 8.0 * s / 1e6 + fill_one);
        // Eight: each server and each worker moves S each way; the blocks of a 256 KiB shard
        // are the smallest chunk, 64 KiB, 8 of them through every NIC.
        close(ms(eight.exposed_s), 0.02 + s / 1e6 + 8.0 * 65536.0 / 1e6);
        close(ms(one.step_s), 2.0 + 4.0 + 0.02 + 8.0 * s / 1e6 + fill_one);
        assert_eq!(one.update_s, 0.0, "the servers update");
        close(one.bytes_per_server.unwrap(), 8.0 * 2.0 * s);
        close(eight.bytes_per_server.unwrap(), 2.0 * s);
        close(one.bytes_per_worker, 2.0 * s);
        assert_eq!((one.extra_hosts, eight.extra_hosts), (1, 8));
        // Colocated on the workers' 8 hosts: each NIC carries 7/8 of its worker's push and 7
        // pulls of S/8 out, 2 (8-1)/8 S each way.
        let co = predict(&w, &c, &ps(8, true, Compression::None), &CodecRates::free()).unwrap();
        // Its fill: 7 blocks out to the other servers, 7 in from the other hosts' workers.
        close(ms(co.exposed_s), 0.02 + 2.0 * 7.0 / 8.0 * s / 1e6 + 7.0 * 65536.0 / 1e6);
        assert_eq!(co.extra_hosts, 0);
        // No momentum on a PS worker; a server holds its shard's parameters, momentum and sum.
        close(eight.memory_per_worker, 2.0 * s);
        close(eight.memory_per_server.unwrap(), 3.0 * s / 8.0);
        // A server's update longer than the exchange decides: 0.5 ms x 1000 on one server.
        let slow = profile(&[("b", 1.0, 2.0, Some(1 << 18)), ("a", 1.0, 2.0, Some(1 << 18))], 500.0);
        let w = Workload::new(&slow, 1).unwrap();
        let p = predict(&w, &c, &ps(1, false, Compression::None), &CodecRates::free()).unwrap();
        close(ms(p.exposed_s), 0.02 + 500.0);
    }

    #[test]
    fn the_hierarchy_crosses_hosts_among_leaders_only() {
        // 2 hosts of 2 ranks; the NIC 1 GB/s, 10 us; inside a host 4 GB/s, 1 us.
        let c = ClusterSpec::parse("2x2:8gbit,10us:pcie,4GB/s,1us").unwrap();
        // One tensor of 2^16 values (256 KiB): one piece, so reduce, leaders' ring, broadcast in turn.
        let w = Workload::new(&profile(&[("a", 1.0, 1.0, Some(1 << 16))], 0.0), 1).unwrap();
        let hier = Config { exchange: Exchange::Hierarchical, ..ring(25.0) };
        let p = predict(&w, &c, &hier, &CodecRates::free()).unwrap();
        let s = 262144.0;
        // Inside: 2 (2-1) 1 us + 2 (2-1)/2 S / 4e9; among the 2 leaders: 2 x 10 us + S / 1e9.
        let want = 2e-6 + s / 4e9 + 20e-6 + s / 1e9;
        close(p.exposed_s, want);
        // The flat ring of 4 crosses the NIC with 2 (4-1)/4 S and 6 latencies.
        let flat = predict(&w, &c, &ring(25.0), &CodecRates::free()).unwrap();
        close(flat.exposed_s, 60e-6 + 1.5 * s / 1e9);
        assert!(p.step_s < flat.step_s);
        // The leader: the leaders' ring's 2 x 2 (2-1)/2 S, the host's sum in and out.
        close(p.bytes_per_worker, 4.0 * s);
        // A larger buffer is cut into pieces that overlap: less than the three stages in turn,
        // more than the leaders' ring alone.
        let w = Workload::new(&profile(&[("a", 1.0, 1.0, Some(1 << 21))], 0.0), 1).unwrap();
        let p = predict(&w, &c, &hier, &CodecRates::free()).unwrap();
        let s = 4.0 * (1 << 21) as f64;
        let leaders = cost::ring(2, s, c.nic);
        assert!(p.exposed_s > leaders && p.exposed_s < leaders + cost::ring(2, s, c.intra_link()));
    }

    #[test]
    fn compression_changes_the_bytes_and_costs_codec_time() {
        let w = two_buckets();
        let c = ClusterSpec::parse("4x1:8gbit,10us").unwrap();
        let s = 1048576.0;
        let half = Config { compression: Compression::Fp16, ..ring(1.0) };
        let p = predict(&w, &c, &half, &CodecRates::free()).unwrap();
        // Half the bytes on every hop.
        close(p.buckets[0].wire_bytes, s / 2.0);
        close(p.bytes_per_worker, 2.0 * 3.0 * s / 2.0);
        close(ms(p.exposed_s), 0.06 + 1.5 * (s / 2.0) / 1e6);
        // Top-k 1% all-gathers 8-byte pairs: (4-1) (10 us + 8 k / B) a bucket, k = 2622.
        let topk = Config { compression: Compression::TopK(0.01), ..ring(1.0) };
        let p = predict(&w, &c, &topk, &CodecRates::free()).unwrap();
        let k = 2622.0;
        close(p.buckets[0].wire_bytes, 8.0 * k);
        close(p.bytes_per_worker, 2.0 * 2.0 * 3.0 * 8.0 * k);
        close(ms(p.exposed_s), 3.0 * (0.01 + 8.0 * k / 1e6));
        // A PS pushes fp16 (2 bytes a value: 1 MiB) and pulls f32 (2 MiB).
        let p = predict(&w, &c, &ps(4, false, Compression::Fp16), &CodecRates::free()).unwrap();
        close(p.bytes_per_worker, s + 2.0 * s);
        // Codec time at 1 ns a value each way: a half bucket of 2^18 values over 4 ranks is
        // encoded and decoded (2 - 1/4) times, 2 ns x 1.75 x 262144 = 0.917504 ms a bucket, on
        // the communication thread.
        let rates = CodecRates {
            half_encode_s: 1e-9,
            half_decode_s: 1e-9,
            topk_select_s: 2e-9,
            topk_add_s: 1e-9,
            source: "test".into(),
        };
        let free = predict(&w, &c, &half, &CodecRates::free()).unwrap();
        let timed = predict(&w, &c, &half, &rates).unwrap();
        close(ms(timed.codec_s), 2.0 * 0.917504);
        close(ms(timed.exposed_s - free.exposed_s), 0.917504);
        // Top-k: 2 ns a value selected, 1 ns a pair added, 4 ranks' 2622 pairs.
        let timed = predict(&w, &c, &topk, &rates).unwrap();
        close(timed.codec_s, 2.0 * (262144.0 * 2e-9 + 4.0 * k * 1e-9));
    }

    #[test]
    fn zero1_hides_its_reduce_scatter_and_exposes_its_all_gather() {
        let w = two_buckets();
        let c = ClusterSpec::parse("4x1:8gbit,10us").unwrap();
        let z = Config { exchange: Exchange::Zero1, ..ring(1.0) };
        let p = predict(&w, &c, &z, &CodecRates::free()).unwrap();
        // Each half: 3 x 10 us + 3/4 MiB / 1e9 = 0.816432 ms. Bucket 1's reduce-scatter ends
        // at 6.816432 ms; the update of a quarter, 0.125 ms; then both all-gathers.
        let half = 0.816432;
        close(ms(p.step_s), 6.0 + half + 0.125 + 2.0 * half);
        close(ms(p.update_s), 0.125);
        close(ms(p.exposed_s), 3.0 * half);
        close(p.memory_per_worker, 2.0 * 2.0 * 1048576.0 + 2.0 * 1048576.0 / 4.0);
        assert_eq!(p.spans.last().map(|s| s.what), Some("all-gather"));
    }

    #[test]
    fn buckets_are_the_real_plans_and_the_batch_scales_compute() {
        let p =
            gradsync_core::profile::builtin("resnet50", gradsync_core::profile::DeviceRate::H100).unwrap();
        let w = Workload::new(&p, 64).unwrap();
        let plan = BucketPlan::with_cap(&Layout::new(&ModelSpec::replay(p.clone())), bucket_values(25.0));
        let ours = w.buckets(25.0);
        assert_eq!(
            ours.iter().map(|b| b.values).collect::<Vec<_>>(),
            plan.buckets.iter().map(|r| r.len()).collect::<Vec<_>>()
        );
        // Ready in backward order, the last at the end of backward.
        assert!(ours.windows(2).all(|b| b[0].ready_s <= b[1].ready_s));
        close(ours.last().unwrap().ready_s, w.backward_s);
        let (f, b) = p.step_ms(64);
        close(ms(w.forward_s), f);
        close(ms(w.backward_s), b);
        let half = Workload::new(&p, 32).unwrap();
        close(half.backward_s, w.backward_s / 2.0);
        assert!(half.estimated && w.estimated);
        assert_eq!(Workload::new(&p, 0).unwrap_err().to_string(), "--batch: must be at least 1");
    }
}
