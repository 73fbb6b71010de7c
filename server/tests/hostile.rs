//! Hostile input against a real `gradsync-server` process: an independent Python client
//! (grpcio, stubs generated from `proto/proto` at test time, see `hostile/hostile_client.py`)
//! sends malformed and hostile requests. Every case must get its expected status, the server
//! must stay up and healthy with bounded memory, and the parameters must be untouched.
//!
//! Needs `python3` with `grpcio` and `grpcio-tools`; without them the test says so on stderr
//! and passes without running (install with `python3 -m pip install grpcio grpcio-tools`).

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

use clap::Parser;
use gradsync_core::model::{Layout, init_params};
use gradsync_server::{Config, ServerArgs};

mod common;

use common::{python_has, start_server};

const TOKEN: &str = "hostile-test-token";

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    args: ServerArgs,
}

/// Resident memory of `pid`, KiB.
fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("reading /proc/PID/status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS in /proc/PID/status")
}

#[test]
fn hostile_grpc_client_is_refused_and_changes_nothing() {
    if !python_has("grpc, grpc_tools.protoc") {
        eprintln!(
            "SKIPPED hostile_grpc_client_is_refused_and_changes_nothing: python3 with grpcio and \
             grpcio-tools is missing (python3 -m pip install grpcio grpcio-tools)"
        );
        return;
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("workspace root").to_path_buf();
    let work = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("hostile-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&work);
    std::fs::create_dir_all(&work).expect("temp dir");
    let proto_dir = root.join("proto/proto");
    let gen_ok = Command::new("python3")
        .args(["-m", "grpc_tools.protoc", "-I"])
        .arg(&proto_dir)
        .arg(format!("--python_out={}", work.display()))
        .arg(format!("--grpc_python_out={}", work.display()))
        .arg(proto_dir.join("gradsync/ps/v1/ps.proto"))
        .status()
        .expect("running grpc_tools.protoc");
    assert!(gen_ok.success(), "generating Python stubs failed");

    let flags = ["--listen", "127.0.0.1:0", "--model", "tiny", "--seed", "42", "--sync", "bsp"];
    let flags = [&flags[..], &["--worker-timeout", "2", "--token", TOKEN]].concat();
    let cfg = Config::from_args(
        &Cli::parse_from(std::iter::once("gradsync-server").chain(flags.iter().copied())).args,
    )
    .expect("server flags");
    let os_flags: Vec<&std::ffi::OsStr> = flags.iter().map(AsRef::as_ref).collect();
    let (mut server, addr) = start_server(&os_flags);
    let pid = server.id();
    let rss_before = rss_kib(pid);

    let params_out = work.join("params.f32");
    let out = Command::new("python3")
        .arg(root.join("server/tests/hostile/hostile_client.py"))
        .arg(&work)
        .arg(&addr)
        .arg(TOKEN)
        .arg(&cfg.fingerprint().text)
        .arg(&params_out)
        .output()
        .expect("running the hostile client");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "hostile client failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );

    let got: BTreeMap<String, (String, String)> = stdout
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).expect("a JSON line");
            let s = |k: &str| v[k].as_str().expect("string field").to_string();
            (s("case"), (s("code"), s("detail")))
        })
        .collect();
    let inv = "INVALID_ARGUMENT";
    let expected = [
        ("no_token", "UNAUTHENTICATED"),
        ("wrong_token", "UNAUTHENTICATED"),
        ("not_bearer", "UNAUTHENTICATED"),
        ("wrong_fingerprint", "FAILED_PRECONDITION"),
        ("absurd_world", inv),
        ("zero_world", inv),
        ("rank_not_below_world", inv),
        ("push_unregistered", "FAILED_PRECONDITION"),
        ("register", "OK"),
        ("registration_flood", "ALREADY_EXISTS|INVALID_ARGUMENT"),
        ("empty_stream", inv),
        ("truncated_stream", inv),
        ("absurd_offset", inv),
        ("max_offset", inv),
        ("out_of_order", inv),
        ("overlapping", inv),
        ("overrun", inv),
        ("ragged_chunk", inv),
        ("nan_gradient", inv),
        ("rank_changes_midstream", inv),
        ("oversized_message", "OUT_OF_RANGE"),
        ("stalled_stream", inv),
        ("truncated_flood", inv),
        ("garbage_bytes", "OK"),
        ("deregister", "OK"),
        ("healthy_after", "OK"),
        ("params_unchanged", "OK"),
    ];
    let mut wrong = Vec::new();
    for (case, code) in expected {
        match got.get(case) {
            Some((c, _)) if c == code => {}
            Some((c, d)) => wrong.push(format!("{case}: got {c} ({d}), expected {code}")),
            None => wrong.push(format!("{case}: not reported")),
        }
    }
    assert!(
        wrong.is_empty(),
        "hostile cases answered wrongly:\n{}\nfull output:\n{stdout}",
        wrong.join("\n")
    );
    assert_eq!(got.len(), expected.len(), "unexpected extra cases:\n{stdout}");

    // Still up, and its memory bounded: nothing a peer declared was allocated.
    assert!(server.child().try_wait().expect("try_wait").is_none(), "the server died");
    let rss_after = rss_kib(pid);
    assert!(
        rss_after < rss_before + 64 * 1024,
        "server RSS grew from {rss_before} KiB to {rss_after} KiB under hostile input"
    );

    // The parameters are exactly the initial ones, computed here independently.
    let bytes = std::fs::read(&params_out).expect("pulled parameters");
    let pulled: Vec<f32> =
        bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
    let init = init_params(&Layout::new(&cfg.spec), cfg.seed);
    assert_eq!(pulled, init, "parameters changed under hostile input");
    eprintln!("hostile: {} cases refused as expected; RSS {rss_before} -> {rss_after} KiB", expected.len());
    let _ = std::fs::remove_dir_all(&work);
}
