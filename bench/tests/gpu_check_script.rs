//! `scripts/gpu-check.sh` runs on GPU machines lent for minutes at a time, where a flag error
//! costs a whole lease. Every gradsync command line it would run (`--print-commands`, which
//! runs nothing) is parsed here by the binary's own command-line types, as the binary parses
//! it, so a flag given twice or misspelt fails on any machine.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::Command;

use clap::Parser;

const SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts/gpu-check.sh");

/// The command lines `phase` would run, each split into its arguments.
fn commands(phase: &str) -> Vec<Vec<String>> {
    let out = Command::new("bash").arg(SCRIPT).args(["--print-commands", phase]).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "gpu-check.sh --print-commands {phase} failed: {stderr}");
    assert!(stderr.trim().is_empty(), "gpu-check.sh --print-commands {phase} complained: {stderr}");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| l.split('\x1f').map(str::to_owned).collect())
        .collect()
}

fn name(arg: &str) -> &str {
    arg.rsplit('/').next().unwrap_or(arg)
}

/// Parse the gradsync command inside `argv` (from its binary on: a sanitizer or profiler may
/// come first) as that binary does; `None` for a command that runs no gradsync binary.
fn parse(argv: &[String]) -> Option<(&'static str, Result<(), String>)> {
    let at = argv.iter().position(|a| name(a).starts_with("gradsync-"))?;
    let args = &argv[at..];
    let err = |e: clap::Error| e.to_string();
    Some(match name(&args[0]) {
        "gradsync-worker" => ("gradsync-worker", parse_worker(args)),
        "gradsync-server" => {
            ("gradsync-server", gradsync_server::Cli::try_parse_from(args).map(drop).map_err(err))
        }
        "gradsync-bench" => {
            ("gradsync-bench", gradsync_bench::cli::Cli::try_parse_from(args).map(drop).map_err(err))
        }
        other => panic!("an unknown gradsync binary {other} in {argv:?}"),
    })
}

/// A worker command; under `launch`, the command each rank runs too.
fn parse_worker(args: &[String]) -> Result<(), String> {
    use gradsync_worker::cli::{Cli, Command};
    let cli = Cli::try_parse_from(args).map_err(|e| e.to_string())?;
    if let Command::Launch(l) = cli.command {
        if l.cmd.first().map(String::as_str) != Some("train") {
            return Err(format!("launch runs {:?}, not this worker's train", l.cmd));
        }
        let rank = std::iter::once("gradsync-worker".to_string()).chain(l.cmd);
        Cli::try_parse_from(rank).map_err(|e| format!("a launched rank's command: {e}"))?;
    }
    Ok(())
}

/// Every command of `phase` that runs a gradsync binary parses; returns how many each binary
/// got.
fn check_phase(phase: &str) -> std::collections::BTreeMap<&'static str, usize> {
    let mut counts = std::collections::BTreeMap::new();
    let mut errors = Vec::new();
    for argv in commands(phase) {
        let Some((bin, parsed)) = parse(&argv) else { continue };
        *counts.entry(bin).or_insert(0) += 1;
        if let Err(e) = parsed {
            errors.push(format!("{}\n  -> {}", argv.join(" "), e.lines().next().unwrap_or_default()));
        }
    }
    assert!(
        errors.is_empty(),
        "gpu-check.sh {phase}: command lines the binaries refuse:\n{}",
        errors.join("\n")
    );
    counts
}

#[test]
fn every_correctness_command_parses() {
    let counts = check_phase("correctness");
    assert!(counts.get("gradsync-worker").copied().unwrap_or(0) >= 10, "{counts:?}");
    assert!(counts.get("gradsync-server").copied().unwrap_or(0) >= 2, "{counts:?}");
    assert!(counts.get("gradsync-bench").copied().unwrap_or(0) >= 8, "{counts:?}");
    // The sanitizer wraps a worker: its command line is parsed too.
    let all = commands("correctness");
    let sanitized =
        all.iter().find(|c| name(&c[0]) == "compute-sanitizer").expect("a compute-sanitizer check");
    assert!(sanitized.iter().any(|a| name(a) == "gradsync-worker"), "{sanitized:?}");
}

#[test]
fn every_bench_command_parses() {
    let counts = check_phase("bench");
    assert!(counts.get("gradsync-bench").copied().unwrap_or(0) >= 5, "{counts:?}");
    // ddp-nccl runs at one worker only: NCCL refuses two ranks on one GPU.
    for c in commands("bench").iter().filter(|c| c.iter().any(|a| a.contains("ddp-nccl"))) {
        let workers = c.iter().position(|a| a == "--workers").map(|i| c[i + 1].as_str());
        assert_eq!(workers, Some("1"), "{c:?}");
    }
}

/// GPU_CHECK_ONLY keeps the checks it names and nothing else: the embedding checks of the
/// correctness phase (training runs on each device, over NCCL, on a PS and in the hybrid, and
/// their cross-checks), and no other command.
#[test]
fn gpu_check_only_runs_the_checks_it_names() {
    let out = Command::new("bash")
        .arg(SCRIPT)
        .args(["--print-commands", "correctness"])
        .env("GPU_CHECK_ONLY", "EMBEDDING")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let lines: Vec<String> =
        String::from_utf8_lossy(&out.stdout).lines().map(|l| l.replace('\x1f', " ")).collect();
    assert!(lines.iter().all(|l| l.contains("emb")), "{lines:#?}");
    // Local on each device, DDP over NCCL, PS and hybrid runs, and a cross-check of each.
    assert_eq!(lines.iter().filter(|l| l.contains(" diff ")).count(), 4, "{lines:#?}");
    assert!(lines.iter().all(|l| !l.contains("--model tiny")), "{lines:#?}");
    let all = commands("correctness");
    assert!(all.len() > 20, "without GPU_CHECK_ONLY every check is listed: {}", all.len());
}

/// What the check above relies on: a flag given twice (the memcheck step's `--steps`, once in
/// the shared arguments and once more) is refused by the parser.
#[test]
fn a_flag_given_twice_is_refused() {
    let argv: Vec<String> =
        ["gradsync-worker", "train", "--steps", "40", "--device", "cuda", "--steps", "10"]
            .map(String::from)
            .into();
    let (_, parsed) = parse(&argv).unwrap();
    let e = parsed.unwrap_err();
    assert!(e.contains("--steps") && e.contains("cannot be used multiple times"), "{e}");
}

#[test]
fn a_phase_that_does_not_exist_is_refused() {
    let out = Command::new("bash").arg(SCRIPT).args(["--print-commands", "everything"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("usage: scripts/gpu-check.sh [--print-commands]"));
}
