//! What `advise` prints: the whole advice as one serialisable [`Report`] (what `--json`
//! writes, every figure a prediction), and its text form: the model, the cluster and the codec
//! rates it was predicted for, the ranked table, the pick with the term that decides it, where
//! the pick would change, and what the prediction leaves out.

use serde::Serialize;

use super::codec::CodecRates;
use super::config::Accuracy;
use super::predict::{Prediction, Workload};
use super::search::{Advice, Change, HOST_SPAN, RATE_SPAN, Space};
use super::spec::{ClusterSpec, gbit_text};
use crate::table::Table;

/// What the predictor leaves out, said with every advice.
pub const NOT_MODELLED: &[&str] = &[
    "activations in memory (a profile holds no activation sizes): memory is model state only",
    "the TCP backend's costs beyond latency and bandwidth (framing, copies, GPU buckets staged through pinned memory) and NCCL's own protocols",
    "compute slowed by communication, stragglers, other jobs on the links",
    "sparse tables (ps-sparse, ddp-allgather, hybrid): a profile holds dense tensors, not a table's rows",
    "steps to an accuracy: top-k's are stated beside it, not predicted",
];

/// Everything `advise` says.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// Always `prediction`: no figure here was measured.
    pub kind: &'static str,
    /// The model.
    pub model: Workload,
    /// The cluster.
    pub cluster: ClusterSpec,
    /// The codec rates compression was priced at.
    pub codecs: CodecRates,
    /// What was searched.
    pub space: Space,
    /// The ranking, the pick and its crossovers.
    pub advice: Advice,
    /// What the prediction leaves out.
    pub not_modelled: Vec<&'static str>,
    /// With `--check`: the configurations run, measured beside predicted.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub check: Option<super::check::CheckReport>,
}

/// Bytes in words: `553.4 MB`, `2.21 GB`.
fn bytes(b: f64) -> String {
    if b >= 1e9 { format!("{:.2} GB", b / 1e9) } else { format!("{:.1} MB", b / 1e6) }
}

/// Seconds as milliseconds.
fn ms(s: f64) -> String {
    format!("{:.2}", s * 1e3)
}

/// The accuracy column.
fn accuracy(p: &Prediction) -> String {
    match p.config.accuracy() {
        Accuracy::Exact => "f32".into(),
        Accuracy::Rounded => format!("{} rounding", p.config.compression),
        Accuracy::Sparsified => "top-k: more steps".into(),
    }
}

impl Report {
    /// The text form, the ranked table cut to `top` rows.
    pub fn text(&self, top: usize) -> String {
        let m = &self.model;
        let how = if m.estimated { "estimated" } else { "measured" };
        let mut out = String::from("gradsync-bench advise: every figure below is predicted, none measured\n");
        out += &format!(
            "model    {} ({}; times {how} on {}), {:.1} M parameters, batch {} a worker\n",
            m.model,
            m.source,
            m.device,
            m.params as f64 / 1e6,
            m.batch
        );
        out += &format!(
            "compute  forward {} ms, backward {} ms, whole update {} ms a step\n",
            ms(m.forward_s),
            ms(m.backward_s),
            ms(m.update_s)
        );
        out += &format!("cluster  {} ({})\n", self.cluster.describe(), self.cluster.source);
        out += &format!("codecs   {}\n\n", self.codecs.describe());
        out += &self.table(top);
        out += &self.verdict();
        out += &format!("\nnot modelled: {}.\n", self.not_modelled.join("; "));
        out
    }

    /// The ranked table.
    fn table(&self, top: usize) -> String {
        let mut t = Table::new(&[
            "#",
            "configuration",
            "step ms",
            "exposed comm ms",
            "bytes/worker",
            "bytes/server",
            "memory/worker",
            "+hosts",
            "accuracy",
        ]);
        let ranked = &self.advice.ranked;
        let pick = self.advice.verdict.as_ref().map(|v| v.pick);
        for (i, p) in ranked.iter().enumerate().take(top.max(1)) {
            let mark = if Some(i) == pick { "*" } else { "" };
            t.row(vec![
                format!("{mark}{}", i + 1),
                p.label.clone(),
                ms(p.step_s),
                ms(p.exposed_s),
                bytes(p.bytes_per_worker),
                p.bytes_per_server.map_or("-".into(), bytes),
                bytes(p.memory_per_worker),
                p.extra_hosts.to_string(),
                accuracy(p),
            ]);
        }
        let mut out = t.render();
        if ranked.len() > top {
            out += &format!("({} of {} configurations; --top or --json for all)\n", top.max(1), ranked.len());
        }
        // What each compression shown does to accuracy, once each.
        let mut notes: Vec<String> = Vec::new();
        for p in ranked.iter().take(top.max(1)) {
            let note = p.config.accuracy().note(p.config.compression);
            if p.config.accuracy() != Accuracy::Exact && !notes.contains(&note) {
                notes.push(note);
            }
        }
        for n in notes {
            out += &format!("accuracy: {n}\n");
        }
        out
    }

    /// The pick, where it would change, and top-k's note.
    fn verdict(&self) -> String {
        let a = &self.advice;
        let mut out = String::new();
        if let Some(v) = &a.verdict {
            out += &format!("\npick (*): {}\n", v.sentence);
        }
        let x = &a.crossovers;
        let rate = |c: &Change| format!("{} ({})", gbit_text(c.at * 1e9 / 8.0), c.to);
        let hosts = |c: &Change| format!("{} host{} ({})", c.at, if c.at == 1.0 { "" } else { "s" }, c.to);
        let mut changes = Vec::new();
        if let Some(c) = &x.rate_below {
            changes.push(format!("with a slower NIC, at {}", rate(c)));
        }
        if let Some(c) = &x.rate_above {
            changes.push(format!("with a faster NIC, at {}", rate(c)));
        }
        if let Some(c) = &x.hosts_below {
            changes.push(format!("with fewer hosts, at {}", hosts(c)));
        }
        if let Some(c) = &x.hosts_above {
            changes.push(format!("with more hosts, at {}", hosts(c)));
        }
        if changes.is_empty() {
            out += &format!(
                "the pick ({}) stays for every NIC from 1/{RATE_SPAN} to {RATE_SPAN} times this one and every host \
                 count up to {HOST_SPAN} times this one (predicted)\n",
                x.family
            );
        } else {
            out += &format!("the pick ({}) would change (predicted): {}\n", x.family, changes.join("; "));
        }
        if let Some(n) = &a.topk_note {
            out += &format!("top-k: {n}\n");
        }
        out
    }
}
