//! Sparse data from a LIBSVM text file (`--data libsvm:FILE`), for the embedding model.
//!
//! Each line is `LABEL INDEX:VALUE INDEX:VALUE ...` (the format of LIBSVM, liblinear and the
//! sparse sets of their data page); blank lines and lines starting with `#` are skipped, and a
//! `#` after the features starts a comment. A feature's index is the row of the table it names
//! (as written: 1-based files leave row 0 unused) and its value the row's weight in the bag.
//! The distinct labels, in ascending order, become classes 0, 1, ... (so -1/+1 become 0/1). The
//! last eighth of the samples (at least one) is held out. A line that does not parse is refused
//! with the file and its line number.

use std::path::Path;

use super::{Dataset, Split};
use crate::error::{Error, Result};
use crate::model::{Input, MAX_BAG_ROWS};

/// Load a LIBSVM file.
pub fn load(path: &Path) -> Result<Dataset> {
    let bytes = super::read_file(path)?;
    let text = std::str::from_utf8(&bytes).map_err(|e| Error::file(path, format!("not UTF-8 text: {e}")))?;
    let mut samples: Vec<(f64, Vec<(u32, f32)>)> = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let bad = |why: String| Error::file(path, format!("line {}: {why}", i + 1));
        let line = line.split_once('#').map_or(line, |(l, _)| l).trim();
        if line.is_empty() {
            continue;
        }
        let mut fields = line.split_whitespace();
        let label = fields.next().unwrap_or_default();
        let label: f64 = label
            .parse()
            .ok()
            .filter(|v: &f64| v.is_finite())
            .ok_or_else(|| bad(format!("label '{label}' is not a number")))?;
        let mut features = Vec::new();
        for f in fields {
            let (index, value) = f.split_once(':').ok_or_else(|| bad(format!("'{f}' is not INDEX:VALUE")))?;
            let index: u32 =
                index.parse().ok().filter(|&v: &u32| (v as usize) < MAX_BAG_ROWS).ok_or_else(|| {
                    bad(format!("index '{index}' is not a whole number below {MAX_BAG_ROWS}"))
                })?;
            let value: f32 = value
                .parse()
                .ok()
                .filter(|v: &f32| v.is_finite())
                .ok_or_else(|| bad(format!("value '{value}' of index {index} is not a number")))?;
            features.push((index, value));
        }
        if features.is_empty() {
            return Err(bad("no features".into()));
        }
        samples.push((label, features));
    }
    if samples.len() < 2 {
        return Err(Error::file(
            path,
            format!("{} samples; need at least 2 (one is held out)", samples.len()),
        ));
    }
    let mut labels: Vec<f64> = samples.iter().map(|s| s.0).collect();
    labels.sort_by(f64::total_cmp);
    labels.dedup();
    if labels.len() < 2 {
        return Err(Error::file(path, "every sample has the same label; need at least 2 classes"));
    }
    let slots = samples.iter().map(|s| s.1.len()).max().unwrap_or(1);
    let rows = samples.iter().flat_map(|s| s.1.iter().map(|f| f.0 as usize + 1)).max().unwrap_or(1);
    let test = (samples.len() / 8).max(1);
    let split = |part: &[(f64, Vec<(u32, f32)>)]| {
        let mut x = Vec::with_capacity(part.len() * 2 * slots);
        let mut y = Vec::with_capacity(part.len());
        for (label, features) in part {
            x.extend((0..slots).map(|j| features.get(j).map_or(-1.0, |f| f.0 as f32)));
            x.extend((0..slots).map(|j| features.get(j).map_or(0.0, |f| f.1)));
            y.push(labels.partition_point(|&l| l < *label) as u32);
        }
        Split { x, y }
    };
    let (train, held) = samples.split_at(samples.len() - test);
    Ok(Dataset {
        name: "libsvm".into(),
        dim: 2 * slots,
        input: Input::Bag { rows, slots },
        classes: labels.len(),
        train: split(train),
        test: split(held),
    })
}
