//! The reading: what the figures say, sentence by sentence, computed from them. Each reading is
//! one small function over the shared [`Context`], listed in [`READINGS`] in the order the
//! page shows them; adding a reading is adding a function to the list. None reads a failed,
//! diverged or partial run (a group's rows are its complete repeats' medians).

use super::context::Context;
use super::{links, ranking, regime, runs, sparse};
use crate::charts::Group;
use crate::cost::Link;
use crate::machine::Machine;
use crate::results::Summary;

/// A reading: its sentences (none when it has nothing to say).
pub type Reading = fn(&Context) -> Vec<String>;

/// Every reading, in the page's order.
pub const READINGS: &[Reading] = &[
    runs::no_runs,
    regime::replay,
    ranking::fastest,
    ranking::first_to_target,
    ranking::scaling,
    runs::fixed_costs,
    ranking::ring_against_ps,
    sparse::ps_against_dense,
    links::busiest_shard,
    runs::exposed_share,
    ranking::zero1_against_ddp,
    ranking::compressed_against_base,
    links::communication_against_raw,
    regime::compute_against_communication,
    regime::across_models,
    links::ring_fit,
    links::extrapolated,
    runs::staleness,
    runs::accuracy_against_local,
    regime::batch_norm,
    runs::contention,
    runs::straggler,
    runs::restarts,
    runs::failures,
    runs::diverged,
    runs::partial,
    runs::skipped,
];

/// What the figures of group `g` say, sentence by sentence: every reading of [`READINGS`].
pub fn reading(g: &Group, link: Option<Link>, m: Option<&Machine>, all: &[Summary]) -> Vec<String> {
    paragraphs(&Context::new(g, link, m, all))
}

/// Every reading of [`READINGS`] over `cx`, a paragraph each.
pub fn paragraphs(cx: &Context) -> Vec<String> {
    READINGS.iter().flat_map(|r| r(cx)).collect()
}
