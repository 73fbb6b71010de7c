//! Slow, silent and greedy clients against a real `gradsync-server` process, over real
//! sockets: raw TCP, raw HTTP/2 frames, and the `h2` client sending what a gRPC client never
//! would (half requests, half messages). Every wait for a client's bytes must end within the
//! limit its flag sets (small here, so the tests are quick), and what incomplete pushes hold
//! must stay within `--push-buffer-mb`. And a slow client's cost to the others is named for
//! what it is: a push held for a worker that began late waited; one held for bytes already on
//! their way was part of the exchange.

use std::io::{Read, Write};
use std::net::TcpStream as StdTcp;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;
use gradsync_core::model::{Fingerprint, ModelSpec};
use gradsync_proto::pb::parameter_server_client::ParameterServerClient;
use gradsync_proto::pb::{GradientChunk, PullRequest, RegisterRequest};
use tonic::Code;

mod common;

use common::{Proc, spawn_server, start_server};

use gradsync_proto::path::{GET_VERSION as VERSION, PULL, PUSH, REGISTER};
const HEALTH: &str = "/grpc.health.v1.Health/Check";

/// A BSP server of the tiny model with `flags` added.
fn server(flags: &[&str]) -> (Proc, String) {
    let base = ["--listen", "127.0.0.1:0", "--model", "tiny", "--seed", "42"];
    let all: Vec<&std::ffi::OsStr> = base.iter().chain(flags).map(AsRef::as_ref).collect();
    start_server(&all)
}

/// An HTTP/2 connection to `addr` from the `h2` client; `closed` fires when the server ends it.
async fn h2_connect(addr: &str) -> (h2::client::SendRequest<Bytes>, tokio::sync::oneshot::Receiver<()>) {
    let tcp = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let (send, conn) = h2::client::handshake(tcp).await.expect("HTTP/2 handshake");
    let (tx, closed) = tokio::sync::oneshot::channel();
    tokio::spawn(async move {
        let _ = conn.await;
        let _ = tx.send(());
    });
    (send, closed)
}

/// Open a gRPC call to `path`, sending `body` and ending the request there if `end`.
async fn call(
    send: &mut h2::client::SendRequest<Bytes>,
    addr: &str,
    path: &str,
    body: impl Into<Bytes>,
    end: bool,
) -> (h2::client::ResponseFuture, h2::SendStream<Bytes>) {
    let body = body.into();
    let req = http::Request::post(format!("http://{addr}{path}"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(())
        .expect("request");
    let mut s = send.clone().ready().await.expect("ready");
    let (resp, mut stream) = s.send_request(req, body.is_empty() && end).expect("send_request");
    if !body.is_empty() {
        stream.send_data(body, end).expect("send_data");
    }
    (resp, stream)
}

/// The gRPC status a response carries, in its headers or its trailers.
async fn status(resp: h2::client::ResponseFuture) -> tonic::Status {
    let resp = resp.await.expect("a response");
    let (parts, mut body) = resp.into_parts();
    if let Some(s) = tonic::Status::from_header_map(&parts.headers) {
        return s;
    }
    while let Some(d) = body.data().await {
        let d = d.expect("body");
        let _ = body.flow_control().release_capacity(d.len());
    }
    let trailers = body.trailers().await.expect("trailers").expect("trailers present");
    tonic::Status::from_header_map(&trailers).expect("grpc-status in the trailers")
}

/// `status`, which must come within `limit`.
async fn status_within(resp: h2::client::ResponseFuture, limit: Duration, what: &str) -> tonic::Status {
    tokio::time::timeout(limit, status(resp))
        .await
        .unwrap_or_else(|_| panic!("{what}: no answer within {limit:?}"))
}

/// A gRPC message prefix declaring `len` bytes.
fn prefix(len: u32) -> Vec<u8> {
    let mut p = vec![0u8];
    p.extend_from_slice(&len.to_be_bytes());
    p
}

/// A push whose first message never completes is answered within the worker timeout:
/// headers only, 3 bytes, 200 bytes of a 17 KB message.
#[tokio::test]
async fn a_push_whose_first_message_never_completes_is_timed_out() {
    let (_server, addr) = server(&["--worker-timeout", "1"]);
    let (mut send, _closed) = h2_connect(&addr).await;
    let mut partial = prefix(17_000);
    partial.extend(std::iter::repeat_n(1u8, 195));
    let cases: [(&str, &[u8]); 3] =
        [("headers only", &[]), ("3 bytes", &[0, 0, 0]), ("200 of 17 KB", &partial)];
    let mut open = Vec::new();
    for (what, body) in cases {
        let (resp, stream) = call(&mut send, &addr, PUSH, body.to_vec(), false).await;
        open.push((what, resp, stream));
    }
    for (what, resp, _stream) in open {
        let s = status_within(resp, Duration::from_secs(10), what).await;
        assert_eq!(s.code(), Code::DeadlineExceeded, "{what}: {s:?}");
        assert!(s.message().contains("first gradient chunk"), "{what}: {s:?}");
    }
}

/// Register (and the other unary calls, health included) whose request never arrives in full
/// is answered within the worker timeout.
#[tokio::test]
async fn a_request_that_never_arrives_in_full_is_timed_out() {
    let (_server, addr) = server(&["--worker-timeout", "1"]);
    let (mut send, _closed) = h2_connect(&addr).await;
    let mut half = prefix(40);
    half.extend([0x0a, 0x02]);
    let cases: [(&str, &str, &[u8]); 4] = [
        ("Register, headers only", REGISTER, &[]),
        ("Register, half a message", REGISTER, &half),
        ("GetVersion, headers only", VERSION, &[]),
        ("health Check, headers only", HEALTH, &[]),
    ];
    let mut open = Vec::new();
    for (what, path, body) in cases {
        let (resp, stream) = call(&mut send, &addr, path, body.to_vec(), false).await;
        open.push((what, resp, stream));
    }
    for (what, resp, _stream) in open {
        let s = status_within(resp, Duration::from_secs(10), what).await;
        assert_eq!(s.code(), Code::DeadlineExceeded, "{what}: {s:?}");
        assert!(s.message().contains("did not arrive within 1 s"), "{what}: {s:?}");
    }
}

/// Whether the server closes `s` within `limit` (reading and dropping whatever it sends).
fn closed_within(s: &mut StdTcp, limit: Duration) -> bool {
    let t = Instant::now();
    let mut buf = [0u8; 4096];
    while t.elapsed() < limit {
        s.set_read_timeout(Some(limit.saturating_sub(t.elapsed()).max(Duration::from_millis(10))))
            .expect("read timeout");
        match s.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => {}
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {}
            Err(_) => return true,
        }
    }
    false
}

const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// An HTTP/2 frame.
fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let mut f = (payload.len() as u32).to_be_bytes()[1..].to_vec();
    f.extend([kind, flags]);
    f.extend(stream.to_be_bytes());
    f.extend_from_slice(payload);
    f
}

/// Connections that send nothing, half the HTTP/2 preface, or the whole preface and then
/// nothing, are closed after --handshake-timeout.
#[test]
fn silent_and_half_open_connections_are_closed() {
    let (_server, addr) = server(&["--handshake-timeout", "1"]);
    let mut silent = StdTcp::connect(&addr).expect("connect");
    let mut half = StdTcp::connect(&addr).expect("connect");
    half.write_all(&PREFACE[..10]).expect("write");
    let mut no_request = StdTcp::connect(&addr).expect("connect");
    no_request.write_all(PREFACE).expect("write");
    no_request.write_all(&frame(4, 0, 0, &[])).expect("write");
    for (what, s) in
        [("silent", &mut silent), ("half a preface", &mut half), ("preface, no request", &mut no_request)]
    {
        assert!(closed_within(s, Duration::from_secs(10)), "{what}: still open after 10 s");
    }
}

/// With every descriptor taken by connections that send nothing, the server still answers
/// a real client once the handshake limit has closed them.
#[tokio::test]
async fn silent_connections_cannot_starve_the_server_of_descriptors() {
    use std::os::unix::process::CommandExt;
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_gradsync-server"));
    cmd.args(["--listen", "127.0.0.1:0", "--model", "tiny", "--handshake-timeout", "1"])
        .stderr(Stdio::null());
    // SAFETY: setrlimit is async-signal-safe; it lowers only this child's limits (both, so
    // that the server cannot raise them).
    unsafe {
        cmd.pre_exec(|| {
            let l = libc::rlimit { rlim_cur: 64, rlim_max: 64 };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &l) == 0 {
                Ok(())
            } else {
                Err(std::io::Error::last_os_error())
            }
        });
    }
    let (_server, addr) = spawn_server(cmd);
    let silent: Vec<StdTcp> = (0..150).map(|_| StdTcp::connect(&addr).expect("connect")).collect();
    let t = Instant::now();
    let version = tokio::time::timeout(Duration::from_secs(20), async {
        let mut c = client(&addr).await;
        c.get_version(gradsync_proto::pb::VersionRequest {}).await
    })
    .await
    .expect("GetVersion answered within 20 s");
    assert_eq!(version.expect("GetVersion").into_inner().version, 0);
    eprintln!("answered after {:?} behind {} silent connections", t.elapsed(), silent.len());
}

/// A literal header field (RFC 7541, without indexing, new name, no Huffman).
fn literal(name: &str, value: &str) -> Vec<u8> {
    let mut h = vec![0u8, name.len() as u8];
    h.extend_from_slice(name.as_bytes());
    h.push(value.len() as u8);
    h.extend_from_slice(value.as_bytes());
    h
}

/// Read frames from `s` until `want` matches one (true) or `limit` passes (false).
fn frame_within(s: &mut StdTcp, limit: Duration, want: impl Fn(u8, u8, u32, &[u8]) -> bool) -> bool {
    let t = Instant::now();
    s.set_read_timeout(Some(Duration::from_millis(100))).expect("read timeout");
    let mut buf = Vec::new();
    let mut chunk = [0u8; 65536];
    while t.elapsed() < limit {
        match s.read(&mut chunk) {
            Ok(0) => return false,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {}
            Err(_) => return false,
        }
        while buf.len() >= 9 {
            let len = u32::from_be_bytes([0, buf[0], buf[1], buf[2]]) as usize;
            if buf.len() < 9 + len {
                break;
            }
            let (kind, flags) = (buf[3], buf[4]);
            let stream = u32::from_be_bytes([buf[5], buf[6], buf[7], buf[8]]) & 0x7fff_ffff;
            if kind == 4 && flags & 1 == 0 {
                // The server's SETTINGS: acknowledged, as a client must.
                s.write_all(&frame(4, 1, 0, &[])).expect("write");
            }
            if want(kind, flags, stream, &buf[9..9 + len]) {
                return true;
            }
            buf.drain(..9 + len);
        }
    }
    false
}

/// One connection may hold --max-streams requests open; the next is refused at once
/// (REFUSED_STREAM), not queued on the server.
#[test]
fn streams_beyond_the_cap_are_refused() {
    let (_server, addr) = server(&["--max-streams", "4", "--worker-timeout", "30"]);
    let mut s = StdTcp::connect(&addr).expect("connect");
    s.write_all(PREFACE).expect("write");
    s.write_all(&frame(4, 0, 0, &[])).expect("write");
    // The limit applies once the client has acknowledged the server's settings.
    assert!(frame_within(&mut s, Duration::from_secs(10), |kind, _, _, _| kind == 4), "no SETTINGS");
    let block: Vec<u8> = [
        literal(":method", "POST"),
        literal(":scheme", "http"),
        literal(":path", PUSH),
        literal(":authority", "localhost"),
        literal("content-type", "application/grpc"),
        literal("te", "trailers"),
    ]
    .concat();
    // Five pushes, headers only (END_HEADERS, not END_STREAM): streams 1, 3, 5, 7, 9.
    for id in [1u32, 3, 5, 7, 9] {
        s.write_all(&frame(1, 4, id, &block)).expect("write");
    }
    let refused = frame_within(&mut s, Duration::from_secs(5), |kind, _, stream, payload| {
        kind == 3 && stream == 9 && payload == 7u32.to_be_bytes()
    });
    assert!(refused, "the fifth stream on a connection allowing 4 was not refused");
}

/// A connection with no request open for --idle-timeout is closed, and one with a request
/// open is not, however long the request takes.
#[tokio::test]
async fn idle_connections_are_closed_and_busy_ones_kept() {
    let flags = ["--idle-timeout", "1", "--handshake-timeout", "30", "--worker-timeout", "3"];
    let (_server, addr) = server(&flags);
    let (mut send, mut closed) = h2_connect(&addr).await;
    // A streamed pull of the next version, which nobody pushes to: open for the worker timeout.
    let pull = gradsync_proto::frames::message(&PullRequest { rank: 0, stream_version: Some(1) });
    let t = Instant::now();
    let (resp, _stream) = call(&mut send, &addr, PULL, pull, true).await;
    let s = status_within(resp, Duration::from_secs(10), "streamed pull").await;
    assert_eq!(s.code(), Code::DeadlineExceeded, "{s:?}");
    assert!(t.elapsed() > Duration::from_secs(2), "the pull ended early: {s:?}");
    assert!(closed.try_recv().is_err(), "the connection was closed while a request was open");
    // Now idle: closed.
    let idle = tokio::time::timeout(Duration::from_secs(10), &mut closed).await;
    assert!(idle.is_ok(), "an idle connection was still open 10 s after --idle-timeout 1");
}

/// Incomplete pushes share --push-buffer-mb: past it a push is refused with
/// RESOURCE_EXHAUSTED; those within it are still served (here: timed out, as they never end).
#[tokio::test]
async fn incomplete_pushes_past_the_byte_cap_are_refused() {
    let (_server, addr) = server(&["--push-buffer-mb", "1", "--worker-timeout", "2"]);
    // Three pushes on three connections, each 600 KB into a 1 MiB message.
    let mut partial = prefix(1 << 20);
    partial.extend(std::iter::repeat_n(0u8, 600_000));
    let mut open = Vec::new();
    for _ in 0..3 {
        let (mut send, closed) = h2_connect(&addr).await;
        let (resp, stream) = call(&mut send, &addr, PUSH, partial.clone(), false).await;
        open.push((resp, stream, send, closed));
    }
    let mut codes = Vec::new();
    for (resp, ..) in open {
        let s = status_within(resp, Duration::from_secs(10), "partial push").await;
        codes.push((s.code(), s.message().to_string()));
    }
    let exhausted = codes.iter().filter(|(c, _)| *c == Code::ResourceExhausted).count();
    assert_eq!(exhausted, 2, "600 KB x 3 against a 1 MiB cap: {codes:?}");
    assert!(
        codes.iter().any(|(c, m)| *c == Code::ResourceExhausted && m.contains("--push-buffer-mb")),
        "{codes:?}"
    );
    assert!(codes.iter().any(|(c, _)| *c == Code::DeadlineExceeded), "{codes:?}");
}

/// The tiny model's fingerprint, as the server computes it.
fn fingerprint() -> String {
    Fingerprint::new(&ModelSpec::parse("tiny").expect("tiny"), 42).text
}

async fn client(addr: &str) -> ParameterServerClient<tonic::transport::Channel> {
    ParameterServerClient::connect(format!("http://{addr}")).await.expect("connect")
}

/// When rank 1's gradient is refused for NaN, rank 0's failed step says so, rather than that
/// rank 1 sent nothing.
#[tokio::test]
async fn a_step_failed_by_a_nan_refusal_says_so() {
    let (_server, addr) = server(&["--worker-timeout", "1"]);
    let mut c = client(&addr).await;
    let mut len = 0;
    for rank in [0, 1] {
        let r = c
            .register(RegisterRequest {
                rank,
                world_size: 2,
                fingerprint: fingerprint(),
                ..RegisterRequest::default()
            })
            .await;
        let r = r.expect("register").into_inner();
        len = (r.end - r.start) as usize;
    }
    let push = |rank: u32, v: f32| {
        let data = gradsync_proto::wire::encode(&vec![v; len], bytes::BytesMut::new());
        tokio_stream::iter(vec![GradientChunk {
            rank,
            base_version: 0,
            offset: 0,
            data,
            ..GradientChunk::default()
        }])
    };
    let refused = c.push_gradients(push(1, f32::NAN)).await.expect_err("a NaN gradient was taken");
    assert_eq!(refused.code(), Code::InvalidArgument, "{refused:?}");
    let failed = c.push_gradients(push(0, 0.5)).await.expect_err("the step completed without rank 1");
    assert_eq!(failed.code(), Code::Aborted, "{failed:?}");
    let m = failed.message();
    assert!(m.contains("rank(s) [1] sent a gradient refused for NaN or Inf"), "{m}");
    assert!(!m.contains("sent nothing"), "{m}");
}

/// A registration's fingerprint is quoted in the refusal cut short, never whole.
#[tokio::test]
async fn a_wrong_fingerprint_is_not_echoed_whole() {
    let (_server, addr) = server(&[]);
    let mut c = client(&addr).await;
    let long = "x".repeat(200_000);
    let r = c
        .register(RegisterRequest { rank: 0, world_size: 1, fingerprint: long, ..RegisterRequest::default() })
        .await;
    let s = r.expect_err("a wrong fingerprint was accepted");
    assert_eq!(s.code(), Code::FailedPrecondition, "{s:?}");
    assert!(s.message().len() < 512, "{} bytes of error", s.message().len());
    assert!(s.message().contains("(200000 bytes)"), "{}", s.message());
}

/// A streamed pull of a version nobody pushes to ends after the worker timeout (not twice
/// it).
#[tokio::test]
async fn a_streamed_pull_nobody_pushes_to_ends_after_the_worker_timeout() {
    let (_server, addr) = server(&["--worker-timeout", "2"]);
    let mut c = client(&addr).await;
    let t = Instant::now();
    let mut stream = c
        .pull_parameters(PullRequest { rank: 0, stream_version: Some(1) })
        .await
        .expect("the pull starts")
        .into_inner();
    let end = match stream.message().await {
        Ok(Some(_)) => panic!("a block of a step nobody pushed to"),
        Ok(None) => panic!("the pull ended without an error"),
        Err(s) => s,
    };
    let took = t.elapsed();
    assert_eq!(end.code(), Code::DeadlineExceeded, "{end:?}");
    // 2 s, with room for a busy machine; twice the timeout would be 4 s.
    assert!(took >= Duration::from_secs(2) && took < Duration::from_millis(3500), "ended after {took:?}");
}

/// The open-file limit is raised to the hard limit at start, and the figure printed.
#[test]
fn the_open_file_limit_is_raised_and_logged() {
    use std::io::{BufRead, BufReader};
    use std::os::unix::process::CommandExt;
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: a valid rlimit for getrlimit to fill.
    assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) }, 0);
    let (soft, hard) = (256.min(lim.rlim_max), lim.rlim_max);
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_gradsync-server"));
    cmd.args(["--listen", "127.0.0.1:0", "--model", "tiny"]).stderr(Stdio::piped());
    // SAFETY: setrlimit is async-signal-safe, and only lowers this child's soft limit.
    unsafe {
        cmd.pre_exec(move || {
            let l = libc::rlimit { rlim_cur: soft, rlim_max: hard };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &l) == 0 {
                Ok(())
            } else {
                Err(std::io::Error::last_os_error())
            }
        });
    }
    let mut child = cmd.stdout(Stdio::piped()).spawn().expect("spawning gradsync-server");
    let stderr = child.stderr.take().expect("stderr");
    let proc = Proc::adopt(child);
    let mut line = String::new();
    BufReader::new(stderr).read_line(&mut line).expect("a line on stderr");
    drop(proc);
    let want = if soft == hard {
        format!("gradsync-server: open-file limit {hard}")
    } else {
        format!("gradsync-server: open-file limit {hard} (raised from {soft})")
    };
    assert_eq!(line.trim(), want);
}

/// A field of /proc/PID/status, KiB.
fn proc_kib(pid: u32, field: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("reading /proc/PID/status");
    status
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("the field in /proc/PID/status")
}

/// Figures for docs/security.md: the server's resident memory while CONNS connections x
/// STREAMS pushes each hold a message 100 bytes short of 4 MiB. `GRADSYNC_MEM=CONNS:STREAMS:MB`
/// sets them and --push-buffer-mb (default 200:4:256):
/// `cargo test -p gradsync-server --test limits -- --ignored --nocapture memory`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "prints figures for the docs; moves a few GB over loopback"]
async fn memory_while_partial_pushes_are_held() {
    let spec = std::env::var("GRADSYNC_MEM").unwrap_or_else(|_| "200:4:256".into());
    let v: Vec<usize> = spec.split(':').map(|x| x.parse().expect("GRADSYNC_MEM=CONNS:STREAMS:MB")).collect();
    let (conns, streams, cap) = (v[0], v[1], v[2]);
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_gradsync-server"));
    cmd.args(["--listen", "127.0.0.1:0", "--model", "tiny", "--worker-timeout", "60"])
        .args(["--push-buffer-mb", &cap.to_string()])
        .stderr(Stdio::null());
    let (server, addr) = spawn_server(cmd);
    let pid = server.id();
    let before = proc_kib(pid, "VmRSS:");
    let len = 4usize << 20;
    let mut body = prefix(len as u32);
    body.extend(std::iter::repeat_n(0u8, len - 100));
    let body = Bytes::from(body);
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let (mut keep, mut senders, mut tasks) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..conns {
        let (mut send, closed) = h2_connect(&addr).await;
        for _ in 0..streams {
            let (resp, stream) = call(&mut send, &addr, PUSH, body.clone(), false).await;
            let tx = tx.clone();
            tasks.push(tokio::spawn(async move {
                let _ = tx.send(status(resp).await.code());
            }));
            keep.push(stream);
        }
        senders.push((send, closed));
    }
    // Every push past the cap is answered; those within it wait for their message's end.
    let total = conns * streams;
    let held_max = (cap << 20) / (len - 100 + 5);
    let mut refused = 0;
    let t = Instant::now();
    while refused < total.saturating_sub(held_max) && t.elapsed() < Duration::from_secs(120) {
        match tokio::time::timeout(Duration::from_secs(5), rx.recv()).await {
            Ok(Some(Code::ResourceExhausted)) => refused += 1,
            Ok(Some(c)) => panic!("a held push answered {c:?}"),
            _ => break,
        }
    }
    // Let the last frames land before reading the figures.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let (rss, peak) = (proc_kib(pid, "VmRSS:"), proc_kib(pid, "VmHWM:"));
    eprintln!(
        "{conns} connections x {streams} pushes of 4 MiB - 100 bytes, --push-buffer-mb {cap}: \
         {refused} refused (RESOURCE_EXHAUSTED), {} held; server RSS {} MiB before, {} MiB holding them, peak {} MiB",
        total - refused,
        before / 1024,
        rss / 1024,
        peak / 1024
    );
    // The held pushes' answers are not waited for.
    for t in tasks {
        t.abort();
    }
    drop((keep, senders));
}

/// A BSP push held for bytes already on their way is not waiting (a colocated server's own
/// worker holds its shard whole at once, then for every other worker's bytes through its host's
/// link); one held for a worker that began its push later is.
#[tokio::test]
async fn a_round_counts_as_waiting_only_the_hold_for_pushes_that_began_later() {
    use tokio::sync::mpsc;
    use tokio_stream::wrappers::ReceiverStream;
    let (_server, addr) = server(&["--worker-timeout", "10"]);
    let mut len = 0;
    for rank in [0, 1] {
        let r = client(&addr)
            .await
            .register(RegisterRequest {
                rank,
                world_size: 2,
                fingerprint: fingerprint(),
                ..RegisterRequest::default()
            })
            .await;
        let r = r.expect("register").into_inner();
        len = (r.end - r.start) as usize;
    }
    let chunk = |rank: u32, base: u64, from: usize, to: usize| GradientChunk {
        rank,
        base_version: base,
        offset: from as u64,
        data: gradsync_proto::wire::encode(&vec![0.25; to - from], bytes::BytesMut::new()),
        ..GradientChunk::default()
    };
    let hold = Duration::from_millis(400);
    // Push `rank`'s gradient from `base` in two chunks: the first after `before`, the second
    // `between` after it; returns the reply's wait_ms.
    let push = |rank: u32, base: u64, before: Duration, between: Duration| {
        let addr = addr.clone();
        tokio::spawn(async move {
            let (tx, rx) = mpsc::channel(2);
            let mut c = client(&addr).await;
            let sender = tokio::spawn(async move {
                tokio::time::sleep(before).await;
                tx.send(chunk(rank, base, 0, len / 2)).await.expect("first chunk");
                tokio::time::sleep(between).await;
                tx.send(chunk(rank, base, len / 2, len)).await.expect("second chunk");
            });
            let reply = c.push_gradients(ReceiverStream::new(rx)).await.expect("push").into_inner();
            sender.await.expect("sender");
            reply.wait_ms
        })
    };
    // Both begin at once; rank 1's bytes take `hold` to arrive. Rank 0's push is whole at once
    // and held until rank 1's is: the exchange, not a straggler.
    let zero = Duration::ZERO;
    let (a, b) = (push(0, 0, zero, zero), push(1, 0, zero, hold));
    let (a, b) = (a.await.expect("rank 0"), b.await.expect("rank 1"));
    assert!(a < 150.0, "rank 0 was held {a:.1} ms for bytes on their way, counted as waiting");
    assert!(b < 150.0, "rank 1, the last to arrive, waited {b:.1} ms");
    // Rank 1 begins `hold` late: rank 0 waited for it.
    let (a, b) = (push(0, 1, zero, zero), push(1, 1, hold, zero));
    let (a, b) = (a.await.expect("rank 0"), b.await.expect("rank 1"));
    assert!(a >= 350.0, "rank 0 waited {a:.1} ms for a push that began 400 ms after its own");
    assert!(b < 150.0, "rank 1, the straggler, waited {b:.1} ms");
}
