//! `cultnet-gateway keygen` and `cultnet-gateway client`: an operator's CultNet client.

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use anyhow::Context as _;
use clap::Subcommand;
use ed25519_dalek::SigningKey;
use gateway::client::{load_key, Client, ClientError, QuicClient};
use gateway::config::hex;
use serde::Serialize;
use wire::docs::{
    ids, AckReceipt, AckRequest, ControlAction, ControlReceipt, ControlRequest,
    ExtensionAckReceipt, ExtensionAckRequest, ExtensionPage, ExtensionPendingRequest,
    GatewayStatus, NoteReceipt, NoteRequest, PendingPage, PendingRequest, SendReceipt, SendRequest,
    StatusRequest, TurnReceipt, TurnRequest,
};

use super::Failure;

/// What to ask.
#[derive(Debug, Subcommand)]
pub(crate) enum Ask {
    /// The gateway's status (the Personas this client may see).
    Status {
        /// Only this Persona.
        #[arg(long)]
        persona: Option<String>,
    },
    /// A page of a Persona's pending deliveries (not consumed).
    Pending {
        /// The Persona.
        #[arg(long)]
        persona: String,
        /// Deliveries after this seq.
        #[arg(long, default_value_t = 0)]
        after: u64,
        /// At most this many.
        #[arg(long)]
        limit: Option<u32>,
    },
    /// Acknowledge a Persona's deliveries through a seq.
    Ack {
        /// The Persona.
        #[arg(long)]
        persona: String,
        /// Through this seq.
        #[arg(long)]
        through: u64,
    },
    /// Say something in one of her rooms (exactly once per request id).
    Send {
        /// The Persona.
        #[arg(long)]
        persona: String,
        /// Room alias or id.
        #[arg(long)]
        room: String,
        /// The text.
        #[arg(long)]
        text: String,
        /// Request id (a repeat with the same id sends nothing new); a new one when absent.
        #[arg(long)]
        request_id: Option<String>,
    },
    /// Ask for a session turn now.
    Turn {
        /// The Persona.
        #[arg(long)]
        persona: String,
        /// Why, for the log.
        #[arg(long)]
        reason: Option<String>,
    },
    /// Append a note to her next batch (state, campaigns, spend and runs replace the previous
    /// note of their kind).
    Note {
        /// The Persona.
        #[arg(long)]
        persona: String,
        /// Its kind.
        #[arg(long)]
        kind: String,
        /// The text (`-`: standard input).
        #[arg(long)]
        text: String,
        /// Note id (a repeat with the same id is shown once); a new one when absent.
        #[arg(long)]
        note_id: Option<String>,
        /// Give her a turn for this note alone.
        #[arg(long)]
        wake: bool,
    },
    /// Her replies' extension fields waiting for a client (not consumed).
    Extensions {
        /// The Persona.
        #[arg(long)]
        persona: String,
        /// Fields after this seq.
        #[arg(long, default_value_t = 0)]
        after: u64,
        /// At most this many.
        #[arg(long)]
        limit: Option<u32>,
    },
    /// Acknowledge her replies' extension fields through a seq.
    ExtensionsAck {
        /// The Persona.
        #[arg(long)]
        persona: String,
        /// Through this seq.
        #[arg(long)]
        through: u64,
    },
    /// An operator's verb on her session, applied at her next turn boundary (the answer
    /// waits for it: give `--timeout` room for a turn).
    Session {
        /// The Persona.
        #[arg(long)]
        persona: String,
        /// What to do.
        #[command(subcommand)]
        action: SessionVerb,
    },
}

/// What an operator asks of her session.
#[derive(Debug, Subcommand)]
pub(crate) enum SessionVerb {
    /// Her session: id, generation, model, turns.
    Status,
    /// A fresh session (the old one stays on disk, resumable by its id).
    Reset,
    /// Compact her conversation (the CLI's /compact).
    Compact,
    /// Switch her model (a fresh session; kept across restarts).
    Model {
        /// The model.
        name: String,
    },
    /// Put a batch set aside (the model API kept refusing it) back into her mail, after what
    /// is pending. `status` lists her set-aside batches.
    Retry {
        /// The batch's id (`setAside[].batch` in `status`).
        #[arg(long)]
        batch: u64,
    },
    /// Drop a set-aside batch for good.
    Drop {
        /// The batch's id (`setAside[].batch` in `status`).
        #[arg(long)]
        batch: u64,
    },
}

/// Writes a new signing key (its seed, 64 hex digits, mode 0600) and prints the public key
/// with the config block that lets it in.
pub(crate) fn keygen(out: &Path, agent: &str, personas: &[String]) -> Result<(), Failure> {
    if out.exists() {
        return Err(Failure::input(anyhow::anyhow!(
            "{} exists; not overwriting a key",
            out.display()
        )));
    }
    let seed = gateway::config::new_key_seed();
    let key = SigningKey::from_bytes(&seed);
    gateway::config::write_private(out, &hex(&seed))
        .with_context(|| format!("writing {}", out.display()))?;
    let public = hex(key.verifying_key().as_bytes());
    println!("{}", grant_block(agent, &public, personas));
    Ok(())
}

/// The `[[cultnet.client]]` block `keygen` prints: the least grant (the Personas named, reading
/// their mail and the status), and a comment naming the rest.
fn grant_block(agent: &str, public: &str, personas: &[String]) -> String {
    let personas: Vec<String> = personas.iter().map(|p| format!("{p:?}")).collect();
    format!(
        "# add to the gateway's config. It may read the mail of the Personas named and the status;\n\
         # add to `verbs` what it needs: \"ack\", \"send\", \"turn\", \"note\", \"extensions\", and\n\
         # \"session\" (reset, compact, switch model) for an operator's tool only. To let only\n\
         # the local users it runs as use this key, add their uids: uids = [1000]\n\
         [[cultnet.client]]\nagent_id = {agent:?}\npublic_key = \"{public}\"\npersonas = [{}]\n\
         verbs = [\"pending\", \"status\"]",
        personas.join(", ")
    )
}

/// Either transport, for the one place that does not care.
enum Conn {
    Rudp(Client),
    Quic(QuicClient),
}

impl Conn {
    async fn request<T: Serialize, R: serde::de::DeserializeOwned>(
        &mut self,
        schema: &str,
        record_key: &str,
        payload: &T,
    ) -> Result<R, ClientError> {
        match self {
            Conn::Rudp(c) => c.request(schema, record_key, payload).await,
            Conn::Quic(c) => c.request(schema, record_key, payload).await,
        }
    }

    async fn close(self) {
        match self {
            Conn::Rudp(c) => c.close().await,
            Conn::Quic(c) => c.close().await,
        }
    }
}

/// Connects (over RUDP, or over QUIC when `quic_cert` pins the gateway's certificate), asks,
/// prints the receipt as JSON.
pub(crate) fn run(
    gateway: SocketAddr,
    agent: &str,
    key_file: &Path,
    quic_cert: Option<&Path>,
    server_key: Option<&str>,
    timeout: Duration,
    ask: Ask,
) -> Result<(), Failure> {
    let key = load_key(key_file).map_err(|e| Failure::input(e.into()))?;
    let server_key = server_key
        .map(|hex| {
            gateway::config::hex32(hex.trim())
                .and_then(|b| ed25519_dalek::VerifyingKey::from_bytes(&b).ok())
                .ok_or_else(|| {
                    anyhow::anyhow!("--server-key is not an ed25519 public key in 64 hex digits")
                })
        })
        .transpose()
        .map_err(Failure::input)?;
    let pinned = quic_cert
        .map(|p| std::fs::read(p).with_context(|| format!("reading {}", p.display())))
        .transpose()
        .map_err(Failure::input)?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the runtime")?;
    rt.block_on(async {
        let mut c = match &pinned {
            Some(cert) => Conn::Quic(
                QuicClient::connect(gateway, cert, agent, &key, timeout)
                    .await
                    .with_context(|| format!("connecting to {gateway} over QUIC"))?,
            ),
            None => Conn::Rudp(
                match &server_key {
                    Some(pinned) => {
                        Client::connect_pinned(gateway, agent, &key, pinned, timeout).await
                    }
                    None => Client::connect(gateway, agent, &key, timeout).await,
                }
                .with_context(|| format!("connecting to {gateway}"))?,
            ),
        };
        let key = uuid::Uuid::new_v4().to_string();
        let out = match ask {
            Ask::Status { persona } => json(
                &c.request::<_, GatewayStatus>(
                    ids::STATUS_REQUEST,
                    &key,
                    &StatusRequest { persona },
                )
                .await?,
            ),
            Ask::Pending {
                persona,
                after,
                limit,
            } => json(
                &c.request::<_, PendingPage>(
                    ids::PENDING_REQUEST,
                    &key,
                    &PendingRequest {
                        persona,
                        after_seq: after,
                        limit,
                        reply_bytes: None,
                    },
                )
                .await?,
            ),
            Ask::Ack { persona, through } => json(
                &c.request::<_, AckReceipt>(
                    ids::ACK_REQUEST,
                    &key,
                    &AckRequest {
                        persona,
                        through_seq: through,
                    },
                )
                .await?,
            ),
            Ask::Send {
                persona,
                room,
                text,
                request_id,
            } => {
                let request_id = request_id.unwrap_or_else(|| key.clone());
                json(
                    &c.request::<_, SendReceipt>(
                        ids::SEND_REQUEST,
                        &request_id,
                        &SendRequest {
                            request_id: request_id.clone(),
                            persona,
                            room,
                            text,
                            thread_root: None,
                            reply_to: None,
                        },
                    )
                    .await?,
                )
            }
            Ask::Turn { persona, reason } => json(
                &c.request::<_, TurnReceipt>(
                    ids::TURN_REQUEST,
                    &key,
                    &TurnRequest { persona, reason },
                )
                .await?,
            ),
            Ask::Note {
                persona,
                kind,
                text,
                note_id,
                wake,
            } => {
                let text = if text == "-" {
                    let mut t = String::new();
                    std::io::Read::read_to_string(&mut std::io::stdin(), &mut t)
                        .context("reading the note from standard input")?;
                    t
                } else {
                    text
                };
                json(
                    &c.request::<_, NoteReceipt>(
                        ids::NOTE_REQUEST,
                        &key,
                        &NoteRequest {
                            persona,
                            note_id: note_id.unwrap_or_else(|| key.clone()),
                            kind,
                            text,
                            wake,
                        },
                    )
                    .await?,
                )
            }
            Ask::Extensions {
                persona,
                after,
                limit,
            } => json(
                &c.request::<_, ExtensionPage>(
                    ids::EXTENSION_PENDING_REQUEST,
                    &key,
                    &ExtensionPendingRequest {
                        persona,
                        after_seq: after,
                        limit,
                    },
                )
                .await?,
            ),
            Ask::ExtensionsAck { persona, through } => json(
                &c.request::<_, ExtensionAckReceipt>(
                    ids::EXTENSION_ACK_REQUEST,
                    &key,
                    &ExtensionAckRequest {
                        persona,
                        through_seq: through,
                    },
                )
                .await?,
            ),
            Ask::Session { persona, action } => {
                let (action, model, batch) = match action {
                    SessionVerb::Status => (ControlAction::Status, None, None),
                    SessionVerb::Reset => (ControlAction::Reset, None, None),
                    SessionVerb::Compact => (ControlAction::Compact, None, None),
                    SessionVerb::Model { name } => (ControlAction::Model, Some(name), None),
                    SessionVerb::Retry { batch } => (ControlAction::Retry, None, Some(batch)),
                    SessionVerb::Drop { batch } => (ControlAction::Drop, None, Some(batch)),
                };
                json(
                    &c.request::<_, ControlReceipt>(
                        ids::CONTROL_REQUEST,
                        &key,
                        &ControlRequest {
                            persona,
                            action,
                            model,
                            batch,
                        },
                    )
                    .await?,
                )
            }
        };
        c.close().await;
        println!("{out}");
        anyhow::Ok(())
    })
    .map_err(Failure::from)
}

fn json<T: Serialize>(v: &T) -> String {
    serde_json::to_string_pretty(v).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(serde::Deserialize)]
    struct Blocks {
        cultnet: Cultnet,
    }

    #[derive(serde::Deserialize)]
    struct Cultnet {
        client: Vec<gateway::config::Client>,
    }

    #[test]
    fn keygen_prints_the_least_grant_as_a_block_the_config_takes() {
        let block = grant_block("ops", &"ab".repeat(32), &["vera".to_owned()]);
        let parsed: Blocks = toml::from_str(&block).expect("a [[cultnet.client]] block");
        let c = &parsed.cultnet.client[0];
        assert_eq!(c.agent_id, "ops");
        assert!(c.allows_persona("vera"));
        assert!(!c.allows_persona("mira"), "one Persona, not all");
        let mut verbs = c.verbs.clone();
        verbs.sort_by_key(|v| format!("{v:?}"));
        assert_eq!(
            verbs,
            [
                gateway::config::Verb::Pending,
                gateway::config::Verb::Status
            ]
        );
    }
}
