//! Embeds the git commit gradsync-compare (and so gradsync-bench) was built from ("unknown"
//! outside a git checkout) so every run directory records the exact code that produced it.
//! Where there is no checkout (a container build's context has no `.git`), `GRADSYNC_COMMIT`
//! in the build's environment names it.

use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).output().ok()?;
    out.status.success().then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

fn main() {
    println!("cargo:rerun-if-env-changed=GRADSYNC_COMMIT");
    if let Ok(commit) = std::env::var("GRADSYNC_COMMIT")
        && !commit.trim().is_empty()
    {
        println!("cargo:rustc-env=GRADSYNC_COMMIT={}", commit.trim());
        return;
    }
    let commit = git(&["rev-parse", "--short=12", "HEAD"]).unwrap_or_else(|| "unknown".into());
    let dirty = git(&["status", "--porcelain", "--untracked-files=no"]).is_some_and(|s| !s.is_empty());
    println!("cargo:rustc-env=GRADSYNC_COMMIT={commit}{}", if dirty { "-dirty" } else { "" });
    // Rebuild when HEAD moves (a commit or a checkout), not on every build.
    for p in ["HEAD", "index"] {
        if let Some(path) = git(&["rev-parse", "--git-path", p]) {
            println!("cargo:rerun-if-changed={path}");
        }
    }
    println!("cargo:rerun-if-changed=build.rs");
}
