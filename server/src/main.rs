use clap::Parser;
use gradsync_server::Cli;

/// Resolves on SIGTERM or Ctrl-C.
async fn signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => tokio::select! {
                _ = term.recv() => {}
                _ = tokio::signal::ctrl_c() => {}
            },
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

fn main() -> std::process::ExitCode {
    // Allocator settings must precede the runtime's threads (each would take its own arena).
    gradsync_core::heap::keep_freed_memory();
    gradsync_core::heap::single_arena();
    match tokio::runtime::Runtime::new() {
        Ok(rt) => rt.block_on(serve()),
        Err(e) => {
            eprintln!("gradsync-server: error: starting the runtime: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

async fn serve() -> std::process::ExitCode {
    // Warnings by default (a refused client, a dropped worker); GRADSYNC_LOG overrides.
    let filter = tracing_subscriber::EnvFilter::builder()
        .with_default_directive(tracing_subscriber::filter::LevelFilter::WARN.into())
        .with_env_var("GRADSYNC_LOG")
        .from_env_lossy();
    tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).init();
    match gradsync_server::run(Cli::parse().args, signal()).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("gradsync-server: error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
