//! The embedding model in every mode that trains it, as real processes: DP replicas and DDP
//! ranks (TCP and shared memory; the table's gradient all-reduced whole, or its rows
//! all-gathered) end at the parameters of one process with the combined batch, within
//! rounding (each rank sums its own samples first). The rows' traffic is what the batch named,
//! a small part of the dense table's. Modes that cannot update a table lazily refuse it by name.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;
use std::process::Output;
use std::time::Duration;

use gradsync_core::checkpoint::Checkpoint;
use gradsync_testkit::Scratch;

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

#[test]
fn modes_that_cannot_update_a_table_lazily_refuse_it() {
    let dir = Scratch::new("sparse-refusals");
    let save = dir.join("x.ckpt");
    for (mode, want) in
        [("ps", "the parameter server's dense push and pull"), ("zero1", "ZeRO-1's sharded update")]
    {
        let mut a: Vec<String> =
            ["train", "--mode", mode, "--servers", "127.0.0.1:1"].map(String::from).to_vec();
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
