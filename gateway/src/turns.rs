//! The turn loop of a live Persona: pending mail -> one batch -> one turn of her claude
//! process -> her says through the mouth -> ack.
//!
//! - Triggers: new mail after a quiet period (`debounce_ms`), or `max_wait_ms` after the
//!   first waiting mail; at once when an operator wrote to her, or on a turn request.
//! - Exactly once: the batch in flight (its first and last seq) is stored before the turn;
//!   after a crash the same batch is retried, so its says keep their request ids
//!   (`session::render::say_request_id`) and the mouth sends each once. The batch is acked
//!   only after every say has a receipt.
//! - The session id is stored after its first turn; a restarted gateway resumes it (with the
//!   current system prompt when the file changed). A resume the CLI cannot do starts fresh.
//! - A crashed or hung CLI is respawned (resumed) and the batch retried, up to
//!   [`ATTEMPTS`] times per round; then the round fails and is retried later with backoff.
//! - A reply naming a room that is not hers, or no structured reply, sends nothing; the next
//!   batch carries a correction note. A prompt-too-long or blocking-limit refusal starts a
//!   fresh session (generation + 1) and retries the batch there.
//! - The refresh policy (`session::policy::decide`) runs before each turn and on the timer it
//!   asks for while idle: a compaction runs the CLI's `/compact` (falling back to a fresh
//!   start when it does not compact); a fresh start gives the new session the last lines of her
//!   rooms; keep-warm refreshes the cache with a forked,
//!   unpersisted request; an idle process is evicted (its session stays resumable).
//! - Each turn's telemetry is written to `STATE/personas/ID/status.json` (last 50 turns).

use std::collections::{BTreeMap, VecDeque};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;
use session::cost::Prices;
use session::driver::{Cli, CliConfig, DriverError, Turn};
use session::policy::{self, Decision, Outcome, PolicyConfig, Process, Telemetry};
use session::render::{self, Seen};
use sha2::{Digest, Sha256};
use tokio::sync::{watch, Notify};
use wire::docs::{Delivery, SendRequest, Status};

use crate::config::Persona;
use crate::ear::Signals;
use crate::inbox::{Inbox, InboxError};
use crate::matrix::Backoff;
use crate::mouth::Mouth;

/// CLI attempts per batch in one round.
pub const ATTEMPTS: u32 = 3;
/// Turns kept in the status file.
pub const TELEMETRY_KEPT: usize = 50;

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
    /// A say could not be sent now (homeserver down, retries exhausted).
    #[error("say {request_id} not sent yet: {error}")]
    Send {
        /// Its request id.
        request_id: String,
        /// Why.
        error: String,
    },
}

/// One turn's record (status file).
#[derive(Debug, Clone, Default, Serialize, serde::Deserialize)]
#[serde(default)]
pub struct TurnRecord {
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
    /// The policy's decision before the turn.
    pub decision: String,
    /// Billed cost by the price table (dollars).
    pub cost_usd: f64,
    /// What became of the reply.
    pub outcome: String,
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
    turns: VecDeque<TurnRecord>,
}

/// A Persona's turn loop.
pub struct TurnLoop {
    persona: Persona,
    inbox: Inbox,
    mouth: Mouth,
    signals: Arc<Signals>,
    /// Turn requests (from CultNet clients or tools).
    pub turn_requests: Arc<Notify>,
    base: CliConfig,
    cli: Option<Cli>,
    seen: Seen,
    note: Option<String>,
    prompt_hash: String,
    status_path: PathBuf,
    status: StatusFile,
    telemetry: Telemetry,
    policy: PolicyConfig,
    prices: Prices,
    prompt_tokens: u64,
    fired: Option<Instant>,
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
    /// A turn loop for `persona`; `base` is her CLI configuration without a session.
    pub fn new(
        persona: Persona,
        inbox: Inbox,
        mouth: Mouth,
        signals: Arc<Signals>,
        base: CliConfig,
        state_dir: &std::path::Path,
    ) -> Result<Self, InboxError> {
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
            turns: earlier.turns,
        };
        let prompt_tokens = std::fs::metadata(&base.system_prompt_file).map_or(0, |m| m.len() / 4);
        Ok(Self {
            telemetry: Telemetry::default(),
            policy: PolicyConfig {
                context_window: persona.session.context_window,
                ..PolicyConfig::for_ttl(base.cache_ttl)
            },
            prices: Prices::default(),
            prompt_tokens,
            fired: None,
            prompt_hash: hash_file(&base.system_prompt_file),
            status_path,
            persona,
            inbox,
            mouth,
            signals,
            turn_requests: Arc::new(Notify::new()),
            base,
            cli: None,
            seen: Seen::default(),
            note: None,
            status,
        })
    }

    /// Runs until `stop` turns true; the CLI is shut down on the way out.
    pub async fn run(mut self, mut stop: watch::Receiver<bool>) {
        let mut backoff = Backoff::new(Duration::from_secs(1), Duration::from_secs(60));
        loop {
            let drained = tokio::select! {
                r = self.drain() => r,
                _ = stop.changed() => break,
            };
            match drained {
                Ok(()) => backoff.reset(),
                Err(e) => {
                    let wait = backoff.next(None);
                    tracing::warn!(persona = %self.persona.id, error = %e, ?wait, "turn round failed; retrying");
                    tokio::select! {
                        _ = tokio::time::sleep(wait) => continue,
                        _ = stop.changed() => break,
                    }
                }
            }
            let forced = loop {
                self.telemetry.batch_waiting = false;
                self.telemetry.process = if self.cli.is_some() {
                    Process::Running
                } else {
                    Process::Stopped
                };
                // A check that already fired and changed nothing is not repeated.
                let at = policy::next_check(&self.telemetry, &self.policy)
                    .filter(|at| Some(*at) != self.fired);
                let timer = at.map(tokio::time::Instant::from_std);
                let sleep = async {
                    match timer {
                        Some(at) => tokio::time::sleep_until(at).await,
                        None => std::future::pending().await,
                    }
                };
                tokio::select! {
                    _ = self.signals.mail.notified() => break false,
                    _ = self.turn_requests.notified() => break true,
                    _ = stop.changed() => return self.shutdown().await,
                    _ = sleep => {
                        self.fired = at;
                        self.idle_check().await;
                    }
                }
            };
            if !forced && !self.debounce(&mut stop).await {
                break;
            }
        }
        self.shutdown().await;
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
        match decision {
            Decision::KeepWarm => {
                let Some(sid) = self.status.session_id.clone() else {
                    return;
                };
                match session::driver::refresh_fork(&self.base, &sid).await {
                    Ok(r) => {
                        let cost = r.usage.usage().cost(&self.prices);
                        self.telemetry.after_keep_warm(cost, Instant::now());
                    }
                    Err(e) => {
                        tracing::warn!(persona = %self.persona.id, error = %e, "keep-warm failed");
                        // Do not try again before the next turn.
                        self.telemetry.last_cache_touch = None;
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

    /// Runs turns until nothing is pending.
    pub async fn drain(&mut self) -> Result<(), TurnError> {
        loop {
            let id = self.persona.id.clone();
            let page = self.inbox.pending(&id, 0, 1000, None)?;
            if page.deliveries.is_empty() {
                return Ok(());
            }
            let inflight = self.inbox.session_value(&id, "inflight")?.and_then(|v| {
                let (a, b) = v.split_once('-')?;
                Some((a.parse::<u64>().ok()?, b.parse::<u64>().ok()?))
            });
            let batch: Vec<Delivery> = match inflight {
                Some((first, last)) if page.deliveries[0].seq == first => page
                    .deliveries
                    .iter()
                    .take_while(|d| d.seq <= last)
                    .cloned()
                    .collect(),
                _ => render::next_batch(&page.deliveries, self.persona.session.max_batch).to_vec(),
            };
            self.turn(&batch).await?;
        }
    }

    fn rooms_allowed(&self, batch: &[Delivery]) -> Vec<String> {
        let mut rooms: Vec<String> = self.persona.rooms.clone();
        for d in batch {
            rooms.push(d.room_id.clone());
            rooms.extend(d.room_alias.clone());
        }
        rooms
    }

    async fn ensure_cli(&mut self) -> Result<&mut Cli, DriverError> {
        if self.cli.is_none() {
            let id = &self.persona.id;
            let mut cfg = self.base.clone();
            match self.inbox.session_value(id, "session_id").ok().flatten() {
                Some(sid) => {
                    let stored = self.inbox.session_value(id, "prompt_hash").ok().flatten();
                    cfg.system_prompt_changed = stored.as_deref() != Some(&self.prompt_hash);
                    cfg.session_id = Some(sid);
                    cfg.resume = true;
                }
                None => {
                    cfg.session_id = Some(uuid::Uuid::new_v4().to_string());
                    cfg.resume = false;
                    self.seen.clear();
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
        Ok(())
    }

    /// Compacts her conversation with the CLI's `/compact`; when the CLI does not compact
    /// (an error, no boundary), starts fresh instead. Context lines are sent again afterwards:
    /// the summary need not keep them.
    async fn compact(&mut self, why: &str) -> Result<(), TurnError> {
        let done = match self.ensure_cli().await {
            Ok(cli) => cli.compact().await,
            Err(e) => Err(e),
        };
        match done {
            Ok(Turn {
                compacted: Some(m),
                result,
                ..
            }) if !result.is_error => {
                tracing::info!(persona = %self.persona.id, why, pre = m.pre_tokens, post = m.post_tokens, "session compacted");
                self.seen.clear();
                self.telemetry.after_compact(m.post_tokens, Instant::now());
                self.status.compactions += 1;
            }
            Ok(t) => {
                tracing::warn!(persona = %self.persona.id, why, errors = ?t.result.errors, "compaction did not happen; starting fresh instead");
                self.fresh_start(why)?;
            }
            Err(e) => {
                tracing::warn!(persona = %self.persona.id, why, error = %e, "compaction failed; starting fresh instead");
                self.cli = None;
                self.fresh_start(why)?;
            }
        }
        Ok(())
    }

    async fn run_cli(&mut self, text: &str) -> Result<Turn, TurnError> {
        let mut last = None;
        for attempt in 1..=ATTEMPTS {
            let resumed = self
                .inbox
                .session_value(&self.persona.id, "session_id")?
                .is_some();
            let result = match self.ensure_cli().await {
                Ok(cli) => cli.turn(text).await,
                Err(e) => Err(e),
            };
            match result {
                Ok(t) if resumed && t.result.is_error && !t.result.errors.is_empty() => {
                    // e.g. the recorded session no longer exists: start over.
                    tracing::warn!(persona = %self.persona.id, errors = ?t.result.errors, "resume failed");
                    self.fresh_start("resume failed")?;
                }
                Ok(t) => return Ok(t),
                Err(e) => {
                    tracing::warn!(persona = %self.persona.id, attempt, error = %e, "claude CLI failed; respawning");
                    self.cli = None;
                    last = Some(e);
                }
            }
        }
        Err(TurnError::Cli(last.unwrap_or_else(|| {
            DriverError::Exited("resume kept failing".into())
        })))
    }

    #[tracing::instrument(skip_all, fields(persona = %self.persona.id, first = batch[0].seq, last = batch[batch.len() - 1].seq))]
    async fn turn(&mut self, batch: &[Delivery]) -> Result<(), TurnError> {
        let id = self.persona.id.clone();
        let (first, last) = (batch[0].seq, batch[batch.len() - 1].seq);
        self.inbox
            .set_session_value(&id, "inflight", Some(&format!("{first}-{last}")))?;
        let rooms: Vec<String> = batch
            .iter()
            .map(|d| d.room_id.clone())
            .collect::<std::collections::BTreeSet<_>>()
            .into_iter()
            .collect();
        for r in &rooms {
            self.mouth.typing(r, true).await;
        }
        let started = Instant::now();
        let rehydration = self.rehydration();
        self.telemetry.batch_waiting = true;
        self.telemetry.process = if self.cli.is_some() {
            Process::Running
        } else {
            Process::Stopped
        };
        self.telemetry.base_tokens = self.prompt_tokens;
        self.telemetry.rehydration_tokens = self.prompt_tokens + rehydration.len() as u64 / 4;
        let decision = if self.status.session_id.is_none() {
            Decision::Continue
        } else {
            policy::decide(&self.telemetry, started, &self.policy)
        };
        tracing::info!(?decision, telemetry = ?self.telemetry, "turn decision");
        match decision {
            Decision::FreshStart(r) => self.fresh_start(&format!("{r:?}"))?,
            Decision::Compact(r) => self.compact(&format!("{r:?}")).await?,
            _ => {}
        }
        let mut text = render::render(batch, &mut self.seen, self.note.as_deref());
        // A session after an earlier one (not her very first) is given the recent lines.
        let had_session = self.status.turns_total > 0 || self.status.generation > 0;
        if self.status.session_id.is_none() && had_session {
            text.push_str(&rehydration);
        }
        let mut turn = self.run_cli(&text).await;
        if let Ok(t) = &turn {
            if matches!(
                t.result.outcome(),
                Outcome::PromptTooLong | Outcome::BlockingLimit
            ) {
                self.fresh_start("the session refused the turn (context full)")?;
                let mut text = render::render(batch, &mut self.seen, self.note.as_deref());
                text.push_str(&rehydration);
                turn = self.run_cli(&text).await;
            }
        }
        for r in &rooms {
            self.mouth.typing(r, false).await;
        }
        let turn = turn?;
        let res = &turn.result;
        if res.outcome() == Outcome::ApiError {
            return Err(TurnError::Api(res.api_error_status));
        }
        if let Some(sid) = &res.session_id {
            if self.status.session_id.as_deref() != Some(sid) {
                self.inbox.set_session_value(&id, "session_id", Some(sid))?;
                self.inbox
                    .set_session_value(&id, "prompt_hash", Some(&self.prompt_hash))?;
                self.status.session_id = Some(sid.clone());
            }
        }
        let allowed = self.rooms_allowed(batch);
        let allowed_refs: Vec<&str> = allowed.iter().map(String::as_str).collect();
        let (says, outcome) = match render::validate(res.structured_output.as_ref(), &allowed_refs)
        {
            Ok(reply) => {
                self.note = None;
                for (i, say) in reply.say.iter().enumerate() {
                    let request_id = render::say_request_id(&id, first, last, i);
                    let receipt = self
                        .mouth
                        .send(&SendRequest {
                            request_id: request_id.clone(),
                            persona: id.clone(),
                            room: say.room.clone(),
                            text: say.text.clone(),
                            thread_root: say.thread_root.clone(),
                            reply_to: say.reply_to.clone(),
                        })
                        .await;
                    match receipt.status {
                        Status::Ok => {}
                        Status::Failed | Status::Unknown => {
                            return Err(TurnError::Send {
                                request_id,
                                error: receipt.error.unwrap_or_default(),
                            })
                        }
                        Status::Rejected => {
                            tracing::warn!(request = %request_id, error = ?receipt.error, "say refused; not retried");
                        }
                    }
                }
                (reply.say.len(), "sent".to_owned())
            }
            Err(e) => {
                tracing::warn!(error = %e, "reply not sent");
                self.note = Some(e.correction_note());
                (0, e.to_string())
            }
        };
        self.inbox.ack(&id, last)?;
        self.inbox.set_session_value(&id, "inflight", None)?;
        self.signals.acked.notify_one();
        let mut last_per_room: BTreeMap<&str, &str> = BTreeMap::new();
        for d in batch {
            last_per_room.insert(&d.room_id, &d.event_id);
        }
        for (room, event) in last_per_room {
            self.mouth.read_receipt(room, event).await;
        }
        let usage = res.usage.usage();
        self.telemetry
            .after_turn(&usage, res.outcome(), Instant::now(), &self.prices);
        let record = TurnRecord {
            first_seq: first,
            last_seq: last,
            generation: self.status.generation,
            duration_ms: started.elapsed().as_millis() as u64,
            input_tokens: usage.input,
            cache_read_tokens: usage.cache_read,
            cache_write_tokens: usage.cache_write_5m + usage.cache_write_1h,
            output_tokens: usage.output,
            hit_ratio: usage.hit_ratio(),
            cli_cost_usd: res.total_cost_usd,
            says,
            decision: format!("{decision:?}"),
            cost_usd: usage.cost(&self.prices),
            outcome,
        };
        tracing::info!(?record, "turn done");
        self.write_status(record);
        Ok(())
    }

    /// The last lines of her rooms, for a fresh session.
    fn rehydration(&self) -> String {
        let id = &self.persona.id;
        let rooms: Vec<(String, Vec<wire::docs::ContextLine>)> = self
            .inbox
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
            .collect();
        let refs: Vec<(&str, Vec<wire::docs::ContextLine>)> =
            rooms.iter().map(|(r, l)| (r.as_str(), l.clone())).collect();
        render::rehydration(
            None,
            &refs,
            self.persona.limits.context_lines,
            self.persona.limits.context_bytes / 2,
        )
    }

    fn write_status(&mut self, record: TurnRecord) {
        self.status.turns_total += 1;
        self.status.turns.push_back(record);
        while self.status.turns.len() > TELEMETRY_KEPT {
            self.status.turns.pop_front();
        }
        let tmp = self.status_path.with_extension("json.tmp");
        let bytes = serde_json::to_vec_pretty(&self.status).unwrap_or_default();
        if let Err(e) =
            std::fs::write(&tmp, bytes).and_then(|()| std::fs::rename(&tmp, &self.status_path))
        {
            tracing::warn!(error = %e, path = %self.status_path.display(), "status file not written");
        }
    }
}
