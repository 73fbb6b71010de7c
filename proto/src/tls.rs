//! Optional TLS (rustls, through tonic) for both ends: PEM files read here, with errors that
//! name the file and the flag. The token still travels in metadata; TLS is what keeps it, and
//! the tensors, from a stranger on the path.

use std::path::Path;

use tonic::transport::{Certificate, ClientTlsConfig, Identity, ServerTlsConfig};

use crate::Error;

fn read_pem(flag: &'static str, path: &Path) -> Result<Vec<u8>, Error> {
    let bytes =
        std::fs::read(path).map_err(|e| Error::TlsFile { flag, path: path.into(), why: e.to_string() })?;
    if !bytes.windows(11).any(|w| w == b"-----BEGIN ") {
        return Err(Error::TlsFile {
            flag,
            path: path.into(),
            why: "not a PEM file (no -----BEGIN line)".into(),
        });
    }
    Ok(bytes)
}

/// The server's TLS settings from `--tls-cert` and `--tls-key` (PEM). The pair is checked by
/// building a server with it, so a key that does not parse fails here, naming both files.
pub fn server(cert: &Path, key: &Path) -> Result<ServerTlsConfig, Error> {
    let identity = Identity::from_pem(read_pem("--tls-cert", cert)?, read_pem("--tls-key", key)?);
    let cfg = ServerTlsConfig::new().identity(identity);
    tonic::transport::Server::builder().tls_config(cfg.clone()).map_err(|e| Error::Tls {
        what: format!("--tls-cert {} with --tls-key {}", cert.display(), key.display()),
        why: tls_why(&e),
    })?;
    Ok(cfg)
}

/// A client's TLS settings: trust the CA in `--tls-ca` (PEM); `domain` is the name the
/// server's certificate must carry (default: the host of the address dialled).
pub fn client(ca: &Path, domain: Option<&str>) -> Result<ClientTlsConfig, Error> {
    let mut cfg = ClientTlsConfig::new().ca_certificate(Certificate::from_pem(read_pem("--tls-ca", ca)?));
    if let Some(d) = domain {
        cfg = cfg.domain_name(d);
    }
    Ok(cfg)
}

/// The innermost cause of a transport error (tonic's own text is only "transport error").
pub fn tls_why(e: &(dyn std::error::Error + 'static)) -> String {
    let mut why = e.to_string();
    let mut src = e.source();
    while let Some(s) = src {
        why = s.to_string();
        src = s.source();
    }
    why
}
