//! One configuration the advisor prices: how gradients are exchanged (DDP's flat or
//! hierarchical ring, ZeRO-1, a parameter server with `k` servers colocated or on hosts of
//! their own), DDP's bucket size and the compression. Each names the compared mode it runs as
//! (an entry of `gradsync_worker::modes::COMPARED`, through [`ModeKind`]) and the `train`
//! flags that make it, so that a check can run exactly what was predicted.

use gradsync_core::compress::Compression;
use gradsync_worker::cli::{Mode, flag};
use gradsync_worker::modes::Codec;
use serde::Serialize;

use super::error::AdviseError;
use super::spec::ClusterSpec;
use crate::scenario::ModeKind;

/// How a configuration exchanges gradients.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case", tag = "kind")]
pub enum Exchange {
    /// DDP's ring all-reduce over every rank, bucket by bucket behind backward
    /// (`--hierarchy off`).
    Ring,
    /// DDP's hierarchical all-reduce: inside each host, a ring among one leader per host, back
    /// inside (`--hierarchy on`).
    Hierarchical,
    /// ZeRO stage 1: each bucket reduce-scattered behind backward, the update on 1/n of the
    /// state, then every bucket all-gathered.
    Zero1,
    /// A bulk-synchronous parameter server: after backward every worker pushes its gradient to
    /// `servers` shards and pulls the new parameters.
    Ps {
        /// Server shards.
        servers: usize,
        /// Server `i` on worker host `i` (else each on a host of its own).
        colocated: bool,
    },
}

/// What a configuration does to accuracy, as gradsync measured it (docs/compression.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Accuracy {
    /// f32 values: the same training as one replica's.
    Exact,
    /// Half-precision values on the wire.
    Rounded,
    /// Top-k with error feedback: fewer values a step, more steps to an accuracy.
    Sparsified,
}

impl Accuracy {
    /// What a reader is told, for compression `c`.
    pub fn note(self, c: Compression) -> String {
        match (self, c) {
            (Accuracy::Exact, _) => "f32: unchanged".into(),
            (Accuracy::Rounded, Compression::Bf16) => {
                "bf16 rounding (2^-8 of a value): not measured in gradsync's runs".into()
            }
            (Accuracy::Rounded, _) => {
                "fp16 rounding: gradsync's runs kept their accuracy and epochs to 97% (docs/compression.md)"
                    .into()
            }
            (Accuracy::Sparsified, c) => format!(
                "{c} with error feedback: top-k 1% kept the final accuracy within 0.5 points in gradsync's \
                 runs but took 1.3-2x the epochs to 97% (docs/compression.md); the step is predicted, the \
                 steps to an accuracy are not"
            ),
        }
    }
}

/// One configuration.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Config {
    /// How gradients are exchanged.
    pub exchange: Exchange,
    /// DDP's and ZeRO-1's `--bucket-mb` (none for the parameter server, which pushes the
    /// whole gradient at once).
    pub bucket_mb: Option<f64>,
    /// `--compress`.
    #[serde(serialize_with = "as_text")]
    pub compression: Compression,
}

fn as_text<S: serde::Serializer>(c: &Compression, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&c.to_string())
}

impl Config {
    /// The compared mode it runs as: the entry of the worker's table whose uncompressed mode
    /// is this exchange's and whose codec is this compression's; the uncompressed mode itself
    /// (with `--compress` among [`Config::flags`]) where no entry compresses this way (bf16).
    pub fn mode(&self) -> ModeKind {
        let base = match self.exchange {
            Exchange::Ring => ModeKind::DdpTcp,
            Exchange::Hierarchical => ModeKind::DdpHier,
            Exchange::Zero1 => ModeKind::Zero1Tcp,
            Exchange::Ps { .. } => ModeKind::PsBsp,
        };
        let codec = Codec::of(self.compression);
        ModeKind::ALL
            .into_iter()
            .find(|m| m.base() == base && Some(m.compared().codec) == codec)
            .unwrap_or(base)
    }

    /// The configuration a compared mode's run is, to predict it beside what it measured:
    /// `bucket_mb` (DDP and ZeRO-1), `hierarchical` (DDP on hosts of several ranks), `servers`
    /// and whether they share the workers' hosts (the PS), `topk_ratio` (a top-k mode's).
    /// DDP over shared memory or NCCL is priced as the ring it runs (the predictor prices the
    /// links, not the backend). None for a mode it does not predict: local, dp, the
    /// asynchronous PS, and the ways of moving a sparse table.
    pub fn of_mode(
        mode: ModeKind,
        bucket_mb: f64,
        hierarchical: bool,
        (servers, colocated): (usize, bool),
        topk_ratio: f64,
    ) -> Option<Config> {
        let compression = mode.compress(topk_ratio).unwrap_or(Compression::None);
        let c = mode.compared();
        if c.needs.table || c.sparse_grads.is_some() || mode.is_async() {
            return None;
        }
        // ddp-hier goes through the hosts; so does a ring with --hierarchy auto where ranks
        // share hosts (a run recorded before the rings named their hierarchy).
        let through = hierarchical || c.through_hosts();
        let ring = if through { Exchange::Hierarchical } else { Exchange::Ring };
        let (exchange, bucket_mb) = match c.mode {
            Mode::Ddp => (ring, Some(bucket_mb)),
            Mode::Zero1 => (Exchange::Zero1, Some(bucket_mb)),
            Mode::Ps => (Exchange::Ps { servers, colocated }, None),
            _ => return None,
        };
        Some(Config { exchange, bucket_mb, compression })
    }

    /// The `train` flags that make it (the mode's own from the table, then what the
    /// configuration adds), as (long name, value); the servers' count and placement are the
    /// run's, not a worker's flag ([`Config::servers`]).
    pub fn flags(&self) -> Vec<(String, String)> {
        let mode = self.mode();
        let ratio = self.compression.ratio().unwrap_or(1.0);
        let mut out: Vec<(String, String)> =
            mode.compared().flags(ratio).into_iter().map(|(k, v)| (k.to_string(), v)).collect();
        if mode.compress(ratio).is_none() && !self.compression.is_none() {
            out.push((flag::COMPRESS.into(), self.compression.to_string()));
        }
        if let Some(mb) = self.bucket_mb {
            out.push((flag::BUCKET_MB.into(), mb.to_string()));
        }
        out
    }

    /// Server shards and whether they share the workers' hosts, for a parameter server.
    pub fn servers(&self) -> Option<(usize, bool)> {
        match self.exchange {
            Exchange::Ps { servers, colocated } => Some((servers, colocated)),
            _ => None,
        }
    }

    /// The mode's name with the compression it adds (`ddp-tcp+bf16`, `ddp-tcp-topk:0.01`).
    fn mode_text(&self) -> String {
        let mode = self.mode();
        match self.compression {
            Compression::TopK(r) => format!("{mode}:{r}"),
            c if mode.compress(1.0).is_none() && !c.is_none() => format!("{mode}+{c}"),
            _ => mode.to_string(),
        }
    }

    /// What it is, without its bucket size, its server count or which half precision: the
    /// configurations the verdict and "the pick would change" tell apart (`ddp-tcp
    /// hierarchical, half precision`, `ps-bsp, servers on their own hosts, f32`).
    pub fn family(&self) -> String {
        let kind = match self.exchange {
            Exchange::Ring => "ddp-tcp flat ring",
            Exchange::Hierarchical => "ddp-hier",
            Exchange::Zero1 => "zero1-tcp",
            Exchange::Ps { colocated: true, .. } => "ps-bsp, servers colocated",
            Exchange::Ps { colocated: false, .. } => "ps-bsp, servers on their own hosts",
        };
        let values = match self.compression {
            Compression::None => "f32",
            Compression::Fp16 | Compression::Bf16 => "half precision",
            Compression::TopK(_) => "top-k",
        };
        format!("{kind}, {values}")
    }

    /// Its name in tables: `ddp-hier, 25 MB buckets`, `ps-bsp, 8 servers on their
    /// own hosts`.
    pub fn label(&self) -> String {
        let mode = self.mode_text();
        let mb = |mb: Option<f64>| mb.map_or(String::new(), |m| format!(", {m} MB buckets"));
        match self.exchange {
            Exchange::Ring => format!("{mode} flat ring{}", mb(self.bucket_mb)),
            Exchange::Hierarchical => format!("{mode}{}", mb(self.bucket_mb)),
            Exchange::Zero1 => format!("{mode}{}", mb(self.bucket_mb)),
            Exchange::Ps { servers: 1, colocated } => {
                format!("{mode}, 1 server {}", if colocated { "colocated" } else { "on its own host" })
            }
            Exchange::Ps { servers, colocated } => {
                format!(
                    "{mode}, {servers} servers {}",
                    if colocated { "colocated" } else { "on their own hosts" }
                )
            }
        }
    }

    /// What it does to accuracy.
    pub fn accuracy(&self) -> Accuracy {
        match self.compression {
            Compression::None => Accuracy::Exact,
            Compression::Fp16 | Compression::Bf16 => Accuracy::Rounded,
            Compression::TopK(_) => Accuracy::Sparsified,
        }
    }

    /// Whether gradsync can run it on `c`, or why not.
    pub fn check(&self, c: &ClusterSpec) -> Result<(), AdviseError> {
        let bad = |why: String| Err(AdviseError::invalid(self.label(), why));
        let dp = !matches!(self.exchange, Exchange::Ps { .. });
        match self.bucket_mb {
            Some(mb) if !dp => {
                return bad(format!("a parameter server pushes its whole gradient, not {mb} MB buckets"));
            }
            Some(mb) if !(mb.is_finite() && mb > 0.0) => {
                return bad(format!("bucket size {mb} MB is not positive"));
            }
            None if dp => return bad("DDP and ZeRO-1 need a bucket size".into()),
            _ => {}
        }
        match self.exchange {
            Exchange::Hierarchical if c.hosts < 2 || c.per_host < 2 => bad(format!(
                "the hierarchy needs several hosts of several ranks, and {} x {} is the flat ring",
                c.hosts, c.per_host
            )),
            Exchange::Hierarchical if matches!(self.compression, Compression::TopK(_)) => {
                bad("top-k all-gathers its pairs over the flat ring: the hierarchy does not apply".into())
            }
            Exchange::Zero1 if !self.compression.is_none() => {
                bad("ZeRO-1 takes no --compress (gradsync refuses it)".into())
            }
            Exchange::Ps { servers: 0, .. } => bad("a parameter server needs at least one server".into()),
            Exchange::Ps { servers, colocated: true } if servers > c.hosts => {
                bad(format!("{servers} servers colocated one a host need {servers} hosts, not {}", c.hosts))
            }
            _ => Ok(()),
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn cfg(exchange: Exchange, bucket_mb: Option<f64>, compression: Compression) -> Config {
        Config { exchange, bucket_mb, compression }
    }

    #[test]
    fn a_configuration_names_its_compared_mode_and_flags() {
        let c = cfg(Exchange::Hierarchical, Some(25.0), Compression::Fp16);
        assert_eq!(c.mode(), "ddp-hier-fp16".parse::<ModeKind>().unwrap());
        assert_eq!(c.label(), "ddp-hier-fp16, 25 MB buckets");
        assert_eq!(c.family(), "ddp-hier, half precision");
        assert_eq!(c.family(), Config { compression: Compression::Bf16, ..c }.family());
        let flags: Vec<String> = c.flags().iter().map(|(k, v)| format!("--{k} {v}")).collect();
        assert_eq!(
            flags,
            [
                "--mode ddp",
                "--backend tcp",
                "--transport tcp",
                "--hierarchy on",
                "--compress fp16",
                "--bucket-mb 25"
            ]
        );
        // The flat ring's flags keep it flat where ranks share hosts.
        let flat = cfg(Exchange::Ring, Some(25.0), Compression::Fp16);
        assert_eq!(flat.mode(), ModeKind::DdpTcpFp16);
        assert!(flat.flags().contains(&("hierarchy".into(), "off".into())));
        assert_eq!(
            Config::of_mode(ModeKind::DdpHier, 25.0, false, (0, false), 0.01).unwrap().exchange,
            Exchange::Hierarchical
        );
        // bf16 has no compared mode of its own: the uncompressed one with --compress bf16.
        let c = cfg(Exchange::Ring, Some(5.0), Compression::Bf16);
        assert_eq!(c.mode(), ModeKind::DdpTcp);
        assert_eq!(c.label(), "ddp-tcp+bf16 flat ring, 5 MB buckets");
        assert!(c.flags().contains(&("compress".into(), "bf16".into())));
        let c = cfg(Exchange::Ps { servers: 4, colocated: false }, None, Compression::TopK(0.01));
        assert_eq!(c.mode(), ModeKind::PsBspTopk);
        assert_eq!(c.label(), "ps-bsp-topk:0.01, 4 servers on their own hosts");
        assert!(c.flags().contains(&("compress".into(), "topk:0.01".into())));
        assert_eq!(c.servers(), Some((4, false)));
        assert_eq!(c.accuracy(), Accuracy::Sparsified);
        assert!(c.accuracy().note(c.compression).contains("epochs to 97%"));
        assert_eq!(cfg(Exchange::Zero1, Some(25.0), Compression::None).mode(), ModeKind::Zero1Tcp);
    }

    #[test]
    fn a_compared_modes_run_maps_back_to_its_configuration() {
        let c = ClusterSpec::parse("4x2:10gbit:pcie").unwrap();
        let space = [Compression::None, Compression::Fp16, Compression::TopK(0.05)];
        for exchange in [
            Exchange::Ring,
            Exchange::Hierarchical,
            Exchange::Zero1,
            Exchange::Ps { servers: 2, colocated: true },
            Exchange::Ps { servers: 4, colocated: false },
        ] {
            for compression in space {
                let bucket_mb = (!matches!(exchange, Exchange::Ps { .. })).then_some(5.0);
                let cfg = Config { exchange, bucket_mb, compression };
                if cfg.check(&c).is_err() {
                    continue;
                }
                let servers = cfg.servers().unwrap_or((0, false));
                let back =
                    Config::of_mode(cfg.mode(), 5.0, exchange == Exchange::Hierarchical, servers, 0.05);
                assert_eq!(back, Some(cfg), "{}", cfg.label());
            }
        }
        assert_eq!(
            Config::of_mode(ModeKind::DdpNccl, 25.0, false, (0, false), 0.01).map(|c| c.exchange),
            Some(Exchange::Ring)
        );
        for m in [
            ModeKind::Local,
            ModeKind::Dp,
            ModeKind::PsAsp,
            ModeKind::PsSparse,
            ModeKind::DdpAllgather,
            ModeKind::Hybrid,
        ] {
            assert_eq!(Config::of_mode(m, 25.0, false, (1, false), 0.01), None, "{m}");
        }
    }

    #[test]
    fn configurations_gradsync_cannot_run_are_refused() {
        let c = ClusterSpec::parse("4x2:10gbit:pcie").unwrap();
        let flat = ClusterSpec::parse("4x1:10gbit").unwrap();
        for (config, on, want) in [
            (cfg(Exchange::Hierarchical, Some(25.0), Compression::None), &flat, "the flat ring"),
            (cfg(Exchange::Hierarchical, Some(25.0), Compression::TopK(0.01)), &c, "all-gathers"),
            (cfg(Exchange::Zero1, Some(25.0), Compression::Fp16), &c, "ZeRO-1 takes no --compress"),
            (cfg(Exchange::Ring, None, Compression::None), &c, "need a bucket size"),
            (cfg(Exchange::Ring, Some(0.0), Compression::None), &c, "not positive"),
            (
                cfg(Exchange::Ps { servers: 2, colocated: false }, Some(25.0), Compression::None),
                &c,
                "whole gradient",
            ),
            (cfg(Exchange::Ps { servers: 0, colocated: false }, None, Compression::None), &c, "at least one"),
            (
                cfg(Exchange::Ps { servers: 8, colocated: true }, None, Compression::None),
                &c,
                "need 8 hosts, not 4",
            ),
        ] {
            let e = config.check(on).unwrap_err().to_string();
            assert!(e.contains(want) && e.starts_with(&config.label()), "{e}");
        }
        assert!(
            cfg(Exchange::Ps { servers: 8, colocated: false }, None, Compression::None).check(&c).is_ok()
        );
    }
}
