//! What the worker's process tests share: the `gradsync-server` binary they start, and the
//! comparison of two checkpoints bit for bit.

use std::path::{Path, PathBuf};

use gradsync_core::checkpoint::Checkpoint;

/// `gradsync-server`, from the target directory this test was built into (the test kit's
/// [`gradsync_testkit::process::binary`]: built by `cargo nextest run --workspace`, never by
/// a test).
#[allow(dead_code)] // not every test file sharing this module starts servers
pub fn server_bin() -> PathBuf {
    gradsync_testkit::process::binary("gradsync-server")
}

/// Assert that the checkpoints `a` and `b` hold the same step, and the same parameters and
/// momentum bit for bit.
#[allow(dead_code, clippy::unwrap_used)] // not every test file sharing this module compares checkpoints
pub fn assert_same_checkpoints(a: &Path, b: &Path) {
    let (a_ck, b_ck) = (Checkpoint::load(a).unwrap(), Checkpoint::load(b).unwrap());
    assert_eq!(a_ck.header.step, b_ck.header.step, "steps of {} and {}", a.display(), b.display());
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert!(
        bits(&a_ck.params) == bits(&b_ck.params),
        "parameters differ: {} vs {}",
        a.display(),
        b.display()
    );
    assert!(
        bits(a_ck.momentum.as_deref().unwrap()) == bits(b_ck.momentum.as_deref().unwrap()),
        "momentum differs: {} vs {}",
        a.display(),
        b.display()
    );
}
