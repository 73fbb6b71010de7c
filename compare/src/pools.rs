//! Which pool of other hosts a command's flags name, and reaching it: the hosts of `--hosts`
//! over ssh ([`crate::ssh`]) or the nodes of the Slurm allocation it runs in (`--slurm`,
//! [`crate::slurm`]). `compare --hosts` / `--slurm` run their comparison on the pool, and
//! `advise --hosts` / `--slurm` measure its link and, with `--check`, run each checked
//! configuration on it as that comparison: one way of reaching the hosts for both.
//!
//! [`PoolSpec::slots`] reads what the list or the allocation says each site takes without
//! reaching any of them, so that a command can refuse what it cannot do with them before it
//! checks a host; [`PoolSpec::connect`] checks them (reachable, this machine's binaries
//! there) and hands back the [`Pool`] a comparison places its runs on.

use std::path::Path;
use std::time::Instant;

use crate::binaries::LocalBinaries;
use crate::site::Pool;
use crate::{hostfile, slurm, ssh};

/// The pool a command's flags name.
#[derive(Debug, Clone)]
pub enum PoolSpec {
    /// `--hosts`: a hostfile or `node0:4,node1:4`, and how ssh reaches them.
    Hosts {
        /// The hostfile's path, or the list, as given.
        list: String,
        /// ssh's options, the hosts' directories, `--copy-binaries`.
        ssh: ssh::SshArgs,
    },
    /// `--slurm`: the allocation this runs in.
    Slurm {
        /// `--copy-binaries`: this machine's binaries put on the nodes that lack them.
        copy_binaries: bool,
    },
}

impl PoolSpec {
    /// The flag that names it, for messages: `--hosts a:1,b:1`, `--slurm`.
    pub fn flag(&self) -> String {
        match self {
            PoolSpec::Hosts { list, .. } => format!("--hosts {list}"),
            PoolSpec::Slurm { .. } => "--slurm".into(),
        }
    }

    /// The processes each site takes, in order, as the list (its slots) or the allocation
    /// (its tasks a node) says, without reaching any: a bad list or an allocation's missing
    /// variable is refused here, naming it.
    pub fn slots(&self) -> anyhow::Result<Vec<usize>> {
        Ok(match self {
            PoolSpec::Hosts { list, .. } => hostfile::parse_arg(list)?.iter().map(|h| h.slots).collect(),
            PoolSpec::Slurm { .. } => {
                let get = |k: &str| std::env::var(k).ok().filter(|v| !v.trim().is_empty());
                // The nodes' binaries and files are not asked for: any paths do.
                let alloc = slurm::Alloc::from_vars(get, Path::new("gradsync-worker"), Path::new("."))?;
                alloc.nodes.iter().map(|n| n.slots).collect()
            }
        })
    }

    /// Every site checked (reachable, `local`, this machine's binaries, there; with
    /// `--copy-binaries` put where they are missing), for runs written under `out`, and said
    /// on stderr as `who` (`gradsync-bench compare`) once they are; every site that fails is
    /// named, with why.
    pub fn connect(&self, local: &LocalBinaries, out: &Path, who: &str) -> anyhow::Result<Box<dyn Pool>> {
        match self {
            PoolSpec::Slurm { copy_binaries } => {
                let alloc = slurm::Alloc::from_env(local, out, *copy_binaries)?;
                eprintln!("{who}: Slurm job {}: {}", alloc.job, alloc.describe());
                Ok(Box::new(alloc))
            }
            PoolSpec::Hosts { list, ssh: args } => {
                let entries = hostfile::parse_arg(list)?;
                let t = Instant::now();
                let hosts = ssh::Hosts::connect(&entries, args, local, out)?;
                eprintln!(
                    "{who}: {} host(s) checked in {:.2} s: {}",
                    hosts.hosts.len(),
                    t.elapsed().as_secs_f64(),
                    hosts
                        .hosts
                        .iter()
                        .map(|h| format!("{} ({}, {} slots)", h.name, h.addr, h.slots))
                        .collect::<Vec<_>>()
                        .join(", ")
                );
                Ok(Box::new(hosts))
            }
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    /// A list's slots are read without reaching a host; a bad list is refused naming it.
    #[test]
    fn the_slots_come_from_the_list_alone() {
        let hosts = |list: &str| PoolSpec::Hosts { list: list.into(), ssh: ssh::SshArgs::default() };
        assert_eq!(hosts("nosuchhost-a:2,nosuchhost-b:1").slots().unwrap(), [2, 1]);
        assert_eq!(hosts("x:2").flag(), "--hosts x:2");
        let e = format!("{:#}", hosts("a:0").slots().unwrap_err());
        assert!(e.contains("--hosts a:0") && e.contains("at least 1"), "{e}");
        assert_eq!(PoolSpec::Slurm { copy_binaries: false }.flag(), "--slurm");
    }
}
