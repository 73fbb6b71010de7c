//! Where `advise --check` runs the configurations it checks, and only what must differ there:
//! where the runs go, what can be placed there, and where the link the second prediction
//! prices was measured. Everything else of the check (its plan, each configuration's
//! scenario, reading the runs, the verdict, the page) is written once in [`super::check`].
//!
//! - **An emulated cluster** matching the SPEC (`--cluster`): network namespaces on this
//!   machine, a fresh cluster for every run, servers on hosts of their own or colocated (shard
//!   `i` on worker host `i`) as the configuration says, dilated
//!   (`--dilate auto`: probed, run, checked at twice the factor) so that this machine's cores
//!   do not set the figures ([`crate::cluster::run_cluster`]). The link as measured is the
//!   cluster's own (`cluster.json`), a host's ranks meeting over its loopback, as good as free
//!   under dilation.
//! - **The real hosts** the advice measured (`--hosts`, `--slurm`): each configuration a
//!   comparison on them, as `compare --hosts` and `--slurm` run one ([`crate::compare_on`]:
//!   the hosts checked, the processes placed by [`crate::place::assign`], their files brought
//!   back), undilated: real hardware runs at its own speed. The link as measured is the NIC
//!   [`super::measure`] measured between the first two hosts for the advice, and inside a host
//!   `--intra`'s link. Every host given holds workers, so what that placement can put on them
//!   is every ring and a parameter server colocated one a host; servers on hosts of their own
//!   would need hosts beyond those given.
//!
//! Both refuse a compression no compared mode runs (bf16).

use std::path::Path;

use anyhow::Context;
use gradsync_core::compress::Compression;
use serde::Serialize;

use super::config::Config;
use super::spec::{ClusterSpec, gbit_text};
use crate::binaries::LocalBinaries;
use crate::cost::Link;
use crate::modes::Bins;
use crate::net::Shape;
use crate::pools::PoolSpec;
use crate::scenario::{Dilate, Scenario};
use crate::{emulated, place, results};

/// Where the check runs.
pub enum Testbed {
    /// A dilated emulated cluster matching the SPEC, made afresh for every run (root and
    /// iproute2).
    Emulated,
    /// The hosts or nodes the cluster was measured on, undilated.
    Real {
        /// Which: `--hosts` or `--slurm`, and how they are reached.
        pool: PoolSpec,
        /// This machine's binaries, which every host must have (read once for every run).
        local: LocalBinaries,
    },
}

/// What a check ran on, as `check.json` records it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Kind {
    /// An emulated cluster, dilated.
    Emulated,
    /// `--hosts`, over ssh.
    Hosts,
    /// `--slurm`, as job steps.
    Slurm,
}

impl Testbed {
    /// What it is, for `check.json` and the page.
    pub fn kind(&self) -> Kind {
        match self {
            Testbed::Emulated => Kind::Emulated,
            Testbed::Real { pool: PoolSpec::Hosts { .. }, .. } => Kind::Hosts,
            Testbed::Real { pool: PoolSpec::Slurm { .. }, .. } => Kind::Slurm,
        }
    }

    /// Whether the check can run here at all, before anything is run: an emulated cluster
    /// needs root and iproute2 (and then stops the emulated hosts on Ctrl-C); the real hosts
    /// are checked as each configuration's comparison reaches them.
    pub fn ready(&self) -> anyhow::Result<()> {
        if let Testbed::Emulated = self {
            crate::net::available()
                .map_err(|e| anyhow::anyhow!("--check runs on an emulated cluster: {e}"))?;
            crate::net::guard("gradsync-bench advise --check");
        }
        Ok(())
    }

    /// Why `c` cannot be checked here on the hosts of `spec`, if it cannot: what no compared
    /// mode runs, then what this testbed cannot place.
    pub fn unrunnable(&self, c: &Config, spec: &ClusterSpec) -> Option<String> {
        let mode = c.mode();
        if mode.compress(c.compression.ratio().unwrap_or(1.0)).unwrap_or(Compression::None) != c.compression {
            return Some(format!(
                "no compared mode runs {} with {}: not checked",
                mode.label(),
                c.compression
            ));
        }
        match self {
            // Config's own checks keep colocated servers to at most one a host.
            Testbed::Emulated => None,
            Testbed::Real { .. } => unplaceable(c, spec),
        }
    }

    /// The scenario's keys that place the runs of `c`: an emulated cluster's hosts and ranks
    /// a host, dilated automatically, and colocated servers where `c` has them; on real hosts
    /// every rank of the cluster, one a slot, undilated (`compare` refuses a factor: real links
    /// run at their own rate), the comparison's placement putting the servers.
    pub fn placement(&self, spec: &ClusterSpec, c: &Config) -> String {
        match self {
            Testbed::Emulated => {
                let servers = match c.servers() {
                    Some((_, true)) => "servers = ['colocated']\n",
                    _ => "",
                };
                format!(
                    "hosts = [{}]\nranks_per_host = [{}]\ndilate = 'auto'\n{servers}",
                    spec.hosts, spec.per_host
                )
            }
            Testbed::Real { .. } => format!("workers = [{}]\n", spec.workers()),
        }
    }

    /// Run `s` (one configuration's scenario, for the cluster `spec`) into the run directory
    /// `dir`: on emulated clusters at the SPEC's NIC rate, or as a comparison on the real
    /// hosts, reached afresh for it and tidied after.
    pub fn run(&self, s: &Scenario, spec: &ClusterSpec, bins: &Bins, dir: &Path) -> anyhow::Result<()> {
        match self {
            Testbed::Emulated => {
                let shape = |rate: f64| Shape::at_rate(rate * 1e9);
                let gbit = spec.nic.b * 8.0 / 1e9;
                crate::cluster::run_cluster(s, bins, dir, &[gbit], shape, Some(Dilate::Auto))?;
            }
            Testbed::Real { pool, local } => {
                let launching = crate::Launching {
                    pool: Some(pool.connect(local, dir, "gradsync-bench advise --check")?),
                    tls: None,
                };
                crate::compare_on(s, bins, dir, &launching)?;
            }
        }
        Ok(())
    }

    /// The cluster the prediction "for the link as measured" prices, for the runs in `dir` of
    /// the cluster `spec`: the emulated cluster's hosts with the NIC its runs measured
    /// (`cluster.json`, the median over its runs; none where none measured it) and a host's
    /// ranks meeting over its loopback; on real hosts `spec` itself, the cluster the hosts'
    /// own link measurement made for the advice.
    pub fn measured_link(&self, spec: &ClusterSpec, dir: &Path) -> anyhow::Result<Option<ClusterSpec>> {
        if let Testbed::Real { .. } = self {
            return Ok(Some(spec.clone()));
        }
        let links = emulated::load(&[dir.to_path_buf()]);
        let med = |f: &dyn Fn(&emulated::ClusterRun) -> Option<f64>| {
            results::median(&links.iter().filter_map(f).collect::<Vec<_>>())
        };
        let Some(gbit) = med(&|r| r.measured_gbit) else { return Ok(None) };
        let nic = Link { a: med(&|r| r.measured_latency_us).unwrap_or(0.0) * 1e-6, b: gbit * 1e9 / 8.0 };
        ClusterSpec::emulated(spec.hosts, spec.per_host, nic)
            .map(Some)
            .map_err(|e| anyhow::anyhow!("the emulated cluster's link: {e}"))
            .context(dir.display().to_string())
    }

    /// Where the check ran, for its table's title: `2 host(s) x 1 rank(s) at 1.000 Gbit/s,
    /// emulated`, or the real hosts with their NIC as measured and the flag that named them.
    pub fn describe(&self, spec: &ClusterSpec) -> String {
        let at = format!("{} host(s) x {} rank(s) at {}", spec.hosts, spec.per_host, gbit_text(spec.nic.b));
        match self {
            Testbed::Emulated => format!("{at}, emulated"),
            Testbed::Real { pool, .. } => format!("{at} as measured, the real hosts of {}", pool.flag()),
        }
    }
}

/// Why the real hosts of `spec` cannot take `c` as the comparison places it
/// ([`place::assign`], each host taking its slots, the ranks filling them all), if they
/// cannot: a parameter server whose servers the placement cannot put where the configuration
/// says (colocated: one on each of some worker hosts; apart: on hosts without workers).
fn unplaceable(c: &Config, spec: &ClusterSpec) -> Option<String> {
    let (servers, colocated) = c.servers()?;
    let slots = vec![spec.per_host; spec.hosts];
    let placed = place::assign(&slots, c.mode(), spec.workers(), servers);
    let shared = placed.as_ref().map(|(s, w)| s.iter().any(|h| w.contains(h)));
    match (colocated, shared) {
        (true, Ok(true)) | (false, Ok(false)) => None,
        (true, _) => Some(format!(
            "{servers} colocated server(s) on {} hosts: the comparison places fewer servers than hosts on hosts \
             of their own, and every host here holds workers (colocated, one a host is checked): not checked",
            spec.hosts
        )),
        (false, _) => Some(format!(
            "{servers} server(s) on hosts of their own need {servers} host(s) beyond the {} given, whose slots \
             the workers fill: not checked",
            spec.hosts
        )),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::advise::config::Exchange;
    use crate::advise::search::Space;

    fn hosts() -> Testbed {
        let paths = ["a", "b", "c"].map(std::path::PathBuf::from);
        let local = LocalBinaries { paths, expected: Vec::new() };
        Testbed::Real { pool: PoolSpec::Hosts { list: "h1,h2".into(), ssh: Default::default() }, local }
    }

    fn ps(servers: usize, colocated: bool) -> Config {
        Config {
            exchange: Exchange::Ps { servers, colocated },
            bucket_mb: None,
            compression: Compression::None,
        }
    }

    /// Each testbed decides for itself: the emulated cluster places every parameter server,
    /// the real hosts refuse servers of their own (every host holds workers) and fewer
    /// colocated servers than hosts (placed apart); what the comparison's placement can put
    /// where the configuration says is run. Both refuse bf16.
    #[test]
    fn what_each_testbed_can_run() {
        let spec = ClusterSpec::parse("4x2:10gbit:pcie").unwrap();
        let (emulated, real) = (Testbed::Emulated, hosts());
        for (k, colocated) in [(4, true), (2, true), (4, false), (2, false)] {
            assert_eq!(emulated.unrunnable(&ps(k, colocated), &spec), None, "{k} {colocated}");
        }
        assert_eq!(real.unrunnable(&ps(4, true), &spec), None);
        let apart = real.unrunnable(&ps(2, false), &spec).unwrap();
        assert!(
            apart.contains("need 2 host(s) beyond the 4 given") && apart.ends_with("not checked"),
            "{apart}"
        );
        // As many servers as hosts, apart: the placement puts them among the workers.
        assert!(real.unrunnable(&ps(4, false), &spec).unwrap().contains("beyond the 4 given"));
        let fewer = real.unrunnable(&ps(2, true), &spec).unwrap();
        assert!(
            fewer.contains("2 colocated server(s) on 4 hosts") && fewer.ends_with("not checked"),
            "{fewer}"
        );
        let bf16 = Config { exchange: Exchange::Ring, bucket_mb: Some(25.0), compression: Compression::Bf16 };
        for t in [&emulated, &real] {
            assert!(t.unrunnable(&bf16, &spec).unwrap().contains("no compared mode runs ddp-tcp with bf16"));
        }
        // Every configuration the advisor searches: runnable on the hosts exactly where the
        // comparison's own placement fits its ranks and puts its servers as it says.
        let space = Space::new(vec![25.0], Some(0.01)).unwrap();
        for spec in ["4x2:10gbit:pcie", "2x1:1gbit", "1x4:1gbit:shm", "3x1:1gbit"].map(ClusterSpec::parse) {
            let spec = spec.unwrap();
            for c in space.configs(&spec) {
                let slots = vec![spec.per_host; spec.hosts];
                let k = c.servers().map_or(1, |(k, _)| k);
                let fits = place::assign(&slots, c.mode(), spec.workers(), k).is_ok_and(|(s, w)| {
                    c.servers().is_none_or(|(_, colocated)| s.iter().any(|h| w.contains(h)) == colocated)
                });
                let ok = c.compression != Compression::Bf16;
                assert_eq!(
                    real.unrunnable(&c, &spec).is_none(),
                    fits && ok,
                    "{} on {}",
                    c.label(),
                    spec.describe()
                );
            }
        }
    }

    /// The link the second prediction prices: the emulated cluster's as its runs measured it
    /// (none where none did), a host's ranks meeting over its loopback; on real hosts the
    /// advice's cluster, which their own measurement made.
    #[test]
    fn the_link_as_measured_comes_from_where_the_runs_went() {
        let dir = gradsync_testkit::Scratch::new("testbed-link");
        let spec = ClusterSpec::parse("2x2:10gbit:nvlink").unwrap();
        assert_eq!(Testbed::Emulated.measured_link(&spec, dir.path()).unwrap(), None);
        let run = |gbit: f64, us: f64| {
            serde_json::json!({"id": "runs/x", "mode": "ddp-tcp", "workers": 4, "shards": 0, "hosts": 2,
                "rate_gbit": 10.0, "measured_gbit": gbit, "measured_latency_us": us, "delay_us": 0,
                "loss_pct": 0.0, "dilation": 8.0})
        };
        let runs = serde_json::json!([run(8.0, 20.0), run(9.0, 30.0), run(9.5, 40.0)]);
        std::fs::write(dir.join(emulated::CLUSTER_FILE), runs.to_string()).unwrap();
        let c = Testbed::Emulated.measured_link(&spec, dir.path()).unwrap().unwrap();
        assert_eq!((c.hosts, c.per_host), (2, 2));
        assert!((c.nic.b - 9e9 / 8.0).abs() < 1.0 && (c.nic.a - 30e-6).abs() < 1e-12, "{:?}", c.nic);
        assert!(c.intra.unwrap().link.b > 1e11, "a host's loopback, as good as free");
        // The real hosts: the cluster as measured for the advice, whatever the run left.
        let measured = ClusterSpec::checked(
            2,
            2,
            Link { a: 25e-6, b: 1.1e8 },
            spec.intra,
            "--hosts h1:2,h2:2: the NIC measured by the raw-TCP yardstick between the first two hosts",
        )
        .unwrap();
        assert_eq!(hosts().measured_link(&measured, dir.path()).unwrap(), Some(measured.clone()));
        assert_eq!(
            hosts().describe(&measured),
            "2 host(s) x 2 rank(s) at 0.880 Gbit/s as measured, the real hosts of --hosts h1,h2"
        );
        assert_eq!(Testbed::Emulated.describe(&spec), "2 host(s) x 2 rank(s) at 10 Gbit/s, emulated");
    }

    /// The scenario's placement: an emulated cluster's hosts, ranks a host, dilation and
    /// colocated servers; on real hosts the ranks alone, which `compare` places one a slot.
    #[test]
    fn the_placement_keys_are_the_testbeds() {
        let spec = ClusterSpec::parse("4x2:10gbit:pcie").unwrap();
        let ring = Config { exchange: Exchange::Ring, bucket_mb: Some(25.0), compression: Compression::None };
        let keys = "hosts = [4]\nranks_per_host = [2]\ndilate = 'auto'\n";
        assert_eq!(Testbed::Emulated.placement(&spec, &ring), keys);
        assert_eq!(Testbed::Emulated.placement(&spec, &ps(4, false)), keys);
        assert_eq!(
            Testbed::Emulated.placement(&spec, &ps(4, true)),
            format!("{keys}servers = ['colocated']\n")
        );
        for c in [&ring, &ps(4, true)] {
            assert_eq!(hosts().placement(&spec, c), "workers = [8]\n");
        }
        assert_eq!((Testbed::Emulated.kind(), hosts().kind()), (Kind::Emulated, Kind::Hosts));
    }
}
