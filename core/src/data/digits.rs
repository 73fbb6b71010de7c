//! The built-in real data set: the UCI handwritten digits (1797 images of 8x8 pixels, 0..16,
//! labels 0..9; CC BY 4.0, see `core/data/README.md`), embedded in the binary so every mode
//! trains on real, labelled data with no download.
//!
//! The split is fixed, stratified and documented so accuracies compare across runs and
//! machines: in file order, every fifth image of each digit (its 5th, 10th, ...) is held out
//! (355 images, 34-36 per digit), the other 1442 train. Pixels are scaled to `p / 16` and then
//! standardised with the mean and standard deviation of the training part's pixels (as
//! torchvision's MNIST constants are), the same for both parts.

use std::io::Read;

use super::{Dataset, Split};
use crate::error::{Error, Result};

/// The file as scikit-learn ships it (`sklearn/datasets/data/digits.csv.gz`).
const GZ: &[u8] = include_bytes!("../../data/digits.csv.gz");
/// Pixels per image.
pub const DIM: usize = 64;
/// Classes.
pub const CLASSES: usize = 10;
/// Every `HOLD_OUT`-th image of each digit is held out.
const HOLD_OUT: usize = 5;

/// Decode the embedded file and split it.
pub fn load() -> Result<Dataset> {
    let mut text = String::new();
    flate2::read::GzDecoder::new(GZ)
        .read_to_string(&mut text)
        .map_err(|e| Error::invalid("data", format!("the embedded digits file does not decode: {e}")))?;
    let (train, test) = parse(&text)?;
    Ok(Dataset {
        name: "digits".into(),
        dim: DIM,
        input: crate::model::Input::Image { channels: 1, height: 8, width: 8 },
        classes: CLASSES,
        train,
        test,
    })
}

/// Parse the CSV (64 pixels and a label per line) into the fixed split, normalised.
fn parse(text: &str) -> Result<(Split, Split)> {
    let bad = |line: usize, why: String| Error::invalid("data", format!("digits line {}: {why}", line + 1));
    let (mut train, mut test) = (Split { x: vec![], y: vec![] }, Split { x: vec![], y: vec![] });
    let mut seen = [0usize; CLASSES];
    for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let fields: Vec<&str> = line.split(',').map(str::trim).collect();
        if fields.len() != DIM + 1 {
            return Err(bad(i, format!("{} fields, expected {}", fields.len(), DIM + 1)));
        }
        let label: u32 = fields[DIM].parse().map_err(|e| bad(i, format!("label '{}': {e}", fields[DIM])))?;
        if label as usize >= CLASSES {
            return Err(bad(i, format!("label {label} is not a digit")));
        }
        let nth = &mut seen[label as usize];
        let part = if *nth % HOLD_OUT == HOLD_OUT - 1 { &mut test } else { &mut train };
        *nth += 1;
        for f in &fields[..DIM] {
            let p: u8 = f.parse().map_err(|e| bad(i, format!("pixel '{f}': {e}")))?;
            if p > 16 {
                return Err(bad(i, format!("pixel {p} is above 16")));
            }
            part.x.push(f32::from(p) / 16.0);
        }
        part.y.push(label);
    }
    let n = train.x.len().max(1) as f64;
    let mean = train.x.iter().map(|&v| f64::from(v)).sum::<f64>() / n;
    let var = train.x.iter().map(|&v| (f64::from(v) - mean).powi(2)).sum::<f64>() / n;
    let std = var.sqrt().max(1e-6);
    for v in train.x.iter_mut().chain(test.x.iter_mut()) {
        *v = ((f64::from(*v) - mean) / std) as f32;
    }
    Ok((train, test))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn the_fixed_split_holds_every_digit() {
        let d = load().unwrap();
        assert_eq!((d.train.len(), d.test.len()), (1442, 355));
        assert_eq!(d.train.x.len(), 1442 * DIM);
        for part in [&d.train, &d.test] {
            let mut count = [0usize; CLASSES];
            part.y.iter().for_each(|&y| count[y as usize] += 1);
            // Stratified: every digit close to a tenth of each part.
            let n = part.len();
            assert!(count.iter().all(|&c| c * 100 >= n * 9 && c * 100 <= n * 11), "{count:?} of {n}");
        }
        // Standardised with the training part's statistics.
        let mean = d.train.x.iter().map(|&v| f64::from(v)).sum::<f64>() / d.train.x.len() as f64;
        assert!(mean.abs() < 1e-4, "{mean}");
        // The file's first row is a 0; the first held out is row 34, the fifth 5.
        assert_eq!((d.train.y[0], d.test.y[0]), (0, 5));
    }

    #[test]
    fn malformed_rows_are_named() {
        let row = |label: &str| format!("{}{label}", "0,".repeat(DIM));
        let e = parse(&format!("{}\n{}\n", row("3"), row("12"))).unwrap_err().to_string();
        assert!(e.contains("line 2") && e.contains("12"), "{e}");
        let e = parse("1,2,3\n").unwrap_err().to_string();
        assert!(e.contains("line 1") && e.contains("3 fields"), "{e}");
        let e = parse(&format!("17,{}", &row("1")[2..])).unwrap_err().to_string();
        assert!(e.contains("above 16"), "{e}");
    }
}
