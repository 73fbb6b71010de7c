//! `gradsync-bench validate DIR...`: the advisor's predictions against dilated emulated
//! clusters' runs (`scripts/advisor-matrix.sh` makes them, one directory a (model, hosts,
//! link) group; a directory `<group>+<part>` holds more designs of `<group>`, run apart). For each sound run (complete, the cores keeping up with the factor): its
//! measured step, the advisor's step ([`advisor_step_ms`]: the run's own compute and link, the
//! per-bucket timeline) and the alpha-beta model's (the run's compute, then the exchange the
//! cost model prices, nothing hidden behind backward), each error beside it. Then the error
//! over every run and by design; and in each group the advisor's pick among the designs run
//! (each predicted from the profile alone and the link as measured: what `advise` would have
//! said before the run) against the fastest measured, within [`PICK_TOLERANCE`] or a miss
//! named with both predictions.

use std::path::{Path, PathBuf};

use anyhow::Context;
use serde::{Deserialize, Serialize};

use crate::emulated::{self, ClusterRun};
use crate::report::cluster::{advisor_prediction_ms, cluster_prediction};
use crate::results::{self, Summary};
use gradsync_worker::cli::flag::DEFAULT_BUCKET_MB;

/// How far above the fastest measured design the advisor's pick may measure and count as
/// found.
pub const PICK_TOLERANCE: f64 = 0.05;

/// One run, measured and predicted.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Row {
    /// Its group: the directory's name, up to a `+` (`resnet50-8x1-10g+colocated` is more of
    /// `resnet50-8x1-10g`).
    pub group: String,
    /// The design: mode, and servers for a parameter server.
    pub design: String,
    /// Its model.
    pub model: String,
    /// Worker hosts, ranks a host.
    pub hosts: usize,
    /// Ranks a host.
    pub ranks_per_host: usize,
    /// Link rate, Gbit/s.
    pub rate_gbit: f64,
    /// The factor it ran at.
    pub dilation: f64,
    /// Its cores' busy share.
    pub cpu_busy: Option<f64>,
    /// Complete, the cores keeping up.
    pub sound: bool,
    /// Why not, where it is not.
    pub unsound: Option<String>,
    /// Measured step, ms.
    pub measured_ms: Option<f64>,
    /// The advisor's step from the run's compute and link, ms.
    pub advisor_ms: Option<f64>,
    /// The advisor's step from the profile's compute and the run's link, ms (the pick's).
    pub advisor_profile_ms: Option<f64>,
    /// The alpha-beta model's step, ms.
    pub alpha_beta_ms: Option<f64>,
}

impl Row {
    /// (advisor - measured) / measured.
    pub fn advisor_error(&self) -> Option<f64> {
        rel(self.advisor_ms?, self.measured_ms?)
    }

    /// (alpha-beta - measured) / measured.
    pub fn alpha_beta_error(&self) -> Option<f64> {
        rel(self.alpha_beta_ms?, self.measured_ms?)
    }
}

fn rel(p: f64, m: f64) -> Option<f64> {
    (m > 0.0).then(|| (p - m) / m)
}

/// The median and largest |error| of a set.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq)]
pub struct Spread {
    /// Runs.
    pub n: usize,
    /// Median |error|.
    pub median: f64,
    /// Largest |error|.
    pub max: f64,
}

impl Spread {
    fn of(errors: impl Iterator<Item = f64>) -> Option<Spread> {
        let e: Vec<f64> = errors.map(f64::abs).collect();
        Some(Spread { n: e.len(), median: results::median(&e)?, max: e.iter().copied().reduce(f64::max)? })
    }
}

/// One group's pick against its fastest measured design.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Pick {
    /// The group.
    pub group: String,
    /// The advisor's pick among the designs measured soundly.
    pub pick: String,
    /// The fastest measured.
    pub best: String,
    /// measured(pick) / measured(best) - 1.
    pub gap: f64,
    /// Within [`PICK_TOLERANCE`].
    pub found: bool,
    /// For a miss: both designs' predictions and measurements.
    pub why: Option<String>,
    /// Designs in the group measured soundly.
    pub designs: usize,
    /// Picked by the predictions from each run's own compute, since a row kept without its
    /// runs held no prediction from the profile alone.
    #[serde(default)]
    pub by_runs_compute: bool,
}

/// Everything `validate` found.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Validation {
    /// The CPU the runs ran on, from their machine.json.
    pub cpu: String,
    /// Every run.
    pub rows: Vec<Row>,
    /// The advisor's error over the sound runs.
    pub advisor: Option<Spread>,
    /// The alpha-beta model's over the same runs.
    pub alpha_beta: Option<Spread>,
    /// By design family: (family, advisor's, alpha-beta's).
    pub by_family: Vec<(String, Option<Spread>, Option<Spread>)>,
    /// Each group's pick.
    pub picks: Vec<Pick>,
    /// Groups with fewer than two sound designs, and why no pick is judged there.
    pub unjudged: Vec<(String, String)>,
    /// In each group that ran servers colocated: the pick among the designs on the worker
    /// hosts alone (rings, ZeRO-1, colocated servers; no host added for servers), the
    /// question of a cluster whose hosts are all it has.
    #[serde(default)]
    pub picks_on_workers: Vec<Pick>,
    /// Such groups whose pick on the worker hosts is not judged, and why.
    #[serde(default)]
    pub unjudged_on_workers: Vec<(String, String)>,
}

/// Whether a design (as [`design`] names it) adds hosts for its servers.
fn adds_hosts(design: &str) -> bool {
    design.starts_with("ps-") && !design.ends_with(" colocated")
}

/// The group directories under `dirs`: each one holding `cluster.json`, or each child of one
/// that does not.
pub fn groups(dirs: &[PathBuf]) -> anyhow::Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    for d in dirs {
        anyhow::ensure!(d.is_dir(), "{} is not a directory", d.display());
        if d.join(emulated::CLUSTER_FILE).exists() {
            out.push(d.clone());
            continue;
        }
        let mut kids: Vec<PathBuf> = std::fs::read_dir(d)
            .with_context(|| format!("reading {}", d.display()))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.join(emulated::CLUSTER_FILE).exists())
            .collect();
        kids.sort();
        anyhow::ensure!(
            !kids.is_empty(),
            "{} holds no emulated cluster's runs ({} in it or in a directory under it)",
            d.display(),
            emulated::CLUSTER_FILE
        );
        out.extend(kids);
    }
    Ok(out)
}

/// Validate the runs in the groups `dirs` names ([`groups`]).
pub fn validate(dirs: &[PathBuf]) -> anyhow::Result<Validation> {
    let mut rows = Vec::new();
    let mut cpu = String::new();
    for g in groups(dirs)? {
        rows.extend(group_rows(&g)?);
        if cpu.is_empty() {
            cpu = machine_cpu(&g).unwrap_or_default();
        }
    }
    Ok(summarise(cpu, rows))
}

fn machine_cpu(dir: &Path) -> Option<String> {
    let t = std::fs::read_to_string(dir.join("machine.json")).ok()?;
    let v: serde_json::Value = serde_json::from_str(&t).ok()?;
    Some(format!("{}, {} cores", v.get("cpu")?.as_str()?, v.get("cores")?.as_u64()?))
}

/// One group directory's runs.
fn group_rows(dir: &Path) -> anyhow::Result<Vec<Row>> {
    let name = dir.file_name().map(|n| n.to_string_lossy().to_string()).unwrap_or_default();
    let name = name.split('+').next().unwrap_or_default().to_string();
    let c = results::collect(&[dir.to_path_buf()], None)?;
    let runs = emulated::load(&[dir.to_path_buf()]);
    Ok(runs.iter().filter_map(|r| Some(row(&name, r, c.summaries.iter().find(|s| s.id == r.id)?))).collect())
}

/// The design a run stands for in its group: with its bucket size where a ring's or ZeRO-1's
/// run had other buckets than the worker's default, so that a group's parts at other bucket
/// sizes are designs of their own beside it.
fn design(r: &ClusterRun, s: &Summary) -> String {
    let name =
        crate::scenario::design_name(r.mode.label(), if r.mode.is_ps() { r.shards } else { 0 }, r.colocated);
    with_buckets(name, (!r.mode.is_ps()).then_some(s.bucket_mb).flatten())
}

/// `name` with `, N MB buckets` where `bucket_mb` is not the worker's default.
fn with_buckets(name: String, bucket_mb: Option<f64>) -> String {
    match bucket_mb {
        Some(mb) if (mb - DEFAULT_BUCKET_MB).abs() > 1e-6 => format!("{name}, {mb} MB buckets"),
        _ => name,
    }
}

fn row(group: &str, r: &ClusterRun, s: &Summary) -> Row {
    let compute = s.forward_ms.zip(s.backward_ms).map(|(f, b)| f + b + s.update_ms.unwrap_or(0.0));
    let exchange = cluster_prediction(r, s.params).map(|t| t * 1e3);
    Row {
        group: group.to_string(),
        design: design(r, s),
        model: s.model.clone(),
        hosts: r.workers.div_ceil(r.ranks_per_host.max(1)),
        ranks_per_host: r.ranks_per_host,
        rate_gbit: r.rate_gbit,
        dilation: r.dilation,
        cpu_busy: s.cpu_busy,
        sound: s.complete() && !s.dilated_saturated(),
        unsound: why_unsound(s),
        measured_ms: s.step_ms,
        advisor_ms: advisor_prediction_ms(r, s, true),
        advisor_profile_ms: advisor_prediction_ms(r, s, false),
        alpha_beta_ms: compute.zip(exchange).map(|(c, x)| c + x),
    }
}

/// Whether a design (as [`design`] names it) belongs to a family.
type InFamily = fn(&str) -> bool;

/// Why a run's figures are set aside, if they are: not complete, its cores busier than
/// [`results::REPLAY_BUSY`], its group's self-check at twice the factor differing, or its
/// compute overrunning the factor.
fn why_unsound(s: &Summary) -> Option<String> {
    if !s.complete() {
        return Some(format!("{}: {}", s.status, s.error));
    }
    if let Some(b) = s.cpu_busy.filter(|b| *b > results::REPLAY_BUSY) {
        return Some(format!("its cores {:.0}% busy", b * 100.0));
    }
    if s.dilation_too_small {
        return Some("its group's self-check at twice the factor differed by over 5%".into());
    }
    s.dilated_saturated().then(|| "its compute overran the factor".into())
}

/// The design families errors are given by.
const FAMILIES: [(&str, InFamily); 3] = [
    ("ring, ddp-hier", |d| d.starts_with("ddp-tcp") || d.starts_with("ddp-hier")),
    ("ZeRO-1", |d| d.starts_with("zero1-tcp")),
    ("parameter server", |d| d.starts_with("ps-")),
];

/// `fresh` over `saved` (a validation kept from earlier runs, `--with`): every (group, design)
/// `fresh` holds from its runs, `saved`'s rows for the others, and `saved`'s picks and
/// verdicts for the groups `fresh` has no row of (a group with a fresh row is judged again over
/// all its rows); the errors over them all. So the matrix can be run in parts, on other days,
/// and only the parts that changed, or the designs added, run again.
pub fn merged(fresh: Validation, saved: Validation) -> Validation {
    use std::collections::BTreeSet;
    let ran: BTreeSet<(String, String)> =
        fresh.rows.iter().map(|r| (r.group.clone(), r.design.clone())).collect();
    let judged: BTreeSet<String> = fresh.rows.iter().map(|r| r.group.clone()).collect();
    let kept = |g: &str| !judged.contains(g);
    let mut rows: Vec<Row> =
        saved.rows.into_iter().filter(|r| !ran.contains(&(r.group.clone(), r.design.clone()))).collect();
    rows.extend(fresh.rows);
    // Stable: each group's rows keep their order.
    rows.sort_by(|a, b| a.group.cmp(&b.group));
    let cpu = match (fresh.cpu.as_str(), saved.cpu.as_str()) {
        (f, s) if f == s || s.is_empty() => f.to_string(),
        ("", s) => s.to_string(),
        (f, s) => format!("{f} (the groups run again); {s} (the rest)"),
    };
    let mut v = summarise(cpu, rows);
    keep_saved(&mut v.picks, saved.picks, |p| &p.group, &kept);
    keep_saved(&mut v.picks_on_workers, saved.picks_on_workers, |p| &p.group, &kept);
    keep_saved(&mut v.unjudged, saved.unjudged, |u| &u.0, &kept);
    keep_saved(&mut v.unjudged_on_workers, saved.unjudged_on_workers, |u| &u.0, &kept);
    v
}

/// `fresh` with its verdicts for the `kept` groups replaced by `saved`'s, in group order.
fn keep_saved<T>(fresh: &mut Vec<T>, saved: Vec<T>, group: fn(&T) -> &String, kept: &dyn Fn(&str) -> bool) {
    fresh.retain(|x| !kept(group(x)));
    fresh.extend(saved.into_iter().filter(|x| kept(group(x))));
    fresh.sort_by(|a, b| group(a).cmp(group(b)));
}

/// A validation saved by `validate --json`: the whole output (its `clusters`) or one
/// [`Validation`] alone.
pub fn load_saved(path: &Path) -> anyhow::Result<Validation> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let mut v: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("{}: not JSON", path.display()))?;
    if let Some(c) = v.get_mut("clusters") {
        v = c.take();
    }
    anyhow::ensure!(!v.is_null(), "{}: its `clusters` is null (a validation of no clusters)", path.display());
    serde_json::from_value(v).with_context(|| {
        format!("{}: not a validation saved by `gradsync-bench validate --json`", path.display())
    })
}

/// The errors, by family, and each group's pick.
pub fn summarise(cpu: String, rows: Vec<Row>) -> Validation {
    let sound = || rows.iter().filter(|r| r.sound && r.advisor_ms.is_some() && r.alpha_beta_ms.is_some());
    let by_family = FAMILIES
        .iter()
        .map(|(name, is)| {
            let of = || sound().filter(|r| is(&r.design));
            (
                name.to_string(),
                Spread::of(of().filter_map(Row::advisor_error)),
                Spread::of(of().filter_map(Row::alpha_beta_error)),
            )
        })
        .collect();
    // Each group once, in the order first met (its rows need not be together).
    let mut seen = std::collections::BTreeSet::new();
    let names: Vec<&str> = rows.iter().map(|r| r.group.as_str()).filter(|g| seen.insert(*g)).collect();
    let (mut picks, mut unjudged) = (Vec::new(), Vec::new());
    let (mut picks_on_workers, mut unjudged_on_workers) = (Vec::new(), Vec::new());
    for g in names {
        match pick(&rows, g, |_| true) {
            Ok(p) => picks.push(p),
            Err(why) => unjudged.push((g.to_string(), why)),
        }
        if rows.iter().any(|r| r.group == g && r.design.ends_with(" colocated")) {
            match pick(&rows, g, |r| !adds_hosts(&r.design)) {
                Ok(p) => picks_on_workers.push(p),
                Err(why) => unjudged_on_workers.push((g.to_string(), why)),
            }
        }
    }
    Validation {
        cpu,
        advisor: Spread::of(sound().filter_map(Row::advisor_error)),
        alpha_beta: Spread::of(sound().filter_map(Row::alpha_beta_error)),
        by_family,
        rows,
        picks,
        unjudged,
        picks_on_workers,
        unjudged_on_workers,
    }
}

/// Group `g`'s pick among the designs `among` keeps: the design the advisor predicts fastest
/// from the profile among those run, against the fastest measured soundly; not judged where
/// the pick itself was not measured soundly (the best of the rest would be no test of it).
fn pick(rows: &[Row], g: &str, among: fn(&Row) -> bool) -> Result<Pick, String> {
    let ran: Vec<&Row> = rows.iter().filter(|r| r.group == g && among(r)).collect();
    // A row kept without its runs (rebuilt from a table) may lack the profile's prediction:
    // then every design of the group is picked by its prediction from its run's own compute
    // (a replay's compute is the profile's, waited out), and the pick says so.
    let by_runs_compute =
        ran.iter().any(|r| r.sound && r.advisor_ms.is_some() && r.advisor_profile_ms.is_none());
    let by: fn(&Row) -> Option<f64> =
        if by_runs_compute { |r| r.advisor_ms } else { |r| r.advisor_profile_ms };
    let predicted = fastest(ran.iter().copied(), by);
    if let Some(p) = predicted.filter(|p| !p.sound) {
        let why = p.unsound.as_deref().map_or(String::new(), |w| format!(": {w}"));
        return Err(format!("the pick, {}, was not measured soundly{why}", p.design));
    }
    let sound: Vec<&Row> =
        ran.iter().copied().filter(|r| r.sound && r.measured_ms.is_some() && by(r).is_some()).collect();
    if sound.len() < 2 {
        let left: Vec<String> = ran.iter().filter(|r| !r.sound).map(|r| r.design.clone()).collect();
        return Err(format!(
            "{} of {} designs measured soundly{}",
            sound.len(),
            ran.len(),
            if left.is_empty() { String::new() } else { format!(" (not sound: {})", left.join(", ")) }
        ));
    }
    let (Some(p), Some(b)) = (predicted, fastest(sound.iter().copied(), |r| r.measured_ms)) else {
        return Err("nothing to rank".into());
    };
    let (pm, bm) = (p.measured_ms.unwrap_or(f64::NAN), b.measured_ms.unwrap_or(f64::NAN));
    let gap = pm / bm - 1.0;
    let found = gap <= PICK_TOLERANCE;
    let ms = |v: Option<f64>| v.map_or("-".into(), |v| format!("{v:.1}"));
    let why = (!found).then(|| {
        format!(
            "picked {} (predicted {} ms, measured {} ms) over {} (predicted {} ms, measured {} ms)",
            p.design,
            ms(by(p)),
            ms(p.measured_ms),
            b.design,
            ms(by(b)),
            ms(b.measured_ms)
        )
    });
    Ok(Pick {
        group: g.to_string(),
        pick: p.design.clone(),
        best: b.design.clone(),
        gap,
        found,
        why,
        designs: sound.len(),
        by_runs_compute,
    })
}

/// The row of least `f` among those that have one.
fn fastest<'a>(rows: impl Iterator<Item = &'a Row>, f: fn(&Row) -> Option<f64>) -> Option<&'a Row> {
    rows.filter_map(|r| Some((f(r)?, r))).min_by(|a, b| a.0.total_cmp(&b.0)).map(|(_, r)| r)
}

fn pct(v: Option<f64>) -> String {
    v.map_or("-".into(), |v| format!("{:+.1}%", v * 100.0))
}

fn spread_text(s: &Option<Spread>) -> String {
    s.map_or("-".into(), |s| format!("{:.1}% / {:.1}% (n = {})", s.median * 100.0, s.max * 100.0, s.n))
}

/// The picks' sentence and table: `among` says which designs they were picked from.
fn picks_markdown(among: &str, picks: &[Pick], unjudged: &[(String, String)]) -> String {
    let found = picks.iter().filter(|p| p.found).count();
    let mut t = format!(
        "\nThe advisor's pick{among} within {:.0}% of the fastest measured design in {found} of {} groups{}.\n\n",
        PICK_TOLERANCE * 100.0,
        picks.len(),
        if picks.is_empty() {
            String::new()
        } else {
            format!(" ({:.0}%)", 100.0 * found as f64 / picks.len() as f64)
        }
    );
    t += "| group | designs | pick | fastest measured | pick's gap | |\n|---|---:|---|---|---:|---|\n";
    for p in picks {
        t += &format!(
            "| {} | {} | {} | {} | {} | {} |\n",
            p.group,
            p.designs,
            p.pick,
            p.best,
            pct(Some(p.gap)),
            p.why.as_deref().unwrap_or("found").to_string()
                + if p.by_runs_compute {
                    " (picked by the runs' own compute: kept rows hold no profile-only prediction)"
                } else {
                    ""
                }
        );
    }
    for (g, why) in unjudged {
        t += &format!("| {g} | | | | | not judged: {why} |\n");
    }
    t
}

/// The validation as Markdown: the summary first, then the picks, then every run.
pub fn markdown(v: &Validation) -> String {
    let mut t = format!("CPU: {}\n\n", if v.cpu.is_empty() { "unknown" } else { &v.cpu });
    t += "| runs | advisor: median / largest \\|error\\| | alpha-beta: median / largest |\n|---|---|---|\n";
    t += &format!("| all sound runs | {} | {} |\n", spread_text(&v.advisor), spread_text(&v.alpha_beta));
    for (name, a, b) in &v.by_family {
        t += &format!("| {name} | {} | {} |\n", spread_text(a), spread_text(b));
    }
    t += &picks_markdown("", &v.picks, &v.unjudged);
    if !v.picks_on_workers.is_empty() || !v.unjudged_on_workers.is_empty() {
        t += &picks_markdown(
            " among the designs on the worker hosts alone (rings, ZeRO-1, servers colocated)",
            &v.picks_on_workers,
            &v.unjudged_on_workers,
        );
    }
    t += "\n| group | design | factor | cores busy | sound | measured ms | advisor ms | error | alpha-beta ms | error |\n\
          |---|---|---:|---:|---|---:|---:|---:|---:|---:|\n";
    let ms = |v: Option<f64>| v.map_or("-".into(), |v| format!("{v:.1}"));
    for r in &v.rows {
        t += &format!(
            "| {} | {} | x{} | {} | {} | {} | {} | {} | {} | {} |\n",
            r.group,
            r.design,
            r.dilation,
            r.cpu_busy.map_or("-".into(), |b| format!("{:.0}%", b * 100.0)),
            if r.sound { "yes" } else { "no" },
            ms(r.measured_ms),
            ms(r.advisor_ms),
            pct(r.advisor_error()),
            ms(r.alpha_beta_ms),
            pct(r.alpha_beta_error())
        );
    }
    t
}

#[cfg(test)]
mod tests {
    use super::*;

    fn r(group: &str, design: &str, measured: f64, predicted: f64, ab: f64, sound: bool) -> Row {
        Row {
            group: group.into(),
            design: design.into(),
            model: "resnet50 (replay)".into(),
            hosts: 4,
            ranks_per_host: 1,
            rate_gbit: 10.0,
            dilation: 12.0,
            cpu_busy: Some(0.3),
            sound,
            unsound: (!sound).then(|| "its cores 90% busy".into()),
            measured_ms: Some(measured),
            advisor_ms: Some(predicted),
            advisor_profile_ms: Some(predicted),
            alpha_beta_ms: Some(ab),
        }
    }

    #[test]
    fn a_run_at_other_buckets_than_the_default_is_a_design_of_its_own() {
        assert_eq!(with_buckets("ddp-tcp".into(), Some(DEFAULT_BUCKET_MB)), "ddp-tcp");
        assert_eq!(with_buckets("ddp-tcp".into(), None), "ddp-tcp");
        assert_eq!(with_buckets("zero1-tcp".into(), Some(1.0)), "zero1-tcp, 1 MB buckets");
        assert_eq!(with_buckets("ddp-tcp".into(), Some(100.0)), "ddp-tcp, 100 MB buckets");
        // The families keep them.
        let ring = FAMILIES[0].1;
        let zero = FAMILIES[1].1;
        assert!(ring("ddp-tcp, 1 MB buckets") && ring("ddp-hier") && !ring("zero1-tcp"));
        assert!(zero("zero1-tcp, 100 MB buckets") && !zero("ps-bsp k=4"));
    }

    #[test]
    fn errors_are_over_sound_runs_and_by_family() {
        let rows = vec![
            r("g", "ddp-tcp", 100.0, 102.0, 110.0, true),
            r("g", "zero1-tcp", 100.0, 96.0, 120.0, true),
            r("g", "ps-bsp k=4", 50.0, 45.0, 60.0, true),
            // Not sound: left out of every figure however far off.
            r("g", "ps-bsp k=2", 80.0, 8.0, 8.0, false),
        ];
        let v = summarise(String::new(), rows);
        let a = v.advisor.unwrap();
        assert_eq!(a.n, 3);
        assert!((a.median - 0.04).abs() < 1e-9 && (a.max - 0.10).abs() < 1e-9, "{a:?}");
        let b = v.alpha_beta.unwrap();
        assert!((b.median - 0.20).abs() < 1e-9 && (b.max - 0.20).abs() < 1e-9, "{b:?}");
        let ps = &v.by_family.iter().find(|f| f.0 == "parameter server").unwrap().1;
        assert_eq!(ps.unwrap().n, 1);
    }

    #[test]
    fn a_pick_is_found_within_five_percent_and_a_miss_says_both_predictions() {
        let rows = vec![
            // The advisor predicts the ring fastest; the PS measures 3% faster: found.
            r("a", "ddp-tcp", 103.0, 90.0, 0.0, true),
            r("a", "ps-bsp k=4", 100.0, 95.0, 0.0, true),
            // Here it measures 20% faster: a miss, named.
            r("b", "ddp-tcp", 120.0, 90.0, 0.0, true),
            r("b", "ps-bsp k=4", 100.0, 95.0, 0.0, true),
            // One sound design: not judged.
            r("c", "ddp-tcp", 120.0, 90.0, 0.0, true),
            r("c", "ps-bsp k=4", 100.0, 95.0, 0.0, false),
            // The pick itself not sound: not judged, though two others are.
            r("d", "ps-bsp k=4", 50.0, 40.0, 0.0, false),
            r("d", "ddp-tcp", 120.0, 90.0, 0.0, true),
            r("d", "zero1-tcp", 119.0, 95.0, 0.0, true),
        ];
        let v = summarise(String::new(), rows);
        assert_eq!(v.picks.len(), 2);
        assert!(v.picks[0].found && (v.picks[0].gap - 0.03).abs() < 1e-9);
        let miss = &v.picks[1];
        assert!(!miss.found && miss.pick == "ddp-tcp" && miss.best == "ps-bsp k=4");
        let why = miss.why.as_deref().unwrap();
        assert!(
            why.contains("predicted 90.0 ms, measured 120.0 ms") && why.contains("predicted 95.0"),
            "{why}"
        );
        assert_eq!(v.unjudged.len(), 2, "{:?}", v.unjudged);
        assert!(
            v.unjudged[1].1 == "the pick, ps-bsp k=4, was not measured soundly: its cores 90% busy",
            "{:?}",
            v.unjudged
        );
        assert!(
            v.unjudged[0].1.contains("1 of 2") && v.unjudged[0].1.contains("ps-bsp k=4"),
            "{:?}",
            v.unjudged
        );
        let md = markdown(&v);
        assert!(md.contains("in 1 of 2 groups (50%)"), "{md}");
        // A group's rows apart from one another: still one verdict for it.
        let rows = vec![
            r("a", "ddp-tcp", 103.0, 90.0, 0.0, true),
            r("b", "ddp-tcp", 120.0, 90.0, 0.0, true),
            r("a", "ps-bsp k=4", 100.0, 95.0, 0.0, true),
            r("b", "ps-bsp k=4", 100.0, 95.0, 0.0, false),
        ];
        let v = summarise(String::new(), rows);
        assert_eq!((v.picks.len(), v.unjudged.len()), (1, 1), "{:?} {:?}", v.picks, v.unjudged);
    }

    #[test]
    fn a_saved_validation_keeps_the_groups_not_run_again_and_the_errors_are_over_both() {
        let saved = summarise(
            "AMD EPYC, 2 cores".into(),
            vec![
                r("a", "ddp-tcp", 100.0, 102.0, 110.0, true),
                r("a", "ps-bsp k=4", 50.0, 40.0, 60.0, true),
                r("b", "ddp-tcp", 100.0, 90.0, 110.0, true),
                r("b", "ps-bsp k=4", 50.0, 45.0, 60.0, true),
            ],
        );
        // Saved and read back as `--json` writes it.
        let d = gradsync_testkit::Scratch::new("validate-saved");
        let path = d.join("saved.json");
        let json = serde_json::json!({ "clusters": saved, "loopback": null });
        std::fs::write(&path, json.to_string()).unwrap();
        let saved = load_saved(&path).unwrap();
        // Group b run again: its new rows replace the old; a stays, pick and all.
        let fresh = summarise(
            "AMD EPYC, 2 cores".into(),
            vec![r("b", "ddp-tcp", 100.0, 101.0, 110.0, true), r("b", "ps-bsp k=4", 50.0, 49.0, 60.0, true)],
        );
        let v = merged(fresh, saved);
        let groups: Vec<(&str, f64)> =
            v.rows.iter().map(|r| (r.group.as_str(), r.advisor_ms.unwrap())).collect();
        assert_eq!(groups, vec![("a", 102.0), ("a", 40.0), ("b", 101.0), ("b", 49.0)]);
        let a = v.advisor.unwrap();
        assert_eq!(a.n, 4);
        assert!((a.max - 0.20).abs() < 1e-9, "a's PS, 20% off, is still in: {a:?}");
        assert_eq!(v.picks.iter().map(|p| p.group.as_str()).collect::<Vec<_>>(), vec!["a", "b"]);
        assert_eq!(v.cpu, "AMD EPYC, 2 cores");
        // A design added to group a apart (`a+colocated`): a keeps its saved rows beside it, and
        // its pick is judged again over all three.
        let added = summarise(
            "AMD EPYC, 2 cores".into(),
            vec![r("a", "ps-bsp k=4 colocated", 45.0, 30.0, 60.0, true)],
        );
        let v = merged(added, v);
        let a: Vec<&str> = v.rows.iter().filter(|r| r.group == "a").map(|r| r.design.as_str()).collect();
        assert_eq!(a, ["ddp-tcp", "ps-bsp k=4", "ps-bsp k=4 colocated"]);
        let pick = v.picks.iter().find(|p| p.group == "a").unwrap();
        assert_eq!(
            (pick.pick.as_str(), pick.best.as_str(), pick.designs),
            ("ps-bsp k=4 colocated", "ps-bsp k=4 colocated", 3)
        );
        // On the worker hosts alone: the ring and the colocated servers, in a only.
        let on: Vec<(&str, &str, usize)> =
            v.picks_on_workers.iter().map(|p| (p.group.as_str(), p.pick.as_str(), p.designs)).collect();
        assert_eq!(on, [("a", "ps-bsp k=4 colocated", 2)]);
        assert!(markdown(&v).contains("among the designs on the worker hosts alone (rings, ZeRO-1, servers colocated) within 5% of the fastest measured design in 1 of 1 groups"));
        assert_eq!(v.rows.iter().filter(|r| r.group == "b").count(), 2);
        // A group judged again where a kept row has no profile prediction: every design picked
        // by its run's own compute (the ring's 90 ms over ZeRO-1's 95, though ZeRO-1's
        // profile-only prediction says 80), and said so.
        let mut old = r("c", "ddp-tcp", 100.0, 90.0, 110.0, true);
        old.advisor_profile_ms = None;
        let mut fresh = r("c", "zero1-tcp", 99.0, 95.0, 110.0, true);
        fresh.advisor_profile_ms = Some(80.0);
        let v = merged(summarise(String::new(), vec![fresh]), summarise(String::new(), vec![old]));
        let c = v.picks.iter().find(|p| p.group == "c").unwrap();
        assert!(c.by_runs_compute && c.pick == "ddp-tcp" && c.found, "{c:?}");
        assert!(markdown(&v).contains("found (picked by the runs' own compute"));
        // Not a validation: refused by name.
        std::fs::write(&path, "{\"clusters\": {\"rows\": 3}}").unwrap();
        let e = format!("{:#}", load_saved(&path).unwrap_err());
        assert!(e.contains("saved.json") && e.contains("not a validation"), "{e}");
    }

    #[test]
    fn a_directory_without_cluster_runs_is_refused_by_name() {
        let d = gradsync_testkit::Scratch::new("validate-empty");
        let e = validate(&[d.to_path_buf()]).unwrap_err().to_string();
        assert!(e.contains("holds no emulated cluster's runs") && e.contains("cluster.json"), "{e}");
    }
}
