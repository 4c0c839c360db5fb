//! The turn loop of a live Persona: pending mail -> one batch -> one turn of her claude
//! process -> her says through the mouth -> ack.
//!
//! - Triggers: new mail after a quiet period (`debounce_ms`), or `max_wait_ms` after the
//!   first waiting mail; at once when an operator wrote to her, or on a turn request.
//! - Exactly once: the batch in flight (its first and last seq) is stored before the turn;
//!   after a crash the same batch is retried, so its says keep their request ids
//!   (`session::render::say_request_id`) and the mouth sends each once. The batch is acked
//!   only after every say has a receipt.
//! - How one turn runs once its batch is chosen (the policy's fresh start or compaction, the
//!   text sent, a dead process replaced up to [`ATTEMPTS`] times, a `[retry]` note instead of a
//!   batch her transcript holds, a refusal as too long, an API error) is decided by
//!   `session::attempt`; which batch is decided by `session::turn`. This module performs their
//!   actions: it spawns and resumes her process, composes texts, compacts, sends, commits.
//! - The session id is stored after its first turn; a restarted gateway resumes it (with the
//!   current system prompt when the file changed).
//! - A reply naming a room that is not hers, or no structured reply, sends nothing; the next
//!   batch carries a correction note.
//! - The refresh policy (`session::policy::decide`) runs before each turn and on the timer it
//!   asks for while idle: a compaction runs the CLI's `/compact` (falling back to a fresh
//!   start when it does not compact); a fresh start gives the new session the last lines of her
//!   rooms; keep-warm refreshes the cache with a forked,
//!   unpersisted request; an idle process is evicted (its session stays resumable).
//! - Notes from her Minds (`inbox::notes`) ride with her next batch in their labelled section;
//!   a note with `wake` gets a turn of its own. A new session (her first, or a fresh start) is
//!   given the latest note of each replacing kind (or her `state_file`). After a restart of the
//!   gateway or of her process, her first batch says so, how long since her last turn, and
//!   whether her session was resumed.
//! - A turn ends with one inbox commit: its deliveries acked, the notes it showed removed, and
//!   her reply's extension fields queued for CultNet clients.
//! - Operators' verbs (reset, compact, model, status) arrive on a channel and are applied only
//!   between turns; their receipt goes back once applied.
//! - Each turn's telemetry is written to `STATE/personas/ID/status.json` (last 50 turns).

use std::collections::{BTreeMap, VecDeque};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;
use session::admission::{Admission, Line, Rules};
use session::attempt::{Action, Attempt, CompactWhy, Event, Failure, Ran, Restarted, Start, Text};
use session::cost::{Prices, Usage};
use session::driver::{Cli, CliConfig, DriverError, Turn};
use session::policy::{self, Decision, PolicyConfig, Process, Telemetry};
use session::proto::CompactMetadata;
use session::render::{self, Note, ReplySchema, Seen};
use session::turn::{Drain, Look, Shrink, Step};
use sha2::{Digest, Sha256};
use tokio::sync::{mpsc, oneshot, watch, Notify};
use wire::docs::{ControlReceipt, ControlRequest, Delivery, SendRequest, Status};

use crate::config::Persona;
use crate::ear::Signals;
use crate::inbox::{Inbox, InboxError, TurnCommit};
use crate::matrix::Backoff;
use crate::metrics::Metrics;
use crate::mouth::{Mouth, Shape};
use crate::processes::{LiveSlot, Processes};

mod attempt;
mod compose;
mod deliver;
mod drain;
mod records;
mod run;
mod verbs;

use attempt::respawning;
pub use records::{append_history, read_history, RecordKind, TurnRecord};
use records::{learned, prices_for, Records, StatusFile};

/// CLI runs per text in one turn (a process that dies, a resume that fails, is retried).
pub use session::attempt::ATTEMPTS;
/// Turns kept in the status file.
pub const TELEMETRY_KEPT: usize = 50;

/// Operators' verbs waiting at most (a full queue answers `failed` at once).
pub const CONTROL_QUEUE: usize = 16;

/// An operator's verb for her turn loop, and where its receipt goes once applied.
#[derive(Debug)]
pub struct Control {
    /// The verb.
    pub request: ControlRequest,
    /// The receipt.
    pub reply: oneshot::Sender<ControlReceipt>,
}

/// Why a round of turns stopped early (the batch stays pending and is retried).
#[derive(Debug, thiserror::Error)]
pub enum TurnError {
    /// The inbox failed.
    #[error(transparent)]
    Inbox(#[from] InboxError),
    /// The CLI failed [`ATTEMPTS`] times.
    #[error("the claude CLI failed {ATTEMPTS} times: {0}")]
    Cli(#[from] DriverError),
    /// The model API failed (the CLI gave up after its own retries).
    #[error("the turn ended with an API error (status {0:?})")]
    Api(Option<u16>),
    /// The model API refused her credential (HTTP 401). The batch stays pending; the
    /// credential file is read again before each retry.
    #[error("unauthorized: the model API refused her credential (HTTP 401); fix the file session.api_key_file or session.oauth_token_file names (it is read again before each retry)")]
    Unauthorized,
    /// Her credential file cannot be read.
    #[error("her model credential cannot be read: {0}")]
    Credential(String),
    /// A fresh session refused the batch as too long for the model's context window: the
    /// turn loop splits it, or cuts its one message ([`TurnLoop::drain`]).
    #[error("a fresh session refused {deliveries} message(s) of {bytes} bytes as too long for the model's context window")]
    TooLong {
        /// Deliveries in the batch.
        deliveries: usize,
        /// Their text's bytes.
        bytes: usize,
    },
    /// A say could not be sent now (homeserver down, retries exhausted).
    #[error("say {request_id} not sent yet: {error}")]
    Send {
        /// Its request id.
        request_id: String,
        /// Why.
        error: String,
    },
}

impl TurnError {
    /// A short name for the kind of failure (a metrics label).
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Inbox(_) => "inbox_error",
            Self::Cli(_) => "cli_failed",
            Self::Api(_) => "api_error",
            Self::Unauthorized => "unauthorized",
            Self::Credential(_) => "credential_unreadable",
            Self::TooLong { .. } => "too_long",
            Self::Send { .. } => "send_failed",
        }
    }
}

/// A Persona's turn loop: her wiring (persona, inbox, mouth, signals, channels), and her state
/// in five owned parts, each named for the concern that changes it.
pub struct TurnLoop {
    persona: Persona,
    inbox: Inbox,
    mouth: Mouth,
    signals: Arc<Signals>,
    /// Turn requests (from CultNet clients or tools).
    pub turn_requests: Arc<Notify>,
    /// Operators' verbs (from CultNet clients with the `session` verb).
    pub controls: mpsc::Sender<Control>,
    control_rx: mpsc::Receiver<Control>,
    /// Where her turns, tokens, cost, decisions and budget are counted.
    metrics: Arc<Metrics>,
    /// Her claude process and how it is started.
    claude: Claude,
    /// What the refresh policy knows of her session, and its configuration.
    refresh: Refresh,
    /// What her next turn carries beside her mail.
    carry: Carry,
    /// What starts her turns, and what is left of a batch that failed.
    gate: Gate,
    /// Her status file, history and spend.
    records: Records,
}

/// Her claude process, the configuration it is started with, and her place in the
/// gateway-wide cap on live processes.
struct Claude {
    /// Her CLI configuration without a session.
    base: CliConfig,
    schema: Arc<ReplySchema>,
    cli: Option<Cli>,
    /// Her system prompt file's hash (a resume after it changed gives the new prompt).
    prompt_hash: String,
    /// Her system prompt's size in tokens (estimated).
    prompt_tokens: u64,
    /// The gateway-wide cap on live processes (`[sessions] max_live`), and her slot in it
    /// while her process lives.
    processes: Option<Arc<Processes>>,
    slot: Option<LiveSlot>,
    /// She is asked to stop her idle process to make room for another Persona's.
    evict: Arc<Notify>,
}

/// What the refresh policy knows of her session, and its configuration.
struct Refresh {
    telemetry: Telemetry,
    policy: PolicyConfig,
    prices: Prices,
    /// When the policy's idle timer fired last.
    fired: Option<Instant>,
}

/// What her next turn carries beside her mail.
struct Carry {
    /// What her session has seen (not shown again).
    seen: Seen,
    /// The correction after a bad reply, for the next batch.
    note: Option<String>,
    /// The gateway was restarted since her last turn: her next batch says so.
    restarted: bool,
    /// A turn the model API failed on: its id, the session whose transcript holds its text,
    /// the status.
    failed: Option<ApiFailure>,
    /// The turn being composed shows its batch degraded (media as descriptions).
    degrade: bool,
    /// Set-aside batches the turn being composed tells her of (marked told once it goes
    /// through).
    telling: Vec<u64>,
}

/// What starts her turns (her rules and who started them lately), and what failed turns on
/// her oldest batch left.
struct Gate {
    /// Who started her turns lately, by her `[persona.turns]` rules (stored).
    admission: Admission,
    /// Her rules for what starts a turn.
    rules: Rules,
    /// Users whose lines count as a bot's: the other Personas of this gateway and her `bots`.
    bots: Vec<String>,
    /// When waiting mail may start a turn without new mail (a sender's hour or the ambient
    /// interval running out), ms since the epoch.
    recheck_at_ms: Option<i64>,
    /// After a batch that no session could hold: how much of it the next turn takes.
    shrink: Option<Shrink>,
    /// What failed turns on her oldest batch left: degraded next, or counted towards its
    /// being set aside.
    trouble: Option<session::turn::Trouble>,
}

/// The instant a message was said, `said_ms` on the homeserver's clock, placed on this
/// process's clock (`now` is `now_ms`): her silence ends when the batch's first message was
/// said, not when the gateway got to it. That differs when the mail waited: through a restart
/// of the gateway (the gap would hold its downtime), behind a long turn, or the debounce. Not
/// before `floor` (her last turn: mail said during it ends a gap of none); a time in the
/// future counts as now.
fn said_at(now: Instant, now_ms: i64, said_ms: i64, floor: Option<Instant>) -> Instant {
    let waited = Duration::from_millis(now_ms.saturating_sub(said_ms).max(0) as u64);
    match (now.checked_sub(waited), floor) {
        (Some(t), Some(f)) => t.max(f),
        (Some(t), None) => t,
        (None, f) => f.unwrap_or(now),
    }
}

/// A message's text in a degraded batch (after the model API refused the batch whole): at most
/// this many bytes.
const DEGRADED_BYTES: usize = 2048;

/// A turn the model API failed on after the CLI's own retries (or interrupted past its
/// timeout). The CLI writes a turn that ended with a result, failed or not, into her session's
/// transcript, so every process that resumes the session holds its text (merged with the next
/// message): the retry must not send the batch again, she would see it twice. (A turn whose
/// process was killed may or may not have reached the transcript: that is looked up there,
/// [`TurnLoop::held_by_session`].) Stored (session value `failed`), so a restart of the gateway
/// keeps it.
#[derive(Debug, Serialize, serde::Deserialize)]
struct ApiFailure {
    turn_id: String,
    /// The session whose transcript holds the failed attempt.
    session: String,
    status: Option<u16>,
}

impl std::fmt::Debug for TurnLoop {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TurnLoop")
            .field("persona", &self.persona.id)
            .finish()
    }
}

fn hash_file(path: &std::path::Path) -> String {
    let bytes = std::fs::read(path).unwrap_or_default();
    crate::config::hex(&Sha256::digest(&bytes)[..16])
}

impl TurnLoop {
    /// A turn loop for `persona`; `base` is her CLI configuration without a session, and
    /// `schema` her reply schema (`base.json_schema` is set from it).
    pub fn new(
        persona: Persona,
        inbox: Inbox,
        mouth: Mouth,
        signals: Arc<Signals>,
        mut base: CliConfig,
        schema: ReplySchema,
        state_dir: &std::path::Path,
    ) -> Result<Self, InboxError> {
        base.json_schema = schema.text();
        // An operator's model switch outlives restarts.
        if let Some(model) = inbox.session_value(&persona.id, "model")? {
            base.model = model;
        }
        let generation = inbox
            .session_value(&persona.id, "generation")?
            .and_then(|g| g.parse().ok())
            .unwrap_or(0);
        let status_path = state_dir
            .join("personas")
            .join(&persona.id)
            .join("status.json");
        // The turn history of earlier runs is kept; identity comes from the inbox.
        let earlier: StatusFile = std::fs::read(&status_path)
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok())
            .unwrap_or_default();
        let status = StatusFile {
            persona: persona.id.clone(),
            session_id: inbox.session_value(&persona.id, "session_id")?,
            generation,
            turns_total: earlier.turns_total,
            compactions: earlier.compactions,
            refreshes: earlier.refreshes,
            upkeep_usd: earlier.upkeep_usd,
            turns: earlier.turns,
            model: base.model.clone(),
            previous_sessions: earlier.previous_sessions,
            last_error: None,
            over_budget: None,
            retired_lines: earlier.retired_lines,
            set_aside: Vec::new(),
            budget_notice_at_ms: earlier.budget_notice_at_ms,
        };
        // She has had turns before: her first batch in this run says she was restarted.
        let restarted = status.turns_total > 0;
        let (controls, control_rx) = mpsc::channel(CONTROL_QUEUE);
        let prompt_tokens = std::fs::metadata(&base.system_prompt_file).map_or(0, |m| m.len() / 4);
        // Her gaps and compaction summaries, learned in earlier runs.
        let mut telemetry = Telemetry {
            gaps: learned(&inbox, &persona.id, GAPS)?,
            summaries: learned(&inbox, &persona.id, SUMMARIES)?,
            ..Telemetry::default()
        };
        let prices = prices_for(&persona, &base.model);
        // What her session had seen, when the gateway resumes it.
        let kept: Option<KeptSeen> = learned(&inbox, &persona.id, SEEN)?;
        let seen = match (kept, &status.session_id) {
            (Some(k), Some(sid)) if &k.session == sid => k.ids.into_iter().collect(),
            _ => Seen::default(),
        };
        // What the policy knew of the session it resumes: her cache is kept warm through a
        // restart, and her next turn priced, as if the gateway had not stopped.
        let policy_kept: Option<KeptPolicy> = learned(&inbox, &persona.id, POLICY)?;
        if let Some(k) = policy_kept.filter(|k| Some(&k.session) == status.session_id.as_ref()) {
            telemetry.restore(
                &k.telemetry,
                Instant::now(),
                crate::clock::unix_ms(),
                base.cache_ttl.duration(),
            );
        }
        // A correction not shown yet when the gateway stopped, and a failed turn not retried.
        let note = inbox.session_value(&persona.id, CORRECTION)?;
        let failed: Option<ApiFailure> = learned(&inbox, &persona.id, FAILED)?;
        let totals: Option<KeptTotals> = learned(&inbox, &persona.id, TOTALS)?;
        let admission: Admission = learned(&inbox, &persona.id, ADMISSION)?;
        let trouble: Option<session::turn::Trouble> = learned(&inbox, &persona.id, TROUBLE)?;
        let billed_so_far = totals.filter(|t| Some(&t.session) == status.session_id.as_ref());
        Ok(Self {
            refresh: Refresh {
                telemetry,
                policy: persona.session.policy(base.cache_ttl, prices),
                prices,
                fired: None,
            },
            carry: Carry {
                seen,
                note,
                restarted,
                failed,
                degrade: false,
                telling: Vec::new(),
            },
            gate: Gate {
                admission,
                rules: persona.turns.rules(),
                bots: persona.turns.bots.clone(),
                recheck_at_ms: None,
                shrink: None,
                trouble,
            },
            records: Records::new(status, status_path, &persona, billed_so_far),
            claude: Claude {
                prompt_hash: hash_file(&base.system_prompt_file),
                prompt_tokens,
                base,
                schema: Arc::new(schema),
                cli: None,
                processes: None,
                slot: None,
                evict: Arc::new(Notify::new()),
            },
            metrics: crate::metrics::unserved(),
            persona,
            inbox,
            mouth,
            signals,
            turn_requests: Arc::new(Notify::new()),
            controls,
            control_rx,
        })
    }

    /// Also counts the lines of `others` (the other Personas of this gateway) as a bot's.
    pub fn with_other_personas(mut self, others: impl IntoIterator<Item = String>) -> Self {
        self.gate.bots.extend(others);
        self
    }

    /// Counts her turns, tokens, cost, refresh decisions and budget in `metrics` (the
    /// gateway's, which its exporter serves).
    pub fn with_metrics(mut self, metrics: Arc<Metrics>) -> Self {
        self.metrics = metrics;
        self
    }

    /// Takes part in the gateway-wide cap on live processes.
    pub fn with_processes(mut self, processes: Arc<Processes>) -> Self {
        self.claude.processes = Some(processes);
        self
    }
}

/// Her full turn history, one [`TurnRecord`] per line, next to her status file (JSON lines:
/// readable by `cultnet-gateway report` and by `jq` while the gateway runs, unlike sled, which
/// one process holds locked).
pub const HISTORY_FILE: &str = "turns.jsonl";

fn decision_name(d: &Decision) -> &'static str {
    match d {
        Decision::Continue => "continue",
        Decision::Compact(_) => "compact",
        Decision::FreshStart(_) => "fresh_start",
        Decision::KeepWarm => "keep_warm",
        Decision::Evict => "evict",
    }
}

/// `ms` as a short human duration ("45 s", "12 min", "3 h 5 min", "2 d 4 h").
pub fn human_duration(ms: i64) -> String {
    let s = ms.max(0) / 1000;
    match s {
        0..=119 => format!("{s} s"),
        120..=7_199 => format!("{} min", s / 60),
        7_200..=172_799 => format!("{} h {} min", s / 3600, s % 3600 / 60),
        _ => format!("{} d {} h", s / 86_400, s % 86_400 / 3600),
    }
}

/// Session values holding what the policy learned about her.
const GAPS: &str = "gaps";
/// Session value: what her `[persona.turns]` rules remember (who started turns lately).
const ADMISSION: &str = "admission";
const SUMMARIES: &str = "summaries";
/// What her resumed session has seen (a [`KeptSeen`]), so a restart of the gateway does not
/// show her again the lines she holds.
const SEEN: &str = "seen";
/// Her reply to the turn in flight, stored before its first say (`{"turn", "output"}`).
const REPLY: &str = "reply";
/// The correction her next batch carries after a reply that could not be sent (its text).
const CORRECTION: &str = "correction";
/// The turn the model API failed on (an [`ApiFailure`]), until a turn is committed.
const FAILED: &str = "failed";
/// What failed turns on her oldest batch left (a [`session::turn::Trouble`]), until it goes
/// through or is set aside.
const TROUBLE: &str = "trouble";
/// What the policy knows of her session between turns (a [`KeptPolicy`]).
const POLICY: &str = "policy";
/// Her session's running totals at its last result (a [`KeptTotals`]), so that the first
/// result after a restart of the gateway is billed from them too (a `/compact`'s result
/// reports no usage of its own).
const TOTALS: &str = "billed";
/// The ids recorded last that a restart keeps even when no timeline holds them yet (her
/// replies of the last turn, whose echo may still be on its way).
const SEEN_LATEST: usize = 64;

/// The ids her session had seen, stored with the session they belong to: another session
/// (after a fresh start) has seen none of them.
#[derive(Debug, Default, Serialize, serde::Deserialize)]
struct KeptSeen {
    session: String,
    ids: Vec<String>,
}

/// What the policy knew of a session between its turns, stored with the session it is of.
#[derive(Debug, Serialize, serde::Deserialize)]
struct KeptPolicy {
    session: String,
    telemetry: session::policy::KeptTelemetry,
}

/// A session's running totals (the CLI's `modelUsage`, summed over models) at its last
/// result.
#[derive(Debug, Serialize, serde::Deserialize)]
struct KeptTotals {
    session: String,
    usage: Usage,
}

#[cfg(test)]
mod tests {
    use super::drain::cut;
    use super::*;

    #[test]
    fn a_message_is_placed_on_this_clock_when_it_was_said() {
        let now = Instant::now();
        let now_ms = 1_800_000_000_000;
        let turn = now - Duration::from_secs(60);
        let last = Some(turn);
        assert_eq!(
            said_at(now, now_ms, now_ms - 30_000, last),
            now - Duration::from_secs(30)
        );
        assert_eq!(
            said_at(now, now_ms, now_ms - 30_000, None),
            now - Duration::from_secs(30)
        );
        // Said during her last turn: her gap is none.
        assert_eq!(said_at(now, now_ms, now_ms - 90_000, last), turn);
        // A homeserver clock ahead of ours: now.
        assert_eq!(said_at(now, now_ms, now_ms + 5_000, last), now);
        // A bogus origin_server_ts, as old as can be: her last turn; no panic without one.
        assert_eq!(said_at(now, now_ms, i64::MIN, last), turn);
        assert!(said_at(now, now_ms, i64::MIN, None) <= now);
    }

    #[test]
    fn a_cut_message_keeps_whole_characters_and_says_how_much_it_shows() {
        let mut d = Delivery {
            text: "é".repeat(1000),
            ..Delivery::default()
        };
        cut(&mut d, 1001);
        // 1001 bytes would split an "é" (two bytes): 1000 are kept.
        assert!(d.text.starts_with(&"é".repeat(500)));
        assert!(d.text.ends_with(
            "[cut by the gateway: the first 1000 of its 2000 bytes; the whole message does not fit your context window]"
        ));
        assert!(d.truncated);
        let mut short = Delivery {
            text: "hi".into(),
            ..Delivery::default()
        };
        cut(&mut short, 1024);
        assert_eq!((short.text.as_str(), short.truncated), ("hi", false));
    }
}
