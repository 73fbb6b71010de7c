use clap::Parser;

fn main() -> std::process::ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_env("GRADSYNC_LOG"))
        .with_writer(std::io::stderr)
        .init();
    match gradsync_bench::main_with_args(gradsync_bench::cli::Cli::parse()) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("gradsync-bench: error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
