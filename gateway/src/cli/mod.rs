//! Command-line arguments and dispatch.

mod decode;
mod run;

use std::path::PathBuf;

use clap::{Parser, Subcommand};

/// The CultNet Matrix gateway.
#[derive(Debug, Parser)]
#[command(name = "cultnet-gateway", version, about)]
pub(crate) struct Args {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the gateway: every configured Persona's ear, mouth and (if live) session.
    Run {
        /// The configuration file (see deploy/gateway.example.toml).
        #[arg(long, short, default_value = "/etc/cultnet-gateway/gateway.toml")]
        config: PathBuf,
    },
    /// Wire-level debugging tools.
    Wire {
        #[command(subcommand)]
        command: WireCommand,
    },
}

#[derive(Debug, Subcommand)]
enum WireCommand {
    /// Print a CNR0 packet, a cultnet.schema.v0 message or length-prefixed stream frames as
    /// JSON, saying which it found. Exit code 2 when the bytes are none of these.
    Decode {
        /// File to read, or `-` for stdin.
        file: PathBuf,
    },
}

/// A failure with the exit code it maps to.
#[derive(Debug)]
pub(crate) struct Failure {
    error: anyhow::Error,
    code: u8,
}

impl Failure {
    pub(crate) fn exit_code(&self) -> u8 {
        self.code
    }

    /// Bad input: exit code 2.
    pub(crate) fn input(error: anyhow::Error) -> Self {
        Self { error, code: 2 }
    }
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if f.alternate() {
            write!(f, "{:#}", self.error)
        } else {
            write!(f, "{}", self.error)
        }
    }
}

impl From<anyhow::Error> for Failure {
    fn from(error: anyhow::Error) -> Self {
        Self { error, code: 1 }
    }
}

/// Runs the parsed command.
pub(crate) fn run(args: Args) -> Result<(), Failure> {
    match args.command {
        Command::Run { config } => run::run(&config),
        Command::Wire {
            command: WireCommand::Decode { file },
        } => decode::run(&file),
    }
}
