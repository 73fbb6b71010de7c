//! A network's forward, backward and update, written once over [`Backend`] for every model:
//! the nodes of its compiled [`Graph`] run in order, then softmax cross-entropy averaged over
//! the batch. Backward runs the nodes in reverse and writes each parameter's gradient into the
//! flat gradient buffer; whenever a bucket of [`BucketPlan`] is complete it is handed to the
//! caller, who may start communicating it while backward continues (the DDP overlap).
//!
//! Activations live in one buffer per slot of the graph (a ReLU works in place on its input's
//! slot); gradients with respect to them in another per slot. A convolution is one GEMM over
//! the whole batch on its column matrix ([`Backend::im2col`]), which backward builds again
//! rather than keeping one per layer.

use std::ops::Range;
use std::time::{Duration, Instant};

use crate::device::{Backend, ChannelSum, NormConfig, Window};
use crate::dilation::{Dilation, Pace, PaceTally, Turns, sleep_until};
use crate::error::{Error, Result};
use crate::model::{
    BucketPlan, Graph, Input, InputGrad, Layout, ModelSpec, Node, Op, Table, init_buffers, init_params,
};
use crate::optim::SgdConfig;
use crate::profile::Profile;

/// Sums per-channel batch-norm statistics over the ranks of a synchronised batch norm, in
/// place (an all-reduce; SyncBatchNorm's): called in forward with each layer's sums of `x`
/// (and, last, the local count), then of squared deviations, and in backward with `sum dy |
/// sum dy (x - mean)`. Every rank calls it the same number of times in the same order.
pub type NormSync<'s> = &'s mut NormSyncFn<'s>;

/// Where a replayed model's gradient values are drawn from (`seed` xor this).
const REPLAY_GRADS: u64 = 0x6772_6164_7265_706c;

/// `ns` at `batch` samples, scaled to `rows`.
fn scaled(ns: u64, rows: usize, batch: usize) -> Duration {
    Duration::from_nanos((ns as u128 * rows as u128 / batch.max(1) as u128) as u64)
}

/// The all-reduce of a [`NormSync`], behind a borrow of any length.
pub type NormSyncFn<'o> = dyn FnMut(&mut [f32]) -> Result<()> + 'o;

/// Loss and accuracy of one batch.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct BatchLoss {
    /// Mean loss over the batch.
    pub loss: f64,
    /// Rows classified correctly.
    pub correct: u64,
    /// Rows in the batch.
    pub rows: usize,
}

/// A batch of bags as the embedding bag's kernels read it, built on the host from the loaded
/// samples: by sample for forward (each sample's ids and weights), and by row for backward
/// (each named row's contributions, rows ascending, contributions in sample order), so that
/// every output is one thread's sum in a fixed order on either device.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct BagBatch {
    /// `off[s]..off[s + 1]`: sample `s`'s entries in `ids` and `w`.
    pub(crate) off: Vec<u32>,
    pub(crate) ids: Vec<u32>,
    /// Each entry's weight, divided by the sample's number of ids under mean pooling.
    pub(crate) w: Vec<f32>,
    /// The rows the batch names, ascending, each once.
    pub(crate) rows: Vec<u32>,
    /// `roff[u]..roff[u + 1]`: row `rows[u]`'s entries in `samples` and `rw`.
    pub(crate) roff: Vec<u32>,
    pub(crate) samples: Vec<u32>,
    pub(crate) rw: Vec<f32>,
}

impl BagBatch {
    /// The bags of `x` (`batch` samples of `slots` ids, then `slots` weights; a negative id is
    /// an empty slot) for a table of `table_rows`; an id that is not a whole number below it is
    /// refused, naming the sample.
    pub(crate) fn build(
        x: &[f32],
        batch: usize,
        slots: usize,
        table_rows: usize,
        mean: bool,
    ) -> Result<Self> {
        let mut b = BagBatch { off: Vec::with_capacity(batch + 1), ..Default::default() };
        b.off.push(0);
        for s in 0..batch {
            let sample = &x[s * 2 * slots..(s + 1) * 2 * slots];
            let (ids, ws) = sample.split_at(slots);
            let start = b.ids.len();
            for (&id, &w) in ids.iter().zip(ws) {
                if id < 0.0 {
                    continue;
                }
                if id.fract() != 0.0 || id >= table_rows as f32 {
                    return Err(Error::invalid(
                        "embedding bag",
                        format!(
                            "sample {s} of the batch names row {id}, not a row of the table's {table_rows}"
                        ),
                    ));
                }
                b.ids.push(id as u32);
                b.w.push(w);
            }
            let count = b.ids.len() - start;
            if mean && count > 0 {
                let inv = 1.0 / count as f32;
                b.w[start..].iter_mut().for_each(|w| *w *= inv);
            }
            b.off.push(b.ids.len() as u32);
        }
        // By row: entries sorted by row, stably, so each row's contributions keep sample order.
        let mut order: Vec<(u32, u32, f32)> = Vec::with_capacity(b.ids.len());
        for s in 0..batch {
            for j in b.off[s] as usize..b.off[s + 1] as usize {
                order.push((b.ids[j], s as u32, b.w[j]));
            }
        }
        order.sort_by_key(|e| e.0);
        b.roff.push(0);
        for (i, &(row, sample, w)) in order.iter().enumerate() {
            if i > 0 && order[i - 1].0 != row {
                b.roff.push(i as u32);
            }
            if i == 0 || order[i - 1].0 != row {
                b.rows.push(row);
            }
            b.samples.push(sample);
            b.rw.push(w);
        }
        if !order.is_empty() {
            b.roff.push(order.len() as u32);
        }
        Ok(b)
    }
}

/// A sparse model's state beside the net: the loaded batch's bags on the device, and which
/// rows of the table's gradient may hold values.
struct BagState<B: Backend> {
    table: Table,
    slots: usize,
    mean: bool,
    host: BagBatch,
    off: Option<B::Labels>,
    ids: Option<B::Labels>,
    w: Option<B::Buf>,
    rows: Option<B::Labels>,
    roff: Option<B::Labels>,
    samples: Option<B::Labels>,
    rw: Option<B::Buf>,
    /// Values `w` and `rw` can hold.
    capacity: usize,
    /// Rows of the table's gradient that may be nonzero, ascending; `None`: any (the gradient
    /// was handed out, or written from outside).
    dirty: Option<Vec<u32>>,
    /// `dirty` on the device, for zeroing and the update.
    dirty_dev: Option<B::Labels>,
}

/// Which buffer [`Net::read_rows`] and [`Net::write_rows`] move rows of.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RowsOf {
    /// The parameters.
    Params,
    /// The gradient.
    Grads,
}

/// `rows` of `table` as runs of consecutive rows: each run's offset in the flat buffer and its
/// values' range in a host array of `dim` values a row.
fn row_runs(table: &Table, rows: &[u32]) -> Vec<(usize, Range<usize>)> {
    let mut runs: Vec<(usize, Range<usize>)> = Vec::new();
    for (i, &r) in rows.iter().enumerate() {
        let at = table.row(r as usize).start;
        let k = i * table.dim..(i + 1) * table.dim;
        match runs.last_mut() {
            Some((start, span)) if *start + span.len() == at && span.end == k.start => span.end = k.end,
            _ => runs.push((at, k)),
        }
    }
    runs
}

/// The union of two ascending lists of rows.
fn merge_rows(a: &[u32], b: &[u32]) -> Vec<u32> {
    let mut out = Vec::with_capacity(a.len() + b.len());
    let (mut i, mut j) = (0, 0);
    while i < a.len() || j < b.len() {
        let next = match (a.get(i), b.get(j)) {
            (Some(&x), Some(&y)) if x == y => {
                i += 1;
                j += 1;
                x
            }
            (Some(&x), Some(&y)) if x < y => {
                i += 1;
                x
            }
            (Some(&x), None) => {
                i += 1;
                x
            }
            (_, Some(&y)) => {
                j += 1;
                y
            }
            (None, None) => unreachable!("the loop ends first"),
        };
        out.push(next);
    }
    out
}

/// A network living on one device: parameters, gradients, momentum, running statistics and
/// activations.
pub struct Net<B: Backend> {
    backend: B,
    spec: ModelSpec,
    graph: Graph,
    params: B::Buf,
    grads: B::Buf,
    /// Allocated on the first update or momentum write: a strategy that keeps the optimiser
    /// state elsewhere (ZeRO's shards) never pays for a full buffer.
    momentum: Option<B::Buf>,
    /// Batch-norm running statistics (the layout's buffers).
    buffers: B::Buf,
    /// Each batch norm's batch mean and inverse deviation, from forward for backward.
    saved: B::Buf,
    /// One buffer per activation slot; slot 0 is the batch as loaded.
    acts: Vec<B::Buf>,
    /// The loss gradient with respect to each slot that backward needs.
    dacts: Vec<Option<B::Buf>>,
    /// A convolution's column matrix (the largest any layer needs).
    col: Option<B::Buf>,
    /// Ones, for a convolution's bias (added and reduced as a rank-1 GEMM).
    ones: Option<B::Buf>,
    /// A batch norm's per-channel sums in backward.
    sums: Option<B::Buf>,
    labels: Option<B::Labels>,
    norm: NormConfig,
    /// Rows the activation buffers can hold; they grow on demand.
    capacity: usize,
    /// Rows of the batch the last forward pass ran over.
    rows: usize,
    /// Rows of the batch last loaded ([`Net::load_batch`]).
    loaded: usize,
    /// Training forward passes so far (PyTorch's `num_batches_tracked`).
    batches: u64,
    /// Each batch norm's count of values per channel in the last training forward, over every
    /// rank when synchronised (indexed by the start of its saved statistics).
    counts: Vec<usize>,
    /// While [`Net::record_profile`] measures: each node's nanoseconds, the device synchronised
    /// around it (forward's nodes then the loss, backward's nodes in reverse).
    timing: Option<Vec<u64>>,
    /// A sparse model's bags and table rows.
    bag: Option<BagState<B>>,
    /// Paces the training compute under `--dilate` ([`crate::dilation`]): a replayed model's
    /// waits are stretched by its factor, a real model's phases padded to it.
    pace: Pace,
}

/// `(&v[read], &mut v[write])` for `read != write`.
fn read_write<T>(v: &mut [T], read: usize, write: usize) -> (&T, &mut T) {
    assert_ne!(read, write, "a node reads and writes one slot");
    if read < write {
        let (lo, hi) = v.split_at_mut(write);
        (&lo[read], &mut hi[0])
    } else {
        let (lo, hi) = v.split_at_mut(read);
        (&hi[0], &mut lo[write])
    }
}

/// All-reduce `buf[range]` through `sync` in host memory, with `count` (a batch norm's values
/// per channel) appended when given; returns the count summed over the ranks (or `count`'s
/// absence as 0).
fn all_reduce_range<B: Backend>(
    backend: &B,
    buf: &mut B::Buf,
    range: Range<usize>,
    sync: &mut NormSyncFn<'_>,
    count: Option<usize>,
) -> Result<usize> {
    let n = range.len();
    let mut host = vec![0.0; n + usize::from(count.is_some())];
    backend.read(buf, range.clone(), &mut host[..n])?;
    if let Some(k) = count {
        host[n] = k as f32;
    }
    sync(&mut host)?;
    backend.write(buf, range.start, &host[..n])?;
    Ok(if count.is_some() { host[n] as usize } else { 0 })
}

/// The gradient buffer handed out bucket by bucket while backward runs.
struct Sink<'a, 'h, B: Backend + 'a> {
    buckets: std::iter::Enumerate<std::vec::IntoIter<Range<usize>>>,
    /// The part of the gradient buffer below the open bucket, not yet handed out.
    rest: Option<B::ViewMut<'a>>,
    open: Option<(usize, Range<usize>, B::ViewMut<'a>)>,
    /// A sparse model's table when the plan leaves it out: written in place, handed to nobody.
    uncovered: Option<Range<usize>>,
    on_ready: &'h mut dyn FnMut(usize, Range<usize>, B::ViewMut<'a>),
    /// Ends a paced phase as each bucket is handed out: its gradients are ready when, dilated,
    /// the compute behind them would have made them ready.
    pace: &'h mut Pace,
}

impl<'a, B: Backend + 'a> Sink<'a, '_, B> {
    /// Let `f` write the gradient of `range` (the next unit in backward order) into its
    /// bucket; hand the bucket out once `range` was its last.
    fn unit(&mut self, range: Range<usize>, f: impl FnOnce(B::ViewMut<'_>) -> Result<()>) -> Result<()> {
        if self.uncovered.as_ref() == Some(&range) {
            let rest = self.rest.as_mut().ok_or_else(|| Error::invalid("bucket plan", "buckets overlap"))?;
            return f(B::sub(rest, range));
        }
        if self.open.as_ref().is_none_or(|(_, r, _)| range.start < r.start) {
            let (i, r) = self
                .buckets
                .next()
                .ok_or_else(|| Error::invalid("bucket plan", "does not cover the gradients"))?;
            let whole = self.rest.take().ok_or_else(|| Error::invalid("bucket plan", "buckets overlap"))?;
            let (below, bucket) = B::split_at(whole, r.start);
            self.rest = Some(below);
            self.open = Some((i, r, bucket));
        }
        let Some((_, br, view)) = self.open.as_mut() else { unreachable!("a bucket was just opened") };
        if range.end > br.end || range.start < br.start {
            return Err(Error::invalid("bucket plan", "a bucket splits a parameter tensor"));
        }
        f(B::sub(view, range.start - br.start..range.end - br.start))?;
        if range.start == br.start {
            let (i, r, v) = self.open.take().unwrap_or_else(|| unreachable!("the bucket is open"));
            self.pace.lap();
            (self.on_ready)(i, r, v);
        }
        Ok(())
    }
}

impl<B: Backend> Net<B> {
    /// A model of `spec` on `backend`, parameters initialised from `seed`.
    pub fn new(backend: B, spec: ModelSpec, seed: u64) -> Result<Self> {
        let graph = Graph::new(&spec)?;
        let layout = &graph.layout;
        let params = backend.upload(init_params(layout, seed))?;
        let grads = if graph.replay.is_some() {
            // A replayed backward writes nothing: the gradients are these values, drawn once
            // (what a step's communication moves, and compression and checksums see, is real
            // data of the model's sizes; after an all-reduce, their mean over the ranks).
            backend.upload(init_params(layout, seed ^ REPLAY_GRADS))?
        } else {
            backend.zeros(layout.len)?
        };
        let buffers = backend.upload(init_buffers(layout))?;
        let saved = backend.zeros(graph.saved_len)?;
        let bag = match (&layout.table, spec.input, &spec.arch) {
            (Some(table), Input::Bag { slots, .. }, crate::model::Arch::Embedding { mean, .. }) => {
                Some(BagState {
                    table: table.clone(),
                    slots,
                    mean: *mean,
                    host: BagBatch::default(),
                    off: None,
                    ids: None,
                    w: None,
                    rows: None,
                    roff: None,
                    samples: None,
                    rw: None,
                    capacity: 0,
                    dirty: Some(Vec::new()),
                    dirty_dev: None,
                })
            }
            _ => None,
        };
        Ok(Net {
            backend,
            spec,
            graph,
            params,
            grads,
            momentum: None,
            buffers,
            saved,
            acts: Vec::new(),
            dacts: Vec::new(),
            col: None,
            ones: None,
            sums: None,
            labels: None,
            norm: NormConfig::DEFAULT,
            capacity: 0,
            rows: 0,
            loaded: 0,
            batches: 0,
            counts: Vec::new(),
            timing: None,
            pace: Pace::new(Dilation::NONE),
            bag,
        })
    }

    /// The device.
    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// The model.
    pub fn spec(&self) -> &ModelSpec {
        &self.spec
    }

    /// The flat layout.
    pub fn layout(&self) -> &Layout {
        &self.graph.layout
    }

    fn ensure_capacity(&mut self, rows: usize) -> Result<()> {
        if rows <= self.capacity {
            return Ok(());
        }
        let g = &self.graph;
        self.acts = g.slots.iter().map(|&n| self.backend.zeros(rows * n)).collect::<Result<_>>()?;
        self.dacts = g
            .slots
            .iter()
            .zip(&g.slot_grads)
            .map(|(&n, &needed)| needed.then(|| self.backend.zeros(rows * n)).transpose())
            .collect::<Result<_>>()?;
        let (mut col, mut ones, mut sums) = (0, 0, 0);
        for node in &g.nodes {
            match &node.op {
                Op::Conv { window, bias, .. } => {
                    let cols = rows * window.out_pixels();
                    if !window.is_pointwise() && !self.backend.direct_conv(window) {
                        col = col.max(window.col_rows() * cols);
                    }
                    if bias.is_some() {
                        ones = ones.max(cols);
                    }
                }
                Op::Norm { channels, .. } => sums = sums.max(2 * channels),
                _ => {}
            }
        }
        self.col = (col > 0).then(|| self.backend.zeros(col)).transpose()?;
        self.sums = (sums > 0).then(|| self.backend.zeros(sums)).transpose()?;
        self.ones = None;
        if ones > 0 {
            let mut buf = self.backend.zeros(ones)?;
            self.backend.write(&mut buf, 0, &vec![1.0; ones])?;
            self.ones = Some(buf);
        }
        self.capacity = rows;
        Ok(())
    }

    /// Forward pass over `x` (`rows x input`, row-major; an image sample as NCHW) with
    /// `labels`; when `train` is set the loss gradient is left ready for [`Net::backward`] and
    /// batch norms use (and update) the batch's statistics. [`Net::load_batch`], then
    /// [`Net::forward_loaded`].
    pub fn forward(&mut self, x: &[f32], labels: &[u32], train: bool) -> Result<BatchLoss> {
        self.load_batch(x, labels)?;
        self.forward_loaded(train)
    }

    /// Copy a batch, `x` (`rows x input`, row-major) and its `labels`, to the device, where the
    /// next forward passes read it.
    pub fn load_batch(&mut self, x: &[f32], labels: &[u32]) -> Result<()> {
        if self.graph.replay.is_some() {
            // Replay reads no data: only how many samples the step stands for.
            if labels.is_empty() {
                return Err(Error::Length { what: "batch labels", expected: 1, got: 0 });
            }
            self.loaded = labels.len();
            return Ok(());
        }
        let input = self.spec.input();
        if x.len() != labels.len() * input || labels.is_empty() {
            return Err(Error::Length { what: "batch inputs", expected: labels.len() * input, got: x.len() });
        }
        let classes = self.spec.classes() as u32;
        if let Some(&bad) = labels.iter().find(|&&y| y >= classes) {
            return Err(Error::invalid("label", format!("{bad} is not below the model's {classes} classes")));
        }
        let rows = labels.len();
        self.ensure_capacity(rows)?;
        self.loaded = 0;
        self.backend.write(&mut self.acts[0], 0, x)?;
        self.backend.write_labels(&mut self.labels, labels)?;
        if let Some(bag) = &mut self.bag {
            let host = BagBatch::build(x, rows, bag.slots, bag.table.rows, bag.mean)?;
            let backend = &self.backend;
            let entries = host.ids.len();
            if entries > bag.capacity || bag.w.is_none() {
                bag.capacity = entries.max(1);
                bag.w = Some(backend.zeros(bag.capacity)?);
                bag.rw = Some(backend.zeros(bag.capacity)?);
            }
            let (Some(w), Some(rw)) = (bag.w.as_mut(), bag.rw.as_mut()) else {
                unreachable!("allocated above")
            };
            backend.write(w, 0, &host.w)?;
            backend.write(rw, 0, &host.rw)?;
            backend.write_labels(&mut bag.off, &host.off)?;
            backend.write_labels(&mut bag.ids, &host.ids)?;
            backend.write_labels(&mut bag.rows, &host.rows)?;
            backend.write_labels(&mut bag.roff, &host.roff)?;
            backend.write_labels(&mut bag.samples, &host.samples)?;
            bag.host = host;
        }
        self.loaded = rows;
        Ok(())
    }

    /// Forward pass over the batch last loaded ([`Net::load_batch`]); when `train` is set the
    /// loss gradient is left ready for [`Net::backward`].
    pub fn forward_loaded(&mut self, train: bool) -> Result<BatchLoss> {
        self.forward_loaded_synced(train, None)
    }

    /// [`Net::forward_loaded`] with batch norms synchronised through `sync` ([`NormSync`]) in
    /// training.
    pub fn forward_loaded_synced(
        &mut self,
        train: bool,
        mut sync: Option<NormSync<'_>>,
    ) -> Result<BatchLoss> {
        let rows = self.loaded;
        if rows == 0 {
            return Err(Error::invalid("forward", "no batch loaded"));
        }
        self.rows = rows;
        self.batches += u64::from(train);
        if let Some(r) = &self.graph.replay {
            // Each layer's time at the profile's batch, scaled to this one (and dilated).
            let ns: u64 = r.layers.iter().map(|l| l.0).sum();
            sleep_until(Instant::now() + self.pace.dilation().stretch(scaled(ns, rows, r.batch)));
            return Ok(BatchLoss { loss: 0.0, correct: 0, rows });
        }
        // A training forward is a compute phase of the step; an evaluation's is not paced.
        if train {
            self.pace.begin();
        }
        self.counts.resize(self.graph.saved_len, 0);
        let out = (|| {
            for i in 0..self.graph.nodes.len() {
                let t = self.tick()?;
                self.forward_node(i, rows, train, sync.as_deref_mut())?;
                self.tock(t)?;
            }
            let t = self.tick()?;
            let out = self.loss(train, rows);
            self.tock(t)?;
            out
        })();
        if train {
            self.pace.end();
        }
        out
    }

    /// Run this model's training compute under `dilation` ([`crate::dilation`]): a replayed
    /// model's waits stretched by it, a real model's forward, backward (up to each bucket it
    /// hands out) and update each made to last its factor times the CPU time it used.
    pub fn set_dilation(&mut self, dilation: Dilation) {
        let turns = self.pace.turns().cloned();
        self.pace = Pace::new(dilation).with_turns(turns);
    }

    /// Compute each paced phase in its turn of `turns` ([`crate::dilation::Turns`]): processes
    /// sharing cores then compute one at a time, as on hosts of their own. A replayed model's
    /// compute is a wait and takes no turns.
    pub fn set_turns(&mut self, turns: Option<Turns>) {
        let turns = if self.graph.replay.is_some() { None } else { turns };
        self.pace = Pace::new(self.pace.dilation()).with_turns(turns);
    }

    /// The turns the training compute takes.
    pub fn turns(&self) -> Option<&Turns> {
        self.pace.turns()
    }

    /// The dilation the training compute runs under.
    pub fn dilation(&self) -> Dilation {
        self.pace.dilation()
    }

    /// What the paced phases came to since the last call ([`Pace::take`]).
    pub fn take_pace(&mut self) -> PaceTally {
        self.pace.take()
    }

    /// With [`Net::timing`] on: the device synchronised, and the moment a node starts.
    fn tick(&self) -> Result<Option<Instant>> {
        if self.timing.is_none() {
            return Ok(None);
        }
        self.backend.synchronize()?;
        Ok(Some(Instant::now()))
    }

    /// With [`Net::timing`] on: the device synchronised, and the node's time since `t` kept.
    fn tock(&mut self, t: Option<Instant>) -> Result<()> {
        if let (Some(t), Some(_)) = (t, &self.timing) {
            self.backend.synchronize()?;
            let ns = t.elapsed().as_nanos() as u64;
            if let Some(v) = self.timing.as_mut() {
                v.push(ns);
            }
        }
        Ok(())
    }

    /// Softmax cross-entropy of the last forward's output, its gradient left for backward when
    /// training.
    fn loss(&mut self, train: bool, rows: usize) -> Result<BatchLoss> {
        let last = self.graph.nodes.last().map_or(0, |n| n.output);
        let cols = self.spec.classes();
        let labels = self.labels.as_ref().ok_or_else(|| Error::invalid("labels", "none uploaded"))?;
        let dlogits = match &mut self.dacts[last] {
            Some(d) if train => Some(B::view_mut(d, 0..rows * cols)),
            _ => None,
        };
        let (loss, correct) = self.backend.softmax_xent(
            B::view(&self.acts[last], 0..rows * cols),
            labels,
            dlogits,
            rows,
            cols,
            1.0 / rows as f32,
        )?;
        Ok(BatchLoss { loss: loss / rows as f64, correct, rows })
    }

    fn forward_node<'o>(
        &mut self,
        i: usize,
        n: usize,
        train: bool,
        sync: Option<&mut NormSyncFn<'o>>,
    ) -> Result<()> {
        let Net { backend, graph, params, buffers, saved, acts, col, ones, norm, counts, bag, .. } = self;
        let node = &graph.nodes[i];
        let size = |slot: usize| n * graph.slots[slot];
        if node.op == Op::Relu {
            return backend.relu(B::view_mut(&mut acts[node.output], 0..size(node.output)));
        }
        let (input, output) = (node.input, node.output);
        let (xbuf, ybuf) = read_write(acts, input, output);
        let x = B::view(xbuf, 0..size(input));
        let ylen = size(output);
        macro_rules! y {
            () => {
                B::view_mut(ybuf, 0..ylen)
            };
        }
        match &node.op {
            Op::ToChannels { channels, pixels } => backend.swap_axes(y!(), x, n, *channels, *pixels, false),
            Op::Linear { fan_in, fan_out, weight, bias, relu } => {
                let w = B::view(params, weight.clone());
                backend.gemm(n, *fan_out, *fan_in, x, false, w, true, y!(), false)?;
                backend.bias_act(y!(), B::view(params, bias.clone()), n, *fan_out, *relu)
            }
            Op::Conv { window, out, weight, bias } => {
                let cols = n * window.out_pixels();
                let w = B::view(params, weight.clone());
                let colv = if backend.direct_conv(window) {
                    backend.conv(y!(), x, w, window, *out, n, false)?;
                    None
                } else if window.is_pointwise() {
                    Some(x)
                } else {
                    let c = col.as_mut().ok_or_else(|| Error::invalid("convolution", "no column buffer"))?;
                    backend.im2col(B::view_mut(c, 0..window.col_rows() * cols), x, window, n)?;
                    Some(B::view(c, 0..window.col_rows() * cols))
                };
                if let Some(colv) = colv {
                    backend.gemm(*out, cols, window.col_rows(), w, false, colv, false, y!(), false)?;
                }
                if let Some(b) = bias {
                    let ones =
                        ones.as_ref().ok_or_else(|| Error::invalid("convolution", "no ones buffer"))?;
                    let (b, o) = (B::view(params, b.clone()), B::view(ones, 0..cols));
                    backend.gemm(*out, cols, 1, b, false, o, false, y!(), true)?;
                }
                Ok(())
            }
            Op::Norm { channels, pixels, params: affine, buffers: running, saved: stats } => {
                let (c, m) = (*channels, n * *pixels);
                let (means, devs) = (stats.start..stats.start + c, stats.start + c..stats.end);
                let mut count = m;
                if train {
                    let mut sync = sync;
                    backend.channel_sums(B::view_mut(saved, means.clone()), x, ChannelSum::Plain, c, m)?;
                    if let Some(sync) = sync.as_deref_mut() {
                        // The sums of x and the count over every rank.
                        count = all_reduce_range(backend, saved, means.clone(), sync, Some(m))?;
                    }
                    backend.scale(B::view_mut(saved, means.clone()), 1.0 / count as f32)?;
                    {
                        let mut sv = B::view_mut(saved, stats.clone());
                        let (mean, mut dev) = B::split_at(B::sub(&mut sv, 0..2 * c), c);
                        let center = B::as_view(&mean);
                        let what = ChannelSum::SquaredDeviation { center };
                        backend.channel_sums(B::sub(&mut dev, 0..c), x, what, c, m)?;
                    }
                    if let Some(sync) = sync {
                        // The squared deviations from the mean every rank shares.
                        all_reduce_range(backend, saved, devs.clone(), sync, None)?;
                    }
                    counts[stats.start] = count;
                }
                backend.norm_stats(
                    B::view_mut(saved, stats.clone()),
                    B::view_mut(buffers, running.clone()),
                    c,
                    count,
                    train,
                    norm,
                )?;
                backend.norm_apply(
                    y!(),
                    x,
                    B::view(saved, stats.clone()),
                    B::view(params, affine.clone()),
                    c,
                    m,
                )
            }
            Op::MaxPool { window } => {
                let planes = Window { channels: window.channels * n, ..*window };
                backend.max_pool(y!(), x, &planes)
            }
            Op::AvgPool { channels, pixels } => backend.avg_pool(y!(), x, *channels, n, *pixels),
            Op::Flatten { channels, pixels } => backend.swap_axes(y!(), x, *channels, n, *pixels, false),
            Op::Bag { table, dim } => {
                let b = bag.as_ref().ok_or_else(|| Error::invalid("embedding bag", "no bags loaded"))?;
                let (Some(off), Some(ids), Some(w)) = (&b.off, &b.ids, &b.w) else {
                    return Err(Error::invalid("embedding bag", "no bags loaded"));
                };
                let w = B::view(w, 0..b.host.ids.len());
                backend.bag_forward(y!(), B::view(params, table.clone()), off, ids, w, n, *dim)
            }
            Op::Add { other, .. } => {
                backend.add_into(y!(), x, false)?;
                let (obuf, ybuf) = read_write(acts, *other, output);
                backend.add_into(B::view_mut(ybuf, 0..size(output)), B::view(obuf, 0..size(*other)), true)
            }
            Op::Relu => unreachable!("handled above"),
        }
    }

    /// Backward pass for the batch of the last training [`Net::forward`]. Gradients overwrite
    /// the gradient buffer, or add to it when `accumulate`. Each bucket of `plan` is handed to
    /// `on_ready(index, range, view)` as soon as its last gradient is written; the view stays
    /// valid for the whole borrow of `self`, so another thread may reduce it meanwhile.
    pub fn backward<'a>(
        &'a mut self,
        plan: &BucketPlan,
        accumulate: bool,
        on_ready: &mut dyn FnMut(usize, Range<usize>, B::ViewMut<'a>),
    ) -> Result<()> {
        self.backward_synced(plan, accumulate, on_ready, None)
    }

    /// [`Net::backward`] with batch norms synchronised through `sync` ([`NormSync`]): each
    /// layer's input gradient from the sums over every rank, its weight and bias gradients
    /// from this rank's own (which the data-parallel mean then averages, as SyncBatchNorm's).
    pub fn backward_synced<'a>(
        &'a mut self,
        plan: &BucketPlan,
        accumulate: bool,
        on_ready: &mut dyn FnMut(usize, Range<usize>, B::ViewMut<'a>),
        sync: Option<NormSync<'_>>,
    ) -> Result<()> {
        let rows = self.rows;
        if rows == 0 {
            return Err(Error::invalid("backward", "no forward pass to differentiate"));
        }
        let handed_out = plan.covers_table(&self.graph.layout);
        if let Some(bag) = &mut self.bag {
            // Rows a previous step left in the table's gradient are cleared before this
            // batch's are written (all of it when nobody knows which).
            if !accumulate && let Some(dirty) = &bag.dirty {
                self.backend.write_labels(&mut bag.dirty_dev, dirty)?;
            }
        }
        let Net {
            backend,
            graph,
            params,
            grads,
            saved,
            acts,
            dacts,
            col,
            ones,
            sums,
            counts,
            timing,
            bag,
            pace,
            ..
        } = self;
        let dilation = pace.dilation();
        let mut sink: Sink<'a, '_, B> = Sink {
            buckets: plan.buckets.clone().into_iter().enumerate(),
            rest: Some(B::view_mut(grads, 0..graph.layout.len)),
            open: None,
            uncovered: if handed_out { None } else { graph.layout.table.as_ref().map(|t| t.range.clone()) },
            on_ready,
            pace,
        };
        if let Some(r) = &graph.replay {
            // Each layer's gradients handed out when its backward time, scaled to the batch
            // (and dilated), has passed since backward began (deadlines, so that a late wake-up
            // is not carried into the layers after it).
            let mut due = Instant::now();
            for (_, backward_ns, units) in &r.layers {
                due += dilation.stretch(scaled(*backward_ns, rows, r.batch));
                sleep_until(due);
                for unit in units {
                    sink.unit(unit.clone(), |_| Ok(()))?;
                }
            }
            return Ok(());
        }
        // What backward clears of the table's gradient first: nothing when accumulating, else the
        // rows a previous step may have left (`Some(count)` of them, uploaded above), or all.
        let clear = match bag.as_ref() {
            Some(b) if !accumulate => Some(b.dirty.as_ref().map(Vec::len)),
            _ => None,
        };
        if let Some(b) = bag.as_mut() {
            // What the table's gradient may hold once this backward has written it.
            b.dirty = match (&b.dirty, handed_out, accumulate) {
                (_, true, _) | (None, _, true) => None,
                (Some(d), false, true) => Some(merge_rows(d, &b.host.rows)),
                (_, false, false) => Some(b.host.rows.clone()),
            };
        }
        let bag = bag.as_ref();
        let mut parts = Parts {
            backend,
            graph,
            params,
            saved,
            acts,
            col,
            ones,
            sums,
            counts,
            sync,
            rows,
            accumulate,
            bag,
            clear,
        };
        // Backward is paced in phases, each ending where a bucket is handed out ([`Sink::unit`]).
        sink.pace.begin();
        for node in graph.nodes.iter().rev() {
            let Some(times) = timing.as_mut() else {
                parts.backward_node(node, dacts, &mut sink)?;
                continue;
            };
            parts.backend.synchronize()?;
            let t = Instant::now();
            parts.backward_node(node, dacts, &mut sink)?;
            parts.backend.synchronize()?;
            times.push(t.elapsed().as_nanos() as u64);
        }
        sink.pace.end();
        Ok(())
    }

    /// Measure this model's profile on its device: `steps` training steps over `x` and
    /// `labels` after one warm-up, each node's forward and backward time taken with the device
    /// synchronised around it, and the optimiser step's; the medians as a [`Profile`] whose
    /// layers are the graph's nodes in backward order (a layer with parameters named by them,
    /// its tensors in the order backward readies them), the loss first. What
    /// `gradsync-bench replay record` writes, so that a replay can be set against the real run.
    pub fn record_profile(&mut self, x: &[f32], labels: &[u32], steps: usize) -> Result<Profile> {
        if self.graph.replay.is_some() {
            return Err(Error::invalid("model", "a replayed model has no compute of its own to measure"));
        }
        let plan = BucketPlan::whole(&self.graph.layout);
        let cfg = SgdConfig::default();
        self.load_batch(x, labels)?;
        let mut runs: Vec<(Vec<u64>, Vec<u64>, u64)> = Vec::new();
        for step in 0..=steps.max(1) {
            self.timing = Some(Vec::new());
            self.forward_loaded(true)?;
            let forward = self.timing.replace(Vec::new()).unwrap_or_default();
            self.backward(&plan, false, &mut |_, _, _| {})?;
            let backward = self.timing.take().unwrap_or_default();
            self.backend.synchronize()?;
            let t = Instant::now();
            self.update(&cfg, 1.0)?;
            self.backend.synchronize()?;
            if step > 0 {
                runs.push((forward, backward, t.elapsed().as_nanos() as u64));
            }
        }
        let median = |mut v: Vec<u64>| {
            v.sort_unstable();
            v[v.len() / 2]
        };
        let nodes = self.graph.nodes.len();
        let fwd = |i: usize| median(runs.iter().map(|r| r.0[i]).collect());
        let bwd = |i: usize| median(runs.iter().map(|r| r.1[i]).collect());
        let layout = &self.graph.layout;
        let tensor = |r: &Range<usize>| -> Vec<(String, Vec<usize>)> {
            let within = |t: &&crate::model::Tensor| r.start <= t.range.start && t.range.end <= r.end;
            layout.params.iter().filter(within).map(|t| (t.name.clone(), t.shape.clone())).collect()
        };
        let mut layers = vec![crate::profile::Layer {
            name: "loss (softmax cross-entropy)".into(),
            forward_ns: fwd(nodes),
            backward_ns: 0,
            tensors: Vec::new(),
        }];
        for (k, node) in self.graph.nodes.iter().enumerate().rev() {
            let tensors: Vec<(String, Vec<usize>)> = match &node.op {
                Op::Linear { weight, bias, .. } => [tensor(bias), tensor(weight)].concat(),
                Op::Conv { weight, bias, .. } => {
                    [bias.as_ref().map(tensor).unwrap_or_default(), tensor(weight)].concat()
                }
                // This model's layout keeps a norm's weight below its bias, and readies the
                // top of the flat buffer first.
                Op::Norm { params, .. } => tensor(params).into_iter().rev().collect(),
                Op::Bag { table, .. } => tensor(table),
                _ => Vec::new(),
            };
            let name = match tensors.first() {
                Some((n, _)) => n.rsplit_once('.').map_or(n.as_str(), |(m, _)| m).to_string(),
                None => format!("{} {k}", node.op.kind()),
            };
            layers.push(crate::profile::Layer {
                name,
                forward_ns: fwd(k),
                backward_ns: bwd(nodes - 1 - k),
                tensors,
            });
        }
        Ok(Profile {
            model: self.spec.name.clone(),
            batch: labels.len(),
            device: self.backend.describe(),
            estimated: false,
            layers,
            optimizer_ns: median(runs.iter().map(|r| r.2).collect()),
            source: format!("measured by gradsync on {}", self.backend.describe()),
        })
    }

    /// One optimiser step from the gradient buffer, scaled by `grad_scale`.
    pub fn update(&mut self, cfg: &SgdConfig, grad_scale: f32) -> Result<()> {
        if let Some(r) = &self.graph.replay {
            sleep_until(Instant::now() + self.pace.dilation().stretch(Duration::from_nanos(r.optimizer_ns)));
            return Ok(());
        }
        self.pace.begin();
        let out = self.update_now(cfg, grad_scale);
        self.pace.end();
        out
    }

    /// [`Net::update`] of a model trained for real, unpaced.
    fn update_now(&mut self, cfg: &SgdConfig, grad_scale: f32) -> Result<()> {
        let n = self.graph.layout.len;
        if self.momentum.is_none() {
            self.momentum = Some(self.backend.zeros(n)?);
        }
        if let Some(bag) = &mut self.bag
            && let Some(dirty) = &bag.dirty
        {
            self.backend.write_labels(&mut bag.dirty_dev, dirty)?;
        }
        let Net { backend, params, grads, momentum: Some(momentum), bag, .. } = self else {
            unreachable!("the momentum was just allocated")
        };
        let Some(bag) = bag else {
            return backend.sgd(
                cfg,
                B::view_mut(params, 0..n),
                B::view(grads, 0..n),
                B::view_mut(momentum, 0..n),
                grad_scale,
            );
        };
        // The dense layers as any model's; the table's rows lazily, only those whose gradient
        // is not all zero (of the rows that may hold one).
        let t = bag.table.range.clone();
        for r in [0..t.start, t.end..n] {
            if !r.is_empty() {
                let (p, g, m) =
                    (B::view_mut(params, r.clone()), B::view(grads, r.clone()), B::view_mut(momentum, r));
                backend.sgd(cfg, p, g, m, grad_scale)?;
            }
        }
        let (rows, count) = match &bag.dirty {
            Some(d) => (bag.dirty_dev.as_ref(), d.len()),
            None => (None, bag.table.rows),
        };
        if count == 0 {
            return Ok(());
        }
        let (p, g, m) = (B::view_mut(params, t.clone()), B::view(grads, t.clone()), B::view_mut(momentum, t));
        backend.sgd_rows(cfg, p, g, m, rows, count, bag.table.dim, grad_scale)
    }

    /// The rows of a sparse model's table that the loaded batch names, ascending (empty for a
    /// dense model).
    pub fn batch_rows(&self) -> &[u32] {
        self.bag.as_ref().map_or(&[], |b| &b.host.rows)
    }

    /// The rows of the table that the batch `x` (not loaded) names, ascending and each once:
    /// what a step on it will read (a parameter server fetches them ahead). Empty for a dense
    /// model; an id that is not a row of the table is refused as loading `x` would.
    pub fn rows_of(&self, x: &[f32]) -> Result<Vec<u32>> {
        let Some(bag) = &self.bag else { return Ok(Vec::new()) };
        let width = 2 * bag.slots;
        if width == 0 || !x.len().is_multiple_of(width) {
            return Err(Error::Length { what: "batch inputs", expected: width, got: x.len() });
        }
        Ok(BagBatch::build(x, x.len() / width, bag.slots, bag.table.rows, false)?.rows)
    }

    /// Say that the table's gradient may hold values in any row: it was written from outside
    /// the net (a dense all-reduce of the whole buffer, another replica's sum).
    fn table_written(&mut self) {
        if let Some(b) = &mut self.bag {
            b.dirty = None;
        }
    }

    /// Rows of a sparse model's table, `dim` values a row in the order of `rows`, copied from
    /// (`Part::Grads`: the gradient, `Part::Params`: the parameters) to host memory.
    pub fn read_rows(&self, part: RowsOf, rows: &[u32], dst: &mut [f32]) -> Result<()> {
        let table = self.table_for(rows, dst.len())?;
        let buf = match part {
            RowsOf::Params => &self.params,
            RowsOf::Grads => &self.grads,
        };
        for (at, k) in row_runs(&table, rows) {
            self.backend.read(buf, at..at + k.len(), &mut dst[k])?;
        }
        Ok(())
    }

    /// Overwrite rows of a sparse model's table from host memory (`dim` values a row, in the
    /// order of `rows`): parameters pulled from a server, or the gradient's rows summed over
    /// every rank before an update (which then steps these rows and those the last backward
    /// wrote).
    pub fn write_rows(&mut self, part: RowsOf, rows: &[u32], src: &[f32]) -> Result<()> {
        let table = self.table_for(rows, src.len())?;
        let buf = match part {
            RowsOf::Params => &mut self.params,
            RowsOf::Grads => &mut self.grads,
        };
        for (at, k) in row_runs(&table, rows) {
            self.backend.write(buf, at, &src[k])?;
        }
        if part == RowsOf::Grads
            && let Some(b) = &mut self.bag
            && let Some(d) = &b.dirty
        {
            let mut sorted = rows.to_vec();
            sorted.sort_unstable();
            sorted.dedup();
            b.dirty = Some(merge_rows(d, &sorted));
        }
        Ok(())
    }

    /// The table, once `rows` (each below its rows) and `len` (`dim` values a row) are checked.
    fn table_for(&self, rows: &[u32], len: usize) -> Result<Table> {
        let t = self
            .graph
            .layout
            .table
            .clone()
            .ok_or_else(|| Error::invalid("rows", "the model has no table"))?;
        if len != rows.len() * t.dim {
            return Err(Error::Length { what: "table rows", expected: rows.len() * t.dim, got: len });
        }
        if let Some(&bad) = rows.iter().find(|&&r| r as usize >= t.rows) {
            return Err(Error::invalid("rows", format!("row {bad} is past the table's {}", t.rows)));
        }
        Ok(t)
    }

    /// Multiply every gradient by `factor`.
    pub fn scale_grads(&mut self, factor: f32) -> Result<()> {
        let n = self.graph.layout.len;
        self.backend.scale(B::view_mut(&mut self.grads, 0..n), factor)
    }

    /// The parameters (`range`) copied to host memory.
    pub fn read_params(&self, range: Range<usize>, dst: &mut [f32]) -> Result<()> {
        self.backend.read(&self.params, range, dst)
    }

    /// Overwrite parameters from host memory starting at `offset`.
    pub fn write_params(&mut self, offset: usize, src: &[f32]) -> Result<()> {
        self.check_range("parameters", offset, src.len())?;
        self.backend.write(&mut self.params, offset, src)
    }

    /// The gradients (`range`) copied to host memory.
    pub fn read_grads(&self, range: Range<usize>, dst: &mut [f32]) -> Result<()> {
        self.backend.read(&self.grads, range, dst)
    }

    /// Overwrite gradients from host memory starting at `offset`.
    pub fn write_grads(&mut self, offset: usize, src: &[f32]) -> Result<()> {
        self.check_range("gradients", offset, src.len())?;
        self.table_written();
        self.backend.write(&mut self.grads, offset, src)
    }

    /// The running statistics (the layout's buffers) copied to host memory.
    pub fn read_buffers(&self, dst: &mut [f32]) -> Result<()> {
        let n = self.graph.layout.buffers_len;
        if dst.len() != n {
            return Err(Error::Length { what: "buffers", expected: n, got: dst.len() });
        }
        self.backend.read(&self.buffers, 0..n, dst)
    }

    /// Training forward passes so far: each batch norm's `num_batches_tracked`.
    pub fn batches_tracked(&self) -> u64 {
        self.batches
    }

    /// Set the training forward passes counted so far (a run resumed from a checkpoint).
    pub fn set_batches_tracked(&mut self, n: u64) {
        self.batches = n;
    }

    /// Overwrite the running statistics from host memory.
    pub fn write_buffers(&mut self, src: &[f32]) -> Result<()> {
        let n = self.graph.layout.buffers_len;
        if src.len() != n {
            return Err(Error::Length { what: "buffers", expected: n, got: src.len() });
        }
        self.backend.write(&mut self.buffers, 0, src)
    }

    /// The momentum buffer copied to host memory (checkpoints); zeros, PyTorch's starting
    /// state, while none has been allocated.
    pub fn read_momentum(&self, dst: &mut [f32]) -> Result<()> {
        let n = self.graph.layout.len;
        match &self.momentum {
            Some(m) => self.backend.read(m, 0..n, dst),
            None if dst.len() == n => {
                dst.fill(0.0);
                Ok(())
            }
            None => Err(Error::Length { what: "momentum", expected: n, got: dst.len() }),
        }
    }

    /// Overwrite the momentum buffer (checkpoints), allocating it if needed.
    pub fn write_momentum(&mut self, src: &[f32]) -> Result<()> {
        self.check_range("momentum", 0, src.len())?;
        let m = match &mut self.momentum {
            Some(m) => m,
            None => self.momentum.insert(self.backend.zeros(self.graph.layout.len)?),
        };
        self.backend.write(m, 0, src)
    }

    /// Free the momentum buffer: a strategy that has taken the optimiser state into its own
    /// keeping (ZeRO's shards). A later update starts again from zero momentum.
    pub fn release_momentum(&mut self) {
        self.momentum = None;
    }

    /// Bytes of optimiser state this model holds (the momentum buffer, once allocated).
    pub fn optimizer_state_bytes(&self) -> usize {
        self.momentum.as_ref().map_or(0, |_| self.graph.layout.len * size_of::<f32>())
    }

    /// The parameters and gradients as host slices, on a device whose buffers live in host
    /// memory: strategies that update and exchange slices of them in place (ZeRO).
    pub fn host_buffers_mut(&mut self) -> (&mut [f32], &mut [f32])
    where
        B::Buf: AsMut<[f32]>,
    {
        self.table_written();
        (self.params.as_mut(), self.grads.as_mut())
    }

    /// Exchange the gradient buffer with `other`, which must be as long, on a device whose
    /// buffers are host vectors: lends the gradient out whole without copying it (a push sends
    /// it from where it lies) and takes it back the same way.
    pub fn swap_grads(&mut self, other: &mut Vec<f32>) -> Result<()>
    where
        B: Backend<Buf = Vec<f32>>,
    {
        let n = self.graph.layout.len;
        if other.len() != n {
            return Err(Error::Length { what: "gradient buffer", expected: n, got: other.len() });
        }
        std::mem::swap(&mut self.grads, other);
        self.table_written();
        Ok(())
    }

    /// Exclusive access to the device buffers of the parameters and gradients, for collectives
    /// that work on device memory directly (NCCL).
    pub fn buffers_mut(&mut self) -> (&mut B::Buf, &mut B::Buf) {
        self.table_written();
        (&mut self.params, &mut self.grads)
    }

    fn check_range(&self, what: &'static str, offset: usize, len: usize) -> Result<()> {
        let n = self.graph.layout.len;
        if offset + len > n {
            return Err(Error::Length { what, expected: n - offset.min(n), got: len });
        }
        Ok(())
    }
}

/// What backward reads besides the activation gradients and the gradient buffer.
struct Parts<'p, 's, B: Backend> {
    backend: &'p B,
    graph: &'p Graph,
    params: &'p B::Buf,
    saved: &'p B::Buf,
    acts: &'p [B::Buf],
    col: &'p mut Option<B::Buf>,
    ones: &'p Option<B::Buf>,
    sums: &'p mut Option<B::Buf>,
    /// Each batch norm's count of values per channel in forward (over every rank).
    counts: &'p [usize],
    sync: Option<NormSync<'s>>,
    rows: usize,
    /// Add parameter gradients to the buffer rather than overwrite it.
    accumulate: bool,
    /// A sparse model's bags.
    bag: Option<&'p BagState<B>>,
    /// What to clear of the table's gradient before writing it: `Some(Some(k))` the `k` dirty
    /// rows, `Some(None)` all of it, `None` nothing.
    clear: Option<Option<usize>>,
}

/// The gradient of a node's input, made only when a step writes it (`InputGrad::Skip`: the
/// input needs none).
struct Dx<'v, B: Backend + 'v> {
    buf: &'v mut Option<B::Buf>,
    len: usize,
    how: InputGrad,
}

impl<B: Backend> Dx<'_, B> {
    /// Whether the node writes its input's gradient.
    fn wanted(&self) -> bool {
        self.how != InputGrad::Skip
    }

    /// Whether it adds to it (another consumer of the input wrote it first).
    fn accumulate(&self) -> bool {
        self.how.accumulate()
    }

    fn view(&mut self) -> Result<B::ViewMut<'_>> {
        Ok(B::view_mut(self.buf.as_mut().ok_or_else(missing_grad)?, 0..self.len))
    }
}

/// One node's backward as its step sees it: the gradient of its output (`dy`), the input it
/// read in forward (`x`), and its input's gradient (`dx`).
struct NodeGrads<'v, 'p, B: Backend + 'v + 'p> {
    dy: B::View<'v>,
    x: B::View<'p>,
    dx: Dx<'v, B>,
}

/// An activation gradient backward needs was never allocated (the graph's bookkeeping).
fn missing_grad() -> Error {
    Error::invalid("backward", "an activation gradient was not allocated")
}

impl<'p, B: Backend> Parts<'p, '_, B> {
    /// Backward through `node`: its parameters' gradients handed to `sink` unit by unit, its
    /// input's gradient written into `dacts`; each kind of node by a step of its own below.
    fn backward_node<'a>(
        &mut self,
        node: &Node,
        dacts: &mut [Option<B::Buf>],
        sink: &mut Sink<'a, '_, B>,
    ) -> Result<()> {
        let (n, graph, backend) = (self.rows, self.graph, self.backend);
        let size = |slot: usize| n * graph.slots[slot];
        match &node.op {
            Op::ToChannels { .. } => return Ok(()),
            Op::Relu | Op::Linear { relu: true, .. } => {
                // dz = dy where the output is positive, in place (a fused ReLU first).
                let d = dacts[node.output].as_mut().ok_or_else(missing_grad)?;
                backend.relu_backward(B::view_mut(d, 0..size(node.output)), self.act(node.output))?;
                if node.op == Op::Relu {
                    return Ok(());
                }
            }
            Op::Add { other, other_grad } => return self.add_backward(node, (*other, *other_grad), dacts),
            _ => {}
        }
        let (dybuf, dxbuf) = read_write(dacts, node.output, node.input);
        let dy = B::view(dybuf.as_ref().ok_or_else(missing_grad)?, 0..size(node.output));
        let dx = Dx { buf: dxbuf, len: size(node.input), how: node.input_grad };
        let mut g = NodeGrads { dy, x: self.act(node.input), dx };
        let acc_dx = g.dx.accumulate();
        match &node.op {
            Op::Linear { fan_in, fan_out, weight, bias, .. } => {
                self.linear_backward(sink, (*fan_in, *fan_out), (weight, bias), g)
            }
            Op::Conv { window, out, weight, bias } => {
                self.conv_backward(sink, (window, *out), (weight, bias.as_ref()), g)
            }
            Op::Norm { channels, pixels, params, saved, .. } => {
                self.norm_backward(sink, (*channels, n * *pixels), (params, saved), g)
            }
            Op::MaxPool { window } if g.dx.wanted() => {
                let planes = Window { channels: window.channels * n, ..*window };
                backend.max_pool_backward(g.dx.view()?, g.dy, g.x, &planes, acc_dx)
            }
            Op::AvgPool { channels, pixels } if g.dx.wanted() => {
                backend.avg_pool_backward(g.dx.view()?, g.dy, *channels, n, *pixels, acc_dx)
            }
            Op::Flatten { channels, pixels } if g.dx.wanted() => {
                backend.swap_axes(g.dx.view()?, g.dy, n, *channels, *pixels, acc_dx)
            }
            Op::MaxPool { .. } | Op::AvgPool { .. } | Op::Flatten { .. } => Ok(()),
            Op::Bag { table, dim } => self.bag_backward(sink, table, *dim, g.dy),
            Op::ToChannels { .. } | Op::Relu | Op::Add { .. } => unreachable!("handled above"),
        }
    }

    /// Activation `slot` of the batch, as forward left it.
    fn act(&self, slot: usize) -> B::View<'p> {
        let acts: &'p [B::Buf] = self.acts;
        B::view(&acts[slot], 0..self.rows * self.graph.slots[slot])
    }

    /// A residual sum: its output's gradient into the gradient of each input that wants one.
    fn add_backward(
        &self,
        node: &Node,
        (other, other_grad): (usize, InputGrad),
        dacts: &mut [Option<B::Buf>],
    ) -> Result<()> {
        let size = |slot: usize| self.rows * self.graph.slots[slot];
        for (slot, how) in [(node.input, node.input_grad), (other, other_grad)] {
            if how != InputGrad::Skip {
                let (dybuf, dbuf) = read_write(dacts, node.output, slot);
                let dy = B::view(dybuf.as_ref().ok_or_else(missing_grad)?, 0..size(node.output));
                let d = B::view_mut(dbuf.as_mut().ok_or_else(missing_grad)?, 0..size(slot));
                self.backend.add_into(d, dy, how.accumulate())?;
            }
        }
        Ok(())
    }

    /// A linear layer `fan_in -> fan_out`: the bias's and the weight's gradients, then `dX =
    /// dZ W`.
    fn linear_backward<'a>(
        &mut self,
        sink: &mut Sink<'a, '_, B>,
        (fan_in, fan_out): (usize, usize),
        (weight, bias): (&Range<usize>, &Range<usize>),
        g: NodeGrads<'_, 'p, B>,
    ) -> Result<()> {
        let (n, acc, backend) = (self.rows, self.accumulate, self.backend);
        let NodeGrads { dy, x, mut dx } = g;
        sink.unit(bias.clone(), |t| backend.bias_grad(t, dy, n, fan_out, acc))?;
        sink.unit(weight.clone(), |t| backend.gemm(fan_out, fan_in, n, dy, true, x, false, t, acc))?;
        if dx.wanted() {
            // dX = dZ W.
            let acc_dx = dx.accumulate();
            let w = B::view(self.params, weight.clone());
            backend.gemm(n, fan_in, fan_out, dy, false, w, false, dx.view()?, acc_dx)?;
        }
        Ok(())
    }

    /// A convolution over `window` into `out` channels: the bias's gradient (a GEMM against
    /// ones), then the weight's and the input's, by the device's direct kernels, as one GEMM
    /// each for a pointwise window, or through the column matrix.
    fn conv_backward<'a>(
        &mut self,
        sink: &mut Sink<'a, '_, B>,
        (window, out): (&Window, usize),
        (weight, bias): (&Range<usize>, Option<&Range<usize>>),
        g: NodeGrads<'_, 'p, B>,
    ) -> Result<()> {
        let (n, acc, backend) = (self.rows, self.accumulate, self.backend);
        let NodeGrads { dy, x, mut dx } = g;
        let (want_dx, acc_dx) = (dx.wanted(), dx.accumulate());
        let cols = n * window.out_pixels();
        let k = window.col_rows();
        if let Some(b) = bias {
            let ones = self.ones.as_ref().ok_or_else(|| Error::invalid("convolution", "no ones buffer"))?;
            let o = B::view(ones, 0..cols);
            sink.unit(b.clone(), |t| backend.gemm(out, 1, cols, dy, false, o, false, t, acc))?;
        }
        let w = B::view(self.params, weight.clone());
        if backend.direct_conv(window) {
            sink.unit(weight.clone(), |t| backend.conv_weight_grad(t, dy, x, window, out, n, acc))?;
            if want_dx {
                backend.conv_input_grad(dx.view()?, dy, w, window, out, n, acc_dx)?;
            }
            return Ok(());
        }
        if window.is_pointwise() {
            sink.unit(weight.clone(), |t| backend.gemm(out, k, cols, dy, false, x, true, t, acc))?;
            if want_dx {
                backend.gemm(k, cols, out, w, true, dy, false, dx.view()?, acc_dx)?;
            }
            return Ok(());
        }
        // The column matrix again (forward's was overwritten by later layers), then the
        // columns' gradient in its place.
        let c = self.col.as_mut().ok_or_else(|| Error::invalid("convolution", "no column buffer"))?;
        backend.im2col(B::view_mut(c, 0..k * cols), x, window, n)?;
        let colv = B::view(c, 0..k * cols);
        sink.unit(weight.clone(), |t| backend.gemm(out, k, cols, dy, false, colv, true, t, acc))?;
        if want_dx {
            backend.gemm(k, cols, out, w, true, dy, false, B::view_mut(c, 0..k * cols), false)?;
            backend.col2im(dx.view()?, B::view(c, 0..k * cols), window, n, acc_dx)?;
        }
        Ok(())
    }

    /// A batch norm over `c` channels of `m` values each: every channel's `sum dy` and `sum dy
    /// (x - mean)`, then the weight's and bias's gradients and the input's from them. When
    /// synchronised, the input's gradient from those sums over every rank (and the count of
    /// values forward normalised over), the weight's and bias's from this rank's own.
    fn norm_backward<'a>(
        &mut self,
        sink: &mut Sink<'a, '_, B>,
        (c, m): (usize, usize),
        (affine, stats): (&Range<usize>, &Range<usize>),
        g: NodeGrads<'_, 'p, B>,
    ) -> Result<()> {
        let (acc, backend) = (self.accumulate, self.backend);
        let NodeGrads { dy, x, mut dx } = g;
        let (want_dx, acc_dx) = (dx.wanted(), dx.accumulate());
        let sums = self.sums.as_mut().ok_or_else(|| Error::invalid("batch norm", "no sums buffer"))?;
        {
            let mut s = B::view_mut(sums, 0..2 * c);
            let (mut sdy, mut sdot) = B::split_at(B::sub(&mut s, 0..2 * c), c);
            backend.channel_sums(B::sub(&mut sdy, 0..c), dy, ChannelSum::Plain, c, m)?;
            let center = B::view(self.saved, stats.start..stats.start + c);
            backend.channel_sums(B::sub(&mut sdot, 0..c), dy, ChannelSum::Dot { b: x, center }, c, m)?;
        }
        let gamma = B::view(self.params, affine.clone());
        let sv = B::view(self.saved, stats.clone());
        let Some(sync) = self.sync.as_deref_mut() else {
            let sums = B::view(sums, 0..2 * c);
            let dxv = if want_dx { Some(dx.view()?) } else { None };
            return sink.unit(affine.clone(), |t| {
                backend.norm_backward(dxv, Some(t), dy, x, sv, gamma, sums, c, m, m, acc, acc_dx)
            });
        };
        // The weight and bias from this rank's sums; the input gradient from every rank's.
        let local = B::view(sums, 0..2 * c);
        sink.unit(affine.clone(), |t| {
            backend.norm_backward(None, Some(t), dy, x, sv, gamma, local, c, m, m, acc, false)
        })?;
        if want_dx {
            all_reduce_range(backend, sums, 0..2 * c, sync, None)?;
            let count = self.counts.get(stats.start).copied().filter(|&k| k > 0).unwrap_or(m);
            let all = B::view(sums, 0..2 * c);
            backend.norm_backward(Some(dx.view()?), None, dy, x, sv, gamma, all, c, m, count, acc, acc_dx)?;
        }
        Ok(())
    }

    /// An embedding bag of `dim` values a row: the table's gradient, rows a previous step
    /// left in it cleared first (`clear`).
    fn bag_backward<'a>(
        &self,
        sink: &mut Sink<'a, '_, B>,
        table: &Range<usize>,
        dim: usize,
        dy: B::View<'_>,
    ) -> Result<()> {
        let (acc, backend) = (self.accumulate, self.backend);
        let b = self.bag.ok_or_else(|| Error::invalid("embedding bag", "no bags loaded"))?;
        let (Some(rows), Some(off), Some(samples), Some(rw)) = (&b.rows, &b.roff, &b.samples, &b.rw) else {
            return Err(Error::invalid("embedding bag", "no bags loaded"));
        };
        let rw = B::view(rw, 0..b.host.samples.len());
        let count = b.host.rows.len();
        let clear = self.clear;
        let (table_rows, dirty) = (b.table.rows, b.dirty_dev.as_ref());
        sink.unit(table.clone(), |mut t| {
            match clear {
                Some(None) => backend.zero_rows(B::sub(&mut t, 0..table.len()), None, table_rows, dim)?,
                Some(Some(k)) if k > 0 => {
                    let d =
                        dirty.ok_or_else(|| Error::invalid("embedding bag", "dirty rows not uploaded"))?;
                    backend.zero_rows(B::sub(&mut t, 0..table.len()), Some(d), k, dim)?
                }
                _ => {}
            }
            backend.bag_backward(t, dy, rows, off, samples, rw, count, dim, acc)
        })
    }
}
