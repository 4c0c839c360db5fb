//! Command-line arguments and dispatch.

mod client;
mod decode;
mod run;

use std::path::PathBuf;

use clap::{Parser, Subcommand};

/// The CultNet Matrix gateway.
#[derive(Debug, Parser)]
#[command(name = "cultnet-gateway", version, about)]
pub(crate) struct Args {
    /// Log format on stderr: text, json (one object per line, with spans), or auto (json when
    /// stderr is not a terminal or under the journal).
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Auto)]
    pub(crate) log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

/// How logs are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum LogFormat {
    /// JSON when stderr is not a terminal or the journal reads it; text otherwise.
    Auto,
    /// Lines for people.
    Text,
    /// One JSON object per line.
    Json,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the gateway: every configured Persona's ear, mouth and (if live) session.
    Run {
        /// The configuration file (see deploy/gateway.example.toml).
        #[arg(long, short, default_value = "/etc/cultnet-gateway/gateway.toml")]
        config: PathBuf,
    },
    /// Print each Persona's session status (the status files the running gateway writes):
    /// session id and generation, and the last turns with usage, cost and decisions.
    Status {
        /// The configuration file.
        #[arg(long, short, default_value = "/etc/cultnet-gateway/gateway.toml")]
        config: PathBuf,
    },
    /// Check a config before starting: one line per check (config, state directory, each
    /// Persona's token, homeserver, rooms, store, claude CLI and credential, QUIC and client
    /// keys), each failure with its fix. Exit code 0 when nothing failed, 1 otherwise.
    Check {
        /// The configuration file.
        #[arg(long, short, default_value = "/etc/cultnet-gateway/gateway.toml")]
        config: PathBuf,
    },
    /// Make a new CultNet client key: writes its secret (mode 0600) and prints the
    /// `[[cultnet.client]]` block with its public key.
    Keygen {
        /// Where to write the secret key (refused if it exists).
        #[arg(long)]
        out: PathBuf,
        /// The agent id to print in the config block.
        #[arg(long, default_value = "operator-tool")]
        agent: String,
    },
    /// Talk to a running gateway as a CultNet client: status, pending, ack, send, turn.
    /// Prints the receipt as JSON.
    Client {
        /// The gateway's CultNet address.
        #[arg(long, default_value = "127.0.0.1:47004")]
        gateway: std::net::SocketAddr,
        /// This client's agent id (as in the gateway's `[[cultnet.client]]`).
        #[arg(long)]
        agent: String,
        /// Its secret key file (from `keygen`).
        #[arg(long)]
        key: PathBuf,
        /// Talk QUIC (a remote gateway): the gateway's certificate (DER, e.g. its
        /// `STATE/quic/cert.der`), the only one trusted; `--gateway` is then its QUIC address.
        #[arg(long)]
        quic_cert: Option<PathBuf>,
        /// Seconds to wait for each answer.
        #[arg(long, default_value_t = 30)]
        timeout: u64,
        #[command(subcommand)]
        ask: client::Ask,
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
        Command::Status { config } => status(&config),
        Command::Check { config } => check(&config),
        Command::Keygen { out, agent } => client::keygen(&out, &agent),
        Command::Client {
            gateway,
            agent,
            key,
            quic_cert,
            timeout,
            ask,
        } => client::run(
            gateway,
            &agent,
            &key,
            quic_cert.as_deref(),
            std::time::Duration::from_secs(timeout),
            ask,
        ),
        Command::Wire {
            command: WireCommand::Decode { file },
        } => decode::run(&file),
    }
}

fn check(config: &std::path::Path) -> Result<(), Failure> {
    use anyhow::Context as _;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the runtime")?;
    let lines = rt.block_on(gateway::check::check(config));
    for l in &lines {
        println!("{l}");
    }
    if gateway::check::failed(&lines) {
        let n = lines
            .iter()
            .filter(|l| l.level == gateway::check::Level::Fail)
            .count();
        return Err(anyhow::anyhow!("{n} check(s) failed").into());
    }
    Ok(())
}

fn status(config: &std::path::Path) -> Result<(), Failure> {
    let cfg = gateway::config::Config::load(config).map_err(|e| Failure::input(e.into()))?;
    let mut out = serde_json::Map::new();
    for p in &cfg.personas {
        let path = cfg
            .state_dir
            .join("personas")
            .join(&p.id)
            .join("status.json");
        let value = match std::fs::read(&path) {
            Ok(bytes) => serde_json::from_slice(&bytes).unwrap_or_else(
                |e| serde_json::json!({"error": format!("{} is unreadable: {e}", path.display())}),
            ),
            Err(_) => {
                serde_json::json!({"session": format!("{:?}", p.session.mode), "turns_total": 0})
            }
        };
        out.insert(p.id.clone(), value);
    }
    println!("{}", serde_json::to_string_pretty(&out).unwrap_or_default());
    Ok(())
}
