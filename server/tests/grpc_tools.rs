//! What `grpc_health_probe` and `grpcurl` rely on, checked by an independent client: grpcio's
//! own health and reflection stubs in Python (`hostile/health_reflection.py`) against a real
//! `gradsync-server` process. Health/Check answers SERVING overall and for the service and
//! NOT_FOUND for an unknown one; reflection lists every service (v1 and v1alpha) and describes
//! the protocol; a Health/Watch stream sees NOT_SERVING once a Shutdown RPC arrives, and the
//! server still exits 0 with that stream open.
//!
//! Needs `python3` with `grpcio`, `grpcio-health-checking` and `grpcio-reflection`; without
//! them the test says so on stderr and passes without running.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

mod common;

use common::{python_has, start_server};

const TOKEN: &str = "tools-test-token";

#[test]
fn health_and_reflection_answer_an_independent_client() {
    if !python_has("grpc, grpc_health.v1.health_pb2, grpc_reflection.v1alpha.reflection_pb2") {
        eprintln!(
            "SKIPPED health_and_reflection_answer_an_independent_client: python3 with grpcio, \
             grpcio-health-checking and grpcio-reflection is missing (python3 -m pip install \
             grpcio grpcio-health-checking grpcio-reflection)"
        );
        return;
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).to_path_buf();
    let flags = ["--listen", "127.0.0.1:0", "--model", "tiny", "--token", TOKEN];
    let os_flags: Vec<&std::ffi::OsStr> = flags.iter().map(AsRef::as_ref).collect();
    let (mut server, addr) = start_server(&os_flags);

    let out = Command::new("python3")
        .arg(root.join("tests/hostile/health_reflection.py"))
        .arg(&addr)
        .arg(TOKEN)
        .output()
        .expect("running the health and reflection client");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "the client failed:\n{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    let mut seen = Vec::new();
    let mut failed = Vec::new();
    for l in stdout.lines() {
        let v: serde_json::Value = serde_json::from_str(l).expect("a JSON line");
        let case = v["case"].as_str().expect("case").to_string();
        if v["ok"] != serde_json::Value::Bool(true) {
            failed.push(format!("{case}: {}", v["detail"]));
        }
        seen.push(case);
    }
    assert!(failed.is_empty(), "checks failed:\n{}", failed.join("\n"));
    let expected = [
        "health_overall",
        "health_ps",
        "health_unknown_service",
        "reflection_list_v1alpha",
        "reflection_list_v1",
        "reflection_describe_service",
        "reflection_describe_message",
        "watch_serving",
        "watch_not_serving_on_shutdown",
    ];
    assert_eq!(seen, expected, "checks reported:\n{stdout}");

    // The Shutdown RPC stops the server: it exits 0 on its own.
    let deadline = Instant::now() + Duration::from_secs(20);
    let status = loop {
        if let Some(s) = server.child().try_wait().expect("try_wait") {
            break s;
        }
        assert!(Instant::now() < deadline, "the server did not exit after Shutdown");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(status.success(), "the server exited with {status}");
}
