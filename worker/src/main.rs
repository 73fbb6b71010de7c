use clap::Parser;

fn main() -> std::process::ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_env("GRADSYNC_LOG"))
        .with_writer(std::io::stderr)
        .init();
    match gradsync_worker::main_with_args(gradsync_worker::cli::Cli::parse_from(
        // A TrainJob's PET_* variables, read as torchrun reads them.
        gradsync_worker::cli::with_pet_env(std::env::args_os().collect(), |v| std::env::var(v).ok()),
    )) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("gradsync-worker: error: {e:#}");
            if e.chain().any(|c| c.is::<gradsync_worker::train::Diverged>()) {
                std::process::ExitCode::from(gradsync_worker::train::EXIT_DIVERGED)
            } else {
                std::process::ExitCode::FAILURE
            }
        }
    }
}
