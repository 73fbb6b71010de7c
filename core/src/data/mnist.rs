//! MNIST in its IDX format (LeCun's files, raw or gzip-compressed): big-endian magic 2051 for
//! images (`count, rows, cols`, then bytes) and 2049 for labels (`count`, then bytes).

use std::io::Read;
use std::path::{Path, PathBuf};

use super::{Dataset, Split, read_file, require_dir};
use crate::error::{Error, Result};

const IMAGES_MAGIC: u32 = 2051;
const LABELS_MAGIC: u32 = 2049;
/// torchvision's normalisation constants for MNIST.
const MEAN: f32 = 0.1307;
const STD: f32 = 0.3081;

/// Load `train-*` and `t10k-*` from `dir`.
pub fn load(dir: &Path) -> Result<Dataset> {
    require_dir(dir)?;
    let (train, (height, width)) = split(dir, "train")?;
    let (test, (th, tw)) = split(dir, "t10k")?;
    let dim = height * width;
    if (height, width) != (th, tw) {
        return Err(Error::file(
            dir,
            format!("training images are {height}x{width} pixels but test images are {th}x{tw}"),
        ));
    }
    Ok(Dataset {
        name: "mnist".into(),
        dim,
        input: crate::model::Input::Image { channels: 1, height, width },
        classes: 10,
        train,
        test,
    })
}

fn split(dir: &Path, prefix: &str) -> Result<(Split, (usize, usize))> {
    let ipath = find(dir, &format!("{prefix}-images-idx3-ubyte"))?;
    let lpath = find(dir, &format!("{prefix}-labels-idx1-ubyte"))?;
    let images = read_maybe_gz(&ipath)?;
    let labels = read_maybe_gz(&lpath)?;
    let (n, dims, pixels) = parse_idx(&ipath, &images, IMAGES_MAGIC, 3)?;
    let (nl, _, lbytes) = parse_idx(&lpath, &labels, LABELS_MAGIC, 1)?;
    if n != nl {
        return Err(Error::file(&lpath, format!("{nl} labels for {n} images in {}", ipath.display())));
    }
    if let Some(bad) = lbytes.iter().find(|&&b| b > 9) {
        return Err(Error::file(&lpath, format!("label {bad} is not a digit")));
    }
    let shape = (dims[1], dims[2]);
    let x = pixels.iter().map(|&p| (p as f32 / 255.0 - MEAN) / STD).collect();
    let y = lbytes.iter().map(|&b| b as u32).collect();
    Ok((Split { x, y }, shape))
}

/// `name` or `name.gz` in `dir`.
fn find(dir: &Path, name: &str) -> Result<PathBuf> {
    let raw = dir.join(name);
    let gz = dir.join(format!("{name}.gz"));
    if raw.is_file() {
        Ok(raw)
    } else if gz.is_file() {
        Ok(gz)
    } else {
        Err(Error::file(raw, "missing (looked for it raw and with .gz)"))
    }
}

/// The file's bytes, gunzipped when it ends in `.gz`.
pub(super) fn read_maybe_gz(path: &Path) -> Result<Vec<u8>> {
    let bytes = read_file(path)?;
    if path.extension().is_some_and(|e| e == "gz") {
        let mut out = Vec::new();
        flate2::read::GzDecoder::new(&bytes[..])
            .read_to_end(&mut out)
            .map_err(|e| Error::file(path, format!("not a valid gzip file: {e}")))?;
        Ok(out)
    } else {
        Ok(bytes)
    }
}

/// Check the header and return (count, dims, payload).
fn parse_idx<'a>(
    path: &Path,
    b: &'a [u8],
    magic: u32,
    ndims: usize,
) -> Result<(usize, Vec<usize>, &'a [u8])> {
    let header = 4 + 4 * ndims;
    if b.len() < header {
        return Err(Error::file(
            path,
            format!("truncated: {} bytes, shorter than the {header}-byte header", b.len()),
        ));
    }
    let word = |i: usize| u32::from_be_bytes([b[4 * i], b[4 * i + 1], b[4 * i + 2], b[4 * i + 3]]);
    if word(0) != magic {
        return Err(Error::file(path, format!("wrong magic number {} (expected {magic})", word(0))));
    }
    let dims: Vec<usize> = (1..=ndims).map(|i| word(i) as usize).collect();
    let want = dims.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d));
    let payload = &b[header..];
    match want {
        Some(w) if w == payload.len() => Ok((dims[0], dims, payload)),
        Some(w) if w > payload.len() => Err(Error::file(
            path,
            format!("truncated: header promises {w} bytes of data, file holds {}", payload.len()),
        )),
        _ => Err(Error::file(
            path,
            format!("header dimensions {dims:?} do not match the {} data bytes", payload.len()),
        )),
    }
}
