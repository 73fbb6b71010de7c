//! The embedding model in every mode that trains it, as real processes: DP replicas, DDP ranks
//! (TCP and shared memory; the table's gradient all-reduced whole, or its rows all-gathered)
//! and PS workers under BSP (the table's rows pushed and pulled by id, on one shard or split
//! over two) end at the parameters of one process with the combined batch, within rounding
//! (each rank sums its own samples first). The rows' traffic is what the batch named, a small
//! part of the dense table's. Modes that cannot update a table lazily refuse it by name.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::path::Path;
use std::process::Output;
use std::time::Duration;

use std::process::{Command, Stdio};

use gradsync_core::checkpoint::Checkpoint;
use gradsync_testkit::Scratch;
use gradsync_testkit::process::{Proc, start_server};

const WORKER: &str = env!("CARGO_BIN_EXE_gradsync-worker");

fn run(args: &[String]) -> Output {
    gradsync_testkit::process::run_to_end(WORKER, args, Duration::from_secs(120))
}

fn run_ok(args: &[String]) -> Output {
    gradsync_testkit::process::run_ok(WORKER, args, Duration::from_secs(120))
}

/// A 5000-row table of 8 under one hidden layer, on clicks over those 5000 ids.
fn common(save: &Path) -> Vec<String> {
    let mut v: Vec<String> = [
        "--model",
        "embedding:5000:8:16",
        "--data",
        "clicks:2000:5000",
        "--device",
        "cpu",
        "--threads",
        "1",
        "--steps",
        "12",
        "--eval-every",
        "0",
        "--lr",
        "0.5",
        "--quiet",
        "--save",
    ]
    .map(String::from)
    .to_vec();
    v.push(save.display().to_string());
    v
}

fn launch(world: usize, rest: &[&str]) -> Vec<String> {
    let w = world.to_string();
    ["launch", "--nproc-per-node", &w, "--master-port", "0", "--", "train", "--mode", "ddp"]
        .iter()
        .chain(rest)
        .map(|s| s.to_string())
        .collect()
}

fn params(p: &Path) -> Vec<f32> {
    Checkpoint::load(p).unwrap().params
}

fn max_rel(a: &[f32], b: &[f32]) -> f32 {
    let scale = b.iter().fold(0f32, |m, v| m.max(v.abs()));
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max) / scale
}

/// Rank 0's steps from a metrics file.
fn steps(path: &Path) -> Vec<serde_json::Value> {
    let text = std::fs::read_to_string(path).unwrap();
    text.lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .filter(|v: &serde_json::Value| v["kind"] == "step")
        .collect()
}

#[test]
fn every_way_of_moving_the_table_ends_where_local_training_does() {
    let dir = Scratch::new("sparse-equiv");
    let local = dir.join("local.ckpt");
    let mut a: Vec<String> = ["train", "--mode", "local", "--batch", "16"].map(String::from).to_vec();
    a.extend(common(&local));
    run_ok(&a);
    let l = params(&local);
    let init = gradsync_core::model::init_params(
        &gradsync_core::model::Layout::new(
            &gradsync_core::model::ModelSpec::parse("embedding:5000:8:16")
                .unwrap()
                .fit(gradsync_core::model::Input::Bag { rows: 5000, slots: 40 }, 2)
                .unwrap(),
        ),
        42,
    );
    // Lazy rows: most of the table was never named by a batch and is still its initial value.
    let table = 5000 * 8;
    let unchanged = (0..table).filter(|&i| l[i] == init[i]).count();
    assert!(unchanged > table / 2 && unchanged < table, "{unchanged} of {table} table values unchanged");

    let dp = dir.join("dp.ckpt");
    let mut a: Vec<String> =
        ["train", "--mode", "dp", "--replicas", "2", "--batch", "8"].map(String::from).to_vec();
    a.extend(common(&dp));
    run_ok(&a);
    let d = max_rel(&params(&dp), &l);
    assert!(d < 1e-5, "dp differs from local by {d:e}");

    let mut bytes = Vec::new();
    for (grads, transport) in [("dense", "tcp"), ("dense", "shm"), ("allgather", "tcp"), ("allgather", "shm")]
    {
        let save = dir.join(format!("ddp-{grads}-{transport}.ckpt"));
        let metrics = dir.join(format!("m-{grads}-{transport}-{{rank}}.jsonl"));
        let m = metrics.display().to_string();
        let mut a = launch(2, &["--batch", "8", "--sparse-grads", grads, "--transport", transport]);
        a.extend(["--bucket-mb", "0.01", "--comm-timeout", "30", "--metrics", &m].map(String::from));
        a.extend(common(&save));
        run_ok(&a);
        let d = max_rel(&params(&save), &l);
        assert!(d < 1e-5, "ddp --sparse-grads {grads} over {transport} differs from local by {d:e}");
        let s = steps(&dir.join(format!("m-{grads}-{transport}-0.jsonl")));
        let sent: u64 = s.iter().map(|v| v["bytes_sent"].as_u64().unwrap()).sum();
        if grads == "allgather" {
            // Each step: the rows every rank named, at least this rank's own.
            for v in &s {
                let rows = v["rows"].as_u64().expect("an allgather step records its rows");
                assert!((8..=2 * 8 * 40).contains(&rows), "{rows} rows");
            }
        }
        bytes.push((grads, sent));
    }
    // The rows are a small part of the whole table's bytes.
    let dense = bytes.iter().find(|b| b.0 == "dense").unwrap().1;
    let rows = bytes.iter().find(|b| b.0 == "allgather").unwrap().1;
    assert!(rows * 10 < dense, "allgather sent {rows} bytes, dense {dense}");
}

/// Server shards for the common model: `--shard i/k` each, BSP unless `sync` says, the
/// common learning rate and seed. Returns them and their addresses, comma-separated.
fn servers(k: usize, sync: &str) -> (Vec<Proc>, String) {
    servers_with(k, sync, &[])
}

/// [`servers`] with `extra` flags for every shard (`{i}` in one becomes the shard's index).
fn servers_with(k: usize, sync: &str, extra: &[String]) -> (Vec<Proc>, String) {
    let mut procs = Vec::new();
    let mut addrs = Vec::new();
    for i in 0..k {
        let mut cmd = Command::new(common::server_bin());
        cmd.args(["--listen", "127.0.0.1:0", "--model", "embedding:5000:8:16", "--data", "clicks:2000:5000"])
            .args(["--seed", "42", "--lr", "0.5", "--sync", sync, "--shard", &format!("{i}/{k}")])
            .args(["--worker-timeout", "30"])
            .args(extra.iter().map(|e| e.replace("{i}", &i.to_string())));
        let (p, a) = start_server(&mut cmd, true);
        procs.push(p);
        addrs.push(a);
    }
    (procs, addrs.join(","))
}

/// PS workers of a run of `world` over `addrs`, each with batch `batch`, rank 0 saving to
/// `save` and writing metrics to `metrics` (`{rank}` filled in); waits for all of them.
fn ps_run(addrs: &str, world: usize, batch: usize, save: &Path, metrics: &Path) {
    ps_run_on("cpu", addrs, world, batch, save, metrics);
}

/// [`ps_run`] with the workers on `device`.
fn ps_run_on(device: &str, addrs: &str, world: usize, batch: usize, save: &Path, metrics: &Path) {
    let mut procs: Vec<Proc> = (0..world)
        .map(|r| {
            let m = metrics.display().to_string().replace("{rank}", &r.to_string());
            let mut a: Vec<String> = ["train", "--mode", "ps", "--servers", addrs, "--rank", &r.to_string()]
                .map(String::from)
                .to_vec();
            a.extend(
                ["--world-size", &world.to_string(), "--batch", &batch.to_string(), "--seed", "42"]
                    .map(String::from),
            );
            a.extend(["--rpc-timeout", "30", "--metrics", &m].map(String::from));
            let other = save.with_extension(format!("rank{r}.ckpt"));
            a.extend(
                common(if r == 0 { save } else { &other })
                    .into_iter()
                    .map(|f| if f == "cpu" { device.to_string() } else { f }),
            );
            let mut cmd = Command::new(WORKER);
            cmd.args(&a).stdout(Stdio::null());
            Proc::spawn(&mut cmd)
        })
        .collect();
    for (r, p) in procs.iter_mut().enumerate() {
        let (code, err, _) = p.finish(Duration::from_secs(120));
        assert_eq!(code, 0, "PS worker {r}: {err}");
    }
}

/// The parameter server with sparse keys: under BSP, two workers (one shard, then the table
/// and the rest split over two) end where one process with the combined batch does; each
/// step moves the rows the batch named and the next batch names, not the table; ASP trains
/// to the end on the rows it pulls.
#[test]
fn the_parameter_server_moves_rows_by_id_and_ends_where_local_training_does() {
    let dir = Scratch::new("sparse-ps");
    let local = dir.join("local.ckpt");
    let mut a: Vec<String> = ["train", "--mode", "local", "--batch", "16"].map(String::from).to_vec();
    a.extend(common(&local));
    run_ok(&a);
    let l = params(&local);
    for shards in [1, 2] {
        let (_servers, addrs) = servers(shards, "bsp");
        let save = dir.join(format!("ps-{shards}.ckpt"));
        let metrics = dir.join(format!("m-ps-{shards}-{{rank}}.jsonl"));
        ps_run(&addrs, 2, 8, &save, &metrics);
        let d = max_rel(&params(&save), &l);
        assert!(d < 1e-5, "ps with {shards} shard(s) differs from local by {d:e}");
        // Each step pushes the named rows (ids and 8 values each) and a few hundred dense
        // values, and pulls as much: far below the 160 KB of the table.
        let s = steps(&dir.join(format!("m-ps-{shards}-0.jsonl")));
        assert_eq!(s.len(), 12);
        let dense = (8 * 16 + 16 + 16 * 2 + 2) * 4;
        for (i, v) in s.iter().enumerate() {
            let rows = v["rows"].as_u64().expect("a PS step records the rows it pushed");
            let (sent, recv) = (v["bytes_sent"].as_u64().unwrap(), v["bytes_recv"].as_u64().unwrap());
            assert!((1..=8 * 40).contains(&rows), "{rows} rows");
            assert_eq!(sent, rows * (4 + 8 * 4) + dense, "push bytes for {rows} rows");
            // The first step also fetches its own batch's rows; the last fetches none (no
            // batch follows).
            let most = if i == 0 { 2 } else { 1 } * 8 * 40 * (4 + 8 * 4) + dense;
            if i + 1 == s.len() {
                assert_eq!(recv, dense, "the last step pulled rows");
            } else {
                assert!(recv <= most && recv > dense, "step {i} pulled {recv} bytes");
            }
        }
    }
    let (_servers, addrs) = servers(2, "asp");
    let save = dir.join("ps-asp.ckpt");
    ps_run(&addrs, 2, 8, &save, &dir.join("m-asp-{rank}.jsonl"));
    // Asynchronous: no equality to hold it to, but every step ran on rows it pulled.
    assert!(params(&save).iter().all(|v| v.is_finite()));
    let s = steps(&dir.join("m-asp-0.jsonl"));
    assert_eq!(s.len(), 12);
    assert!(s.iter().all(|v| v["loss"].as_f64().unwrap().is_finite() && v["rows"].as_u64().unwrap() > 0));
}

/// `--mode hybrid`: the table on servers that hold it alone, the rest all-reduced by the ring;
/// two ranks (one table shard, then two) end where one process with the combined batch does.
/// Servers and modes that do not fit together refuse each other by name.
#[test]
fn the_hybrid_keeps_the_table_on_servers_and_rings_the_rest() {
    let dir = Scratch::new("sparse-hybrid");
    let local = dir.join("local.ckpt");
    let mut a: Vec<String> = ["train", "--mode", "local", "--batch", "16"].map(String::from).to_vec();
    a.extend(common(&local));
    run_ok(&a);
    let l = params(&local);
    let table_only = ["--table-only".to_string()];
    for shards in [1, 2] {
        let (_servers, addrs) = servers_with(shards, "bsp", &table_only);
        let save = dir.join(format!("hybrid-{shards}.ckpt"));
        let m = dir.join(format!("m-h{shards}-{{rank}}.jsonl")).display().to_string();
        let mut a: Vec<String> = ["launch", "--nproc-per-node", "2", "--master-port", "0", "--", "train"]
            .map(String::from)
            .to_vec();
        a.extend(
            ["--mode", "hybrid", "--servers", &addrs, "--batch", "8", "--comm-timeout", "30"]
                .map(String::from),
        );
        a.extend(["--rpc-timeout", "30", "--metrics", &m].map(String::from));
        a.extend(common(&save));
        run_ok(&a);
        let d = max_rel(&params(&save), &l);
        assert!(d < 1e-5, "hybrid with {shards} table shard(s) differs from local by {d:e}");
        let s = steps(&dir.join(format!("m-h{shards}-0.jsonl")));
        assert_eq!(s.len(), 12);
        // The rows go to the servers; the ring carries the rest (a few hundred values), far
        // less than the table.
        for v in &s {
            let rows = v["rows"].as_u64().expect("a hybrid step records its rows");
            assert!((1..=8 * 40).contains(&rows), "{rows} rows");
            let sent = v["bytes_sent"].as_u64().unwrap();
            assert!(
                sent >= rows * (4 + 8 * 4) && sent < rows * (4 + 8 * 4) + 4000,
                "{sent} bytes for {rows} rows"
            );
        }
    }
    // A hybrid worker against servers that hold the whole model, a PS worker against servers
    // that hold the table alone, and a hybrid worker against table servers that would step the
    // table with another optimiser than the ranks step the rest with (it trained on silently).
    let save = dir.join("x.ckpt");
    let other_momentum = ["--table-only", "--momentum", "0.5"].map(String::from);
    for (mode, extra, want) in [
        ("hybrid", &[][..], "start them with --table-only"),
        ("ps", &table_only[..], "for --mode hybrid"),
        ("hybrid", &other_momentum[..], "the table's servers step it with --lr 0.5 --momentum 0.5"),
    ] {
        let (_servers, addrs) = servers_with(1, "bsp", extra);
        let mut a: Vec<String> =
            ["train", "--mode", mode, "--servers", &addrs, "--rpc-timeout", "10"].map(String::from).to_vec();
        if mode == "hybrid" {
            a.extend(["--master-port".into(), gradsync_testkit::process::free_port().to_string()]);
        }
        a.extend(common(&save));
        let out = run(&a);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains(want), "{mode}: {err}");
    }
}

/// A shard's rows are checkpointed beside its dense values and resumed with them: servers
/// resumed from the checkpoint of the last step serve exactly the parameters the run ended
/// with (rank 0's --save, which brings the whole table in). Without its rows' file a shard
/// refuses to resume, naming it.
#[test]
fn a_sparse_shard_checkpoints_and_resumes_its_rows() {
    let dir = Scratch::new("sparse-ps-ckpt");
    let ck = dir.join("shard-{i}.ckpt").display().to_string();
    let flags = |resume: bool| {
        let mut v: Vec<String> = ["--checkpoint", &ck, "--checkpoint-every", "6"].map(String::from).to_vec();
        if resume {
            v.push("--resume".into());
        }
        v
    };
    let save = dir.join("ran.ckpt");
    {
        let (_servers, addrs) = servers_with(2, "bsp", &flags(false));
        ps_run(&addrs, 2, 8, &save, &dir.join("m-{rank}.jsonl"));
    }
    let (_servers, addrs) = servers_with(2, "bsp", &flags(true));
    let resumed = dir.join("resumed.ckpt");
    let mut a: Vec<String> =
        ["train", "--mode", "ps", "--servers", &addrs, "--rpc-timeout", "30"].map(String::from).to_vec();
    a.extend(common(&resumed).into_iter().map(|f| if f == "12" { "0".into() } else { f }));
    run_ok(&a);
    assert_eq!(params(&resumed), params(&save), "the resumed shards serve other values");
    drop(_servers);
    std::fs::remove_file(dir.join("shard-1.ckpt.rows")).unwrap();
    let mut args: Vec<String> =
        ["--listen", "127.0.0.1:0", "--model", "embedding:5000:8:16", "--data", "clicks:2000:5000"]
            .map(String::from)
            .to_vec();
    args.extend(["--seed", "42", "--shard", "1/2"].map(String::from));
    args.extend(flags(true).iter().map(|f| f.replace("{i}", "1")));
    let out = gradsync_testkit::process::run_to_end(common::server_bin(), &args, Duration::from_secs(60));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("shard-1.ckpt.rows"), "{err}");
}

#[test]
fn modes_that_cannot_update_a_table_lazily_refuse_it() {
    let dir = Scratch::new("sparse-refusals");
    let save = dir.join("x.ckpt");
    for (mode, want) in [("ps", "--compress fp16 with embedding"), ("zero1", "ZeRO-1's sharded update")] {
        let mut a: Vec<String> = ["train", "--mode", mode, "--servers", "127.0.0.1:1", "--compress", "fp16"]
            .map(String::from)
            .to_vec();
        if mode == "zero1" {
            a.truncate(3);
        }
        a.extend(common(&save));
        let out = run(&a);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains(want) && err.contains("embedding"), "{mode}: {err}");
    }
    for (extra, want) in [
        (&["--model", "tiny", "--data", "synthetic:64:32:8"][..], "has none"),
        (&["--sync-every", "2"][..], "needs --sync-every 1"),
    ] {
        let mut a: Vec<String> =
            ["train", "--mode", "ddp", "--sparse-grads", "allgather"].map(String::from).to_vec();
        a.extend(extra.iter().map(|s| s.to_string()));
        let mut rest = common(&save).into_iter();
        while let Some(flag) = rest.next() {
            // This case's own --model and --data replace the common ones.
            if extra.contains(&flag.as_str()) {
                rest.next();
            } else {
                a.push(flag);
            }
        }
        let out = run(&a);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains(want), "{extra:?}: {err}");
    }
}

/// Without --data the embedding model trains on the built-in clicks over its own rows (it once
/// got dense synthetic values, which are not ids).
#[test]
fn the_embedding_model_defaults_to_the_clicks() {
    let out = run_ok(
        &["train", "--model", "embedding:3000:4", "--steps", "3", "--threads", "1", "--device", "cpu"]
            .map(String::from),
    );
    let text = String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(text.contains("3 steps"), "{text}");
}

/// On the GPU under NCCL (one rank, as one GPU allows; in CI the fake's): both ways of moving
/// the table run, the rows through NCCL's all-gather, and end at local training's parameters on
/// the same device.
#[test]
fn the_table_travels_over_nccl_on_the_gpu() {
    let test = "the_table_travels_over_nccl_on_the_gpu";
    match gradsync_testkit::gpu_test(test) {
        gradsync_testkit::GpuRun::Here => {}
        gradsync_testkit::GpuRun::Fake(c) => {
            assert!(c.processes >= 1 && c.collectives > 0 && c.alive_at_exit == 0, "{c}");
            return;
        }
        gradsync_testkit::GpuRun::Skipped => return,
    }
    let dir = Scratch::new("sparse-nccl");
    let on_gpu = |mut a: Vec<String>| {
        let i = a.iter().position(|x| x == "cpu").unwrap();
        a[i] = "cuda".into();
        a
    };
    let local = dir.join("local.ckpt");
    let mut a: Vec<String> = ["train", "--mode", "local", "--batch", "8"].map(String::from).to_vec();
    a.extend(common(&local));
    run_ok(&on_gpu(a));
    for grads in ["dense", "allgather"] {
        let save = dir.join(format!("{grads}.ckpt"));
        let mut a = launch(1, &["--batch", "8", "--backend", "nccl", "--sparse-grads", grads]);
        a.extend(common(&save));
        run_ok(&on_gpu(a));
        let d = max_rel(&params(&save), &params(&local));
        assert!(d < 1e-6, "--sparse-grads {grads} over NCCL differs from local on the GPU by {d:e}");
    }
}

/// The table's rows by id from GPU workers (in CI the fake's): PS workers under BSP and
/// hybrid ranks read and write the table's rows and the dense values on the device, and end
/// where local training on the GPU does.
#[test]
fn gpu_workers_move_the_tables_rows_by_id() {
    let test = "gpu_workers_move_the_tables_rows_by_id";
    match gradsync_testkit::gpu_test(test) {
        gradsync_testkit::GpuRun::Here => {}
        gradsync_testkit::GpuRun::Fake(c) => {
            assert!(c.processes >= 3 && c.alive_at_exit == 0, "{c}");
            return;
        }
        gradsync_testkit::GpuRun::Skipped => return,
    }
    let dir = Scratch::new("sparse-gpu-rows");
    let on_gpu = |a: Vec<String>| -> Vec<String> {
        a.into_iter().map(|f| if f == "cpu" { "cuda".into() } else { f }).collect()
    };
    let local = dir.join("local.ckpt");
    let mut a: Vec<String> = ["train", "--mode", "local", "--batch", "16"].map(String::from).to_vec();
    a.extend(common(&local));
    run_ok(&on_gpu(a));
    let l = params(&local);
    let (servers, addrs) = servers(2, "bsp");
    let save = dir.join("ps.ckpt");
    ps_run_on("cuda", &addrs, 2, 8, &save, &dir.join("m-{rank}.jsonl"));
    drop(servers);
    let d = max_rel(&params(&save), &l);
    assert!(d < 1e-5, "PS workers on the GPU differ from local on the GPU by {d:e}");
    let (_servers, addrs) = servers_with(1, "bsp", &["--table-only".to_string()]);
    let save = dir.join("hybrid.ckpt");
    let mut a: Vec<String> =
        ["launch", "--nproc-per-node", "2", "--master-port", "0", "--", "train"].map(String::from).to_vec();
    a.extend(
        ["--mode", "hybrid", "--servers", &addrs, "--batch", "8", "--comm-timeout", "30"].map(String::from),
    );
    a.extend(common(&save));
    run_ok(&on_gpu(a));
    let d = max_rel(&params(&save), &l);
    assert!(d < 1e-5, "hybrid ranks on the GPU differ from local on the GPU by {d:e}");
}
