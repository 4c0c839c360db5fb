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
    /// Print each Persona's session status (the status files the running gateway writes): a
    /// table for people, or with `--json` the whole status (session id and generation, the
    /// last turns with usage, cost and decisions) for scripts.
    Status {
        /// The configuration file.
        #[arg(long, short, default_value = "/etc/cultnet-gateway/gateway.toml")]
        config: PathBuf,
        /// JSON instead of the table.
        #[arg(long)]
        json: bool,
    },
    /// Draw a Persona's live session over time (SVG): her prompt against the watermark and the
    /// window with each refresh decision and its reason, the cache hit share, the cost per turn,
    /// and the cumulative cost against rebuilding every turn. From her turn history.
    Report {
        /// The configuration file.
        #[arg(long, short, default_value = "/etc/cultnet-gateway/gateway.toml")]
        config: PathBuf,
        /// The Persona (the only live one when absent).
        #[arg(long)]
        persona: Option<String>,
        /// Where to write the SVG.
        #[arg(long)]
        out: PathBuf,
    },
    /// Check a config before starting: one line per check (config, state directory, each
    /// Persona's token, homeserver, rooms, store, claude CLI and credential, QUIC and client
    /// keys), each failure with its fix. Exit code 0 when nothing failed, 1 otherwise.
    Check {
        /// The configuration file.
        #[arg(long, short, default_value = "/etc/cultnet-gateway/gateway.toml")]
        config: PathBuf,
    },
    /// Bring a Persona back after her Matrix store was lost: with a token for a NEW device
    /// (its id in the config) and her recovery key (encryption.recovery_key_file), her new
    /// device is signed from her secret storage and her key backup opens for it, so messages
    /// sent to the lost device decrypt. Her inbox, sync position and sends are kept. Run it
    /// with the gateway stopped; start the gateway after it.
    Recover {
        /// The configuration file.
        #[arg(long, short, default_value = "/etc/cultnet-gateway/gateway.toml")]
        config: PathBuf,
        /// The Persona.
        #[arg(long)]
        persona: String,
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
        /// The Persona it acts for (repeat for more; `*` grants every Persona). The block
        /// printed grants only reading her mail and the status; add verbs as it needs.
        #[arg(long = "persona", required = true)]
        personas: Vec<String>,
    },
    /// Talk to a running gateway as a CultNet client: status, pending, ack, send, turn, note,
    /// extensions, session. Prints the receipt as JSON.
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
        /// Over RUDP: the gateway's public key (64 hex digits, logged at its start; its secret
        /// half is `STATE/cultnet/server.key`). The session is refused unless the gateway
        /// proves it, so whoever else holds its port gets no request.
        #[arg(long)]
        server_key: Option<String>,
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
        Command::Status { config, json } => status(&config, json),
        Command::Report {
            config,
            persona,
            out,
        } => report(&config, persona.as_deref(), &out),
        Command::Check { config } => check(&config),
        Command::Recover { config, persona } => recover(&config, &persona),
        Command::Keygen {
            out,
            agent,
            personas,
        } => client::keygen(&out, &agent, &personas),
        Command::Client {
            gateway,
            agent,
            key,
            quic_cert,
            server_key,
            timeout,
            ask,
        } => client::run(
            gateway,
            &agent,
            &key,
            quic_cert.as_deref(),
            server_key.as_deref(),
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

fn recover(config: &std::path::Path, persona: &str) -> Result<(), Failure> {
    use anyhow::Context as _;
    let cfg = gateway::config::Config::load(config).map_err(|e| Failure::input(e.into()))?;
    let p = cfg
        .personas
        .iter()
        .find(|p| p.id == persona)
        .ok_or_else(|| {
            Failure::input(anyhow::anyhow!(
                "no Persona {persona:?} in {}",
                config.display()
            ))
        })?;
    // Held while recovering: no gateway may run with this state directory meanwhile.
    let inbox_path = cfg.state_dir.join("inbox");
    let _inbox = gateway::inbox::Inbox::open(&inbox_path).map_err(|e| {
        if e.is_contention() {
            anyhow::anyhow!(
                "{} is locked: a gateway is running with it; stop it first",
                inbox_path.display()
            )
        } else {
            anyhow::Error::new(e).context(format!("opening the inbox {}", inbox_path.display()))
        }
    })?;
    let token = p.load_token().map_err(|e| Failure::input(e.into()))?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the runtime")?;
    let done = rt
        .block_on(gateway::identity::recover(p, &cfg.state_dir, &token))
        .map_err(anyhow::Error::new)?;
    for m in &done.moved {
        println!(
            "{}: the lost store's remains moved to {}",
            p.id,
            m.display()
        );
    }
    match (&done.old_device, done.old_device_deleted) {
        (Some(d), true) => println!("{}: her lost device {d} is deleted from her account", p.id),
        (Some(d), false) => println!(
            "{}: her lost device {d} is still on her account: delete it from a client of hers (or set encryption.password_file and run recover again)",
            p.id
        ),
        (None, _) => {}
    }
    let s = &done.standing;
    println!(
        "{}: device {} cross-signed: {}, key backup: {}",
        p.id,
        p.device_id,
        if s.cross_signed { "yes" } else { "NO" },
        if s.backup { "on" } else { "OFF" }
    );
    println!(
        "{}: recovered; start the gateway: her pending mail is delivered once, in clear",
        p.id
    );
    Ok(())
}

fn report(
    config: &std::path::Path,
    persona: Option<&str>,
    out: &std::path::Path,
) -> Result<(), Failure> {
    use anyhow::Context as _;
    let cfg = gateway::config::Config::load(config).map_err(|e| Failure::input(e.into()))?;
    let live: Vec<&gateway::config::Persona> = cfg
        .personas
        .iter()
        .filter(|p| p.session.mode == gateway::config::SessionMode::Live)
        .collect();
    let p = match persona {
        Some(id) => cfg.personas.iter().find(|p| p.id == id).ok_or_else(|| {
            Failure::input(anyhow::anyhow!("no Persona {id:?} in {}", config.display()))
        })?,
        None => match live[..] {
            [one] => one,
            _ => {
                return Err(Failure::input(anyhow::anyhow!(
                    "{} live Personas: name one with --persona",
                    live.len()
                )))
            }
        },
    };
    let path = cfg
        .state_dir
        .join("personas")
        .join(&p.id)
        .join(gateway::turns::HISTORY_FILE);
    let turns = gateway::turns::read_history(&path)
        .with_context(|| format!("reading her turn history {}", path.display()))?;
    let svg =
        gateway::report::svg(&p.id, &turns).with_context(|| format!("the report of {}", p.id))?;
    std::fs::write(out, svg).with_context(|| format!("writing {}", out.display()))?;
    let n = turns
        .iter()
        .filter(|r| r.kind == gateway::turns::RecordKind::Turn)
        .count();
    println!("{}: {n} turns -> {}", p.id, out.display());
    Ok(())
}

fn status(config: &std::path::Path, json: bool) -> Result<(), Failure> {
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
    if json {
        println!("{}", serde_json::to_string_pretty(&out).unwrap_or_default());
        return Ok(());
    }
    println!(
        "{:<12} {:<5} {:<38} {:>4} {:>7} {:>9} {:>7} {:>10}  last error",
        "persona", "mode", "session", "gen", "turns", "prefix", "hit", "cost"
    );
    for p in &cfg.personas {
        let v = &out[&p.id];
        let turns: Vec<&serde_json::Value> = v["turns"]
            .as_array()
            .map(|a| a.iter().collect())
            .unwrap_or_default();
        let last = turns.last();
        let cost = turns
            .iter()
            .filter_map(|t| t["cost_usd"].as_f64())
            .fold(0.0, |a, c| a + c);
        let prefix = last
            .map(|t| {
                ["input_tokens", "cache_read_tokens", "cache_write_tokens"]
                    .iter()
                    .filter_map(|k| t[*k].as_u64())
                    .sum::<u64>()
            })
            .unwrap_or(0);
        println!(
            "{:<12} {:<5} {:<38} {:>4} {:>7} {:>9} {:>6.1}% {:>10}  {}",
            p.id,
            format!("{:?}", p.session.mode).to_lowercase(),
            v["session_id"].as_str().unwrap_or("-"),
            v["generation"].as_u64().unwrap_or(0),
            v["turns_total"].as_u64().unwrap_or(0),
            prefix,
            last.and_then(|t| t["hit_ratio"].as_f64()).unwrap_or(0.0) * 100.0,
            format!("${cost:.4}"),
            v["last_error"]
                .as_str()
                .or(v["error"].as_str())
                .unwrap_or("-"),
        );
        // What she holds back, and why.
        let mut held = Vec::new();
        if let Some(n) = v["retired_lines"].as_u64().filter(|n| *n > 0) {
            held.push(format!(
                "{n} waiting line(s) retired into her rooms' context (turns.waiting_lines)"
            ));
        }
        if let Some(a) = v["set_aside"].as_array().filter(|a| !a.is_empty()) {
            let ids: Vec<String> = a.iter().map(|b| b["batch"].to_string()).collect();
            held.push(format!(
                "{} batch(es) set aside, the model API refused them (ids {}: session retry|drop --batch ID)",
                a.len(),
                ids.join(", ")
            ));
        }
        if !held.is_empty() {
            println!("{:<12} holds back: {}", "", held.join("; "));
        }
    }
    println!(
        "(cost: the last {} turns; --json for everything)",
        gateway::turns::TELEMETRY_KEPT
    );
    Ok(())
}
