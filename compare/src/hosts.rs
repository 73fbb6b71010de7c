//! Where the `ps` benchmark's sockets live: on this machine's loopback (every process on
//! 127.0.0.1, the link being the machine's memory copies), or on emulated hosts whose links are
//! shaped to a chosen rate ([`crate::net`]), as the bound's model has it: each shard
//! and each worker on a host of its own with its own full-duplex link.
//!
//! Everything still runs in this one process. A socket belongs to the network namespace of the
//! thread that made it, so each emulated host's sockets are made on a thread inside its
//! namespace: listeners and plain socket pairs directly, and a worker's HTTP/2 connections on a
//! runtime whose thread lives there ([`HostRuntime`]).

use std::net::{TcpListener, TcpStream};
use std::time::Duration;

use anyhow::Context;

use crate::net::Cluster;

/// How long a plain socket may block on one read or write before the run fails.
const IO_TIMEOUT: Duration = Duration::from_secs(60);

/// The hosts of a run.
#[derive(Debug, Clone, Copy)]
pub enum Hosts<'a> {
    /// Every host is this machine's loopback.
    Loopback,
    /// Host `i` is the cluster's host `i`.
    Emulated(&'a Cluster),
}

impl Hosts<'_> {
    /// Host `host`'s address.
    pub fn ip(&self, host: usize) -> anyhow::Result<String> {
        match self {
            Hosts::Loopback => Ok("127.0.0.1".into()),
            Hosts::Emulated(c) => c
                .hosts()
                .get(host)
                .map(|h| h.addr.clone())
                .with_context(|| format!("no host {host} among {}", c.hosts().len())),
        }
    }

    /// Run `f` where sockets it makes belong to `host`.
    fn on<T: Send + 'static>(
        &self,
        host: usize,
        f: impl FnOnce() -> std::io::Result<T> + Send + 'static,
    ) -> anyhow::Result<T> {
        match self {
            Hosts::Loopback => Ok(f()?),
            Hosts::Emulated(c) => {
                let h = c.spawn_on(host, f)?;
                let r = h.join().map_err(|_| anyhow::anyhow!("a thread on host {host} panicked"))?;
                Ok(r.with_context(|| format!("entering host {host}'s network namespace"))??)
            }
        }
    }

    /// A listener on `host`'s address, any port.
    pub fn listen(&self, host: usize) -> anyhow::Result<TcpListener> {
        let ip = self.ip(host)?;
        self.on(host, move || TcpListener::bind((ip.as_str(), 0)))
            .with_context(|| format!("listening on host {host}"))
    }

    /// A connected pair of plain sockets from host `from` to host `to`: (the dialing end on
    /// `from`, the accepted end on `to`), with no Nagle delay and I/O timeouts.
    pub fn pair(&self, from: usize, to: usize) -> anyhow::Result<(TcpStream, TcpStream)> {
        let listener = self.listen(to)?;
        let addr = listener.local_addr()?;
        let tx = self
            .on(from, move || TcpStream::connect_timeout(&addr, Duration::from_secs(10)))
            .with_context(|| format!("connecting a plain socket pair to {addr}"))?;
        let (rx, _) = listener.accept().context("accepting a plain socket pair")?;
        for s in [&tx, &rx] {
            s.set_nodelay(true)?;
            s.set_read_timeout(Some(IO_TIMEOUT))?;
            s.set_write_timeout(Some(IO_TIMEOUT))?;
        }
        Ok((tx, rx))
    }

    /// A runtime whose connections belong to `host` (tasks spawned on it open their sockets
    /// there), until dropped; `None` on loopback, where the caller's runtime serves.
    pub fn runtime(&self, host: usize) -> anyhow::Result<Option<HostRuntime>> {
        let Hosts::Emulated(c) = self else { return Ok(None) };
        let (handle_tx, handle_rx) = std::sync::mpsc::channel();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let thread = c.spawn_on(host, move || -> std::io::Result<()> {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
            let _ = handle_tx.send(rt.handle().clone());
            rt.block_on(async {
                let _ = stopped.await;
            });
            Ok(())
        })?;
        match handle_rx.recv() {
            Ok(handle) => Ok(Some(HostRuntime { handle, stop: Some(stop), thread: Some(thread) })),
            Err(_) => {
                let r = thread.join().map_err(|_| anyhow::anyhow!("host {host}'s runtime panicked"))?;
                r.and_then(|r| r).with_context(|| format!("starting a runtime on host {host}"))?;
                anyhow::bail!("host {host}'s runtime stopped before it started")
            }
        }
    }
}

/// A current-thread tokio runtime on a thread inside an emulated host's network namespace.
/// Dropping it stops the runtime (and every connection it drives) and joins its thread.
#[derive(Debug)]
pub struct HostRuntime {
    /// Spawn here to make connections on the host.
    pub handle: tokio::runtime::Handle,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<std::io::Result<std::io::Result<()>>>>,
}

impl Drop for HostRuntime {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
