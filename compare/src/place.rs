//! Where the processes of a run go on the hosts of `compare --hosts` or the nodes of
//! `compare --slurm` ([`assign`]), whether those can take them ([`placement_short`]: GPUs for
//! NCCL, memory), and the memory a run's processes hold ([`run_memory`], [`process_memory`]),
//! which also tells whether this machine can take a run.

use gradsync_worker::modes::Family;

use crate::scenario::{ModeKind, RunSpec};
use crate::site::HostFacts;

/// Which host each server shard and each worker rank of a run goes to, given each host's
/// slots: parameter-server shards on hosts of their own when enough are left for the workers
/// (else shard `i` on host `i` among the workers), workers spread over their hosts in turn,
/// each host taking at most its slots; a ring over every host; `local` and `dp` (one process)
/// on the first; `ddp-shm` (shared memory) on one host with the slots for every rank.
pub fn assign(
    slots: &[usize],
    mode: ModeKind,
    workers: usize,
    shards: usize,
) -> Result<(Vec<usize>, Vec<usize>), String> {
    let n = slots.len();
    if n == 0 {
        return Err("no hosts".into());
    }
    let compared = mode.compared();
    if compared.one_process() {
        return Ok((vec![], vec![0]));
    }
    if compared.needs.one_host {
        return match slots.iter().position(|&s| s >= workers) {
            Some(h) => Ok((vec![], vec![h; workers])),
            None => {
                Err(format!("{mode} needs its {workers} ranks on one host, and no host has {workers} slots"))
            }
        };
    }
    let (servers, pool): (Vec<usize>, Vec<usize>) = if mode.is_ps() {
        let k = shards.max(1);
        if n > k {
            ((0..k).collect(), (k..n).collect())
        } else {
            ((0..k).map(|i| i % n).collect(), (0..n).collect())
        }
    } else {
        (vec![], (0..n).collect())
    };
    let capacity: usize = pool.iter().map(|&h| slots[h]).sum();
    if capacity < workers {
        return Err(format!(
            "{workers} workers need {workers} slots and the hosts left for them have {capacity}"
        ));
    }
    let mut used = vec![0usize; n];
    let mut out = Vec::with_capacity(workers);
    let mut turn = 0;
    while out.len() < workers {
        let h = pool[turn % pool.len()];
        if used[h] < slots[h] {
            used[h] += 1;
            out.push(h);
        }
        turn += 1;
    }
    Ok((servers, out))
}

/// Why the hosts (or Slurm nodes, `what`) a run is placed on cannot take it, if they cannot:
/// `ddp-nccl` with more ranks on one than it has GPUs (NCCL refuses two ranks on one device),
/// or the processes placed on one needing more than 0.9 of the memory it had available when
/// it was checked ([`process_memory`]; a host whose memory was not read is not checked).
/// `servers` and `workers` are indexes into `hosts`.
pub fn placement_short(
    spec: &RunSpec,
    hosts: &[&HostFacts],
    servers: &[usize],
    workers: &[usize],
    what: &str,
) -> Option<String> {
    if spec.mode.compared().needs.gpu {
        for (i, h) in hosts.iter().enumerate() {
            let ranks = workers.iter().filter(|&&w| w == i).count();
            if ranks > h.gpus.len() {
                return Some(format!(
                    "{ranks} NCCL ranks placed on {what} {} and it has {} GPU(s)",
                    h.name,
                    h.gpus.len()
                ));
            }
        }
    }
    let params = gradsync_core::model::ModelSpec::parse(&spec.model)
        .map(|m| gradsync_core::model::Layout::new(&m).len)
        .ok()?;
    let (server, worker) = process_memory(spec.mode, spec.workers, spec.shards, params);
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    hosts.iter().enumerate().find_map(|(i, h)| {
        let (k, w) = (servers.iter().filter(|&&s| s == i).count(), workers.iter().filter(|&&s| s == i).count());
        let need = k as u64 * server + w as u64 * worker;
        (h.memory_available_bytes > 0 && need as f64 > 0.9 * h.memory_available_bytes as f64).then(|| {
            let who = match (k, w) {
                (0, w) => format!("{w} worker(s)"),
                (k, 0) => format!("{k} server shard(s)"),
                (k, w) => format!("{k} server shard(s) and {w} worker(s)"),
            };
            format!(
                "{who} placed on {what} {} need about {:.1} GiB ({:.0} MB of parameters each: parameters, \
                 gradients, optimiser state and buffers) and it had {:.1} GiB available: run fewer workers, or \
                 on more {what}s",
                h.name,
                gib(need),
                params as f64 * 4.0 / 1e6,
                gib(h.memory_available_bytes)
            )
        })
    })
}

/// Bytes one server shard and one worker process of a run hold at most (for [`run_memory`]'s
/// run, split by process): a parameter server's shards share its 5S evenly; DP is one
/// process holding everything.
pub fn process_memory(mode: ModeKind, workers: usize, shards: usize, params: usize) -> (u64, u64) {
    let s = params as u64 * 4;
    let k = shards.max(1) as u64;
    match mode.compared().family {
        Family::Local | Family::Dp => (0, run_memory(mode, workers, params)),
        Family::Hybrid => ((5 * s).div_ceil(k), 4 * s),
        Family::Ps => ((5 * s).div_ceil(k), 3 * s),
        Family::Ring => (0, 4 * s),
    }
}

/// Bytes a run of `mode` holds at most, all processes together, for a model of `params`
/// f32 parameters (S bytes): each training process its parameters, gradients and momentum,
/// and one more S of communication buffers for a ring; DP its replicas' parameters and
/// gradients and replica 0's sum, momentum and copies; the parameter servers, over all their
/// shards, parameters, momentum, the sum of pushes and the next step's parameters and momentum.
pub fn run_memory(mode: ModeKind, workers: usize, params: usize) -> u64 {
    let s = params as u64 * 4;
    let w = workers.max(1) as u64;
    match mode.compared().family {
        Family::Local => 3 * s,
        Family::Dp => (2 * w + 4) * s,
        // A whole replica per rank, as DDP's, and the table (at most the model) on the servers.
        Family::Hybrid => 4 * s * w + 5 * s,
        Family::Ps => 3 * s * w + 5 * s,
        Family::Ring => 4 * s * w,
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn servers_get_hosts_of_their_own_when_enough_and_workers_spread_by_slots() {
        // Four hosts, one shard: the server alone on host 0, workers spread over 1..3.
        assert_eq!(assign(&[2, 2, 2, 2], ModeKind::PsBsp, 4, 1).unwrap(), (vec![0], vec![1, 2, 3, 1]));
        // Two shards on two of four hosts.
        assert_eq!(assign(&[2, 2, 2, 2], ModeKind::PsAsp, 4, 2).unwrap(), (vec![0, 1], vec![2, 3, 2, 3]));
        // Not enough hosts: the shards share them with the workers.
        assert_eq!(assign(&[4, 4], ModeKind::PsBsp, 2, 2).unwrap(), (vec![0, 1], vec![0, 1]));
        // A ring over every host, each up to its slots.
        assert_eq!(assign(&[1, 3], ModeKind::DdpTcp, 4, 0).unwrap(), (vec![], vec![0, 1, 1, 1]));
        assert_eq!(assign(&[2, 2, 2], ModeKind::DdpTcp, 2, 0).unwrap(), (vec![], vec![0, 1]));
        assert_eq!(assign(&[2, 2], ModeKind::Local, 1, 0).unwrap(), (vec![], vec![0]));
        assert_eq!(assign(&[1, 4], ModeKind::DdpShm, 4, 0).unwrap(), (vec![], vec![1, 1, 1, 1]));
        let e = assign(&[2, 2], ModeKind::DdpShm, 4, 0).unwrap_err();
        assert!(e.contains("one host"), "{e}");
        let e = assign(&[1, 1, 1], ModeKind::PsBsp, 4, 1).unwrap_err();
        assert!(e.contains("4 workers need 4 slots and the hosts left for them have 2"), "{e}");
    }

    /// A run placed on hosts is checked host by host: its processes there against the memory
    /// the host had available, and NCCL ranks against the host's GPUs, naming the host.
    #[test]
    fn placement_is_checked_against_each_hosts_memory_and_gpus() {
        let mut s = crate::scenario::Scenario::load(None).unwrap();
        (s.models, s.modes, s.workers, s.shards) =
            (vec!["vgg11".into()], vec![ModeKind::PsBsp], vec![4], crate::scenario::Shards::counts(&[2]));
        let spec = s.expand().remove(0);
        let params =
            gradsync_core::model::Layout::new(&gradsync_core::model::ModelSpec::parse("vgg11").unwrap()).len;
        let sz = params as u64 * 4;
        let (server, worker) = process_memory(ModeKind::PsBsp, 4, 2, params);
        assert_eq!((server, worker), ((5 * sz).div_ceil(2), 3 * sz));
        // With one shard the processes add up to the run's estimate.
        let (one, _) = process_memory(ModeKind::PsBsp, 4, 1, params);
        assert_eq!(one + 4 * worker, run_memory(ModeKind::PsBsp, 4, params));
        let host = |name: &str, avail: u64, gpus: usize| HostFacts {
            name: name.into(),
            memory_available_bytes: avail,
            gpus: vec!["H100".into(); gpus],
            ..Default::default()
        };
        // Servers on n0 and n1, two workers each on n2 and n3; n3 has room for one.
        let (hosts, servers, workers) = (
            [
                host("n0", 64 << 30, 0),
                host("n1", 64 << 30, 0),
                host("n2", 64 << 30, 0),
                host("n3", 512 << 20, 0),
            ],
            [0, 1],
            [2, 3, 2, 3],
        );
        let refs: Vec<_> = hosts.iter().collect();
        let why = placement_short(&spec, &refs, &servers, &workers, "host").unwrap();
        assert!(
            why.starts_with("2 worker(s) placed on host n3 need about 0.6 GiB (113 MB of parameters each"),
            "{why}"
        );
        assert!(why.contains("it had 0.5 GiB available"), "{why}");
        let roomy: Vec<_> =
            hosts.iter().map(|h| HostFacts { memory_available_bytes: 64 << 30, ..h.clone() }).collect();
        assert_eq!(
            placement_short(&spec, &roomy.iter().collect::<Vec<_>>(), &servers, &workers, "host"),
            None
        );
        // Memory not read: not checked.
        let unknown: Vec<_> =
            hosts.iter().map(|h| HostFacts { memory_available_bytes: 0, ..h.clone() }).collect();
        assert_eq!(
            placement_short(&spec, &unknown.iter().collect::<Vec<_>>(), &servers, &workers, "host"),
            None
        );
        // NCCL: two ranks on a node with one GPU is refused naming the node; none on a node
        // without GPUs.
        (s.models, s.modes, s.workers) = (vec!["tiny".into()], vec![ModeKind::DdpNccl], vec![3]);
        let spec = s.expand().remove(0);
        let nodes = [host("gpu1", 64 << 30, 2), host("gpu2", 64 << 30, 1)];
        let refs: Vec<_> = nodes.iter().collect();
        let why = placement_short(&spec, &refs, &[], &[0, 1, 1], "node").unwrap();
        assert_eq!(why, "2 NCCL ranks placed on node gpu2 and it has 1 GPU(s)");
        assert_eq!(placement_short(&spec, &refs, &[], &[0, 0, 1], "node"), None);
        let cpu = [host("cpu1", 64 << 30, 0)];
        let why = placement_short(&spec, &cpu.iter().collect::<Vec<_>>(), &[], &[0], "node").unwrap();
        assert!(why.contains("on node cpu1 and it has 0 GPU(s)"), "{why}");
    }

    /// Eight DDP ranks of VGG-16 (553 MB of parameters) need 17.7 GB, whatever they compress;
    /// ResNet-50 under a fifth of that.
    #[test]
    fn run_memory_counts_every_process() {
        let vgg = 138_357_544;
        let s = vgg as u64 * 4;
        assert_eq!(run_memory(ModeKind::DdpTcp, 8, vgg), 32 * s);
        assert_eq!(run_memory(ModeKind::DdpTcpFp16, 8, vgg), 32 * s);
        assert_eq!(run_memory(ModeKind::Local, 1, vgg), 3 * s);
        assert_eq!(run_memory(ModeKind::PsBspTopk, 8, vgg), 29 * s);
        assert_eq!(run_memory(ModeKind::Dp, 8, vgg), 20 * s);
        assert!(run_memory(ModeKind::DdpTcp, 8, 25_557_032) < run_memory(ModeKind::DdpTcp, 8, vgg) / 5);
    }
}
