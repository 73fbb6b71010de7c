//! gradsync's parameter server: holds the parameters and the optimiser state of one shard of
//! the flat buffer, and turns workers' gradients into updates under BSP, ASP or SSP.
//!
//! # Layout
//! - [`config`]: the command line ([`Cli`]) and its flags ([`ServerArgs`], their names in
//!   `config::flag`), `--sync` and `--shard` parsing, the resolved
//!   [`Config`].
//! - [`state`]: the shard's parameters, momentum, membership and the synchronisation rules,
//!   with no transport (what a push, a timeout or a departure does).
//! - [`round`]: one pipelined BSP step: blocks summed and stepped as the gradients arrive,
//!   into next buffers committed only when the whole step succeeded.
//! - [`service`]: the gRPC edge: chunk streams in and out, the token interceptor, errors to
//!   statuses.
//! - [`direct`]: PushGradients and PullParameters served straight from HTTP/2 frames (no
//!   codec copies), in front of the generated service.
//! - [`limits`]: what one client may hold and for how long (connections, requests, bytes of
//!   incomplete pushes), and the open-file limit.
//! - [`error`]: the crate's [`Error`].
//!
//! [`ParamServer::serve`] takes a bound listener and a shutdown future; `main.rs` only parses
//! flags, binds and prints the `listening on` line.

pub mod config;
pub mod direct;
pub mod error;
pub mod limits;
pub mod round;
pub mod rows;
pub mod service;
pub mod state;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use gradsync_proto::pb::parameter_server_server::ParameterServerServer;
use tokio::net::TcpListener;
use tokio::sync::{Mutex, watch};
use tokio_stream::StreamExt;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::server::TcpIncoming;

pub use config::{Cli, Config, ServerArgs, ShardSpec, SyncMode};
pub use error::{Error, Result};

/// One parameter-server shard, ready to serve.
pub struct ParamServer {
    service: service::Service,
}

impl ParamServer {
    /// Build the shard: initial (or resumed) parameters, metrics file.
    pub fn new(cfg: Config) -> Result<Self> {
        let (shared, state) = state::State::new(cfg)?;
        let service = service::Service {
            shared: Arc::new(shared),
            state: Arc::new(Mutex::new(state)),
            stop: Arc::new(watch::channel(false).0),
        };
        Ok(ParamServer { service })
    }

    /// The server's version (updates applied, or resumed from).
    pub async fn version(&self) -> u64 {
        self.service.state.lock().await.version()
    }

    /// Serve on `listener` until `shutdown` completes or a client calls Shutdown; then fail
    /// waiting pushes, let in-flight RPCs finish, and write the final checkpoint.
    pub async fn serve(self, listener: TcpListener, shutdown: impl Future<Output = ()> + Send) -> Result<()> {
        let svc = self.service;
        let shared = svc.shared.clone();
        let tuning = shared.cfg.tuning;

        let (health_reporter, health) = tonic_health::server::health_reporter();
        health_reporter
            .set_service_status(gradsync_proto::SERVICE_NAME, tonic_health::ServingStatus::Serving)
            .await;
        health_reporter.set_service_status("", tonic_health::ServingStatus::Serving).await;
        // Both reflection versions: grpcurl asks for v1 and falls back to v1alpha, older
        // tools (and grpcio's Python client) know only v1alpha.
        let reflection = || {
            tonic_reflection::server::Builder::configure()
                .register_encoded_file_descriptor_set(gradsync_proto::FILE_DESCRIPTOR_SET)
                .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        };
        let reflection_v1alpha =
            reflection().build_v1alpha().map_err(|e| Error::invalid("reflection", e.to_string()))?;
        let reflection = reflection().build_v1().map_err(|e| Error::invalid("reflection", e.to_string()))?;
        let ps = ParameterServerServer::new(svc.clone())
            .max_decoding_message_size(tuning.max_message())
            .max_encoding_message_size(tuning.max_message());
        let auth = service::auth(shared.cfg.token.as_deref().map(Arc::from));

        // Elastic runs drop silent workers even when nobody is waiting on them yet.
        let reaper = {
            let svc = svc.clone();
            let period = (shared.cfg.worker_timeout / 4).max(Duration::from_millis(50));
            tokio::spawn(async move {
                let mut tick = tokio::time::interval(period);
                loop {
                    tick.tick().await;
                    let mut st = svc.state.lock().await;
                    st.reap(&svc.shared);
                }
            })
        };

        let mut stop_rx = svc.stop.subscribe();
        let state = svc.state.clone();
        let stop_shared = shared.clone();
        let signal = async move {
            tokio::select! {
                () = shutdown => {}
                _ = stop_rx.wait_for(|s| *s) => {}
            }
            tracing::info!("shutting down");
            health_reporter.set_service_status("", tonic_health::ServingStatus::NotServing).await;
            health_reporter
                .set_service_status(gradsync_proto::SERVICE_NAME, tonic_health::ServingStatus::NotServing)
                .await;
            state.lock().await.close(&stop_shared);
        };
        let (limits, warned) = (shared.cfg.limits, limits::LastWarned::default());
        let incoming = TcpIncoming::from(listener)
            .with_nodelay(Some(tuning.nodelay))
            .then(move |s| limits::accepted(s, limits, warned.clone()));
        let guard = limits::Guard {
            body: shared.cfg.worker_timeout,
            budget: Arc::new(limits::Budget::new(limits.push_bytes)),
        };
        let mut builder = tuning
            .server()
            .max_concurrent_streams(limits.max_streams)
            .http2_keepalive_interval(Some(limits.keepalive))
            .http2_keepalive_timeout(Some(limits.keepalive))
            .layer(guard);
        if let Some(tls) = shared.cfg.tls.clone() {
            builder = builder.tls_config(tls)?;
        }
        let router = builder.add_service(health).add_service(reflection).add_service(reflection_v1alpha);
        let router = if tuning.direct {
            router.add_service(InterceptedService::new(direct::Direct::new(svc.clone(), ps), auth))
        } else {
            router.add_service(InterceptedService::new(ps, auth))
        };
        let served = router.serve_with_incoming_shutdown(incoming, signal).await;
        reaper.abort();
        let mut st = svc.state.lock().await;
        let ck = if shared.cfg.checkpoint.is_some() { st.checkpoint(&shared) } else { Ok(()) };
        if let Some(path) = &shared.cfg.trace {
            shared.trace.write(path)?;
        }
        served?;
        ck
    }
}

/// What `gradsync-server` does: resolve the flags, bind, announce, serve until SIGTERM,
/// Ctrl-C or a Shutdown RPC.
pub async fn run(args: ServerArgs, shutdown: impl Future<Output = ()> + Send) -> anyhow::Result<()> {
    use anyhow::Context;
    use std::io::Write;
    let cfg = Config::from_args(&args)?;
    // Every connection is a descriptor: the usual soft limit of 1024 is a few hundred idle
    // clients away from refusing workers.
    match limits::raise_open_files() {
        Ok((before, after)) if before == after => eprintln!("gradsync-server: open-file limit {after}"),
        Ok((before, after)) => eprintln!("gradsync-server: open-file limit {after} (raised from {before})"),
        Err(e) => eprintln!("gradsync-server: open-file limit unchanged: {e}"),
    }
    gradsync_core::heap::keep_freed_memory();
    let server = ParamServer::new(cfg)?;
    let listener =
        TcpListener::bind(args.listen).await.with_context(|| format!("--listen {}", args.listen))?;
    let addr = listener.local_addr()?;
    let mut out = std::io::stdout().lock();
    writeln!(out, "gradsync-server listening on {addr}")?;
    out.flush()?;
    drop(out);
    server.serve(listener, shutdown).await?;
    Ok(())
}
