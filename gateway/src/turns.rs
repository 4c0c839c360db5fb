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
use wire::docs::{ControlAction, ControlReceipt, ControlRequest, Delivery, SendRequest, Status};

use crate::config::Persona;
use crate::ear::Signals;
use crate::inbox::{Inbox, InboxError, TurnCommit};
use crate::matrix::Backoff;
use crate::metrics::Metrics;
use crate::mouth::{Mouth, Shape};
use crate::processes::{LiveSlot, Processes};

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

/// What a history record is: one of her turns, or what her session cost between turns.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RecordKind {
    /// A turn: a batch (or notes) shown, her reply handled.
    #[default]
    Turn,
    /// The turn before a planned compaction that asks her what to keep (says not sent).
    Checkpoint,
    /// A `/compact`. The CLI reports no usage for it: its tokens are the step of the session's
    /// running totals, or, without an earlier result of the session in this run to step
    /// from, an estimate (the conversation sent uncached, the size it kept as output).
    Compaction,
    /// A keep-warm refresh (a one-token fork of her session that reads its prefix).
    Refresh,
}

/// One record of her history (`turns.jsonl`; her turns also in the status file).
#[derive(Debug, Clone, Default, Serialize, serde::Deserialize)]
#[serde(default)]
pub struct TurnRecord {
    /// A turn, or what her session cost between turns (older records: a turn).
    pub kind: RecordKind,
    /// Batch seqs.
    pub first_seq: u64,
    /// Batch seqs.
    pub last_seq: u64,
    /// Session generation.
    pub generation: u64,
    /// Wall time of the turn (ms), CLI included.
    pub duration_ms: u64,
    /// Input tokens not from cache.
    pub input_tokens: u64,
    /// Cache reads.
    pub cache_read_tokens: u64,
    /// Cache writes.
    pub cache_write_tokens: u64,
    /// Output tokens.
    pub output_tokens: u64,
    /// Share of the prompt read from cache.
    pub hit_ratio: f64,
    /// The CLI's own cumulative cost estimate.
    pub cli_cost_usd: f64,
    /// Says sent.
    pub says: usize,
    /// Notes shown.
    pub notes: usize,
    /// Extension fields queued.
    pub extensions: usize,
    /// The policy's decision before the turn.
    pub decision: String,
    /// Billed cost by the price table (dollars).
    pub cost_usd: f64,
    /// What became of the reply.
    pub outcome: String,
    /// When it ended (ms since the epoch).
    pub at_ms: i64,
    /// Its prompt in tokens (uncached + cache reads + cache writes).
    pub prefix_tokens: u64,
    /// Where the policy acts (tokens).
    pub watermark_tokens: u64,
    /// The model's context window (tokens).
    pub window_tokens: u64,
    /// What a rebuild (a new session given the rehydration, as the old design did every turn)
    /// would cost now, dollars.
    pub rebuild_usd: f64,
    /// What a fresh start of her session would cost now, dollars: the rebuild, and the recent
    /// lines of her rooms this session holds that the rehydration leaves out, which their next
    /// batches would show again (the price the ski-rental rule weighs).
    pub fresh_start_usd: f64,
}

#[derive(Debug, Default, Serialize, serde::Deserialize)]
#[serde(default)]
struct StatusFile {
    persona: String,
    session_id: Option<String>,
    generation: u64,
    turns_total: u64,
    /// Compactions carried out (by `/compact`).
    #[serde(default)]
    compactions: u64,
    /// Keep-warm refreshes made.
    #[serde(default)]
    refreshes: u64,
    /// What she cost outside her turns (refreshes, compactions, checkpoints), dollars; with
    /// her turns' costs, what the model API billed for her.
    #[serde(default)]
    upkeep_usd: f64,
    turns: VecDeque<TurnRecord>,
    /// Her model (the configured one, or the last operator's switch).
    #[serde(default)]
    model: String,
    /// Sessions before a reset or model switch, newest last (each still resumable).
    #[serde(default)]
    previous_sessions: Vec<String>,
    /// Why her session cannot take turns now (`unauthorized: ...`), until a turn succeeds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    last_error: Option<String>,
    /// Her spend has reached her daily cap: nothing that costs starts before it resumes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    over_budget: Option<OverBudget>,
    /// Waiting lines retired from her mail into her rooms' context, in all.
    #[serde(default)]
    retired_lines: u64,
    /// Her batches set aside (the model API kept refusing them), oldest first.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    set_aside: Vec<wire::docs::SetAsideBatch>,
    /// When her operator was told she stopped for her budget (until she is within it again).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    budget_notice_at_ms: Option<i64>,
}

/// Her spend in the last 24 hours has reached her cap (`[persona.budget] usd_per_day`), or the
/// public share of it (the cap less her operators' reserve).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, serde::Deserialize)]
struct OverBudget {
    /// Spent in the window, dollars.
    spent_usd: f64,
    /// The cap, dollars.
    cap_usd: f64,
    /// When enough spend has left the window, ms since the epoch: below the cap, or (with
    /// `operators_only`) below the public share.
    resumes_at_ms: i64,
    /// Only the public share is spent: her operators' lines and DMs are answered from the
    /// reserve.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    operators_only: bool,
}

impl OverBudget {
    /// From her share, `None` when it is open.
    fn of(share: session::budget::Share) -> Option<Self> {
        use session::budget::Share;
        match share {
            Share::Open => None,
            Share::Operators {
                spent_usd,
                cap_usd,
                resumes_at_ms,
                ..
            }
            | Share::Over {
                spent_usd,
                cap_usd,
                resumes_at_ms,
            } => Some(Self {
                spent_usd,
                cap_usd,
                resumes_at_ms,
                operators_only: matches!(share, Share::Operators { .. }),
            }),
        }
    }

    /// What her status says of it.
    fn describe(&self) -> String {
        let wait = human_duration(self.resumes_at_ms - crate::clock::unix_ms());
        if self.operators_only {
            format!(
                "over_budget: ${:.4} spent in the last 24 hours, past the public share of a ${:.4} cap; her operators' lines are answered from the reserve, others' wait {wait} more (or until a reload raises budget.usd_per_day)",
                self.spent_usd, self.cap_usd,
            )
        } else {
            format!(
                "over_budget: ${:.4} spent in the last 24 hours of a ${:.4} cap; her mail waits {wait} more (or until a reload raises budget.usd_per_day)",
                self.spent_usd, self.cap_usd,
            )
        }
    }

    /// What the gateway tells her operator, once, in her DM with him.
    fn notice(&self, persona: &str) -> String {
        let wait = human_duration(self.resumes_at_ms - crate::clock::unix_ms());
        let what = if self.operators_only {
            "She answers only you (and her other operators) now, from the reserve; others' lines wait"
        } else {
            "She answers no one now; all her mail waits"
        };
        format!(
            "[cultnet-gateway] {persona} has spent ${:.2} in the last 24 hours of her ${:.2} daily budget. {what}, {wait} more. To raise it: set [persona.budget] usd_per_day in the gateway's config and reload it (SIGHUP, or systemctl reload cultnet-gateway).",
            self.spent_usd, self.cap_usd
        )
    }
}

/// A Persona's turn loop.
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
    base: CliConfig,
    schema: Arc<ReplySchema>,
    cli: Option<Cli>,
    seen: Seen,
    /// The correction after a bad reply, for the next batch.
    note: Option<String>,
    /// Lines in her history file (counted on first use).
    history_lines: Option<usize>,
    /// The gateway was restarted since her last turn: her next batch says so.
    restarted: bool,
    prompt_hash: String,
    status_path: PathBuf,
    status: StatusFile,
    telemetry: Telemetry,
    policy: PolicyConfig,
    prices: Prices,
    prompt_tokens: u64,
    fired: Option<Instant>,
    /// Her session's running totals at its last result, so that each record bills what the
    /// API billed since ([`TurnLoop::billed`]); stored, so a restart of the gateway keeps
    /// them for the session it resumes.
    billed_so_far: Option<KeptTotals>,
    /// A turn the model API failed on: its id, the session whose transcript holds its text,
    /// the status.
    failed: Option<ApiFailure>,
    /// After a batch that no session could hold: how much of it the next turn takes.
    shrink: Option<Shrink>,
    /// What failed turns on her oldest batch left: degraded next, or counted towards its
    /// being set aside.
    trouble: Option<session::turn::Trouble>,
    /// The turn being composed shows its batch degraded (media as descriptions).
    degrade: bool,
    /// Set-aside batches the turn being composed tells her of (marked told once it goes
    /// through).
    telling: Vec<u64>,
    /// What she was billed in the last 24 hours, against her daily cap.
    spend: session::budget::Spend,
    /// Who started her turns lately, by her `[persona.turns]` rules (stored).
    admission: Admission,
    /// Her rules for what starts a turn.
    rules: Rules,
    /// Users whose lines count as a bot's: the other Personas of this gateway and her `bots`.
    bots: Vec<String>,
    /// When waiting mail may start a turn without new mail (a sender's hour or the ambient
    /// interval running out), ms since the epoch.
    recheck_at_ms: Option<i64>,
    /// The gateway-wide cap on live processes (`[sessions] max_live`), and her slot in it
    /// while her process lives.
    processes: Option<Arc<Processes>>,
    slot: Option<LiveSlot>,
    /// She is asked to stop her idle process to make room for another Persona's.
    evict: Arc<Notify>,
    /// Where her turns, tokens, cost, decisions and budget are counted.
    metrics: Arc<Metrics>,
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

/// `d`'s text cut to `bytes` (at a character boundary), saying so.
fn cut(d: &mut Delivery, bytes: usize) {
    cut_for(
        d,
        bytes,
        "the whole message does not fit your context window",
    );
}

/// `d`'s text cut to `bytes` (whole characters), saying how much it shows and `why`.
fn cut_for(d: &mut Delivery, bytes: usize, why: &str) {
    let whole = d.text.len();
    if whole <= bytes {
        return;
    }
    let at = crate::event::truncate_text(&mut d.text, bytes);
    d.text.push_str(&format!(
        "\n[cut by the gateway: the first {at} of its {whole} bytes; {why}]"
    ));
    d.truncated = true;
}

/// A message's text in a degraded batch (after the model API refused the batch whole): at most
/// this many bytes.
const DEGRADED_BYTES: usize = 2048;

/// `d` as a degraded batch shows it: its text cut to [`DEGRADED_BYTES`], saying so.
fn degrade(d: &mut Delivery) {
    cut_for(d, DEGRADED_BYTES, "the model API refused this batch whole");
}

/// How a failed turn bears on its batch ([`session::turn::Trouble`]).
fn fault_of(e: &TurnError) -> session::turn::Fault {
    use session::turn::Fault;
    match e {
        TurnError::Api(Some(s)) if (400..500).contains(s) && *s != 401 && *s != 429 => {
            Fault::Refused
        }
        TurnError::TooLong { .. } => Fault::Refused,
        TurnError::Api(_) | TurnError::Cli(_) => Fault::Failed,
        TurnError::Unauthorized
        | TurnError::Credential(_)
        | TurnError::Inbox(_)
        | TurnError::Send { .. } => Fault::Elsewhere,
    }
}

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
        // Her spend in the last 24 hours, from her history (every billed record is there),
        // when she has a cap to hold it against (a new cap comes with a restart of her loop).
        let mut spend = session::budget::Spend::default();
        if persona.budget.usd_per_day.is_some() {
            let since = crate::clock::unix_ms() - session::budget::WINDOW_MS;
            for r in read_history(&status_path.with_file_name(HISTORY_FILE)).unwrap_or_default() {
                if r.at_ms > since {
                    spend.add(r.at_ms, r.cost_usd);
                }
            }
        }
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
            telemetry,
            policy: persona.session.policy(base.cache_ttl, prices),
            prices,
            prompt_tokens,
            fired: None,
            failed,
            shrink: None,
            trouble,
            degrade: false,
            telling: Vec::new(),
            spend,
            admission,
            rules: persona.turns.rules(),
            bots: persona.turns.bots.clone(),
            recheck_at_ms: None,
            processes: None,
            slot: None,
            evict: Arc::new(Notify::new()),
            metrics: crate::metrics::unserved(),
            billed_so_far,
            prompt_hash: hash_file(&base.system_prompt_file),
            status_path,
            persona,
            inbox,
            mouth,
            signals,
            turn_requests: Arc::new(Notify::new()),
            controls,
            control_rx,
            base,
            schema: Arc::new(schema),
            cli: None,
            seen,
            note,
            history_lines: None,
            restarted,
            status,
        })
    }

    /// Also counts the lines of `others` (the other Personas of this gateway) as a bot's.
    pub fn with_other_personas(mut self, others: impl IntoIterator<Item = String>) -> Self {
        self.bots.extend(others);
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
        self.processes = Some(processes);
        self
    }

    /// Runs until `stop` turns true; the CLI is shut down on the way out.
    pub async fn run(mut self, mut stop: watch::Receiver<bool>) {
        // Her budget's metrics start from "within" (a reload restarts her turn loop); her
        // first check publishes what holds.
        let label = crate::metrics::PersonaLabel {
            persona: self.persona.id.clone(),
        };
        self.metrics.over_budget.get_or_create(&label).set(0);
        self.metrics.budget_resumes_at.get_or_create(&label).set(0);
        let mut backoff = Backoff::new(Duration::from_secs(1), Duration::from_secs(60));
        let grace = Duration::from_secs(self.persona.session.shutdown_grace_secs);
        let stopping = stop.clone();
        // Her Minds asked for a turn: the next drain takes one whatever the rules say.
        let mut forced = false;
        loop {
            let drained = {
                let drain = self.drain(&stopping, forced);
                tokio::pin!(drain);
                tokio::select! {
                    r = &mut drain => Some(r),
                    _ = stop.changed() => {
                        // Stop taking turns; a turn in flight may end within the grace.
                        match tokio::time::timeout(grace, &mut drain).await {
                            Ok(r) => tracing::info!(result = ?r.err().map(|e| e.to_string()), "turn in flight ended at shutdown"),
                            Err(_) => tracing::warn!(?grace, "turn in flight given up at shutdown; its batch is retried after the restart"),
                        }
                        None
                    }
                }
            };
            let Some(drained) = drained else { break };
            match drained {
                Ok(()) => {
                    backoff.reset();
                    let over = self.status.over_budget.map(|o| o.describe());
                    self.set_error(over);
                }
                Err(e) => {
                    let wait = backoff.next(None);
                    tracing::warn!(persona = %self.persona.id, error = %e, ?wait, "turn round failed; retrying");
                    let credential =
                        matches!(e, TurnError::Unauthorized | TurnError::Credential(_));
                    self.metrics
                        .turns
                        .get_or_create(&crate::metrics::OutcomeLabels {
                            persona: self.persona.id.clone(),
                            outcome: e.kind().to_owned(),
                        })
                        .inc();
                    self.set_error(Some(e.to_string()));
                    tokio::select! {
                        _ = tokio::time::sleep(wait) => {}
                        _ = stop.changed() => break,
                    }
                    if credential {
                        self.reload_credential().await;
                    }
                    continue;
                }
            }
            let turn_requested = loop {
                self.telemetry.batch_waiting = false;
                // Idle: her process, if it lives, may be stopped for another Persona's; a
                // process that stopped frees its slot.
                if self.cli.is_none() {
                    self.slot = None;
                }
                if let Some(p) = &self.processes {
                    p.idle(&self.persona.id);
                }
                self.telemetry.process = if self.cli.is_some() {
                    Process::Running
                } else {
                    Process::Stopped
                };
                // A check that already fired and changed nothing is not repeated.
                let at = policy::next_check(&self.telemetry, &self.policy, self.fired);
                let timer = at.map(tokio::time::Instant::from_std);
                let sleep = async {
                    match timer {
                        Some(at) => tokio::time::sleep_until(at).await,
                        None => std::future::pending().await,
                    }
                };
                // Waiting mail is looked at again when she resumes from her budget, or when it
                // may start a turn without new mail (a sender's hour or the ambient interval).
                let look_again = [
                    self.status.over_budget.map(|o| o.resumes_at_ms),
                    self.recheck_at_ms,
                ]
                .into_iter()
                .flatten()
                .min()
                .map(|at| {
                    let wait = (at - crate::clock::unix_ms()).max(0) as u64;
                    tokio::time::sleep(Duration::from_millis(wait))
                });
                let looked_again = async {
                    match look_again {
                        Some(sleep) => sleep.await,
                        None => std::future::pending().await,
                    }
                };
                tokio::select! {
                    _ = self.evict.notified() => {
                        if self.cli.is_some() {
                            tracing::info!(persona = %self.persona.id, "stopping her idle process to make room for another Persona's (her session is resumed at her next turn)");
                            self.shutdown().await;
                            self.telemetry.process = Process::Stopped;
                        }
                        self.slot = None;
                    }
                    _ = looked_again => break false,
                    _ = self.signals.mail.notified() => break false,
                    _ = self.turn_requests.notified() => break true,
                    Some(c) = self.control_rx.recv() => self.apply_control(c).await,
                    _ = stop.changed() => return self.shutdown().await,
                    _ = sleep => {
                        self.fired = at;
                        self.idle_check().await;
                    }
                }
            };
            forced = turn_requested;
            // Working from here (the debounce too): her process is not stopped for another's
            // while her turn is about to start.
            if let Some(p) = &self.processes {
                p.busy(&self.persona.id);
            }
            if !forced && !self.debounce(&mut stop).await {
                break;
            }
        }
        self.shutdown().await;
    }

    /// Whether her spend in the last 24 hours has reached her daily cap, so nothing that costs
    /// may start now (her operators' reserve aside: see [`TurnLoop::budget`]).
    fn over_budget(&mut self) -> bool {
        self.budget().is_some_and(|o| !o.operators_only)
    }

    /// Where her spend stands against her cap and her operators' reserve (`None`: open). Keeps
    /// her status, her metrics and the log up to date as it changes.
    fn budget(&mut self) -> Option<OverBudget> {
        let now = crate::clock::unix_ms();
        let b = &self.persona.budget;
        let over = OverBudget::of(self.spend.share(now, b.usd_per_day, b.operator_reserve));
        if over != self.status.over_budget {
            let label = crate::metrics::PersonaLabel {
                persona: self.persona.id.clone(),
            };
            let m = self.metrics.clone();
            m.over_budget
                .get_or_create(&label)
                .set(i64::from(over.is_some()));
            m.budget_resumes_at
                .get_or_create(&label)
                .set(over.map_or(0, |o| o.resumes_at_ms / 1000));
            match &over {
                Some(o) if o.operators_only => {
                    tracing::warn!(persona = %self.persona.id, spent_usd = o.spent_usd, cap_usd = o.cap_usd, resumes_at_ms = o.resumes_at_ms, "the public share of her budget is spent: only her operators' lines start turns, from the reserve")
                }
                Some(o) => {
                    tracing::warn!(persona = %self.persona.id, spent_usd = o.spent_usd, cap_usd = o.cap_usd, resumes_at_ms = o.resumes_at_ms, "over her budget: no turn starts until she resumes")
                }
                None => tracing::info!(persona = %self.persona.id, "within her budget again"),
            }
            if over.is_none() {
                self.status.budget_notice_at_ms = None;
            }
            self.status.over_budget = over;
            self.save_status();
            self.set_error(over.map(|o| o.describe()));
        }
        over
    }

    /// Tells her operator, once while she is held by her budget, in her DM with him, what she
    /// spent, when she resumes, and how to raise her budget (sent by the gateway in her name,
    /// at most once per episode: its request id is the episode's).
    async fn tell_operator_of_budget(&mut self, over: OverBudget) {
        if self.status.budget_notice_at_ms.is_some() {
            return;
        }
        let now = crate::clock::unix_ms();
        let mut dm = None;
        for room in self.mouth.client().joined_rooms() {
            let operator = room.is_direct().await.unwrap_or(false)
                && room.direct_targets().iter().any(|t| {
                    t.as_user_id()
                        .is_some_and(|u| self.persona.operators.iter().any(|o| o == u.as_str()))
                });
            if operator {
                dm = Some(room.room_id().to_string());
                break;
            }
        }
        self.status.budget_notice_at_ms = Some(now);
        self.save_status();
        let Some(room) = dm else {
            tracing::warn!(persona = %self.persona.id, "no DM with an operator to tell of her budget; the log and her status say it");
            return;
        };
        let receipt = self
            .mouth
            .send(&SendRequest {
                request_id: format!("budget:{}:{now}", self.persona.id),
                persona: self.persona.id.clone(),
                room: room.clone(),
                text: over.notice(&self.persona.user_id),
                thread_root: None,
                reply_to: None,
            })
            .await;
        match receipt.status {
            Status::Ok => {
                tracing::info!(persona = %self.persona.id, room = %room, "her operator was told of her budget")
            }
            _ => {
                tracing::warn!(persona = %self.persona.id, room = %room, error = ?receipt.error, "her operator could not be told of her budget")
            }
        }
    }

    /// Records why her session cannot take turns (for her status file and CultNet status).
    fn set_error(&mut self, error: Option<String>) {
        if self.status.last_error == error {
            return;
        }
        *self
            .signals
            .session_error
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = error.clone();
        self.status.last_error = error;
        self.save_status();
    }

    /// Reads her credential file again and restarts her process with it (the credential
    /// lives in the process's start-up).
    async fn reload_credential(&mut self) {
        match self.persona.session.load_credential(&self.persona.id) {
            Ok(c) => {
                tracing::info!(persona = %self.persona.id, "model credential read again");
                self.base.credential = c;
                self.shutdown().await;
            }
            Err(e) => {
                tracing::error!(persona = %self.persona.id, "model credential: {e}");
                self.set_error(Some(TurnError::Credential(e.to_string()).to_string()));
            }
        }
    }

    async fn shutdown(&mut self) {
        if let Some(cli) = self.cli.take() {
            cli.shutdown(Duration::from_secs(5)).await;
        }
    }

    /// While idle, at the time the policy asked for: keep the cache warm or evict.
    async fn idle_check(&mut self) {
        let now = Instant::now();
        let decision = policy::decide(&self.telemetry, now, &self.policy);
        tracing::info!(persona = %self.persona.id, ?decision, telemetry = ?self.telemetry, "idle decision");
        self.metrics
            .decision(&self.persona.id, decision_name(&decision));
        match decision {
            Decision::KeepWarm => {
                let Some(sid) = self.status.session_id.clone() else {
                    return;
                };
                if self.over_budget() {
                    tracing::info!(persona = %self.persona.id, "keep-warm skipped: over her budget");
                    // Not again before her next turn.
                    self.telemetry.last_cache_touch = None;
                    return;
                }
                match session::driver::refresh_fork(&self.base, &sid).await {
                    Ok(r) => {
                        let usage = r.usage.usage();
                        let cost = usage.cost(&self.prices);
                        // Its touch is its start: the expiry reckoned from it is never late.
                        let missed = self.telemetry.after_keep_warm(
                            &usage,
                            cost,
                            now,
                            now.elapsed(),
                            &self.policy,
                        );
                        self.status.refreshes += 1;
                        let outcome = if missed {
                            "refreshed; the cache entry had expired"
                        } else {
                            "refreshed"
                        };
                        self.record_upkeep(RecordKind::Refresh, &usage, now, outcome);
                        tracing::info!(
                            persona = %self.persona.id,
                            cost,
                            missed,
                            read = usage.cache_read,
                            next_lead_ms = self.telemetry.keep_warm_lead(&self.policy).as_millis() as u64,
                            "kept warm"
                        );
                    }
                    Err(e) => {
                        tracing::warn!(persona = %self.persona.id, error = %e, "keep-warm failed");
                        // Do not try again before the next turn.
                        self.telemetry.last_cache_touch = None;
                        self.keep_session();
                    }
                }
            }
            Decision::Evict => {
                self.shutdown().await;
                self.telemetry.process = Process::Stopped;
            }
            _ => {}
        }
    }

    /// Waits out the quiet period; `false` when stopped.
    async fn debounce(&self, stop: &mut watch::Receiver<bool>) -> bool {
        let s = &self.persona.session;
        let first = Instant::now();
        let max_wait = Duration::from_millis(s.max_wait_ms);
        let quiet = Duration::from_millis(s.debounce_ms);
        loop {
            if self.operator_waiting() {
                return true;
            }
            let left = max_wait.saturating_sub(first.elapsed());
            if left.is_zero() {
                return true;
            }
            tokio::select! {
                _ = self.signals.mail.notified() => {}
                _ = self.turn_requests.notified() => return true,
                _ = tokio::time::sleep(quiet.min(left)) => return true,
                _ = stop.changed() => return false,
            }
        }
    }

    fn operator_waiting(&self) -> bool {
        self.inbox
            .pending(&self.persona.id, 0, 1000, None)
            .map(|p| {
                p.deliveries
                    .iter()
                    .any(|d| self.persona.operators.contains(&d.sender))
            })
            .unwrap_or(false)
    }

    /// Books a turn on `batch` started by `trigger` (its seq, and whether ambient mail started
    /// it; `None` for her Minds' request), and stores what the rules remember.
    fn book_start(&mut self, batch: &[Delivery], trigger: Option<(u64, bool)>) {
        let lines = self.lines(batch);
        let hit = trigger.and_then(|(seq, ambient)| {
            let at = batch.iter().position(|d| d.seq == seq)?;
            Some((lines[at], ambient))
        });
        self.admission.started(
            &self.rules,
            &lines,
            hit.as_ref().map(|(l, _)| l),
            hit.is_some_and(|(_, ambient)| ambient),
            crate::clock::unix_ms(),
        );
        self.keep_learned(ADMISSION, &self.admission);
    }

    /// Her pending mail as her `[persona.turns]` rules see it.
    fn lines<'d>(&self, pending: &'d [Delivery]) -> Vec<Line<'d>> {
        pending
            .iter()
            .map(|d| Line {
                room: &d.room_id,
                sender: &d.sender,
                addressed: d.is_direct || d.to_you,
                operator: self.persona.operators.contains(&d.sender),
                bot: self.bots.contains(&d.sender),
            })
            .collect()
    }

    /// Runs turns while her mail may start them (by her `[persona.turns]` rules; `forced`: the
    /// first turn is her Minds' request and needs none), or a note asks for a turn; mail that
    /// starts none waits and rides with her next turn. Between turns new mail is coalesced
    /// (`debounce_ms` after the last, `max_wait_ms` at most). Operators' verbs waiting are
    /// applied before each turn, never during one.
    pub async fn drain(
        &mut self,
        stop: &watch::Receiver<bool>,
        forced: bool,
    ) -> Result<(), TurnError> {
        let mut drain = Drain::new(forced);
        self.recheck_at_ms = None;
        loop {
            if *stop.borrow() {
                return Ok(());
            }
            while let Ok(c) = self.control_rx.try_recv() {
                self.apply_control(c).await;
            }
            let id = self.persona.id.clone();
            let page = self.inbox.pending(&id, 0, 1000, None)?;
            let inflight = self.inbox.session_value(&id, "inflight")?.and_then(|v| {
                let (a, b) = v.split_once('-')?;
                Some((a.parse::<u64>().ok()?, b.parse::<u64>().ok()?))
            });
            // A waiting line its author (or a moderator) deleted is dropped from her mail (a
            // batch in flight keeps its lines: it was shown, or is about to be, as it was).
            let deleted: Vec<u64> = page
                .deliveries
                .iter()
                .filter(|d| d.text == crate::event::DELETED)
                .filter(|d| inflight.is_none_or(|(a, b)| d.seq < a || d.seq > b))
                .map(|d| d.seq)
                .collect();
            if !deleted.is_empty() {
                tracing::info!(persona = %id, lines = deleted.len(), "deleted lines dropped from her mail");
                self.inbox.retire(&id, &deleted)?;
                continue;
            }
            let wake_note =
                page.deliveries.is_empty() && self.inbox.pending_notes(&id)?.iter().any(|n| n.wake);
            let budget = self.budget();
            if let Some(o) = budget {
                self.tell_operator_of_budget(o).await;
            }
            let over_budget = budget.is_some_and(|o| !o.operators_only);
            let operators_only = budget.is_some_and(|o| o.operators_only);
            let mut lines = self.lines(&page.deliveries);
            // Past the public share only her operators' lines start turns (the reserve).
            if operators_only {
                for l in lines.iter_mut().filter(|l| !l.operator) {
                    l.addressed = false;
                }
            }
            let rules = if operators_only {
                Rules {
                    start: match self.rules.start {
                        session::admission::Start::All => session::admission::Start::Addressed,
                        s => s,
                    },
                    ambient_every_ms: 0,
                    ..self.rules.clone()
                }
            } else {
                self.rules.clone()
            };
            let look = Look {
                pending: &page.deliveries,
                lines: &lines,
                inflight,
                wake_note,
                over_budget,
                now_ms: crate::clock::unix_ms(),
            };
            let step = drain.next(
                &look,
                &self.admission,
                &rules,
                self.shrink,
                self.persona.session.max_batch,
                self.persona.turns.bound(),
            );
            match step {
                Step::Idle { recheck_at_ms } => {
                    if !page.deliveries.is_empty() {
                        tracing::debug!(persona = %id, pending = page.deliveries.len(), ?recheck_at_ms, "mail waits: nothing in it starts a turn");
                    }
                    self.recheck_at_ms = recheck_at_ms;
                    return Ok(());
                }
                Step::OverBudget => return Ok(()),
                Step::Retire { seqs } => self.retire(&seqs)?,
                Step::Coalesce => {
                    // What came while the last turn ran, and comes just after, joins the next.
                    let mut stop = stop.clone();
                    if !self.debounce(&mut stop).await {
                        return Ok(());
                    }
                    drain.coalesced();
                }
                Step::Notes => {
                    self.degrade = false;
                    self.turn(&[]).await?;
                    self.told();
                }
                Step::Turn {
                    take,
                    retry,
                    trigger,
                    cut: to,
                } => {
                    // Before any model call: a batch her session could not hold whole is
                    // split (or its one message cut), as a refused one would be, rather than
                    // refused, compacted or started fresh.
                    let fit = self.fit(&page.deliveries[..take]);
                    let take = match fit {
                        session::turn::Fit::Whole => take,
                        session::turn::Fit::Take(n) => n,
                        session::turn::Fit::Cut(_) => 1,
                    };
                    let whole = &page.deliveries[..take];
                    let mut batch: Vec<Delivery> = whole.to_vec();
                    if let (session::turn::Fit::Cut(bytes), Some(d)) = (fit, batch.first_mut()) {
                        cut(d, bytes);
                    }
                    if !retry {
                        self.book_start(&batch, trigger);
                    }
                    if let (Some(bytes), Some(d)) = (to, batch.first_mut()) {
                        cut(d, bytes);
                    }
                    let bound = self.persona.turns.bound();
                    let cuts = if self.rules.start == session::admission::Start::All {
                        Vec::new()
                    } else {
                        session::waiting::to_cut(&batch, &self.lines(whole), bound)
                    };
                    for i in cuts {
                        if let Some(d) = batch.get_mut(i) {
                            cut_for(d, bound.line_bytes, "it was not meant for you");
                        }
                    }
                    let first = batch.first().map_or(0, |d| d.seq);
                    self.degrade = session::turn::Trouble::degraded(self.trouble, first);
                    if self.degrade {
                        batch.iter_mut().for_each(degrade);
                    }
                    match self.turn(&batch).await {
                        // Nothing of it was shown to her: take less, in a new session (the
                        // refused text may be in the old one's transcript).
                        Err(e @ TurnError::TooLong { .. }) => {
                            let shrink = session::turn::after_too_long(&batch, self.shrink);
                            tracing::warn!(persona = %id, error = %e, ?shrink, "batch too long for a fresh session; taking less");
                            self.fresh_start("the batch does not fit her context window")?;
                            if shrink.is_none() {
                                self.shrink = None;
                                self.after_failure(whole, e)?;
                            } else {
                                self.shrink = shrink;
                            }
                        }
                        Ok(()) => {
                            self.shrink = None;
                            self.set_trouble(None);
                            self.told();
                        }
                        Err(e) => self.after_failure(whole, e)?,
                    }
                }
            }
        }
    }

    /// How much of `batch` fits what is left of her window after her prompt so far (and a
    /// margin for her answer), by an estimate that errs long
    /// ([`session::turn::BYTES_PER_TOKEN`]).
    fn fit(&self, batch: &[Delivery]) -> session::turn::Fit {
        // Kept free for the turn's own growth and her answer: an eighth of her window, at most
        // 16k tokens.
        let margin = (self.policy.context_window / 8).min(16_000);
        let prefix = self.telemetry.prefix_tokens.max(self.prompt_tokens);
        let room_tokens = self
            .policy
            .blocking_limit()
            .saturating_sub(prefix)
            .saturating_sub(margin);
        let mut context = std::collections::HashSet::new();
        let context_bytes: usize = batch
            .iter()
            .flat_map(|d| &d.context)
            .filter(|c| context.insert(c.event_id.as_str()))
            .map(|c| c.text.len())
            .sum();
        let room = usize::try_from(room_tokens)
            .unwrap_or(usize::MAX)
            .saturating_mul(session::turn::BYTES_PER_TOKEN)
            .saturating_sub(context_bytes);
        let sizes: Vec<usize> = batch.iter().map(|d| d.text.len()).collect();
        let fit = session::turn::fit(&sizes, room);
        if fit != session::turn::Fit::Whole {
            tracing::info!(persona = %self.persona.id, ?fit, room, prefix, "her batch would not fit her window whole: split before any model call");
        }
        fit
    }

    /// After a turn on `batch` (as stored) failed with `e`, by [`session::turn::Trouble`]:
    /// retried (the error goes up, for the loop's backoff), tried degraded in a fresh session,
    /// or set aside (and the drain goes on with later mail).
    fn after_failure(&mut self, batch: &[Delivery], e: TurnError) -> Result<(), TurnError> {
        use session::turn::{Fault, Next, Trouble};
        let first = batch.first().map_or(0, |d| d.seq);
        let fault = fault_of(&e);
        let (trouble, next) = Trouble::after(self.trouble, first, fault);
        self.set_trouble(trouble);
        match next {
            Next::Retry => Err(e),
            Next::Degrade => {
                tracing::warn!(persona = %self.persona.id, error = %e, first, "the model API refused her batch: it is tried once more degraded (media as descriptions, long messages cut) in a fresh session");
                // The refused message sits in her session's transcript: a resume sends it again.
                self.fresh_start("the model API refused her batch")?;
                Err(e)
            }
            Next::SetAside => {
                let why = e.to_string();
                let counts =
                    self.inbox
                        .set_aside(&self.persona.id, batch, &why, crate::clock::unix_ms())?;
                tracing::error!(persona = %self.persona.id, first, messages = batch.len(), why = %why, pending = counts.pending, "batch set aside: later mail flows; `client session retry|drop --batch {first}` puts it back or drops it");
                self.metrics
                    .turns
                    .get_or_create(&crate::metrics::OutcomeLabels {
                        persona: self.persona.id.clone(),
                        outcome: "set_aside".to_owned(),
                    })
                    .inc();
                if fault == Fault::Refused {
                    // What was refused is in her transcript still.
                    self.fresh_start("her batch was set aside after a refusal")?;
                }
                self.set_failed(None);
                self.degrade = false;
                self.refresh_set_aside();
                Ok(())
            }
        }
    }

    /// Sets (and stores, when it changed) what failed turns on her oldest batch left.
    fn set_trouble(&mut self, trouble: Option<session::turn::Trouble>) {
        if self.trouble != trouble {
            self.trouble = trouble;
            self.keep_learned(TROUBLE, &self.trouble);
        }
    }

    /// Her set-aside batches as her status shows them, read again from the inbox.
    fn refresh_set_aside(&mut self) {
        match self.inbox.set_aside_list(&self.persona.id) {
            Ok(list) => {
                self.status.set_aside = list
                    .iter()
                    .map(|a| wire::docs::SetAsideBatch {
                        batch: a.id,
                        messages: a.deliveries.len() as u64,
                        why: a.why.clone(),
                        at_ms: a.at_ms,
                    })
                    .collect();
                self.save_status();
            }
            Err(e) => {
                tracing::warn!(persona = %self.persona.id, error = %e, "her set-aside batches cannot be read")
            }
        }
    }

    /// A turn went through: the set-aside batches it told her of are told.
    fn told(&mut self) {
        let ids = std::mem::take(&mut self.telling);
        if ids.is_empty() {
            return;
        }
        if let Err(e) = self.inbox.set_aside_told(&self.persona.id, &ids) {
            tracing::warn!(persona = %self.persona.id, error = %e, "set-aside batches not marked told; she is told again");
        }
    }

    /// Takes `seqs` out of her mail into her rooms' context (they stay in the timelines she
    /// reads recent lines from), counted in her status and the metrics.
    fn retire(&mut self, seqs: &[u64]) -> Result<(), TurnError> {
        let r = self.inbox.retire(&self.persona.id, seqs)?;
        if r.lines > 0 {
            tracing::info!(persona = %self.persona.id, lines = r.lines, pending = r.pending, "waiting lines retired into her rooms' context (turns.waiting_lines / waiting_bytes)");
            self.metrics
                .mail_retired
                .get_or_create(&crate::metrics::PersonaLabel {
                    persona: self.persona.id.clone(),
                })
                .inc_by(r.lines);
            self.status.retired_lines += r.lines;
            self.save_status();
        }
        Ok(())
    }

    /// Applies an operator's verb (between turns) and answers it.
    async fn apply_control(&mut self, c: Control) {
        let action = c.request.action;
        tracing::info!(persona = %self.persona.id, ?action, model = ?c.request.model, "session verb");
        let mut previous = None;
        let result: Result<(), String> = match action {
            ControlAction::Status => Ok(()),
            ControlAction::Reset => {
                previous = self.status.session_id.clone();
                self.retire_session("operator reset").await
            }
            ControlAction::Compact => {
                if self.status.session_id.is_none() {
                    Err("she has no session to compact yet".to_owned())
                } else if self.over_budget() {
                    Err(self
                        .status
                        .over_budget
                        .map(|o| o.describe())
                        .unwrap_or_default())
                } else {
                    let before = self.telemetry.prefix_tokens;
                    match self.compact_on_request().await {
                        Ok(true) => {
                            tracing::info!(
                                before,
                                after = self.telemetry.prefix_tokens,
                                "compacted on request"
                            );
                            Ok(())
                        }
                        Ok(false) => {
                            Err("the CLI did not compact; she starts fresh instead".to_owned())
                        }
                        Err(e) => Err(e.to_string()),
                    }
                }
            }
            ControlAction::Model => match c.request.model.as_deref().map(str::trim) {
                Some(m) if !m.is_empty() && m.len() <= 128 => {
                    previous = self.status.session_id.clone();
                    let m = m.to_owned();
                    match self
                        .inbox
                        .set_session_value(&self.persona.id, "model", Some(&m))
                    {
                        Ok(()) => {
                            self.prices = prices_for(&self.persona, &m);
                            self.policy.prices = self.prices;
                            self.base.model = m.clone();
                            self.status.model = m;
                            self.retire_session("model switch").await
                        }
                        Err(e) => Err(e.to_string()),
                    }
                }
                _ => Err("a model switch needs a model name (1 to 128 bytes)".to_owned()),
            },
            ControlAction::Retry | ControlAction::Drop => match c.request.batch {
                None => Err("retry and drop name a set-aside batch (--batch ID)".to_owned()),
                Some(batch) => {
                    let id = &self.persona.id;
                    let done = if action == ControlAction::Retry {
                        self.inbox.retry_set_aside(id, batch).map(|s| s.is_some())
                    } else {
                        self.inbox.drop_set_aside(id, batch)
                    };
                    match done {
                        Ok(true) => {
                            tracing::info!(persona = %id, batch, ?action, "set-aside batch");
                            if action == ControlAction::Retry {
                                self.signals.mail.notify_one();
                            }
                            Ok(())
                        }
                        Ok(false) => Err(format!("she has no set-aside batch {batch}")),
                        Err(e) => Err(e.to_string()),
                    }
                }
            },
            ControlAction::Unknown => Err("unknown session action".to_owned()),
        };
        self.refresh_set_aside();
        let (status, error) = match result {
            Ok(()) => (Status::Ok, None),
            Err(e)
                if matches!(
                    action,
                    ControlAction::Unknown
                        | ControlAction::Model
                        | ControlAction::Retry
                        | ControlAction::Drop
                ) =>
            {
                (Status::Rejected, Some(e))
            }
            Err(e) => (Status::Failed, Some(e)),
        };
        self.save_status();
        let receipt = ControlReceipt {
            persona: self.persona.id.clone(),
            action,
            status,
            session_id: self.status.session_id.clone(),
            previous_session_id: previous,
            generation: self.status.generation,
            model: self.base.model.clone(),
            turns_total: self.status.turns_total,
            prefix_tokens: (self.telemetry.prefix_tokens > 0)
                .then_some(self.telemetry.prefix_tokens),
            set_aside: self.status.set_aside.clone(),
            error,
        };
        let _ = c.reply.send(receipt);
    }

    /// Ends her session for good (its transcript stays on disk, resumable by its id) and
    /// starts a fresh one at the next turn.
    async fn retire_session(&mut self, why: &str) -> Result<(), String> {
        if let Some(old) = self.status.session_id.clone() {
            self.status.previous_sessions.push(old);
            let n = self.status.previous_sessions.len();
            if n > 20 {
                self.status.previous_sessions.drain(..n - 20);
            }
        }
        self.shutdown().await;
        self.fresh_start(why).map_err(|e| e.to_string())
    }

    /// The rooms her reply may name: her configured rooms, by name and by the id each
    /// resolved to, and the batch's rooms.
    async fn rooms_allowed(&self, batch: &[Delivery]) -> Vec<String> {
        let mut rooms: Vec<String> = self.persona.rooms.clone();
        // A configured room by its id too: batches show rooms as "#alias (!id)".
        for name in &self.persona.rooms {
            rooms.extend(self.mouth.resolved(name).await);
        }
        for d in batch {
            rooms.push(d.room_id.clone());
            rooms.extend(d.room_alias.clone());
        }
        rooms
    }

    async fn ensure_cli(&mut self) -> Result<&mut Cli, DriverError> {
        if self.cli.is_none() {
            // A live process takes one of the gateway's slots, waiting for an idle Persona
            // to stop hers when none is free.
            if let (Some(p), None) = (&self.processes, &self.slot) {
                self.slot = Some(p.acquire(&self.persona.id, self.evict.clone()).await);
            }
            let id = &self.persona.id;
            let mut cfg = self.base.clone();
            match self.inbox.session_value(id, "session_id").ok().flatten() {
                Some(sid) => {
                    let stored = self.inbox.session_value(id, "prompt_hash").ok().flatten();
                    cfg.system_prompt_changed = stored.as_deref() != Some(&self.prompt_hash);
                    cfg.session_id = Some(sid);
                    cfg.resume = true;
                }
                // A new session: `fresh_start` forgot what the old one saw. Not here: the
                // batch it starts with was composed (and marked seen) before the process.
                None => {
                    let sid = uuid::Uuid::new_v4().to_string();
                    // A new session has billed nothing yet.
                    self.billed_so_far = Some(KeptTotals {
                        session: sid.clone(),
                        usage: Usage::default(),
                    });
                    cfg.session_id = Some(sid);
                    cfg.resume = false;
                }
            }
            tracing::info!(persona = %id, session = ?cfg.session_id, resume = cfg.resume, "starting the claude CLI");
            self.cli = Some(Cli::spawn(cfg).await?);
        }
        self.cli
            .as_mut()
            .ok_or_else(|| DriverError::Exited("no process".into()))
    }

    /// Forgets the session: the next turn starts a fresh one (a new generation).
    fn fresh_start(&mut self, why: &str) -> Result<(), InboxError> {
        let id = self.persona.id.clone();
        tracing::info!(persona = %id, why, "fresh session");
        self.cli = None;
        self.seen.clear();
        self.inbox.set_session_value(&id, "session_id", None)?;
        self.status.generation += 1;
        self.inbox.set_session_value(
            &id,
            "generation",
            Some(&self.status.generation.to_string()),
        )?;
        self.status.session_id = None;
        self.telemetry.after_fresh_start();
        // The new session holds no failed attempt.
        self.set_failed(None);
        Ok(())
    }

    /// Sets (and stores) the turn the model API failed on; a failure to store only means a
    /// restart of the gateway would send its batch again.
    fn set_failed(&mut self, failed: Option<ApiFailure>) {
        self.keep_learned(FAILED, &failed);
        self.failed = failed;
    }

    /// Books the gap since her last turn for predictive keep-warm, up to when the batch's first
    /// message was said (`said_ms`, the homeserver's clock), and stores her gaps so a restart
    /// keeps what was learned.
    fn book_gap(&mut self, now: Instant, said_ms: i64) {
        let last = self.telemetry.last_turn_at;
        let said = said_at(now, crate::clock::unix_ms(), said_ms, last);
        if self.telemetry.batch_arrived(said) {
            self.keep_learned(GAPS, &self.telemetry.gaps);
        }
    }

    /// What her session has seen that can still be shown to her (`lines`: her rooms'
    /// timelines), as stored with her turn so that after a restart of the gateway the resumed
    /// session is not shown it again (JSON; `None` without a session).
    fn seen_to_keep(&self, lines: &[(String, Vec<wire::docs::ContextLine>)]) -> Option<String> {
        let session = self.status.session_id.clone()?;
        let shown: std::collections::HashSet<&str> = lines
            .iter()
            .flat_map(|(_, ls)| ls.iter().map(|l| l.event_id.as_str()))
            .collect();
        let ids = self
            .seen
            .to_keep(SEEN_LATEST, |id| shown.contains(id))
            .into_iter()
            .map(str::to_owned)
            .collect();
        serde_json::to_string(&KeptSeen { session, ids }).ok()
    }

    /// Stores, with one flush, what a restart of the gateway goes on from for the session it
    /// resumes: what the policy knows of it (its size, when her cache was last touched, ski
    /// rental's rent) and its running totals at its last result. Called before each record
    /// is written: a crash between the two loses that record rather than bills it twice.
    fn keep_session(&self) {
        let Some(session) = self.status.session_id.clone() else {
            return;
        };
        let policy = KeptPolicy {
            session,
            telemetry: self.telemetry.keep(Instant::now(), crate::clock::unix_ms()),
        };
        self.store_json(&[
            (POLICY, serde_json::to_string(&policy)),
            (TOTALS, serde_json::to_string(&self.billed_so_far)),
        ]);
    }

    /// Stores something the turn loop keeps across restarts (JSON in her session values: what
    /// the policy learned, a failed turn); see [`TurnLoop::store_json`].
    fn keep_learned<T: Serialize>(&self, name: &str, value: &T) {
        self.store_json(&[(name, serde_json::to_string(value))]);
    }

    /// Stores session values serialized as JSON, all with one flush; a `null` (an `Option`
    /// that is `None`) removes the value. A failure is logged: a restart would only start
    /// over what they held.
    fn store_json(&self, values: &[(&str, serde_json::Result<String>)]) {
        let stored = values
            .iter()
            .map(|(name, v)| match v {
                Ok(v) => Ok((*name, (v != "null").then_some(v.as_str()))),
                Err(e) => Err(e.to_string()),
            })
            .collect::<Result<Vec<_>, _>>()
            .and_then(|vs| {
                self.inbox
                    .set_session_values(&self.persona.id, &vs)
                    .map_err(|e| e.to_string())
            });
        if let Err(e) = stored {
            let names: Vec<&str> = values.iter().map(|(n, _)| *n).collect();
            tracing::warn!(persona = %self.persona.id, ?names, error = %e, "session values not stored; a restart starts them over");
        }
    }

    /// Compacts her conversation with the CLI's `/compact` and returns its boundary, `None`
    /// when the CLI did not compact (an error, no boundary): the caller starts fresh then.
    /// The summary is her memory of the lines she saw, so they are not sent again as context:
    /// with a large `context_bytes` that would write back much of what the compaction took out
    /// (the session benchmark's long conversation compacted five times instead of three and
    /// cost 1.12x resume-per-turn).
    async fn compact(&mut self, why: &str) -> Option<CompactMetadata> {
        let started = Instant::now();
        // A failed turn's text is summarized with the rest: its retry sends the batch again.
        self.set_failed(None);
        let done = match self.ensure_cli().await {
            Ok(cli) => cli.compact().await,
            Err(e) => Err(e),
        };
        match done {
            Ok(Turn {
                compacted: Some(m),
                result,
                last_request_at,
                ..
            }) if !result.is_error => {
                tracing::info!(persona = %self.persona.id, why, pre = m.pre_tokens, post = m.post_tokens, "session compacted");
                // The CLI reports no usage for `/compact`; its running totals have the summary
                // request. Without them (none of this session's kept) it is estimated: the
                // conversation sent uncached, the kept size as output.
                let (usage, how) = match self.billed(&result) {
                    Some(u) => (u, "billed"),
                    None => (
                        Usage {
                            input: m.pre_tokens,
                            output: m.post_tokens,
                            ..Usage::default()
                        },
                        "tokens estimated",
                    ),
                };
                // The CLI bills a `/compact` as a local command (no usage); its boundary's
                // post_tokens (the summary and what was kept) is what the compaction wrote.
                self.telemetry
                    .after_compact(m.post_tokens, m.post_tokens, last_request_at);
                self.record_upkeep(
                    RecordKind::Compaction,
                    &usage,
                    started,
                    &format!("compacted ({why}); {how}"),
                );
                self.status.compactions += 1;
                self.keep_learned(SUMMARIES, &self.telemetry.summaries);
                Some(m)
            }
            Ok(t) => {
                tracing::warn!(persona = %self.persona.id, why, errors = ?t.result.errors, "compaction did not happen; starting fresh instead");
                // Its summary request may have been billed all the same.
                if let Some(u) = self.billed(&t.result).filter(|u| *u != Usage::default()) {
                    self.record_upkeep(
                        RecordKind::Compaction,
                        &u,
                        started,
                        &format!("compaction failed ({why}); she starts fresh"),
                    );
                }
                None
            }
            Err(e) => {
                tracing::warn!(persona = %self.persona.id, why, error = %e, "compaction failed; starting fresh instead");
                self.cli = None;
                None
            }
        }
    }

    /// Runs `text` in her process (spawned, resuming her session, if none lives): the turn,
    /// or the event that tells her attempt the process died (its error kept in `died`).
    async fn run_text(
        &mut self,
        text: &str,
        images: &[session::proto::Image],
        died: &mut Option<DriverError>,
    ) -> (Option<Turn>, Event) {
        let result = match self.ensure_cli().await {
            Ok(cli) => cli.turn_with(text, images).await,
            Err(e) => Err(e),
        };
        match result {
            Ok(t) => {
                let ran = Ran {
                    outcome: t.result.outcome(),
                    errors: t.result.is_error && !t.result.errors.is_empty(),
                    status: t.result.api_error_status,
                };
                if ran.errors {
                    tracing::warn!(persona = %self.persona.id, errors = ?t.result.errors, "the turn ended in errors");
                }
                (Some(t), Event::Ran(ran))
            }
            Err(e) => {
                self.cli = None;
                *died = Some(e);
                (None, Event::Died)
            }
        }
    }

    /// Whether her stored session's transcript already holds the batch `text` (its header
    /// line): a process that resumes the session will send the model that text again.
    fn held_by_session(&self, text: &str) -> bool {
        match (&self.status.session_id, render::batch_header(text)) {
            (Some(session), Some(header)) => {
                session::driver::transcript_holds(&self.base, session, header)
            }
            _ => false,
        }
    }

    /// The message of a retry whose batch her session holds already: the `restart` note if
    /// any, and a `[retry]` note saying `why` (the batch is "above").
    fn retry_text(&mut self, restart: Option<Note>, why: &str) -> String {
        let mut notes: Vec<Note> = restart.into_iter().collect();
        notes.push(Note::new(
            "retry",
            format!("{why}, which you have not answered yet: answer it now (it is not repeated)"),
        ));
        render::render(&[], &mut self.seen, &notes)
    }

    /// The text of a checkpoint turn (before a planned compaction, with
    /// `checkpoint_before_compact`): it asks her to put what she must keep into her reply's
    /// extension fields, which go to the outbox; her says in it are not sent.
    fn checkpoint_text(&mut self) -> String {
        let note = Note::new(
            "checkpoint",
            "your conversation is about to be compacted: only a summary of it will remain. Put \
             what you must keep into your reply's fields now. Say nothing: says in this reply \
             are not sent.",
        );
        render::render(&[], &mut self.seen, &[note])
    }

    /// Records the checkpoint turn and commits her reply's fields if she `answered`.
    fn keep_checkpoint(
        &mut self,
        turn: Option<&Turn>,
        answered: bool,
        started: Instant,
    ) -> Result<(), TurnError> {
        let Some(turn) = turn else {
            return Ok(());
        };
        let id = self.persona.id.clone();
        let turn_id = format!(
            "checkpoint:{id}:{}:{}",
            self.status.generation,
            self.status.compactions + 1
        );
        let billed = self
            .billed(&turn.result)
            .unwrap_or_else(|| turn.result.usage.usage());
        self.record_upkeep(
            RecordKind::Checkpoint,
            &billed,
            started,
            &format!("{:?}", turn.result.outcome()),
        );
        match self.schema.check(turn.result.structured_output.as_ref()) {
            Ok(reply) if answered => {
                tracing::info!(%turn_id, fields = reply.extensions.len(), unsent_says = reply.say.len(), "checkpoint turn");
                self.inbox.commit_turn(
                    &id,
                    &TurnCommit {
                        turn_id: &turn_id,
                        extensions: &reply.extensions,
                        at_ms: crate::clock::unix_ms(),
                        ..TurnCommit::default()
                    },
                )?;
            }
            Ok(_) => {
                tracing::warn!(%turn_id, outcome = ?turn.result.outcome(), "checkpoint turn failed")
            }
            Err(e) => tracing::warn!(%turn_id, error = %e, "checkpoint reply not kept"),
        }
        Ok(())
    }

    /// Her operator's compaction, performed as her attempt decides it ([`Attempt::compaction`]):
    /// a checkpoint turn first when configured; a failed compaction is a fresh start. Whether
    /// the CLI compacted.
    async fn compact_on_request(&mut self) -> Result<bool, TurnError> {
        let (mut attempt, mut action) =
            Attempt::compaction(self.persona.session.checkpoint_before_compact);
        let mut text = String::new();
        let mut turn = None;
        let mut died = None;
        let started = Instant::now();
        loop {
            let event = match action {
                Action::Compacted { compacted } => return Ok(compacted),
                Action::Run(t) => {
                    let sent = self.text_for(t, &[], &mut text);
                    let (t, event) = self.run_text(&sent, &[], &mut died).await;
                    turn = t;
                    event
                }
                Action::KeepCheckpoint { answered } => {
                    if let Err(e) = self.keep_checkpoint(turn.as_ref(), answered, started) {
                        tracing::warn!(persona = %self.persona.id, error = %e, "checkpoint turn failed; compacting anyway");
                    }
                    Event::Done
                }
                Action::Compact(why) => match self.compact(&why.describe()).await {
                    Some(_) => Event::Compacted {
                        kept_refused: false,
                    },
                    None => Event::CompactFailed,
                },
                Action::FreshStart(why) => {
                    self.fresh_start(&why.describe())?;
                    Event::Done
                }
                Action::CheckTranscript => Event::Held(self.held_by_session(&text)),
                other => {
                    tracing::error!(?other, "an action an operator's compaction does not take");
                    return Ok(false);
                }
            };
            action = attempt.on(event);
            if event == Event::Died {
                respawning(&self.persona.id, &action, died.as_ref());
            }
        }
    }

    /// The text `t` names: the batch as composed, a retry note, the last text again, the
    /// checkpoint note. `last` is the text of the current run (the composed batch, a retry
    /// note, the checkpoint note), which a text sent `Again` repeats.
    fn text_for(&mut self, t: Text, batch: &[Delivery], last: &mut String) -> String {
        match t {
            Text::Composed => last.clone(),
            Text::Retry { why, restart } => {
                // The batch is in her transcript: it counts as shown.
                render::render(batch, &mut self.seen, &[]);
                let restart = restart.map(|r| self.restart_note(r));
                tracing::info!(why = %why.describe(), "retrying without the batch: her session holds it");
                *last = self.retry_text(restart, &why.describe());
                last.clone()
            }
            Text::Again { restart: None } => last.clone(),
            Text::Again { restart: Some(r) } => render::with_note(last, &self.restart_note(r)),
            Text::Checkpoint => {
                *last = self.checkpoint_text();
                last.clone()
            }
        }
    }

    /// The note that tells her she was restarted: what, how long since her last turn, and
    /// whether her session was resumed.
    fn restart_note(&self, what: Restarted) -> Note {
        let what = match what {
            Restarted::Gateway => "the gateway",
            Restarted::Process => "your claude process",
        };
        let last = self
            .inbox
            .session_value(&self.persona.id, "last_turn_ms")
            .ok()
            .flatten()
            .and_then(|v| v.parse::<i64>().ok());
        let ago = match last {
            Some(at) => format!(
                "your last turn was {} ago",
                human_duration(crate::clock::unix_ms().saturating_sub(at))
            ),
            None => "the time of your last turn is not known".to_owned(),
        };
        let session = if self.status.session_id.is_some() {
            "your session was resumed: the conversation above continues"
        } else {
            "this is a fresh session: your earlier conversation is not in it"
        };
        Note::new("restart", format!("{what} was restarted; {ago}; {session}"))
    }

    /// The user message of a turn: header, notes (the gateway's, then her Minds'), the batch,
    /// and for a new session what it is given to start from.
    fn compose(&mut self, batch: &[Delivery], stored: &[crate::inbox::Note]) -> String {
        let mut notes = Vec::new();
        if self.restarted {
            notes.push(self.restart_note(Restarted::Gateway));
        }
        if let Some(c) = &self.note {
            notes.push(Note::new("correction", c.clone()));
        }
        self.telling.clear();
        let aside = self
            .inbox
            .set_aside_list(&self.persona.id)
            .unwrap_or_default();
        // What was set aside is not shown again as context or recent lines either: the API
        // refused it, and would refuse the turn that carried it.
        for d in aside.iter().flat_map(|a| &a.deliveries) {
            self.seen.insert(&d.event_id);
        }
        for a in aside.into_iter().filter(|a| !a.told) {
            let rooms: std::collections::BTreeSet<String> = a
                .deliveries
                .iter()
                .map(|d| {
                    let room = d.room_alias.as_deref().unwrap_or(&d.room_id);
                    format!("\"{}\"", session::untrusted::field(room, 128))
                })
                .collect();
            notes.push(Note::new(
                "set_aside",
                format!(
                    "{} message(s) from {} were set aside unanswered, and you have not seen them: {} Her operator may put them back or drop them.",
                    a.deliveries.len(),
                    rooms.into_iter().collect::<Vec<_>>().join(", "),
                    a.why
                ),
            ));
            self.telling.push(a.id);
        }
        notes.extend(
            stored
                .iter()
                .map(|n| Note::from_minds(&n.kind, n.text.clone())),
        );
        let mut text = render::render(batch, &mut self.seen, &notes);
        if self.status.session_id.is_none() {
            // A session after an earlier one (not her very first) is given the recent lines.
            let had_session = self.status.turns_total > 0 || self.status.generation > 0;
            let shown: Vec<&str> = stored.iter().map(|n| n.kind.as_str()).collect();
            // After the batch: its deliveries and context are not repeated.
            let rooms = if had_session {
                self.room_lines()
            } else {
                Vec::new()
            };
            text.push_str(&render::rehydration(
                &self.latest_notes(&shown),
                &rooms,
                self.persona.limits.context_lines,
                self.persona.limits.context_bytes / 2,
                &mut self.seen,
            ));
        }
        text
    }

    #[tracing::instrument(skip_all, fields(persona = %self.persona.id, turn = tracing::field::Empty))]
    async fn turn(&mut self, batch: &[Delivery]) -> Result<(), TurnError> {
        let id = self.persona.id.clone();
        let span = batch.first().zip(batch.last()).map(|(f, l)| (f.seq, l.seq));
        // The notes it shows: those waiting; a retried batch shows the same ones, no newer.
        let mut stored = self.inbox.pending_notes(&id)?;
        if let Some(through) = self
            .inbox
            .session_value(&id, "inflight_notes")?
            .and_then(|v| v.parse::<u64>().ok())
            .filter(|_| span.is_some())
        {
            stored.retain(|n| n.seq <= through);
        }
        let note_span = stored
            .first()
            .zip(stored.last())
            .map(|(f, l)| (f.seq, l.seq));
        let turn_id = match (span, note_span) {
            (Some((a, b)), _) => format!("turn:{id}:{a}-{b}"),
            (None, Some((a, b))) => format!("turn:{id}:n{a}-{b}"),
            (None, None) => return Ok(()),
        };
        tracing::Span::current().record("turn", turn_id.as_str());
        // A batch already in flight is a retry: a turn before may have left it in her
        // transcript.
        let inflight = span.map(|(first, last)| format!("{first}-{last}"));
        let retried = inflight.is_some()
            && self.inbox.session_value(&id, "inflight")?.as_deref() == inflight.as_deref();
        // Stored together (one flush): the batch and the notes in flight, and its says'
        // receipts (`TURN:i`) kept whatever their age until the turn is committed, so a reply
        // sent again after a long outage sends each say at most once.
        let keep = format!("{turn_id}:");
        let through = note_span.map(|(_, through)| through.to_string());
        let mut values = vec![(crate::inbox::retention::KEEP_RECEIPTS, Some(keep.as_str()))];
        if inflight.is_some() {
            values.push(("inflight", inflight.as_deref()));
        }
        if through.is_some() {
            values.push(("inflight_notes", through.as_deref()));
        }
        self.inbox.set_session_values(&id, &values)?;
        let stored_output = self.stored_reply(&turn_id);
        let started = Instant::now();
        // What a fresh start would write: its rehydration, then the lines this session holds
        // that the rehydration leaves out, which her rooms' next batches show again.
        let lines = self.room_lines();
        let decision = if stored_output.is_some() {
            Decision::Continue
        } else {
            if let Some(first) = batch.first() {
                self.book_gap(started, first.ts);
            }
            self.telemetry.batch_waiting = true;
            self.telemetry.process = if self.cli.is_some() {
                Process::Running
            } else {
                Process::Stopped
            };
            self.telemetry.base_tokens = self.prompt_tokens;
            let (rehydrated, resent) = render::fresh_start_bytes(
                &self.latest_notes(&[]),
                &lines,
                self.persona.limits.context_lines,
                self.persona.limits.context_bytes,
                &self.seen,
            );
            self.telemetry.rehydration_tokens = self.prompt_tokens + rehydrated as u64 / 4;
            self.telemetry.resend_tokens = resent as u64 / 4;
            let decision = if self.status.session_id.is_none() {
                Decision::Continue
            } else {
                policy::decide(&self.telemetry, started, &self.policy)
            };
            tracing::info!(?decision, telemetry = ?self.telemetry, "turn decision");
            self.metrics.decision(&id, decision_name(&decision));
            decision
        };
        // The session that will run this batch: the live process's, else the stored one.
        let next_session = self
            .cli
            .as_ref()
            .and_then(Cli::session_id)
            .or(self.status.session_id.as_deref())
            .map(str::to_owned);
        let api_failed = self
            .failed
            .as_ref()
            .filter(|f| f.turn_id == turn_id && Some(&f.session) == next_session.as_ref())
            .map(|f| f.status);
        let (mut attempt, mut action) = Attempt::start(Start {
            stored_reply: stored_output.is_some(),
            has_session: self.status.session_id.is_some(),
            live: self.cli.is_some(),
            retried,
            api_failed,
            decision,
            checkpoint: self.persona.session.checkpoint_before_compact,
            restarted: self.restarted,
        });
        let rooms: Vec<String> = batch
            .iter()
            .map(|d| d.room_id.clone())
            .collect::<std::collections::BTreeSet<_>>()
            .into_iter()
            .collect();
        let typing = (stored_output.is_none()).then(|| self.mouth.typing_while(rooms));
        // What the session had seen before the batch's text: if it refuses the batch, it saw
        // none of it.
        let mut seen_before = None;
        // The text of the current run, and the last run's turn and the error its process died
        // of.
        let mut text = String::new();
        let mut turn = None;
        let mut died = None;
        // The batch's images, sent with the text while it carries the batch.
        let mut images: Vec<session::proto::Image> = Vec::new();
        let mut carries_batch = false;
        let checkpoint_started = Instant::now();
        loop {
            tracing::debug!(?action, "turn action");
            let event = match action {
                Action::SendStored => {
                    // She answered this batch and a say failed (or the gateway stopped between
                    // says): the same reply is sent, each say at most once; she is not asked
                    // again.
                    tracing::info!("sending her stored reply to this batch");
                    self.deliver(&turn_id, batch, &stored, stored_output.as_ref(), &lines)
                        .await?;
                    // Counted as a turn that went out, after the one whose say failed (counted
                    // by the turn loop as `send_failed`); nothing was billed for it.
                    self.metrics
                        .turn(&id, "sent", started.elapsed().as_secs_f64());
                    return Ok(());
                }
                Action::FreshStart(why) => {
                    self.fresh_start(&why.describe())?;
                    Event::Done
                }
                Action::Compact(why) => {
                    // The refused message, as her transcript names it: a refused turn stays in
                    // the CLI's conversation, and when it did not fit the summary request
                    // either the compaction keeps it verbatim past the summary
                    // (`live_session::a_refused_turn_is_kept_verbatim_past_the_compaction_after_it`):
                    // sent again, she would see the batch twice.
                    let refused = match (why, &self.status.session_id, render::batch_header(&text))
                    {
                        (CompactWhy::Refused, Some(session), Some(header)) => {
                            session::driver::transcript_user_message(&self.base, session, header)
                        }
                        _ => None,
                    };
                    match self.compact(&why.describe()).await {
                        Some(m) => Event::Compacted {
                            kept_refused: refused
                                .is_some_and(|id| m.preserved_messages.uuids.contains(&id)),
                        },
                        None => Event::CompactFailed,
                    }
                }
                Action::Compose => {
                    seen_before.get_or_insert_with(|| self.seen.clone());
                    // Her batch's images and text files, fetched (and decrypted) now; a
                    // degraded batch keeps their descriptions.
                    if self.degrade {
                        text = self.compose(batch, &stored);
                        images = Vec::new();
                    } else {
                        let media = crate::media::prepare(
                            self.mouth.client(),
                            &id,
                            batch,
                            &self.persona.limits,
                        )
                        .await;
                        text = self.compose(&media.apply(batch), &stored);
                        images = media.images;
                    }
                    carries_batch = true;
                    Event::Done
                }
                Action::Unsee => {
                    if let Some(seen) = &seen_before {
                        self.seen = seen.clone();
                    }
                    Event::Done
                }
                Action::CheckTranscript => Event::Held(self.held_by_session(&text)),
                Action::Run(t) => {
                    if matches!(t, Text::Retry { .. }) {
                        seen_before.get_or_insert_with(|| self.seen.clone());
                    }
                    // The batch's images go with its text, not with a note that replaces it.
                    if matches!(t, Text::Retry { .. } | Text::Checkpoint) {
                        carries_batch = false;
                    }
                    let sent = self.text_for(t, batch, &mut text);
                    let with: &[session::proto::Image] = if carries_batch { &images } else { &[] };
                    let (t, event) = self.run_text(&sent, with, &mut died).await;
                    turn = t;
                    event
                }
                Action::KeepCheckpoint { answered } => {
                    self.keep_checkpoint(turn.as_ref(), answered, checkpoint_started)?;
                    Event::Done
                }
                Action::Deliver | Action::Fail(_) | Action::Compacted { .. } => break,
            };
            action = attempt.on(event);
            if event == Event::Died {
                respawning(&self.persona.id, &action, died.as_ref());
            }
        }
        if let Some(typing) = typing {
            typing.stop().await;
        }
        let turn = match (action, turn) {
            (Action::Deliver, Some(turn)) => turn,
            (Action::Fail(Failure::TooLong), _) => {
                return Err(TurnError::TooLong {
                    deliveries: batch.len(),
                    bytes: batch.iter().map(|d| d.text.len()).sum(),
                })
            }
            (Action::Fail(Failure::Unauthorized), _) => return Err(TurnError::Unauthorized),
            (Action::Fail(Failure::Api { status }), turn) => {
                // Its text is in the transcript of the session it ran in.
                let failed = turn
                    .and_then(|t| t.result.session_id)
                    .map(|session| ApiFailure {
                        turn_id,
                        session,
                        status,
                    });
                self.set_failed(failed);
                return Err(TurnError::Api(status));
            }
            _ => {
                return Err(TurnError::Cli(died.unwrap_or_else(|| {
                    DriverError::Exited("resume kept failing".into())
                })))
            }
        };
        let res = &turn.result;
        if let Some(sid) = &res.session_id {
            if self.status.session_id.as_deref() != Some(sid) {
                self.inbox.set_session_value(&id, "session_id", Some(sid))?;
                self.inbox
                    .set_session_value(&id, "prompt_hash", Some(&self.prompt_hash))?;
                self.status.session_id = Some(sid.clone());
            }
        }
        // A turn whose say failed was billed all the same: it is recorded, then fails.
        let delivered = self
            .deliver(
                &turn_id,
                batch,
                &stored,
                res.structured_output.as_ref(),
                &lines,
            )
            .await;
        let (says, extensions, outcome) = match &delivered {
            Ok((says, extensions, outcome)) => (*says, *extensions, outcome.clone()),
            Err(e) => (0, 0, e.to_string()),
        };
        let shown = stored.len();
        // What it billed: every request of the turn (a reply bounced by the schema is asked
        // for again), and anything since the last result the result leaves out.
        let own = res.usage.usage();
        let billed = self.billed(res).unwrap_or(own);
        // The prefix the policy watches: the last request's prompt, with the turn's output.
        let last = turn.last_request.map_or(own, |last| Usage {
            output: own.output,
            ..last
        });
        self.telemetry
            .book_earlier_reads(&turn.earlier_reads, &self.prices);
        self.telemetry.after_turn(
            &last,
            res.outcome(),
            turn.last_request_at,
            Instant::now(),
            &self.prices,
        );
        // Before the record: a crash between the two loses the record, not bills it twice.
        self.keep_session();
        let (first_seq, last_seq) = span.unwrap_or_default();
        let record = TurnRecord {
            first_seq,
            last_seq,
            notes: shown,
            extensions,
            cli_cost_usd: res.total_cost_usd,
            says,
            decision: format!("{decision:?}"),
            // A rebuild's (the old design's) price, not a fresh start's: that also counts
            // what her rooms would send again, which a rebuild per turn never held.
            rebuild_usd: Prices::dollars(
                self.telemetry.rehydration_tokens,
                self.policy.prices.write(self.policy.ttl),
            ),
            fresh_start_usd: policy::rebuild_cost(&self.telemetry, &self.policy),
            ..self.record(RecordKind::Turn, &billed, &last, started, outcome)
        };
        let m = self.metrics.clone();
        // A say that failed fails the turn, which the turn loop counts by its error.
        if delivered.is_ok() {
            m.turn(
                &id,
                if record.outcome == "sent" {
                    "sent"
                } else {
                    "not_sent"
                },
                started.elapsed().as_secs_f64(),
            );
        }
        m.usage(&id, &billed, record.cost_usd);
        tracing::info!(?record, "turn done");
        self.write_status(record);
        delivered.map(drop)
    }

    /// Sends her reply's says, each at most once (request id `TURN:i`), and commits the turn:
    /// the ack, the notes shown and her extension fields. A reply with says is stored before
    /// the first, so the retry after a say failed (or after a crash between says) sends this
    /// reply again instead of asking her again: she would see the batch twice, and a new reply
    /// could drop or change a say not sent yet. Returns her says, her extension fields and
    /// the outcome.
    async fn deliver(
        &mut self,
        turn_id: &str,
        batch: &[Delivery],
        stored: &[crate::inbox::Note],
        output: Option<&serde_json::Value>,
        lines: &[(String, Vec<wire::docs::ContextLine>)],
    ) -> Result<(usize, usize, String), TurnError> {
        let id = self.persona.id.clone();
        let allowed = self.rooms_allowed(batch).await;
        let allowed_refs: Vec<&str> = allowed.iter().map(String::as_str).collect();
        // Her replies, edits and reactions name lines of this batch's conversation only: a
        // public turn does not quote or react in a DM, nor a DM's turn in a room.
        let lines = self.conversation_lines(batch, lines).await;
        let lines = lines.as_slice();
        let mut kept = false;
        let (says, extensions, outcome) = match self.schema.validate(output, &allowed_refs) {
            Ok(reply) => {
                self.note = None;
                if let (Some(output), false) = (output, reply.say.is_empty()) {
                    let value = serde_json::json!({ "turn": turn_id, "output": output });
                    self.inbox
                        .set_session_value(&id, REPLY, Some(&value.to_string()))?;
                    kept = true;
                }
                let mut refused: Vec<(&str, &str, String)> = Vec::new();
                for (i, say) in reply.say.iter().enumerate() {
                    let request_id = format!("{turn_id}:{i}");
                    let me = self.persona.user_id.as_str();
                    let targets = match render::targets(say, batch, lines, me) {
                        Ok(t) => t,
                        Err(e) => {
                            tracing::warn!(request = %request_id, error = %e, "say refused; not sent");
                            refused.push((&say.room, &say.text, e.to_string()));
                            continue;
                        }
                    };
                    if !targets.unresolved.is_empty() {
                        tracing::warn!(request = %request_id, handles = ?targets.unresolved, "say sent without the lines it named: she never saw them");
                    }
                    let mentions = render::mentioned(say, batch, lines, me);
                    let pills = render::pills(say, batch, &mentions);
                    let receipt = self
                        .mouth
                        .send_shaped(
                            &SendRequest {
                                request_id: request_id.clone(),
                                persona: id.clone(),
                                room: say.room.clone(),
                                text: say.text.clone(),
                                thread_root: targets.thread_root.clone(),
                                reply_to: targets.reply_to.clone(),
                            },
                            &Shape {
                                mentions: Some(&mentions),
                                pills: &pills,
                                replaces: targets.replaces.as_deref(),
                            },
                        )
                        .await;
                    match receipt.status {
                        // Her own line comes back in her rooms' timelines: she said it, so it
                        // is never shown to her again as context.
                        Status::Ok => {
                            if let Some(event) = &receipt.event_id {
                                self.seen.insert(event);
                            }
                        }
                        Status::Failed | Status::Unknown => {
                            return Err(TurnError::Send {
                                request_id,
                                error: receipt.error.unwrap_or_default(),
                            })
                        }
                        // Refused for good (too long, a room she may not post in): not
                        // retried, and her next batch tells her it went nowhere.
                        Status::Rejected => {
                            tracing::warn!(request = %request_id, error = ?receipt.error, "say refused; not retried");
                            refused.push((&say.room, &say.text, receipt.error.unwrap_or_default()));
                        }
                    }
                }
                // Her reactions, each once (request id `TURN:react:i`); one that names no
                // line she saw, or that the homeserver refuses, is logged and left.
                for (i, r) in reply.react.iter().enumerate() {
                    let request_id = format!("{turn_id}:react:{i}");
                    let Some(line) = session::handle::resolve(&r.to, batch, lines) else {
                        tracing::warn!(request = %request_id, to = %r.to, "reaction to a line she never saw; not sent");
                        continue;
                    };
                    let receipt = self
                        .mouth
                        .react(&request_id, line.room_id, line.event_id, &r.key)
                        .await;
                    match receipt.status {
                        Status::Ok => {}
                        Status::Rejected => {
                            tracing::warn!(request = %request_id, error = ?receipt.error, "reaction refused");
                        }
                        Status::Failed | Status::Unknown => {
                            return Err(TurnError::Send {
                                request_id,
                                error: receipt.error.unwrap_or_default(),
                            })
                        }
                    }
                }
                let sent = reply.say.len() - refused.len();
                let outcome = if refused.is_empty() {
                    "sent".to_owned()
                } else {
                    let note = render::unsent_says_note(&refused, reply.say.len());
                    let outcome = format!("sent {sent} of {}: {note}", reply.say.len());
                    self.note = Some(note);
                    outcome
                };
                (sent, reply.extensions, outcome)
            }
            Err(e) => {
                tracing::warn!(error = %e, "reply not sent");
                self.note = Some(e.correction_note());
                (0, Vec::new(), e.to_string())
            }
        };
        let shown: Vec<u64> = stored.iter().map(|n| n.seq).collect();
        let acked = batch.last().map(|d| d.seq);
        // With the turn: what her session has seen, the correction her next batch carries
        // (both outlive a restart), and her stored reply gone (a stale one could not match a
        // later turn, seqs are not reused, but it has no use left).
        let seen = self.seen_to_keep(lines);
        let mut values = vec![
            (CORRECTION, self.note.as_deref()),
            (FAILED, None),
            (crate::inbox::retention::KEEP_RECEIPTS, None),
        ];
        if seen.is_some() {
            values.push((SEEN, seen.as_deref()));
        }
        if kept {
            values.push((REPLY, None));
        }
        self.inbox.commit_turn(
            &id,
            &TurnCommit {
                ack_through: acked,
                notes_shown: &shown,
                turn_id,
                extensions: &extensions,
                at_ms: crate::clock::unix_ms(),
                values: &values,
            },
        )?;
        self.restarted = false;
        // She can take turns again.
        self.set_error(None);
        if acked.is_some() {
            self.signals.acked.notify_one();
        }
        let mut last_per_room: BTreeMap<&str, &str> = BTreeMap::new();
        for d in batch {
            last_per_room.insert(&d.room_id, &d.event_id);
        }
        for (room, event) in last_per_room {
            self.mouth.read_receipt(room, event).await;
        }
        Ok((says, extensions.len(), outcome))
    }

    /// Her reply to `turn_id` stored by [`TurnLoop::deliver`], if a say of it failed.
    fn stored_reply(&self, turn_id: &str) -> Option<serde_json::Value> {
        let v = self
            .inbox
            .session_value(&self.persona.id, REPLY)
            .ok()
            .flatten()?;
        let mut v: serde_json::Value = serde_json::from_str(&v).ok()?;
        (v["turn"] == turn_id).then(|| v["output"].take())
    }

    /// Her rooms' timelines as the inbox holds them, oldest line first.
    fn room_lines(&self) -> Vec<(String, Vec<wire::docs::ContextLine>)> {
        let id = &self.persona.id;
        self.inbox
            .timeline_rooms(id)
            .unwrap_or_default()
            .into_iter()
            .map(|room| {
                let lines = self
                    .inbox
                    .timeline(id, &room)
                    .unwrap_or_default()
                    .into_iter()
                    .map(|l| l.line)
                    .collect();
                (room, lines)
            })
            .collect()
    }

    /// Of `lines` (her rooms' timelines), those of `batch`'s conversation: its one DM room, or
    /// her rooms that are not DMs.
    async fn conversation_lines(
        &self,
        batch: &[Delivery],
        lines: &[(String, Vec<wire::docs::ContextLine>)],
    ) -> Vec<(String, Vec<wire::docs::ContextLine>)> {
        let dm = batch
            .first()
            .filter(|d| d.is_direct)
            .map(|d| d.room_id.as_str());
        let mut out = Vec::new();
        for (room, l) in lines {
            let keep = match dm {
                Some(dm) => room == dm,
                None => {
                    let direct = match matrix_sdk::ruma::OwnedRoomId::try_from(room.as_str())
                        .ok()
                        .and_then(|r| self.mouth.client().get_room(&r))
                    {
                        Some(r) => r.is_direct().await.unwrap_or(true),
                        // A room she no longer knows: its lines are not this conversation's.
                        None => true,
                    };
                    !direct
                }
            };
            if keep {
                out.push((room.clone(), l.clone()));
            }
        }
        out
    }

    /// The latest note of each replacing kind (or her `state_file` while no `state` note came)
    /// other than the kinds `skip` (shown in the batch itself): what a new session is given.
    fn latest_notes(&self, skip: &[&str]) -> Vec<Note> {
        let mut latest: Vec<Note> = self
            .inbox
            .latest_notes(&self.persona.id)
            .unwrap_or_default()
            .into_iter()
            .map(|(kind, text)| Note::new(&kind, text))
            .collect();
        if !latest.iter().any(|n| n.kind == "state") {
            if let Some(path) = &self.persona.session.state_file {
                match std::fs::read_to_string(path) {
                    Ok(text) if !text.trim().is_empty() => {
                        latest.insert(0, Note::new("state", text));
                    }
                    Ok(_) => {}
                    Err(e) => {
                        tracing::warn!(path = %path.display(), error = %e, "state_file not read");
                    }
                }
            }
        }
        latest.retain(|n| !skip.contains(&n.kind.as_str()));
        latest
    }

    /// A record of what her session billed (`billed`) since the last, with the prompt of its
    /// last request (`last`: the prefix and its hit share) and its wall time since `started`.
    fn record(
        &self,
        kind: RecordKind,
        billed: &Usage,
        last: &Usage,
        started: Instant,
        outcome: String,
    ) -> TurnRecord {
        TurnRecord {
            kind,
            generation: self.status.generation,
            duration_ms: started.elapsed().as_millis() as u64,
            input_tokens: billed.input,
            cache_read_tokens: billed.cache_read,
            cache_write_tokens: billed.cache_write_5m + billed.cache_write_1h,
            output_tokens: billed.output,
            cost_usd: billed.cost(&self.prices),
            hit_ratio: last.hit_ratio(),
            prefix_tokens: last.prompt_tokens(),
            outcome,
            at_ms: crate::clock::unix_ms(),
            watermark_tokens: self.policy.watermark_tokens(),
            window_tokens: self.policy.context_window,
            ..TurnRecord::default()
        }
    }

    /// Appends `record` to her history file (a failure is logged: the turn is done anyway).
    fn append_to_history(&mut self, record: &TurnRecord) {
        if self.persona.budget.usd_per_day.is_some() {
            self.spend.add(record.at_ms, record.cost_usd);
        }
        if let Err(e) = append_history(
            &self.status_path.with_file_name(HISTORY_FILE),
            record,
            self.persona.session.history_turns,
            &mut self.history_lines,
        ) {
            tracing::warn!(error = %e, "history not written");
        }
    }

    fn write_status(&mut self, record: TurnRecord) {
        self.append_to_history(&record);
        self.status.turns_total += 1;
        self.status.turns.push_back(record);
        while self.status.turns.len() > TELEMETRY_KEPT {
            self.status.turns.pop_front();
        }
        self.save_status();
    }

    /// What her session billed since its last result, from the running totals of `result`
    /// (`None` when they cannot tell: another session, or none of this session's totals
    /// known); the totals are kept for the next result (and stored by
    /// [`TurnLoop::keep_session`] before its record is written).
    fn billed(&mut self, result: &session::proto::ResultEvent) -> Option<Usage> {
        let (session, usage) = (result.session_id.clone()?, result.cumulative()?);
        let since = match &self.billed_so_far {
            Some(k) if k.session == session => usage.since(&k.usage),
            _ => None,
        };
        self.billed_so_far = Some(KeptTotals { session, usage });
        since
    }

    /// Records what her session cost outside a turn (a refresh, a compaction, a checkpoint):
    /// in her history, her status file's upkeep and the cost metrics, so that what she is
    /// reported to cost is what the model API billed.
    fn record_upkeep(&mut self, kind: RecordKind, usage: &Usage, started: Instant, outcome: &str) {
        self.keep_session();
        let record = self.record(kind, usage, usage, started, outcome.to_owned());
        self.metrics.usage(&self.persona.id, usage, record.cost_usd);
        self.append_to_history(&record);
        self.status.upkeep_usd += record.cost_usd;
        self.save_status();
    }

    fn save_status(&self) {
        let tmp = self.status_path.with_extension("json.tmp");
        let bytes = serde_json::to_vec_pretty(&self.status).unwrap_or_default();
        if let Err(e) =
            std::fs::write(&tmp, bytes).and_then(|()| std::fs::rename(&tmp, &self.status_path))
        {
            tracing::warn!(error = %e, path = %self.status_path.display(), "status file not written");
        }
    }
}

/// Her full turn history, one [`TurnRecord`] per line, next to her status file (JSON lines:
/// readable by `cultnet-gateway report` and by `jq` while the gateway runs, unlike sled, which
/// one process holds locked).
pub const HISTORY_FILE: &str = "turns.jsonl";

/// Appends `record` to the history at `path`; past `keep` records (by a quarter), the oldest
/// are dropped (the file is rewritten and renamed into place). `lines` is the file's line count
/// (counted when `None`), kept by the caller so a turn does not read the whole file.
pub fn append_history(
    path: &std::path::Path,
    record: &TurnRecord,
    keep: usize,
    lines: &mut Option<usize>,
) -> std::io::Result<()> {
    use std::io::Write;
    let line = serde_json::to_string(record).map_err(std::io::Error::other)?;
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)?;
    writeln!(f, "{line}")?;
    drop(f);
    let keep = keep.max(1);
    let n = match lines {
        Some(n) => *n + 1,
        None => std::fs::read_to_string(path)?.lines().count(),
    };
    *lines = Some(n);
    if n > keep + keep / 4 {
        let text = std::fs::read_to_string(path)?;
        let n = text.lines().count();
        let kept: String = text
            .lines()
            .skip(n - keep)
            .flat_map(|l| [l, "\n"])
            .collect();
        let tmp = path.with_extension("jsonl.tmp");
        std::fs::write(&tmp, kept)?;
        std::fs::rename(&tmp, path)?;
        *lines = Some(keep.min(n));
    }
    Ok(())
}

/// Reads a turn history (lines that do not parse are skipped).
pub fn read_history(path: &std::path::Path) -> std::io::Result<Vec<TurnRecord>> {
    Ok(std::fs::read_to_string(path)?
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect())
}

/// The name of a refresh decision, without its reason (a metrics label).
/// Logs what her attempt does after her process died of `error`: respawn it, or give up
/// the round (its runs are spent).
fn respawning(persona: &str, next: &Action, error: Option<&DriverError>) {
    let error = error.map(ToString::to_string).unwrap_or_default();
    if next.is_final() {
        tracing::warn!(
            persona,
            error,
            "claude CLI failed; its runs are spent, the round fails"
        );
    } else {
        tracing::warn!(persona, error, "claude CLI failed; respawning");
    }
}

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

/// What the policy learned in earlier runs (`name`, JSON in her session values), or nothing
/// yet; a value that does not parse (another version wrote it) is logged and started over.
fn learned<T: serde::de::DeserializeOwned + Default>(
    inbox: &Inbox,
    persona: &str,
    name: &str,
) -> Result<T, InboxError> {
    Ok(match inbox.session_value(persona, name)? {
        None => T::default(),
        Some(v) => serde_json::from_str(&v).unwrap_or_else(|e| {
            tracing::warn!(persona, name, error = %e, "a stored value of the policy is unreadable; learning it again");
            T::default()
        }),
    })
}

/// Her model's prices: the configured table, else the model's published one, else Sonnet's
/// (with a warning: the policy's choices and her reported cost assume them).
fn prices_for(persona: &Persona, model: &str) -> Prices {
    if let Some(p) = &persona.session.prices {
        return p.table();
    }
    Prices::for_model(model).unwrap_or_else(|| {
        tracing::warn!(persona = %persona.id, model, "no published prices known for this model; costing it as Sonnet (set [persona.session.prices])");
        Prices::default()
    })
}

#[cfg(test)]
mod tests {
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
