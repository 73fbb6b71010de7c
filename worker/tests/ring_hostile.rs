//! Hostile clients against the rendezvous store and a rank's ring listener: garbage bytes, a
//! line far over the handshake limit, strangers' handshakes (wrong token, wrong world size,
//! wrong model, wrong addressee). Each is refused; the ring then forms from the real ranks and
//! computes exactly what a serial sum computes.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::Duration;

use gradsync_worker::collective::tcp::MeshInfo;
use gradsync_worker::collective::{Collective, Hierarchy, RingConfig, TcpComm, Transport};
use gradsync_worker::rendezvous::{RendezvousConfig, join_with_store};

mod ring_client;

use ring_client::{Claim, knock_as, line, nonce_of, read_one};

const TOKEN: &str = "ring-secret";
const FP: &str = "mlp:4-8-2:f32:seed=1";

fn claim(rank: usize, world: usize, fp: &str, to: Option<usize>, addr: Option<SocketAddr>) -> Claim {
    Claim { rank, world, fingerprint: fp.into(), to, addr }
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
    // They wait in the store's backlog, ahead of every real rank.
    let raw = vec![
        ("garbage", knock(master, &[0xff; 3000])),
        ("oversized line", knock(master, &vec![b'{'; 200 << 10])),
    ];
    let speakers = vec![
        ("wrong token", knock_as(master, claim(1, world, FP, None, Some(dummy)), "guess")),
        ("absurd world", knock_as(master, claim(1, usize::MAX, FP, None, Some(dummy)), TOKEN)),
        ("rank not below world", knock_as(master, claim(7, world, FP, None, Some(dummy)), TOKEN)),
        ("other model", knock_as(master, claim(1, world, "mlp:1-1:f32:seed=0", None, Some(dummy)), TOKEN)),
        ("no ring address", knock_as(master, claim(1, world, FP, None, None), TOKEN)),
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
        generation: 0,
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
    for (name, s) in raw {
        let got = answer(s);
        assert!(got == "closed" || got.starts_with("error"), "{name} was answered: {got:?}");
    }
    let expect =
        ["wrong ring token", "world size", "not below the world size", "fingerprint", "no ring address"];
    for ((name, h), want) in speakers.into_iter().zip(expect) {
        let got = h.join().unwrap();
        let last = got.last().cloned().unwrap_or_default();
        assert!(last.contains(want), "{name}: expected {want:?}, got {got:?}");
        assert!(
            got.iter().all(|l| !l.contains("\"addrs\":[\"")),
            "{name} was told the ring's addresses: {got:?}"
        );
    }
}

#[test]
fn a_rank_refuses_hostile_handshakes_and_the_ring_still_computes() {
    let world = 2;
    let ls: Vec<TcpListener> = (0..world).map(|_| TcpListener::bind("127.0.0.1:0").unwrap()).collect();
    let addrs: Vec<SocketAddr> = ls.iter().map(|l| l.local_addr().unwrap()).collect();
    let raw = vec![
        ("garbage", knock(addrs[0], b"\x00\x01\x02 not json at all\n")),
        ("oversized line", knock(addrs[0], &vec![b'x'; 100 << 10])),
        ("frame header for a handshake", knock(addrs[0], &[1, 0, 0, 0, 0xff, 0xff, 0xff, 0xff, b'\n'])),
        (
            "the first protocol's hashed token",
            knock(
                addrs[0],
                b"{\"magic\":\"gradsync-ring/1\",\"rank\":1,\"world\":2,\"fingerprint\":\"x\",\"token\":1,\"to\":0}\n",
            ),
        ),
    ];
    let speakers = vec![
        ("wrong token", knock_as(addrs[0], claim(1, world, FP, Some(0), None), "guess")),
        ("empty token", knock_as(addrs[0], claim(1, world, FP, Some(0), None), "")),
        ("wrong world", knock_as(addrs[0], claim(1, 64, FP, Some(0), None), TOKEN)),
        ("other model", knock_as(addrs[0], claim(1, world, "x", Some(0), None), TOKEN)),
        ("wrong addressee", knock_as(addrs[0], claim(1, world, FP, Some(5), None), TOKEN)),
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
    for (name, s) in raw {
        let got = answer(s);
        if name.contains("first protocol") {
            // It spoke JSON, so it is told why: another protocol version.
            assert!(got.contains("gradsync-ring/2"), "{name}: {got:?}");
        } else {
            // Refused without an answer: the rank dropped the connection (EOF or a reset).
            assert!(got == "closed" || got.starts_with("error"), "{name} was answered: {got:?}");
        }
    }
    let expect = ["wrong ring token", "wrong ring token", "world size", "fingerprint", "meant to reach"];
    for ((name, h), want) in speakers.into_iter().zip(expect) {
        let got = h.join().unwrap();
        let last = got.last().cloned().unwrap_or_default();
        assert!(last.contains(want), "{name}: expected {want:?}, got {got:?}");
        assert!(got.iter().all(|l| !l.contains("\"proof\":[")), "{name} was given the rank's proof: {got:?}");
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
        // The hand-written peer speaks no set-up lines: sockets only, one flat ring.
        hierarchy: Hierarchy::Off,
        host_id: None,
        ..RingConfig::default()
    };
    let peer = std::thread::spawn(move || {
        let mut s = TcpStream::connect(addrs[0]).unwrap();
        let me = claim(1, 2, FP, Some(0), None);
        let mine = [3u8; 32];
        s.write_all(&me.hello(&mine)).unwrap();
        let mut r = BufReader::new(s.try_clone().unwrap());
        let challenge: serde_json::Value = serde_json::from_str(&read_one(&mut r).unwrap()).unwrap();
        let theirs = nonce_of(&challenge["nonce"]).unwrap();
        s.write_all(&line(
            &serde_json::json!({ "proof": me.proof(TOKEN, "connector", &mine, &theirs).to_vec() }),
        ))
        .unwrap();
        let welcome: serde_json::Value = serde_json::from_str(&read_one(&mut r).unwrap()).unwrap();
        assert!(welcome["refused"].is_null(), "{welcome}");
        // The rank's own proof is the one the protocol's description gives.
        let want = me.proof(TOKEN, "acceptor", &mine, &theirs);
        assert_eq!(nonce_of(&welcome["proof"]), Some(want), "{welcome}");
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

/// Forward one connection accepted on `front` to `back`, both ways, recording what each side
/// sent: what an eavesdropper on the path sees. Returns (client's bytes, server's bytes).
fn sniff(front: TcpListener, back: SocketAddr) -> std::thread::JoinHandle<(Vec<u8>, Vec<u8>)> {
    std::thread::spawn(move || {
        let (client, _) = front.accept().unwrap();
        let server = TcpStream::connect(back).unwrap();
        let pipe = |mut from: TcpStream, mut to: TcpStream| {
            std::thread::spawn(move || {
                let mut seen = Vec::new();
                let mut buf = [0u8; 4096];
                while let Ok(n @ 1..) = from.read(&mut buf) {
                    seen.extend_from_slice(&buf[..n]);
                    if to.write_all(&buf[..n]).is_err() {
                        break;
                    }
                }
                let _ = to.shutdown(std::net::Shutdown::Write);
                seen
            })
        };
        let up = pipe(client.try_clone().unwrap(), server.try_clone().unwrap());
        let down = pipe(server, client);
        (up.join().unwrap(), down.join().unwrap())
    })
}

/// The first `n` lines of `bytes`, each with its newline.
fn lines(bytes: &[u8], n: usize) -> Vec<Vec<u8>> {
    bytes.split_inclusive(|&b| b == b'\n').take(n).map(<[u8]>::to_vec).collect()
}

#[test]
fn a_recorded_handshake_replayed_on_a_new_connection_is_refused() {
    // 1. A real ring of two whose handshake passes through an eavesdropper.
    let l0 = TcpListener::bind("127.0.0.1:0").unwrap();
    let l1 = TcpListener::bind("127.0.0.1:0").unwrap();
    let front = TcpListener::bind("127.0.0.1:0").unwrap();
    let (a0, a1, via) = (l0.local_addr().unwrap(), l1.local_addr().unwrap(), front.local_addr().unwrap());
    let tap = sniff(front, a0);
    let info = |rank, addrs: Vec<SocketAddr>| MeshInfo {
        rank,
        addrs,
        fingerprint: FP.into(),
        token: Some(TOKEN.into()),
    };
    let ring = RingConfig {
        timeout: Duration::from_secs(20),
        chunk_bytes: 256,
        socket_buffer: None,
        transport: Transport::Tcp,
        // The hand-written peer speaks no set-up lines: sockets only, one flat ring.
        hierarchy: Hierarchy::Off,
        host_id: None,
        ..RingConfig::default()
    };
    let sums: Vec<f32> = std::thread::scope(|s| {
        let r0 = s.spawn(|| TcpComm::connect(l0, &info(0, vec![a0, a1]), ring.clone()).unwrap());
        // Rank 1 reaches rank 0 through the tap.
        let r1 = s.spawn(|| TcpComm::connect(l1, &info(1, vec![via, a1]), ring.clone()).unwrap());
        let comms = [r0.join().unwrap(), r1.join().unwrap()];
        comms
            .into_iter()
            .enumerate()
            .map(|(r, mut c)| {
                s.spawn(move || {
                    let mut b = [r as f32 + 1.0];
                    c.all_reduce(&mut b).unwrap();
                    b[0]
                })
            })
            .collect::<Vec<_>>()
            .into_iter()
            .map(|h| h.join().unwrap())
            .collect()
    });
    assert_eq!(sums, vec![3.0, 3.0]);
    let (up, down) = tap.join().unwrap();
    let (hello_answer, challenge_welcome) = (lines(&up, 2), lines(&down, 2));
    assert_eq!(hello_answer.len(), 2, "the tap saw {}", String::from_utf8_lossy(&up));
    assert!(String::from_utf8_lossy(&challenge_welcome[1]).contains("\"proof\":["));

    // 2. The eavesdropper replays rank 1's hello and proof to rank 0 of a new run with the same
    //    token and addresses: the fresh challenge makes the old proof worthless.
    let l0 = TcpListener::bind("127.0.0.1:0").unwrap();
    let l1 = TcpListener::bind("127.0.0.1:0").unwrap();
    let (a0, a1) = (l0.local_addr().unwrap(), l1.local_addr().unwrap());
    let mut replay = TcpStream::connect(a0).unwrap();
    replay.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let replayer = std::thread::spawn(move || {
        replay.write_all(&hello_answer[0]).unwrap();
        let mut r = BufReader::new(replay.try_clone().unwrap());
        let challenge = read_one(&mut r).unwrap();
        replay.write_all(&hello_answer[1]).unwrap();
        (challenge, read_one(&mut r))
    });
    // 3. A fake rank 0 replays the recorded challenge and welcome (with rank 0's old proof) to a
    //    real rank 1 of that new run, which must refuse it.
    let fake = TcpListener::bind("127.0.0.1:0").unwrap();
    let fake_addr = fake.local_addr().unwrap();
    let impostor = std::thread::spawn(move || {
        let (mut s, _) = fake.accept().unwrap();
        let mut r = BufReader::new(s.try_clone().unwrap());
        let _hello = read_one(&mut r).unwrap();
        s.write_all(&challenge_welcome[0]).unwrap();
        let _answer = read_one(&mut r).unwrap();
        s.write_all(&challenge_welcome[1]).unwrap();
    });
    let fooled = TcpComm::connect(
        TcpListener::bind("127.0.0.1:0").unwrap(),
        &info(1, vec![fake_addr, a1]),
        ring.clone(),
    );
    let e = fooled.unwrap_err().to_string();
    assert!(e.contains(&format!("rank 0 at {fake_addr}")) && e.contains("without proving"), "{e}");
    impostor.join().unwrap();

    // The real rank 1 still joins the new run, after the replayed connection was refused.
    let sums: Vec<f32> = std::thread::scope(|s| {
        let hs = [(0, l0, ring.clone()), (1, l1, ring.clone())].map(|(r, l, ring)| {
            let info = info(r, vec![a0, a1]);
            s.spawn(move || {
                let mut c = TcpComm::connect(l, &info, ring).unwrap();
                let mut b = [r as f32 + 1.0];
                c.all_reduce(&mut b).unwrap();
                b[0]
            })
        });
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(sums, vec![3.0, 3.0]);
    let (challenge, verdict) = replayer.join().unwrap();
    assert!(challenge.contains("\"nonce\":["), "{challenge}");
    let verdict = verdict.unwrap_or_default();
    assert!(verdict.contains("wrong ring token") && verdict.contains("replayed"), "{verdict}");
}
