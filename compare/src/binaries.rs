//! The gradsync binaries a host or node runs a comparison's processes with, and the check of
//! them there at the start: this machine's three ([`BINARIES`]) with what tells one build from
//! another (`--version` and the SHA-256 of the file), the script a host or node runs (each
//! binary's identity in its binaries' directory, then [`FACTS_SCRIPT`]), reading its answer,
//! and `--copy-binaries`: this machine's binaries put there ([`Site::put`]) where they are
//! missing or another build, then checked again. `compare --hosts` ([`crate::ssh`]) and
//! `compare --slurm` ([`crate::slurm`]) check their sites with it.

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::Context;
use sha2::Digest;

use crate::child::run_limited;
use crate::modes::Bins;
use crate::site::{FACTS_SCRIPT, HostFacts, Site, quote, read_facts};

/// The binaries every host or node must have, in the same build as this machine's.
pub const BINARIES: [&str; 3] = ["gradsync-worker", "gradsync-server", "gradsync-bench"];

/// The flag that puts this machine's binaries where they are missing: every refusal names it.
pub const COPY_FLAG: &str = "--copy-binaries";

/// This machine's binaries, and what identifies their build.
#[derive(Debug, Clone)]
pub struct LocalBinaries {
    /// Their paths here, in the order of [`BINARIES`].
    pub paths: [PathBuf; 3],
    /// Each one's name, `--version` line and SHA-256, in that order.
    pub expected: Vec<(String, String, String)>,
}

impl LocalBinaries {
    /// `bins`' worker and server, and the gradsync-bench beside them (else this running
    /// program), each run for its version and hashed.
    pub fn of(bins: &Bins) -> anyhow::Result<LocalBinaries> {
        let dir = bins.worker.parent().unwrap_or(Path::new("."));
        let bench = dir.join("gradsync-bench");
        let bench = if bench.is_file() {
            bench
        } else {
            std::env::current_exe().context("locating gradsync-bench")?
        };
        LocalBinaries::read([bins.worker.clone(), bins.server.clone(), bench])
    }

    /// The binaries at `paths` (in the order of [`BINARIES`]), each run for its version and
    /// hashed.
    pub fn read(paths: [PathBuf; 3]) -> anyhow::Result<LocalBinaries> {
        let mut expected = Vec::new();
        for (b, p) in BINARIES.iter().zip(&paths) {
            let (version, sha) = identity(p).with_context(|| format!("this machine's {b}"))?;
            expected.push((b.to_string(), version, sha));
        }
        Ok(LocalBinaries { paths, expected })
    }

    /// Their size in bytes, for messages.
    fn bytes(&self) -> u64 {
        self.paths.iter().filter_map(|p| std::fs::metadata(p).ok()).map(|m| m.len()).sum()
    }
}

/// What one binary here is: its `--version` line and SHA-256.
fn identity(path: &Path) -> anyhow::Result<(String, String)> {
    let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    let sha = sha2::Sha256::digest(&bytes).iter().map(|b| format!("{b:02x}")).collect();
    let mut c = Command::new(path);
    c.arg("--version");
    let out = run_limited(c, None, Duration::from_secs(30))
        .with_context(|| format!("{} --version", path.display()))?;
    Ok((String::from_utf8_lossy(&out.stdout).trim().to_string(), sha))
}

/// What the check prints on a host or node, one `key value` a line: each binary of `bin_dir`
/// (`bin NAME SHA256 VERSION`, or `missing NAME`), then [`FACTS_SCRIPT`]'s lines and `end`.
pub fn check_script(bin_dir: &Path) -> String {
    let mut s = String::new();
    for b in BINARIES {
        let p = quote(&bin_dir.join(b).display().to_string());
        s.push_str(&format!(
            "if [ -x {p} ]; then echo \"bin {b} $(sha256sum < {p} | cut -d' ' -f1) $({p} --version)\"; \
             else echo \"missing {b}\"; fi; "
        ));
    }
    s.push_str(FACTS_SCRIPT);
    s
}

/// What the check printed on a host or node ([`check_script`]): its facts, or what is wrong
/// with its binaries against `expected` (each one's name, `--version` and SHA-256 here).
pub fn read_check(
    text: &str,
    mut facts: HostFacts,
    expected: &[(String, String, String)],
    bin_dir: &Path,
) -> Result<HostFacts, Vec<String>> {
    let short = |s: &str| s.chars().take(12).collect::<String>();
    read_facts(text, &mut facts);
    let mut problems = Vec::new();
    for line in text.lines() {
        let (key, rest) = line.split_once(' ').unwrap_or((line, ""));
        match key {
            "missing" => problems.push(format!("lacks {}", bin_dir.join(rest).display())),
            "bin" => {
                let mut w = rest.splitn(3, ' ');
                let (b, sha, version) =
                    (w.next().unwrap_or(""), w.next().unwrap_or(""), w.next().unwrap_or(""));
                if let Some((_, v, s)) = expected.iter().find(|(n, _, _)| n == b)
                    && (v != version || s != sha)
                {
                    problems.push(format!(
                        "has another {} ({version}, sha256 {}) than this machine ({v}, sha256 {})",
                        bin_dir.join(b).display(),
                        short(sha),
                        short(s)
                    ));
                }
            }
            // The facts' lines, read above.
            _ => {}
        }
    }
    if problems.is_empty() { Ok(facts) } else { Err(problems) }
}

/// Why `what` (`host node3`, `node gpu7`) cannot run this machine's binaries, and the flag
/// that would put them there.
pub fn refusal(what: &str, problems: &[String]) -> String {
    format!("{what} {} ({COPY_FLAG} puts this machine's there)", problems.join(", and "))
}

/// `--copy-binaries` on `site`, whose check found its binaries missing or another build:
/// this machine's put into `bin_dir` there (each replacing the old one by a rename, so that a
/// process starting it meanwhile never runs half a file: [`Site::put`]), then the check run
/// again within `limit`. Its facts (`facts` filled in), or why not.
pub fn copy_and_check(
    site: &dyn Site,
    local: &LocalBinaries,
    bin_dir: &Path,
    facts: HostFacts,
    limit: Duration,
) -> anyhow::Result<HostFacts> {
    let whence = site.label().unwrap_or_else(|| "this machine".into());
    // They arrive under their names here; the check there looks for these.
    for (p, b) in local.paths.iter().zip(BINARIES) {
        anyhow::ensure!(
            p.file_name() == Some(OsStr::new(b)),
            "{whence}: {COPY_FLAG}: {} cannot be copied as {b}: its name differs (pass --bin-dir with all three)",
            p.display()
        );
    }
    let t = Instant::now();
    let paths: Vec<&Path> = local.paths.iter().map(PathBuf::as_path).collect();
    site.put(&paths, bin_dir).context(COPY_FLAG)?;
    let took = t.elapsed();
    let o = site.run(&check_script(bin_dir), limit).context("checking the binaries copied there")?;
    let text = String::from_utf8_lossy(&o.stdout);
    anyhow::ensure!(
        o.status.success() && text.lines().any(|l| l == "end"),
        "{whence}: the check after {COPY_FLAG} failed ({}): {}",
        o.status,
        String::from_utf8_lossy(&o.stderr).trim()
    );
    let facts = read_check(&text, facts, &local.expected, bin_dir).map_err(|problems| {
        anyhow::anyhow!("{whence}: after {COPY_FLAG}, it still {}", problems.join(", and "))
    })?;
    eprintln!(
        "gradsync-bench compare: {whence}: this machine's binaries copied into {} ({:.0} MB in {:.1} s)",
        bin_dir.display(),
        local.bytes() as f64 / 1e6,
        took.as_secs_f64()
    );
    Ok(facts)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn the_check_names_a_missing_binary_and_another_build() {
        let expected = [
            ("gradsync-worker".to_string(), "gradsync-worker 0.1.0".to_string(), "aa".repeat(32)),
            ("gradsync-server".to_string(), "gradsync-server 0.1.0".to_string(), "bb".repeat(32)),
        ];
        let same = format!(
            "bin gradsync-worker {} gradsync-worker 0.1.0\nbin gradsync-server {} gradsync-server 0.1.0\n\
             hostname n1\ncores 8\nkernel 6.1\ncpu EPYC\nmemkb 1024\ngpu H100\nend\n",
            "aa".repeat(32),
            "bb".repeat(32)
        );
        let f = read_check(&same, HostFacts::default(), &expected, Path::new("/opt/g")).unwrap();
        assert_eq!((f.hostname.as_str(), f.cores, f.memory_bytes, f.gpus.len()), ("n1", 8, 1 << 20, 1));
        let other = same.replace(&"bb".repeat(32), &"cc".repeat(32));
        let other = format!("missing gradsync-bench\n{other}");
        let e = read_check(&other, HostFacts::default(), &expected, Path::new("/opt/g")).unwrap_err();
        assert_eq!(e.len(), 2, "{e:?}");
        assert!(e[0].contains("lacks /opt/g/gradsync-bench"), "{e:?}");
        assert!(
            e[1].contains("has another /opt/g/gradsync-server") && e[1].contains("sha256 cccccccccccc"),
            "{e:?}"
        );
        // The refusal names the fix.
        let r = refusal("host n1", &e);
        assert!(
            r.starts_with("host n1 lacks /opt/g/gradsync-bench, and has another") && r.contains(COPY_FLAG),
            "{r}"
        );
    }

    #[test]
    fn the_check_script_quotes_a_binaries_directory_with_spaces_and_quotes() {
        let s = check_script(Path::new("/opt/my g's/bin"));
        assert!(s.contains("if [ -x '/opt/my g'\\''s/bin/gradsync-worker' ]"), "{s}");
        assert!(s.contains("sha256sum < '/opt/my g'\\''s/bin/gradsync-bench'"), "{s}");
        // Run here against a directory holding one of the three: one found, two missing.
        let dir = gradsync_testkit::Scratch::new("check script's g");
        let bin = dir.join("b i'n");
        std::fs::create_dir_all(&bin).unwrap();
        let worker = bin.join("gradsync-worker");
        std::fs::write(&worker, "#!/bin/sh\necho gradsync-worker 9.9\n").unwrap();
        std::fs::set_permissions(&worker, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
        let o = Command::new("/bin/sh").args(["-c", &check_script(&bin)]).output().unwrap();
        let text = String::from_utf8_lossy(&o.stdout);
        let sha: String = sha2::Sha256::digest(std::fs::read(&worker).unwrap())
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        assert!(text.contains(&format!("bin gradsync-worker {sha} gradsync-worker 9.9\n")), "{text}");
        assert!(text.contains("missing gradsync-server\nmissing gradsync-bench\n"), "{text}");
    }
}
