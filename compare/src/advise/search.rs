//! The advice: every configuration of the space predicted and ranked by step time, the pick
//! with the term that decides it, and the link rate and host count at which the pick would be
//! another configuration (found by predicting again: a scan outwards, then a bisection).
//!
//! The space: DDP's flat ring and, on hosts of several ranks, its hierarchical all-reduce, each
//! at every bucket size and compression; ZeRO-1 at every bucket size (it takes no
//! compression); a parameter server with `k` = hosts, hosts/2, ... 1 servers, colocated with
//! the workers or on hosts of their own, at every compression. Sparse tables (ps-sparse,
//! ddp-allgather, hybrid) are not searched: a profile holds dense tensors only, not a table's
//! rows nor how many of them a batch names.
//!
//! The pick is the fastest configuration that leaves training as f32 or half precision does:
//! top-k changes how many steps an accuracy takes, which a step's prediction cannot weigh, so
//! it is ranked and its effect stated, never picked. Ties (within [`TIE`]) go to the fewer
//! bytes per worker, then to the fewer extra hosts.

use gradsync_core::compress::Compression;
use serde::Serialize;

use super::codec::CodecRates;
use super::config::{Accuracy, Config, Exchange};
use super::error::AdviseError;
use super::predict::{Prediction, Workload, predict};
use super::spec::ClusterSpec;

/// Two steps closer than this share (relative) are a tie.
pub const TIE: f64 = 1e-3;
/// A pick ahead of its runner-up by less than this share is called level with it: the
/// predictor is to be validated to a median error of 5% (docs/advisor.md), so a smaller margin
/// is not one a reader can rely on.
pub const LEVEL: f64 = 0.05;
/// A link rate scan goes this far each way (a factor).
pub const RATE_SPAN: f64 = 1e4;
/// Each step of the rate scan multiplies the rate by this.
const RATE_STEP: f64 = std::f64::consts::SQRT_2;
/// A rate boundary is bisected to this relative width.
const RATE_PRECISION: f64 = 0.01;
/// A host scan goes up to this many times the cluster's hosts (and at most [`MAX_HOSTS`]).
pub const HOST_SPAN: usize = 16;
/// The most hosts a scan tries.
const MAX_HOSTS: usize = 4096;

/// What is searched besides the exchanges.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Space {
    /// DDP's and ZeRO-1's bucket sizes, MB.
    pub bucket_mb: Vec<f64>,
    /// The compressions (DDP's flat and hierarchical rings and the PS).
    #[serde(serialize_with = "texts")]
    pub compressions: Vec<Compression>,
}

fn texts<S: serde::Serializer>(c: &[Compression], s: S) -> Result<S::Ok, S::Error> {
    s.collect_seq(c.iter().map(|c| c.to_string()))
}

impl Space {
    /// Bucket sizes `bucket_mb`; none, fp16, bf16, and top-k at `topk_ratio` when given.
    pub fn new(bucket_mb: Vec<f64>, topk_ratio: Option<f64>) -> Result<Self, AdviseError> {
        if bucket_mb.is_empty() || bucket_mb.iter().any(|m| !(m.is_finite() && *m > 0.0)) {
            return Err(AdviseError::invalid("--bucket-mb", format!("{bucket_mb:?}: give positive sizes")));
        }
        let mut compressions = vec![Compression::None, Compression::Fp16, Compression::Bf16];
        if let Some(r) = topk_ratio {
            if !(r > 0.0 && r <= 1.0) {
                return Err(AdviseError::invalid(
                    "--topk-ratio",
                    format!("{r}: must be above 0 and at most 1"),
                ));
            }
            compressions.push(Compression::TopK(r));
        }
        Ok(Space { bucket_mb, compressions })
    }

    /// Every configuration gradsync can run on `c`.
    pub fn configs(&self, c: &ClusterSpec) -> Vec<Config> {
        let mut out = Vec::new();
        for exchange in [Exchange::Ring, Exchange::Hierarchical] {
            for &mb in &self.bucket_mb {
                for &compression in &self.compressions {
                    out.push(Config { exchange, bucket_mb: Some(mb), compression });
                }
            }
        }
        for &mb in &self.bucket_mb {
            out.push(Config {
                exchange: Exchange::Zero1,
                bucket_mb: Some(mb),
                compression: Compression::None,
            });
        }
        for servers in server_counts(c.hosts) {
            for colocated in [true, false] {
                for &compression in &self.compressions {
                    let exchange = Exchange::Ps { servers, colocated };
                    out.push(Config { exchange, bucket_mb: None, compression });
                }
            }
        }
        out.retain(|cfg| cfg.check(c).is_ok());
        out
    }
}

/// `hosts`, `hosts/2`, `hosts/4`, ... down to 1.
fn server_counts(hosts: usize) -> Vec<usize> {
    let mut out = vec![hosts.max(1)];
    while let Some(&k) = out.last().filter(|&&k| k > 1) {
        out.push(k / 2);
    }
    out
}

/// Every configuration of `space` on `c` predicted, fastest first (ties as this file's header
/// says).
pub fn rank(
    w: &Workload,
    c: &ClusterSpec,
    codecs: &CodecRates,
    space: &Space,
) -> Result<Vec<Prediction>, AdviseError> {
    let mut all =
        space.configs(c).iter().map(|cfg| predict(w, c, cfg, codecs)).collect::<Result<Vec<_>, _>>()?;
    all.sort_by(|a, b| a.step_s.total_cmp(&b.step_s));
    // Each run of steps within TIE of its fastest is a tie, ordered by the bytes per worker,
    // then the extra hosts, then the step (a "within TIE" comparison is not transitive, so
    // the runs are cut first and sorted each on its own).
    let mut start = 0;
    while start < all.len() {
        let bound = all[start].step_s * (1.0 + TIE);
        let end = start + all[start..].iter().take_while(|p| p.step_s <= bound).count();
        all[start..end].sort_by(|a, b| {
            a.bytes_per_worker
                .total_cmp(&b.bytes_per_worker)
                .then(a.extra_hosts.cmp(&b.extra_hosts))
                .then(a.step_s.total_cmp(&b.step_s))
        });
        start = end;
    }
    Ok(all)
}

/// The fastest configuration that may be picked (none top-k), in `ranked`.
pub fn pick(ranked: &[Prediction]) -> Option<usize> {
    ranked.iter().position(|p| p.config.accuracy() != Accuracy::Sparsified)
}

/// The pick, and why.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Verdict {
    /// Its place in the ranking (0: the fastest).
    pub pick: usize,
    /// The fastest pickable configuration of another family ([`Config::family`]), if any.
    pub runner_up: Option<usize>,
    /// The term that decides: `exposed communication`, `update` or `tie`.
    pub term: &'static str,
    /// One sentence saying so, with the predicted figures.
    pub sentence: String,
}

/// Milliseconds, for sentences.
fn ms(s: f64) -> String {
    format!("{:.3} ms", s * 1e3)
}

/// Why `ranked[pick]` wins: against the runner-up of another family, the term of the step
/// that differs most (forward and backward are the same in every configuration).
pub fn verdict(ranked: &[Prediction]) -> Option<Verdict> {
    let at = pick(ranked)?;
    let p = &ranked[at];
    let family = p.config.family();
    let runner_up = ranked
        .iter()
        .position(|q| q.config.accuracy() != Accuracy::Sparsified && q.config.family() != family);
    let Some(r) = runner_up.map(|i| &ranked[i]) else {
        let sentence = format!(
            "{} is predicted at {} a step, the only kind of configuration here.",
            p.label,
            ms(p.step_s)
        );
        return Some(Verdict { pick: at, runner_up, term: "tie", sentence });
    };
    let (d_exposed, d_update) = (r.exposed_s - p.exposed_s, r.update_s - p.update_s);
    let (term, sentence) = if (r.step_s - p.step_s).abs() <= TIE * p.step_s {
        let sentence = format!(
            "{} ties with {} at {} a step (predicted), and moves fewer bytes per worker or needs fewer hosts.",
            p.label,
            r.label,
            ms(p.step_s)
        );
        ("tie", sentence)
    } else if d_exposed.abs() >= d_update.abs() {
        let how = if p.exposed_s <= 0.0 {
            format!("none of its {} of exchange shows past backward", ms(p.comm_s))
        } else {
            format!("{} of its {} of exchange shows past backward", ms(p.exposed_s), ms(p.comm_s))
        };
        let sentence = format!(
            "{} is predicted fastest at {} a step; the deciding term is exposed communication: {how}, against {} for \
             {} ({} a step), while forward and backward take {} in every configuration.",
            p.label,
            ms(p.step_s),
            ms(r.exposed_s),
            r.label,
            ms(r.step_s),
            ms(p.forward_s + p.backward_s)
        );
        ("exposed communication", sentence)
    } else {
        let sentence = format!(
            "{} is predicted fastest at {} a step; the deciding term is the update: {} on each worker against {} for \
             {} ({} a step).",
            p.label,
            ms(p.step_s),
            ms(p.update_s),
            ms(r.update_s),
            r.label,
            ms(r.step_s)
        );
        ("update", sentence)
    };
    let margin = 1.0 - p.step_s / r.step_s;
    let sentence = if term != "tie" && margin < LEVEL {
        format!(
            "{} It is ahead by {:.1}%, less than the {:.0}% a prediction may be off: the two are as good as level.",
            sentence,
            margin * 100.0,
            LEVEL * 100.0
        )
    } else {
        sentence
    };
    Some(Verdict { pick: at, runner_up, term, sentence })
}

/// Where the pick becomes another family.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Change {
    /// The link rate (Gbit/s) or host count at which it does.
    pub at: f64,
    /// The family picked there.
    pub to: String,
}

/// The nearest link rates and host counts, each way, at which the pick would change (none
/// within the scanned span: [`RATE_SPAN`], [`HOST_SPAN`]).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Crossovers {
    /// The family picked on the cluster as given.
    pub family: String,
    /// The highest slower NIC rate at which another is picked, Gbit/s.
    pub rate_below: Option<Change>,
    /// The lowest faster NIC rate at which another is picked, Gbit/s.
    pub rate_above: Option<Change>,
    /// The most hosts, fewer than given, at which another is picked.
    pub hosts_below: Option<Change>,
    /// The fewest hosts, more than given, at which another is picked.
    pub hosts_above: Option<Change>,
}

/// The family picked on `c`.
fn picked_family(
    w: &Workload,
    c: &ClusterSpec,
    codecs: &CodecRates,
    space: &Space,
) -> Result<String, AdviseError> {
    let ranked = rank(w, c, codecs, space)?;
    Ok(pick(&ranked).map_or_else(|| "none".into(), |i| ranked[i].config.family()))
}

/// Scan the points `steps` gives (outwards from the cluster's, each the next further away)
/// until the family picked there is not `here`; then bisect between the last point where it
/// was and the first where it was not, with `mid` and `close` (done when the two are close).
fn boundary(
    here: &str,
    start: f64,
    steps: impl Iterator<Item = f64>,
    family: &dyn Fn(f64) -> Result<String, AdviseError>,
    mid: fn(f64, f64) -> f64,
    close: fn(f64, f64) -> bool,
) -> Result<Option<Change>, AdviseError> {
    let mut inside = start;
    for point in steps {
        let there = family(point)?;
        if there == here {
            inside = point;
            continue;
        }
        let (mut outside, mut to) = (point, there);
        while !close(inside, outside) {
            let m = mid(inside, outside);
            let f = family(m)?;
            if f == here {
                inside = m;
            } else {
                (outside, to) = (m, f);
            }
        }
        return Ok(Some(Change { at: outside, to }));
    }
    Ok(None)
}

/// The crossovers of the pick on `c`.
pub fn crossovers(
    w: &Workload,
    c: &ClusterSpec,
    codecs: &CodecRates,
    space: &Space,
) -> Result<Crossovers, AdviseError> {
    let here = picked_family(w, c, codecs, space)?;
    let gbit = c.nic.b * 8.0 / 1e9;
    let by_rate = |g: f64| picked_family(w, &c.with_nic_rate(g * 1e9 / 8.0), codecs, space);
    let geometric: fn(f64, f64) -> f64 = |a, b| (a * b).sqrt();
    let rate_close: fn(f64, f64) -> bool = |a, b| (a / b - 1.0).abs() <= RATE_PRECISION;
    let steps = (RATE_SPAN.ln() / RATE_STEP.ln()).ceil() as i32;
    let down = (1..=steps).map(|i| gbit / RATE_STEP.powi(i));
    let up = (1..=steps).map(|i| gbit * RATE_STEP.powi(i));
    let rate_below = boundary(&here, gbit, down, &by_rate, geometric, rate_close)?;
    let rate_above = boundary(&here, gbit, up, &by_rate, geometric, rate_close)?;
    let by_hosts = |h: f64| picked_family(w, &c.with_hosts(h as usize), codecs, space);
    let halfway: fn(f64, f64) -> f64 = |a, b| ((a + b) / 2.0).floor();
    let adjacent: fn(f64, f64) -> bool = |a, b| (a - b).abs() <= 1.0;
    // At least two workers.
    let fewest = if c.per_host > 1 { 1 } else { 2 };
    let most = (c.hosts * HOST_SPAN).min(MAX_HOSTS).max(c.hosts);
    let hosts_below =
        boundary(&here, c.hosts as f64, host_steps(c.hosts, fewest, false), &by_hosts, halfway, adjacent)?;
    let hosts_above =
        boundary(&here, c.hosts as f64, host_steps(c.hosts, most, true), &by_hosts, halfway, adjacent)?;
    Ok(Crossovers { family: here, rate_below, rate_above, hosts_below, hosts_above })
}

/// Host counts outwards from `from` to `bound`: one by one, then by a quarter more each time.
fn host_steps(from: usize, bound: usize, up: bool) -> impl Iterator<Item = f64> {
    std::iter::successors(Some(from), move |&h| {
        let next = if up { (h + 1).max(h + h / 4) } else { h.saturating_sub(1).min(h - h / 5) };
        let inside = if up { next <= bound } else { next >= bound && next < h };
        inside.then_some(next)
    })
    .skip(1)
    .map(|h| h as f64)
}

/// What the advisor says of `w` on `c`: the ranking, the verdict and the crossovers.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Advice {
    /// Every configuration, fastest first.
    pub ranked: Vec<Prediction>,
    /// The pick and why.
    pub verdict: Option<Verdict>,
    /// Where the pick would change.
    pub crossovers: Crossovers,
    /// The fastest top-k configuration when it beats the pick's step, with what that costs.
    pub topk_note: Option<String>,
}

/// The whole advice.
pub fn advise(
    w: &Workload,
    c: &ClusterSpec,
    codecs: &CodecRates,
    space: &Space,
) -> Result<Advice, AdviseError> {
    let ranked = rank(w, c, codecs, space)?;
    let verdict = verdict(&ranked);
    let crossovers = crossovers(w, c, codecs, space)?;
    let topk_note = verdict.as_ref().and_then(|v| {
        let t = ranked.first().filter(|t| t.config.accuracy() == Accuracy::Sparsified)?;
        let p = &ranked[v.pick];
        Some(format!(
            "{} is predicted {:.0}% faster a step ({} against {}), not picked: {}.",
            t.label,
            (1.0 - t.step_s / p.step_s) * 100.0,
            ms(t.step_s),
            ms(p.step_s),
            t.config.accuracy().note(t.config.compression)
        ))
    });
    Ok(Advice { ranked, verdict, crossovers, topk_note })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use gradsync_core::profile::{DeviceRate, builtin};

    use super::*;

    fn space() -> Space {
        Space::new(vec![1.0, 25.0], Some(0.01)).unwrap()
    }

    fn workload(name: &str) -> Workload {
        Workload::new(&builtin(name, DeviceRate::H100).unwrap(), 64).unwrap()
    }

    #[test]
    fn the_space_holds_what_the_cluster_can_run() {
        let s = space();
        let labels = |spec: &str| -> Vec<String> {
            s.configs(&ClusterSpec::parse(spec).unwrap()).iter().map(Config::label).collect()
        };
        let flat = labels("4x1:10gbit");
        // Flat ring 2 x 4, ZeRO-1 2, PS: k = 4, 2, 1, colocated and apart, 4 compressions each.
        assert_eq!(flat.len(), 8 + 2 + 3 * 2 * 4, "{flat:#?}");
        assert!(!flat.iter().any(|l| l.contains("ddp-hier")));
        assert!(flat.contains(&"ps-bsp, 2 servers colocated".to_string()));
        let hier = labels("4x8:10gbit:nvlink");
        // The hierarchy adds 2 x 3 (top-k all-gathers flat).
        assert_eq!(hier.len(), flat.len() + 6);
        assert!(hier.contains(&"ddp-hier-fp16, 25 MB buckets".to_string()));
        // One host: its one colocated server; no servers apart.
        let one = labels("1x8:1gbit:shm");
        assert!(one.iter().all(|l| !l.contains("own hosts")));
        assert!(one.contains(&"ps-bsp, 1 server colocated".to_string()));
        assert_eq!(server_counts(6), [6, 3, 1]);
        assert!(Space::new(vec![], None).is_err());
        assert!(Space::new(vec![1.0], Some(0.0)).unwrap_err().to_string().contains("--topk-ratio"));
    }

    #[test]
    fn a_slow_link_between_hosts_of_many_gpus_picks_the_hierarchy() {
        // VGG-16's 553 MB of gradients over 8 hosts of 8 GPUs at 10 Gbit/s: the leaders' ring
        // pays 2 (8-1) latencies a bucket where the flat ring pays 2 (64-1), and carries
        // 2 (8-1)/8 of the buffer across each NIC against 2 (64-1)/64.
        let w = workload("vgg16");
        let c = ClusterSpec::parse("8x8:10gbit:nvlink").unwrap();
        let a = advise(&w, &c, &CodecRates::free(), &space()).unwrap();
        let v = a.verdict.as_ref().unwrap();
        let p = &a.ranked[v.pick];
        assert!(matches!(p.config.exchange, Exchange::Hierarchical), "{}", p.label);
        assert_eq!(v.term, "exposed communication", "{}", v.sentence);
        assert!(v.sentence.contains(&p.label) && v.sentence.contains("exposed communication"));
        // Sorted by step, and top-k (faster here on the bytes) ranked but not picked.
        assert!(a.ranked.windows(2).all(|r| r[0].step_s <= r[1].step_s * (1.0 + TIE)));
        if a.ranked[0].config.accuracy() == Accuracy::Sparsified {
            assert!(a.topk_note.as_ref().unwrap().contains("not picked"));
        }
        // A faster NIC lets the flat ring (or fewer bytes) catch up somewhere above 10 Gbit/s,
        // or nowhere in the scan; below, the hierarchy stays or another takes over: either way
        // a change is at a rate on its own side.
        let x = &a.crossovers;
        assert_eq!(x.family, p.config.family());
        if let Some(ch) = &x.rate_above {
            assert!(ch.at > 10.0 && ch.to != x.family, "{ch:?}");
        }
        if let Some(ch) = &x.rate_below {
            assert!(ch.at < 10.0 && ch.to != x.family, "{ch:?}");
        }
    }

    #[test]
    fn the_crossover_is_where_predicting_again_changes_the_pick() {
        // 4 hosts of one rank: the ring and the PS apart trade places as the latency grows
        // against the bandwidth; whatever is found must hold on both sides of it.
        let w = workload("resnet50");
        let c = ClusterSpec::parse("4x1:1gbit,50us").unwrap();
        let s = space();
        let x = crossovers(&w, &c, &CodecRates::free(), &s).unwrap();
        let found = [&x.rate_below, &x.rate_above, &x.hosts_below, &x.hosts_above];
        assert!(found.iter().any(|c| c.is_some()), "{x:?}");
        let fam =
            |g: f64| picked_family(&w, &c.with_nic_rate(g * 1e9 / 8.0), &CodecRates::free(), &s).unwrap();
        assert_eq!(fam(1.0), x.family);
        for ch in [&x.rate_below, &x.rate_above].into_iter().flatten() {
            assert_eq!(fam(ch.at), ch.to, "{ch:?}");
            // Just inside (1% towards the given rate) the pick is still the given one's.
            let inside = if ch.at < 1.0 { ch.at * 1.011 } else { ch.at / 1.011 };
            assert_eq!(fam(inside), x.family, "{ch:?}");
        }
        for ch in [&x.hosts_below, &x.hosts_above].into_iter().flatten() {
            let h = ch.at as usize;
            let fh = picked_family(&w, &c.with_hosts(h), &CodecRates::free(), &s).unwrap();
            assert_eq!(fh, ch.to);
            let inside = if h < 4 { h + 1 } else { h - 1 };
            assert_eq!(picked_family(&w, &c.with_hosts(inside), &CodecRates::free(), &s).unwrap(), x.family);
        }
    }

    #[test]
    fn the_ranking_is_a_total_order_with_ties_to_the_fewer_bytes() {
        // VGG-16 on 16 hosts of 8: many configurations land within TIE of each other in
        // chains, where calling two steps within TIE equal is no total order (sorting by it
        // panicked).
        let w = workload("vgg16");
        let c = ClusterSpec::parse("16x8:25gbit,5us:pcie").unwrap();
        let r = rank(&w, &c, &CodecRates::free(), &space()).unwrap();
        assert_eq!(r.len(), space().configs(&c).len());
        for p in r.windows(2) {
            assert!(p[0].step_s <= p[1].step_s * (1.0 + TIE));
            let tie = p[1].step_s <= p[0].step_s * (1.0 + TIE);
            if tie && p[0].bytes_per_worker == p[1].bytes_per_worker && p[0].extra_hosts == p[1].extra_hosts {
                assert!(p[0].step_s <= p[1].step_s, "{} before {}", p[0].label, p[1].label);
            }
        }
        // Within a tie, fewer bytes first: the top-k ring's pairs before the dense ring's.
        let c = ClusterSpec::parse("2x1:1000gbit,1ns").unwrap();
        // (A slow device with fast memory: every exchange hides, and no update is worth
        // sharding.)
        let slow = builtin("resnet50", DeviceRate { tflops: 1.0, tbps: 1e5 }).unwrap();
        let r = rank(&Workload::new(&slow, 64).unwrap(), &c, &CodecRates::free(), &space()).unwrap();
        assert!(r[1].step_s <= r[0].step_s * (1.0 + TIE));
        assert_eq!(r[0].config.accuracy(), Accuracy::Sparsified, "{}", r[0].label);
        assert!(r[0].bytes_per_worker < r[1].bytes_per_worker);
    }

    #[test]
    fn a_clear_cut_case_picks_the_obvious_configuration() {
        // VGG-16's 553 MB over 8 hosts of one GPU at 1 Gbit/s, f32 only: the exchange is
        // seconds against a backward of milliseconds, and a worker moves S each way to 8
        // servers of their own where the ring moves 2 (8-1)/8 S and colocated servers carry 2
        // (8-1)/8 S through each NIC: BytePS's case.
        let w = workload("vgg16");
        let c = ClusterSpec::parse("8x1:1gbit").unwrap();
        let f32_only = Space { bucket_mb: vec![25.0], compressions: vec![Compression::None] };
        let a = advise(&w, &c, &CodecRates::free(), &f32_only).unwrap();
        let v = a.verdict.unwrap();
        assert_eq!(a.ranked[v.pick].label, "ps-bsp, 8 servers on their own hosts");
        assert_eq!(v.term, "exposed communication", "{}", v.sentence);
        // The incast: one server's NIC carries all 8 pushes.
        let one = a.ranked.iter().find(|q| q.label == "ps-bsp, 1 server on its own host").unwrap();
        assert!(one.exposed_s > 8.0 * w.bytes() / c.nic.b);
        assert!(one.step_s > 7.0 * a.ranked[v.pick].step_s);
        // A device 40 times slower: backward outlasts every exchange but the last bucket's,
        // and the pick hides nearly all of it.
        let slow = builtin("resnet50", DeviceRate { tflops: 10.0, tbps: 0.1 }).unwrap();
        let w = Workload::new(&slow, 64).unwrap();
        let c = ClusterSpec::parse("4x1:100gbit,5us").unwrap();
        let a = advise(&w, &c, &CodecRates::free(), &space()).unwrap();
        let p = &a.ranked[a.verdict.unwrap().pick];
        assert!(p.exposed_s < 0.02 * p.step_s, "{}: {} of {}", p.label, p.exposed_s, p.step_s);
    }
}
