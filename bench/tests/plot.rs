//! `gradsync-bench plot` on metrics files written here: every mode present (so every chart has
//! data), output identical for identical input, bad files reported by path and line.
#![allow(clippy::unwrap_used)] // a test fails loudly on anything unexpected

use std::path::Path;
use std::process::Command;

use gradsync_core::metrics::{Header, MetricsWriter, Record, ServerApply, Step};

fn tmp(name: &str) -> Scratch {
    Scratch::new(&format!("plot-{name}"))
}

const PARAMS: usize = 50_000;

fn header(mode: &str, variant: &str, world: usize, rank: usize, start: u64) -> Header {
    Header {
        schema: 1,
        mode: mode.into(),
        variant: variant.into(),
        device: "cpu".into(),
        preset: "tiny".into(),
        widths: "32-64-32-8".into(),
        params: PARAMS,
        batch: 64 / world,
        global_batch: 64,
        world_size: world,
        rank,
        seed: 42,
        start_unix_ms: start,
        // Every fixture run is complete: its workers reach the steps they planned.
        extra: serde_json::Map::from_iter([("total_steps".to_string(), 20.into())]),
        ..Header::default()
    }
}

/// A run of `world` workers whose steps take `step_ms`, communicating `comm_ms` per step.
#[allow(clippy::too_many_arguments)]
fn write_run(
    dir: &Path,
    mode: &str,
    variant: &str,
    world: usize,
    start: u64,
    step_ms: f64,
    comm_ms: f64,
    bytes: u64,
    stale: bool,
) {
    std::fs::create_dir_all(dir).unwrap();
    // DP is one process for all its replicas.
    let files = if mode == "dp" { 1 } else { world };
    for r in 0..files {
        let mut w = MetricsWriter::create(&dir.join(format!("rank{r}.jsonl"))).unwrap();
        w.write(&Record::Header(header(mode, variant, world, r, start))).unwrap();
        for s in 1..=20u64 {
            w.write(&Record::Step(Step {
                rank: r,
                step: s,
                samples: s * 64,
                wall_ms: s as f64 * step_ms,
                step_ms,
                loss: 2.0 / (1.0 + s as f64 * 0.1) + r as f64 * 0.01,
                forward_ms: step_ms * 0.3,
                backward_ms: step_ms * 0.4,
                update_ms: step_ms * 0.1,
                comm_ms,
                comm_exposed_ms: comm_ms * 0.5,
                wait_ms: 0.0,
                bytes_sent: bytes / 2,
                bytes_recv: bytes / 2,
                staleness: stale.then_some((s + r as u64) % 3),
                accuracy: (s == 20).then_some(0.5),
                ..Step::default()
            }))
            .unwrap();
        }
    }
    if mode == "ps" {
        let mut w = MetricsWriter::create(&dir.join("server0.jsonl")).unwrap();
        w.write(&Record::Header(Header {
            mode: "server".into(),
            rank: 0,
            ..header(mode, variant, world, 0, start - 50)
        }))
        .unwrap();
        for v in 1..=20u64 {
            w.write(&Record::ServerApply(ServerApply {
                shard: 0,
                version: v,
                wall_ms: v as f64 * step_ms + 50.0,
                gradients: world,
                ranks: (0..world).collect(),
                staleness: vec![0; world],
                bytes_in: bytes / 2 * world as u64,
                bytes_out: bytes / 2 * world as u64,
                ..ServerApply::default()
            }))
            .unwrap();
        }
    }
}

/// A run directory as `compare` leaves it, with every mode, 1 and 2 workers.
fn fixture(root: &Path) {
    let s = PARAMS as u64 * 4;
    let mut t = 1_700_000_000_000u64;
    let mut next = |d: u64| {
        t += d;
        t
    };
    let runs = root.join("runs");
    write_run(&runs.join("001-local-w1"), "local", "", 1, next(0), 10.0, 0.0, 0, false);
    write_run(&runs.join("002-dp-w2"), "dp", "", 2, next(10_000), 7.0, 0.0, 0, false);
    for (i, v) in ["bsp", "asp", "ssp:2"].iter().enumerate() {
        write_run(
            &runs.join(format!("00{}-ps-w2", 3 + i)),
            "ps",
            v,
            2,
            next(10_000),
            9.0,
            3.0,
            2 * s,
            *v != "bsp",
        );
    }
    write_run(&runs.join("006-ddp-w2"), "ddp", "tcp", 2, next(10_000), 8.0, 2.0, 2 * s, false);
    std::fs::write(
        root.join("machine.json"),
        r#"{"host":"h","cpu":"test cpu","cores":2,"memory_bytes":1073741824,"gpus":[],"kernel":"6","gradsync_version":"0.1.0","gradsync_commit":"abc","tcp_bandwidth":2000000000.0,"tcp_latency_s":0.00002}"#,
    )
    .unwrap();
}

fn plot(dirs: &[&Path], out: &Path) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_gradsync-bench"))
        .arg("plot")
        .args(dirs)
        .arg("--out")
        .arg(out)
        .output()
        .unwrap()
}

use gradsync_compare::charts::NAMES as CHARTS;
use gradsync_testkit::Scratch;

fn files(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut v: Vec<(String, Vec<u8>)> = std::fs::read_dir(dir)
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.path().is_file())
        .map(|e| (e.file_name().to_string_lossy().to_string(), std::fs::read(e.path()).unwrap()))
        .collect();
    v.sort();
    v
}

/// Plot `inputs` into `out`, which must succeed, and return its summary.csv.
fn plot_summary(inputs: &[&Path], out: &Path) -> String {
    let o = plot(inputs, out);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    std::fs::read_to_string(out.join("summary.csv")).unwrap()
}

#[test]
fn identical_input_gives_identical_output() {
    let root = tmp("same");
    fixture(&root.join("in"));
    let (a, b) = (root.join("a"), root.join("b"));
    for out in [&a, &b] {
        let o = plot(&[&root.join("in")], out);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    }
    let (fa, fb) = (files(&a), files(&b));
    assert_eq!(fa.iter().map(|f| &f.0).collect::<Vec<_>>(), fb.iter().map(|f| &f.0).collect::<Vec<_>>());
    for (x, y) in fa.iter().zip(&fb) {
        assert!(x.1 == y.1, "{} differs between two plots of the same input", x.0);
    }
    // Every chart, in both formats, and inlined in the report.
    let html = std::fs::read_to_string(a.join("report.html")).unwrap();
    for c in CHARTS {
        assert!(a.join(format!("{c}.svg")).is_file() && a.join(format!("{c}.png")).is_file(), "{c}");
        assert!(html.contains(&format!("<figure id=\"{c}\">")), "{c} not in the report");
    }
    assert_eq!(html.matches("<svg").count(), CHARTS.len());
    // The figures are read from the data: the fixture's ring at 2 workers is faster than its PS.
    assert!(
        html.contains(
            "Ring all-reduce over TCP sockets (ddp-tcp) against the best synchronous parameter server"
        ),
        "{html}"
    );
    assert!(html.contains("ps-asp k=1 (gRPC over TCP) at 2 workers: mean"), "staleness reading missing");
    // Titles name the network trained, not the preset it was fitted from.
    assert!(html.contains("(MLP 32-64-32-8, global batch 64)") && !html.contains("(tiny,"), "chart titles");
    let csv = std::fs::read_to_string(a.join("summary.csv")).unwrap();
    assert_eq!(csv.lines().count(), 1 + 6, "{csv}");
    assert!(csv.lines().any(|l| l.starts_with("runs/006-ddp-w2,ddp-tcp,2,0,")), "{csv}");
    // 20 steps per rank file, 20 server updates per PS run.
    let jl = std::fs::read_to_string(a.join("runs.jsonl")).unwrap();
    assert_eq!(jl.lines().count(), 20 * (1 + 1 + 3 * 2 + 2) + 3 * 20);
}

#[test]
fn bad_files_are_named_with_their_line_and_the_rest_plots() {
    let root = tmp("bad");
    let input = root.join("in");
    fixture(&input);
    // A corrupt record in the middle and a truncated last line.
    let p = input.join("runs/006-ddp-w2/rank1.jsonl");
    let mut text = std::fs::read_to_string(&p).unwrap();
    let mut lines: Vec<String> = text.lines().map(String::from).collect();
    lines[4] = "{\"kind\":\"step\",\"rank\":\"one\"}".into();
    text = lines.join("\n") + "\n{\"kind\":\"step\",\"ra";
    std::fs::write(&p, text).unwrap();
    // A file that is not metrics at all.
    std::fs::write(input.join("runs/notes.jsonl"), "hello\n").unwrap();
    let out = root.join("out");
    let o = plot(&[&input], &out);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(err.contains("runs/006-ddp-w2/rank1.jsonl:5:"), "{err}");
    assert!(err.contains("runs/006-ddp-w2/rank1.jsonl:22: truncated last line"), "{err}");
    assert!(err.contains("runs/notes.jsonl:1: not a metrics header"), "{err}");
    let html = std::fs::read_to_string(out.join("report.html")).unwrap();
    assert!(html.contains("Problems in the input") && html.contains("rank1.jsonl:5:"));
    let csv = std::fs::read_to_string(out.join("summary.csv")).unwrap();
    assert_eq!(csv.lines().count(), 1 + 6, "every run still summarised:\n{csv}");
}

#[test]
fn files_from_several_hosts_join_one_run() {
    // Two hosts' directories, each with one rank of the same DDP run.
    let root = tmp("hosts");
    let all = root.join("all");
    write_run(&all.join("run"), "ddp", "tcp", 2, 1_700_000_000_000, 8.0, 2.0, 1000, false);
    for r in 0..2 {
        let host = root.join(format!("host{r}"));
        std::fs::create_dir_all(&host).unwrap();
        std::fs::rename(all.join(format!("run/rank{r}.jsonl")), host.join(format!("rank{r}.jsonl"))).unwrap();
    }
    let csv = plot_summary(&[&root.join("host0"), &root.join("host1")], &root.join("out"));
    assert_eq!(csv.lines().count(), 2, "one run from two files:\n{csv}");
    assert!(csv.lines().nth(1).unwrap().contains(",ddp-tcp,2,0,"), "{csv}");
}

#[test]
fn a_missing_directory_is_an_error_naming_it() {
    let out = tmp("none");
    let o = plot(&[Path::new("/nonexistent/gradsync-runs")], &out.join("out"));
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("/nonexistent/gradsync-runs is not a directory"));
}

#[test]
fn back_to_back_runs_of_one_configuration_stay_apart() {
    // Two PS runs of the same configuration, the second starting as the first ends (as
    // `compare` runs them): each keeps its own workers and its own server.
    let root = tmp("b2b");
    let runs = root.join("in/runs");
    write_run(&runs.join("a"), "ps", "bsp", 2, 1_700_000_000_000, 5.0, 1.0, 100, false);
    write_run(&runs.join("b"), "ps", "bsp", 2, 1_700_000_000_000 + 101, 5.0, 1.0, 100, false);
    let csv = plot_summary(&[&root.join("in")], &root.join("out"));
    let rows: Vec<&str> = csv.lines().skip(1).collect();
    assert_eq!(rows.len(), 2, "{csv}");
    assert!(rows[0].starts_with("runs/a,ps-bsp,2,1,") && rows[1].starts_with("runs/b,ps-bsp,2,1,"), "{csv}");
}

#[test]
fn asp_workers_that_never_overlap_join_through_their_server() {
    // Under ASP a fast rank 0 may finish before rank 1 starts; the server served both.
    let root = tmp("asp-apart");
    let run = root.join("in/runs/asp");
    let start = 1_700_000_000_000u64;
    write_run(&run, "ps", "asp", 2, start, 5.0, 1.0, 100, true);
    // Rank 0 lives start..start+100; rank 1 from start+105; the server start+10..start+160.
    let shift = |file: &str, from: u64, to: u64| {
        let p = run.join(file);
        let text = std::fs::read_to_string(&p).unwrap();
        let (a, b) = (format!("\"start_unix_ms\":{from}"), format!("\"start_unix_ms\":{to}"));
        assert!(text.contains(&a), "{file}: {a} not found");
        std::fs::write(&p, text.replace(&a, &b)).unwrap();
    };
    shift("rank1.jsonl", start, start + 105);
    shift("server0.jsonl", start - 50, start + 10);
    let csv = plot_summary(&[&root.join("in")], &root.join("out"));
    let rows: Vec<&str> = csv.lines().skip(1).collect();
    assert_eq!(rows.len(), 1, "{csv}");
    assert!(rows[0].starts_with("runs/asp,ps-asp,2,1,"), "{csv}");
}
