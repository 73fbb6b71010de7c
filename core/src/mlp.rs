//! The MLP's forward, backward and update, written once over [`Backend`].
//!
//! Layer `l` computes `a_{l+1} = relu(a_l W_l^T + b_l)` (no ReLU after the last layer), then
//! softmax cross-entropy averaged over the batch. Backward walks the layers in reverse and
//! writes each parameter's gradient into the flat gradient buffer; whenever a bucket of
//! [`BucketPlan`] is complete it is handed to the caller, who may start communicating it while
//! backward continues (the DDP overlap).

use std::ops::Range;

use crate::device::Backend;
use crate::error::{Error, Result};
use crate::model::{BucketPlan, Layout, ModelSpec, init_params};
use crate::optim::SgdConfig;

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

/// An MLP living on one device: parameters, gradients, momentum and activations.
pub struct Mlp<B: Backend> {
    backend: B,
    spec: ModelSpec,
    layout: Layout,
    params: B::Buf,
    grads: B::Buf,
    /// Allocated on the first update or momentum write: a strategy that keeps the optimiser
    /// state elsewhere (ZeRO's shards) never pays for a full buffer.
    momentum: Option<B::Buf>,
    /// `acts[0]` is the input batch, `acts[l + 1]` the output of layer `l`.
    acts: Vec<B::Buf>,
    /// `dacts[l]` is the loss gradient with respect to layer `l`'s pre-activation output.
    dacts: Vec<B::Buf>,
    labels: Option<B::Labels>,
    /// Rows the activation buffers can hold; they grow on demand.
    capacity: usize,
    /// Rows of the batch the last forward pass ran over.
    rows: usize,
    /// Rows of the batch last loaded ([`Mlp::load_batch`]).
    loaded: usize,
}

impl<B: Backend> Mlp<B> {
    /// A model of `spec` on `backend`, parameters initialised from `seed`.
    pub fn new(backend: B, spec: ModelSpec, seed: u64) -> Result<Self> {
        let layout = Layout::new(&spec);
        let mut params = backend.zeros(layout.len)?;
        backend.write(&mut params, 0, &init_params(&layout, seed))?;
        let grads = backend.zeros(layout.len)?;
        Ok(Mlp {
            backend,
            spec,
            layout,
            params,
            grads,
            momentum: None,
            acts: Vec::new(),
            dacts: Vec::new(),
            labels: None,
            capacity: 0,
            rows: 0,
            loaded: 0,
        })
    }

    /// The device.
    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// The layer widths.
    pub fn spec(&self) -> &ModelSpec {
        &self.spec
    }

    /// The flat layout.
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    fn ensure_capacity(&mut self, rows: usize) -> Result<()> {
        if rows <= self.capacity {
            return Ok(());
        }
        let w = &self.spec.widths;
        self.acts = w.iter().map(|&n| self.backend.zeros(rows * n)).collect::<Result<_>>()?;
        self.dacts = w[1..].iter().map(|&n| self.backend.zeros(rows * n)).collect::<Result<_>>()?;
        self.capacity = rows;
        Ok(())
    }

    /// Forward pass over `x` (`rows x input`, row-major) with `labels`; when `train` is set the
    /// loss gradient is left ready for [`Mlp::backward`]. [`Mlp::load_batch`], then
    /// [`Mlp::forward_loaded`].
    pub fn forward(&mut self, x: &[f32], labels: &[u32], train: bool) -> Result<BatchLoss> {
        self.load_batch(x, labels)?;
        self.forward_loaded(train)
    }

    /// Copy a batch, `x` (`rows x input`, row-major) and its `labels`, to the device, where the
    /// next forward passes read it.
    pub fn load_batch(&mut self, x: &[f32], labels: &[u32]) -> Result<()> {
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
        self.loaded = rows;
        Ok(())
    }

    /// Forward pass over the batch last loaded ([`Mlp::load_batch`]); when `train` is set the
    /// loss gradient is left ready for [`Mlp::backward`].
    pub fn forward_loaded(&mut self, train: bool) -> Result<BatchLoss> {
        let rows = self.loaded;
        if rows == 0 {
            return Err(Error::invalid("forward", "no batch loaded"));
        }
        self.rows = rows;
        let last = self.layout.layers.len() - 1;
        for (l, lr) in self.layout.layers.iter().enumerate() {
            let (done, rest) = self.acts.split_at_mut(l + 1);
            let a_in = B::view(&done[l], 0..rows * lr.fan_in);
            let w = B::view(&self.params, lr.weight.clone());
            self.backend.gemm(
                rows,
                lr.fan_out,
                lr.fan_in,
                a_in,
                false,
                w,
                true,
                B::view_mut(&mut rest[0], 0..rows * lr.fan_out),
                false,
            )?;
            let b = B::view(&self.params, lr.bias.clone());
            self.backend.bias_act(
                B::view_mut(&mut rest[0], 0..rows * lr.fan_out),
                b,
                rows,
                lr.fan_out,
                l != last,
            )?;
        }
        let cols = self.spec.classes();
        let labels = self.labels.as_ref().ok_or_else(|| Error::invalid("labels", "none uploaded"))?;
        let dlogits = if train { Some(B::view_mut(&mut self.dacts[last], 0..rows * cols)) } else { None };
        let (loss, correct) = self.backend.softmax_xent(
            B::view(&self.acts[last + 1], 0..rows * cols),
            labels,
            dlogits,
            rows,
            cols,
            1.0 / rows as f32,
        )?;
        Ok(BatchLoss { loss: loss / rows as f64, correct, rows })
    }

    /// Backward pass for the batch of the last training [`Mlp::forward`]. Gradients overwrite
    /// the gradient buffer, or add to it when `accumulate`. Each bucket of `plan` is handed to
    /// `on_ready(index, range, view)` as soon as its last gradient is written; the view stays
    /// valid for the whole borrow of `self`, so another thread may reduce it meanwhile.
    pub fn backward<'a>(
        &'a mut self,
        plan: &BucketPlan,
        accumulate: bool,
        on_ready: &mut dyn FnMut(usize, Range<usize>, B::ViewMut<'a>),
    ) -> Result<()> {
        let Mlp { backend, layout, params, grads, acts, dacts, rows, .. } = self;
        let rows = *rows;
        if rows == 0 {
            return Err(Error::invalid("backward", "no forward pass to differentiate"));
        }
        let mut buckets = plan.buckets.iter().cloned().enumerate();
        // The part of the gradient buffer below the open bucket, not yet handed out.
        let mut rest = Some(B::view_mut(grads, 0..layout.len));
        let mut open: Option<(usize, Range<usize>, B::ViewMut<'a>)> = None;
        let mut next_bucket =
            |rest: &mut Option<B::ViewMut<'a>>| -> Result<(usize, Range<usize>, B::ViewMut<'a>)> {
                let (i, r) = buckets
                    .next()
                    .ok_or_else(|| Error::invalid("bucket plan", "does not cover the gradients"))?;
                let whole = rest.take().ok_or_else(|| Error::invalid("bucket plan", "buckets overlap"))?;
                let (below, bucket) = B::split_at(whole, r.start);
                *rest = Some(below);
                Ok((i, r, bucket))
            };
        for l in (0..layout.layers.len()).rev() {
            let lr = &layout.layers[l];
            for (param, is_bias) in [(lr.bias.clone(), true), (lr.weight.clone(), false)] {
                if open.as_ref().is_none_or(|(_, r, _)| param.start < r.start) {
                    open = Some(next_bucket(&mut rest)?);
                }
                let Some((_, br, view)) = open.as_mut() else { unreachable!("a bucket was just opened") };
                if param.end > br.end || param.start < br.start {
                    return Err(Error::invalid("bucket plan", "a bucket splits a parameter tensor"));
                }
                let dz = B::view(&dacts[l], 0..rows * lr.fan_out);
                let target = B::sub(view, param.start - br.start..param.end - br.start);
                if is_bias {
                    backend.bias_grad(target, dz, rows, lr.fan_out, accumulate)?;
                } else {
                    // dW = dZ^T X: (fan_out x rows) * (rows x fan_in).
                    let x = B::view(&acts[l], 0..rows * lr.fan_in);
                    backend.gemm(lr.fan_out, lr.fan_in, rows, dz, true, x, false, target, accumulate)?;
                }
                if param.start == br.start {
                    let (i, r, v) = open.take().unwrap_or_else(|| unreachable!("the bucket is open"));
                    on_ready(i, r, v);
                }
            }
            if l > 0 {
                // dX = dZ W, then through the previous layer's ReLU.
                let (lower, upper) = dacts.split_at_mut(l);
                let dz = B::view(&upper[0], 0..rows * lr.fan_out);
                let w = B::view(params, lr.weight.clone());
                let dx = &mut lower[l - 1];
                backend.gemm(
                    rows,
                    lr.fan_in,
                    lr.fan_out,
                    dz,
                    false,
                    w,
                    false,
                    B::view_mut(dx, 0..rows * lr.fan_in),
                    false,
                )?;
                backend.relu_backward(
                    B::view_mut(dx, 0..rows * lr.fan_in),
                    B::view(&acts[l], 0..rows * lr.fan_in),
                )?;
            }
        }
        Ok(())
    }

    /// One optimiser step from the gradient buffer, scaled by `grad_scale`.
    pub fn update(&mut self, cfg: &SgdConfig, grad_scale: f32) -> Result<()> {
        let n = self.layout.len;
        if self.momentum.is_none() {
            self.momentum = Some(self.backend.zeros(n)?);
        }
        let Mlp { backend, params, grads, momentum: Some(momentum), .. } = self else {
            unreachable!("the momentum was just allocated")
        };
        backend.sgd(
            cfg,
            B::view_mut(params, 0..n),
            B::view(grads, 0..n),
            B::view_mut(momentum, 0..n),
            grad_scale,
        )
    }

    /// Multiply every gradient by `factor`.
    pub fn scale_grads(&mut self, factor: f32) -> Result<()> {
        let n = self.layout.len;
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
        self.backend.write(&mut self.grads, offset, src)
    }

    /// The momentum buffer copied to host memory (checkpoints); zeros, PyTorch's starting
    /// state, while none has been allocated.
    pub fn read_momentum(&self, dst: &mut [f32]) -> Result<()> {
        match &self.momentum {
            Some(m) => self.backend.read(m, 0..self.layout.len, dst),
            None if dst.len() == self.layout.len => {
                dst.fill(0.0);
                Ok(())
            }
            None => Err(Error::Length { what: "momentum", expected: self.layout.len, got: dst.len() }),
        }
    }

    /// Overwrite the momentum buffer (checkpoints), allocating it if needed.
    pub fn write_momentum(&mut self, src: &[f32]) -> Result<()> {
        self.check_range("momentum", 0, src.len())?;
        let m = match &mut self.momentum {
            Some(m) => m,
            None => self.momentum.insert(self.backend.zeros(self.layout.len)?),
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
        self.momentum.as_ref().map_or(0, |_| self.layout.len * size_of::<f32>())
    }

    /// The parameters and gradients as host slices, on a device whose buffers live in host
    /// memory: strategies that update and exchange slices of them in place (ZeRO).
    pub fn host_buffers_mut(&mut self) -> (&mut [f32], &mut [f32])
    where
        B::Buf: AsMut<[f32]>,
    {
        (self.params.as_mut(), self.grads.as_mut())
    }

    /// Exchange the gradient buffer with `other`, which must be as long, on a device whose
    /// buffers are host vectors: lends the gradient out whole without copying it (a push sends
    /// it from where it lies) and takes it back the same way.
    pub fn swap_grads(&mut self, other: &mut Vec<f32>) -> Result<()>
    where
        B: Backend<Buf = Vec<f32>>,
    {
        if other.len() != self.layout.len {
            return Err(Error::Length {
                what: "gradient buffer",
                expected: self.layout.len,
                got: other.len(),
            });
        }
        std::mem::swap(&mut self.grads, other);
        Ok(())
    }

    /// Exclusive access to the device buffers of the parameters and gradients, for collectives
    /// that work on device memory directly (NCCL).
    pub fn buffers_mut(&mut self) -> (&mut B::Buf, &mut B::Buf) {
        (&mut self.params, &mut self.grads)
    }

    fn check_range(&self, what: &'static str, offset: usize, len: usize) -> Result<()> {
        if offset + len > self.layout.len {
            return Err(Error::Length {
                what,
                expected: self.layout.len - offset.min(self.layout.len),
                got: len,
            });
        }
        Ok(())
    }
}
