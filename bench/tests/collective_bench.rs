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
    let sizes = ["--min-bytes", "4096", "--max-bytes", "65536", "--factor", "16", "--budget-bytes", "262144"];
    bench_sized(tag, &sizes, args)
}

/// [`bench`] with the sizes (and budget) flags given.
fn bench_sized(tag: &str, sizes: &[&str], args: &[&str]) -> (String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_gradsync-bench"))
        .env(TAG_VAR, format!("{tag}-{}", std::process::id()))
        .args(["collective", "--backend", "tcp"])
        .args(sizes)
        .args(["--raw-secs", "0.1", "--rounds", "2"])
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

/// (ranks, ranks as, transport, size, busbw, #wrong, all-reduce, vs flat ring, of plain, CPU
/// s/GB) per row of gradsync's own (backend tcp) in the table.
type Row = (usize, String, String, String, f64, usize, String, String, String, String);

fn rows(table: &str) -> Vec<Row> {
    backend_rows(table, "tcp")
}

/// The table's rows of `backend` (tcp: gradsync's; gloo; plain).
fn backend_rows(table: &str, backend: &str) -> Vec<Row> {
    table
        .lines()
        .filter(|l| l.starts_with('|'))
        .filter_map(|l| {
            let f: Vec<&str> = l.split('|').map(str::trim).collect();
            (f[3] == backend).then_some(())?;
            Some((
                f[1].parse().ok()?,
                f[2].to_string(),
                f[4].to_string(),
                f[6].to_string(),
                f[9].parse().ok()?,
                f[15].parse().ok()?,
                f[5].to_string(),
                f[14].to_string(),
                f[11].to_string(),
                f[16].to_string(),
            ))
        })
        .collect()
}

/// "87% (80-95)": the median, least and most of a row's busbw over plain sockets', percent.
fn percent_range(cell: &str) -> [f64; 3] {
    let (med, range) = cell.split_once("% (").unwrap_or_else(|| panic!("not a percent range: {cell:?}"));
    let (lo, hi) = range.trim_end_matches(')').split_once('-').unwrap();
    [med, lo, hi].map(|v| v.parse().unwrap())
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

/// The chunk a flat ring on sockets of `ranks` ranks on this machine cuts when none is asked
/// for: 256 KiB where they outnumber its cores, else 1024.
fn flat_socket_chunk_kb(ranks: usize) -> usize {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    if ranks > cores { 256 } else { 1024 }
}

fn check(rows: &[Row], ranks_as: &str, transports: &[&str]) {
    for t in transports {
        for size in ["4 KB", "64 KB"] {
            let n = rows.iter().filter(|r| r.1 == ranks_as && &r.2 == t && r.3 == size).count();
            assert_eq!(n, 1, "{ranks_as}, {t}, {size}: {n} rows in {rows:?}");
        }
    }
    for r in rows {
        assert!(r.4 > 0.0, "a row without a bandwidth: {r:?}");
        assert_eq!(r.5, 0, "wrong values: {r:?}");
        // The machine's busy time per GB moved, read from /proc/stat by rank 0 (a short
        // loop may fall within one clock tick: 0).
        let cpu: f64 = r.9.parse().unwrap_or_else(|_| panic!("no CPU s/GB: {r:?}"));
        assert!(cpu.is_finite() && cpu >= 0.0, "{r:?}");
    }
}

#[test]
fn one_process_per_rank_by_default_and_none_left_behind() {
    let tag = "processes-by-default";
    let (out, _) = bench(tag, &["--ranks", "3", "--transport", "tcp,auto"]);
    let rows = rows(&out);
    check(&rows, "processes", &["tcp", "auto (shm)"]);
    assert!(out.contains("median of 2 interleaved rounds"), "{out}");
    // Plain sockets moved the same bytes per rank around the ring, checked, one row per size,
    // and every row of gradsync's is set against them.
    let plain = backend_rows(&out, "plain");
    check(&plain, "processes", &["tcp"]);
    assert!(plain.iter().all(|r| r.8 == "100% (100-100)"), "{plain:?}");
    for r in &rows {
        let [med, lo, hi] = percent_range(&r.8);
        assert!(lo > 0.0 && lo <= med && med <= hi, "{r:?}");
    }
    assert_eq!(processes_left(tag), 0, "rank processes outlived the benchmark");
}

#[test]
fn no_plain_leaves_the_plain_rows_out() {
    let (out, _) = bench("no-plain", &["--ranks", "2", "--transport", "tcp", "--no-plain"]);
    check(&rows(&out), "processes", &["tcp"]);
    assert!(backend_rows(&out, "plain").is_empty(), "{out}");
    assert!(rows(&out).iter().all(|r| r.8.is_empty()), "{out}");
}

#[test]
fn threads_on_request_labelled_so() {
    let (out, _) = bench("threads", &["--ranks", "2", "--transport", "tcp", "--threads"]);
    check(&rows(&out), "threads", &["tcp"]);
}

#[test]
fn a_python_without_torch_fails_when_given_and_skips_gloo_otherwise() {
    let run = |extra: &[&str], home: &std::path::Path| {
        Command::new(env!("CARGO_BIN_EXE_gradsync-bench"))
            .args(["collective", "--backend", "tcp", "--transport", "tcp", "--ranks", "2"])
            .args(["--min-bytes", "4096", "--max-bytes", "4096", "--raw-secs", "0.1", "--rounds", "1"])
            .args(extra)
            .env("HOME", home)
            .env_remove("GRADSYNC_PYTHON")
            .output()
            .unwrap()
    };
    // Asked for with --python: gloo rows that cannot be measured fail the run, saying why.
    let home = gradsync_testkit::Scratch::new("no-torch-home");
    let out = run(&["--python", "/bin/false"], &home);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.contains("/bin/false") && stderr.contains("pip install torch"), "{stderr}");
    // Not asked for, and no conventional environment: skipped, with how to get one.
    let out = run(&[], &home);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("gloo rows skipped") && stderr.contains("pip install torch"), "{stderr}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let backends: Vec<&str> =
        stdout.lines().filter_map(|l| l.split('|').nth(3).map(str::trim)).filter(|b| !b.is_empty()).collect();
    assert!(backends.contains(&"tcp") && !backends.contains(&"gloo"), "{stdout}");
}

/// With --python, a gloo script found nowhere is an error naming every folder looked in.
#[test]
fn a_missing_gloo_script_with_python_is_an_error_naming_where_it_looked() {
    let dir = gradsync_testkit::Scratch::new("no-script");
    let python = fake_gloo_python(&dir);
    let out = Command::new(env!("CARGO_BIN_EXE_gradsync-bench"))
        .args(["collective", "--backend", "tcp", "--transport", "tcp", "--ranks", "2", "--no-plain"])
        .args(["--min-bytes", "4096", "--max-bytes", "4096", "--raw-secs", "0.1", "--rounds", "1"])
        .arg("--python")
        .arg(&python)
        .current_dir(&dir)
        .env_remove("GRADSYNC_PYTORCH_DIR")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.contains("allreduce.py was not found"), "{stderr}");
    assert!(stderr.contains(&dir.join("bench/pytorch").display().to_string()), "{stderr}");
}

#[test]
fn on_emulated_hosts_each_rank_keeps_to_its_link() {
    if let Err(e) = gradsync_compare::net::available() {
        eprintln!("SKIPPED on_emulated_hosts_each_rank_keeps_to_its_link: no emulated cluster here: {e}");
        return;
    }
    let tag = "emulated";
    let (out, _) = bench(tag, &["--ranks", "2", "--transport", "auto", "--link-gbit", "1"]);
    assert!(out.contains("emulated 1 Gbit/s hosts"), "{out}");
    // Ranks on different hosts cannot share memory: auto falls back to sockets.
    let rows = rows(&out);
    check(&rows, "processes", &["auto (tcp)"]);
    let want = format!("auto: ring, {} KiB chunks", flat_socket_chunk_kb(2));
    assert!(rows.iter().all(|r| r.6 == want), "{want}: {out}");
    assert_eq!(processes_left(tag), 0, "rank processes outlived the benchmark");
}

#[test]
fn several_ranks_per_emulated_host_reduce_through_the_hosts_beside_the_flat_ring() {
    let test = "several_ranks_per_emulated_host_reduce_through_the_hosts_beside_the_flat_ring";
    if let Err(e) = gradsync_compare::net::available() {
        eprintln!("SKIPPED {test}: no emulated cluster here: {e}");
        return;
    }
    let tag = "per-host";
    // 1, 3, 9, ... 729 and 1001 values: none divisible by the ranks or hosts but the first.
    let sizes = ["--min-bytes", "4", "--max-bytes", "4004", "--factor", "3", "--budget-bytes", "4096"];
    let args = ["--ranks", "2,4,6", "--ranks-per-host", "2", "--link-gbit", "10", "--transport", "auto"];
    let args = [&args[..], &["--hierarchy", "off,auto"]].concat();
    let (out, _) = bench_sized(tag, &sizes, &args);
    assert!(out.contains("2 ranks each"), "{out}");
    let rows = rows(&out);
    assert_eq!(rows.len(), 3 * 2 * 8, "{out}");
    for r in &rows {
        assert_eq!(r.5, 0, "wrong values: {r:?}");
        // The flat ring on sockets cuts smaller chunks where the ranks outnumber the cores.
        let sockets = format!("off: ring, {} KiB chunks", flat_socket_chunk_kb(r.0));
        let want = match (r.0, r.6.starts_with("off")) {
            // Two ranks on one host: the flat ring on shared memory, whatever the flag.
            (2, true) => ("auto (shm)", "off: ring, 1024 KiB chunks"),
            (2, false) => ("auto (shm)", "auto: ring, 1024 KiB chunks"),
            (_, true) => ("auto (tcp)", sockets.as_str()),
            (4, false) => ("auto (shm)", "auto: hier, 2 hosts, 1024 KiB chunks"),
            (_, false) => ("auto (shm)", "auto: hier, 3 hosts, 1024 KiB chunks"),
        };
        assert_eq!((r.2.as_str(), r.6.as_str()), want, "{r:?}");
        // A hierarchical row says how it fared against the flat ring of the same rounds:
        // "1.23x (1.10-1.40)", the median inside the range; a ring row says nothing.
        if r.6.contains("hier") {
            let (med, range) = r.7.split_once("x (").unwrap_or_else(|| panic!("{r:?}"));
            let (lo, hi) = range.trim_end_matches(')').split_once('-').unwrap();
            let [med, lo, hi]: [f64; 3] = [med, lo, hi].map(|v| v.parse().unwrap());
            assert!(lo > 0.0 && lo <= med && med <= hi, "{r:?}");
        } else {
            assert!(r.7.is_empty(), "{r:?}");
        }
    }
    assert_eq!(processes_left(tag), 0, "rank processes outlived the benchmark");
}

/// A stand-in for a Python with torch (the gloo rows' timings are its fixed 1 ms, not gloo's):
/// it says gloo is there, and as a rank prints where rank 0 "listens" and one row per size, as
/// `bench/pytorch/allreduce.py` does.
fn fake_gloo_python(dir: &std::path::Path) -> std::path::PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let path = dir.join("python");
    std::fs::write(
        &path,
        "#!/bin/sh\n[ \"$1\" = -c ] && exit 0\nrank=; sizes=\n\
         while [ $# -gt 0 ]; do case \"$1\" in --rank) rank=$2; shift;; --sizes) sizes=$2; shift;; esac; shift; done\n\
         [ \"$rank\" = 0 ] && echo '{\"listening\": \"127.0.0.1:9\"}'\n\
         for b in $(echo \"$sizes\" | tr , ' '); do echo \"{\\\"bytes\\\": $b, \\\"seconds\\\": 0.001, \\\"wrong\\\": 0}\"; done\n",
    )
    .unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    path
}

/// `vs gloo` is the ratio of the medians, with the least and most of the rounds' own ratios
/// beside it once there are several rounds (never on gloo's own row).
#[test]
fn vs_gloo_shows_the_rounds_spread() {
    let dir = gradsync_testkit::Scratch::new("fake-gloo");
    let python = fake_gloo_python(&dir);
    let run = |rounds: &str| {
        let out = Command::new(env!("CARGO_BIN_EXE_gradsync-bench"))
            .args(["collective", "--backend", "tcp", "--transport", "tcp", "--ranks", "2", "--no-plain"])
            .args(["--min-bytes", "65536", "--max-bytes", "65536", "--raw-secs", "0.1", "--rounds", rounds])
            .arg("--python")
            .arg(&python)
            .args(["--pytorch-dir", concat!(env!("CARGO_MANIFEST_DIR"), "/pytorch")])
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        // (backend, vs gloo) per row.
        let cells: Vec<(String, String)> = stdout
            .lines()
            .filter(|l| l.starts_with('|'))
            .map(|l| l.split('|').map(str::trim).collect::<Vec<_>>())
            .filter(|f| f[3] == "tcp" || f[3] == "gloo")
            .map(|f| (f[3].to_string(), f[13].to_string()))
            .collect();
        assert_eq!(cells.len(), 2, "{stdout}");
        cells
    };
    for (backend, cell) in run("3") {
        if backend == "gloo" {
            assert_eq!(cell, "1.00x");
            continue;
        }
        let (ratio, range) = cell.split_once("x (").unwrap_or_else(|| panic!("no spread: {cell:?}"));
        let (lo, hi) = range.trim_end_matches(')').split_once('-').unwrap();
        let [ratio, lo, hi]: [f64; 3] = [ratio, lo, hi].map(|x| x.parse().unwrap());
        // With gloo's time fixed, the ratio of the medians is the median of the ratios.
        assert!(lo <= ratio && ratio <= hi && lo > 0.0, "{cell}");
    }
    for (_, cell) in run("1") {
        assert!(cell.ends_with('x') && !cell.contains('('), "one round has no spread: {cell:?}");
    }
}
