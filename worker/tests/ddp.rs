//! DDP, ZeRO-1 and DP against local training, as real processes: W ranks with batch b (DDP, started
//! by `gradsync-worker launch` over 127.0.0.1, TCP backend, on sockets or on the shared-memory
//! transport) and W replicas with batch b (DP)
//! must end at the parameters of one process with batch W*b, because the distributed sampler
//! gives the union of the ranks' k-th batches as local's k-th batch. Also the launcher's
//! contract: rank-prefixed output, and one failing rank stops the rest.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use gradsync_core::checkpoint::Checkpoint;
use gradsync_testkit::process::Proc;
use gradsync_testkit::{Counters, GpuRun, Scratch, gpu_test};

const WORKER: &str = env!("CARGO_BIN_EXE_gradsync-worker");

/// A worker process, killed if the test ends early.
fn spawn(args: &[&str]) -> Proc {
    Proc::adopt(
        gradsync_testkit::process::isolated(WORKER)
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    )
}

fn run_ok(args: &[&str]) -> Output {
    gradsync_testkit::process::run_ok(WORKER, args, Duration::from_secs(120))
}

/// Flags every run shares: the tiny model on a small synthetic set, a few steps.
fn common(save: &Path) -> Vec<String> {
    [
        "--model",
        "tiny",
        "--data",
        "synthetic:600:32:8",
        "--device",
        "cpu",
        "--threads",
        "1",
        "--steps",
        "6",
        "--eval-every",
        "0",
        "--lr",
        "0.1",
        "--quiet",
        "--save",
    ]
    .iter()
    .map(|s| s.to_string())
    .chain([save.display().to_string()])
    .collect()
}

fn params(p: &Path) -> Vec<f32> {
    Checkpoint::load(p).unwrap().params
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

fn check_equivalence(world: usize, batch: usize, transport: &str, hierarchy: &str) {
    let dir = Scratch::new(&format!("equiv{world}{transport}{hierarchy}"));
    let local = dir.join("local.ckpt");
    let dp = dir.join("dp.ckpt");
    let ddp = dir.join("ddp.ckpt");
    let w = world.to_string();
    let global = (world * batch).to_string();
    let b = batch.to_string();

    let mut a = vec!["train".to_string(), "--mode".into(), "local".into(), "--batch".into(), global];
    a.extend(common(&local));
    run_ok(&a.iter().map(String::as_str).collect::<Vec<_>>());

    let mut a: Vec<String> =
        ["train", "--mode", "dp", "--replicas", &w, "--batch", &b].map(String::from).to_vec();
    a.extend(common(&dp));
    run_ok(&a.iter().map(String::as_str).collect::<Vec<_>>());

    // Small buckets, so several all-reduces overlap backward.
    let mut a = launch_train(&w, "ddp", &["--batch", &b]);
    a.extend(["--bucket-mb", "0.002", "--comm-timeout", "30", "--chunk-kb", "1"].map(String::from));
    a.extend(["--transport", transport, "--hierarchy", hierarchy, "--metrics"].map(String::from));
    a.push(dir.join("m-{rank}.jsonl").display().to_string());
    a.extend(common(&ddp));
    run_ok(&a.iter().map(String::as_str).collect::<Vec<_>>());
    // The ring really ran on the transport asked for: the metrics header says which.
    for r in 0..world {
        let text = std::fs::read_to_string(dir.join(format!("m-{r}.jsonl"))).unwrap();
        let header: serde_json::Value = serde_json::from_str(text.lines().next().unwrap()).unwrap();
        assert_eq!(header["extra"]["transport"], transport, "rank {r}: {header}");
        // One host: the flat ring unless the hierarchy is forced on.
        let (path, hosts) =
            if hierarchy == "on" { ("hierarchical", 1.into()) } else { ("ring", serde_json::Value::Null) };
        assert_eq!(header["extra"]["all_reduce"], path, "rank {r}: {header}");
        assert_eq!(header["extra"]["hosts"], hosts, "rank {r}: {header}");
        // DDP holds the whole momentum on every rank (ZeRO-1 holds 1/n: `check_zero1`).
        assert_eq!(header["extra"]["optimizer_state_bytes"], 4456 * 4, "rank {r}: {header}");
    }

    let (l, p, d) = (params(&local), params(&dp), params(&ddp));
    assert_ne!(
        l,
        gradsync_core::model::init_params(
            &gradsync_core::model::Layout::new(&gradsync_core::model::ModelSpec::parse("tiny").unwrap()),
            42
        ),
        "local did not train"
    );
    assert!(max_diff(&l, &p) < 1e-5, "DP vs local: max diff {}", max_diff(&l, &p));
    assert!(max_diff(&l, &d) < 1e-5, "DDP vs local: max diff {}", max_diff(&l, &d));
}

#[test]
fn ddp_and_dp_match_local_with_two_ranks() {
    check_equivalence(2, 8, "tcp", "auto");
}

#[test]
fn ddp_and_dp_match_local_with_three_ranks() {
    check_equivalence(3, 5, "tcp", "auto");
}

#[test]
fn ddp_over_shared_memory_matches_local_with_three_ranks() {
    check_equivalence(3, 5, "shm", "auto");
}

#[test]
fn ddp_through_the_hosts_matches_local_with_three_ranks() {
    // --hierarchy on with one host: every bucket reduced into rank 0 and broadcast back over
    // the host's shared-memory ring, the header saying so.
    check_equivalence(3, 5, "shm", "on");
}

/// Augmentation draws each sample's crop and flip from the seed, the epoch and the sample
/// alone: DDP's ranks augment their shards as local training augments the whole batch, so the
/// two still end at the same parameters (an MLP on the digits' 8x8 images, crop-flip with one
/// pixel of padding), and differently from training without it.
#[test]
fn augmented_ddp_matches_augmented_local_training() {
    let dir = Scratch::new("augment");
    let run = |mode: &[&str], augment: &str, name: &str| {
        let save = dir.join(name);
        let mut a: Vec<String> = mode.iter().map(|s| s.to_string()).collect();
        a.extend(
            [
                "--model",
                "64-32-10",
                "--data",
                "digits",
                "--augment",
                augment,
                "--device",
                "cpu",
                "--threads",
                "1",
            ]
            .map(String::from),
        );
        a.extend(["--steps", "8", "--eval-every", "0", "--lr", "0.1", "--quiet", "--save"].map(String::from));
        a.push(save.display().to_string());
        run_ok(&a.iter().map(String::as_str).collect::<Vec<_>>());
        params(&save)
    };
    let local = run(&["train", "--batch", "32"], "crop-flip:1", "local.ckpt");
    let plain = run(&["train", "--batch", "32"], "none", "plain.ckpt");
    let ddp_args = launch_train(2, "ddp", &["--batch", "16", "--comm-timeout", "30"]);
    let ddp = run(&ddp_args.iter().map(String::as_str).collect::<Vec<_>>(), "crop-flip:1", "ddp.ckpt");
    assert!(max_diff(&local, &plain) > 1e-4, "augmentation changed nothing");
    assert!(max_diff(&local, &ddp) < 1e-5, "augmented DDP vs local: max diff {}", max_diff(&local, &ddp));
}

/// The communicators a synchronised batch norm (`--sync-bn`) is checked over.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SyncBnOver {
    /// Two ranks, the flat ring on loopback sockets.
    Tcp,
    /// Two ranks, the flat ring on shared memory.
    Shm,
    /// Two emulated hosts of two ranks each (two launchers, `--host-id`): the hierarchical
    /// all-reduce, shared memory inside each host and loopback sockets between its leaders.
    Hosts,
    /// Two NCCL ranks, one GPU each (the fake CUDA's four, here), as threads of this process.
    Nccl,
}

/// How far a tensor trained with `--sync-bn` may end from local training's with the global
/// batch: its largest difference over local's largest value. Both sum the same values in
/// another order (each rank's batch norm sums its part, the communicator adds the parts; the
/// gradient's mean is a sum of the ranks' means), so they agree to f32 rounding carried
/// through 8 steps; without `--sync-bn` they part by more than 1e-2.
const SYNC_BN_TOLERANCE: f32 = 1e-5;

/// SyncBatchNorm over `over`: with `--sync-bn` every rank's batch norms normalise with the
/// statistics of all ranks' batches together, and backward's sums go with the gradient buckets
/// over the same communicator, so DDP (buckets overlapped with backward, and not) and ZeRO-1
/// end where one process with the combined batch of 32 does (on the same device): every
/// parameter and running statistic of cnn8 after 8 steps on the digits, within
/// [`SYNC_BN_TOLERANCE`]. The metrics header says the run went over the communicator asked
/// for. Without `--sync-bn` each rank normalises with its own part of the batch, and ends
/// elsewhere.
fn sync_bn_matches_local_training(over: SyncBnOver) {
    use gradsync_core::state_dict::Tensors;
    let dir = Scratch::new(&format!("sync-bn-{over:?}"));
    let device = if over == SyncBnOver::Nccl { "cuda" } else { "cpu" };
    let train_flags = |name: &str| -> Vec<String> {
        let mut a: Vec<String> =
            ["--model", "cnn8", "--data", "digits", "--device", device, "--threads", "1"]
                .map(String::from)
                .to_vec();
        a.extend(
            ["--steps", "8", "--eval-every", "0", "--lr", "0.05", "--quiet", "--save"].map(String::from),
        );
        a.push(dir.join(name).display().to_string());
        a
    };
    let load = |name: &str| gradsync_core::state_dict::load(&dir.join(name)).unwrap();
    let mut a: Vec<String> = ["train", "--batch", "32"].map(String::from).to_vec();
    a.extend(train_flags("local.safetensors"));
    run_strings(&a);
    let local = load("local.safetensors");
    // The largest difference of any tensor from local's, absolute and relative to local's
    // largest value, and its name (the step counter left out).
    let worst = |b: &Tensors| {
        let (mut abs, mut rel, mut at) = (0.0f32, 0.0f32, String::new());
        for (k, v) in local.iter().filter(|(k, _)| !k.ends_with("num_batches_tracked")) {
            let (x, y) = (v.to_f32(), b[k].to_f32());
            let scale = x.iter().fold(1e-6f32, |m, v| m.max(v.abs()));
            let d = max_diff(&x, &y);
            abs = abs.max(d);
            if d / scale > rel {
                (rel, at) = (d / scale, k.clone());
            }
        }
        (abs, rel, at)
    };
    let world = if over == SyncBnOver::Hosts { 4 } else { 2 };
    let batch = (32 / world).to_string();
    let run = |mode: &str, extra: &[&str], name: &str| -> Tensors {
        let metrics = dir.join(format!("{name}-{{rank}}.jsonl"));
        let mut rest: Vec<String> =
            ["--batch", &batch, "--comm-timeout", "30", "--metrics"].map(String::from).to_vec();
        rest.push(metrics.display().to_string());
        rest.extend(extra.iter().map(|x| x.to_string()));
        // What the metrics header must say ran: the variant, and the TCP backend's transport,
        // all-reduce and hosts.
        let (variant, transport, all_reduce, hosts) = match over {
            SyncBnOver::Tcp => ("tcp", "tcp", "ring", serde_json::Value::Null),
            SyncBnOver::Shm => ("tcp", "shm", "ring", serde_json::Value::Null),
            SyncBnOver::Hosts => ("tcp", "shm", "hierarchical", 2.into()),
            SyncBnOver::Nccl => ("nccl", "", "", serde_json::Value::Null),
        };
        let file = format!("{name}.safetensors");
        match over {
            SyncBnOver::Tcp | SyncBnOver::Shm => {
                rest.extend(["--transport", transport, "--hierarchy", "off"].map(String::from));
                rest.extend(train_flags(&file));
                let mut a = launch_train(world, mode, &[]);
                a.extend(rest);
                run_strings(&a);
            }
            SyncBnOver::Hosts => {
                rest.extend(["--transport", "auto", "--hierarchy", "auto"].map(String::from));
                rest.extend(train_flags(&file));
                on_two_hosts(mode, &rest);
            }
            SyncBnOver::Nccl => {
                rest.extend(["--backend", "nccl"].map(String::from));
                rest.extend(train_flags(&file));
                ranks_as_threads(world, mode, &rest);
            }
        }
        for r in 0..world {
            let text = std::fs::read_to_string(dir.join(format!("{name}-{r}.jsonl"))).unwrap();
            let header: serde_json::Value = serde_json::from_str(text.lines().next().unwrap()).unwrap();
            assert_eq!(header["extra"]["sync_bn"], extra.contains(&"--sync-bn"), "rank {r}: {header}");
            assert_eq!(header["variant"], variant, "rank {r}: {header}");
            if over == SyncBnOver::Nccl {
                continue;
            }
            assert_eq!(header["extra"]["transport"], transport, "rank {r}: {header}");
            assert_eq!(header["extra"]["all_reduce"], all_reduce, "rank {r}: {header}");
            assert_eq!(header["extra"]["hosts"], hosts, "rank {r}: {header}");
        }
        load(&file)
    };
    for (mode, extra, name) in [
        ("ddp", &["--sync-bn"][..], "ddp"),
        ("ddp", &["--sync-bn", "--no-overlap"][..], "ddp-after"),
        ("zero1", &["--sync-bn"][..], "zero1"),
    ] {
        let (abs, rel, at) = worst(&run(mode, extra, name));
        eprintln!(
            "--sync-bn over {over:?}, {mode} {extra:?}: max abs diff {abs:.2e}, worst {at} {rel:.2e} of its largest"
        );
        assert!(rel < SYNC_BN_TOLERANCE, "{over:?}: {mode} {extra:?} vs local: {at} differs by {rel:.2e}");
    }
    let (abs, rel, at) = worst(&run("ddp", &[], "plain"));
    eprintln!("without --sync-bn over {over:?}: max abs diff {abs:.2e}, worst {at} {rel:.2e} of its largest");
    assert!(
        rel > 1e-2,
        "{over:?}: without --sync-bn DDP should normalise per rank, but only {at} differs, by {rel:.2e}"
    );
}

#[test]
fn sync_bn_over_sockets_matches_local_training() {
    sync_bn_matches_local_training(SyncBnOver::Tcp);
}

#[test]
fn sync_bn_over_shared_memory_matches_local_training() {
    sync_bn_matches_local_training(SyncBnOver::Shm);
}

#[test]
fn sync_bn_through_two_hosts_matches_local_training() {
    sync_bn_matches_local_training(SyncBnOver::Hosts);
}

#[test]
fn sync_bn_over_nccl_matches_local_training() {
    let test = "sync_bn_over_nccl_matches_local_training";
    let reduced = |c: &Counters| {
        assert!(c.launches > 0 && c.collectives > 0 && c.alive_at_exit == 0, "{c}");
    };
    if !gpu_here(test, reduced) {
        return;
    }
    let gpus = (0..8).take_while(|&i| gradsync_core::device::cuda::probe(i).is_ok()).count();
    if gpus < 2 {
        eprintln!("SKIPPED (two NCCL ranks need two GPUs; this machine has {gpus}) [{test}]");
        return;
    }
    sync_bn_matches_local_training(SyncBnOver::Nccl);
}

/// `train --mode MODE` with `rest` on two emulated hosts of two ranks: two launchers (`--nnodes
/// 2`, their ranks meeting at a store on a port picked here), each telling its ranks their host
/// (`--host-id`).
fn on_two_hosts(mode: &str, rest: &[String]) {
    let port = gradsync_testkit::process::free_port().to_string();
    let mut nodes: Vec<Proc> = (0..2)
        .map(|node| {
            let (n, host) = (node.to_string(), format!("host{node}"));
            let mut a: Vec<&str> =
                vec!["launch", "--nnodes", "2", "--node-rank", &n, "--nproc-per-node", "2"];
            a.extend(["--master-addr", "127.0.0.1", "--master-port", &port, "--", "train", "--mode", mode]);
            a.extend(rest.iter().map(String::as_str));
            a.extend(["--host-id", &host]);
            spawn(&a)
        })
        .collect();
    for (node, p) in nodes.iter_mut().enumerate() {
        let out = p.output(Duration::from_secs(120));
        assert!(
            out.status.success(),
            "node {node}: {}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

#[test]
fn ddp_metrics_report_communication() {
    let dir = Scratch::new("metrics");
    let m = dir.join("m-{rank}.jsonl");
    let save = dir.join("s.ckpt");
    let mut a: Vec<String> =
        ["launch", "--nproc-per-node", "2", "--master-port", "0", "--", "train", "--mode", "ddp"]
            .map(String::from)
            .to_vec();
    a.extend(["--batch", "8", "--bucket-mb", "0.002", "--metrics"].map(String::from));
    a.push(m.display().to_string());
    a.extend(common(&save));
    run_ok(&a.iter().map(String::as_str).collect::<Vec<_>>());
    let text = std::fs::read_to_string(dir.join("m-1.jsonl")).unwrap();
    assert!(dir.join("m-0.jsonl").exists());
    let steps: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .filter(|v: &serde_json::Value| v["kind"] == "step")
        .collect();
    assert_eq!(steps.len(), 6);
    let params = 4456u64;
    for s in &steps {
        assert!(s["comm_ms"].as_f64().unwrap() > 0.0, "{s}");
        let exposed = s["comm_exposed_ms"].as_f64().unwrap();
        assert!(exposed >= 0.0, "{s}");
        // Two ranks: each sends and receives half the gradient twice, i.e. all of it.
        assert_eq!(s["bytes_sent"].as_u64().unwrap(), params * 4, "{s}");
        assert_eq!(s["bytes_recv"].as_u64().unwrap(), params * 4, "{s}");
    }
}

#[test]
fn sync_every_communicates_only_on_sync_steps() {
    let dir = Scratch::new("nosync");
    let save = dir.join("s.ckpt");
    let mut a: Vec<String> =
        ["launch", "--nproc-per-node", "2", "--master-port", "0", "--", "train", "--mode", "ddp"]
            .map(String::from)
            .to_vec();
    a.extend(["--batch", "8", "--sync-every", "3", "--metrics"].map(String::from));
    a.push(dir.join("m-{rank}.jsonl").display().to_string());
    a.extend(common(&save));
    run_ok(&a.iter().map(String::as_str).collect::<Vec<_>>());
    let text = std::fs::read_to_string(dir.join("m-0.jsonl")).unwrap();
    let sent: Vec<u64> = text
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|v| v["kind"] == "step")
        .map(|v| v["bytes_sent"].as_u64().unwrap())
        .collect();
    assert_eq!(sent.len(), 6);
    for (i, b) in sent.iter().enumerate() {
        assert_eq!(*b > 0, (i + 1) % 3 == 0, "step {}: {b} bytes sent", i + 1);
    }
    // Accumulated steps still train: the saved parameters are finite.
    let p0 = params(&save);
    assert!(p0.iter().all(|v| v.is_finite()));
}

#[test]
fn launcher_prefixes_output_and_stops_everyone_when_one_fails() {
    let out = run_ok(&[
        "launch",
        "--nproc-per-node",
        "3",
        "--master-port",
        "0",
        "--",
        "sh",
        "-c",
        "echo hi from $RANK of $WORLD_SIZE local $LOCAL_RANK",
    ]);
    let text = String::from_utf8_lossy(&out.stdout);
    for r in 0..3 {
        assert!(text.contains(&format!("[{r}] hi from {r} of 3 local {r}")), "{text}");
    }
    let t0 = Instant::now();
    let out = spawn(&[
        "launch",
        "--nproc-per-node",
        "3",
        "--master-port",
        "0",
        "--",
        "sh",
        "-c",
        "if [ \"$RANK\" = 1 ]; then echo failing >&2; exit 3; fi; exec sleep 60",
    ])
    .output(Duration::from_secs(30));
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("[1] failing"), "{err}");
    assert!(err.contains("rank 1 failed"), "{err}");
    assert!(t0.elapsed() < Duration::from_secs(20), "the launcher waited for the sleeping ranks");
}

#[test]
fn launcher_stops_its_ranks_on_sigterm() {
    let dir = Scratch::new("sigterm");
    let marker = dir.join("rank-{}.pid");
    let script = format!(
        "echo $$ > {}; echo ready; exec sleep 60",
        marker.display().to_string().replace("{}", "$RANK")
    );
    let mut g = spawn(&["launch", "--nproc-per-node", "2", "--master-port", "0", "--", "sh", "-c", &script]);
    let pid = g.child().id().to_string();
    // Wait (bounded) until both ranks have said they run, by reading the launcher's output.
    let stdout = g.child().stdout.take().unwrap();
    let mut lines = std::io::BufRead::lines(std::io::BufReader::new(stdout));
    for _ in 0..2 {
        assert!(lines.next().unwrap().unwrap().contains("ready"));
    }
    let t0 = Instant::now();
    assert!(Command::new("kill").args(["-TERM", &pid]).status().unwrap().success());
    let out = g.output(Duration::from_secs(20));
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("stopped by a signal"));
    assert!(t0.elapsed() < Duration::from_secs(10), "took {:?}", t0.elapsed());
    for r in 0..2 {
        let rank_pid = std::fs::read_to_string(dir.join(format!("rank-{r}.pid"))).unwrap();
        let alive = Command::new("kill").args(["-0", rank_pid.trim()]).status().unwrap().success();
        assert!(!alive, "rank {r} (pid {}) survived the launcher", rank_pid.trim());
    }
}

#[test]
fn ddp_refuses_a_rank_of_another_model() {
    // Two ranks started by hand, with different seeds: the handshake must refuse them.
    let dir = Scratch::new("mismatch");
    let port = gradsync_testkit::process::free_port().to_string();
    let rank = |r: &str, seed: &str| {
        spawn(&[
            "train",
            "--mode",
            "ddp",
            "--rank",
            r,
            "--world-size",
            "2",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            &port,
            "--model",
            "tiny",
            "--data",
            "synthetic:64:32:8",
            "--device",
            "cpu",
            "--steps",
            "1",
            "--quiet",
            "--seed",
            seed,
            "--comm-timeout",
            "5",
        ])
    };
    let (mut a, mut b) = (rank("0", "1"), rank("1", "2"));
    let (a, b) = (a.output(Duration::from_secs(30)), b.output(Duration::from_secs(30)));
    assert!(!a.status.success() && !b.status.success());
    let e = String::from_utf8_lossy(&b.stderr).to_string() + &String::from_utf8_lossy(&a.stderr);
    assert!(e.contains("fingerprint"), "{e}");
    drop(dir);
}

/// Whether a GPU test's body runs in this process (a real GPU, or the child that runs against
/// the fake CUDA; then the worker processes it starts load the fake too). When the body ran
/// in such a child, `check` looks at what the fake counted over all of its processes.
fn gpu_here(test: &str, check: impl FnOnce(&Counters)) -> bool {
    match gpu_test(test) {
        GpuRun::Here => true,
        GpuRun::Fake(c) => {
            check(&c);
            false
        }
        GpuRun::Skipped => false,
    }
}

/// `v` with `--device cpu` replaced by `--device cuda`.
fn on_gpu(mut v: Vec<String>) -> Vec<String> {
    let i = v.iter().position(|a| a == "cpu").unwrap();
    v[i] = "cuda".into();
    v
}

fn run_strings(a: &[String]) -> Output {
    run_ok(&a.iter().map(String::as_str).collect::<Vec<_>>())
}

#[test]
fn ddp_with_nccl_matches_local_on_one_gpu() {
    let trained = |c: &Counters| {
        // Two processes (local, one DDP rank), each training and reducing on the GPU.
        assert!(c.processes >= 2 && c.launches > 0 && c.gemms > 0 && c.collectives > 0, "{c}");
    };
    if !gpu_here("ddp_with_nccl_matches_local_on_one_gpu", trained) {
        return;
    }
    // NCCL refuses two ranks on one GPU: world size 1 is what one GPU can check.
    let dir = Scratch::new("nccl");
    let (local, ddp) = (dir.join("local.ckpt"), dir.join("ddp.ckpt"));
    let mut a: Vec<String> = ["train", "--mode", "local", "--batch", "8"].map(String::from).to_vec();
    a.extend(on_gpu(common(&local)));
    run_strings(&a);
    let mut a = launch_train(1, "ddp", &["--backend", "nccl"]);
    a.extend(["--batch", "8", "--bucket-mb", "0.002"].map(String::from));
    a.extend(on_gpu(common(&ddp)));
    run_strings(&a);
    let d = max_diff(&params(&local), &params(&ddp));
    assert!(d < 1e-5, "DDP over NCCL vs local: max diff {d}");
}

/// DP with two replicas on the GPU(s) and DDP with two GPU ranks over the TCP ring (gradients
/// staged through the host) end where local training on the CPU with the global batch does,
/// to the GPU's rounding.
#[test]
fn dp_and_ddp_over_tcp_on_gpus_match_local() {
    let trained = |c: &Counters| {
        // DP's process and the launcher's two ranks trained on the GPU; nothing was left
        // allocated by any of them.
        assert!(c.processes >= 3 && c.launches > 0 && c.gemms > 0 && c.alive_at_exit == 0, "{c}");
    };
    if !gpu_here("dp_and_ddp_over_tcp_on_gpus_match_local", trained) {
        return;
    }
    let dir = Scratch::new("gpu-equiv");
    let (local, dp, ddp) = (dir.join("local.ckpt"), dir.join("dp.ckpt"), dir.join("ddp.ckpt"));
    let mut a: Vec<String> = ["train", "--mode", "local", "--batch", "16"].map(String::from).to_vec();
    a.extend(common(&local));
    run_strings(&a);
    let mut a: Vec<String> =
        ["train", "--mode", "dp", "--replicas", "2", "--batch", "8"].map(String::from).to_vec();
    a.extend(on_gpu(common(&dp)));
    run_strings(&a);
    let mut a = launch_train(2, "ddp", &["--batch", "8"]);
    a.extend(["--backend", "tcp", "--bucket-mb", "0.002", "--comm-timeout", "30"].map(String::from));
    a.extend(on_gpu(common(&ddp)));
    run_strings(&a);
    let l = params(&local);
    for (what, p) in [("DP on GPUs", params(&dp)), ("DDP over TCP on GPUs", params(&ddp))] {
        let d = max_diff(&l, &p);
        assert!(d < 1e-4, "{what} vs local on the CPU: max diff {d}");
    }
}

/// `gradsync-worker launch` of `world` ZeRO-1 ranks with batch `batch`, small buckets, the
/// given transport and `extra` flags, saving to `save`, metrics to `dir/z-{rank}.jsonl`;
/// returns each rank's metrics header.
fn run_zero1(dir: &Path, world: usize, batch: usize, extra: &[&str], save: &Path) -> Vec<serde_json::Value> {
    let (w, b) = (world.to_string(), batch.to_string());
    let mut a = launch_train(&w, "zero1", &["--batch", &b]);
    a.extend(["--bucket-mb", "0.002", "--comm-timeout", "30", "--chunk-kb", "1"].map(String::from));
    a.extend(extra.iter().map(|s| s.to_string()));
    a.push("--metrics".into());
    a.push(dir.join("z-{rank}.jsonl").display().to_string());
    a.extend(common(save));
    run_strings(&a);
    (0..world)
        .map(|r| {
            let text = std::fs::read_to_string(dir.join(format!("z-{r}.jsonl"))).unwrap();
            serde_json::from_str(text.lines().next().unwrap()).unwrap()
        })
        .collect()
}

/// ZeRO-1 with `world` ranks of batch `batch` ends where local training with the combined
/// batch does, holding 1/world of the optimiser state on each rank.
fn check_zero1(world: usize, batch: usize, extra: &[&str]) {
    let dir = Scratch::new(&format!("zero1-{world}-{}", extra.join("").replace('-', "")));
    let (local, zero) = (dir.join("local.ckpt"), dir.join("zero1.ckpt"));
    let mut a: Vec<String> =
        ["train", "--mode", "local", "--batch", &(world * batch).to_string()].map(String::from).to_vec();
    a.extend(common(&local));
    run_strings(&a);
    let headers = run_zero1(&dir, world, batch, extra, &zero);
    let (l, z) = (Checkpoint::load(&local).unwrap(), Checkpoint::load(&zero).unwrap());
    let n = l.params.len();
    assert_ne!(
        l.params,
        gradsync_core::model::init_params(
            &gradsync_core::model::Layout::new(&gradsync_core::model::ModelSpec::parse("tiny").unwrap()),
            42
        ),
        "local did not train"
    );
    let d = max_diff(&l.params, &z.params);
    assert!(d < 1e-5, "ZeRO-1 with {world} ranks vs local: max diff {d}");
    // The momentum shards, gathered for the checkpoint, are local's momentum.
    let dm = max_diff(l.momentum.as_ref().unwrap(), z.momentum.as_ref().unwrap());
    assert!(dm < 1e-4, "ZeRO-1's gathered momentum vs local's: max diff {dm}");
    // Each rank held its shard of the optimiser state and nothing more: the shards add up
    // to one full momentum buffer (DDP's per rank), each within a bucket's rounding of 1/n.
    let held: Vec<u64> =
        headers.iter().map(|h| h["extra"]["optimizer_state_bytes"].as_u64().unwrap()).collect();
    assert_eq!(held.iter().sum::<u64>(), 4 * n as u64, "{held:?}");
    for (r, h) in headers.iter().enumerate() {
        assert_eq!(h["mode"], "zero1", "{h}");
        let buckets = h["extra"]["buckets"].as_u64().unwrap();
        let fair = (4 * n / world) as u64;
        assert!(
            held[r].abs_diff(fair) <= 4 * buckets,
            "rank {r} held {} bytes, 1/{world} is {fair}",
            held[r]
        );
        assert!(h["extra"]["peak_rss_kib_at_start"].as_u64().unwrap() > 0, "{h}");
    }
}

#[test]
fn zero1_matches_local_with_two_ranks() {
    check_zero1(2, 8, &["--transport", "tcp"]);
}

#[test]
fn zero1_matches_local_with_three_ranks_without_overlap() {
    check_zero1(3, 5, &["--transport", "tcp", "--no-overlap"]);
}

#[test]
fn zero1_over_shared_memory_matches_local_with_three_ranks() {
    check_zero1(3, 5, &["--transport", "shm"]);
}

/// ZeRO-1 moves what DDP's ring moves: two ranks send and receive half the gradient in the
/// reduce-scatter and half the parameters in the all-gather, i.e. the whole buffer each way.
#[test]
fn zero1_moves_the_rings_bytes() {
    let dir = Scratch::new("zero1-bytes");
    run_zero1(&dir, 2, 8, &[], &dir.join("s.ckpt"));
    let text = std::fs::read_to_string(dir.join("z-1.jsonl")).unwrap();
    let steps: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .filter(|v: &serde_json::Value| v["kind"] == "step")
        .collect();
    assert_eq!(steps.len(), 6);
    for s in &steps {
        assert_eq!(s["bytes_sent"].as_u64().unwrap(), 4456 * 4, "{s}");
        assert_eq!(s["bytes_recv"].as_u64().unwrap(), 4456 * 4, "{s}");
        assert!(s["comm_ms"].as_f64().unwrap() > 0.0 && s["update_ms"].as_f64().unwrap() > 0.0, "{s}");
    }
}

#[test]
fn zero1_with_nccl_on_the_cpu_is_refused_clearly() {
    let out = spawn(&[
        "launch",
        "--nproc-per-node",
        "1",
        "--master-port",
        "0",
        "--",
        "train",
        "--mode",
        "zero1",
        "--backend",
        "nccl",
        "--device",
        "cpu",
        "--steps",
        "1",
        "--model",
        "tiny",
        "--data",
        "synthetic:64:32:8",
    ])
    .output(Duration::from_secs(60));
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--backend nccl works on GPU memory"), "{err}");
    let out = spawn(&["train", "--mode", "zero1", "--bucket-mb", "0", "--steps", "1"])
        .output(Duration::from_secs(60));
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--bucket-mb must be positive"), "{err}");
}

/// ZeRO-1 with two GPU ranks over the TCP ring (each bucket staged through host memory, the
/// momentum shard in host memory) ends where local training on the CPU does.
#[test]
fn zero1_over_tcp_on_gpus_matches_local() {
    let trained = |c: &Counters| {
        assert!(c.processes >= 2 && c.launches > 0 && c.gemms > 0 && c.alive_at_exit == 0, "{c}");
    };
    if !gpu_here("zero1_over_tcp_on_gpus_matches_local", trained) {
        return;
    }
    let dir = Scratch::new("zero1-gpu");
    let (local, zero) = (dir.join("local.ckpt"), dir.join("zero1.ckpt"));
    let mut a: Vec<String> = ["train", "--mode", "local", "--batch", "16"].map(String::from).to_vec();
    a.extend(common(&local));
    run_strings(&a);
    let mut a = launch_train(2, "zero1", &["--batch", "8"]);
    a.extend(["--backend", "tcp", "--bucket-mb", "0.002", "--comm-timeout", "30"].map(String::from));
    a.extend(on_gpu(common(&zero)));
    run_strings(&a);
    let d = max_diff(&params(&local), &params(&zero));
    assert!(d < 1e-4, "ZeRO-1 over TCP on GPUs vs local on the CPU: max diff {d}");
}

/// `launch --nproc-per-node WORLD --master-port 0 -- train --mode MODE`, then `rest`.
fn launch_train(world: impl std::fmt::Display, mode: &str, rest: &[&str]) -> Vec<String> {
    let w = world.to_string();
    ["launch", "--nproc-per-node", &w, "--master-port", "0", "--", "train", "--mode", mode]
        .iter()
        .chain(rest)
        .map(|a| a.to_string())
        .collect()
}

/// One DDP run of `world` ranks with `--compress c` (small buckets, so several are reduced
/// while backward runs); its parameters and rank 0's bytes sent per step.
fn ddp_compressed(dir: &Path, world: usize, c: &str) -> (Vec<f32>, Vec<u64>) {
    let save = dir.join(format!("ddp-{c}.ckpt"));
    let metrics = dir.join(format!("m-{c}-{{rank}}.jsonl"));
    let w = world.to_string();
    let mut a = launch_train(&w, "ddp", &["--batch", "8"]);
    a.extend(
        ["--bucket-mb", "0.002", "--comm-timeout", "30", "--transport", "tcp", "--compress", c]
            .map(String::from),
    );
    a.extend(["--metrics".to_string(), metrics.display().to_string()]);
    a.extend(common(&save));
    run_ok(&a.iter().map(String::as_str).collect::<Vec<_>>());
    let text = std::fs::read_to_string(dir.join(format!("m-{c}-0.jsonl"))).unwrap();
    let lines: Vec<serde_json::Value> = text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(lines[0]["extra"]["compression"], c, "{}", lines[0]);
    let sent =
        lines.iter().filter(|v| v["kind"] == "step").map(|v| v["bytes_sent"].as_u64().unwrap()).collect();
    (params(&save), sent)
}

/// DDP's `--compress`: top-k (pairs all-gathered, summed in rank order) at ratio 1 equals the
/// f32 all-reduce bit for bit with two ranks (both sums are g0 + g1); at 10% it trains and
/// sends less; fp16 and bf16 (the ring's half-precision all-reduce) end within their rounding
/// of f32 and send half its bytes.
#[test]
fn ddp_compression_matches_the_all_reduce_within_its_rounding() {
    let dir = Scratch::new("ddp-compress");
    let (dense, dense_sent) = ddp_compressed(&dir, 2, "none");
    let (all, _) = ddp_compressed(&dir, 2, "topk:1");
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&all), bits(&dense), "DDP top-k at ratio 1 differs from the all-reduce");
    let (tenth, tenth_sent) = ddp_compressed(&dir, 2, "topk:0.1");
    assert!(max_diff(&tenth, &dense) > 0.0, "top-k 10% sent everything");
    let init = gradsync_core::model::init_params(
        &gradsync_core::model::Layout::new(
            &gradsync_core::model::ModelSpec::parse("tiny").unwrap().with_io(32, 8),
        ),
        42,
    );
    assert!(max_diff(&tenth, &init) > 1e-3, "top-k 10% did not train");
    // Two ranks: the all-reduce sends half the buffer twice (4 bytes a value); top-k's
    // all-gather sends this rank's pairs once (8 bytes a pair), about a tenth of the values.
    let (d, t): (u64, u64) = (dense_sent.iter().sum(), tenth_sent.iter().sum());
    assert!(t * 4 < d, "top-k 10% sent {t} bytes, the all-reduce {d}");

    // Half precision: each value and each hop's partial sum rounded by at most 2^-11 (2^-8)
    // of itself; over six steps of lr 0.1 and momentum 0.9 on gradients below 1 in magnitude
    // a parameter moves by less than 6 x 0.1 x 4.7 = 2.8, so the rounding moves it by less
    // than 2.8 x 2 x 2^-11 = 2.7e-3 (fp16) or 2.2e-2 (bf16) (two roundings: the value, the sum).
    for (c, bound) in [("fp16", 2.7e-3f32), ("bf16", 2.2e-2)] {
        let (got, sent) = ddp_compressed(&dir, 2, c);
        let diff = max_diff(&got, &dense);
        assert!(diff > 0.0 && diff < bound, "--compress {c}: max diff from f32 {diff} (bound {bound})");
        // Two bytes a value (an odd-length bucket pads one value).
        let half = sent.iter().sum::<u64>() as f64 / d as f64;
        assert!((0.49..0.51).contains(&half), "--compress {c} sent {half} of the all-reduce's bytes");
    }
}

/// `world` ranks of `gradsync-worker train --mode MODE` (DDP or ZeRO-1) as threads of this
/// process, through the library (`train::train`), on `cuda:RANK` each: the fake NCCL's ranks
/// meet only inside one process, and a real NCCL takes one rank per thread and GPU as well.
/// They meet through rank 0's real rendezvous store on a port picked here; `rest` follows the
/// rank's own flags.
fn ranks_as_threads(world: usize, mode: &str, rest: &[String]) {
    use clap::Parser;
    use gradsync_worker::cli::{Cli, Command};
    let (port, w) = (gradsync_testkit::process::free_port().to_string(), world.to_string());
    std::thread::scope(|s| {
        let ranks: Vec<_> = (0..world)
            .map(|r| {
                let (rank, device) = (r.to_string(), format!("cuda:{r}"));
                let mut a: Vec<String> =
                    ["gradsync-worker", "train", "--mode", mode, "--rank", &rank, "--world-size", &w]
                        .map(String::from)
                        .to_vec();
                a.extend(["--master-addr", "127.0.0.1", "--master-port", &port].map(String::from));
                // This rank's GPU instead of the device `rest` names.
                let mut rest = rest.to_vec();
                if let Some(i) = rest.iter().position(|x| x == "--device") {
                    rest[i + 1] = device;
                }
                a.extend(rest);
                s.spawn(move || {
                    let Command::Train(args) = Cli::try_parse_from(&a).unwrap().command else {
                        unreachable!("a train command line")
                    };
                    gradsync_worker::train::train(*args)
                })
            })
            .collect();
        for (r, h) in ranks.into_iter().enumerate() {
            if let Err(e) = h.join().unwrap() {
                panic!("rank {r}: {e:#}");
            }
        }
    });
}

/// `--backend nccl --compress fp16|bf16` with two ranks on two GPUs (the fake's, here): each
/// bucket is rounded, all-reduced in NCCL's half type and widened back on the device. The run
/// ends at the bits of the same run over the TCP ring, whose buckets are packed and summed on
/// the host with the host codec (two ranks: both sums are `round(round(g0) + round(g1))`), and
/// within the rounding bound of `ddp_compression_matches_the_all_reduce_within_its_rounding`
/// of the uncompressed NCCL run, not at it; every step records exactly half its bytes. With
/// `--no-overlap` (buckets queued after backward) it ends at the same bits.
#[test]
fn ddp_over_nccl_compresses_buckets_on_the_device() {
    let test = "ddp_over_nccl_compresses_buckets_on_the_device";
    let reduced = |c: &Counters| {
        assert!(c.launches > 0 && c.gemms > 0 && c.collectives > 0 && c.alive_at_exit == 0, "{c}");
    };
    if !gpu_here(test, reduced) {
        return;
    }
    let gpus = (0..8).take_while(|&i| gradsync_core::device::cuda::probe(i).is_ok()).count();
    if gpus < 2 {
        eprintln!("SKIPPED (two NCCL ranks need two GPUs; this machine has {gpus}) [{test}]");
        return;
    }
    let dir = Scratch::new("nccl-half");
    let run = |backend: &str, c: &str, extra: &[&str]| {
        let name = format!("{backend}-{c}{}", extra.join(""));
        let save = dir.join(format!("{name}.ckpt"));
        let metrics = dir.join(format!("m-{name}-{{rank}}.jsonl"));
        let mut a: Vec<String> =
            ["--backend", backend, "--compress", c, "--transport", "tcp", "--batch", "8"]
                .map(String::from)
                .to_vec();
        a.extend(["--bucket-mb", "0.002", "--comm-timeout", "30", "--metrics"].map(String::from));
        a.push(metrics.display().to_string());
        a.extend(extra.iter().map(|x| x.to_string()));
        a.extend(common(&save));
        ranks_as_threads(2, "ddp", &a);
        let text = std::fs::read_to_string(dir.join(format!("m-{name}-0.jsonl"))).unwrap();
        let lines: Vec<serde_json::Value> = text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
        assert_eq!(lines[0]["extra"]["compression"], c, "{}", lines[0]);
        assert_eq!(lines[0]["variant"], backend, "{}", lines[0]);
        let moved: Vec<(u64, u64)> = lines
            .iter()
            .filter(|v| v["kind"] == "step")
            .map(|v| (v["bytes_sent"].as_u64().unwrap(), v["bytes_recv"].as_u64().unwrap()))
            .collect();
        assert_eq!(moved.len(), 6, "{backend} {c}: steps recorded");
        (params(&save), moved)
    };
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    let (dense, dense_moved) = run("nccl", "none", &[]);
    let init = gradsync_core::model::init_params(
        &gradsync_core::model::Layout::new(
            &gradsync_core::model::ModelSpec::parse("tiny").unwrap().with_io(32, 8),
        ),
        42,
    );
    assert!(max_diff(&dense, &init) > 1e-3, "the uncompressed NCCL run did not train");
    for (c, bound) in [("fp16", 2.7e-3f32), ("bf16", 2.2e-2)] {
        let (nccl, moved) = run("nccl", c, &[]);
        let (tcp, _) = run("tcp", c, &[]);
        assert_eq!(bits(&nccl), bits(&tcp), "--compress {c}: NCCL on the device and the TCP ring end apart");
        // The buckets queued once backward has ended take the same way.
        let (late, late_moved) = run("nccl", c, &["--no-overlap"]);
        assert_eq!(bits(&late), bits(&nccl), "--compress {c} over NCCL: --no-overlap ends elsewhere");
        assert_eq!(late_moved, moved, "--compress {c} over NCCL: --no-overlap moves other bytes");
        let d = max_diff(&nccl, &dense);
        assert!(d > 0.0 && d < bound, "--compress {c} over NCCL: max diff from f32 {d} (bound {bound})");
        for (step, ((sent, recv), (f32_sent, f32_recv))) in moved.iter().zip(&dense_moved).enumerate() {
            assert!(
                2 * sent == *f32_sent && 2 * recv == *f32_recv && *sent > 0,
                "--compress {c} over NCCL, step {}: {sent}/{recv} bytes, f32 {f32_sent}/{f32_recv}",
                step + 1
            );
        }
        eprintln!("{test}: {c}: bit for bit the TCP ring's run; max diff from f32 {d:.2e}; half the bytes");
    }
}

/// `--compress` values and modes that cannot go together are refused before anything runs,
/// each naming what was wrong.
#[test]
fn compression_flags_are_refused_naming_the_fault() {
    let quick = ["--model", "tiny", "--data", "synthetic:64:32:8", "--device", "cpu", "--steps", "1"];
    for (args, says) in [
        (&["--mode", "local", "--compress", "fp16"][..], "is for --mode ps and --mode ddp"),
        (&["--mode", "zero1", "--compress", "topk:0.1"], "is for --mode ps and --mode ddp"),
        (&["--mode", "ddp", "--compress", "topk:0"], "above 0 and at most 1"),
        (&["--mode", "ddp", "--compress", "topk:abc"], "'abc' is not a number"),
        (&["--mode", "ddp", "--compress", "gzip"], "unknown compression 'gzip'"),
        (
            &["--mode", "ddp", "--backend", "nccl", "--compress", "topk:0.1"],
            "top-k selection on the device is not implemented (NCCL reduces the buckets in GPU memory); use --backend tcp",
        ),
    ] {
        let mut a = vec!["train"];
        a.extend(args);
        a.extend(quick);
        let out = spawn(&a).output(Duration::from_secs(30));
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains(says), "{args:?}: {err}");
    }
}

/// How one rank's device work went, step by step, as the fake CUDA logged it: per step that
/// synchronised, (the staging copies to the host queued before backward's last GEMM, all of
/// them, the copies back before the update's kernel).
fn staging_per_step(work: &[gradsync_testkit::Work]) -> Vec<(usize, usize, usize)> {
    use gradsync_testkit::{CopyKind, Work};
    let is = |w: &Work, name: &str| matches!(w, Work::Kernel(l) if l.kernel == name);
    let mut steps = Vec::new();
    let mut rest = work;
    // A step: forward ends with the softmax (and the loss read back), backward starts with the
    // last layer's bias gradient, the update is the `sgd` kernel.
    while let Some(soft) = rest.iter().position(|w| is(w, "softmax_xent")) {
        let Some(sgd) = rest[soft..].iter().position(|w| is(w, "sgd")).map(|i| i + soft) else { break };
        let step = &rest[soft..sgd];
        let bwd = step.iter().position(|w| is(w, "bias_grad")).unwrap_or(step.len());
        let backward = &step[bwd..];
        let last_gemm = backward.iter().rposition(|w| matches!(w, Work::Gemm)).unwrap_or(0);
        let out = |w: &Work| matches!(w, Work::Copy { kind: CopyKind::DtoH, .. });
        let back = |w: &Work| matches!(w, Work::Copy { kind: CopyKind::HtoD, .. });
        let early = backward[..last_gemm].iter().filter(|w| out(w)).count();
        let staged = backward.iter().filter(|w| out(w)).count();
        let returned = backward.iter().filter(|w| back(w)).count();
        steps.push((early, staged, returned));
        rest = &rest[sgd + 1..];
    }
    steps
}

/// DDP with two GPU ranks over the TCP ring (the fake CUDA's GPUs here): each bucket is staged
/// to the host as backward finishes it, while backward still runs, and its sum goes back
/// before the update; the fake checks every copy's bounds, pinned buffers included, and that
/// none is left allocated. The exposed communication of every step is recorded.
#[test]
fn gpu_buckets_are_staged_as_backward_finishes_them() {
    const TEST: &str = "gpu_buckets_are_staged_as_backward_finishes_them";
    let trained = |c: &Counters| assert!(c.processes >= 2 && c.gemms > 0 && c.alive_at_exit == 0, "{c}");
    if !gpu_here(TEST, trained) {
        return;
    }
    let Some(_) = gradsync_testkit::WorkLog::here() else {
        eprintln!(
            "{TEST}: the order of copies is checked against the fake CUDA only (a real GPU logs nothing)"
        );
        return;
    };
    let dir = Scratch::new("staging");
    let log = dir.join("work.log");
    // Buckets of about one tensor each, so most are finished while backward still runs.
    let mut a = launch_train(2, "ddp", &["--batch", "8"]);
    a.extend(["--backend", "tcp", "--bucket-mb", "0.0001", "--comm-timeout", "30"].map(String::from));
    a.extend(["--metrics".to_string(), dir.join("m-{rank}.jsonl").display().to_string()]);
    a.extend(on_gpu(common(&dir.join("ddp.ckpt"))));
    let (key, value) = gradsync_testkit::WorkLog::env(&log);
    let mut cmd = Command::new(WORKER);
    cmd.args(&a).env(key, value).stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    for v in ["RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"] {
        cmd.env_remove(v);
    }
    let out = Proc::adopt(cmd.spawn().unwrap()).output(Duration::from_secs(120));
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let header: serde_json::Value =
        serde_json::from_str(std::fs::read_to_string(dir.join("m-0.jsonl")).unwrap().lines().next().unwrap())
            .unwrap();
    let buckets = header["extra"]["buckets"].as_u64().unwrap() as usize;
    assert!(buckets >= 3, "small buckets, several per step: {header}");
    let ranks: Vec<_> = gradsync_testkit::WorkLog::at(&log)
        .by_process()
        .into_iter()
        .filter(|(_, w)| w.iter().any(|w| matches!(w, gradsync_testkit::Work::Gemm)))
        .collect();
    assert_eq!(ranks.len(), 2, "two ranks trained on the GPU");
    for (pid, work) in ranks {
        let steps = staging_per_step(&work);
        assert_eq!(steps.len(), 6, "process {pid}: six steps");
        for (i, &(early, staged, returned)) in steps.iter().enumerate() {
            assert_eq!(staged, buckets, "process {pid} step {i}: every bucket staged once");
            // Every sum is back before the update's kernel (the next copies to the device are
            // the next batch's).
            assert_eq!(
                returned, buckets,
                "process {pid} step {i}: every bucket's sum copied back before the update"
            );
            // All but the bucket that holds the first layer leave while backward still runs.
            assert!(
                early >= buckets - 1,
                "process {pid} step {i}: {early} of {buckets} staged during backward"
            );
        }
    }
    // Every step recorded its communication and the exposed part of it.
    for r in 0..2 {
        let text = std::fs::read_to_string(dir.join(format!("m-{r}.jsonl"))).unwrap();
        for line in text.lines().skip(1).filter(|l| l.contains("\"comm_exposed_ms\"")) {
            let s: serde_json::Value = serde_json::from_str(line).unwrap();
            let (busy, exposed) = (s["comm_ms"].as_f64().unwrap(), s["comm_exposed_ms"].as_f64().unwrap());
            assert!(busy > 0.0 && exposed <= busy + 1e-9, "rank {r}: {line}");
        }
    }
}
