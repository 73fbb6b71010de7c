//! DataParallel: one process, N replicas (threads on the CPU; one per visible GPU, several per
//! GPU allowed). Each step scatters the global batch, every replica computes its gradient in
//! parallel, replica 0 gathers and sums them, takes the optimiser step alone, and broadcasts
//! the parameters back: `torch.nn.DataParallel`'s semantics, master bottleneck included,
//! which is what this mode exists to measure. Batch norms normalise each replica's share of the
//! batch, and replica 0's running statistics are the model's (copied to the others each step).

use std::time::Instant;

use gradsync_core::Engine;
use gradsync_core::device::Device;
use gradsync_core::metrics::Step;
use gradsync_core::model::ModelSpec;
use gradsync_core::net::BatchLoss;
use gradsync_core::optim::SgdConfig;

use gradsync_core::trace::Trace;

use super::{Batch, Result, Shape, Strategy, StrategyError, backward, forward, ms_since, timed};
use crate::collective::reduce::add_into;
use crate::resume::{Resume, Resumed};

/// What DP needs to know.
#[derive(Debug, Clone)]
pub struct DpConfig {
    /// Replicas in the process.
    pub replicas: usize,
    /// Replica 0's device; the others take the next GPUs round-robin (the same CPU).
    pub device: Device,
    /// The model.
    pub spec: ModelSpec,
    /// The initialisation seed.
    pub seed: u64,
    /// The optimiser replica 0 applies.
    pub sgd: SgdConfig,
    /// The replica to delay before each step's forward pass, and by how much.
    pub slow: Option<(usize, std::time::Duration)>,
    /// An injected fault, if any.
    pub fault: Option<ReplicaFault>,
    /// Timeline recorder (`--trace`).
    pub trace: Trace,
}

/// How an injected replica fault shows (`--fail-replica`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultKind {
    /// The replica's thread panics.
    Panic,
    /// The replica's forward pass returns an error, as a failing device's would.
    Error,
}

/// `--fail-replica K:N:KIND`: which replica fails, in which step, and how.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReplicaFault {
    /// The failing replica.
    pub replica: usize,
    /// The step (1-based) it fails in.
    pub step: u64,
    /// Panic or error.
    pub kind: FaultKind,
}

/// Replica 0 is the engine the training loop owns; these are the others.
pub struct Dp {
    sgd: SgdConfig,
    replicas: usize,
    devices: Vec<Device>,
    spec: ModelSpec,
    seed: u64,
    others: Vec<Engine>,
    sum: Vec<f32>,
    tmp: Vec<f32>,
    params: Vec<f32>,
    /// `--slow-rank`: the replica to delay and its delay.
    slow: Option<(usize, std::time::Duration)>,
    /// `--fail-replica`: the injected fault, if any.
    fault: Option<ReplicaFault>,
    /// Steps begun so far (the fault fires in one of them).
    steps: u64,
    /// Timeline recorder: replica 0's compute spans.
    trace: Trace,
}

impl Dp {
    /// `cfg.replicas` replicas of the model.
    pub fn new(cfg: DpConfig) -> Result<Dp> {
        let replicas = cfg.replicas;
        if replicas < 1 {
            return Err(StrategyError::Config("--replicas must be at least 1".into()));
        }
        if let Some(f) = cfg.fault
            && f.replica >= replicas
        {
            return Err(StrategyError::Config(format!(
                "--fail-replica: replica {} is not below the {replicas} replicas",
                f.replica
            )));
        }
        let devices = cfg.device.spread(replicas);
        Ok(Dp {
            sgd: cfg.sgd,
            replicas,
            devices,
            spec: cfg.spec,
            seed: cfg.seed,
            others: Vec::new(),
            sum: Vec::new(),
            tmp: Vec::new(),
            params: Vec::new(),
            slow: cfg.slow,
            fault: cfg.fault,
            steps: 0,
            trace: cfg.trace,
        })
    }
}

/// A replica thread's panic as an error carrying the panic's message.
fn panicked(payload: Box<dyn std::any::Any + Send>) -> StrategyError {
    let msg = payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "(no message)".into());
    StrategyError::Panicked(msg)
}

impl Strategy for Dp {
    fn shape(&self) -> Shape {
        // One process scatters each global batch over its replicas.
        Shape { processes: 1, rank: 0, replicas: self.replicas }
    }

    fn start(&mut self, engine: &mut Engine, resume: &Resume) -> Result<Option<Resumed>> {
        // Replica 0's state (resumed) is every replica's.
        let resumed = resume.engine(engine)?;
        let p = engine.params()?;
        self.others = self.devices[1..]
            .iter()
            .enumerate()
            .map(|(k, &d)| -> Result<Engine> {
                let mut e = Engine::new(d, self.spec.clone(), self.seed).map_err(|source| {
                    StrategyError::ReplicaEngine { replica: k + 1, device: d.label(), source }
                })?;
                e.write_params(0, &p)?;
                // Each replica paces its own thread's compute under `--dilate`.
                e.set_dilation(engine.dilation());
                Ok(e)
            })
            .collect::<Result<_>>()?;
        let n = p.len();
        self.sum = vec![0.0; n];
        self.tmp = vec![0.0; n];
        Ok(resumed)
    }

    fn step(&mut self, engine: &mut Engine, batch: &mut Batch<'_>, rec: &mut Step) -> Result<BatchLoss> {
        let (x, y) = (batch.x, batch.y);
        let n = self.replicas;
        if !y.len().is_multiple_of(n) {
            return Err(StrategyError::Split { rows: y.len(), replicas: n });
        }
        let (rows, dim) = (y.len() / n, x.len() / y.len().max(1));
        // Scatter: replica k takes rows k*rows..(k+1)*rows and runs forward and backward on
        // its own thread.
        self.steps += 1;
        let fault = self.fault.filter(|f| f.step == self.steps);
        let results: Vec<Result<(BatchLoss, f64, f64)>> = std::thread::scope(|s| {
            let slow = self.slow;
            let trace = &self.trace;
            let work = move |e: &mut Engine, k: usize| -> Result<(BatchLoss, f64, f64)> {
                if let Some((r, d)) = slow
                    && r == k
                {
                    std::thread::sleep(d);
                }
                match fault {
                    Some(f) if f.replica == k && f.kind == FaultKind::Panic => {
                        panic!("injected fault (--fail-replica {k}:{}:panic)", f.step)
                    }
                    Some(f) if f.replica == k => {
                        return Err(StrategyError::Injected { replica: k, step: f.step });
                    }
                    _ => {}
                }
                let (xs, ys) = (&x[k * rows * dim..(k + 1) * rows * dim], &y[k * rows..(k + 1) * rows]);
                // Replica 0 records its spans; the others run the same work beside it.
                let off = Trace::disabled();
                let trace = if k == 0 { trace } else { &off };
                let mut rec = Step::default();
                let loss = forward(e, xs, ys, &mut rec, trace)?;
                backward(e, false, &mut rec, trace)?;
                Ok((loss, rec.forward_ms, rec.backward_ms))
            };
            let handles: Vec<_> =
                self.others.iter_mut().enumerate().map(|(i, e)| s.spawn(move || work(e, i + 1))).collect();
            // Replica 0 runs on this thread: a panic there is caught too, so that every replica's
            // failure ends the step the same way (an error naming it) once all are joined.
            let mine = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| work(engine, 0)));
            let mut out = vec![mine.unwrap_or_else(|p| Err(panicked(p)))];
            out.extend(handles.into_iter().map(|h| h.join().unwrap_or_else(|p| Err(panicked(p)))));
            out
        });
        let mut total = BatchLoss::default();
        let mut weighted = 0.0;
        for (k, r) in results.into_iter().enumerate() {
            let (l, f, b) = r.map_err(|e| StrategyError::Replica { replica: k, source: Box::new(e) })?;
            rec.forward_ms = rec.forward_ms.max(f);
            rec.backward_ms = rec.backward_ms.max(b);
            weighted += l.loss * l.rows as f64;
            total.correct += l.correct;
            total.rows += l.rows;
        }
        total.loss = weighted / total.rows.max(1) as f64;
        // The other replicas' paced phases count with replica 0's (which the loop reads).
        for e in &mut self.others {
            let pace = e.take_pace();
            if pace.phases > 0 {
                rec.count_pace(pace);
            }
        }

        // Gather and sum on replica 0.
        let t = Instant::now();
        let len = self.sum.len();
        engine.read_grads(0..len, &mut self.sum)?;
        for e in &self.others {
            e.read_grads(0..len, &mut self.tmp)?;
            add_into(&mut self.sum, &self.tmp);
        }
        engine.write_grads(0, &self.sum)?;
        let gather_ms = ms_since(t);
        let ((), ms) = timed(engine, |e| e.update(&self.sgd, 1.0 / n as f32))?;
        rec.update_ms = ms;
        // Broadcast the new parameters back to every replica, and replica 0's batch-norm
        // statistics: as DataParallel's replicas are copies of the module on device 0, whose
        // buffer updates alone persist.
        let t = Instant::now();
        self.params.resize(len, 0.0);
        engine.read_params(0..len, &mut self.params)?;
        let buffers = engine.buffers()?;
        for e in &mut self.others {
            e.write_params(0, &self.params)?;
            e.write_buffers(&buffers)?;
        }
        rec.comm_ms = gather_ms + ms_since(t);
        // Replica 0 waits for all of it: nothing overlaps.
        rec.comm_exposed_ms = rec.comm_ms;
        let bytes = (n as u64 - 1) * len as u64 * 4;
        rec.bytes_recv = bytes;
        rec.bytes_sent = bytes;
        Ok(total)
    }

    fn finish(&mut self, _engine: &mut Engine) -> Result<()> {
        self.others.clear();
        Ok(())
    }

    fn describe(&self) -> (String, serde_json::Map<String, serde_json::Value>) {
        let mut m = serde_json::Map::new();
        m.insert("replicas".into(), self.replicas.into());
        m.insert(
            "replica_devices".into(),
            self.devices.iter().map(|d| serde_json::Value::from(d.label())).collect::<Vec<_>>().into(),
        );
        (String::new(), m)
    }
}
