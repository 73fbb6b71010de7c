//! A model's state in safetensors under PyTorch's state-dict names, so that
//! `model.load_state_dict(safetensors.torch.load_file(path))` loads what gradsync wrote, and
//! gradsync loads what PyTorch saved with `safetensors.torch.save_file(model.state_dict(), path)`.
//!
//! Parameters and running statistics are `f32` under their [`crate::model::Layout`] names; each
//! batch norm's `num_batches_tracked` is the `i64` scalar PyTorch keeps. Files are written
//! atomically; a file read back is checked name by name against the model, and any missing,
//! unexpected or misshapen tensor is named in the error.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use safetensors::{Dtype, SafeTensors};

use crate::error::{Error, Result};
use crate::model::{Layout, Tensor};

/// A tensor's values.
#[derive(Debug, Clone, PartialEq)]
pub enum Values {
    /// 32-bit floats.
    F32(Vec<f32>),
    /// 64-bit integers (labels, counters).
    I64(Vec<i64>),
}

impl Values {
    fn bytes(&self) -> Vec<u8> {
        match self {
            Values::F32(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            Values::I64(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        }
    }

    fn dtype(&self) -> Dtype {
        match self {
            Values::F32(_) => Dtype::F32,
            Values::I64(_) => Dtype::I64,
        }
    }
}

/// One named tensor.
#[derive(Debug, Clone, PartialEq)]
pub struct Entry {
    /// Its shape (`[]` for a scalar).
    pub shape: Vec<usize>,
    /// Its values, as many as the shape holds.
    pub values: Values,
}

impl Entry {
    /// An `f32` tensor.
    pub fn f32(shape: Vec<usize>, values: Vec<f32>) -> Self {
        Entry { shape, values: Values::F32(values) }
    }

    /// The values as `f32` (integers converted), for comparisons and loading.
    pub fn to_f32(&self) -> Vec<f32> {
        match &self.values {
            Values::F32(v) => v.clone(),
            Values::I64(v) => v.iter().map(|&x| x as f32).collect(),
        }
    }
}

/// Named tensors, sorted by name.
pub type Tensors = BTreeMap<String, Entry>;

/// Whether `path` names a PyTorch state dict (`.safetensors`) rather than a gradsync
/// checkpoint: the one rule every `--save`, `--load` and export follows.
pub fn is_state_dict(path: &Path) -> bool {
    path.extension().is_some_and(|e| e == "safetensors")
}

/// Write `tensors` to `path` as safetensors, atomically, with `metadata` in its header.
pub fn save(path: &Path, tensors: &Tensors, metadata: &[(&str, String)]) -> Result<()> {
    crate::checkpoint::write_atomically(path, &to_bytes(path, tensors, metadata)?)
}

/// `tensors` as the bytes of a safetensors file, with `metadata` in its header; errors name
/// `path`, the file they are meant for.
pub fn to_bytes(path: &Path, tensors: &Tensors, metadata: &[(&str, String)]) -> Result<Vec<u8>> {
    let bytes: Vec<(String, Vec<u8>)> = tensors.iter().map(|(k, e)| (k.clone(), e.values.bytes())).collect();
    let views = tensors
        .iter()
        .zip(&bytes)
        .map(|((name, e), (_, b))| {
            safetensors::tensor::TensorView::new(e.values.dtype(), e.shape.clone(), b)
                .map(|v| (name.clone(), v))
                .map_err(|err| Error::file(path, format!("tensor {name}: {err}")))
        })
        .collect::<Result<Vec<_>>>()?;
    let info: HashMap<String, String> = metadata.iter().map(|(k, v)| ((*k).to_string(), v.clone())).collect();
    safetensors::serialize(views, (!info.is_empty()).then_some(info))
        .map_err(|e| Error::file(path, e.to_string()))
}

/// Read every tensor of the safetensors file `path` (`f32`, or integers as `i64`).
pub fn load(path: &Path) -> Result<Tensors> {
    let bytes = std::fs::read(path).map_err(|e| Error::io(path, e))?;
    from_bytes(path, &bytes)
}

/// Every tensor of `bytes`, a safetensors file's contents read from `path` (which errors
/// name), as [`load`] reads them.
pub fn from_bytes(path: &Path, bytes: &[u8]) -> Result<Tensors> {
    let st = SafeTensors::deserialize(bytes)
        .map_err(|e| Error::file(path, format!("not a safetensors file: {e}")))?;
    let mut out = Tensors::new();
    for (name, view) in st.tensors() {
        let data = view.data();
        let values = match view.dtype() {
            Dtype::F32 => Values::F32(
                data.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
            ),
            Dtype::I64 => Values::I64(
                data.chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().unwrap_or([0; 8]))).collect(),
            ),
            Dtype::I32 => Values::I64(
                data.chunks_exact(4)
                    .map(|c| i64::from(i32::from_le_bytes([c[0], c[1], c[2], c[3]])))
                    .collect(),
            ),
            other => {
                return Err(Error::file(
                    path,
                    format!("tensor {name} is {other:?}; gradsync reads F32, I64 and I32"),
                ));
            }
        };
        out.insert(name, Entry { shape: view.shape().to_vec(), values });
    }
    Ok(out)
}

/// The model's state: every parameter and running statistic under its name, and each batch
/// norm's `num_batches_tracked` (`batches`, the training forward passes so far).
pub fn from_model(layout: &Layout, params: &[f32], buffers: &[f32], batches: u64) -> Tensors {
    let mut out = Tensors::new();
    let put = |out: &mut Tensors, t: &Tensor, src: &[f32]| {
        out.insert(t.name.clone(), Entry::f32(t.shape.clone(), src[t.range.clone()].to_vec()));
    };
    for t in &layout.params {
        put(&mut out, t, params);
    }
    for t in &layout.buffers {
        put(&mut out, t, buffers);
        if let Some(prefix) = t.name.strip_suffix(".running_mean") {
            let tracked = Entry { shape: Vec::new(), values: Values::I64(vec![batches as i64]) };
            out.insert(format!("{prefix}.num_batches_tracked"), tracked);
        }
    }
    out
}

/// A model's parameters and buffers from `tensors` (as [`load`] read them from `path`): every
/// parameter must be there with its shape; buffers absent from the file keep `None` (PyTorch's
/// defaults apply). A missing, unexpected or misshapen tensor is an error naming it.
pub fn to_model(path: &Path, layout: &Layout, tensors: &Tensors) -> Result<(Vec<f32>, Option<Vec<f32>>)> {
    // What does not fit, by kind, so that a file of another model reads as such in one line.
    let (mut missing, mut misshapen) = (Vec::new(), Vec::new());
    let mut take = |list: &[Tensor], out: &mut Vec<f32>, required: bool| -> bool {
        let mut all = true;
        for t in list {
            match tensors.get(&t.name) {
                Some(e) if e.shape == t.shape => out[t.range.clone()].copy_from_slice(&e.to_f32()),
                Some(e) => {
                    misshapen.push(format!("{} is {:?}, the model's is {:?}", t.name, e.shape, t.shape));
                    all = false;
                }
                None => {
                    if required {
                        missing.push(t.name.clone());
                    }
                    all = false;
                }
            }
        }
        all
    };
    let mut params = vec![0.0; layout.len];
    take(&layout.params, &mut params, true);
    let mut buffers = crate::model::init_buffers(layout);
    let has_buffers = take(&layout.buffers, &mut buffers, false);
    let known = |name: &str| {
        layout.params.iter().chain(&layout.buffers).any(|t| t.name == name)
            || name
                .strip_suffix(".num_batches_tracked")
                .is_some_and(|p| layout.buffers.iter().any(|t| t.name == format!("{p}.running_mean")))
    };
    let unexpected: Vec<String> = tensors.keys().filter(|k| !known(k)).cloned().collect();
    let list = |v: &[String]| {
        let shown: Vec<&str> = v.iter().take(4).map(String::as_str).collect();
        let more = if v.len() > 4 { format!(" and {} more", v.len() - 4) } else { String::new() };
        format!("{}{more}", shown.join(", "))
    };
    let mut problems = Vec::new();
    if !missing.is_empty() {
        problems.push(format!(
            "{} of the model's {} parameters are missing ({})",
            missing.len(),
            layout.params.len(),
            list(&missing)
        ));
    }
    if !misshapen.is_empty() {
        problems.push(format!("{} are shaped otherwise ({})", misshapen.len(), list(&misshapen)));
    }
    if !unexpected.is_empty() {
        problems.push(format!("{} tensors are not the model's ({})", unexpected.len(), list(&unexpected)));
    }
    if !problems.is_empty() {
        return Err(Error::file(path, format!("does not fit this model: {}", problems.join("; "))));
    }
    Ok((params, has_buffers.then_some(buffers)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Input, ModelSpec, init_params};

    fn layout(name: &str) -> Layout {
        let spec = ModelSpec::parse(name)
            .unwrap()
            .fit(Input::Image { channels: 1, height: 8, width: 8 }, 10)
            .unwrap();
        Layout::new(&spec)
    }

    #[test]
    fn a_model_round_trips_and_another_models_file_is_refused_by_name() {
        let dir = tempfile::tempdir().unwrap();
        let l = layout("cnn8");
        let params = init_params(&l, 3);
        let buffers: Vec<f32> = (0..l.buffers_len).map(|i| i as f32).collect();
        let path = dir.path().join("m.safetensors");
        save(&path, &from_model(&l, &params, &buffers, 7), &[("step", "7".into())]).unwrap();
        let read = load(&path).unwrap();
        assert_eq!(read["features.1.num_batches_tracked"].values, Values::I64(vec![7]));
        let (p, b) = to_model(&path, &l, &read).unwrap();
        assert_eq!((p, b), (params, Some(buffers)));

        // Parameters alone: PyTorch's defaults for the buffers.
        let only: Tensors = read
            .iter()
            .filter(|(k, _)| !k.contains("running") && !k.contains("num_batches"))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        assert_eq!(to_model(&path, &l, &only).unwrap().1, None);

        let err = to_model(&path, &layout("resnet20"), &read).unwrap_err().to_string();
        assert!(err.contains("65 of the model's 65 parameters are missing (conv1.weight, bn1.weight, bn1.bias, layer1.0.conv1.weight and 61 more)"), "{err}");
        assert!(err.contains("16 tensors are not the model's"), "{err}");
        let mut wrong = read.clone();
        wrong.insert("classifier.2.bias".into(), Entry::f32(vec![3], vec![0.0; 3]));
        let err = to_model(&path, &l, &wrong).unwrap_err().to_string();
        assert!(err.contains("classifier.2.bias is [3], the model's is [10]"), "{err}");

        std::fs::write(&path, b"not a tensor file").unwrap();
        assert!(load(&path).unwrap_err().to_string().contains("not a safetensors file"));
    }
}
