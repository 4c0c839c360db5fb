//! The gateway's configuration (TOML; `deploy/gateway.example.toml` documents every key).
//!
//! [`Config::parse`] checks everything it can without touching the network: every error names
//! the Persona and the key. Access tokens are read by [`Persona::load_token`] from a file
//! (refused when group or others may read it) or a systemd credential, into a [`Secret`] whose
//! `Debug` and `Display` print `<redacted>`.

use std::collections::HashSet;
use std::fmt;
use std::path::{Path, PathBuf};

use serde::Deserialize;

/// A secret value: never printed, never logged.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    /// Wraps a secret value.
    pub fn new(value: String) -> Self {
        Self(value)
    }

    /// The value, for the one place that needs it (the Matrix client).
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("<redacted>")
    }
}

impl fmt::Display for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("<redacted>")
    }
}

/// A configuration problem, naming where it is.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}key `{key}`: {problem}", persona.as_ref().map(|p| format!("persona {p:?}: ")).unwrap_or_default())]
pub struct ConfigError {
    /// The Persona, when the key belongs to one.
    pub persona: Option<String>,
    /// The key (dotted path).
    pub key: String,
    /// What is wrong and, where possible, how to fix it.
    pub problem: String,
}

fn err(persona: Option<&str>, key: &str, problem: impl Into<String>) -> ConfigError {
    ConfigError {
        persona: persona.map(str::to_owned),
        key: key.to_owned(),
        problem: problem.into(),
    }
}

/// Per-Persona limits, with the defaults the issue names.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Limits {
    /// Pending deliveries at which the ear stops syncing.
    pub max_pending: u64,
    /// Context lines per delivery.
    pub context_lines: usize,
    /// Context bytes per delivery.
    pub context_bytes: usize,
    /// Events per `/messages` fetch.
    pub fetch_limit: usize,
    /// Events a gap fill may fetch at most.
    pub gap_fill_max: usize,
    /// How long an event that cannot be decrypted is held and retried before it is delivered
    /// with a placeholder text.
    pub undecryptable_wait_secs: u64,
    /// The largest image (PNG, JPEG, GIF, WebP) given to her live session as an image; a
    /// larger one reaches her as its description.
    pub max_image_bytes: u64,
    /// The largest text file (`text/*`) given to her as its text; a larger one reaches her as
    /// its description.
    pub max_text_file_bytes: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_pending: 1000,
            context_lines: 20,
            context_bytes: 16 * 1024,
            fetch_limit: 100,
            gap_fill_max: 1000,
            undecryptable_wait_secs: 600,
            // The Messages API takes images up to 5 MB.
            max_image_bytes: 5 * 1000 * 1000,
            max_text_file_bytes: 64 * 1024,
        }
    }
}

/// Whether the gateway runs her turns.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SessionMode {
    /// Mouth-only: CultNet clients (her Minds) read the inbox and drive turns themselves.
    #[default]
    Off,
    /// One live claude process, fed each new batch.
    Live,
}

/// Her live session: the claude CLI and when turns run.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SessionConfig {
    /// `off` or `live`.
    pub mode: SessionMode,
    /// The `claude` executable.
    pub claude: PathBuf,
    /// Model name.
    pub model: String,
    /// Her system prompt (the doctrine).
    pub system_prompt_file: Option<PathBuf>,
    /// Messages API base URL.
    pub api_base_url: String,
    /// File holding the model API key (mode 0600; never a Matrix token).
    pub api_key_file: Option<PathBuf>,
    /// Or: file holding a subscription OAuth token (mode 0600), handed to the CLI on a file
    /// descriptor, never in its environment or argv.
    pub oauth_token_file: Option<PathBuf>,
    /// Prompt cache TTL: `5m` or `1h`.
    pub cache_ttl: String,
    /// Extended thinking.
    pub thinking: bool,
    /// A turn starts once no new mail came for this long...
    pub debounce_ms: u64,
    /// ...or this long after the first waiting mail, whichever is first. Mail from an
    /// operator starts a turn at once.
    pub max_wait_ms: u64,
    /// A turn running longer is interrupted, then killed.
    pub turn_timeout_secs: u64,
    /// On SIGTERM a turn in flight may finish for this long; then it is given up (its batch
    /// stays in flight and is retried after the restart, its says still sent once).
    pub shutdown_grace_secs: u64,
    /// Turns kept in her history (`STATE/personas/ID/turns.jsonl`, read by `report`).
    pub history_turns: usize,
    /// Deliveries per batch at most.
    pub max_batch: usize,
    /// The model's context window in tokens: the refresh policy compacts or starts fresh well
    /// before the CLI's own limit (window - 23k).
    pub context_window: u64,
    /// After her cache has expired, a batch starts her fresh (rehydrated from her rooms) only
    /// once her conversation is this percent of what a fresh start sends; below it she goes on
    /// and the whole conversation is written to the cache again. 100 (the default) is cost
    /// alone: a fresh start carries her notes and each room's last lines, her own replies
    /// among them. More pays for continuity: in the session benchmark with 5 minutes, 125 cost
    /// 2-8% more on the workloads whose caches go cold. At least 100.
    pub continuity_percent: u32,
    /// Her initial state: a new session (her first, or a fresh start) is given it until a
    /// `state` note replaces it.
    pub state_file: Option<PathBuf>,
    /// Extra top-level fields of her reply (a JSON object `{"properties": {...}, "required":
    /// [...]}`); every such field of a reply goes to the extension outbox for CultNet clients.
    pub reply_schema_file: Option<PathBuf>,
    /// Before a planned compaction (the policy's or an operator's), one turn asks her to put
    /// what she must keep into her reply's extension fields (they go to the outbox).
    pub checkpoint_before_compact: bool,
    /// Her model's prices, when not its published ones (`[persona.session.prices]`): they
    /// drive the refresh policy and the cost she reports.
    pub prices: Option<PriceConfig>,
}

/// A model's prices as a base and a cache-read ratio; writes cost 1.25x (5 minutes) and 2x
/// (1 hour) the base and output 5x, as on every published model.
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PriceConfig {
    /// Dollars per million uncached input tokens.
    pub input: f64,
    /// A cache read's price as a share of `input` (0.1 on published models; 0.05 on some).
    #[serde(default = "PriceConfig::default_read_ratio")]
    pub cache_read_ratio: f64,
}

// Loading rejects NaN, so equality is reflexive on every loaded config.
impl Eq for PriceConfig {}

impl PriceConfig {
    fn default_read_ratio() -> f64 {
        0.1
    }

    /// The full table.
    pub fn table(&self) -> session::cost::Prices {
        session::cost::Prices::from_base(self.input, self.cache_read_ratio)
    }
}

impl Default for SessionConfig {
    fn default() -> Self {
        Self {
            mode: SessionMode::Off,
            claude: PathBuf::from("claude"),
            model: "claude-sonnet-4-5".to_owned(),
            system_prompt_file: None,
            api_base_url: "https://api.anthropic.com".to_owned(),
            api_key_file: None,
            oauth_token_file: None,
            cache_ttl: "1h".to_owned(),
            thinking: false,
            debounce_ms: 2_000,
            max_wait_ms: 15_000,
            turn_timeout_secs: 300,
            shutdown_grace_secs: 5,
            history_turns: 10_000,
            max_batch: 20,
            context_window: 200_000,
            continuity_percent: 100,
            state_file: None,
            reply_schema_file: None,
            checkpoint_before_compact: false,
            prices: None,
        }
    }
}

/// One Persona's Matrix account.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Persona {
    /// Short id (letters, digits, `-`, `_`).
    pub id: String,
    /// Homeserver base URL.
    pub homeserver: String,
    /// `@name:server`.
    pub user_id: String,
    /// Her stable device id (exactly-once sends depend on it).
    pub device_id: String,
    /// File holding her access token (mode 0600 or stricter).
    #[serde(default)]
    pub access_token_file: Option<PathBuf>,
    /// Or: the name of a systemd credential (`LoadCredential=`) holding it.
    #[serde(default)]
    pub access_token_credential: Option<String>,
    /// Rooms to join and listen in (aliases `#...` or ids `!...`).
    #[serde(default)]
    pub rooms: Vec<String>,
    /// Users whose DM invites she accepts.
    #[serde(default)]
    pub operators: Vec<String>,
    /// Limits.
    #[serde(default)]
    pub limits: Limits,
    /// Her live session (off by default: mouth-only).
    #[serde(default)]
    pub session: SessionConfig,
    /// What she may spend (`[persona.budget]`; no cap by default, which `check` warns of).
    #[serde(default)]
    pub budget: Budget,
    /// What starts her turns (`[persona.turns]`).
    #[serde(default)]
    pub turns: Turns,
    /// Her cryptographic identity and her Matrix store at rest (`[persona.encryption]`).
    #[serde(default)]
    pub encryption: Encryption,
}

/// Her cryptographic identity (cross-signing, key backup, recovery key) and her Matrix store
/// at rest. With the defaults she signs her own device at her first start (when the
/// homeserver lets the first upload through without a password), turns on key backup, and
/// writes her recovery key to `STATE/personas/ID/recovery-key` for the operator to keep.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Encryption {
    /// Bootstrap and check cross-signing and key backup at every start (default true).
    pub cross_signing: bool,
    /// Her account password (mode 0600), read only when the homeserver asks for it to accept
    /// her first cross-signing upload, and by `recover` to delete her lost device.
    pub password_file: Option<PathBuf>,
    /// Her recovery key (mode 0600): read when it exists, written once when she makes one.
    /// Default `STATE/personas/ID/recovery-key`.
    pub recovery_key_file: Option<PathBuf>,
    /// A passphrase for her Matrix store (mode 0600), which encrypts it at rest. Set it before
    /// her first start: an existing store cannot be opened with a new passphrase.
    pub store_passphrase_file: Option<PathBuf>,
    /// Or: the name of a systemd credential (`LoadCredential=`) holding the passphrase.
    pub store_passphrase_credential: Option<String>,
}

impl Default for Encryption {
    fn default() -> Self {
        Self {
            cross_signing: true,
            password_file: None,
            recovery_key_file: None,
            store_passphrase_file: None,
            store_passphrase_credential: None,
        }
    }
}

/// What starts a live Persona's turns ([`session::admission`] decides by these).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Turns {
    /// `"addressed"` (her operator's lines, DMs, mentions of her, replies to her, her threads),
    /// `"all"` (every line) or `"minds"` (only CultNet turn requests).
    pub start: session::admission::Start,
    /// Unaddressed mail may start at most one turn this often (0: never; it rides with her
    /// next turn).
    pub ambient_every_secs: u64,
    /// Turns one non-operator's lines may start in an hour.
    pub per_sender_per_hour: u32,
    /// Consecutive turns in one room started by other Personas of this gateway or by `bots`,
    /// with no human line between; past it their lines start no turn until a human speaks.
    pub bot_exchanges: u32,
    /// Users whose lines count as a bot's (besides the other Personas of this gateway).
    pub bots: Vec<String>,
    /// Waiting lines from members one public room keeps as mail; older ones are retired into
    /// the room's context (she reads the newest of them there at her next turn).
    pub waiting_lines: usize,
    /// Bytes of text of those waiting lines one room keeps (its newest line always).
    pub waiting_bytes: usize,
    /// Bytes of text a member's line not addressed to her shows in her batch (the rest is
    /// cut, saying how much).
    pub unaddressed_line_bytes: usize,
}

impl Default for Turns {
    fn default() -> Self {
        let r = session::admission::Rules::default();
        Self {
            start: r.start,
            ambient_every_secs: 0,
            per_sender_per_hour: r.per_sender_per_hour,
            bot_exchanges: r.bot_exchanges,
            bots: Vec::new(),
            waiting_lines: session::waiting::Bound::default().lines,
            waiting_bytes: session::waiting::Bound::default().bytes,
            unaddressed_line_bytes: session::waiting::Bound::default().line_bytes,
        }
    }
}

impl Turns {
    /// The rules [`session::admission`] decides by.
    pub fn rules(&self) -> session::admission::Rules {
        session::admission::Rules {
            start: self.start,
            ambient_every_ms: i64::try_from(self.ambient_every_secs.saturating_mul(1000))
                .unwrap_or(i64::MAX),
            per_sender_per_hour: self.per_sender_per_hour,
            bot_exchanges: self.bot_exchanges,
        }
    }

    /// The bound on a room's waiting mail [`session::waiting`] retires by.
    pub fn bound(&self) -> session::waiting::Bound {
        session::waiting::Bound {
            lines: self.waiting_lines,
            bytes: self.waiting_bytes,
            line_bytes: self.unaddressed_line_bytes,
        }
    }
}

/// What a live Persona may spend on the model: her operator's cap, enforced before any call
/// that costs (a turn, a keep-warm refresh, a compaction).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Budget {
    /// Dollars she may spend in any 24 hours (billed by her price table): [`DEFAULT_USD_PER_DAY`]
    /// unless set. Once reached, her mail waits (nothing is lost) until the window moves on or
    /// a reload raises the cap.
    pub usd_per_day: Option<f64>,
    /// The share of the cap (0 to less than 1) kept for her operators: once the rest is spent,
    /// only her operators' lines and DMs start turns.
    pub operator_reserve: f64,
}

/// Her daily cap when her config names none: a room cannot make her spend without limit.
pub const DEFAULT_USD_PER_DAY: f64 = 10.0;

impl Default for Budget {
    fn default() -> Self {
        Self {
            usd_per_day: Some(DEFAULT_USD_PER_DAY),
            operator_reserve: 0.25,
        }
    }
}

// Loading rejects NaN, so equality is reflexive on every loaded config.
impl Eq for Budget {}

/// The CultNet endpoint.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CultNet {
    /// Loopback address to bind.
    pub bind: std::net::SocketAddr,
    /// How far a Connect payload's `issuedAt` may be from now, in seconds.
    pub max_skew_secs: u64,
    /// The clients allowed to connect, each with its pinned key.
    #[serde(rename = "client")]
    pub clients: Vec<Client>,
    /// CultNet for remote peers over QUIC (off when absent).
    pub quic: Option<Quic>,
    /// Requests per second one client may make, sustained (a token bucket); past it (and its
    /// burst) a request is answered `failed`, retry later.
    pub requests_per_sec: u32,
    /// Requests one client may make at once above its rate.
    pub request_burst: u32,
    /// Sends and session verbs of one client running at once, at most.
    pub max_in_flight: usize,
}

/// `[cultnet.quic]`: the same service for remote peers, over QUIC.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Quic {
    /// Address to bind (any interface may be used: TLS 1.3 and the pinned client keys guard it).
    pub bind: std::net::SocketAddr,
    /// PEM certificate chain; with `key_file`. When both are absent, a self-signed certificate
    /// is made once and kept in `STATE/quic/` (clients pin it).
    #[serde(default)]
    pub cert_file: Option<PathBuf>,
    /// PEM private key of the certificate.
    #[serde(default)]
    pub key_file: Option<PathBuf>,
}

impl Default for CultNet {
    fn default() -> Self {
        Self {
            bind: std::net::SocketAddr::from(([127, 0, 0, 1], 47_004)),
            max_skew_secs: 120,
            clients: Vec::new(),
            quic: None,
            requests_per_sec: 10_000,
            request_burst: 10_000,
            max_in_flight: 16,
        }
    }
}

/// A request kind a CultNet client may be allowed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Verb {
    /// Read pending deliveries.
    Pending,
    /// Acknowledge deliveries.
    Ack,
    /// Say something in Matrix.
    Send,
    /// Ask for a session turn.
    Turn,
    /// Read the gateway's status.
    Status,
    /// Append a note to her next batch.
    Note,
    /// Pull and acknowledge her replies' extension fields.
    Extensions,
    /// Reset, compact, switch the model of, or report her session (operators).
    Session,
}

impl Verb {
    /// Every verb (a client's default).
    pub const ALL: [Verb; 8] = [
        Verb::Pending,
        Verb::Ack,
        Verb::Send,
        Verb::Turn,
        Verb::Status,
        Verb::Note,
        Verb::Extensions,
        Verb::Session,
    ];
}

/// A CultNet client: who it is, its pinned ed25519 key, and what it may do for whom.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Client {
    /// The `agentId` it signs its Connect payload as.
    pub agent_id: String,
    /// Its ed25519 public key, 64 hex digits.
    pub public_key: String,
    /// The Personas it may act for (`"*"`: all).
    pub personas: Vec<String>,
    /// What it may ask (all when absent).
    #[serde(default = "all_verbs")]
    pub verbs: Vec<Verb>,
    /// The local users (uids) whose sockets may use its key over loopback RUDP (any local
    /// user when absent; a client with `uids` cannot connect over QUIC). Whoever it is, a
    /// session stays with the user whose socket opened it.
    #[serde(default)]
    pub uids: Option<Vec<u32>>,
}

fn all_verbs() -> Vec<Verb> {
    Verb::ALL.to_vec()
}

impl Client {
    /// Its key as bytes (checked by [`Config::parse`], so this succeeds on a parsed config).
    pub fn key_bytes(&self) -> Option<[u8; 32]> {
        hex32(self.public_key.trim())
    }

    /// A client of `agent_id` with this public key, for these Personas and verbs.
    pub fn for_key(
        agent_id: &str,
        key: &ed25519_dalek::VerifyingKey,
        personas: &[&str],
        verbs: &[Verb],
    ) -> Self {
        Self {
            agent_id: agent_id.to_owned(),
            public_key: hex(key.as_bytes()),
            personas: personas.iter().map(|p| (*p).to_owned()).collect(),
            verbs: verbs.to_vec(),
            uids: None,
        }
    }

    /// May it act for `persona`?
    pub fn allows_persona(&self, persona: &str) -> bool {
        self.personas.iter().any(|p| p == "*" || p == persona)
    }
}

/// The whole configuration.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// Where the inbox and the Matrix stores live.
    pub state_dir: PathBuf,
    /// The CultNet endpoint.
    #[serde(default)]
    pub cultnet: CultNet,
    /// The Personas.
    #[serde(default, rename = "persona")]
    pub personas: Vec<Persona>,
    /// Prometheus metrics, `/healthz` and `/readyz` (off when absent).
    #[serde(default)]
    pub metrics: Option<MetricsConfig>,
    /// How long the inbox keeps what it no longer needs for delivery.
    #[serde(default)]
    pub retention: RetentionConfig,
    /// Live sessions across the gateway.
    #[serde(default)]
    pub sessions: SessionsConfig,
}

/// `[sessions]`: live sessions across the gateway.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SessionsConfig {
    /// Live claude processes at most (about 160 MB each): past it the least recently used
    /// idle Persona's process is stopped, her session kept on disk and resumed at her next
    /// turn.
    pub max_live: usize,
}

impl Default for SessionsConfig {
    fn default() -> Self {
        Self { max_live: 32 }
    }
}

/// `[retention]`: the inbox's event-id index and send receipts are pruned hourly of records
/// older than these, and its files are compacted when they are mostly dead records. Reloaded
/// on SIGHUP.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RetentionConfig {
    /// Days an event id is remembered to drop a sync's repeats (also at most 10,000 per
    /// Persona).
    pub event_ids_days: u32,
    /// Days a send receipt is kept to answer a repeated request without sending again.
    pub receipts_days: u32,
    /// The inbox's files are rewritten (hourly check) once they are at least this many MiB
    /// and four times what they hold: sled does not give back the space of removed records.
    pub compact_above_mib: u32,
}

impl Default for RetentionConfig {
    fn default() -> Self {
        Self {
            event_ids_days: 30,
            receipts_days: 30,
            compact_above_mib: 64,
        }
    }
}

/// The metrics listener.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MetricsConfig {
    /// A loopback address (a reverse proxy or the local Prometheus agent scrapes it).
    pub bind: std::net::SocketAddr,
}

impl Config {
    /// Parses and checks a configuration.
    pub fn parse(text: &str) -> Result<Self, ConfigError> {
        let cfg: Config = toml::from_str(text).map_err(|e| {
            let msg = e.message().to_owned();
            // toml names unknown and missing keys in its message; keep it whole.
            err(None, "(document)", msg)
        })?;
        cfg.check()?;
        Ok(cfg)
    }

    /// Reads and parses a configuration file.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|e| {
            err(
                None,
                "(file)",
                format!("cannot read {}: {e}", path.display()),
            )
        })?;
        Self::parse(&text)
    }

    fn check_clients(&self) -> Result<(), ConfigError> {
        if let Some(q) = &self.cultnet.quic {
            if q.cert_file.is_some() != q.key_file.is_some() {
                return Err(err(
                    None,
                    "cultnet.quic.cert_file",
                    "set both cert_file and key_file, or neither (a certificate is then made)",
                ));
            }
            if q.bind == self.cultnet.bind && q.bind.port() != 0 {
                return Err(err(
                    None,
                    "cultnet.quic.bind",
                    "must differ from cultnet.bind (both are UDP)",
                ));
            }
        }
        let mut agents = HashSet::new();
        for (i, c) in self.cultnet.clients.iter().enumerate() {
            let at = |field: &str| format!("cultnet.client[{i}].{field}");
            if c.agent_id.is_empty() || c.agent_id.len() > wire::docs::MAX_CONNECT_FIELD {
                return Err(err(None, &at("agent_id"), "must be 1-256 characters"));
            }
            if !agents.insert(c.agent_id.as_str()) {
                return Err(err(
                    None,
                    &at("agent_id"),
                    format!("{:?} is listed twice", c.agent_id),
                ));
            }
            let key_ok = c
                .key_bytes()
                .is_some_and(|k| ed25519_dalek::VerifyingKey::from_bytes(&k).is_ok());
            if !key_ok {
                return Err(err(
                    None,
                    &at("public_key"),
                    "must be an ed25519 public key as 64 hex digits",
                ));
            }
            if c.uids.as_ref().is_some_and(Vec::is_empty) {
                return Err(err(
                    None,
                    &at("uids"),
                    "names no one: list the uids that may use this key, or leave it out",
                ));
            }
            for (j, p) in c.personas.iter().enumerate() {
                if p != "*" && !self.personas.iter().any(|q| &q.id == p) {
                    return Err(err(
                        None,
                        &format!("cultnet.client[{i}].personas[{j}]"),
                        format!("{p:?} is not a configured Persona"),
                    ));
                }
            }
        }
        Ok(())
    }

    fn check(&self) -> Result<(), ConfigError> {
        if self.sessions.max_live == 0 {
            return Err(err(
                None,
                "sessions.max_live",
                "must be at least 1 (live claude processes across the gateway)",
            ));
        }
        if !self.cultnet.bind.ip().is_loopback() {
            return Err(err(
                None,
                "cultnet.bind",
                format!(
                    "{} is not loopback: CultNet RUDP binds loopback only (remote peers use QUIC)",
                    self.cultnet.bind
                ),
            ));
        }
        if let Some(m) = &self.metrics {
            if !m.bind.ip().is_loopback() {
                return Err(err(
                    None,
                    "metrics.bind",
                    format!(
                        "{} is not loopback: metrics are served on loopback only",
                        m.bind
                    ),
                ));
            }
        }
        self.check_clients()?;
        let mut ids = HashSet::new();
        for (i, p) in self.personas.iter().enumerate() {
            let who = Some(p.id.as_str()).filter(|s| !s.is_empty());
            if p.id.is_empty()
                || !p
                    .id
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
            {
                return Err(err(
                    who,
                    &format!("persona[{i}].id"),
                    "must be non-empty letters, digits, '-' or '_'",
                ));
            }
            if !ids.insert(p.id.as_str()) {
                return Err(err(who, "id", "another Persona has the same id"));
            }
            if !(p.homeserver.starts_with("http://") || p.homeserver.starts_with("https://")) {
                return Err(err(
                    who,
                    "homeserver",
                    format!("{:?} is not an http(s) URL", p.homeserver),
                ));
            }
            if !is_user_id(&p.user_id) {
                return Err(err(
                    who,
                    "user_id",
                    format!("{:?} is not a Matrix user id (@name:server)", p.user_id),
                ));
            }
            if p.device_id.trim().is_empty() {
                return Err(err(
                    who,
                    "device_id",
                    "must be set: a stable device id makes sends exactly-once",
                ));
            }
            match (&p.access_token_file, &p.access_token_credential) {
                (Some(_), Some(_)) => {
                    return Err(err(
                        who,
                        "access_token_file",
                        "set either access_token_file or access_token_credential, not both",
                    ))
                }
                (None, None) => {
                    return Err(err(
                        who,
                        "access_token_file",
                        "missing: set access_token_file or access_token_credential",
                    ))
                }
                _ => {}
            }
            if p.encryption.store_passphrase_file.is_some()
                && p.encryption.store_passphrase_credential.is_some()
            {
                return Err(err(
                    who,
                    "encryption.store_passphrase_file",
                    "set either store_passphrase_file or store_passphrase_credential, not both",
                ));
            }
            for (j, r) in p.rooms.iter().enumerate() {
                if !(r.starts_with('#') || r.starts_with('!')) {
                    return Err(err(
                        who,
                        &format!("rooms[{j}]"),
                        format!("{r:?} is neither an alias (#...) nor a room id (!...)"),
                    ));
                }
            }
            for (j, o) in p.operators.iter().enumerate() {
                if !is_user_id(o) {
                    return Err(err(
                        who,
                        &format!("operators[{j}]"),
                        format!("{o:?} is not a Matrix user id"),
                    ));
                }
            }
            for (j, b) in p.turns.bots.iter().enumerate() {
                if !is_user_id(b) {
                    return Err(err(
                        who,
                        &format!("turns.bots[{j}]"),
                        format!("{b:?} is not a Matrix user id"),
                    ));
                }
            }
            if let Some(cap) = p.budget.usd_per_day {
                if !(cap.is_finite() && cap >= 0.0) {
                    return Err(err(
                        who,
                        "budget.usd_per_day",
                        format!("{cap} is not an amount in dollars (0 or more)"),
                    ));
                }
            }
            let r = p.budget.operator_reserve;
            if !(r.is_finite() && (0.0..1.0).contains(&r)) {
                return Err(err(
                    who,
                    "budget.operator_reserve",
                    format!("{r} is not a share of the cap (0 to less than 1, e.g. 0.25)"),
                ));
            }
            let sc = &p.session;
            if sc.mode == SessionMode::Live {
                if sc.system_prompt_file.is_none() {
                    return Err(err(
                        who,
                        "session.system_prompt_file",
                        "required when session.mode = \"live\"",
                    ));
                }
                match (&sc.api_key_file, &sc.oauth_token_file) {
                    (None, None) => {
                        return Err(err(
                            who,
                            "session.api_key_file",
                            "required when session.mode = \"live\" (or session.oauth_token_file)",
                        ))
                    }
                    (Some(_), Some(_)) => {
                        return Err(err(
                            who,
                            "session.oauth_token_file",
                            "set either session.api_key_file or session.oauth_token_file, not both",
                        ))
                    }
                    _ => {}
                }
            }
            if !matches!(sc.cache_ttl.as_str(), "5m" | "1h") {
                return Err(err(
                    who,
                    "session.cache_ttl",
                    format!("{:?} is neither \"5m\" nor \"1h\"", sc.cache_ttl),
                ));
            }
            if let Some(p) = &sc.prices {
                if !(p.input.is_finite() && p.input > 0.0 && p.input < 1_000.0) {
                    return Err(err(
                        who,
                        "session.prices.input",
                        format!(
                            "{} is not a price in dollars per million tokens (0 < input < 1000)",
                            p.input
                        ),
                    ));
                }
                if !(p.cache_read_ratio > 0.0 && p.cache_read_ratio <= 1.0) {
                    return Err(err(
                        who,
                        "session.prices.cache_read_ratio",
                        format!(
                            "{} is not a share of the input price (0 < ratio <= 1)",
                            p.cache_read_ratio
                        ),
                    ));
                }
            }
            if sc.context_window < 50_000 {
                return Err(err(
                    who,
                    "session.context_window",
                    "must be at least 50000 tokens (the CLI keeps 23k of it for itself)",
                ));
            }
            if sc.continuity_percent < 100 {
                return Err(err(
                    who,
                    "session.continuity_percent",
                    format!(
                        "{} is below 100: she would start fresh with a conversation smaller than the fresh start",
                        sc.continuity_percent
                    ),
                ));
            }
            for (k, v) in [
                ("session.turn_timeout_secs", sc.turn_timeout_secs),
                ("session.max_batch", sc.max_batch as u64),
                ("session.max_wait_ms", sc.max_wait_ms),
            ] {
                if v == 0 {
                    return Err(err(who, k, "must be greater than 0"));
                }
            }
            let l = &p.limits;
            for (k, v) in [
                ("limits.max_pending", l.max_pending as usize),
                ("limits.context_lines", l.context_lines),
                ("limits.context_bytes", l.context_bytes),
                ("limits.fetch_limit", l.fetch_limit),
                ("limits.gap_fill_max", l.gap_fill_max),
                ("turns.waiting_lines", p.turns.waiting_lines),
                ("turns.waiting_bytes", p.turns.waiting_bytes),
                (
                    "turns.unaddressed_line_bytes",
                    p.turns.unaddressed_line_bytes,
                ),
            ] {
                if v == 0 {
                    return Err(err(who, k, "must be greater than 0"));
                }
            }
        }
        Ok(())
    }
}

fn is_user_id(s: &str) -> bool {
    s.starts_with('@')
        && s.split_once(':')
            .is_some_and(|(name, server)| name.len() > 1 && !server.is_empty())
}

impl Persona {
    /// Where her recovery key is kept: `encryption.recovery_key_file`, or
    /// `STATE/personas/ID/recovery-key`.
    pub fn recovery_key_path(&self, state_dir: &Path) -> PathBuf {
        self.encryption
            .recovery_key_file
            .clone()
            .unwrap_or_else(|| {
                state_dir
                    .join("personas")
                    .join(&self.id)
                    .join("recovery-key")
            })
    }

    /// Reads her recovery key, `None` when its file does not exist (yet). A file readable by
    /// group or others is refused.
    pub fn load_recovery_key(&self, state_dir: &Path) -> Result<Option<Secret>, ConfigError> {
        let path = self.recovery_key_path(state_dir);
        if !path.exists() {
            return Ok(None);
        }
        read_private(&path)
            .map(Some)
            .map_err(|p| err(Some(&self.id), "encryption.recovery_key_file", p))
    }

    /// Reads her account password, `None` when none is configured.
    pub fn load_password(&self) -> Result<Option<Secret>, ConfigError> {
        let Some(path) = &self.encryption.password_file else {
            return Ok(None);
        };
        read_private(path)
            .map(Some)
            .map_err(|p| err(Some(&self.id), "encryption.password_file", p))
    }

    /// Reads the passphrase of her Matrix store, `None` when none is configured.
    pub fn load_store_passphrase(&self) -> Result<Option<Secret>, ConfigError> {
        let e = &self.encryption;
        let who = Some(self.id.as_str());
        let path = match (&e.store_passphrase_file, &e.store_passphrase_credential) {
            (Some(f), _) => f.clone(),
            (None, Some(name)) => credential(who, "encryption.store_passphrase_credential", name)?,
            (None, None) => return Ok(None),
        };
        read_private(&path)
            .map(Some)
            .map_err(|p| err(who, "encryption.store_passphrase_file", p))
    }

    /// Reads her access token. A token file readable by group or others is refused.
    pub fn load_token(&self) -> Result<Secret, ConfigError> {
        let who = Some(self.id.as_str());
        let path = match (&self.access_token_file, &self.access_token_credential) {
            (Some(f), _) => {
                check_private(f).map_err(|p| err(who, "access_token_file", p))?;
                f.clone()
            }
            (None, Some(name)) => credential(who, "access_token_credential", name)?,
            (None, None) => return Err(err(who, "access_token_file", "missing")),
        };
        let text = std::fs::read_to_string(&path).map_err(|e| {
            err(
                who,
                "access_token_file",
                format!("cannot read {}: {e}", path.display()),
            )
        })?;
        let token = text.trim();
        if token.is_empty() {
            return Err(err(
                who,
                "access_token_file",
                format!("{} is empty", path.display()),
            ));
        }
        Ok(Secret(token.to_owned()))
    }
}

impl SessionConfig {
    /// Her refresh policy's constants: the defaults for her cache TTL, her context window, the
    /// continuity she is configured to pay for, and her model's prices.
    pub fn policy(
        &self,
        ttl: session::cost::Ttl,
        prices: session::cost::Prices,
    ) -> session::policy::PolicyConfig {
        session::policy::PolicyConfig {
            context_window: self.context_window,
            cold_prefix_factor: f64::from(self.continuity_percent) / 100.0,
            prices,
            ..session::policy::PolicyConfig::for_ttl(ttl)
        }
    }

    /// Her reply schema: the base one plus `reply_schema_file`'s fields (checked).
    pub fn reply_schema(&self, persona: &str) -> Result<session::render::ReplySchema, ConfigError> {
        let who = Some(persona);
        let ext = match &self.reply_schema_file {
            Some(path) => {
                let text = std::fs::read_to_string(path).map_err(|e| {
                    err(
                        who,
                        "session.reply_schema_file",
                        format!("cannot read {}: {e}", path.display()),
                    )
                })?;
                let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| {
                    err(
                        who,
                        "session.reply_schema_file",
                        format!("{} is not JSON: {e}", path.display()),
                    )
                })?;
                Some(v)
            }
            None => None,
        };
        session::render::ReplySchema::new(ext.as_ref())
            .map_err(|e| err(who, "session.reply_schema_file", e.to_string()))
    }

    /// Reads her model credential: the API key, or the OAuth token (a file readable by group
    /// or others is refused). Read again whenever the API refuses it, so a rotated key works
    /// without a restart.
    pub fn load_credential(
        &self,
        persona: &str,
    ) -> Result<session::driver::Credential, ConfigError> {
        match &self.oauth_token_file {
            Some(path) => read_private(path)
                .map(|t| session::driver::Credential::OAuth(t.0))
                .map_err(|p| err(Some(persona), "session.oauth_token_file", p)),
            None => self
                .load_api_key(persona)
                .map(|k| session::driver::Credential::ApiKey(k.0)),
        }
    }

    /// Reads the model API key (a file readable by group or others is refused).
    pub fn load_api_key(&self, persona: &str) -> Result<Secret, ConfigError> {
        let who = Some(persona);
        let path = self
            .api_key_file
            .as_ref()
            .ok_or_else(|| err(who, "session.api_key_file", "missing"))?;
        check_private(path).map_err(|p| err(who, "session.api_key_file", p))?;
        let text = std::fs::read_to_string(path).map_err(|e| {
            err(
                who,
                "session.api_key_file",
                format!("cannot read {}: {e}", path.display()),
            )
        })?;
        Ok(Secret(text.trim().to_owned()))
    }
}

/// A new ed25519 seed: two v4 UUIDs (122 random bits each) hashed, so every bit is uniform.
pub fn new_key_seed() -> [u8; 32] {
    let mut raw = [0u8; 32];
    raw[..16].copy_from_slice(&uuid::Uuid::new_v4().into_bytes());
    raw[16..].copy_from_slice(&uuid::Uuid::new_v4().into_bytes());
    sha2::Digest::finalize(sha2::Digest::chain_update(
        <sha2::Sha256 as sha2::Digest>::new(),
        raw,
    ))
    .into()
}

/// Writes `text` and a newline to a new file only its owner may read (0600), synced; an
/// existing file is an error, never overwritten.
pub fn write_private(path: &Path, text: &str) -> std::io::Result<()> {
    use std::io::Write;
    let mut opts = std::fs::OpenOptions::new();
    opts.write(true).create_new(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut opts, 0o600);
    let mut f = opts.open(path)?;
    writeln!(f, "{text}")?;
    f.sync_all()
}

/// Reads a secret from a file only its owner may read (trimmed; empty is an error).
pub fn read_private(path: &Path) -> Result<Secret, String> {
    check_private(path)?;
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let value = text.trim();
    if value.is_empty() {
        return Err(format!("{} is empty", path.display()));
    }
    Ok(Secret(value.to_owned()))
}

/// The file of systemd credential `name` (`LoadCredential=`), for config key `key`.
fn credential(who: Option<&str>, key: &str, name: &str) -> Result<PathBuf, ConfigError> {
    let dir = std::env::var_os("CREDENTIALS_DIRECTORY").ok_or_else(|| {
        err(
            who,
            key,
            "CREDENTIALS_DIRECTORY is not set: is the gateway running under systemd with LoadCredential=?",
        )
    })?;
    Ok(Path::new(&dir).join(name))
}

/// Bytes as lowercase hex digits (keys in the config, digests in ids and logs).
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// 64 hex digits as 32 bytes.
pub fn hex32(hex: &str) -> Option<[u8; 32]> {
    if hex.len() != 64 || !hex.is_ascii() {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, pair) in hex.as_bytes().chunks(2).enumerate() {
        out[i] = u8::from_str_radix(std::str::from_utf8(pair).ok()?, 16).ok()?;
    }
    Some(out)
}

#[cfg(unix)]
fn check_private(path: &Path) -> Result<(), String> {
    use std::os::unix::fs::PermissionsExt;
    let meta =
        std::fs::metadata(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let mode = meta.permissions().mode() & 0o777;
    if mode & 0o077 != 0 {
        return Err(format!(
            "{} is readable by group or others (mode {mode:04o}); run `chmod 600 {}`",
            path.display(),
            path.display()
        ));
    }
    Ok(())
}

#[cfg(not(unix))]
fn check_private(_: &Path) -> Result<(), String> {
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r##"
state_dir = "/tmp/x"
[[persona]]
id = "mira"
homeserver = "http://127.0.0.1:8008"
user_id = "@mira:localhost"
device_id = "CULTNET-MIRA"
access_token_file = "/tmp/mira.token"
rooms = ["#lobby:localhost", "!abc"]
operators = ["@op:localhost"]
"##;

    fn with(replace: &str, by: &str) -> Result<Config, ConfigError> {
        Config::parse(&GOOD.replace(replace, by))
    }

    #[test]
    fn good_config_and_defaults() {
        let c = Config::parse(GOOD).unwrap();
        assert_eq!(c.personas[0].limits, Limits::default());
        assert_eq!(c.personas[0].limits.max_pending, 1000);
        assert!(c.cultnet.bind.ip().is_loopback());
    }

    const KEY: &str = "3b6a27bcceb6a42d62a3a8d02a6f0d73653215771de243a63ac048a18b59da29";

    fn client(body: &str) -> Result<Config, ConfigError> {
        Config::parse(&format!("{GOOD}\n[[cultnet.client]]\n{body}"))
    }

    #[test]
    fn clients_need_a_real_key_known_personas_and_a_unique_id() {
        let c = client(&format!(
            "agent_id = \"organ\"\npublic_key = \"{KEY}\"\npersonas = [\"mira\"]"
        ))
        .unwrap();
        let organ = &c.cultnet.clients[0];
        assert_eq!(organ.verbs, Verb::ALL.to_vec(), "all verbs by default");
        assert!(organ.allows_persona("mira") && !organ.allows_persona("otto"));
        let c = client(&format!(
            "agent_id = \"hb\"\npublic_key = \"{KEY}\"\npersonas = [\"*\"]\nverbs = [\"status\", \"turn\"]"
        ))
        .unwrap();
        assert_eq!(c.cultnet.clients[0].verbs, vec![Verb::Status, Verb::Turn]);
        assert!(c.cultnet.clients[0].allows_persona("anyone"));
        let e = client(&format!(
            "agent_id = \"o\"\npublic_key = \"{}\"\npersonas = []",
            &KEY[2..]
        ))
        .unwrap_err();
        assert_eq!(e.key, "cultnet.client[0].public_key");
        let e = client(&format!(
            "agent_id = \"o\"\npublic_key = \"{KEY}\"\npersonas = [\"otto\"]"
        ))
        .unwrap_err();
        assert_eq!(e.key, "cultnet.client[0].personas[0]");
        assert!(e.problem.contains("not a configured Persona"));
        let one = format!("agent_id = \"o\"\npublic_key = \"{KEY}\"\npersonas = []");
        let e = client(&format!("{one}\n[[cultnet.client]]\n{one}")).unwrap_err();
        assert_eq!(e.key, "cultnet.client[1].agent_id");
        let e = client(&format!("{one}\nverbs = [\"delete\"]")).unwrap_err();
        assert!(e.problem.contains("delete"), "{e}");
        assert_eq!(client(&one).unwrap().cultnet.clients[0].uids, None);
        let c = client(&format!("{one}\nuids = [1000, 1001]")).unwrap();
        assert_eq!(c.cultnet.clients[0].uids, Some(vec![1000, 1001]));
        let e = client(&format!("{one}\nuids = []")).unwrap_err();
        assert_eq!(e.key, "cultnet.client[0].uids");
        assert!(client(&format!("{one}\nuids = [-1]")).is_err());
    }

    #[test]
    fn prices_are_a_base_and_a_read_ratio_checked_on_load() {
        let prices = |body: &str| Config::parse(&format!("{GOOD}\n[persona.session]\n{body}"));
        let c = prices("prices = { input = 3.0, cache_read_ratio = 0.05 }").unwrap();
        let p = c.personas[0].session.prices.unwrap().table();
        assert_eq!(
            (p.input, p.cache_read, p.output),
            (3.0, 0.15000000000000002, 15.0)
        );
        let c = prices("prices = { input = 1.0 }").unwrap();
        assert_eq!(c.personas[0].session.prices.unwrap().cache_read_ratio, 0.1);
        assert_eq!(
            Config::parse(GOOD).unwrap().personas[0].session.prices,
            None
        );
        for (body, key) in [
            ("prices = { input = 0.0 }", "session.prices.input"),
            ("prices = { input = -3.0 }", "session.prices.input"),
            ("prices = { input = nan }", "session.prices.input"),
            (
                "prices = { input = 3.0, cache_read_ratio = 0.0 }",
                "session.prices.cache_read_ratio",
            ),
            (
                "prices = { input = 3.0, cache_read_ratio = 1.5 }",
                "session.prices.cache_read_ratio",
            ),
        ] {
            let e = prices(body).unwrap_err();
            assert_eq!(e.key, key, "{body}: {e}");
            assert_eq!(e.persona.as_deref(), Some("mira"));
        }
        assert!(
            prices("prices = { input = 3.0, output = 9.0 }").is_err(),
            "unknown keys refused"
        );
    }

    #[test]
    fn what_starts_a_turn_has_defaults_and_is_checked_on_load() {
        use session::admission::Start;
        let turns = |body: &str| Config::parse(&format!("{GOOD}\n[persona.turns]\n{body}"));
        let d = &Config::parse(GOOD).unwrap().personas[0].turns;
        assert_eq!(
            (
                d.start,
                d.ambient_every_secs,
                d.per_sender_per_hour,
                d.bot_exchanges
            ),
            (Start::Addressed, 0, 10, 3)
        );
        assert_eq!((d.waiting_lines, d.waiting_bytes), (20, 16 * 1024));
        let e = turns("waiting_lines = 0").unwrap_err();
        assert_eq!(e.key, "turns.waiting_lines");
        let c = turns("start = \"minds\"\nambient_every_secs = 600\nbots = [\"@hal:l\"]").unwrap();
        let t = &c.personas[0].turns;
        assert_eq!(
            (t.start, t.rules().ambient_every_ms),
            (Start::Minds, 600_000)
        );
        assert_eq!(
            turns("start = \"all\"").unwrap().personas[0].turns.start,
            Start::All
        );
        assert!(turns("start = \"some\"").is_err());
        let e = turns("bots = [\"hal\"]").unwrap_err();
        assert_eq!(e.key, "turns.bots[0]");
        assert!(
            turns("per_sender_an_hour = 1").is_err(),
            "unknown keys refused"
        );
    }

    #[test]
    fn live_processes_are_capped_gateway_wide() {
        assert_eq!(Config::parse(GOOD).unwrap().sessions.max_live, 32);
        let with = |body: &str| Config::parse(&format!("{GOOD}\n[sessions]\n{body}"));
        assert_eq!(with("max_live = 2").unwrap().sessions.max_live, 2);
        assert_eq!(with("max_live = 0").unwrap_err().key, "sessions.max_live");
    }

    #[test]
    fn a_budget_is_dollars_a_day_checked_on_load() {
        let budget = |body: &str| Config::parse(&format!("{GOOD}\n[persona.budget]\n{body}"));
        let d = &Config::parse(GOOD).unwrap().personas[0].budget;
        assert_eq!(
            (d.usd_per_day, d.operator_reserve),
            (Some(DEFAULT_USD_PER_DAY), 0.25)
        );
        assert_eq!(
            budget("operator_reserve = 1.0").unwrap_err().key,
            "budget.operator_reserve"
        );
        let c = budget("usd_per_day = 2.5").unwrap();
        assert_eq!(c.personas[0].budget.usd_per_day, Some(2.5));
        for body in [
            "usd_per_day = -1.0",
            "usd_per_day = nan",
            "usd_per_day = inf",
        ] {
            let e = budget(body).unwrap_err();
            assert_eq!(e.key, "budget.usd_per_day", "{body}: {e}");
            assert_eq!(e.persona.as_deref(), Some("mira"));
        }
        assert!(budget("usd_a_day = 1.0").is_err(), "unknown keys refused");
    }

    #[test]
    fn continuity_is_a_percent_of_at_least_100() {
        let session = |body: &str| Config::parse(&format!("{GOOD}\n[persona.session]\n{body}"));
        assert_eq!(
            Config::parse(GOOD).unwrap().personas[0]
                .session
                .continuity_percent,
            100
        );
        let c = session("continuity_percent = 100").unwrap();
        assert_eq!(c.personas[0].session.continuity_percent, 100);
        let e = session("continuity_percent = 99").unwrap_err();
        assert_eq!(e.key, "session.continuity_percent");
        assert_eq!(e.persona.as_deref(), Some("mira"));
        assert!(
            session("continuity_percent = 1.5").is_err(),
            "a whole percent"
        );
        // It is what the policy weighs a cold cache with.
        use session::cost::{Prices, Ttl};
        use session::policy::{decide, Decision, Reason, Telemetry};
        let now = std::time::Instant::now();
        let cold = Telemetry {
            batch_waiting: true,
            prefix_tokens: 36_000,
            rehydration_tokens: 30_000,
            last_cache_touch: Some(now - std::time::Duration::from_secs(3600)),
            ..Telemetry::default()
        };
        let decided = |body: &str| {
            let c = session(body).unwrap();
            let policy = c.personas[0]
                .session
                .policy(Ttl::FiveMinutes, Prices::default());
            decide(&cold, now, &policy)
        };
        // 1.2x a fresh start: at 125 she goes on, at 100 she starts fresh.
        assert_eq!(decided("continuity_percent = 125"), Decision::Continue);
        assert_eq!(
            decided("continuity_percent = 100"),
            Decision::FreshStart(Reason::ColdCache)
        );
    }

    #[test]
    fn her_encryption_keys_are_read_from_private_files_with_sane_defaults() {
        let enc = |body: &str| Config::parse(&format!("{GOOD}\n[persona.encryption]\n{body}"));
        let c = Config::parse(GOOD).unwrap();
        let p = &c.personas[0];
        assert!(p.encryption.cross_signing, "on by default");
        assert_eq!(
            p.recovery_key_path(Path::new("/s")),
            Path::new("/s/personas/mira/recovery-key")
        );
        assert_eq!(p.load_password().unwrap(), None);
        assert_eq!(p.load_store_passphrase().unwrap(), None);
        let e =
            enc("store_passphrase_file = \"/a\"\nstore_passphrase_credential = \"b\"").unwrap_err();
        assert_eq!(e.key, "encryption.store_passphrase_file");
        assert!(enc("recovery_key = \"x\"").is_err(), "unknown keys refused");

        let dir = crate::scratch::Dir::new("enc-keys");
        std::fs::create_dir_all(&*dir).unwrap();
        let key = dir.join("key");
        let c = enc(&format!(
            "recovery_key_file = {key:?}\npassword_file = {key:?}"
        ))
        .unwrap();
        let p = &c.personas[0];
        assert_eq!(p.load_recovery_key(&dir).unwrap(), None, "not there yet");
        write_private(&key, "EsTc abcd").unwrap();
        assert_eq!(
            p.load_recovery_key(&dir).unwrap().unwrap().expose(),
            "EsTc abcd"
        );
        assert_eq!(p.load_password().unwrap().unwrap().expose(), "EsTc abcd");
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o644)).unwrap();
        let e = p.load_recovery_key(&dir).unwrap_err();
        assert_eq!(e.key, "encryption.recovery_key_file");
        assert!(e.problem.contains("chmod 600"), "{e}");
    }

    #[test]
    fn quic_needs_both_pem_files_or_none_and_its_own_port() {
        let quic = |body: &str| Config::parse(&format!("{GOOD}\n[cultnet.quic]\n{body}"));
        let c = quic("bind = \"0.0.0.0:47005\"").unwrap();
        assert_eq!(c.cultnet.quic.unwrap().cert_file, None);
        let e = quic("bind = \"0.0.0.0:47005\"\ncert_file = \"/x.pem\"").unwrap_err();
        assert_eq!(e.key, "cultnet.quic.cert_file");
        let e = quic("bind = \"127.0.0.1:47004\"").unwrap_err();
        assert_eq!(e.key, "cultnet.quic.bind");
    }

    #[test]
    fn every_error_names_persona_and_key() {
        let cases = [
            (with("\"#lobby:localhost\"", "\"lobby\""), "rooms[0]"),
            (with("@mira:localhost", "mira"), "user_id"),
            (with("http://127.0.0.1:8008", "ftp://x"), "homeserver"),
            (with("@op:localhost", "op"), "operators[0]"),
            (
                with("device_id = \"CULTNET-MIRA\"", "device_id = \" \""),
                "device_id",
            ),
            (
                with("access_token_file = \"/tmp/mira.token\"", ""),
                "access_token_file",
            ),
            (
                with(
                    "access_token_file = \"/tmp/mira.token\"",
                    "access_token_file = \"/a\"\naccess_token_credential = \"b\"",
                ),
                "access_token_file",
            ),
            (
                with(
                    "operators = [\"@op:localhost\"]",
                    "operators = []\n[persona.limits]\nmax_pending = 0",
                ),
                "limits.max_pending",
            ),
        ];
        for (r, key) in cases {
            let e = r.unwrap_err();
            assert_eq!(e.key, key, "{e}");
            assert_eq!(e.persona.as_deref(), Some("mira"), "{e}");
            assert!(e.to_string().starts_with("persona \"mira\": key"), "{e}");
        }
        let twice = format!("{GOOD}{}", &GOOD[GOOD.find("[[persona]]").unwrap()..]);
        assert_eq!(Config::parse(&twice).unwrap_err().key, "id");
        let e = with("rooms =", "roooms =").unwrap_err();
        assert!(e.problem.contains("roooms"), "unknown keys are named: {e}");
        let e = Config::parse(&format!("{GOOD}\n[cultnet]\nbind = \"0.0.0.0:47004\"")).unwrap_err();
        assert_eq!(e.key, "cultnet.bind");
    }

    #[test]
    fn tokens_are_private_and_never_printed() {
        use std::os::unix::fs::PermissionsExt;
        let dir = crate::scratch::Dir::new("config");
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("mira.token");
        std::fs::write(&file, "syt_secret_token\n").unwrap();
        let mut c = Config::parse(GOOD).unwrap();
        c.personas[0].access_token_file = Some(file.clone());
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).unwrap();
        let e = c.personas[0].load_token().unwrap_err();
        assert!(
            e.problem.contains("chmod 600") && e.problem.contains("0644"),
            "{e}"
        );
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
        let t = c.personas[0].load_token().unwrap();
        assert_eq!(t.expose(), "syt_secret_token");
        assert_eq!(format!("{t:?} {t}"), "<redacted> <redacted>");
        assert!(!format!("{:?}", c.personas[0]).contains("syt_"));
    }

    #[test]
    fn the_example_config_parses() {
        let text = include_str!("../../deploy/gateway.example.toml");
        let c = Config::parse(text).unwrap();
        assert!(!c.personas.is_empty());
    }
}
