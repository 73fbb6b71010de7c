//! A cluster measured rather than described: `advise --hosts` (hosts reached over ssh, as
//! `compare --hosts` reaches them) or `--slurm` (the nodes of the allocation it runs in), the
//! pool [`crate::pools::PoolSpec`] names. What the list or the allocation says of the hosts
//! (their slots alike, `--intra` where they hold several ranks) is checked first, before any
//! host is reached; then the hosts are checked as the comparison checks them (reachable,
//! gradsync's binaries there), and the raw-TCP yardstick (`gradsync-bench rawtcp-peer`,
//! [`crate::site::measure_link`]) streams between the first two: its median rate is the NIC's
//! bandwidth and its small-message latency the NIC's. Each host's slots are its ranks; the
//! link among them is not measured and is named with `--intra`.

use std::path::Path;
use std::time::Duration;

use super::error::AdviseError;
use super::spec::{ClusterSpec, Intra, IntraKind};
use crate::binaries::LocalBinaries;
use crate::cost::Link;
use crate::pools::PoolSpec;
use crate::rawtcp::PeerReading;

/// Yardstick rounds, and how long each streams.
const ROUNDS: usize = 3;
const EACH: Duration = Duration::from_millis(500);

/// The cluster `pool`'s hosts make, its NIC measured; `local` is this machine's binaries,
/// `work` a directory the hosts' check may write in.
pub fn cluster(
    pool: &PoolSpec,
    local: &LocalBinaries,
    intra: Option<IntraKind>,
    work: &Path,
) -> anyhow::Result<ClusterSpec> {
    let (slots, what) = (listed(pool, intra)?, pool.flag());
    let pool = pool.connect(local, work, "gradsync-bench advise")?;
    let reading = pool.measure_link(ROUNDS, EACH);
    pool.tidy();
    Ok(from_reading(&slots, &reading?, intra, &what)?)
}

/// The slots of `pool`'s hosts as the list or the allocation gives them, refused (naming the
/// flag and what is wrong) where the advisor cannot predict for them ([`layout`]), before any
/// host is reached.
pub fn listed(pool: &PoolSpec, intra: Option<IntraKind>) -> anyhow::Result<Vec<usize>> {
    let slots = pool.slots()?;
    layout(&slots, intra, &pool.flag())?;
    Ok(slots)
}

/// Hosts with `slots` ranks each, as the advisor takes them: every host the same (their
/// count, the ranks a host), the link among one host's ranks named where they are several,
/// and at least two ranks in all. `what` names the flag in the refusal.
pub fn layout(
    slots: &[usize],
    intra: Option<IntraKind>,
    what: &str,
) -> Result<(usize, usize, Option<Intra>), AdviseError> {
    let bad = |why: String| AdviseError::invalid(what.to_string(), why);
    let per_host = *slots.first().ok_or_else(|| bad("no hosts".into()))?;
    if let Some(other) = slots.iter().find(|&&s| s != per_host) {
        return Err(bad(format!(
            "hosts of {per_host} and {other} slots: the advisor predicts for hosts alike; give each the same slots"
        )));
    }
    if per_host > 1 && intra.is_none() {
        return Err(bad(format!(
            "{per_host} slots a host: name the link between them with --intra nvlink|pcie|shm"
        )));
    }
    if slots.len() * per_host < 2 {
        return Err(bad("one worker has nothing to synchronise: give at least 2 ranks".into()));
    }
    let intra = intra.filter(|_| per_host > 1).map(|kind| Intra { kind, link: kind.default_link() });
    Ok((slots.len(), per_host, intra))
}

/// The cluster of hosts with `slots` ranks each, whose NIC `reading` measured, the link among
/// one host's ranks `intra`'s defaults.
pub fn from_reading(
    slots: &[usize],
    reading: &PeerReading,
    intra: Option<IntraKind>,
    what: &str,
) -> Result<ClusterSpec, AdviseError> {
    let (hosts, per_host, intra) = layout(slots, intra, what)?;
    let rate = crate::table::median(&reading.samples);
    if !(rate.is_finite() && rate > 0.0) {
        return Err(AdviseError::invalid(
            what.to_string(),
            format!("the yardstick measured no bandwidth ({:?})", reading.samples),
        ));
    }
    let nic = Link { a: reading.latency_s.max(0.0), b: rate };
    let source = format!("{what}: the NIC measured by the raw-TCP yardstick between the first two hosts");
    ClusterSpec::checked(hosts, per_host, nic, intra, &source)
        .map_err(|why| AdviseError::invalid(what.to_string(), why))
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
        // What the list says is refused before any host is reached, naming the flag.
        let pool = |list: &str| PoolSpec::Hosts { list: list.into(), ssh: Default::default() };
        assert_eq!(listed(&pool("nosuchhost-a:2,nosuchhost-b:2"), Some(IntraKind::Shm)).unwrap(), [2, 2]);
        for (list, intra, want) in [
            ("nosuchhost-a:2,nosuchhost-b:1", Some(IntraKind::Pcie), "hosts of 2 and 1 slots"),
            ("nosuchhost-a:2,nosuchhost-b:2", None, "name the link between them with --intra"),
            ("nosuchhost-a", None, "one worker has nothing to synchronise"),
        ] {
            let e = listed(&pool(list), intra).unwrap_err().to_string();
            assert!(e.starts_with(&format!("--hosts {list}: ")) && e.contains(want), "{e}");
        }
        let none = PeerReading { samples: vec![], latency_s: 0.0 };
        assert!(from_reading(&[1, 1], &none, None, "x").unwrap_err().to_string().contains("no bandwidth"));
    }
}
