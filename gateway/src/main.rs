//! `cultnet-gateway`: the CultNet Matrix gateway daemon and its tools.
//!
//! `main` only parses arguments, runs the command and maps errors to exit codes: 0 success,
//! 1 a runtime failure, 2 bad input (unreadable or undecodable bytes, bad arguments).
#![forbid(unsafe_code)]
#![warn(missing_docs, unreachable_pub)]

mod cli;

use std::process::ExitCode;

use clap::Parser;

/// Logs to stderr: text for people, or one JSON object per line (spans included) for the
/// journal and log shippers. `auto` is JSON when stderr is not a terminal or the journal
/// reads it (`JOURNAL_STREAM`). `RUST_LOG` filters either. By default matrix-sdk's HTTP
/// client is silent: it logs every failed request as an error, the normal 404s of a first start
/// (no account data, no key backup yet) among them; the gateway reports the failures that
/// matter itself, with what they stop. `RUST_LOG=info,matrix_sdk::http_client=debug` shows
/// them all.
fn logs(format: cli::LogFormat) {
    use std::io::IsTerminal;
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| {
        "info,matrix_sdk=warn,matrix_sdk_crypto=warn,matrix_sdk_base=warn,matrix_sdk::http_client=off"
            .into()
    });
    let terminal = std::io::stderr().is_terminal();
    let json = match format {
        cli::LogFormat::Json => true,
        cli::LogFormat::Text => false,
        cli::LogFormat::Auto => !terminal || std::env::var_os("JOURNAL_STREAM").is_some(),
    };
    let base = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    if json {
        base.json()
            .with_current_span(true)
            .with_span_list(true)
            .init();
    } else {
        base.with_ansi(terminal).init();
    }
}

fn main() -> ExitCode {
    // Everything the gateway writes (her inbox with decrypted DMs, her Matrix store, her
    // session files, its keys) is for its own user alone, whatever the umask it was started
    // with; her claude processes inherit it.
    #[cfg(unix)]
    rustix::process::umask(rustix::fs::Mode::from_raw_mode(0o077));
    let args = cli::Args::parse();
    logs(args.log_format);
    match cli::run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("cultnet-gateway: {e:#}");
            ExitCode::from(e.exit_code())
        }
    }
}
