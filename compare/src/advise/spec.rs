//! The cluster the advisor predicts for: hosts, ranks (GPUs) per host, the NIC every host has
//! and the link between the ranks of one host, from a short SPEC string or a TOML file.
//!
//! ```text
//! SPEC    = HOSTS "x" PERHOST ":" NIC [ ":" INTRA ]
//! NIC     = RATE [ "," LATENCY ]                     the host's link to the others
//! INTRA   = KIND [ "," RATE ] [ "," LATENCY ]        the link among one host's ranks
//! KIND    = "nvlink" | "pcie" | "shm"
//! RATE    = NUMBER ( "gbit" | "mbit" | "tbit" )      bits per second, as tc spells them
//!         | NUMBER ( "GB/s" | "MB/s" )               bytes per second
//! LATENCY = NUMBER ( "ns" | "us" | "ms" )            one way, one small message
//!
//! 8x8:100gbit:nvlink    4x1:10gbit,20us    16x8:25gbit,5us:pcie,20GB/s
//! ```
//!
//! Units are case-insensitive. A rate is one direction of a full-duplex link. `INTRA` is
//! needed when a host holds more than one rank (there is no sensible default between 5 and
//! 450 GB/s) and refused when it holds one. A latency left out takes the default below. The
//! TOML file has the same fields (`hosts`, `per_host`, `nic`, `nic_latency`, `intra`,
//! `intra_rate`, `intra_latency`), each written as in the string.
//!
//! Defaults, and where they come from:
//! - the NIC's latency, [`NIC_LATENCY_US`]: 10 us one way, half a 20 us round trip of a small
//!   TCP message inside one datacenter (an order of magnitude; measure yours: `--hosts`);
//! - `nvlink`: 450 GB/s each way, 2 us: an H100 SXM's NVLink 4 carries 900 GB/s in both
//!   directions together (NVIDIA's H100 datasheet); the latency is an order of magnitude for
//!   one hop of NCCL's ring inside a node;
//! - `pcie`: 25 GB/s each way, 5 us: PCIe 4.0 x16 signals 31.5 GB/s each way (16 GT/s, 16
//!   lanes, 128b/130b), of which device-to-device copies reach about 25 GB/s;
//! - `shm`: 5 GB/s each way, 1 us: ranks as processes exchanging through shared memory on the
//!   CPU, as gradsync's ddp-shm does; it reached 2.2-4 GB/s of bus bandwidth on a 2-core VM
//!   (docs/benchmarks.md), and one server core copies about 10 GB/s.

use std::path::Path;

use serde::{Deserialize, Serialize};

use super::error::AdviseError;
use crate::cost::Link;

/// The NIC's one-way latency when the SPEC gives none, microseconds.
pub const NIC_LATENCY_US: f64 = 10.0;

/// Most ranks a cluster may hold: beyond this a SPEC is a typo.
const MAX_WORKERS: usize = 1 << 16;

/// How the ranks of one host reach each other.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum IntraKind {
    /// NVLink between GPUs (H100 SXM figures).
    Nvlink,
    /// PCIe 4.0 x16 between GPUs.
    Pcie,
    /// Shared memory between processes on the CPU.
    Shm,
}

impl IntraKind {
    /// Every kind, as the grammar names them.
    pub const ALL: [IntraKind; 3] = [IntraKind::Nvlink, IntraKind::Pcie, IntraKind::Shm];

    /// Its name in a SPEC.
    pub fn name(self) -> &'static str {
        match self {
            IntraKind::Nvlink => "nvlink",
            IntraKind::Pcie => "pcie",
            IntraKind::Shm => "shm",
        }
    }

    /// Its default link (the figures and their sources are in this file's header).
    pub fn default_link(self) -> Link {
        let (gbyte, us) = match self {
            IntraKind::Nvlink => (450.0, 2.0),
            IntraKind::Pcie => (25.0, 5.0),
            IntraKind::Shm => (5.0, 1.0),
        };
        Link { a: us / 1e6, b: gbyte * 1e9 }
    }

    fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|k| k.name().eq_ignore_ascii_case(s))
    }
}

/// The link among one host's ranks.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Intra {
    /// What it is.
    pub kind: IntraKind,
    /// Its latency (`a`, seconds) and bandwidth (`b`, bytes per second each way).
    pub link: Link,
}

/// A cluster of identical hosts.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ClusterSpec {
    /// Hosts.
    pub hosts: usize,
    /// Ranks (GPUs, or processes) per host.
    pub per_host: usize,
    /// Each host's NIC: latency (`a`, seconds) and bandwidth (`b`, bytes per second each way).
    pub nic: Link,
    /// The link among one host's ranks (none with one rank a host).
    pub intra: Option<Intra>,
    /// Where the figures came from: the SPEC, the file, a measurement.
    pub source: String,
}

impl ClusterSpec {
    /// Ranks in all.
    pub fn workers(&self) -> usize {
        self.hosts * self.per_host
    }

    /// The link among one host's ranks; the NIC where a host holds one rank (no rank then
    /// talks to another of its host).
    pub fn intra_link(&self) -> Link {
        self.intra.map_or(self.nic, |i| i.link)
    }

    /// An emulated cluster (`gradsync-bench cluster`) of `hosts` hosts of `per_host` ranks with
    /// NICs `nic` (as measured there): a host's ranks meet over its loopback, which the cluster
    /// does not shape and dilation speeds up with everything else, so as good as free.
    pub fn emulated(hosts: usize, per_host: usize, nic: Link) -> Result<Self, String> {
        let intra = (per_host > 1).then_some(Intra { kind: IntraKind::Shm, link: Link { a: 1e-7, b: 1e12 } });
        Self::checked(hosts, per_host, nic, intra, "an emulated cluster, its link as measured")
    }

    /// The same cluster with `hosts` hosts.
    pub fn with_hosts(&self, hosts: usize) -> Self {
        ClusterSpec { hosts, ..self.clone() }
    }

    /// The same cluster with NICs of `bytes_per_s`.
    pub fn with_nic_rate(&self, bytes_per_s: f64) -> Self {
        ClusterSpec { nic: Link { b: bytes_per_s, ..self.nic }, ..self.clone() }
    }

    /// The cluster as a reader is told it: `8 hosts x 8 ranks, NIC 100 Gbit/s, 10 us; inside
    /// a host nvlink 450 GB/s, 2 us`.
    pub fn describe(&self) -> String {
        let mut s = format!(
            "{} host(s) x {} rank(s) = {} workers; NIC {} each way, {} one way",
            self.hosts,
            self.per_host,
            self.workers(),
            gbit_text(self.nic.b),
            us_text(self.nic.a)
        );
        if let Some(i) = self.intra {
            s += &format!(
                "; inside a host {} {:.0} GB/s, {}",
                i.kind.name(),
                i.link.b / 1e9,
                us_text(i.link.a)
            );
        }
        s
    }

    /// A SPEC string, or the path of a TOML file holding the same fields (a name that is a
    /// file, or ends in `.toml`).
    pub fn parse_arg(arg: &str) -> Result<Self, AdviseError> {
        let path = Path::new(arg);
        if path.is_file() || arg.ends_with(".toml") {
            let bad = |why: String| AdviseError::File { path: arg.to_string(), why };
            let text = std::fs::read_to_string(path).map_err(|e| bad(e.to_string()))?;
            return Self::parse_toml(&text).map_err(bad);
        }
        Self::parse(arg)
    }

    /// A SPEC string (this file's header has the grammar).
    pub fn parse(spec: &str) -> Result<Self, AdviseError> {
        let bad = |why: String| AdviseError::Spec { spec: spec.to_string(), why };
        let parts: Vec<&str> = spec.trim().split(':').collect();
        let (shape, nic, intra) = match parts.as_slice() {
            [shape, nic] => (*shape, *nic, None),
            [shape, nic, intra] => (*shape, *nic, Some(*intra)),
            _ => return Err(bad(format!("{} ':'-separated part(s), expected 2 or 3", parts.len()))),
        };
        let (hosts, per_host) = shape_of(shape).map_err(bad)?;
        let mut items = nic.split(',').map(str::trim);
        let rate = items.next().unwrap_or_default();
        let rate = parse_rate(rate).map_err(|why| bad(format!("the NIC's rate: {why}")))?;
        let latency = match items.next() {
            Some(l) => parse_latency(l).map_err(|why| bad(format!("the NIC's latency: {why}")))?,
            None => NIC_LATENCY_US / 1e6,
        };
        if let Some(extra) = items.next() {
            return Err(bad(format!("'{extra}' after the NIC's rate and latency")));
        }
        let intra = intra.map(|i| intra_of(i, None, None)).transpose().map_err(bad)?;
        Self::checked(hosts, per_host, Link { a: latency, b: rate }, intra, spec).map_err(bad)
    }

    /// The TOML form: the same fields, each written as in the SPEC string.
    pub fn parse_toml(text: &str) -> Result<Self, String> {
        let f: SpecFile = toml::from_str(text).map_err(|e| e.to_string())?;
        let rate = parse_rate(&f.nic).map_err(|why| format!("nic: {why}"))?;
        let latency = match &f.nic_latency {
            Some(l) => parse_latency(l).map_err(|why| format!("nic_latency: {why}"))?,
            None => NIC_LATENCY_US / 1e6,
        };
        let intra = match &f.intra {
            Some(kind) => Some(intra_of(kind, f.intra_rate.as_deref(), f.intra_latency.as_deref())?),
            None if f.intra_rate.is_some() || f.intra_latency.is_some() => {
                return Err("intra_rate and intra_latency need intra (nvlink, pcie or shm)".into());
            }
            None => None,
        };
        Self::checked(f.hosts, f.per_host, Link { a: latency, b: rate }, intra, "a TOML file")
    }

    /// A cluster from its parts, checked: at least two workers, not absurdly many, the link
    /// inside a host given exactly when a host holds several ranks.
    pub fn checked(
        hosts: usize,
        per_host: usize,
        nic: Link,
        intra: Option<Intra>,
        source: &str,
    ) -> Result<Self, String> {
        if hosts == 0 || per_host == 0 {
            return Err("hosts and ranks per host must be at least 1".into());
        }
        let workers = hosts.checked_mul(per_host).filter(|&w| w <= MAX_WORKERS);
        let Some(workers) = workers else {
            return Err(format!("{hosts} x {per_host} ranks is more than {MAX_WORKERS}"));
        };
        if workers < 2 {
            return Err("one worker has nothing to synchronise: give at least 2 ranks".into());
        }
        match (per_host, &intra) {
            (1, Some(i)) => {
                return Err(format!(
                    "one rank a host: the link inside a host ({}) joins nothing; leave it out",
                    i.kind.name()
                ));
            }
            (m, None) if m > 1 => {
                return Err(format!(
                    "{m} ranks a host: name the link between them (nvlink, pcie or shm), e.g. {hosts}x{m}:...:nvlink"
                ));
            }
            _ => {}
        }
        Ok(ClusterSpec { hosts, per_host, nic, intra, source: source.to_string() })
    }
}

/// The TOML form of a SPEC.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct SpecFile {
    hosts: usize,
    per_host: usize,
    nic: String,
    #[serde(default)]
    nic_latency: Option<String>,
    #[serde(default)]
    intra: Option<String>,
    #[serde(default)]
    intra_rate: Option<String>,
    #[serde(default)]
    intra_latency: Option<String>,
}

/// `HOSTSxPERHOST`.
fn shape_of(shape: &str) -> Result<(usize, usize), String> {
    let (h, m) =
        shape.split_once(['x', 'X']).ok_or_else(|| format!("'{shape}' is not HOSTSxPERHOST (e.g. 8x8)"))?;
    let count = |v: &str, what: &str| {
        v.trim().parse::<usize>().map_err(|_| format!("{what} '{v}' is not a whole number"))
    };
    Ok((count(h, "hosts")?, count(m, "ranks per host")?))
}

/// `KIND[,RATE][,LATENCY]` (from a SPEC, with `rate` and `latency` None), or a TOML file's
/// three fields.
fn intra_of(text: &str, rate: Option<&str>, latency: Option<&str>) -> Result<Intra, String> {
    let mut items = text.split(',').map(str::trim);
    let name = items.next().unwrap_or_default();
    let kind = IntraKind::parse(name).ok_or_else(|| {
        let kinds: Vec<&str> = IntraKind::ALL.iter().map(|k| k.name()).collect();
        format!("the link inside a host '{name}' is not one of {}", kinds.join(", "))
    })?;
    let mut link = kind.default_link();
    let (mut rate_set, mut latency_set) = (false, false);
    let mut set = |item: &str| -> Result<(), String> {
        if let Ok(l) = parse_latency(item) {
            if std::mem::replace(&mut latency_set, true) {
                return Err(format!("the link inside a host: two latencies ('{item}')"));
            }
            link.a = l;
            return Ok(());
        }
        let r = parse_rate(item).map_err(|why| format!("the link inside a host: {why}"))?;
        if std::mem::replace(&mut rate_set, true) {
            return Err(format!("the link inside a host: two rates ('{item}')"));
        }
        link.b = r;
        Ok(())
    };
    for item in items.chain(rate).chain(latency) {
        set(item)?;
    }
    Ok(Intra { kind, link })
}

/// A unit: its spelling, and what a number of it is multiplied, then divided by (a division
/// by a power of ten rounds once, so `10us` is exactly the `1e-5` a reader expects).
type Unit = (&'static str, f64, f64);

/// `NUMBER` then a unit (case-insensitive) of `units`, as a positive finite value in the base
/// unit.
fn number_with(text: &str, units: &[Unit]) -> Option<Result<f64, String>> {
    let t = text.trim();
    let lower = t.to_ascii_lowercase();
    let (unit, times, per) = units.iter().find(|(u, _, _)| lower.ends_with(&u.to_ascii_lowercase()))?;
    let number = t[..t.len() - unit.len()].trim();
    Some(match number.parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 => Ok(v * times / per),
        _ => Err(format!("'{number}' in '{t}' is not a positive number")),
    })
}

/// A rate, bytes per second.
pub fn parse_rate(text: &str) -> Result<f64, String> {
    const UNITS: &[Unit] = &[
        ("tbit", 1e12, 8.0),
        ("gbit", 1e9, 8.0),
        ("mbit", 1e6, 8.0),
        ("GB/s", 1e9, 1.0),
        ("MB/s", 1e6, 1.0),
    ];
    number_with(text, UNITS).unwrap_or_else(|| {
        Err(format!("'{}' has no rate unit (gbit, mbit, tbit, GB/s or MB/s, e.g. 100gbit)", text.trim()))
    })
}

/// A latency, seconds.
pub fn parse_latency(text: &str) -> Result<f64, String> {
    const UNITS: &[Unit] = &[("ns", 1.0, 1e9), ("us", 1.0, 1e6), ("ms", 1.0, 1e3)];
    number_with(text, UNITS)
        .unwrap_or_else(|| Err(format!("'{}' has no time unit (ns, us or ms, e.g. 5us)", text.trim())))
}

/// Bytes per second as Gbit/s.
pub fn gbit_text(bytes_per_s: f64) -> String {
    let g = bytes_per_s * 8.0 / 1e9;
    if g >= 10.0 { format!("{g:.0} Gbit/s") } else { format!("{g:.3} Gbit/s") }
}

/// Seconds as microseconds.
fn us_text(s: f64) -> String {
    format!("{} us", s * 1e6)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn specs_read_as_written() {
        let c = ClusterSpec::parse("8x8:100gbit:nvlink").unwrap();
        assert_eq!((c.hosts, c.per_host, c.workers()), (8, 8, 64));
        assert_eq!(c.nic, Link { a: 10e-6, b: 12.5e9 });
        assert_eq!(c.intra, Some(Intra { kind: IntraKind::Nvlink, link: Link { a: 2e-6, b: 450e9 } }));
        let c = ClusterSpec::parse("4x1:10gbit,20us").unwrap();
        assert_eq!((c.hosts, c.per_host, c.intra), (4, 1, None));
        assert_eq!(c.nic, Link { a: 20e-6, b: 1.25e9 });
        assert_eq!(c.intra_link(), c.nic);
        // The link inside a host with its own rate and latency, in either order; units in any case.
        let c = ClusterSpec::parse("16X8:25GBIT,5us:PCIe,3us,20GB/s").unwrap();
        assert_eq!(c.nic, Link { a: 5e-6, b: 25e9 / 8.0 });
        assert_eq!(c.intra.unwrap().link, Link { a: 3e-6, b: 20e9 });
        assert_eq!(ClusterSpec::parse("2x1:800mbit,1ms").unwrap().nic, Link { a: 1e-3, b: 1e8 });
        assert_eq!(ClusterSpec::parse("1x4:1gbit:shm").unwrap().intra.unwrap().kind, IntraKind::Shm);
    }

    #[test]
    fn bad_specs_are_refused_naming_what_is_wrong() {
        for (spec, want) in [
            ("8x8", "1 ':'-separated part(s)"),
            ("8x8:100gbit:nvlink:x", "4 ':'-separated part(s)"),
            ("8:100gbit", "'8' is not HOSTSxPERHOST"),
            ("ax8:100gbit:nvlink", "hosts 'a' is not a whole number"),
            ("8x-1:100gbit:nvlink", "ranks per host '-1'"),
            ("0x8:100gbit:nvlink", "at least 1"),
            ("1x1:100gbit", "one worker has nothing to synchronise"),
            ("8x8:100:nvlink", "the NIC's rate: '100' has no rate unit"),
            ("8x8:fastgbit:nvlink", "'fast' in 'fastgbit' is not a positive number"),
            ("8x8:-5gbit:nvlink", "not a positive number"),
            ("8x8:100gbit,5:nvlink", "the NIC's latency: '5' has no time unit"),
            ("8x8:100gbit,5us,6us:nvlink", "'6us' after the NIC's rate and latency"),
            ("8x8:100gbit", "8 ranks a host: name the link between them"),
            ("8x1:100gbit:nvlink", "one rank a host: the link inside a host (nvlink) joins nothing"),
            ("8x8:100gbit:infiniband", "'infiniband' is not one of nvlink, pcie, shm"),
            ("8x8:100gbit:pcie,1us,2us", "two latencies"),
            ("8x8:100gbit:pcie,1GB/s,2GB/s", "two rates"),
            ("8x8:100gbit:pcie,fast", "'fast' has no rate unit"),
            ("100000x100:1gbit:shm", "more than 65536"),
        ] {
            let e = ClusterSpec::parse(spec).unwrap_err().to_string();
            assert!(e.contains(&format!("--cluster {spec}:")) && e.contains(want), "{spec}: {e}");
            assert!(e.contains("e.g. 8x8:100gbit:nvlink"), "{e}");
        }
    }

    #[test]
    fn a_toml_file_holds_the_same_fields() {
        let c = ClusterSpec::parse_toml(
            "hosts = 16\nper_host = 8\nnic = '25gbit'\nnic_latency = '5us'\nintra = 'pcie'\nintra_rate = '20GB/s'\n",
        )
        .unwrap();
        let s = ClusterSpec::parse("16x8:25gbit,5us:pcie,20GB/s").unwrap();
        assert_eq!((c.hosts, c.per_host, c.nic, c.intra), (s.hosts, s.per_host, s.nic, s.intra));
        for (text, want) in [
            ("hosts = 4\nper_host = 1\nnic = '10gbit'\nspeed = 1\n", "unknown field `speed`"),
            ("hosts = 4\nper_host = 1\n", "missing field `nic`"),
            ("hosts = 4\nper_host = 2\nnic = '10gbit'\n", "name the link between them"),
            ("hosts = 4\nper_host = 1\nnic = '10gbit'\nintra_rate = '1GB/s'\n", "need intra"),
            ("hosts = 4\nper_host = 1\nnic = '10gbit'\nnic_latency = 'soon'\n", "nic_latency: 'soon'"),
        ] {
            let e = ClusterSpec::parse_toml(text).unwrap_err();
            assert!(e.contains(want), "{text}: {e}");
        }
        // Through a file: its path in the error.
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.toml");
        std::fs::write(&path, "hosts = 4\nper_host = 1\nnic = '10'\n").unwrap();
        let e = ClusterSpec::parse_arg(&path.display().to_string()).unwrap_err().to_string();
        assert!(e.contains(&format!("--cluster {}: nic: '10' has no rate unit", path.display())), "{e}");
        let e = ClusterSpec::parse_arg("/nowhere/c.toml").unwrap_err().to_string();
        assert!(e.contains("--cluster /nowhere/c.toml:"), "{e}");
    }
}
