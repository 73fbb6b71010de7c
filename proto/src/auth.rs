//! The shared token travels as `authorization: Bearer TOKEN` metadata on every request.

use tonic::metadata::MetadataValue;

use crate::Error;

/// The metadata key.
pub const KEY: &str = "authorization";

/// The metadata value for `token`.
pub fn bearer(token: &str) -> Result<MetadataValue<tonic::metadata::Ascii>, Error> {
    format!("Bearer {token}").parse().map_err(|_| Error::BadToken)
}

/// Whether `a` equals `b`, in time that depends only on their lengths (a wrong token's
/// common prefix must not show in the response time).
pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    let diff = a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y));
    std::hint::black_box(diff) == 0
}

#[cfg(test)]
mod tests {
    #[test]
    fn compares() {
        assert!(super::constant_time_eq(b"abc", b"abc"));
        assert!(!super::constant_time_eq(b"abc", b"abd"));
        assert!(!super::constant_time_eq(b"abc", b"ab"));
        assert!(super::bearer("s3cret").is_ok());
        assert!(super::bearer("bad\ntoken").is_err());
    }
}
