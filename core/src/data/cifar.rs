//! CIFAR-10, binary version: `data_batch_1.bin` .. `data_batch_5.bin` and `test_batch.bin`,
//! each a run of 3073-byte records (one label byte, then 32x32 red, green and blue planes).

use std::path::Path;

use super::{Dataset, Split, read_file, require_dir};
use crate::error::{Error, Result};

const RECORD: usize = 1 + 3 * 32 * 32;
/// Per-channel mean and standard deviation of the training set (the usual constants).
const MEAN: [f32; 3] = [0.4914, 0.4822, 0.4465];
const STD: [f32; 3] = [0.2470, 0.2435, 0.2616];

/// Load the five training batches and the test batch from `dir`.
pub fn load(dir: &Path) -> Result<Dataset> {
    require_dir(dir)?;
    let mut train = Split { x: Vec::new(), y: Vec::new() };
    for i in 1..=5 {
        append(&dir.join(format!("data_batch_{i}.bin")), &mut train)?;
    }
    let mut test = Split { x: Vec::new(), y: Vec::new() };
    append(&dir.join("test_batch.bin"), &mut test)?;
    Ok(Dataset {
        name: "cifar10".into(),
        dim: RECORD - 1,
        input: crate::model::Input::Image { channels: 3, height: 32, width: 32 },
        classes: 10,
        train,
        test,
    })
}

fn append(path: &Path, split: &mut Split) -> Result<()> {
    let bytes = read_file(path)?;
    if bytes.is_empty() || bytes.len() % RECORD != 0 {
        return Err(Error::file(
            path,
            format!(
                "{} bytes is not a whole number of {RECORD}-byte records (truncated or not CIFAR-10 binary)",
                bytes.len()
            ),
        ));
    }
    for (i, rec) in bytes.chunks_exact(RECORD).enumerate() {
        if rec[0] > 9 {
            return Err(Error::file(path, format!("record {i}: label {} is not below 10", rec[0])));
        }
        split.y.push(rec[0] as u32);
        for (c, plane) in rec[1..].chunks_exact(32 * 32).enumerate() {
            split.x.extend(plane.iter().map(|&p| (p as f32 / 255.0 - MEAN[c]) / STD[c]));
        }
    }
    Ok(())
}
