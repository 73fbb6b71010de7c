//! `gradsync-bench collective` as a user runs it, on small buffers: one process per rank by
//! default (and every rank process gone afterwards), threads with `--threads`, and on emulated
//! hosts where namespaces can be made. Checks that the figures parse and every reduction was
//! right; never how fast anything was.
#![allow(clippy::unwrap_used)] // a test fails loudly on anything unexpected

use std::process::Command;

/// Run `gradsync-bench collective` with `args` (gloo left out: it may not be installed),
/// its processes marked with `tag` in their environment; its stdout and stderr, after
/// checking it exited 0.
fn bench(tag: &str, args: &[&str]) -> (String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_gradsync-bench"))
        .env(TAG_VAR, format!("{tag}-{}", std::process::id()))
        .args(["collective", "--backend", "tcp", "--min-bytes", "4096", "--max-bytes", "65536"])
        .args(["--factor", "16", "--budget-bytes", "262144", "--raw-secs", "0.1", "--rounds", "2"])
        .arg("--no-gloo")
        .args(args)
        .output()
        .unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    );
    assert!(out.status.success(), "gradsync-bench collective {args:?} failed: {stderr}");
    (stdout, stderr)
}

/// (ranks, ranks as, transport, size, busbw, #wrong) per row of the table.
fn rows(table: &str) -> Vec<(usize, String, String, String, f64, usize)> {
    table
        .lines()
        .filter(|l| l.starts_with('|'))
        .filter_map(|l| {
            let f: Vec<&str> = l.split('|').map(str::trim).collect();
            Some((
                f[1].parse().ok()?,
                f[2].to_string(),
                f[4].to_string(),
                f[5].to_string(),
                f[8].parse().ok()?,
                f[12].parse().ok()?,
            ))
        })
        .collect()
}

/// Marks the processes of one test's run (rank processes inherit it), so that tests running
/// side by side do not count each other's.
const TAG_VAR: &str = "GRADSYNC_BENCH_TEST_TAG";

/// Processes still alive with `tag` in their environment: the rank processes a run started
/// and left behind.
fn processes_left(tag: &str) -> usize {
    let want = format!("{TAG_VAR}={tag}-{}", std::process::id());
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| std::fs::read(e.ok()?.path().join("environ")).ok())
        .filter(|env| env.split(|&b| b == 0).any(|kv| kv == want.as_bytes()))
        .count()
}

fn check(rows: &[(usize, String, String, String, f64, usize)], ranks_as: &str, transports: &[&str]) {
    for t in transports {
        for size in ["4 KB", "64 KB"] {
            let n = rows.iter().filter(|r| r.1 == ranks_as && &r.2 == t && r.3 == size).count();
            assert_eq!(n, 1, "{ranks_as}, {t}, {size}: {n} rows in {rows:?}");
        }
    }
    for r in rows {
        assert!(r.4 > 0.0, "a row without a bandwidth: {r:?}");
        assert_eq!(r.5, 0, "wrong values: {r:?}");
    }
}

#[test]
fn one_process_per_rank_by_default_and_none_left_behind() {
    let tag = "processes-by-default";
    let (out, _) = bench(tag, &["--ranks", "3", "--transport", "tcp,auto"]);
    let rows = rows(&out);
    check(&rows, "processes", &["tcp", "auto (shm)"]);
    assert!(out.contains("median of 2 interleaved rounds"), "{out}");
    assert_eq!(processes_left(tag), 0, "rank processes outlived the benchmark");
}

#[test]
fn threads_on_request_labelled_so() {
    let (out, _) = bench("threads", &["--ranks", "2", "--transport", "tcp", "--threads"]);
    check(&rows(&out), "threads", &["tcp"]);
}

#[test]
fn a_python_without_torch_skips_gloo_and_says_how_to_install_it() {
    let out = Command::new(env!("CARGO_BIN_EXE_gradsync-bench"))
        .args(["collective", "--backend", "tcp", "--transport", "tcp", "--ranks", "2"])
        .args(["--min-bytes", "4096", "--max-bytes", "4096", "--raw-secs", "0.1", "--rounds", "1"])
        .args(["--python", "/bin/false"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("gloo rows skipped") && stderr.contains("pip install torch"), "{stderr}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let backends: Vec<&str> =
        stdout.lines().filter_map(|l| l.split('|').nth(3).map(str::trim)).filter(|b| !b.is_empty()).collect();
    assert!(backends.contains(&"tcp") && !backends.contains(&"gloo"), "{stdout}");
}

#[test]
fn on_emulated_hosts_each_rank_keeps_to_its_link() {
    if let Err(e) = gradsync_bench::cluster::net::available() {
        eprintln!("SKIPPED on_emulated_hosts_each_rank_keeps_to_its_link: no emulated cluster here: {e}");
        return;
    }
    let tag = "emulated";
    let (out, _) = bench(tag, &["--ranks", "2", "--transport", "auto", "--link-gbit", "1"]);
    assert!(out.contains("emulated 1 Gbit/s hosts"), "{out}");
    // Ranks on different hosts cannot share memory: auto falls back to sockets.
    check(&rows(&out), "processes", &["auto (tcp)"]);
    assert_eq!(processes_left(tag), 0, "rank processes outlived the benchmark");
}
