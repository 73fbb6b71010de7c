//! Hostile clients against the rendezvous store and a rank's ring listener: garbage bytes, a
//! line far over the handshake limit, strangers' handshakes (wrong token, wrong world size,
//! wrong model, wrong addressee). Each is refused; the ring then forms from the real ranks and
//! computes exactly what a serial sum computes.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::Duration;

use gradsync_worker::collective::tcp::MeshInfo;
use gradsync_worker::collective::{Collective, RingConfig, TcpComm, Transport};
use gradsync_worker::rendezvous::{RendezvousConfig, join_with_store};

const TOKEN: &str = "ring-secret";
const FP: &str = "mlp:4-8-2:f32:seed=1";

/// FNV-1a of `s`, as a peer that knows the token would send it (computed here independently).
fn fnv(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ b as u64).wrapping_mul(0x0100_0000_01b3))
}

fn hello(
    rank: usize,
    world: usize,
    fp: &str,
    token: u64,
    to: Option<usize>,
    addr: Option<SocketAddr>,
) -> Vec<u8> {
    let mut v = serde_json::to_vec(&serde_json::json!({
        "magic": "gradsync-ring/1", "rank": rank, "world": world, "fingerprint": fp,
        "token": token, "to": to, "addr": addr,
    }))
    .unwrap();
    v.push(b'\n');
    v
}

/// Open a connection to `addr` and send `bytes` (the peer may close early: errors ignored).
fn knock(addr: SocketAddr, bytes: &[u8]) -> TcpStream {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let _ = s.write_all(bytes);
    // Done talking: a silent open connection would only cost the store its read timeout.
    let _ = s.shutdown(std::net::Shutdown::Write);
    s
}

/// The first line the peer answered, or what ended the connection.
fn answer(s: TcpStream) -> String {
    let mut line = String::new();
    match BufReader::new(s).read_line(&mut line) {
        Ok(0) => "closed".into(),
        Ok(_) => line,
        Err(e) => format!("error: {e}"),
    }
}

fn serial_sum(world: usize, n: usize) -> Vec<f32> {
    (0..n).map(|i| (0..world).map(|r| (r * n + i) as f32 * 0.25).sum()).collect()
}

#[test]
fn the_store_refuses_hostile_clients_and_the_ring_still_computes() {
    let world = 3;
    let store = TcpListener::bind("127.0.0.1:0").unwrap();
    let master = store.local_addr().unwrap();
    let dummy: SocketAddr = "127.0.0.1:9".parse().unwrap();
    let right = fnv(TOKEN);
    // They wait in the store's backlog, ahead of every real rank.
    let strangers = vec![
        ("garbage", knock(master, &[0xff; 3000])),
        ("oversized line", knock(master, &vec![b'{'; 200 << 10])),
        ("wrong token", knock(master, &hello(1, world, FP, fnv("guess"), None, Some(dummy)))),
        ("absurd world", knock(master, &hello(1, usize::MAX, FP, right, None, Some(dummy)))),
        ("rank not below world", knock(master, &hello(7, world, FP, right, None, Some(dummy)))),
        ("other model", knock(master, &hello(1, world, "mlp:1-1:f32:seed=0", right, None, Some(dummy)))),
        ("no ring address", knock(master, &hello(1, world, FP, right, None, None))),
    ];
    let n = 1000;
    let rc = |rank| RendezvousConfig {
        master: master.to_string(),
        rank,
        world,
        fingerprint: FP.into(),
        token: Some(TOKEN.into()),
        timeout: Duration::from_secs(30),
        nccl: false,
    };
    let ring = RingConfig {
        timeout: Duration::from_secs(30),
        chunk_bytes: 256,
        socket_buffer: None,
        ..RingConfig::default()
    };
    let mut store = Some(store);
    let outs: Vec<Vec<f32>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..world)
            .map(|r| {
                let (rc, ring) = (rc(r), ring.clone());
                let store = if r == 0 { store.take() } else { None };
                s.spawn(move || {
                    let j = join_with_store(&rc, store).unwrap();
                    let mut c = TcpComm::connect(j.listener, &j.mesh, ring).unwrap();
                    let mut b: Vec<f32> = (0..n).map(|i| (r * n + i) as f32 * 0.25).collect();
                    c.all_reduce(&mut b).unwrap();
                    b
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let want = serial_sum(world, n);
    for (r, o) in outs.iter().enumerate() {
        assert_eq!(o, &want, "rank {r} computed another sum");
    }
    let expect = [
        ("garbage", "closed"),
        ("oversized line", "closed"),
        ("wrong token", "wrong ring token"),
        ("absurd world", "world size"),
        ("rank not below world", "not below the world size"),
        ("other model", "fingerprint"),
        ("no ring address", "no ring address"),
    ];
    for ((name, s), (ename, want)) in strangers.into_iter().zip(expect) {
        assert_eq!(name, ename);
        let got = answer(s);
        assert!(
            got.contains(want) || (want == "closed" && got.starts_with("error")),
            "{name}: expected {want:?}, got {got:?}"
        );
        assert!(!got.contains("\"addrs\":[\""), "{name} was told the ring's addresses: {got}");
    }
}

#[test]
fn a_rank_refuses_hostile_handshakes_and_the_ring_still_computes() {
    let world = 2;
    let ls: Vec<TcpListener> = (0..world).map(|_| TcpListener::bind("127.0.0.1:0").unwrap()).collect();
    let addrs: Vec<SocketAddr> = ls.iter().map(|l| l.local_addr().unwrap()).collect();
    let right = fnv(TOKEN);
    let strangers = vec![
        ("garbage", knock(addrs[0], b"\x00\x01\x02 not json at all\n")),
        ("oversized line", knock(addrs[0], &vec![b'x'; 100 << 10])),
        ("frame header for a handshake", knock(addrs[0], &[1, 0, 0, 0, 0xff, 0xff, 0xff, 0xff, b'\n'])),
        ("wrong token", knock(addrs[0], &hello(1, world, FP, 0, Some(0), None))),
        ("wrong world", knock(addrs[0], &hello(1, 64, FP, right, Some(0), None))),
        ("other model", knock(addrs[0], &hello(1, world, "x", right, Some(0), None))),
        ("wrong addressee", knock(addrs[0], &hello(1, world, FP, right, Some(5), None))),
    ];
    let info =
        |rank| MeshInfo { rank, addrs: addrs.clone(), fingerprint: FP.into(), token: Some(TOKEN.into()) };
    let ring = RingConfig {
        timeout: Duration::from_secs(30),
        chunk_bytes: 256,
        socket_buffer: None,
        ..RingConfig::default()
    };
    let n = 777;
    let outs: Vec<Vec<f32>> = std::thread::scope(|s| {
        let hs: Vec<_> = ls
            .into_iter()
            .enumerate()
            .map(|(r, l)| {
                let (info, ring) = (info(r), ring.clone());
                s.spawn(move || {
                    let mut c = TcpComm::connect(l, &info, ring).unwrap();
                    let mut b: Vec<f32> = (0..n).map(|i| (r * n + i) as f32 * 0.25).collect();
                    c.all_reduce(&mut b).unwrap();
                    b
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let want = serial_sum(world, n);
    assert!(outs.iter().all(|o| o == &want), "the ring computed another sum");
    let expect =
        ["closed", "closed", "closed", "wrong ring token", "world size", "fingerprint", "meant to reach"];
    for ((name, mut s), want) in strangers.into_iter().zip(expect) {
        if want == "closed" {
            // Refused without an answer: the rank dropped the connection.
            // Refused without an answer: the rank dropped the connection (EOF or a reset).
            let mut rest = Vec::new();
            if s.read_to_end(&mut rest).is_ok() {
                assert!(rest.is_empty(), "{name} was answered: {}", String::from_utf8_lossy(&rest));
            }
        } else {
            let got = answer(s);
            assert!(got.contains(want), "{name}: expected {want:?}, got {got:?}");
        }
    }
}

#[test]
fn an_oversized_frame_header_is_refused_without_allocating() {
    // A peer that passes the handshake (it knows the token) then announces 2^32-1 values.
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let fake = TcpListener::bind("127.0.0.1:0").unwrap();
    let addrs = vec![l.local_addr().unwrap(), fake.local_addr().unwrap()];
    let info = MeshInfo { rank: 0, addrs: addrs.clone(), fingerprint: FP.into(), token: Some(TOKEN.into()) };
    // The fake peer speaks frames right after the handshake: no transport set-up.
    let ring = RingConfig {
        timeout: Duration::from_secs(20),
        chunk_bytes: 256,
        socket_buffer: None,
        transport: Transport::Tcp,
    };
    let peer = std::thread::spawn(move || {
        let mut s = TcpStream::connect(addrs[0]).unwrap();
        s.write_all(&hello(1, 2, FP, fnv(TOKEN), Some(0), None)).unwrap();
        let mut r = BufReader::new(s.try_clone().unwrap());
        let mut welcome = String::new();
        r.read_line(&mut welcome).unwrap();
        assert!(welcome.contains("\"refused\":null"), "{welcome}");
        for tag in 1u32..=9 {
            let _ = s.write_all(&tag.to_le_bytes());
            let _ = s.write_all(&u32::MAX.to_le_bytes());
        }
        let mut rest = Vec::new();
        let _ = r.read_to_end(&mut rest);
    });
    let mut c = TcpComm::connect(l, &info, ring).unwrap();
    let mut b = vec![1.0f32; 4096];
    let e = c.all_reduce(&mut b).unwrap_err().to_string();
    assert!(e.contains("rank 1") && (e.contains("4294967295") || e.contains("frame")), "{e}");
    drop(c);
    peer.join().unwrap();
}
