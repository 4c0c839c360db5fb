//! `cultnet-gateway`: the CultNet Matrix gateway daemon and its tools.
//!
//! `main` only parses arguments, runs the command and maps errors to exit codes: 0 success,
//! 1 a runtime failure, 2 bad input (unreadable or undecodable bytes, bad arguments).
#![forbid(unsafe_code)]
#![warn(missing_docs, unreachable_pub)]

mod cli;

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| {
                "info,matrix_sdk=warn,matrix_sdk_crypto=warn,matrix_sdk_base=warn".into()
            }),
        )
        .with_writer(std::io::stderr)
        .init();
    let args = cli::Args::parse();
    match cli::run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("cultnet-gateway: {e:#}");
            ExitCode::from(e.exit_code())
        }
    }
}
