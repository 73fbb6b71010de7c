//! The parameter server end to end, as real processes on 127.0.0.1: BSP against local
//! training, bad input, faults, resume. The server binary comes from the test kit (see
//! [`server_bin`]); every child is killed when its guard drops. Over 600 lines: every PS
//! scenario here shares the same server and worker fixtures.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use gradsync_core::checkpoint::Checkpoint;
use gradsync_core::model::{Fingerprint, Layout, ModelSpec, init_params};
use gradsync_proto::frames::FramedChunk;
use gradsync_proto::pb::parameter_server_client::ParameterServerClient;
use gradsync_proto::pb::{
    DeregisterRequest, GradientChunk, ParameterChunk, PullRequest, RegisterRequest, ShutdownRequest,
    VersionRequest,
};
use gradsync_proto::tuning::Tuning;
use gradsync_worker::ps::{Gradients, HostGrads, HostSlice, PsClient, PsError, SharedGrads};
use tonic::Code;

mod common;
use common::server_bin;
use gradsync_testkit::Scratch;
use gradsync_testkit::process::{Proc, free_port, start_server};

const WORKER: &str = env!("CARGO_BIN_EXE_gradsync-worker");
const DATA: &str = "synthetic:256:32:8";
const SEED: &str = "7";

/// A running server shard and its address.
struct Server {
    proc: Proc,
    addr: String,
}

impl Server {
    /// Start a shard with `extra` flags and wait for its `listening on` line.
    fn start(extra: &[&str]) -> Server {
        Server::start_on("127.0.0.1:0", extra)
    }

    /// [`Server::start`], listening on `listen`.
    fn start_on(listen: &str, extra: &[&str]) -> Server {
        let mut cmd = Command::new(server_bin());
        cmd.args(["--listen", listen, "--model", "tiny", "--seed", SEED, "--data", DATA])
            .args(extra)
            .stderr(Stdio::inherit());
        let (proc, addr) = start_server(&mut cmd, false);
        Server { proc, addr }
    }

    /// Wait for the process to exit (with a deadline) and return its exit code (none when a
    /// signal ended it).
    fn wait(&mut self, limit: Duration) -> Option<i32> {
        let (code, _, _) = self.proc.finish(limit);
        (code >= 0).then_some(code)
    }

    fn signal(&self, sig: &str) {
        let ok = Command::new("kill").args([sig, &self.proc.id().to_string()]).status().expect("kill");
        assert!(ok.success());
    }
}

/// Run workers to completion (each a process); returns (exit code, stderr) per rank.
fn run_workers(
    world: usize,
    servers: &str,
    batch: usize,
    steps: usize,
    save: &Path,
    extra: &[&str],
) -> Vec<(i32, String)> {
    // The CPU unless `extra` names a device.
    let device: &[&str] = if extra.contains(&"--device") { &[] } else { &["--device", "cpu"] };
    let procs: Vec<_> = (0..world)
        .map(|r| {
            Proc::spawn(
                Command::new(WORKER)
                    .args(["train", "--mode", "ps", "--servers", servers, "--model", "tiny", "--seed", SEED])
                    .args(["--data", DATA, "--threads", "1", "--quiet"])
                    .args(device)
                    .args(["--batch", &batch.to_string(), "--steps", &steps.to_string()])
                    .args([
                        "--rank",
                        &r.to_string(),
                        "--world-size",
                        &world.to_string(),
                        "--rpc-timeout",
                        "30",
                    ])
                    .arg("--save")
                    .arg(save)
                    .args(extra)
                    .stdout(Stdio::null()),
            )
        })
        .collect();
    procs
        .into_iter()
        .map(|mut p| {
            let (code, err, _) = p.finish(Duration::from_secs(120));
            (code, err)
        })
        .collect()
}

/// Local training as the serial reference.
fn run_local(batch: usize, steps: usize, save: &Path, extra: &[&str]) {
    let out = Command::new(WORKER)
        .args(["train", "--mode", "local", "--model", "tiny", "--seed", SEED, "--data", DATA])
        .args(["--device", "cpu", "--threads", "1", "--quiet"])
        .args(["--batch", &batch.to_string(), "--steps", &steps.to_string()])
        .arg("--save")
        .arg(save)
        .args(extra)
        .output()
        .expect("running the local reference");
    assert!(out.status.success(), "local run failed: {}", String::from_utf8_lossy(&out.stderr));
}

fn params(path: &Path) -> Vec<f32> {
    Checkpoint::load(path).unwrap_or_else(|e| panic!("{}: {e}", path.display())).params
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

fn tmp(name: &str) -> Scratch {
    Scratch::new(&format!("ps-{name}"))
}

fn start_shards(k: usize, extra: &[&str]) -> (Vec<Server>, String) {
    let servers: Vec<Server> =
        (0..k).map(|i| Server::start(&[&["--shard", &format!("{i}/{k}")], extra].concat())).collect();
    let addrs = servers.iter().map(|s| s.addr.clone()).collect::<Vec<_>>().join(",");
    (servers, addrs)
}

/// The tiny model fitted to DATA, as the workers build it.
fn spec() -> ModelSpec {
    ModelSpec::parse("tiny").expect("preset").with_io(32, 8)
}

#[test]
fn bsp_matches_local_training_with_the_combined_batch() {
    let dir = tmp("bsp");
    let (b, steps) = (4, 6);
    for w in [1usize, 2, 4] {
        let reference = dir.join(format!("local-{w}.ckpt"));
        run_local(w * b, steps, &reference, &[]);
        let want = params(&reference);
        // The pipelined step, and (with two workers) pushing, then pulling.
        let variants: &[&[&str]] = if w == 2 { &[&[], &["--no-pipeline"]] } else { &[&[]] };
        for (k, extra) in [1usize, 2].into_iter().flat_map(|k| variants.iter().map(move |v| (k, *v))) {
            let (_servers, addrs) = start_shards(k, &["--worker-timeout", "30"]);
            let save = dir.join(format!("ps-{w}-{k}{}.ckpt", extra.concat()));
            for (rank, (code, err)) in run_workers(w, &addrs, b, steps, &save, extra).into_iter().enumerate()
            {
                assert_eq!(code, 0, "W={w} K={k} {extra:?} rank {rank} failed: {err}");
            }
            let got = params(&save);
            let d = max_diff(&got, &want);
            assert!(d < 1e-5, "W={w} K={k} {extra:?}: parameters differ from local batch {} by {d}", w * b);
            assert!(
                max_diff(&got, &init_params(&Layout::new(&spec()), 7)) > 1e-3,
                "W={w} K={k} {extra:?}: nothing trained"
            );
        }
    }
}

/// PS workers on the GPU (gradients copied out of device memory, parameters written back into
/// it) end where local training on the CPU with the combined batch does, to the GPU's
/// rounding: on a real GPU, or against the fake CUDA in a child process whose workers load it.
#[test]
fn bsp_with_gpu_workers_matches_local_training() {
    use gradsync_testkit::{GpuRun, gpu_test_with_env};
    let server = server_bin();
    match gpu_test_with_env(
        "bsp_with_gpu_workers_matches_local_training",
        &[("GRADSYNC_SERVER_BIN", server.as_os_str())],
    ) {
        GpuRun::Here => {}
        GpuRun::Fake(c) => {
            // Two workers trained on the GPU, and left nothing allocated.
            assert!(c.processes >= 2 && c.launches > 0 && c.gemms > 0 && c.alive_at_exit == 0, "{c}");
            return;
        }
        GpuRun::Skipped => return,
    }
    let dir = tmp("bsp-gpu");
    let (w, b, steps) = (2, 4, 6);
    let reference = dir.join("local.ckpt");
    run_local(w * b, steps, &reference, &[]);
    let (_servers, addrs) = start_shards(1, &["--worker-timeout", "30"]);
    let save = dir.join("ps-gpu.ckpt");
    for (rank, (code, err)) in
        run_workers(w, &addrs, b, steps, &save, &["--device", "cuda"]).into_iter().enumerate()
    {
        assert_eq!(code, 0, "GPU worker {rank} failed: {err}");
    }
    let d = max_diff(&params(&save), &params(&reference));
    assert!(d < 1e-4, "PS with GPU workers vs local on the CPU: max diff {d}");
    // On the fake CUDA, whose log the workers append to: each worker's gradient left the device
    // bucket by bucket while backward ran, not in one copy after it.
    if let Some(log) = gradsync_testkit::WorkLog::here() {
        use gradsync_testkit::{CopyKind, Work};
        let is = |w: &Work, name: &str| matches!(w, Work::Kernel(l) if l.kernel == name);
        let me = std::process::id();
        let workers: Vec<_> = log
            .by_process()
            .into_iter()
            .filter(|(pid, w)| *pid != me && w.iter().any(|w| matches!(w, Work::Gemm)))
            .collect();
        assert_eq!(workers.len(), w, "every worker trained on the GPU");
        for (pid, work) in workers {
            // Forward ends with the softmax; a training step's backward follows (evaluation's
            // forwards have none).
            let starts: Vec<usize> = (0..work.len()).filter(|&i| is(&work[i], "softmax_xent")).collect();
            let segments: Vec<&[Work]> = starts
                .iter()
                .enumerate()
                .map(|(i, &s)| &work[s..starts.get(i + 1).copied().unwrap_or(work.len())])
                .filter(|seg| seg.iter().any(|w| is(w, "bias_grad")))
                .collect();
            assert_eq!(segments.len(), steps, "process {pid}: one backward a step");
            for (i, step) in segments.into_iter().enumerate() {
                let bwd = step.iter().position(|w| is(w, "bias_grad")).expect("a backward");
                let last_gemm = step.iter().rposition(|w| matches!(w, Work::Gemm)).expect("GEMMs");
                let early = step[bwd..last_gemm]
                    .iter()
                    .filter(|w| matches!(w, Work::Copy { kind: CopyKind::DtoH, .. }))
                    .count();
                assert!(early >= 1, "process {pid} step {i}: no bucket left the device during backward");
            }
        }
    }
}

/// gradsync's worker frames its pushes and reads its pulls straight from HTTP/2 frames; a
/// server answering through tonic's codec (`--default-transport`) must see the same messages.
#[test]
fn direct_framing_interoperates_with_a_tonic_codec_server() {
    let dir = tmp("interop");
    let (w, k, b, steps) = (2, 2, 4, 4);
    let reference = dir.join("local.ckpt");
    run_local(w * b, steps, &reference, &[]);
    let (_servers, addrs) = start_shards(k, &["--worker-timeout", "30", "--default-transport"]);
    let save = dir.join("ps.ckpt");
    for (rank, (code, err)) in run_workers(w, &addrs, b, steps, &save, &[]).into_iter().enumerate() {
        assert_eq!(code, 0, "rank {rank} failed: {err}");
    }
    let d = max_diff(&params(&save), &params(&reference));
    assert!(d < 1e-5, "parameters differ from local batch {} by {d}", w * b);
}

async fn connect(addr: &str) -> ParameterServerClient<tonic::transport::Channel> {
    let ch = tonic::transport::Endpoint::from_shared(format!("http://{addr}")).expect("uri").connect().await;
    ParameterServerClient::new(ch.expect("connecting")).max_decoding_message_size(64 << 20)
}

fn authed<T>(msg: T, token: &str) -> tonic::Request<T> {
    let mut r = tonic::Request::new(msg);
    r.set_timeout(Duration::from_secs(10));
    r.metadata_mut().insert(gradsync_proto::auth::KEY, gradsync_proto::auth::bearer(token).expect("token"));
    r
}

fn grad_stream(
    rank: u32,
    values: &[f32],
    token: &str,
) -> tonic::Request<impl tonic::codegen::tokio_stream::Stream<Item = GradientChunk> + use<>> {
    let data = gradsync_proto::wire::encode(values, Default::default());
    let chunks: Vec<_> = gradsync_proto::wire::chunks(data.len(), 256)
        .map(|r| GradientChunk {
            rank,
            base_version: 0,
            offset: (r.start / 4) as u64,
            data: data.slice(r),
            ..GradientChunk::default()
        })
        .collect();
    authed(tonic::codegen::tokio_stream::iter(chunks), token)
}

async fn pull_all(c: &mut ParameterServerClient<tonic::transport::Channel>, token: &str) -> (u64, Vec<f32>) {
    let mut s = c
        .pull_parameters(authed(PullRequest { rank: 0, stream_version: None }, token))
        .await
        .expect("pull")
        .into_inner();
    let mut out = Vec::new();
    let mut version = 0;
    while let Some(chunk) = s.message().await.expect("chunk") {
        version = chunk.version;
        out.extend(chunk.data.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])));
    }
    (version, out)
}

#[test]
fn bad_input_is_refused_and_leaves_parameters_unchanged() {
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let dir = tmp("bad");
    let ck = dir.join("s.ckpt");
    let mut server = Server::start(&["--token", "s3cret", "--checkpoint", ck.to_str().expect("utf8")]);
    let mut c = rt.block_on(connect(&server.addr));
    let fp = Fingerprint::new(&spec(), 7).text;
    let init = init_params(&Layout::new(&spec()), 7);
    let n = init.len();
    let reg = |rank: u32, fp: &str| RegisterRequest {
        rank,
        world_size: 2,
        fingerprint: fp.into(),
        ..RegisterRequest::default()
    };
    rt.block_on(async {
        // Token: missing, wrong.
        let e = c.register(tonic::Request::new(reg(0, &fp))).await.expect_err("no token");
        assert_eq!(e.code(), Code::Unauthenticated, "{e:?}");
        let e = c.register(authed(reg(0, &fp), "wrong")).await.expect_err("wrong token");
        assert_eq!(e.code(), Code::Unauthenticated, "{e:?}");
        // Another model.
        let e = c.register(authed(reg(0, "mlp:1-2:f32:seed=7"), "s3cret")).await.expect_err("fingerprint");
        assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
        assert!(e.message().contains("fingerprint"), "{}", e.message());
        // Twice.
        let r = c.register(authed(reg(0, &fp), "s3cret")).await.expect("register").into_inner();
        assert_eq!((r.start, r.end, r.total), (0, n as u64, n as u64));
        let e = c.register(authed(reg(0, &fp), "s3cret")).await.expect_err("twice");
        assert_eq!(e.code(), Code::AlreadyExists, "{e:?}");
        // Wrong length, both ways.
        for len in [n - 1, n + 1] {
            let e = c.push_gradients(grad_stream(0, &vec![0.5; len], "s3cret")).await.expect_err("length");
            assert_eq!(e.code(), Code::InvalidArgument, "{len}: {e:?}");
        }
        // NaN and Inf.
        for bad in [f32::NAN, f32::INFINITY] {
            let mut g = vec![0.5; n];
            g[n / 2] = bad;
            let e = c.push_gradients(grad_stream(0, &g, "s3cret")).await.expect_err("non-finite");
            assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
        }
        // A rank that never registered.
        let e = c.push_gradients(grad_stream(1, &vec![0.5; n], "s3cret")).await.expect_err("unregistered");
        assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
        let v = c.get_version(authed(VersionRequest {}, "s3cret")).await.expect("version").into_inner();
        assert_eq!((v.version, v.rejected_nonfinite, v.live_ranks), (0, 2, vec![0]));
        let (version, now) = pull_all(&mut c, "s3cret").await;
        assert_eq!(version, 0);
        assert_eq!(now, init, "parameters changed after refused pushes");

        // Health needs no token and says SERVING.
        let ch = tonic::transport::Endpoint::from_shared(format!("http://{}", server.addr)).expect("uri");
        let mut h = tonic_health::pb::health_client::HealthClient::new(ch.connect().await.expect("connect"));
        let req = tonic_health::pb::HealthCheckRequest { service: gradsync_proto::SERVICE_NAME.into() };
        let s = h.check(req).await.expect("health").into_inner();
        assert_eq!(s.status, tonic_health::pb::health_check_response::ServingStatus::Serving as i32);

        // Reflection lists the service (what grpcurl asks first).
        use tonic_reflection::pb::v1::ServerReflectionRequest;
        use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
        use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
        use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;
        let mut refl = ServerReflectionClient::new(ch.connect().await.expect("connect"));
        let ask = ServerReflectionRequest {
            host: String::new(),
            message_request: Some(MessageRequest::ListServices(String::new())),
        };
        let mut answers = refl
            .server_reflection_info(tonic::codegen::tokio_stream::iter([ask]))
            .await
            .expect("reflection")
            .into_inner();
        let first = answers.message().await.expect("answer").expect("one answer");
        let Some(MessageResponse::ListServicesResponse(list)) = first.message_response else {
            panic!("unexpected reflection answer {first:?}")
        };
        assert!(list.service.iter().any(|s| s.name == gradsync_proto::SERVICE_NAME), "{list:?}");

        c.shutdown(authed(ShutdownRequest {}, "s3cret")).await.expect("shutdown");
    });
    assert_eq!(server.wait(Duration::from_secs(30)), Some(0), "clean exit after Shutdown");
    let saved = Checkpoint::load(&ck).expect("final checkpoint");
    assert_eq!((saved.header.step, saved.params), (0, init));
}

#[test]
fn token_mismatch_stops_a_worker_with_a_clear_error() {
    let dir = tmp("token");
    let server = Server::start(&["--token", "s3cret"]);
    let save = dir.join("x.ckpt");
    for extra in [&["--token", "nope"][..], &[][..]] {
        let (code, err) = run_workers(1, &server.addr, 4, 2, &save, extra).remove(0);
        assert_ne!(code, 0);
        assert!(err.contains("Unauthenticated"), "{err}");
    }
    // Another seed is another model.
    let out = Command::new(WORKER)
        .args(["train", "--mode", "ps", "--servers", &server.addr, "--token", "s3cret", "--model", "tiny"])
        .args(["--seed", "8", "--data", DATA, "--device", "cpu", "--quiet", "--steps", "2", "--batch", "4"])
        .output()
        .expect("worker");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("FailedPrecondition") && err.contains("fingerprint"), "{err}");
    let (code, err) = run_workers(1, &server.addr, 4, 2, &save, &["--token", "s3cret"]).remove(0);
    assert_eq!(code, 0, "{err}");
}

#[test]
fn a_dead_worker_fails_the_bsp_step_naming_it() {
    let (code, err, _) = dead_rank_1_only_rank0(false);
    assert_ne!(code, 0, "{err}");
    assert!(err.contains("rank(s) [1]"), "{err}");
}

#[test]
fn a_dead_worker_is_dropped_when_elastic() {
    let (code, err, metrics) = dead_rank_1_only_rank0(true);
    assert_eq!(code, 0, "{err}");
    let applies = metrics.lines().filter(|l| l.contains("\"server_apply\"")).count();
    assert_eq!(applies, 3, "{metrics}");
}

/// Like [`dead_rank_1`] but only rank 0 is a process.
fn dead_rank_1_only_rank0(elastic: bool) -> (i32, String, String) {
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let dir = tmp(if elastic { "elastic" } else { "strict" });
    let metrics = dir.join("server.jsonl");
    // Above the workers' 2 s heartbeat interval, which an elastic server requires.
    let mut flags = vec!["--worker-timeout", "2.5", "--metrics", metrics.to_str().expect("utf8")];
    if elastic {
        flags.push("--elastic");
    }
    let server = Server::start(&flags);
    let mut c = rt.block_on(connect(&server.addr));
    let fp = Fingerprint::new(&spec(), 7).text;
    rt.block_on(c.register(authed(
        RegisterRequest { rank: 1, world_size: 2, fingerprint: fp, ..RegisterRequest::default() },
        "x",
    )))
    .expect("rank 1 registers");
    let mut cmd = Command::new(WORKER);
    cmd.args(["train", "--mode", "ps", "--servers", &server.addr, "--model", "tiny", "--seed", SEED])
        .args([
            "--data",
            DATA,
            "--device",
            "cpu",
            "--threads",
            "1",
            "--quiet",
            "--batch",
            "4",
            "--steps",
            "3",
        ])
        .args(["--rank", "0", "--world-size", "2", "--rpc-timeout", "30"])
        .stdout(Stdio::null());
    let (code, err, _) = Proc::spawn(&mut cmd).finish(Duration::from_secs(60));
    drop(server);
    (code, err, std::fs::read_to_string(&metrics).unwrap_or_default())
}

#[test]
fn sigkill_then_resume_continues_from_the_checkpoint() {
    let dir = tmp("resume");
    let ck = dir.join("shard.ckpt");
    let ckf = ck.to_str().expect("utf8");
    let mut server = Server::start(&["--checkpoint", ckf, "--checkpoint-every", "3"]);
    let (code, err) = run_workers(1, &server.addr, 4, 7, &dir.join("a.ckpt"), &[]).remove(0);
    assert_eq!(code, 0, "{err}");
    server.signal("-KILL");
    server.wait(Duration::from_secs(10));
    let saved = Checkpoint::load(&ck).expect("checkpoint");
    assert_eq!(saved.header.step, 6, "the last periodic checkpoint");

    let server = Server::start(&["--checkpoint", ckf, "--resume"]);
    // No steps: the worker pulls and saves exactly what the server resumed with.
    let (code, err) = run_workers(1, &server.addr, 4, 0, &dir.join("pulled.ckpt"), &[]).remove(0);
    assert_eq!(code, 0, "{err}");
    assert_eq!(
        params(&dir.join("pulled.ckpt")),
        saved.params,
        "resumed parameters differ from the checkpoint"
    );
    // Training continues with the checkpointed momentum: the same as local training loaded
    // from the checkpoint.
    let (code, err) = run_workers(1, &server.addr, 4, 4, &dir.join("cont.ckpt"), &[]).remove(0);
    assert_eq!(code, 0, "{err}");
    run_local(4, 4, &dir.join("ref.ckpt"), &["--load", ckf]);
    let d = max_diff(&params(&dir.join("cont.ckpt")), &params(&dir.join("ref.ckpt")));
    assert!(d < 1e-6, "continued training differs from the local reference by {d}");
}

#[test]
fn sigterm_writes_the_final_checkpoint_and_exits_zero() {
    let dir = tmp("term");
    let ck = dir.join("s.ckpt");
    let mut server = Server::start(&["--checkpoint", ck.to_str().expect("utf8"), "--sync", "ssp:1"]);
    let save = dir.join("w.ckpt");
    for (rank, (code, err)) in run_workers(2, &server.addr, 4, 5, &save, &[]).into_iter().enumerate() {
        assert_eq!(code, 0, "rank {rank}: {err}");
    }
    server.signal("-TERM");
    assert_eq!(server.wait(Duration::from_secs(30)), Some(0));
    let saved = Checkpoint::load(&ck).expect("final checkpoint");
    assert_eq!(saved.header.step, 10, "SSP applies each of 2 x 5 gradients");
}

#[test]
fn asp_runs_and_reports_staleness() {
    let dir = tmp("asp");
    let metrics: Vec<PathBuf> = (0..2).map(|i| dir.join(format!("shard{i}.jsonl"))).collect();
    let servers: Vec<Server> = (0..2)
        .map(|i| {
            let m = metrics[i].to_str().expect("utf8");
            Server::start(&["--sync", "asp", "--shard", &format!("{i}/2"), "--metrics", m])
        })
        .collect();
    let addrs = format!("{},{}", servers[0].addr, servers[1].addr);
    for (rank, (code, err)) in run_workers(2, &addrs, 4, 5, &dir.join("w.ckpt"), &[]).into_iter().enumerate()
    {
        assert_eq!(code, 0, "rank {rank}: {err}");
    }
    drop(servers);
    for m in &metrics {
        let text = std::fs::read_to_string(m).expect("metrics");
        let applies: Vec<gradsync_core::metrics::ServerApply> = text
            .lines()
            .filter_map(|l| match gradsync_core::metrics::parse_line(l) {
                Ok(gradsync_core::metrics::Record::ServerApply(a)) => Some(a),
                _ => None,
            })
            .collect();
        assert_eq!(applies.len(), 10, "each shard applies all 2 x 5 gradients one by one: {text}");
        assert!(applies.iter().all(|a| a.gradients == 1 && a.staleness.len() == 1));
        assert_eq!(applies.last().map(|a| a.version), Some(10));
        // Each update says how long its push took to arrive, so that the workers' phase (pushing
        // together or taking turns) can be read from the server's records.
        assert!(applies.iter().all(|a| a.receive_ms.is_some_and(|r| r >= 0.0 && r < a.wall_ms)), "{text}");
    }
}

/// A request with the token and a deadline long enough for a whole step.
fn authed_long<T>(msg: T, token: &str) -> tonic::Request<T> {
    let mut r = authed(msg, token);
    r.set_timeout(Duration::from_secs(60));
    r
}

/// Register ranks 0 and 1 of 2 and open a pull of version 1, streamed as it is produced.
async fn two_ranks_and_a_streamed_pull(
    addr: &str,
    fp: &str,
    token: &str,
) -> (ParameterServerClient<tonic::transport::Channel>, tonic::Streaming<ParameterChunk>) {
    let mut c = connect(addr).await;
    for rank in 0..2 {
        let req =
            RegisterRequest { rank, world_size: 2, fingerprint: fp.into(), ..RegisterRequest::default() };
        c.register(authed(req, token)).await.expect("register");
    }
    let req = PullRequest { rank: 0, stream_version: Some(1) };
    let pull = c.pull_parameters(authed_long(req, token)).await.expect("streamed pull").into_inner();
    (c, pull)
}

/// A gradient's values, different per rank.
fn rank_grad(rank: usize, n: usize) -> Vec<f32> {
    (0..n).map(|i| ((i * 7 + rank * 13) % 101) as f32 * 0.01 - 0.5).collect()
}

/// Pipelined BSP: the blocks of the next version stream to a pull while the gradients are
/// still arriving. A NaN in the LAST block of one worker's push then ends that pull with an
/// error and leaves the parameters, the momentum and the version as they were; a good
/// gradient then completes the step, which equals the serial update (rank-order sum, one
/// `sgd_step`) of the good gradients bit for bit.
#[test]
fn nan_in_the_last_block_fails_the_streamed_pull_and_commits_nothing() {
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let dir = tmp("pipenan");
    let ck = dir.join("s.ckpt");
    let mut server = Server::start(&[
        "--token",
        "s3cret",
        "--checkpoint",
        ck.to_str().expect("utf8"),
        "--chunk-bytes",
        "4096",
        "--worker-timeout",
        "60",
        "--lr",
        "0.1",
        "--momentum",
        "0.9",
        "--weight-decay",
        "0.01",
    ]);
    let fp = Fingerprint::new(&spec(), 7).text;
    let init = init_params(&Layout::new(&spec()), 7);
    let n = init.len();
    let (block, token) = (1024, "s3cret");
    let blocks = n.div_ceil(block);
    assert!(blocks >= 3, "the test needs several blocks");
    let (g0, g1) = (rank_grad(0, n), rank_grad(1, n));
    rt.block_on(async {
        let (mut c, mut pull) = two_ranks_and_a_streamed_pull(&server.addr, &fp, token).await;
        // Rank 0 pushes everything; its reply waits for the step.
        let push0 = tokio::spawn({
            let mut c = c.clone();
            let g0 = g0.clone();
            async move {
                let mut req = grad_stream(0, &g0, token);
                req.set_timeout(Duration::from_secs(60));
                c.push_gradients(req).await
            }
        });
        // Rank 1 sends every block but the last, in the server's block size.
        let (tx, rx) = tokio::sync::mpsc::channel(64);
        let push1 = tokio::spawn({
            let mut c = c.clone();
            async move {
                let s = tonic::codegen::tokio_stream::wrappers::ReceiverStream::new(rx);
                c.push_gradients(authed_long(s, token)).await
            }
        });
        let piece = |from: usize, values: &[f32]| GradientChunk {
            rank: 1,
            base_version: 0,
            offset: from as u64,
            data: gradsync_proto::wire::encode(values, Default::default()),
            ..GradientChunk::default()
        };
        let last = (blocks - 1) * block;
        for b in 0..blocks - 1 {
            tx.send(piece(b * block, &g1[b * block..(b + 1) * block])).await.expect("send");
        }
        // Those blocks are stepped and streamed before the step can complete.
        for b in 0..blocks - 1 {
            let m = pull.message().await.expect("a block of version 1").expect("not the end");
            assert_eq!((m.version, m.offset), (1, (b * block) as u64));
        }
        let mut bad = g1[last..].to_vec();
        *bad.last_mut().expect("values") = f32::NAN;
        tx.send(piece(last, &bad)).await.expect("send");
        drop(tx);
        let e = push1.await.expect("task").expect_err("a NaN is refused");
        assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
        let e = pull.message().await.expect_err("the streamed pull ends with an error");
        assert_eq!(e.code(), Code::Aborted, "{e:?}");
        let v = c.get_version(authed(VersionRequest {}, token)).await.expect("version").into_inner();
        assert_eq!((v.version, v.rejected_nonfinite), (0, 1));
        assert_eq!(pull_all(&mut c, token).await, (0, init.clone()), "parameters changed");

        // A good gradient from rank 1 completes the step.
        let mut req = grad_stream(1, &g1, token);
        req.set_timeout(Duration::from_secs(60));
        let r1 = c.push_gradients(req).await.expect("rank 1's good push").into_inner();
        let r0 = push0.await.expect("task").expect("rank 0's push").into_inner();
        assert_eq!((r0.version, r1.version), (1, 1));
        c.shutdown(authed(ShutdownRequest {}, token)).await.expect("shutdown");
    });
    assert_eq!(server.wait(Duration::from_secs(30)), Some(0), "clean exit after Shutdown");
    let cfg = gradsync_core::optim::SgdConfig { lr: 0.1, momentum: 0.9, weight_decay: 0.01 };
    let (mut want_p, mut want_m) = (init, vec![0.0; n]);
    let sum: Vec<f32> = g0.iter().zip(&g1).map(|(a, b)| a + b).collect();
    gradsync_core::optim::sgd_step(&cfg, &mut want_p, &sum, &mut want_m, 0.5);
    let saved = Checkpoint::load(&ck).expect("final checkpoint");
    assert_eq!(saved.header.step, 1);
    assert_eq!(saved.params, want_p, "parameters: not the serial update of the good gradients");
    assert_eq!(saved.momentum, Some(want_m), "momentum: not the serial update of the good gradients");
}

/// A step that fails (strict: a rank missed the barrier) ends a pull streaming its version
/// with the step's error, and leaves the version and parameters as they were. Against a
/// server answering through tonic's generated service (`--default-transport`), so both of the
/// server's pull paths stream.
#[test]
fn a_failed_step_ends_the_streamed_pull_with_its_error() {
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let server = Server::start(&["--token", "s3cret", "--worker-timeout", "2", "--default-transport"]);
    let fp = Fingerprint::new(&spec(), 7).text;
    let init = init_params(&Layout::new(&spec()), 7);
    let token = "s3cret";
    rt.block_on(async {
        let (mut c, mut pull) = two_ranks_and_a_streamed_pull(&server.addr, &fp, token).await;
        let mut req = grad_stream(0, &rank_grad(0, init.len()), token);
        req.set_timeout(Duration::from_secs(60));
        let e = c.push_gradients(req).await.expect_err("rank 1 never pushes");
        assert_eq!(e.code(), Code::Aborted, "{e:?}");
        assert!(e.message().contains("[1]"), "names rank 1: {}", e.message());
        let e = pull.message().await.expect_err("the streamed pull ends with the step's error");
        assert_eq!(e.code(), Code::Aborted, "{e:?}");
        assert!(e.message().contains("[1]"), "names rank 1: {}", e.message());
        let v = c.get_version(authed(VersionRequest {}, token)).await.expect("version").into_inner();
        assert_eq!(v.version, 0);
        assert_eq!(pull_all(&mut c, token).await, (0, init.clone()), "parameters changed");
        // A version beyond the next is refused.
        let req = PullRequest { rank: 0, stream_version: Some(5) };
        let e = c.pull_parameters(authed(req, token)).await.expect_err("too far ahead");
        assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
        // A streamed pull whose step every worker leaves ends with an error, not a hang.
        let req = PullRequest { rank: 0, stream_version: Some(1) };
        let mut pull = c.pull_parameters(authed_long(req, token)).await.expect("streamed pull").into_inner();
        for rank in 0..2 {
            c.deregister(authed(DeregisterRequest { rank }, token)).await.expect("deregister");
        }
        let e = pull.message().await.expect_err("the step is abandoned");
        assert_eq!(e.code(), Code::Aborted, "{e:?}");
        assert!(e.message().contains("every worker left"), "{}", e.message());
    });
}

/// Workers push in the chunks each shard announces (its `--chunk-bytes`, or by default a size
/// chosen from its range), unless told a size of their own.
#[test]
fn workers_push_in_the_chunks_each_shard_announces() {
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let servers =
        [Server::start(&["--shard", "0/2", "--chunk-bytes", "1024"]), Server::start(&["--shard", "1/2"])];
    let addrs: Vec<String> = servers.iter().map(|s| s.addr.clone()).collect();
    let n = Layout::new(&spec()).len;
    let fp = Fingerprint::new(&spec(), SEED.parse().expect("seed")).text;
    let connect = |rank: usize, own: Option<usize>| {
        let addrs = addrs.clone();
        let fp = fp.clone();
        async move {
            let mut c = PsClient::connect(&addrs, None, Duration::from_secs(30), Tuning::tuned()).await?;
            c.set_chunk_bytes(own);
            c.register(rank, 2, &fp, n).await?;
            anyhow::Ok(c)
        }
    };
    let mut a = rt.block_on(connect(0, None)).expect("worker 0");
    let second = Tuning::chunk_for_shard((n - n / 2) * 4);
    assert_eq!(a.chunk_bytes(), vec![1024, second]);
    let mut b = rt.block_on(connect(1, Some(512))).expect("worker 1");
    assert_eq!(b.chunk_bytes(), vec![512, 512]);
    // Pieces of either size make the same step.
    let (ga, gb) = (vec![0.25f32; n], vec![0.75f32; n]);
    let (mut pa, mut pb) = (vec![0f32; n], vec![0f32; n]);
    rt.block_on(async { tokio::try_join!(a.step(&ga, &mut pa), b.step(&gb, &mut pb)) }).expect("a step");
    assert_eq!(pa, pb);
}

/// Pushes lent the gradient's memory (`SharedGrads`, no copy into the messages) reach the
/// servers bit for bit: two shards, many chunks each, two steps with the buffer overwritten
/// in between (right after the first step returns), the first pipelined, the second pushed
/// then pulled; the pulled parameters are the serial update of exactly those gradients. With
/// gradsync's framing on both ends, against a server decoding through tonic's codec, and from
/// a client encoding through tonic's codec.
#[test]
fn lent_gradients_reach_the_servers_bit_for_bit() {
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let n = Layout::new(&spec()).len;
    let fp = Fingerprint::new(&spec(), SEED.parse().expect("seed")).text;
    let cfg = gradsync_core::optim::SgdConfig { lr: 0.1, momentum: 0.9, weight_decay: 0.01 };
    let optimiser = ["--lr", "0.1", "--momentum", "0.9", "--weight-decay", "0.01"];
    let (g1, g2) = (rank_grad(0, n), rank_grad(1, n));
    // The serial reference: two SGD steps over the whole buffer.
    let (mut want1, mut momentum) = (init_params(&Layout::new(&spec()), 7), vec![0.0; n]);
    gradsync_core::optim::sgd_step(&cfg, &mut want1, &g1, &mut momentum, 1.0);
    let mut want2 = want1.clone();
    gradsync_core::optim::sgd_step(&cfg, &mut want2, &g2, &mut momentum, 1.0);
    for (tuning, server_flag) in [
        (Tuning::tuned(), None),
        (Tuning::tuned(), Some("--default-transport")),
        (Tuning::tonic_codec(), None),
    ] {
        let what = format!("{} client, server {server_flag:?}", tuning.name);
        let extra: Vec<&str> =
            optimiser.iter().copied().chain(["--chunk-bytes", "1024"]).chain(server_flag).collect();
        let (_servers, addrs) = start_shards(2, &extra);
        let addrs: Vec<String> = addrs.split(',').map(String::from).collect();
        let mut c =
            rt.block_on(PsClient::connect(&addrs, None, Duration::from_secs(30), tuning)).expect("connect");
        rt.block_on(c.register(0, 1, &fp, n)).expect("register");
        assert!(c.chunk_bytes().iter().all(|&b| b == 1024), "{what}: many chunks per shard");
        let mut g = SharedGrads::new(g1.clone());
        let mut params = vec![0f32; n];
        rt.block_on(c.exchange_into(&g, &mut params)).expect("step 1");
        assert_eq!(params, want1, "{what}: step 1 is not the serial update of the gradient sent");
        // Overwritten as soon as the step returns: the next step's gradient.
        g.make_mut().copy_from_slice(&g2);
        rt.block_on(async {
            c.push_from(&g).await?;
            c.pull(&mut params).await
        })
        .expect("step 2");
        assert_eq!(params, want2, "{what}: step 2 is not the serial update of the gradient sent");
        // A buffer of another length is refused before anything is sent.
        let short = SharedGrads::new(vec![0.0; n - 1]);
        let e = rt.block_on(c.push_from(&short)).expect_err("a short gradient");
        assert!(format!("{e:#}").contains(&format!("{} values for a model of {n}", n - 1)), "{e:#}");
        eprintln!("{what}: the buffer was copied {} times", g.copies());
    }
}

/// A device whose gradient copy-out fails from value `fail_from` on (a lost GPU, say).
struct FailingGrads {
    grads: Vec<f32>,
    fail_from: usize,
}

impl Gradients for FailingGrads {
    fn chunk(&self, head: &GradientChunk, values: std::ops::Range<usize>) -> Result<FramedChunk, PsError> {
        if values.start >= self.fail_from {
            let msg = format!("device lost at value {}", values.start);
            return Err(gradsync_core::Error::Cuda { op: "cuMemcpyDtoH", msg }.into());
        }
        HostGrads(&self.grads).chunk(head, values)
    }
}

#[test]
fn a_push_that_fails_midway_is_not_taken_and_returns_at_once() {
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    // A long barrier: were the streamed pull awaited after the failed push, the exchange would
    // take that long.
    let server = Server::start(&["--worker-timeout", "60"]);
    let n = Layout::new(&spec()).len;
    let fp = Fingerprint::new(&spec(), SEED.parse().expect("seed")).text;
    let mut c = rt
        .block_on(PsClient::connect(
            std::slice::from_ref(&server.addr),
            None,
            Duration::from_secs(30),
            Tuning::tuned(),
        ))
        .expect("connect");
    // Small chunks, so the model is many messages and the failure falls in the middle.
    c.set_chunk_bytes(Some(256));
    rt.block_on(c.register(0, 1, &fp, n)).expect("register");
    let mut before = vec![0f32; n];
    rt.block_on(c.pull(&mut before)).expect("pull");

    let bad = FailingGrads { grads: vec![0.5; n], fail_from: n / 2 };
    let mut params = before.clone();
    let t = Instant::now();
    let err = rt.block_on(c.exchange(&bad, vec![HostSlice(&mut params)])).expect_err("the push must fail");
    assert!(t.elapsed() < Duration::from_secs(20), "the failed exchange waited {:?}", t.elapsed());
    assert!(format!("{err:#}").contains("device lost"), "{err:#}");
    assert_eq!(params, before, "nothing was pulled into the parameters");

    // Nothing of it was taken: still version 0, the same parameters; a whole gradient then
    // makes version 1.
    let mut now = vec![0f32; n];
    rt.block_on(c.pull(&mut now)).expect("pull");
    assert_eq!(now, before, "a short push changed the parameters");
    let good = vec![0.5f32; n];
    rt.block_on(c.step(&good, &mut now)).expect("a whole push after the failed one");
    assert_ne!(now, before, "the good step changed nothing");
    let mut raw = rt.block_on(connect(&server.addr));
    let v =
        rt.block_on(raw.get_version(tonic::Request::new(VersionRequest {}))).expect("version").into_inner();
    assert_eq!(v.version, 1, "only the whole push made a version");
}

#[test]
fn the_servers_optimiser_is_the_one_recorded_and_a_contradicting_flag_is_refused() {
    let dir = tmp("optimiser");
    let server =
        Server::start(&["--lr", "0.02", "--momentum", "0.5", "--sync", "asp", "--staleness-lr", "inverse"]);
    let save = dir.join("x.ckpt");
    // A flag that contradicts the server: an error naming both values, nothing trained.
    let (code, err) = run_workers(1, &server.addr, 4, 2, &save, &["--lr", "0.5"]).remove(0);
    assert_ne!(code, 0);
    assert!(err.contains("--lr 0.5") && err.contains("--lr 0.02"), "{err}");
    // The same value, or none: the metrics header records what the server applies.
    for (tag, extra) in [("same", &["--lr", "0.02"][..]), ("none", &[][..])] {
        let m = dir.join(format!("{tag}.jsonl"));
        let flags = [extra, &["--metrics", m.to_str().expect("utf8")][..]].concat();
        let (code, err) = run_workers(1, &server.addr, 4, 2, &save, &flags).remove(0);
        assert_eq!(code, 0, "{tag}: {err}");
        let header: serde_json::Value = serde_json::from_str(
            std::fs::read_to_string(&m).expect("metrics").lines().next().expect("header"),
        )
        .expect("json");
        assert_eq!(header["lr"].as_f64().map(|v| v as f32), Some(0.02), "{tag}: {header}");
        assert_eq!(header["momentum"].as_f64().map(|v| v as f32), Some(0.5), "{tag}: {header}");
        assert_eq!(header["extra"]["staleness_lr"], "inverse", "{tag}: {header}");
    }
}

/// A PS worker of one rank training 2 steps against `addr`, with `extra` flags; its stderr
/// comes line by line through the receiver.
fn ps_worker(addr: &str, extra: &[&str]) -> Proc {
    Proc::spawn(
        Command::new(WORKER)
            .args([
                "train",
                "--mode",
                "ps",
                "--servers",
                addr,
                "--model",
                "tiny",
                "--seed",
                SEED,
                "--data",
                DATA,
            ])
            .args(["--device", "cpu", "--threads", "1", "--quiet", "--batch", "4", "--steps", "2"])
            .args(["--rank", "0", "--world-size", "1", "--rpc-timeout", "30"])
            .args(extra)
            .stdout(Stdio::null()),
    )
}

/// A worker started before its server says what it waits for, and trains once the server
/// is up.
#[test]
fn a_worker_started_before_its_server_waits_for_it() {
    // Built before the worker starts waiting (a build can take longer than the wait).
    server_bin();
    let addr = format!("127.0.0.1:{}", free_port());
    let mut worker = ps_worker(&addr, &["--connect-timeout", "60"]);
    worker.wait_line(&format!("waiting for the parameter server at {addr}"), Duration::from_secs(60));
    let _server = Server::start_on(&addr, &[]);
    let (code, err, _) = worker.finish(Duration::from_secs(120));
    assert_eq!(code, 0, "the worker failed once its server was up: {err}");
}

/// A worker whose server never comes gives up at --connect-timeout, saying where it waited.
#[test]
fn a_worker_gives_up_on_a_server_that_never_comes() {
    let addr = format!("127.0.0.1:{}", free_port());
    let (code, err, _) = ps_worker(&addr, &["--connect-timeout", "1"]).finish(Duration::from_secs(30));
    assert_ne!(code, 0);
    let want = format!("no parameter server answered at {addr} within --connect-timeout 1 s");
    assert!(err.contains(&want), "{err}");
}

/// A server that died under a call is not taken for one that serves TLS; a TLS server asked
/// in plaintext still is.
#[test]
fn only_a_failure_that_looks_like_tls_suggests_tls_ca() {
    use std::io::Read;
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let connect = |addr: String| async move {
        let mut c = PsClient::connect(&[addr], None, Duration::from_secs(10), Tuning::tuned()).await?;
        c.sync_mode().await?;
        anyhow::Ok(c)
    };
    // A server that dies once the client's first call is on the wire: it takes the client's
    // two connections, reads the first until a request's HEADERS frame arrives, then is gone.
    let fake = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = fake.local_addr().expect("addr").to_string();
    let dies = std::thread::spawn(move || {
        let (mut rpc, _) = fake.accept().expect("accept");
        let _pull = fake.accept().expect("accept");
        let (mut wire, mut buf) = (Vec::new(), [0u8; 4096]);
        loop {
            match rpc.read(&mut buf) {
                Ok(0) | Err(_) => return,
                Ok(n) => wire.extend_from_slice(&buf[..n]),
            }
            // After the 24-byte preface, frames: 3 bytes of length, then the type.
            let mut at = 24;
            while at + 9 <= wire.len() {
                if wire[at + 3] == 1 {
                    return;
                }
                at += 9 + u32::from_be_bytes([0, wire[at], wire[at + 1], wire[at + 2]]) as usize;
            }
        }
    });
    let dead = rt.block_on(connect(addr)).map(|_| ()).expect_err("a dead server answered");
    dies.join().expect("the dying server");
    let dead = format!("{dead:#}");
    assert!(dead.contains("GetVersion at"), "it did not die under the call: {dead}");

    let dir = tmp("tls-hint");
    let ck = rcgen::generate_simple_self_signed(vec!["localhost".into()]).expect("rcgen");
    let (cert, key) = (dir.join("s.crt"), dir.join("s.key"));
    std::fs::write(&cert, ck.cert.pem()).expect("write cert");
    std::fs::write(&key, ck.key_pair.serialize_pem()).expect("write key");
    let tls = Server::start(&[
        "--tls-cert",
        cert.to_str().expect("utf8"),
        "--tls-key",
        key.to_str().expect("utf8"),
    ]);
    let plain = rt.block_on(connect(tls.addr.clone())).map(|_| ()).expect_err("plaintext served over TLS");
    let plain = format!("{plain:#}");
    assert!(!dead.contains("--tls-ca"), "{dead}");
    assert!(plain.contains("--tls-ca"), "{plain}");
}

/// A self-signed certificate for `localhost` in `dir`: (cert path, key path), the cert also
/// the CA a worker trusts.
fn self_signed(dir: &Path) -> (PathBuf, PathBuf) {
    let ck = rcgen::generate_simple_self_signed(vec!["localhost".into()]).expect("rcgen");
    let (cert, key) = (dir.join("s.crt"), dir.join("s.key"));
    std::fs::write(&cert, ck.cert.pem()).expect("write cert");
    std::fs::write(&key, ck.key_pair.serialize_pem()).expect("write key");
    (cert, key)
}

/// A worker that passed `--tls-ca` and reached a TLS server with the wrong token is told its
/// token is wrong, never to pass the `--tls-ca` it already passed; in process, the refusal is
/// the token's variant.
#[test]
fn a_tls_worker_with_a_wrong_token_is_told_the_token_is_wrong() {
    let dir = tmp("tls-token");
    let (cert, key) = self_signed(&dir);
    let (cert_s, key_s) = (cert.to_str().expect("utf8"), key.to_str().expect("utf8"));
    let server = Server::start(&["--tls-cert", cert_s, "--tls-key", key_s, "--token", "s3cret"]);
    let tls = ["--tls-ca", cert_s, "--tls-domain", "localhost"];
    let (code, err, _) =
        ps_worker(&server.addr, &[&tls[..], &["--token", "nope"]].concat()).finish(Duration::from_secs(60));
    assert_ne!(code, 0, "a wrong token was served: {err}");
    assert!(err.contains("Unauthenticated") && err.contains("wrong token"), "{err}");
    assert!(!err.contains("pass --tls-ca"), "told to pass the --tls-ca it passed: {err}");

    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let refused = rt.block_on(async {
        let tls = gradsync_proto::tls::client(&cert, Some("localhost")).expect("CA");
        let addrs = std::slice::from_ref(&server.addr);
        let mut c =
            PsClient::connect_tls(addrs, Some("nope"), Duration::from_secs(10), Tuning::tuned(), Some(tls))
                .await
                .expect("a TLS connection to a TLS server");
        c.sync_mode().await.expect_err("a wrong token was served")
    });
    assert!(matches!(refused, PsError::Unauthenticated { .. }), "{refused:?}");
    // With the right token the same worker trains.
    let (code, err, _) =
        ps_worker(&server.addr, &[&tls[..], &["--token", "s3cret"]].concat()).finish(Duration::from_secs(60));
    assert_eq!(code, 0, "{err}");
}

/// A worker that passed `--tls-ca` and reached a plaintext server is told at once that the
/// server does not serve TLS: not to pass `--tls-ca`, and not that nobody answered after
/// waiting `--connect-timeout` for a server that was up all along.
#[test]
fn a_tls_worker_at_a_plaintext_server_is_told_so_at_once() {
    let dir = tmp("tls-plain");
    let (cert, _) = self_signed(&dir);
    let server = Server::start(&[]);
    let t = Instant::now();
    let flags = ["--tls-ca", cert.to_str().expect("utf8"), "--tls-domain", "localhost"];
    let (code, err, _) = ps_worker(&server.addr, &[&flags[..], &["--connect-timeout", "60"]].concat())
        .finish(Duration::from_secs(120));
    assert_ne!(code, 0, "a TLS worker trained against a plaintext server: {err}");
    assert!(t.elapsed() < Duration::from_secs(30), "it waited {:?} for a server that was up", t.elapsed());
    assert!(err.contains("does not seem to serve TLS"), "{err}");
    assert!(!err.contains("pass --tls-ca") && !err.contains("no parameter server answered"), "{err}");
}

/// Each step's pushed and pulled bytes in a worker's metrics file.
fn step_bytes(metrics: &Path) -> Vec<(u64, u64)> {
    let text = std::fs::read_to_string(metrics).unwrap_or_else(|e| panic!("{}: {e}", metrics.display()));
    text.lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["kind"] == "step")
        .map(|v| {
            (v["bytes_sent"].as_u64().expect("bytes_sent"), v["bytes_recv"].as_u64().expect("bytes_recv"))
        })
        .collect()
}

/// `--compress` end to end (2 workers, 2 shards, real processes): top-k at ratio 1 sends every
/// value and ends at f32's parameters bit for bit; fp16 and bf16 (pushes and pulls) end within
/// their rounding of them; each moves the bytes its codec says.
#[test]
fn compressed_pushes_match_f32_within_their_rounding() {
    let dir = tmp("compress");
    let (w, b, steps) = (2, 4, 6);
    let n = Layout::new(&spec()).len as u64;
    let run = |c: &str| -> (Vec<f32>, Vec<(u64, u64)>) {
        let (_servers, addrs) = start_shards(2, &["--worker-timeout", "30", "--compress", c]);
        let save = dir.join(format!("{c}.ckpt"));
        let metrics = dir.join(format!("{c}-{{rank}}.jsonl"));
        let extra = ["--compress", c, "--metrics", metrics.to_str().expect("utf8")];
        for (rank, (code, err)) in run_workers(w, &addrs, b, steps, &save, &extra).into_iter().enumerate() {
            assert_eq!(code, 0, "--compress {c}: rank {rank} failed: {err}");
        }
        (params(&save), step_bytes(&dir.join(format!("{c}-0.jsonl"))))
    };
    let (none, none_bytes) = run("none");
    assert_eq!(none_bytes, vec![(4 * n, 4 * n); steps]);
    let (all, all_bytes) = run("topk:1");
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&all), bits(&none), "top-k at ratio 1 differs from f32");
    assert_eq!(all_bytes, vec![(8 * n, 4 * n); steps]);
    // Half precision rounds each gradient value by at most 2^-11 (fp16) or 2^-8 (bf16) of
    // itself. With lr 0.05 and momentum 0.9, one gradient moves a parameter by at most
    // 0.05 x (1 + 0.9 + ... + 0.9^5) < 0.24 x |g| within six steps, so six gradients of
    // magnitude below 1 move it by less than 1.4, and their rounding by less than
    // 1.4 x 2^-11 = 7e-4 (fp16) or 1.4 x 2^-8 = 5.5e-3 (bf16). The pulls carry the parameters
    // rounded too, by at most max|p| x 2^-11 (2^-8). The bounds leave room (x2) for the
    // changed parameters' own effect on later gradients; the rounding must show (a codec that
    // sent f32 would end at exactly f32's parameters).
    let top = none.iter().fold(0f32, |m, p| m.max(p.abs()));
    for (c, ulp) in [("fp16", 2f32.powi(-11)), ("bf16", 2f32.powi(-8))] {
        let bound = 2.0 * (1.4 + top) * ulp;
        let (got, bytes) = run(c);
        let d = max_diff(&got, &none);
        assert!(d > 0.0 && d < bound, "--compress {c}: max diff from f32 {d} (bound {bound})");
        assert_eq!(bytes, vec![(2 * n, 2 * n); steps], "--compress {c}: pushes and pulls in half precision");
    }
    let (sparse, bytes) = run("topk:0.01");
    let k = (0.01 * n as f64).ceil() as u64;
    assert_eq!(bytes, vec![(8 * k, 4 * n); steps], "top-k 1% pushes k = {k} pairs of 8 bytes, pulls f32");
    assert!(max_diff(&sparse, &init_params(&Layout::new(&spec()), 7)) > 0.0, "top-k 1% changed nothing");
}

/// Under `--compress fp16` a parameter past fp16's range (here moved there by one step: a
/// gradient of -60000 at learning rate 2) fails the pull, streamed and plain alike, with a
/// status naming the parameter, the range and bf16; never an infinity in the pulled values.
#[test]
fn a_parameter_past_fp16s_range_fails_the_pull_naming_it() {
    use gradsync_core::compress::Half;
    use gradsync_proto::pb::Encoding;
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let flags = ["--compress", "fp16", "--lr", "2", "--momentum", "0", "--weight-decay", "0"];
    let server = Server::start(&flags);
    let n = Layout::new(&spec()).len;
    let fp = Fingerprint::new(&spec(), SEED.parse().expect("seed")).text;
    rt.block_on(async {
        let mut c = connect(&server.addr).await;
        let reg = RegisterRequest {
            rank: 0,
            world_size: 1,
            fingerprint: fp,
            compression: "fp16".into(),
            ..RegisterRequest::default()
        };
        c.register(reg).await.expect("register");
        let mut streamed = c.clone();
        let pull = tokio::spawn(async move {
            let req = PullRequest { rank: 0, stream_version: Some(1) };
            let mut s = streamed.pull_parameters(req).await?.into_inner();
            while s.message().await?.is_some() {}
            Ok::<(), tonic::Status>(())
        });
        let mut data = vec![0u8; 2 * n];
        Half::F16.encode(&vec![-60_000.0f32; n], &mut data).expect("encode");
        let chunk = GradientChunk {
            rank: 0,
            base_version: 0,
            offset: 0,
            data: data.into(),
            encoding: Encoding::F16.into(),
            ..GradientChunk::default()
        };
        let pushed = c.push_gradients(tokio_stream::iter(vec![chunk])).await.expect("the push is taken");
        assert_eq!(pushed.into_inner().version, 1);
        let says = |s: &tonic::Status| {
            assert_eq!(s.code(), Code::OutOfRange, "{s:?}");
            let m = s.message();
            assert!(m.contains("version 1: parameter 0 of the flat buffer is 1200"), "{m}");
            assert!(
                m.contains("beyond fp16's range (largest 65504)") && m.contains("--compress bf16"),
                "{m}"
            );
        };
        says(&pull.await.expect("pull task").expect_err("a streamed pull carried an overflowing parameter"));
        let plain = async {
            let mut s = c.pull_parameters(PullRequest { rank: 0, stream_version: None }).await?.into_inner();
            while s.message().await?.is_some() {}
            Ok::<(), tonic::Status>(())
        };
        says(&plain.await.expect_err("a plain pull carried an overflowing parameter"));
    });
}

/// A server with `--compress topk:0.5` refuses a worker that announces another codec, and every
/// malformed push (an index out of range, a repeated index, unequal lengths, a span past the
/// range, another encoding) with a status naming the fault, the parameters unchanged; then
/// takes a well-formed sparse push.
#[test]
fn malformed_compressed_pushes_are_refused_with_the_fault_named() {
    use gradsync_proto::pb::Encoding;
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    // No weight decay: a step then moves only the values a gradient holds.
    let server = Server::start(&[
        "--token",
        "t",
        "--compress",
        "topk:0.5",
        "--worker-timeout",
        "30",
        "--weight-decay",
        "0",
    ]);
    let mut c = rt.block_on(connect(&server.addr));
    let fp = Fingerprint::new(&spec(), 7).text;
    let init = init_params(&Layout::new(&spec()), 7);
    let n = init.len();
    let reg = |compression: &str| RegisterRequest {
        rank: 0,
        world_size: 1,
        fingerprint: fp.clone(),
        compression: compression.into(),
        ..RegisterRequest::default()
    };
    let le = |v: &[u32]| v.iter().flat_map(|i| i.to_le_bytes()).collect::<Vec<u8>>();
    let sparse = |indices: &[u32], values: &[f32], span: u64| {
        let chunk = GradientChunk {
            rank: 0,
            base_version: 0,
            offset: 0,
            data: gradsync_proto::wire::encode(values, Default::default()),
            encoding: Encoding::Sparse.into(),
            indices: le(indices).into(),
            span,
        };
        authed(tonic::codegen::tokio_stream::iter(vec![chunk]), "t")
    };
    rt.block_on(async {
        for (announced, says) in [("fp16", "--compress fp16"), ("", "--compress none"), ("zip", "'zip'")] {
            let e = c.register(authed(reg(announced), "t")).await.expect_err(announced);
            assert!(
                e.message().contains(says) && e.message().contains("registration refused"),
                "{announced}: {e:?}"
            );
        }
        c.register(authed(reg("topk:0.5"), "t")).await.expect("register");
        let last = n as u32 - 1;
        for (what, push, says) in [
            ("index out of range", sparse(&[0, n as u32], &[1.0, 1.0], n as u64), "outside the chunk's span"),
            ("repeated index", sparse(&[3, 3], &[1.0, 1.0], n as u64), "strictly ascend"),
            ("unequal lengths", sparse(&[1, 2], &[1.0], n as u64), "2 indices but 1 values"),
            ("span past the range", sparse(&[last], &[1.0], n as u64 + 1), "past the range"),
            ("short span", sparse(&[1], &[1.0], 10), "values, the range holds"),
        ] {
            let e = c.push_gradients(push).await.expect_err(what);
            assert_eq!(e.code(), Code::InvalidArgument, "{what}: {e:?}");
            assert!(e.message().contains(says), "{what}: {}", e.message());
        }
        let e = c.push_gradients(grad_stream(0, &vec![0.5; n], "t")).await.expect_err("f32 push");
        assert!(
            e.message().contains("ENCODING_F32") && e.message().contains("--compress topk:0.5"),
            "{}",
            e.message()
        );
        let (version, now) = pull_all(&mut c, "t").await;
        assert_eq!((version, &now), (0, &init), "parameters changed after refused pushes");
        let r = c.push_gradients(sparse(&[0, last], &[0.5, -0.5], n as u64)).await.expect("a good push");
        assert_eq!(r.into_inner().version, 1);
        let (_, after) = pull_all(&mut c, "t").await;
        let moved: Vec<usize> = (0..n).filter(|&i| after[i] != init[i]).collect();
        assert_eq!(moved, [0, n - 1], "only the two values pushed moved");
    });
}

/// A worker whose own parameters are the shards' (drawn from the same seed) starts from them:
/// each registration reply carries the digest of its shard at the version it names, and the
/// first pull moves nothing. A worker that registers once the shards have moved on (an ASP
/// push applied) pulls them, and its engine ends with the servers' values. A registration
/// reply's digest is that of the values a pull then returns.
#[test]
fn a_worker_starts_from_the_values_it_holds_and_pulls_the_shards_that_moved() {
    use gradsync_core::Engine;
    use gradsync_core::device::Device;
    use gradsync_proto::wire::Digest;
    use gradsync_worker::ps::EngineLink;
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let (_servers, addrs) = start_shards(2, &["--sync", "asp"]);
    let addrs: Vec<String> = addrs.split(',').map(String::from).collect();
    let seed = SEED.parse().expect("seed");
    let n = Layout::new(&spec()).len;
    let fp = Fingerprint::new(&spec(), seed).text;
    let init = init_params(&Layout::new(&spec()), seed);
    let worker = |rank: usize| {
        let mut engine = Engine::new(Device::Cpu { threads: 1 }, spec(), seed).expect("engine");
        let link = EngineLink::new(&mut engine);
        let mut c = rt
            .block_on(PsClient::connect(&addrs, None, Duration::from_secs(30), Tuning::tuned()))
            .expect("connect");
        rt.block_on(c.register(rank, 2, &fp, n)).expect("register");
        (engine, link, c)
    };
    let (mut e0, mut l0, mut c0) = worker(0);
    let t = rt.block_on(l0.pull_unless_held(&mut c0, &mut e0)).expect("start of rank 0");
    assert_eq!(t.bytes, 0, "rank 0 pulled values it held");
    assert_eq!(e0.params().expect("params"), init);
    // Rank 0's push moves both shards on (ASP applies it at once).
    let mut after = vec![0f32; n];
    rt.block_on(c0.step(&vec![0.5; n], &mut after)).expect("a step");
    assert_ne!(after, init);
    let (mut e1, mut l1, mut c1) = worker(1);
    let t = rt.block_on(l1.pull_unless_held(&mut c1, &mut e1)).expect("start of rank 1");
    assert_eq!(t.bytes, 4 * n as u64, "rank 1 did not pull the shards that moved");
    assert_eq!(e1.params().expect("params"), after);
    // The digests rank 1's registration gave are those of the values it then pulled.
    let held = c1.held(|r| Ok(Digest::of(&after[r]))).expect("held");
    assert_eq!(held, [true, true], "the registration digests are not those of the values pulled");
}
