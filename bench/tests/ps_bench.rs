//! `gradsync-bench ps` as a user runs it: the quick grid on loopback, and on emulated hosts
//! with shaped links (skipped with a visible message where namespaces cannot be made). The
//! figures must parse and obey the links: the raw stream runs at the shaped rate, and no row
//! moves its bytes faster than the busiest full-duplex link allows.
#![allow(clippy::unwrap_used)] // a test fails loudly on anything unexpected

use std::process::Command;

/// One row of the table: (MB, workers, shards, transport, ms/step, raw GB/s, x bound).
type Row = (f64, usize, usize, String, f64, f64, f64);

/// Run the benchmark with `args`; its stdout, after checking it exited 0.
fn bench(args: &[&str]) -> (String, u32) {
    let child = Command::new(env!("CARGO_BIN_EXE_gradsync-bench"))
        .arg("ps")
        .args(args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id();
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "gradsync-bench ps {args:?} failed: {stderr}");
    (String::from_utf8(out.stdout).unwrap(), pid)
}

fn rows(table: &str) -> Vec<Row> {
    table
        .lines()
        .filter(|l| l.starts_with('|'))
        .filter_map(|l| {
            let f: Vec<&str> = l.split('|').map(str::trim).collect();
            let num = |i: usize| f[i].parse::<f64>().ok();
            Some((
                num(1)?,
                f[2].parse().ok()?,
                f[3].parse().ok()?,
                f[4].to_string(),
                num(5)?,
                num(10)?,
                num(13)?,
            ))
        })
        .collect()
}

/// Every (workers, shards) group of the quick grid has the plain-sockets row and gradsync's two.
fn check_groups(rows: &[Row]) {
    for w in [1, 2] {
        for k in [1, 2] {
            for t in ["plain tcp", "tuned serial", "tuned"] {
                let n = rows.iter().filter(|r| r.1 == w && r.2 == k && r.3 == t).count();
                assert_eq!(n, 1, "{w} workers, {k} shards: {n} rows of {t}");
            }
        }
    }
    for r in rows {
        assert!(r.4 > 0.0 && r.5 > 0.0 && r.6.is_finite() && r.6 > 0.0, "a row with no figures: {r:?}");
    }
}

#[test]
fn quick_grid_on_loopback() {
    let (out, _) = bench(&["--quick", "--tuned-only"]);
    assert!(out.contains("links: loopback"), "{out}");
    assert!(out.contains("one round: every figure from a single run"), "{out}");
    let rows = rows(&out);
    check_groups(&rows);
}

/// `--rounds 2`: every row runs twice, interleaved, and each ratio against the plain row is
/// the median of the two rounds' ratios with their least and most.
#[test]
fn rounds_give_each_ratio_its_spread() {
    let (out, _) = bench(&["--quick", "--tuned-only", "--rounds", "2"]);
    assert!(out.contains("median of 2 interleaved rounds"), "{out}");
    check_groups(&rows(&out));
    let mut ranged = 0;
    for line in out.lines().filter(|l| l.starts_with('|')) {
        let f: Vec<&str> = line.split('|').map(str::trim).collect();
        if !f[4].starts_with("tuned") {
            continue;
        }
        for cell in [f[14], f[16]] {
            // "m (lo-hi)": the median of two rounds lies between them.
            let (m, range) = cell.split_once(" (").unwrap_or_else(|| panic!("no spread in {cell:?}: {line}"));
            let (lo, hi) = range.trim_end_matches(')').split_once('-').unwrap();
            let [m, lo, hi]: [f64; 3] = [m, lo, hi].map(|x| x.parse().unwrap());
            assert!(lo <= m && m <= hi && lo > 0.0, "{cell}: {line}");
            ranged += 1;
        }
    }
    assert_eq!(ranged, 2 * 2 * 4, "x plain and CPU x plain for both transports in four groups:\n{out}");
}

#[test]
fn zero_rounds_are_refused_naming_the_flag() {
    let out = Command::new(env!("CARGO_BIN_EXE_gradsync-bench"))
        .args(["ps", "--quick", "--rounds", "0"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && stderr.contains("--rounds"), "{stderr}");
}

#[test]
fn quick_grid_on_shaped_links_is_held_to_the_link() {
    if let Err(e) = gradsync_compare::net::available() {
        eprintln!("SKIPPED quick_grid_on_shaped_links_is_held_to_the_link: no emulated cluster here: {e}");
        return;
    }
    let (out, pid) = bench(&["--quick", "--tuned-only", "--link-gbit", "1"]);
    assert!(out.contains("links: emulated hosts"), "{out}");
    let rows = rows(&out);
    check_groups(&rows);
    for r in &rows {
        // 1 Gbit/s is 0.125 GB/s (printed to two decimals); unshaped, the same pair of
        // namespaces carries more than 1 GB/s.
        assert!((0.08..=0.14).contains(&r.5), "raw {} GB/s over a 1 Gbit/s link: {r:?}", r.5);
        // The bound counts the two directions one after the other; the links are full duplex,
        // so the busiest one allows half of it at best.
        assert!(r.6 > 0.45, "faster than the links allow: {r:?}");
    }
    let left = String::from_utf8_lossy(&Command::new("ip").args(["netns", "list"]).output().unwrap().stdout)
        .lines()
        .filter(|l| l.starts_with(&format!("gs-{pid}-")))
        .count();
    assert_eq!(left, 0, "the run left {left} namespaces");
}
