//! Parameter files: the trained parameters (optionally the optimiser's momentum and the step)
//! tagged with the model fingerprint, written atomically.
//!
//! Format: the 8 bytes `GSYNCKP1`, a little-endian `u32` header length, the JSON
//! [`CheckpointHeader`], then the parameters and (when present) the momentum as little-endian
//! `f32`, then a little-endian `u64` FNV-1a checksum of everything before it.

use std::fs::File;
use std::io::Write;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

const MAGIC: &[u8; 8] = b"GSYNCKP1";

/// What a checkpoint says about itself.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CheckpointHeader {
    /// The model fingerprint.
    pub fingerprint: String,
    /// Steps (or server versions) taken when it was written.
    pub step: u64,
    /// The range of the flat buffer it holds (a server shard holds part of it).
    pub start: usize,
    /// End of that range.
    pub end: usize,
    /// Whether the momentum buffer follows the parameters.
    pub has_momentum: bool,
    /// gradsync's version.
    pub version: String,
}

/// A checkpoint in memory.
#[derive(Debug, Clone, PartialEq)]
pub struct Checkpoint {
    /// Header.
    pub header: CheckpointHeader,
    /// Parameters of `header.start..header.end`.
    pub params: Vec<f32>,
    /// Momentum, same range, when saved.
    pub momentum: Option<Vec<f32>>,
}

/// Write `bytes` to `path` atomically: a temporary file beside it, fsync, rename, fsync the
/// directory. A crash at any point leaves either the old file or the new one.
pub(crate) fn write_atomically(path: &Path, bytes: &[u8]) -> Result<()> {
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    let name = path.file_name().ok_or_else(|| Error::file(path, "not a file path"))?;
    let tmp = dir.join(format!(".{}.tmp.{}", name.to_string_lossy(), std::process::id()));
    let result = (|| {
        let mut f = File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)?;
        File::open(dir)?.sync_all()
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result.map_err(|e| Error::io(path, e))
}

fn fnv(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3))
}

impl Checkpoint {
    /// Write to `path` atomically: a temporary file beside it, fsync, rename, fsync the
    /// directory. A crash at any point leaves either the old file or the new one.
    pub fn save(&self, path: &Path) -> Result<()> {
        let header = serde_json::to_vec(&self.header).map_err(|e| Error::file(path, e.to_string()))?;
        let n = self.params.len();
        let mut buf = Vec::with_capacity(16 + header.len() + 8 * n + 8);
        buf.extend_from_slice(MAGIC);
        buf.extend_from_slice(&(header.len() as u32).to_le_bytes());
        buf.extend_from_slice(&header);
        for v in self.params.iter().chain(self.momentum.iter().flatten()) {
            buf.extend_from_slice(&v.to_le_bytes());
        }
        let sum = fnv(&buf);
        buf.extend_from_slice(&sum.to_le_bytes());

        write_atomically(path, &buf)
    }

    /// Read and verify `path`.
    pub fn load(path: &Path) -> Result<Self> {
        let b = std::fs::read(path).map_err(|e| Error::io(path, e))?;
        if b.len() < 20 || &b[..8] != MAGIC {
            return Err(Error::file(path, "not a gradsync checkpoint (bad magic or too short)"));
        }
        let (body, tail) = b.split_at(b.len() - 8);
        let stored = u64::from_le_bytes(tail.try_into().map_err(|_| Error::file(path, "truncated"))?);
        if fnv(body) != stored {
            return Err(Error::file(path, "checksum mismatch: the file is truncated or corrupt"));
        }
        let hlen = u32::from_le_bytes([b[8], b[9], b[10], b[11]]) as usize;
        let hjson = body.get(12..12 + hlen).ok_or_else(|| Error::file(path, "header runs past the end"))?;
        let header: CheckpointHeader =
            serde_json::from_slice(hjson).map_err(|e| Error::file(path, format!("bad header: {e}")))?;
        let n = header
            .end
            .checked_sub(header.start)
            .ok_or_else(|| Error::file(path, "header range is reversed"))?;
        let values = &body[12 + hlen..];
        let per_value = if header.has_momentum { 8 } else { 4 };
        let want = n.checked_mul(per_value).ok_or_else(|| {
            Error::file(path, format!("header range {}..{} is too large", header.start, header.end))
        })?;
        if values.len() != want {
            return Err(Error::file(
                path,
                format!("holds {} values, header promises {}", values.len() / 4, want / 4),
            ));
        }
        // Each straight into a buffer of its own, allocated as the engine's and the server's are.
        let decode = |bytes: &[u8]| {
            let mut v: Vec<f32> = crate::heap::zeros(bytes.len() / 4);
            for (d, c) in v.iter_mut().zip(bytes.chunks_exact(4)) {
                *d = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
            v
        };
        let (params, momentum) = values.split_at(4 * n);
        let momentum = header.has_momentum.then(|| decode(momentum));
        Ok(Checkpoint { header, params: decode(params), momentum })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_corruption() {
        let dir = gradsync_testkit::Scratch::new("ckpt");
        let path = dir.join("a.ckpt");
        let c = Checkpoint {
            header: CheckpointHeader {
                fingerprint: "mlp:2-2:f32:seed=1".into(),
                step: 9,
                start: 2,
                end: 5,
                has_momentum: true,
                version: "t".into(),
            },
            params: vec![1.0, 2.0, 3.0],
            momentum: Some(vec![0.5, 0.25, -1.0]),
        };
        c.save(&path).unwrap();
        assert_eq!(Checkpoint::load(&path).unwrap(), c);
        let mut bytes = std::fs::read(&path).unwrap();
        let mid = bytes.len() / 2;
        bytes[mid] ^= 1;
        std::fs::write(&path, &bytes).unwrap();
        assert!(Checkpoint::load(&path).unwrap_err().to_string().contains("checksum"));
        std::fs::write(&path, &bytes[..10]).unwrap();
        assert!(Checkpoint::load(&path).is_err());
    }

    /// A header whose range is too large to hold, or longer than the values that follow, is
    /// refused by name, not a panic or a wrapped length (the checksum guards against damage,
    /// not against a file written that way).
    #[test]
    fn a_header_promising_what_is_not_there_is_refused() {
        let dir = gradsync_testkit::Scratch::new("ckpt");
        let path = dir.join("a.ckpt");
        let c = |start, end| Checkpoint {
            header: CheckpointHeader {
                fingerprint: "f".into(),
                step: 1,
                start,
                end,
                has_momentum: true,
                version: "t".into(),
            },
            params: vec![1.0, 2.0],
            momentum: Some(vec![3.0, 4.0]),
        };
        c(0, usize::MAX / 2 + 1).save(&path).unwrap();
        let e = Checkpoint::load(&path).unwrap_err().to_string();
        assert!(e.contains("is too large"), "{e}");
        c(0, 3).save(&path).unwrap();
        let e = Checkpoint::load(&path).unwrap_err().to_string();
        assert!(e.contains("holds 4 values, header promises 6"), "{e}");
    }
}
