//! The modes `gradsync-bench compare` compares, declared once ([`COMPARED`]): each one's name,
//! what it is, the `train` flags that make it (named as [`crate::cli::flag`] names them, each
//! value by its type), the parameter servers it runs, what carries its traffic, what it needs,
//! and its family. The comparison's scenarios, command lines and report read this table, so
//! comparing one more mode is one entry here (and a strategy behind a `--mode` of its own when
//! it is a new algorithm).

use gradsync_core::compress::Compression;
use gradsync_proto::SyncMode;

use crate::cli::flag::{self, choice};
use crate::cli::{Backend, Mode, Transport};
use crate::collective::Hierarchy;
use crate::strategy::SparseGrads;

/// One compared mode: a name for a set of `train` flags, and what a reader must know of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Compared {
    /// Its name in scenarios, on command lines, in file names, tables and charts.
    pub name: &'static str,
    /// Other names a scenario or a command line may give it.
    pub aliases: &'static [&'static str],
    /// What it is, in one line (the help of `compare --modes`).
    pub about: &'static str,
    /// `--mode`: the strategy that trains it.
    pub mode: Mode,
    /// DDP's `--backend` and `--transport`, for a mode whose ranks meet over the rendezvous
    /// store.
    pub ring: Option<Ring>,
    /// `--compress`.
    pub codec: Codec,
    /// `--sparse-grads`, where it names one.
    pub sparse_grads: Option<SparseGrads>,
    /// The parameter servers it runs first, if any.
    pub servers: Option<Servers>,
    /// What carries its traffic.
    pub wire: Wire,
    /// What it needs beyond a model and workers.
    pub needs: Needs,
    /// Why it cannot train a model with an embedding table, if it cannot (the worker refuses
    /// such a run; a scenario naming both is refused before any run starts).
    pub refuses_table: Option<&'static str>,
    /// Its family, which the report groups and words it by.
    pub family: Family,
    /// Its label under one bar of a chart: `{n}` stands for the workers, `{k}` for the server
    /// shards.
    pub short: &'static str,
}

/// The ring a mode's ranks form.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ring {
    /// `--backend`.
    pub backend: Backend,
    /// `--transport`, always named where the backend takes one, so that a TCP mode is sockets
    /// even when every rank shares a host.
    pub transport: Option<Transport>,
    /// `--hierarchy`, always named where the backend takes one, so that a flat ring stays flat
    /// when several ranks share a host (`auto` would go through the hosts there).
    pub hierarchy: Option<Hierarchy>,
}

/// How a compared mode compresses gradients on the wire (`--compress`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Codec {
    /// Full f32 values.
    None,
    /// Half precision.
    Fp16,
    /// Top-k with error feedback, at the comparison's ratio (a scenario's `topk_ratio`).
    TopK,
}

impl Codec {
    /// The `--compress` value, top-k at `topk_ratio`.
    pub fn compression(self, topk_ratio: f64) -> Compression {
        match self {
            Codec::None => Compression::None,
            Codec::Fp16 => Compression::Fp16,
            Codec::TopK => Compression::TopK(topk_ratio),
        }
    }

    /// The codec of a `--compress` value, if a compared mode uses it.
    pub fn of(c: Compression) -> Option<Codec> {
        match c {
            Compression::None => Some(Codec::None),
            Compression::Fp16 => Some(Codec::Fp16),
            Compression::TopK(_) => Some(Codec::TopK),
            Compression::Bf16 => None,
        }
    }
}

/// The parameter servers a mode runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Servers {
    /// Their `--sync`.
    pub sync: ServerSync,
    /// Whether they hold a sparse model's table alone (`gradsync-server --table-only`).
    pub table_only: bool,
}

/// The servers' synchronisation, its bound (SSP's) left to the comparison.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ServerSync {
    /// Bulk-synchronous.
    Bsp,
    /// Asynchronous.
    Asp,
    /// Stale-synchronous.
    Ssp,
}

impl ServerSync {
    /// The servers' `--sync`, SSP with `staleness` steps.
    pub fn mode(self, staleness: u64) -> SyncMode {
        match self {
            ServerSync::Bsp => SyncMode::Bsp,
            ServerSync::Asp => SyncMode::Asp,
            ServerSync::Ssp => SyncMode::Ssp(staleness),
        }
    }

    /// How a metrics header's `variant` begins for it (`bsp`, `asp`, `ssp:2`).
    fn variant(self) -> &'static str {
        match self {
            ServerSync::Bsp => "bsp",
            ServerSync::Asp => "asp",
            ServerSync::Ssp => "ssp",
        }
    }

    /// Whether the workers wait for every gradient of a step (only BSP does).
    pub fn is_synchronous(self) -> bool {
        self == ServerSync::Bsp
    }
}

/// What carries a mode's traffic: modes are compared like for like only where this says so.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wire {
    /// Nothing: one replica.
    None,
    /// Memory inside one process.
    InProcess,
    /// gRPC over TCP, to parameter servers.
    Grpc,
    /// TCP sockets between the ranks.
    Tcp,
    /// TCP sockets between the ranks and gRPC over TCP to the servers.
    TcpAndGrpc,
    /// Shared memory between the ranks of one host.
    Shm,
    /// NCCL between GPUs.
    Nccl,
}

impl Wire {
    /// How every label a reader sees names it.
    pub fn describe(self) -> &'static str {
        match self {
            Wire::None => "none",
            Wire::InProcess => "in one process",
            Wire::Grpc => "gRPC over TCP",
            Wire::Tcp => "TCP sockets",
            Wire::TcpAndGrpc => "TCP sockets and gRPC over TCP",
            Wire::Shm => "shared memory",
            Wire::Nccl => "NCCL",
        }
    }

    /// Whether it crosses TCP (so that its figures compare with each other's).
    pub fn over_tcp(self) -> bool {
        matches!(self, Wire::Grpc | Wire::Tcp | Wire::TcpAndGrpc)
    }
}

/// What a mode needs beyond a model and workers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Needs {
    /// A model with an embedding table (it is one of the ways of moving one).
    pub table: bool,
    /// A GPU of its own for every rank (NCCL refuses two ranks on one device).
    pub gpu: bool,
    /// Every rank on one host.
    pub one_host: bool,
}

impl Needs {
    /// Nothing more.
    pub const NOTHING: Needs = Needs { table: false, gpu: false, one_host: false };
    /// A model with an embedding table.
    pub const TABLE: Needs = Needs { table: true, ..Needs::NOTHING };
}

/// The family a mode belongs to, which the report groups and words it by.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    /// One process, one replica.
    Local,
    /// One process, several replicas.
    Dp,
    /// Workers and parameter servers.
    Ps,
    /// Ranks exchanging among themselves over a ring's links (DDP, ZeRO-1).
    Ring,
    /// A ring for the dense part, parameter servers for the table.
    Hybrid,
}

/// local, which dp is written from.
const LOCAL: Compared = Compared {
    name: "local",
    aliases: &[],
    about: "One process, one replica (the baseline every speed-up is measured against)",
    mode: Mode::Local,
    ring: None,
    codec: Codec::None,
    sparse_grads: None,
    servers: None,
    wire: Wire::None,
    needs: Needs::NOTHING,
    refuses_table: None,
    family: Family::Local,
    short: "local",
};

/// ps-bsp, which the other parameter-server modes and the hybrid are written from.
const PS_BSP: Compared = Compared {
    name: "ps-bsp",
    aliases: &[],
    about: "Parameter server, bulk-synchronous",
    mode: Mode::Ps,
    ring: None,
    codec: Codec::None,
    sparse_grads: None,
    servers: Some(Servers { sync: ServerSync::Bsp, table_only: false }),
    wire: Wire::Grpc,
    needs: Needs::NOTHING,
    refuses_table: None,
    family: Family::Ps,
    short: "bsp{n}k{k}",
};

/// DDP's ring over TCP sockets.
const TCP: Ring =
    Ring { backend: Backend::Tcp, transport: Some(Transport::Tcp), hierarchy: Some(Hierarchy::Off) };

/// ddp-tcp, which the other rings are written from.
const DDP_TCP: Compared = Compared {
    name: "ddp-tcp",
    aliases: &[],
    about: "DDP ring all-reduce over TCP sockets (on loopback here: the parameter server's wire)",
    mode: Mode::Ddp,
    ring: Some(TCP),
    codec: Codec::None,
    sparse_grads: None,
    servers: None,
    wire: Wire::Tcp,
    needs: Needs::NOTHING,
    refuses_table: None,
    family: Family::Ring,
    short: "ring{n}",
};

/// Why the PS's compressed pushes cannot carry a table.
const PS_COMPRESSED_TABLE: &str =
    "the parameter server moves a table's rows as ids and f32 values, uncompressed (use ps-sparse)";

/// Every compared mode, in report order: each written as what it changes of the mode it is
/// written from.
pub const COMPARED: &[Compared] = &[
    LOCAL,
    Compared {
        name: "dp",
        about: "One process, several replicas",
        mode: Mode::Dp,
        wire: Wire::InProcess,
        family: Family::Dp,
        short: "dp{n}",
        ..LOCAL
    },
    PS_BSP,
    Compared {
        name: "ps-asp",
        about: "Parameter server, asynchronous",
        servers: Some(Servers { sync: ServerSync::Asp, table_only: false }),
        short: "asp{n}k{k}",
        ..PS_BSP
    },
    Compared {
        name: "ps-ssp",
        about: "Parameter server, stale-synchronous",
        servers: Some(Servers { sync: ServerSync::Ssp, table_only: false }),
        short: "ssp{n}k{k}",
        ..PS_BSP
    },
    DDP_TCP,
    Compared {
        name: "ddp-hier",
        about: "DDP all-reduce through the hosts over TCP sockets: reduce inside each host, ring among one \
                leader per host, broadcast inside (`--hierarchy on`, NCCL's and Horovod's hierarchical \
                all-reduce); with one rank a host, the flat ring",
        ring: Some(Ring { hierarchy: Some(Hierarchy::On), ..TCP }),
        short: "hier{n}",
        ..DDP_TCP
    },
    Compared {
        name: "ddp-shm",
        about: "DDP ring all-reduce over shared memory (one host only; not a network)",
        ring: Some(Ring { transport: Some(Transport::Shm), ..TCP }),
        wire: Wire::Shm,
        needs: Needs { one_host: true, ..Needs::NOTHING },
        short: "shm{n}",
        ..DDP_TCP
    },
    Compared {
        name: "ddp-nccl",
        about: "DDP over NCCL (GPU only)",
        ring: Some(Ring { backend: Backend::Nccl, transport: None, hierarchy: None }),
        wire: Wire::Nccl,
        needs: Needs { gpu: true, ..Needs::NOTHING },
        short: "nccl{n}",
        ..DDP_TCP
    },
    Compared {
        name: "zero1-tcp",
        about: "ZeRO stage 1 over TCP sockets: reduce-scatter, each rank updates its 1/n shard, all-gather",
        mode: Mode::Zero1,
        refuses_table: Some(
            "ZeRO-1's sharded update is not lazy, and a table's rows are updated only where a batch named them",
        ),
        short: "zero{n}",
        ..DDP_TCP
    },
    Compared {
        name: "ps-bsp-fp16",
        about: "ps-bsp with fp16 pushes (`--compress fp16`)",
        codec: Codec::Fp16,
        refuses_table: Some(PS_COMPRESSED_TABLE),
        short: "fp16-bsp{n}k{k}",
        ..PS_BSP
    },
    Compared {
        name: "ps-bsp-topk",
        about: "ps-bsp with top-k pushes and error feedback (`--compress topk:R`, R the scenario's \
                `topk_ratio`)",
        codec: Codec::TopK,
        refuses_table: Some(PS_COMPRESSED_TABLE),
        short: "topk-bsp{n}k{k}",
        ..PS_BSP
    },
    Compared {
        name: "ddp-tcp-topk",
        about: "ddp-tcp with each bucket's top-k all-gathered, with error feedback (`--compress topk:R`)",
        codec: Codec::TopK,
        short: "topk-ring{n}",
        ..DDP_TCP
    },
    Compared {
        name: "ddp-tcp-fp16",
        about: "ddp-tcp with the ring's half-precision all-reduce (`--compress fp16`)",
        codec: Codec::Fp16,
        short: "fp16-ring{n}",
        ..DDP_TCP
    },
    Compared {
        name: "ddp-hier-fp16",
        about: "ddp-hier with half-precision values on every hop, inside the hosts and among their leaders \
                (`--compress fp16`)",
        ring: Some(Ring { hierarchy: Some(Hierarchy::On), ..TCP }),
        codec: Codec::Fp16,
        short: "fp16-hier{n}",
        ..DDP_TCP
    },
    Compared {
        name: "ps-sparse",
        about: "Parameter server, bulk-synchronous, on a model with an embedding table: each worker pushes \
                the rows its batch named and pulls the rows its next batch names, by id (the PS's own way \
                with a table; ps-bsp on such a model is the same run)",
        needs: Needs::TABLE,
        short: "sparse{n}k{k}",
        ..PS_BSP
    },
    Compared {
        name: "ddp-dense",
        about: "DDP over TCP sockets with the table's gradient all-reduced whole, zeros included \
                (`--sparse-grads dense`, `nn.EmbeddingBag` under DDP)",
        sparse_grads: Some(SparseGrads::Dense),
        needs: Needs::TABLE,
        short: "ddp-dense{n}",
        ..DDP_TCP
    },
    Compared {
        name: "ddp-allgather",
        aliases: &["ddp-sparse"],
        about: "DDP over TCP sockets with the rows each rank's batch named all-gathered as (id, values) and \
                summed (`--sparse-grads allgather`, DDP's way with `sparse=True`); `ddp-sparse` in a \
                scenario or on the command line names it too",
        sparse_grads: Some(SparseGrads::Allgather),
        needs: Needs::TABLE,
        short: "ddp-allgather{n}",
        ..DDP_TCP
    },
    Compared {
        name: "hybrid",
        about: "The table on parameter servers that hold it alone (`gradsync-server --table-only`, rows by \
                id), the rest of the model all-reduced by DDP's ring over TCP (`--mode hybrid`)",
        mode: Mode::Hybrid,
        ring: Some(TCP),
        servers: Some(Servers { sync: ServerSync::Bsp, table_only: true }),
        wire: Wire::TcpAndGrpc,
        needs: Needs::TABLE,
        family: Family::Hybrid,
        short: "hybrid{n}k{k}",
        ..PS_BSP
    },
];

/// The index in [`COMPARED`] of the mode named `name` (or one of its aliases), if any; usable
/// in constants, so that a name written in code is checked as it compiles.
pub const fn position(name: &str) -> Option<usize> {
    let mut i = 0;
    while i < COMPARED.len() {
        if same(COMPARED[i].name, name) {
            return Some(i);
        }
        let mut a = 0;
        while a < COMPARED[i].aliases.len() {
            if same(COMPARED[i].aliases[a], name) {
                return Some(i);
            }
            a += 1;
        }
        i += 1;
    }
    None
}

/// String equality, in a constant.
const fn same(a: &str, b: &str) -> bool {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    if a.len() != b.len() {
        return false;
    }
    let mut i = 0;
    while i < a.len() {
        if a[i] != b[i] {
            return false;
        }
        i += 1;
    }
    true
}

/// How many names and aliases [`COMPARED`] holds.
const NAME_COUNT: usize = {
    let (mut n, mut i) = (0, 0);
    while i < COMPARED.len() {
        n += 1 + COMPARED[i].aliases.len();
        i += 1;
    }
    n
};

/// Every name and alias, in table order, each entry's aliases after its name (what a parser of
/// mode names lists as expected).
pub const NAMES: [&str; NAME_COUNT] = {
    let mut out = [""; NAME_COUNT];
    let (mut n, mut i) = (0, 0);
    while i < COMPARED.len() {
        out[n] = COMPARED[i].name;
        n += 1;
        let mut a = 0;
        while a < COMPARED[i].aliases.len() {
            out[n] = COMPARED[i].aliases[a];
            n += 1;
            a += 1;
        }
        i += 1;
    }
    out
};

impl Compared {
    /// The `train` flags that make this mode, as (long name, value) in command-line order:
    /// `--mode`, the ring's `--backend` and `--transport`, `--compress` (top-k at
    /// `topk_ratio`), `--sparse-grads`. The rest of a command line (model, data, rank, the
    /// servers' addresses) is the comparison's.
    pub fn flags(&self, topk_ratio: f64) -> Vec<(&'static str, String)> {
        let mut out = vec![(flag::MODE, choice(self.mode))];
        if let Some(r) = self.ring {
            out.push((flag::BACKEND, choice(r.backend)));
            if let Some(t) = r.transport {
                out.push((flag::TRANSPORT, choice(t)));
            }
            if let Some(h) = r.hierarchy {
                out.push((flag::HIERARCHY, choice(h)));
            }
        }
        if let Some(c) = self.compression(topk_ratio) {
            out.push((flag::COMPRESS, c.to_string()));
        }
        if let Some(s) = self.sparse_grads {
            out.push((flag::SPARSE_GRADS, choice(s)));
        }
        out
    }

    /// Its `--compress` value, top-k at `topk_ratio`, when it compresses.
    pub fn compression(&self, topk_ratio: f64) -> Option<Compression> {
        Some(self.codec.compression(topk_ratio)).filter(|c| !c.is_none())
    }

    /// Whether all its workers are one process (local training, DataParallel's replicas).
    pub fn one_process(&self) -> bool {
        matches!(self.mode, Mode::Local | Mode::Dp)
    }

    /// The `--sparse-grads` its workers run with, named or not.
    fn sparse_grads_run(&self) -> SparseGrads {
        self.sparse_grads.unwrap_or_default()
    }

    /// Whether it and `other` start the same processes with the same flags, named or left to
    /// their defaults (on a model with a table, ps-bsp is ps-sparse and ddp-tcp ddp-dense).
    pub fn same_processes(&self, other: &Compared) -> bool {
        self.codec == other.codec && self.same_but_codec(other)
    }

    /// Whether it and `other` differ in their compression alone, if at all.
    fn same_but_codec(&self, other: &Compared) -> bool {
        (self.mode, self.ring, self.sparse_grads_run(), self.servers)
            == (other.mode, other.ring, other.sparse_grads_run(), other.servers)
    }

    /// Whether it moves the ring all-reduce's f32 bytes over the ring (DDP's all-reduce, or
    /// ZeRO-1's reduce-scatter and all-gather: the same two halves, split around the update):
    /// ddp-dense all-reduces the whole model, table included.
    pub fn is_ring(&self) -> bool {
        self.family == Family::Ring
            && self.codec == Codec::None
            && self.sparse_grads_run() == SparseGrads::Dense
            && !self.through_hosts()
    }

    /// Whether its all-reduce goes through the hosts (`--hierarchy on`).
    pub fn through_hosts(&self) -> bool {
        self.ring.is_some_and(|r| r.hierarchy == Some(Hierarchy::On))
    }
}

/// The index in [`COMPARED`] of the uncompressed mode entry `i` compresses (`i` itself for a
/// mode that compresses nothing): the one that differs in its compression alone, on any model.
pub fn base(i: usize) -> usize {
    let Some(me) = COMPARED.get(i) else { return i };
    if me.codec == Codec::None {
        return i;
    }
    COMPARED
        .iter()
        .position(|c| c.codec == Codec::None && !c.needs.table && c.same_but_codec(me))
        .unwrap_or(i)
}

/// What a metrics header says of the mode that wrote it.
#[derive(Debug, Clone, Copy, Default)]
pub struct HeaderMode<'a> {
    /// `mode`: the worker's `--mode` (`server` for a parameter server).
    pub mode: &'a str,
    /// `variant`: the servers' synchronisation for a PS, the collective backend for a ring.
    pub variant: &'a str,
    /// `extra.transport`, for the TCP backend: what the ring ran over.
    pub transport: Option<&'a str>,
    /// `extra.compression`.
    pub compression: Option<&'a str>,
    /// Whether the model has an embedding table.
    pub table: bool,
    /// `extra.sparse_grads`, for DDP.
    pub sparse_grads: Option<&'a str>,
    /// `extra.all_reduce`, for the TCP backend: `ring` or `hierarchical` (absent: the ring).
    pub all_reduce: Option<&'a str>,
}

/// The index in [`COMPARED`] of the mode a metrics header describes, if any: the first entry
/// whose flags it matches, among them one that needs a table on a model with one (a PS worker
/// under BSP on such a model is ps-sparse, a DDP rank over TCP sockets ddp-allgather or
/// ddp-dense by its `sparse_grads`) and one that needs none elsewhere.
pub fn from_header(h: &HeaderMode) -> Option<usize> {
    let codec = Codec::of(h.compression.unwrap_or("none").parse().ok()?)?;
    let mode = if h.mode == "server" { Mode::Ps.name() } else { h.mode };
    let sparse = h.sparse_grads.unwrap_or(SparseGrads::Dense.name());
    let fits = |c: &Compared| {
        let sync = match c.servers {
            Some(s) if c.mode == Mode::Ps => h.variant.starts_with(s.sync.variant()),
            _ => true,
        };
        let ring = c.ring.is_none_or(|r| {
            let shm = h.transport == Some(Transport::Shm.name());
            let through_hosts = h.all_reduce == Some("hierarchical");
            (r.backend == Backend::Nccl) == (h.variant == choice(Backend::Nccl))
                && match r.transport {
                    Some(Transport::Shm) => shm,
                    Some(_) => !shm,
                    None => true,
                }
                && match r.hierarchy {
                    Some(Hierarchy::On) => through_hosts,
                    Some(_) => !through_hosts,
                    None => true,
                }
        });
        c.mode.name() == mode
            && c.codec == codec
            && sync
            && ring
            && c.sparse_grads.is_none_or(|s| s.name() == sparse)
    };
    let fitting: Vec<usize> = (0..COMPARED.len()).filter(|&i| fits(&COMPARED[i])).collect();
    fitting.iter().copied().find(|&i| COMPARED[i].needs.table == h.table).or(fitting.first().copied())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::cli::{Cli, Command, TrainArgs};
    use clap::Parser;

    /// `flags` as the worker's own parser reads them.
    fn parsed(c: &Compared, topk_ratio: f64) -> TrainArgs {
        let mut argv = vec!["gradsync-worker".to_string(), "train".to_string()];
        for (long, value) in c.flags(topk_ratio) {
            argv.extend([format!("--{long}"), value]);
        }
        match Cli::try_parse_from(&argv) {
            Ok(Cli { command: Command::Train(a) }) => *a,
            Ok(other) => panic!("{}: {argv:?} is not a train command: {other:?}", c.name),
            Err(e) => panic!("{}: {argv:?}: {e}", c.name),
        }
    }

    /// Every entry's command line parses with the worker's own parser, into the mode, ring,
    /// compression and table handling the entry declares.
    #[test]
    fn every_entrys_flags_parse_into_what_it_declares() {
        for c in COMPARED {
            let a = parsed(c, 0.05);
            assert_eq!(a.mode, c.mode, "{}", c.name);
            if let Some(r) = c.ring {
                assert_eq!(a.ddp.backend, r.backend, "{}", c.name);
                assert_eq!(a.ddp.transport, r.transport.unwrap_or_default(), "{}", c.name);
                assert_eq!(a.ddp.hierarchy, r.hierarchy.unwrap_or_default(), "{}", c.name);
            }
            assert_eq!(a.compress, c.codec.compression(0.05), "{}", c.name);
            assert_eq!(a.ddp.sparse_grads, c.sparse_grads.unwrap_or_default(), "{}", c.name);
        }
        // Top-k carries the comparison's ratio.
        let topk = &COMPARED[position("ddp-tcp-topk").unwrap()];
        assert_eq!(parsed(topk, 0.25).compress, Compression::TopK(0.25));
    }

    #[test]
    fn a_chart_label_names_server_shards_only_where_the_mode_runs_servers() {
        // `ddp-dense` and `ddp-allgather` were labelled `ddp-dense2k0`: shards they never run.
        for c in COMPARED {
            assert_eq!(
                c.short.contains("{k}"),
                c.servers.is_some(),
                "{}: label {:?} against servers {:?}",
                c.name,
                c.short,
                c.servers
            );
        }
    }

    #[test]
    fn names_are_unique_and_found_with_their_aliases() {
        let mut seen = std::collections::BTreeSet::new();
        for name in NAMES {
            assert!(seen.insert(name), "{name} names two modes");
            let i = position(name).unwrap();
            assert!(COMPARED[i].name == name || COMPARED[i].aliases.contains(&name), "{name}");
        }
        assert_eq!(position("ddp-sparse"), position("ddp-allgather"));
        assert_eq!(position("warp"), None);
        assert_eq!(NAMES.len(), COMPARED.len() + 1);
    }

    /// A compressed mode's base is the mode without its compression; the others are their own.
    #[test]
    fn each_compressed_mode_has_one_uncompressed_base() {
        for (i, c) in COMPARED.iter().enumerate() {
            let b = &COMPARED[base(i)];
            assert_eq!(b.codec, Codec::None, "{}", c.name);
            assert_eq!(base(i) == i, c.codec == Codec::None, "{}", c.name);
            assert!(b.same_but_codec(c), "{} -> {}", c.name, b.name);
            assert!(base(i) == i || !b.needs.table, "{} -> {}", c.name, b.name);
        }
        let name = |n: &str| COMPARED[base(position(n).unwrap())].name;
        assert_eq!(
            [name("ps-bsp-fp16"), name("ps-bsp-topk"), name("ddp-tcp-topk"), name("ddp-tcp-fp16")],
            ["ps-bsp", "ps-bsp", "ddp-tcp", "ddp-tcp"]
        );
    }

    /// Each entry is read back from the header its own run writes.
    #[test]
    fn every_entry_is_read_back_from_its_header() {
        for (i, c) in COMPARED.iter().enumerate() {
            let compression = c.codec.compression(0.01).to_string();
            let h = HeaderMode {
                mode: c.mode.name(),
                variant: match (c.servers, c.ring) {
                    (Some(s), _) if c.mode == Mode::Ps => s.sync.variant(),
                    (_, Some(r)) if r.backend == Backend::Nccl => "nccl",
                    (_, Some(_)) => "tcp",
                    _ => "",
                },
                transport: c.ring.and_then(|r| r.transport).map(Transport::name),
                compression: Some(&compression),
                table: c.needs.table,
                sparse_grads: Some(if c.mode == Mode::Hybrid {
                    "servers"
                } else {
                    c.sparse_grads_run().name()
                }),
                all_reduce: c
                    .ring
                    .filter(|r| r.backend == Backend::Tcp)
                    .map(|_| if c.through_hosts() { "hierarchical" } else { "ring" }),
            };
            let found = from_header(&h).map(|j| COMPARED[j].name);
            // ps-bsp on a model without a table reads as itself; so does every other entry.
            assert_eq!(found, Some(COMPARED[i].name), "{h:?}");
        }
        // A compression no compared mode uses is no compared mode.
        assert_eq!(
            from_header(&HeaderMode { mode: "ddp", compression: Some("bf16"), ..Default::default() }),
            None
        );
    }

    #[test]
    fn rings_and_wires_are_what_the_comparison_compares_like_for_like() {
        let c = |n: &str| COMPARED[position(n).unwrap()];
        let rings: Vec<&str> = COMPARED.iter().filter(|c| c.is_ring()).map(|c| c.name).collect();
        assert_eq!(rings, ["ddp-tcp", "ddp-shm", "ddp-nccl", "zero1-tcp", "ddp-dense"]);
        assert!(c("ps-bsp").same_processes(&c("ps-sparse")) && c("ddp-tcp").same_processes(&c("ddp-dense")));
        assert!(
            !c("ddp-tcp").same_processes(&c("ddp-allgather")) && !c("ps-bsp").same_processes(&c("ps-asp"))
        );
        let tcp: Vec<&str> = COMPARED.iter().filter(|c| !c.wire.over_tcp()).map(|c| c.name).collect();
        assert_eq!(tcp, ["local", "dp", "ddp-shm", "ddp-nccl"]);
        // Every ring over TCP names its hierarchy: the flat ones stay flat on shared hosts.
        assert!(
            COMPARED
                .iter()
                .filter_map(|c| c.ring)
                .all(|r| (r.backend == Backend::Tcp) == r.hierarchy.is_some())
        );
        assert!(
            c("ddp-hier").through_hosts()
                && !c("ddp-hier").is_ring()
                && !c("ddp-hier").same_processes(&c("ddp-tcp"))
        );
    }

    /// A flat ring's old header (no `all_reduce`) still reads as ddp-tcp; a hierarchical one
    /// as ddp-hier.
    #[test]
    fn the_hierarchy_a_header_names_tells_the_rings_apart() {
        let h = |all_reduce| HeaderMode {
            mode: "ddp",
            variant: "tcp",
            transport: Some("tcp"),
            all_reduce,
            ..Default::default()
        };
        let name = |all_reduce| from_header(&h(all_reduce)).map(|i| COMPARED[i].name);
        assert_eq!(name(None), Some("ddp-tcp"));
        assert_eq!(name(Some("ring")), Some("ddp-tcp"));
        assert_eq!(name(Some("hierarchical")), Some("ddp-hier"));
    }
}
