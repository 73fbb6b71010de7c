//! `gradsync-bench export`: gradsync checkpoints, whole or a parameter server's shards, as one
//! PyTorch state dict, with the model read from their fingerprint; a missing shard or another
//! model's file refused by name.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::{Command, Output};

use gradsync_core::checkpoint::{Checkpoint, CheckpointHeader};
use gradsync_core::model::{Fingerprint, Layout, ModelSpec, init_params, segment};
use gradsync_testkit::Scratch;

fn export(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_gradsync-bench")).arg("export").args(args).output().unwrap()
}

/// The shards of `spec`'s parameters (seed 3) as server checkpoints in `dir`.
fn shards(dir: &Scratch, spec: &ModelSpec, k: usize) -> (Vec<f32>, Vec<String>) {
    let params = init_params(&Layout::new(spec), 3);
    let paths = (0..k)
        .map(|i| {
            let r = segment(params.len(), k, i);
            let path = dir.join(format!("shard{i}.ckpt"));
            Checkpoint {
                header: CheckpointHeader {
                    fingerprint: Fingerprint::new(spec, 3).text,
                    step: 12,
                    start: r.start,
                    end: r.end,
                    has_momentum: false,
                    version: gradsync_core::VERSION.into(),
                },
                params: params[r].to_vec(),
                momentum: None,
            }
            .save(&path)
            .unwrap();
            path.display().to_string()
        })
        .collect();
    (params, paths)
}

#[test]
fn shards_become_one_state_dict_and_a_gap_or_another_model_is_refused() {
    let dir = Scratch::new("export");
    let spec = ModelSpec::parse("resnet20").unwrap();
    let (params, paths) = shards(&dir, &spec, 3);
    let out = dir.join("model.safetensors");
    let o = export(&[&paths[2], &paths[0], &paths[1], "--out", out.to_str().unwrap()]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(text.contains("resnet20 (3x32x32, 10 classes)") && text.contains("initial ones"), "{text}");
    let tensors = gradsync_core::state_dict::load(&out).unwrap();
    let layout = Layout::new(&spec);
    for t in &layout.params {
        assert_eq!(tensors[&t.name].to_f32(), params[t.range.clone()], "{}", t.name);
    }
    assert!(
        tensors.contains_key("bn1.running_var") && tensors.contains_key("layer3.2.bn2.num_batches_tracked")
    );

    let o = export(&[&paths[0], &paths[2], "--out", out.to_str().unwrap()]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("shard2.ckpt") && err.contains("a shard missing"), "{err}");

    let other = Scratch::new("export-other");
    let (_, mlp) = shards(&other, &ModelSpec::parse("tiny").unwrap(), 1);
    let o = export(&[&paths[0], &mlp[0], "--out", out.to_str().unwrap()]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("is another model"), "{err}");
    let o = export(&[&paths[0], "--out", dir.join("x.pt").to_str().unwrap()]);
    assert!(String::from_utf8_lossy(&o.stderr).contains("written as .safetensors"));
}
