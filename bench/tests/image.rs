//! The container image (`deploy/Dockerfile`) for real: its binaries answer, a worker trains in
//! it, and two-rank DDP jobs run across containers on a network of their own, started with
//! the variables and arguments the Kubernetes manifests give them: PyTorchJob's `MASTER_ADDR`,
//! `MASTER_PORT`, `WORLD_SIZE`, `RANK` (one rank a pod) and TrainJob's `PET_*` (the launcher
//! in each pod). The ring token reaches the containers through the environment, never their
//! command lines, as from the manifests' Secret.
//!
//! Building the image takes 17 minutes on the 2-core development machine, too long for the
//! suite: the test runs only when asked. `GRADSYNC_IMAGE_TEST=build` builds the image first
//! (timed; it needs the base images, see deploy/offline-bases.sh where Docker Hub is out of
//! reach), `GRADSYNC_IMAGE_TEST=TAG` checks an image built before. Otherwise, or without a
//! container engine that answers (`docker`, or the program `DOCKER` names, such as podman),
//! it prints SKIPPED with the reason and passes.
#![allow(clippy::unwrap_used)] // a test fails loudly on anything unexpected

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use gradsync_testkit::Scratch;
use gradsync_testkit::process::Proc;

/// The container engine's client.
fn engine() -> String {
    std::env::var("DOCKER").unwrap_or_else(|_| "docker".into())
}

/// `engine ARGS` to its end within `limit`: exit code, stdout, stderr.
fn engine_run(args: &[&str], limit: Duration) -> (i32, String, String) {
    let mut c = Command::new(engine());
    c.args(args).stdout(Stdio::piped());
    let o = Proc::spawn(&mut c).output(limit);
    (
        o.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&o.stdout).to_string(),
        String::from_utf8_lossy(&o.stderr).to_string(),
    )
}

/// The image to check, or why there is none.
fn image() -> Result<String, String> {
    let asked = std::env::var("GRADSYNC_IMAGE_TEST").map_err(|_| {
        "set GRADSYNC_IMAGE_TEST=build (build deploy/Dockerfile, 17 min on 2 cores) or =TAG (an image built \
         before) to check the container image"
            .to_string()
    })?;
    let mut c = Command::new(engine());
    c.arg("info").stdout(Stdio::null()).stderr(Stdio::null()).stdin(Stdio::null());
    match c.status() {
        Ok(s) if s.success() => {}
        Ok(_) => return Err(format!("`{} info` fails: no container engine answers", engine())),
        Err(e) => return Err(format!("no container engine here ({}: {e})", engine())),
    }
    if asked != "build" {
        return Ok(asked);
    }
    let tag = "gradsync:test".to_string();
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let commit = Command::new("git").args(["rev-parse", "--short=12", "HEAD"]).current_dir(&root).output();
    let commit = commit.map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string()).unwrap_or_default();
    let t = Instant::now();
    let mut c = Command::new(engine());
    c.args(["build", "-f", "deploy/Dockerfile", "--build-arg"])
        .arg(format!("GRADSYNC_COMMIT={commit}"))
        .args(["-t", &tag, "."])
        .current_dir(&root)
        .stdout(Stdio::null());
    let (code, err, _) = Proc::spawn(&mut c).finish(Duration::from_secs(3600));
    assert_eq!(code, 0, "building the image failed:\n{err}");
    let (_, size, _) = engine_run(&["image", "inspect", "-f", "{{.Size}}", &tag], Duration::from_secs(60));
    eprintln!(
        "built {tag} in {:.0} s: {:.0} MB",
        t.elapsed().as_secs_f64(),
        size.trim().parse::<f64>().unwrap_or(0.0) / 1e6
    );
    Ok(tag)
}

/// The list of a manifest's `KEY:` (its first), one `- item` a line, as written in deploy/k8s.
fn manifest_list(file: &str, key: &str) -> Vec<String> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/k8s").join(file);
    let text = std::fs::read_to_string(&path).unwrap();
    let mut lines = text.lines().skip_while(|l| !l.trim_start().starts_with(key)).skip(1);
    let mut items = Vec::new();
    for l in lines.by_ref() {
        match l.trim_start().strip_prefix("- ") {
            Some(item) => items.push(item.split(" #").next().unwrap().trim().to_string()),
            None => break,
        }
    }
    assert!(!items.is_empty(), "no `{key}` list in {}", path.display());
    items
}

/// Containers and a network made by the test, removed when dropped.
struct Made {
    containers: Vec<String>,
    network: Option<String>,
}

impl Drop for Made {
    fn drop(&mut self) {
        for c in &self.containers {
            let _ = engine_run(&["rm", "-f", c], Duration::from_secs(60));
        }
        if let Some(n) = &self.network {
            let _ = engine_run(&["network", "rm", n], Duration::from_secs(60));
        }
    }
}

/// A directory the image's user (uid 1000) may write, for a container's runs volume.
fn volume(dir: &Scratch, name: &str) -> PathBuf {
    let d = dir.join(name);
    std::fs::create_dir_all(&d).unwrap();
    std::fs::set_permissions(&d, std::os::unix::fs::PermissionsExt::from_mode(0o777)).unwrap();
    d
}

/// The step records of a metrics file.
fn steps(path: &Path) -> usize {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    text.matches("\"kind\":\"step\"").count()
}

/// Start the pods of one job detached (each `(name, env, args)`), wait for all (at most
/// `limit` in all), and say how each ended.
fn run_pods(
    made: &mut Made,
    image: &str,
    network: &str,
    pods: &[(String, Vec<String>, PathBuf, Vec<String>)],
    limit: Duration,
) {
    for (name, env, vol, args) in pods {
        let mut a: Vec<String> = vec!["run".into(), "-d".into(), "--name".into(), name.clone()];
        a.extend(["--network".into(), network.into(), "--hostname".into(), name.clone()]);
        a.extend(["-v".into(), format!("{}:/home/gradsync/runs", vol.display())]);
        // The token from this process's environment, never on a command line.
        a.extend(["-e".into(), "GRADSYNC_RING_TOKEN".into()]);
        for e in env {
            a.extend(["-e".into(), e.clone()]);
        }
        a.push(image.into());
        a.extend(args.iter().cloned());
        let refs: Vec<&str> = a.iter().map(String::as_str).collect();
        let (code, _, err) = engine_run(&refs, Duration::from_secs(120));
        assert_eq!(code, 0, "starting {name}: {err}");
        made.containers.push(name.clone());
    }
    let until = Instant::now() + limit;
    for (name, ..) in pods {
        let left = until.saturating_duration_since(Instant::now()).max(Duration::from_secs(1));
        let (_, code, _) = engine_run(&["wait", name], left);
        let (_, logs, errs) = engine_run(&["logs", name], Duration::from_secs(60));
        assert_eq!(code.trim(), "0", "{name} exited with {}:\n{logs}{errs}", code.trim());
    }
}

#[test]
fn the_image_runs_the_worker_and_ddp_across_containers_as_the_manifests_start_it() {
    let image = match image() {
        Ok(i) => i,
        Err(why) => {
            eprintln!("SKIPPED: the container image: {why}");
            return;
        }
    };
    let t = Instant::now();
    // The three binaries, the same build.
    for (entry, name) in [
        ("gradsync-worker", "gradsync-worker"),
        ("gradsync-server", "gradsync-server"),
        ("gradsync-bench", "gradsync-bench"),
    ] {
        let (code, out, err) = engine_run(
            &["run", "--rm", "--entrypoint", entry, &image, "--version"],
            Duration::from_secs(120),
        );
        assert_eq!(code, 0, "{entry} --version: {err}");
        assert_eq!(out.trim(), format!("{name} {}", env!("CARGO_PKG_VERSION")));
    }
    // apt's lists and package caches were not left in the runtime stage's layer.
    let (code, out, _) = engine_run(
        &[
            "run",
            "--rm",
            "--entrypoint",
            "sh",
            &image,
            "-c",
            "ls /var/cache/apt/*.bin /var/lib/apt/lists/*Packages* 2>/dev/null",
        ],
        Duration::from_secs(120),
    );
    assert!(code != 0 && out.trim().is_empty(), "apt's caches are in the image: {out}");
    let dir = Scratch::new("image");
    // A short local training run, its metrics on a volume.
    let local = volume(&dir, "local");
    let (code, _, err) = engine_run(
        &[
            "run",
            "--rm",
            "-v",
            &format!("{}:/home/gradsync/runs", local.display()),
            &image,
            "train",
            "--mode=local",
            "--model=tiny",
            "--batch=32",
            "--steps=20",
            "--metrics=/home/gradsync/runs/rank0.jsonl",
        ],
        Duration::from_secs(300),
    );
    assert_eq!(code, 0, "local training in the image: {err}");
    assert_eq!(steps(&local.join("rank0.jsonl")), 20);

    let tag = format!("gs-image-{}", std::process::id());
    let mut made = Made { containers: Vec::new(), network: None };
    let (code, _, err) = engine_run(&["network", "create", &tag], Duration::from_secs(60));
    assert_eq!(code, 0, "creating a network: {err}");
    made.network = Some(tag.clone());
    let mut token = [0u8; 32];
    getrandom::fill(&mut token).unwrap();
    // SAFETY: set before any thread of this test reads the environment (the engine's clients
    // are started after it).
    unsafe {
        std::env::set_var(
            "GRADSYNC_RING_TOKEN",
            token.iter().map(|b| format!("{b:02x}")).collect::<String>(),
        );
    }

    // PyTorchJob: a Master and a Worker pod, one rank each, with the operator's variables and
    // the manifest's arguments (fewer steps).
    let args: Vec<String> = manifest_list("pytorchjob-ddp.yaml", "args: &train")
        .into_iter()
        .map(|a| if a.starts_with("--steps=") { "--steps=20".into() } else { a })
        .collect();
    let master = format!("{tag}-master-0");
    let pods: Vec<_> = (0..2)
        .map(|rank| {
            let name = if rank == 0 { master.clone() } else { format!("{tag}-worker-0") };
            let env = vec![
                format!("MASTER_ADDR={master}"),
                "MASTER_PORT=23456".into(),
                "WORLD_SIZE=2".into(),
                format!("RANK={rank}"),
            ];
            (name, env, volume(&dir, &format!("pytorchjob-{rank}")), args.clone())
        })
        .collect();
    run_pods(&mut made, &image, &tag, &pods, Duration::from_secs(300));
    for rank in 0..2 {
        assert_eq!(
            steps(&dir.join(format!("pytorchjob-{rank}/rank{rank}.jsonl"))),
            20,
            "PyTorchJob rank {rank}"
        );
    }

    // TrainJob: two pods, each `gradsync-worker launch` (the manifest's command and
    // arguments) reading the torch runtime's PET_* variables; one rank a pod, over the TCP
    // ring (this machine has no GPU for the manifest's NCCL).
    let command = manifest_list("trainjob-ddp.yaml", "command:");
    assert_eq!(command, ["gradsync-worker"]);
    let args: Vec<String> = manifest_list("trainjob-ddp.yaml", "args:")
        .into_iter()
        .map(|a| match a.as_str() {
            "--backend=nccl" => "--backend=tcp".into(),
            s if s.starts_with("--steps=") => "--steps=5".into(),
            _ => a,
        })
        .collect();
    assert_eq!(args[0], "launch");
    let node0 = format!("{tag}-node-0");
    let pods: Vec<_> = (0..2)
        .map(|node| {
            let env = vec![
                "PET_NNODES=2".into(),
                "PET_NPROC_PER_NODE=1".into(),
                format!("PET_NODE_RANK={node}"),
                format!("PET_MASTER_ADDR={node0}"),
                "PET_MASTER_PORT=29400".into(),
            ];
            (format!("{tag}-node-{node}"), env, volume(&dir, &format!("trainjob-{node}")), args.clone())
        })
        .collect();
    run_pods(&mut made, &image, &tag, &pods, Duration::from_secs(600));
    for node in 0..2 {
        assert_eq!(steps(&dir.join(format!("trainjob-{node}/rank{node}.jsonl"))), 5, "TrainJob node {node}");
    }
    drop(made);
    eprintln!("the image {image}: checked in {:.0} s", t.elapsed().as_secs_f64());
}
