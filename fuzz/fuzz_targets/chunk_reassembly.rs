//! Fuzz the parameter server's chunk reassembly with arbitrary chunk streams (offsets,
//! lengths, payloads) against a buffer of a fixed real size. The production module
//! (`proto/src/wire.rs`) is compiled in as is. Checks: no panic, nothing written past the
//! buffer, and an accepted stream is exactly the concatenation of its chunks.
#![no_main]

/// The proto crate's error type, which `wire.rs` names as `crate::Error`.
#[allow(dead_code)]
#[path = "../../proto/src/wire.rs"]
mod wire;

#[allow(dead_code)]
#[derive(Debug, thiserror::Error, PartialEq, Eq, Clone)]
pub enum Error {
    #[error("ragged {0}")]
    Ragged(usize),
    #[error("overrun")]
    Overrun { offset: u64, len: usize, range: usize },
    #[error("bad token")]
    BadToken,
}

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&n, mut rest)) = data.split_first() else { return };
    let len = n as usize % 64;
    let mut buf = vec![f32::NAN; len + 1];
    let (dst, guard) = buf.split_at_mut(len);
    let mut asm = wire::Reassembly::new(dst);
    let mut expect = Vec::new();
    let mut ok = true;
    // Each chunk: 8-byte offset, 1-byte payload length, payload.
    while rest.len() >= 9 {
        let offset = u64::from_le_bytes(rest[..8].try_into().expect("8 bytes"));
        let plen = (rest[8] as usize).min(rest.len() - 9);
        let payload = &rest[9..9 + plen];
        rest = &rest[9 + plen..];
        if asm.push(offset, payload).is_err() {
            ok = false;
            break;
        }
        expect.extend_from_slice(payload);
    }
    let done = asm.finish();
    assert!(guard[0].is_nan(), "wrote past the buffer");
    if ok {
        if let Ok((_, bytes)) = done {
            assert_eq!(bytes as usize, len * 4);
            let got: Vec<u8> = buf[..len].iter().flat_map(|v| v.to_le_bytes()).collect();
            assert_eq!(got, expect);
        }
    }
});
