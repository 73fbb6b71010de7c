//! TLS end to end against a real `gradsync-server` process, with self-signed certificates
//! made here (rcgen): a client trusting the right CA is served, a plaintext client and a
//! client trusting another CA are refused, and bad certificate files are refused at start
//! with an error naming the file.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use gradsync_proto::pb::VersionRequest;
use gradsync_proto::pb::parameter_server_client::ParameterServerClient;
use tonic::transport::Endpoint;

const SERVER: &str = env!("CARGO_BIN_EXE_gradsync-server");

mod common;

use common::start_server;

fn dir(name: &str) -> PathBuf {
    let d = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("tls-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).expect("temp dir");
    d
}

/// A self-signed certificate for localhost: (cert path, key path).
fn self_signed(d: &Path, name: &str) -> (PathBuf, PathBuf) {
    let ck = rcgen::generate_simple_self_signed(vec!["localhost".into()]).expect("rcgen");
    let (cert, key) = (d.join(format!("{name}.crt")), d.join(format!("{name}.key")));
    std::fs::write(&cert, ck.cert.pem()).expect("write cert");
    std::fs::write(&key, ck.key_pair.serialize_pem()).expect("write key");
    (cert, key)
}

fn start(tls: &[&Path]) -> (common::Proc, String) {
    let mut args: Vec<&std::ffi::OsStr> =
        ["--listen", "127.0.0.1:0", "--model", "tiny"].map(AsRef::as_ref).to_vec();
    if let [cert, key] = tls {
        args.extend(["--tls-cert".as_ref(), cert.as_os_str(), "--tls-key".as_ref(), key.as_os_str()]);
    }
    start_server(&args)
}

/// GetVersion over `uri`, with `ca` trusted when given. The error text if it fails.
async fn get_version(uri: &str, ca: Option<&Path>) -> Result<u64, String> {
    let mut ep = Endpoint::from_shared(uri.to_string()).map_err(|e| e.to_string())?;
    ep = ep.connect_timeout(Duration::from_secs(10)).timeout(Duration::from_secs(10));
    if let Some(ca) = ca {
        let tls = gradsync_proto::tls::client(ca, Some("localhost")).map_err(|e| e.to_string())?;
        ep = ep.tls_config(tls).map_err(|e| gradsync_proto::tls::tls_why(&e))?;
    }
    let ch = ep.connect().await.map_err(|e| gradsync_proto::tls::tls_why(&e))?;
    let mut c = ParameterServerClient::new(ch);
    let r = c.get_version(VersionRequest {}).await.map_err(|s| format!("{:?}: {}", s.code(), s.message()))?;
    Ok(r.into_inner().version)
}

#[tokio::test]
async fn tls_serves_the_right_ca_and_refuses_others() {
    let d = dir("serve");
    let (cert, key) = self_signed(&d, "server");
    let (other, _) = self_signed(&d, "other");
    let (_server, addr) = start(&[&cert, &key]);
    let port = addr.rsplit(':').next().expect("port");

    assert_eq!(get_version(&format!("https://127.0.0.1:{port}"), Some(&cert)).await, Ok(0));

    let plain = get_version(&format!("http://{addr}"), None).await;
    assert!(plain.is_err(), "a plaintext client was served over TLS: {plain:?}");

    let wrong = get_version(&format!("https://127.0.0.1:{port}"), Some(&other)).await;
    let why = wrong.expect_err("a client trusting another CA was served");
    assert!(why.to_lowercase().contains("certificate"), "unclear error for the wrong CA: {why}");
    eprintln!("plaintext client: {}; wrong CA: {why}", plain.unwrap_err());
    let _ = std::fs::remove_dir_all(&d);
}

#[tokio::test]
async fn plaintext_server_refuses_a_tls_client() {
    let d = dir("plain");
    let (cert, _) = self_signed(&d, "server");
    let (_server, addr) = start(&[]);
    let port = addr.rsplit(':').next().expect("port");
    assert_eq!(get_version(&format!("http://{addr}"), None).await, Ok(0));
    assert!(get_version(&format!("https://127.0.0.1:{port}"), Some(&cert)).await.is_err());
    let _ = std::fs::remove_dir_all(&d);
}

/// Run the server with bad TLS flags: it must exit non-zero, naming what was wrong.
fn refused(args: &[&std::ffi::OsStr]) -> String {
    let mut child = Command::new(SERVER)
        .args(["--listen", "127.0.0.1:0", "--model", "tiny"])
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawning gradsync-server");
    let mut err = String::new();
    child.stderr.take().expect("piped stderr").read_to_string(&mut err).expect("stderr");
    let status = child.wait().expect("wait");
    assert!(!status.success(), "the server started with {args:?}");
    err
}

#[test]
fn bad_tls_files_are_named() {
    let d = dir("bad");
    let (cert, key) = self_signed(&d, "server");
    let missing = d.join("missing.pem");
    let garbage = d.join("garbage.pem");
    std::fs::write(&garbage, "this is not a certificate\n").expect("write");
    let bad_key = d.join("bad.key");
    std::fs::write(&bad_key, "-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n")
        .expect("write");

    let err = refused(&["--tls-cert".as_ref(), missing.as_os_str(), "--tls-key".as_ref(), key.as_os_str()]);
    assert!(err.contains("--tls-cert") && err.contains("missing.pem"), "{err}");
    let err = refused(&["--tls-cert".as_ref(), cert.as_os_str(), "--tls-key".as_ref(), garbage.as_os_str()]);
    assert!(err.contains("--tls-key") && err.contains("garbage.pem") && err.contains("PEM"), "{err}");
    let err = refused(&["--tls-cert".as_ref(), cert.as_os_str(), "--tls-key".as_ref(), bad_key.as_os_str()]);
    assert!(err.contains("bad.key"), "{err}");
    eprintln!("bad key: {err}");
    let err = refused(&["--tls-cert".as_ref(), cert.as_os_str()]);
    assert!(err.contains("--tls-key"), "{err}");
    let _ = std::fs::remove_dir_all(&d);
}
