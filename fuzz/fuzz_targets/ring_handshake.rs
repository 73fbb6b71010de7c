//! Fuzz what a stranger can send a ring rank or the rendezvous store: one handshake line
//! (bounded JSON), its verdict, then a frame header. The production module is compiled
//! in as is (`#[path]`), so this runs exactly the code the ranks run.
#![no_main]

#[path = "../../worker/src/collective/handshake.rs"]
#[allow(dead_code)]
mod handshake;

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let mut rest = data;
    let token = handshake::token_hash(Some("fuzz-token"));
    if let Ok(h) = handshake::read_line::<handshake::Hello>(&mut rest) {
        // A rank (me = 1) and the store (me = None) judge the same line.
        let _ = handshake::refuse(&h, Some(1), 4, "mlp:4-8-2:f32:seed=1", token);
        let _ = handshake::refuse(&h, None, 4, "mlp:4-8-2:f32:seed=1", token);
    }
    let _ = handshake::read_line::<handshake::Welcome>(&mut &data[..]);
    if let Some(head) = rest.get(..8) {
        let head: [u8; 8] = head.try_into().expect("8 bytes");
        let expect = rest.len().saturating_sub(8) / 4;
        match handshake::check_header(&head, 1, expect) {
            Ok(()) => assert_eq!(u32::from_le_bytes([head[4], head[5], head[6], head[7]]) as usize, expect),
            Err(handshake::HeaderError::Count(c)) => assert_ne!(c, expect),
            Err(handshake::HeaderError::Tag(t)) => assert_ne!(t, 1),
        }
    }
});
