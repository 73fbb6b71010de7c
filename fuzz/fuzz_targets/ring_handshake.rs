//! Fuzz what a stranger can send a ring rank or the rendezvous store, and what a rank reads
//! back from whatever answers its dial: handshake lines (bounded JSON) through the
//! challenge-response state machines of both sides, then a frame header (or an abort notice).
//! The production module is compiled in as is (`#[path]`), so this runs exactly the code the
//! ranks run.
#![no_main]

#[path = "../../worker/src/collective/handshake.rs"]
#[allow(dead_code)]
mod handshake;

use handshake::{Hello, Role};
use libfuzzer_sys::fuzz_target;

const TOKEN: Option<&str> = Some("fuzz-token");
const FP: &str = "mlp:4-8-2:f32:seed=1";

fuzz_target!(|data: &[u8]| {
    let nonce = [5u8; 32];
    // The acceptor's side, as a rank (me = 1) and as the store (me = None), with the bytes as
    // everything the connector sends. Without the token nobody can make the proof: never `Ok`.
    for me in [Some(1), None] {
        let mut out = Vec::new();
        let got = handshake::accept(&mut &data[..], &mut out, me, 4, FP, TOKEN, &nonce);
        assert!(got.is_err(), "accepted a stranger without the token: {got:?}");
        // Whatever it answered is well-formed lines.
        for line in out.split_inclusive(|&b| b == b'\n') {
            assert!(
                handshake::read_line::<handshake::Challenge>(line).is_ok()
                    || handshake::read_line::<handshake::Welcome>(line).is_ok()
            );
        }
    }
    // The same hello followed by the right proof is accepted exactly when its fields fit.
    let mut rest = data;
    if let Ok(hello) = handshake::read_line::<Hello>(&mut rest) {
        for me in [Some(1), None] {
            let mut input = serde_json::to_vec(&hello).expect("a parsed hello serialises");
            input.push(b'\n');
            let answer = handshake::Answer { proof: handshake::proof(TOKEN, Role::Connector, &hello, &nonce) };
            input.extend(serde_json::to_vec(&answer).expect("an answer serialises"));
            input.push(b'\n');
            let got = handshake::accept(&input[..], &mut Vec::new(), me, 4, FP, TOKEN, &nonce);
            let fits = handshake::refuse(&hello, me, 4, FP).is_none();
            assert_eq!(got.is_ok(), fits, "{got:?}");
        }
    }
    // The connector's side, with the bytes as the acceptor's answers: never confirmed without
    // the acceptor's proof for this connection.
    let hello = Hello {
        magic: handshake::MAGIC.into(),
        rank: 2,
        world: 4,
        fingerprint: FP.into(),
        to: Some(1),
        addr: None,
        nonce: [6u8; 32],
    };
    let got = handshake::connect(&mut &data[..], &mut Vec::new(), &hello, TOKEN);
    assert!(got.is_err(), "trusted an acceptor without the token");
    // A frame header after the handshake line.
    if let Some(head) = rest.get(..8) {
        let head: [u8; 8] = head.try_into().expect("8 bytes");
        let expect = rest.len().saturating_sub(8) / 4;
        match handshake::check_header(&head, 1, expect) {
            Ok(()) => assert_eq!(u32::from_le_bytes([head[4], head[5], head[6], head[7]]) as usize, expect),
            Err(handshake::HeaderError::Count(c)) => assert_ne!(c, expect),
            Err(handshake::HeaderError::Tag(t)) => assert_ne!(t, 1),
            Err(handshake::HeaderError::Aborted(c)) => {
                assert_eq!(handshake::ends_with_abort(&head), Some(c));
                assert_eq!(handshake::abort_notice(c), head);
            }
        }
    }
});
