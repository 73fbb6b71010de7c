//! A cluster measured rather than described: `advise --hosts` (hosts reached over ssh, as
//! `compare --hosts` reaches them) or `--slurm` (the nodes of the allocation it runs in). The
//! hosts are checked as the comparison checks them (reachable, gradsync's binaries there),
//! then the raw-TCP yardstick (`gradsync-bench rawtcp-peer`, [`crate::site::measure_link`])
//! streams between the first two: its median rate is the NIC's bandwidth and its small-message
//! latency the NIC's. Each host's slots are its ranks; the link among them is not measured and
//! is named with `--intra`.

use std::path::Path;
use std::time::Duration;

use super::error::AdviseError;
use super::spec::{ClusterSpec, Intra, IntraKind};
use crate::cost::Link;
use crate::rawtcp::PeerReading;
use crate::site::Pool;
use crate::{binaries, hostfile, modes, slurm, ssh};

/// Yardstick rounds, and how long each streams.
const ROUNDS: usize = 3;
const EACH: Duration = Duration::from_millis(500);

/// Where the hosts come from.
#[derive(Debug, Clone)]
pub enum Measured {
    /// `--hosts`: a hostfile or `node0:4,node1:4`, with ssh's extra options.
    Hosts {
        /// The list.
        list: String,
        /// More ssh options (`-F FILE -o User=me`).
        ssh_opts: Option<String>,
    },
    /// `--slurm`: the allocation this runs in.
    Slurm,
}

/// The cluster the hosts make, its NIC measured; `work` is a directory the check may write in.
pub fn cluster(m: &Measured, intra: Option<IntraKind>, work: &Path) -> anyhow::Result<ClusterSpec> {
    let bins = modes::Bins::find(None)?;
    let local = binaries::LocalBinaries::of(&bins)?;
    let (pool, slots, what): (Box<dyn Pool>, Vec<usize>, String) = match m {
        Measured::Hosts { list, ssh_opts } => {
            let entries = hostfile::parse_arg(list)?;
            let args = ssh::SshArgs { ssh_opts: ssh_opts.clone(), ..ssh::SshArgs::default() };
            let hosts = ssh::Hosts::connect(&entries, &args, &local, work)?;
            let slots = hosts.hosts.iter().map(|h| h.slots).collect();
            (Box::new(hosts), slots, format!("--hosts {list}"))
        }
        Measured::Slurm => {
            let alloc = slurm::Alloc::from_env(&local, work, false)?;
            let slots = alloc.nodes.iter().map(|n| n.slots).collect();
            let what = format!("--slurm (job {})", alloc.job);
            (Box::new(alloc), slots, what)
        }
    };
    let reading = pool.measure_link(ROUNDS, EACH);
    pool.tidy();
    Ok(from_reading(&slots, &reading?, intra, &what)?)
}

/// The cluster of hosts with `slots` ranks each, whose NIC `reading` measured, the link among
/// one host's ranks `intra`'s defaults.
pub fn from_reading(
    slots: &[usize],
    reading: &PeerReading,
    intra: Option<IntraKind>,
    what: &str,
) -> Result<ClusterSpec, AdviseError> {
    let bad = |why: String| AdviseError::invalid(what.to_string(), why);
    let per_host = *slots.first().ok_or_else(|| bad("no hosts".into()))?;
    if let Some(other) = slots.iter().find(|&&s| s != per_host) {
        return Err(bad(format!(
            "hosts of {per_host} and {other} slots: the advisor predicts for hosts alike; give each the same slots"
        )));
    }
    let rate = crate::table::median(&reading.samples);
    if !(rate.is_finite() && rate > 0.0) {
        return Err(bad(format!("the yardstick measured no bandwidth ({:?})", reading.samples)));
    }
    if per_host > 1 && intra.is_none() {
        return Err(bad(format!(
            "{per_host} slots a host: name the link between them with --intra nvlink|pcie|shm"
        )));
    }
    let intra = intra.filter(|_| per_host > 1).map(|kind| Intra { kind, link: kind.default_link() });
    let nic = Link { a: reading.latency_s.max(0.0), b: rate };
    let source = format!("{what}: the NIC measured by the raw-TCP yardstick between the first two hosts");
    ClusterSpec::checked(slots.len(), per_host, nic, intra, &source).map_err(bad)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn a_measured_reading_makes_the_cluster() {
        let r = PeerReading { samples: vec![1.1e9, 1.0e9, 1.2e9], latency_s: 30e-6 };
        let c = from_reading(&[4, 4], &r, Some(IntraKind::Pcie), "--hosts h").unwrap();
        assert_eq!((c.hosts, c.per_host), (2, 4));
        assert_eq!(c.nic, Link { a: 30e-6, b: 1.1e9 });
        assert_eq!(c.intra.unwrap().link, IntraKind::Pcie.default_link());
        assert!(c.source.starts_with("--hosts h: the NIC measured"));
        // One slot a host: the link inside one is not needed.
        assert!(from_reading(&[1, 1], &r, Some(IntraKind::Shm), "x").unwrap().intra.is_none());
        for (slots, intra, want) in [
            (&[4usize, 2][..], Some(IntraKind::Pcie), "hosts of 4 and 2 slots"),
            (&[4, 4], None, "with --intra"),
            (&[], None, "no hosts"),
            (&[1], None, "one worker has nothing to synchronise"),
        ] {
            let e = from_reading(slots, &r, intra, "--hosts h").unwrap_err().to_string();
            assert!(e.starts_with("--hosts h: ") && e.contains(want), "{e}");
        }
        let none = PeerReading { samples: vec![], latency_s: 0.0 };
        assert!(from_reading(&[1, 1], &none, None, "x").unwrap_err().to_string().contains("no bandwidth"));
    }
}
