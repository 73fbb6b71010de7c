//! What the worker's process tests share: the `gradsync-server` binary they start.

use std::path::PathBuf;

/// `gradsync-server`, from the target directory this test was built into (the test kit's
/// [`gradsync_testkit::process::binary`]: built by `cargo nextest run --workspace`, never by
/// a test).
pub fn server_bin() -> PathBuf {
    gradsync_testkit::process::binary("gradsync-server")
}
