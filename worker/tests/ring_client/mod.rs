//! A client of the ring handshake written for the tests from its description in
//! docs/security.md (`gradsync-ring/2`: hello, challenge, HMAC-SHA256 answer, verdict), not
//! from the worker's code, so that the tests check the protocol rather than restate it.

#![allow(dead_code)]

use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpStream};
use std::thread::JoinHandle;
use std::time::Duration;

use hmac::{Hmac, Mac};
use serde_json::{Value, json};
use sha2::Sha256;

/// Who a client claims to be.
#[derive(Debug, Clone)]
pub struct Claim {
    pub rank: usize,
    pub world: usize,
    pub fingerprint: String,
    /// The rank it means to reach (`None`: the store).
    pub to: Option<usize>,
    /// The ring address it registers (store only).
    pub addr: Option<SocketAddr>,
}

impl Claim {
    /// The hello line, with the connector's nonce.
    pub fn hello(&self, nonce: &[u8; 32]) -> Vec<u8> {
        line(&json!({
            "magic": "gradsync-ring/2", "rank": self.rank, "world": self.world,
            "fingerprint": self.fingerprint, "to": self.to, "addr": self.addr, "nonce": nonce.to_vec(),
        }))
    }

    /// HMAC-SHA256 under `key` of the transcript: length-prefixed magic, role, both nonces,
    /// rank, world, addressee (u64::MAX for the store), address text, fingerprint.
    pub fn proof(&self, key: &str, role: &str, connector: &[u8; 32], acceptor: &[u8; 32]) -> [u8; 32] {
        let to = self.to.map_or(u64::MAX, |t| t as u64);
        let addr = self.addr.map(|a| a.to_string()).unwrap_or_default();
        let fields: Vec<Vec<u8>> = vec![
            b"gradsync-ring/2".to_vec(),
            role.as_bytes().to_vec(),
            connector.to_vec(),
            acceptor.to_vec(),
            (self.rank as u64).to_le_bytes().to_vec(),
            (self.world as u64).to_le_bytes().to_vec(),
            to.to_le_bytes().to_vec(),
            addr.into_bytes(),
            self.fingerprint.clone().into_bytes(),
        ];
        let mut m = Hmac::<Sha256>::new_from_slice(key.as_bytes()).unwrap();
        for f in fields {
            m.update(&(f.len() as u32).to_le_bytes());
            m.update(&f);
        }
        m.finalize().into_bytes().into()
    }
}

/// `v` as one JSON line.
pub fn line(v: &Value) -> Vec<u8> {
    let mut out = serde_json::to_vec(v).unwrap();
    out.push(b'\n');
    out
}

/// A 32-byte nonce parsed from a JSON array, if `v` holds one.
pub fn nonce_of(v: &Value) -> Option<[u8; 32]> {
    let bytes: Vec<u8> = v.as_array()?.iter().map(|b| b.as_u64().map(|b| b as u8)).collect::<Option<_>>()?;
    bytes.try_into().ok()
}

/// Read one line (without the newline); `None` at the end of the stream or on an error.
pub fn read_one(r: &mut impl BufRead) -> Option<String> {
    let mut l = String::new();
    match r.read_line(&mut l) {
        Ok(0) | Err(_) => None,
        Ok(_) => Some(l.trim_end().to_string()),
    }
}

/// Connect to `addr` now (so the connection queues in the listener's backlog in call order),
/// then speak the connector's side on a thread, proving with `key`. The thread returns every
/// line the acceptor sent (challenge, verdict) until it closed or stopped.
pub fn knock_as(addr: SocketAddr, claim: Claim, key: &str) -> JoinHandle<Vec<String>> {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let key = key.to_string();
    std::thread::spawn(move || {
        let mine = [7u8; 32];
        let _ = s.write_all(&claim.hello(&mine));
        let mut r = BufReader::new(s.try_clone().unwrap());
        let mut got = Vec::new();
        let Some(challenge) = read_one(&mut r) else { return got };
        got.push(challenge.clone());
        let theirs = serde_json::from_str::<Value>(&challenge).ok().and_then(|v| nonce_of(&v["nonce"]));
        if let Some(theirs) = theirs {
            let proof = claim.proof(&key, "connector", &mine, &theirs);
            let _ = s.write_all(&line(&json!({ "proof": proof.to_vec() })));
            // The verdict; a store that accepted keeps the connection until the ring forms.
            if let Some(v) = read_one(&mut r) {
                got.push(v);
            }
        }
        got
    })
}
