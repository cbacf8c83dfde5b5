//! `kvroute-indexer`: see indexer/README.md for the flags.

use clap::Parser;
use kvroute_indexer::config::Args;

fn main() -> std::process::ExitCode {
    let args = Args::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("kvroute-indexer: cannot start the runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    match runtime.block_on(kvroute_indexer::service::run(args)) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kvroute-indexer: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}
