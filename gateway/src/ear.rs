//! The ear: one sync loop per Persona whose position the gateway owns.
//!
//! Each round: `sync_once` from the inbox's stored token, turn the response into deliveries
//! and timeline lines, and store them with the response's `next_batch` in one flushed batch
//! ([`Inbox::ingest_sync`]). Only then is the new token used. So a crash anywhere replays the
//! response, and the event-id index drops what was already stored.
//!
//! - The first sync (no stored token) seeds the room timelines and makes no mail; in a room
//!   she joins later, the events before her join are history (context, not mail).
//! - A `limited` timeline is gap-filled backwards from its `prev_batch` down to the previous
//!   token, at most `gap_fill_max` events; if the fill fails the round fails and is retried
//!   from the old token, so nothing is skipped.
//! - While her inbox is full (`max_pending` pending: CultNet clients have not acknowledged
//!   her mail) her position stays where it is (the homeserver keeps the messages), but a
//!   *partial* round still syncs her DMs and invites alone, from a position of its own that
//!   is never stored: her operators' invites are joined and their DM lines stored (the full
//!   sync meets them again later, deduplicated by event id). No state of her inbox keeps an
//!   operator waiting.
//! - DM invites from her operators are joined; others are ignored and logged.
//! - Errors back off exponentially (0.5 s to 30 s); a 429's requested wait is honoured.
//! - An event that cannot be decrypted is held (in the inbox) and retried every round; once it
//!   decrypts it is delivered in clear, and when `undecryptable_wait_secs` runs out it is
//!   delivered with a placeholder text. One written before her device existed was encrypted
//!   for no device of hers: after one lookup in her key backup it is delivered as the
//!   placeholder at once. Counted and logged either way, never dropped.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use matrix_sdk::config::{SyncSettings, SyncToken};
use matrix_sdk::deserialized_responses::TimelineEventKind;
use matrix_sdk::room::MessagesOptions;
use matrix_sdk::ruma::api::client::filter::FilterDefinition;
use matrix_sdk::ruma::api::client::sync::sync_events::v3::{Filter, InvitedRoom};
use matrix_sdk::ruma::{OwnedRoomId, UInt};
use matrix_sdk::{Client, Room};
use serde_json::Value;
use tokio::sync::{watch, Notify};

use crate::clock::unix_ms;
use crate::config::Persona;
use crate::event::{self, Me, RoomInfo};
use crate::inbox::{Held, Inbox, InboxError, SyncWrite, TimelineLine, TIMELINE_CAP};
use crate::matrix::{classify, Backoff, Failure};

/// How long one `/sync` long-polls.
pub const SYNC_TIMEOUT: Duration = Duration::from_secs(30);

/// Counters of one ear (read by status and tests).
#[derive(Debug, Default)]
pub struct EarStats {
    /// Sync responses stored.
    pub syncs: AtomicU64,
    /// Deliveries stored (new seqs).
    pub delivered: AtomicU64,
    /// Events that could not be decrypted when they arrived (held and retried).
    pub undecryptable: AtomicU64,
    /// Held events that decrypted on a retry.
    pub decrypted_late: AtomicU64,
    /// Held events delivered with a placeholder after their wait.
    pub undecryptable_delivered: AtomicU64,
    /// Gap fills run and events they fetched.
    pub gap_fills: AtomicU64,
    /// Events fetched by gap fills.
    pub gap_events: AtomicU64,
    /// Failed sync rounds.
    pub errors: AtomicU64,
    /// 429 answers.
    pub rate_limited: AtomicU64,
    /// Rounds held back because the inbox was full (each a partial round of her DMs and
    /// invites alone).
    pub held_back: AtomicU64,
    /// When her inbox was last found full (ms since the epoch; 0 while it is not).
    pub full_since_ms: AtomicU64,
    /// When the last sync round succeeded (ms since the epoch; 0 before the first).
    pub last_sync_ms: AtomicU64,
}

/// Signals between the ear and her other tasks.
#[derive(Debug, Default)]
pub struct Signals {
    /// New mail was stored.
    pub mail: Notify,
    /// Acks freed room in the inbox.
    pub acked: Notify,
    /// Why her live session cannot take turns now (e.g. the model API refuses her
    /// credential), for her status; `None` when it can.
    pub session_error: std::sync::Mutex<Option<String>>,
}

/// Why a sync round failed.
#[derive(Debug, thiserror::Error)]
pub enum EarError {
    /// The homeserver or the SDK failed.
    #[error("sync: {0}")]
    Matrix(#[from] matrix_sdk::Error),
    /// The inbox failed.
    #[error(transparent)]
    Inbox(#[from] InboxError),
    /// A blocking task panicked or was cancelled.
    #[error("inbox task: {0}")]
    Join(#[from] tokio::task::JoinError),
}

/// A held event's room key is looked up in her key backup at most this often.
const BACKUP_LOOKUP_EVERY: Duration = Duration::from_secs(60);

type Timeline = VecDeque<(Option<String>, wire::docs::ContextLine)>;

/// One Persona's ear.
pub struct Ear {
    persona: Persona,
    client: Client,
    inbox: Inbox,
    me: Me,
    timelines: HashMap<String, Timeline>,
    /// Rooms whose history was read with `/messages` for context in this process.
    backfilled: std::collections::HashSet<String>,
    /// Megolm sessions looked up in her key backup in the last [`BACKUP_LOOKUP_EVERY`].
    looked_up: HashMap<String, std::time::Instant>,
    signals: Arc<Signals>,
    stats: Arc<EarStats>,
    /// The position of the partial rounds while her inbox is full (from her stored position
    /// when it filled; forgotten once it has room again).
    partial_token: Option<String>,
}

/// The account data event type whose writes move her homeserver's sync position on
/// ([`Ear::unstick`]).
pub const SYNC_MARK: &str = "org.cultnet.gateway.sync_mark";

/// How long a partial round long-polls: it gives way soon to a full round once acks free room.
const PARTIAL_SYNC_TIMEOUT: Duration = Duration::from_secs(5);

impl std::fmt::Debug for Ear {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ear")
            .field("persona", &self.persona.id)
            .finish()
    }
}

impl Ear {
    /// An ear for `persona` over a connected client.
    pub async fn new(
        persona: Persona,
        client: Client,
        inbox: Inbox,
        signals: Arc<Signals>,
        stats: Arc<EarStats>,
    ) -> Self {
        let display_name = client.account().get_display_name().await.ok().flatten();
        let me = Me {
            user_id: persona.user_id.clone(),
            display_name,
        };
        Self {
            persona,
            client,
            inbox,
            me,
            timelines: HashMap::new(),
            backfilled: Default::default(),
            looked_up: HashMap::new(),
            signals,
            stats,
            partial_token: None,
        }
    }

    /// Runs sync rounds until `stop` turns true.
    pub async fn run(mut self, mut stop: watch::Receiver<bool>) {
        let mut backoff = Backoff::new(Duration::from_millis(500), Duration::from_secs(30));
        loop {
            if *stop.borrow() {
                return;
            }
            let round = async {
                if self.is_full()? {
                    self.stats.held_back.fetch_add(1, Ordering::Relaxed);
                    if self.stats.full_since_ms.load(Ordering::Relaxed) == 0 {
                        tracing::warn!(persona = %self.persona.id, max_pending = self.persona.limits.max_pending, "her inbox is full: CultNet clients have not acknowledged her mail; her rooms wait on the homeserver, her DMs and invites are still synced");
                        self.stats.full_since_ms.store(
                            u64::try_from(unix_ms()).unwrap_or(1).max(1),
                            Ordering::Relaxed,
                        );
                    }
                    return self.partial_round(PARTIAL_SYNC_TIMEOUT).await.map(|_| ());
                }
                if self.stats.full_since_ms.swap(0, Ordering::Relaxed) != 0 {
                    tracing::info!(persona = %self.persona.id, "her inbox has room again: full sync resumes");
                }
                self.partial_token = None;
                self.round(SYNC_TIMEOUT).await.map(|_| ())
            };
            let result = tokio::select! {
                r = round => r,
                _ = stop.changed() => return,
            };
            match result {
                Ok(()) => backoff.reset(),
                Err(e) => {
                    self.stats.errors.fetch_add(1, Ordering::Relaxed);
                    let retry_after = match &e {
                        EarError::Matrix(m) => match classify(m) {
                            Failure::Transient { retry_after } => {
                                if retry_after.is_some() {
                                    self.stats.rate_limited.fetch_add(1, Ordering::Relaxed);
                                }
                                retry_after
                            }
                            _ => None,
                        },
                        _ => None,
                    };
                    let wait = backoff.next(retry_after);
                    tracing::warn!(persona = %self.persona.id, error = %e, ?wait, "sync round failed; retrying");
                    tokio::select! {
                        _ = tokio::time::sleep(wait) => {}
                        _ = stop.changed() => return,
                    }
                }
            }
        }
    }

    fn is_full(&self) -> Result<bool, InboxError> {
        Ok(self.inbox.counts(&self.persona.id)?.pending >= self.persona.limits.max_pending)
    }

    /// One sync round: sync from the stored token, store what it brought. Returns the number
    /// of new deliveries.
    pub async fn round(&mut self, timeout: Duration) -> Result<usize, EarError> {
        self.sync_round(timeout, false).await
    }

    /// A round while her inbox is full: her DM rooms and invites alone, from the partial
    /// position (her stored one at first); her stored position does not move.
    pub async fn partial_round(&mut self, timeout: Duration) -> Result<usize, EarError> {
        self.sync_round(timeout, true).await
    }

    /// When her device was made (ms since the epoch), as her crypto store knows it.
    async fn device_created_ms(&self) -> i64 {
        let at = self.client.encryption().device_creation_timestamp().await;
        i64::from(at.get())
    }

    /// Whether `room` is a DM of hers with one of her operators: marked direct (her `m.direct`,
    /// which records who invited her to it as a DM) with an operator. A room a member marks as
    /// a DM with her is a public room to her rules: not every line there starts a turn.
    async fn operator_dm(&self, room: &Room) -> bool {
        room.is_direct().await.unwrap_or(false)
            && room.direct_targets().iter().any(|t| {
                t.as_user_id()
                    .is_some_and(|u| self.persona.operators.iter().any(|o| o == u.as_str()))
            })
    }

    /// Her joined rooms that are not DMs with her operators (a partial round leaves them on the
    /// homeserver).
    async fn public_rooms(&self) -> Vec<OwnedRoomId> {
        let mut out = Vec::new();
        for room in self.client.joined_rooms() {
            if !self.operator_dm(&room).await {
                out.push(room.room_id().to_owned());
            }
        }
        out
    }

    /// The SDK drops a sync response whose `next_batch` equals the token it stored last
    /// (matrix-sdk-base `receive_sync_response`: "Got the same sync response twice"). Its token
    /// runs ahead of hers after partial rounds, and after a crash between its processing and
    /// her inbox's write; a sync from hers would then come back with the SDK's own position
    /// when nothing happened since, and its events would be lost. So when the two differ, a
    /// mark in her account data moves the homeserver's position on first.
    async fn unstick(&self, since: Option<&str>) -> Result<(), EarError> {
        use matrix_sdk::store::StateStoreDataKey;
        let Some(since) = since else {
            return Ok(());
        };
        let sdk = self
            .client
            .state_store()
            .get_kv_data(StateStoreDataKey::SyncToken)
            .await
            .ok()
            .flatten()
            .and_then(|v| v.into_sync_token());
        if sdk.as_deref().is_none_or(|t| t == since) {
            return Ok(());
        }
        let mark = serde_json::json!({ "at_ms": unix_ms() });
        let raw = serde_json::value::to_raw_value(&mark)
            .map_err(|e| EarError::Matrix(matrix_sdk::Error::SerdeJson(e)))?;
        self.client
            .account()
            .set_account_data_raw(
                SYNC_MARK.into(),
                matrix_sdk::ruma::serde::Raw::from_json(raw),
            )
            .await?;
        tracing::debug!(persona = %self.persona.id, "sync position marked: her store's token ran ahead of hers");
        Ok(())
    }

    async fn sync_round(&mut self, timeout: Duration, partial: bool) -> Result<usize, EarError> {
        let stored = self.inbox.sync_token(&self.persona.id)?;
        if !partial {
            self.unstick(stored.as_deref()).await?;
        }
        let since = if partial {
            self.partial_token.clone().or(stored)
        } else {
            stored
        };
        let mut filter = FilterDefinition::default();
        filter.room.timeline.limit = UInt::new(self.persona.limits.fetch_limit as u64);
        if partial {
            filter.room.not_rooms = self.public_rooms().await;
        }
        let settings = SyncSettings::default()
            .timeout(timeout)
            .filter(Filter::FilterDefinition(filter))
            .token(match &since {
                Some(t) => SyncToken::Specific(t.clone()),
                None => SyncToken::NoToken,
            });
        let resp = self.client.sync_once(settings).await?;
        for (room_id, invite) in &resp.rooms.invited {
            self.consider_invite(room_id, invite).await;
        }
        let (mut deliveries, release) = self.retry_held().await?;
        let mut hold = Vec::new();
        let now_ms = unix_ms();
        let mut lines = Vec::new();
        let mut redacted = Vec::new();
        tracing::debug!(persona = %self.persona.id, partial, since = ?since, next = %resp.next_batch, rooms = resp.rooms.joined.len(), events = resp.rooms.joined.values().map(|u| u.timeline.events.len()).sum::<usize>(), "synced");
        for (room_id, update) in &resp.rooms.joined {
            let Some(room) = self.client.get_room(room_id) else {
                continue;
            };
            let info = RoomInfo {
                room_id: room_id.to_string(),
                alias: room.canonical_alias().map(|a| a.to_string()),
                is_direct: self.operator_dm(&room).await,
            };
            let mut fresh: Vec<(bool, Value)> = Vec::new();
            for ev in &update.timeline.events {
                let utd = matches!(ev.kind, TimelineEventKind::UnableToDecrypt { .. });
                if let Ok(v) = serde_json::from_str::<Value>(ev.raw().json().get()) {
                    fresh.push((utd, v));
                }
            }
            // In a room she joined in this response, what precedes her join is history:
            // context, not mail, and no gap fill reaches back before it; in her operator's DM,
            // his lines since the invite are mail.
            let history = event::history_before(
                fresh.iter().map(|(_, ev)| ev),
                &self.me,
                &self.persona.operators,
            );
            let joined_at = history.joined_at;
            let mut events: Vec<(bool, Value)> = Vec::new();
            if let (true, None, Some(since), Some(prev)) = (
                update.timeline.limited,
                joined_at,
                &since,
                &update.timeline.prev_batch,
            ) {
                events = self.gap_fill(&room, prev, since).await?;
            }
            let mail_from = history.mail_after.map_or(0, |i| events.len() + i + 1);
            events.extend(fresh);
            self.timeline_loaded(&info.room_id)?;
            // Deleted (redacted) messages never reach her: one stored before is blanked where
            // it is kept. (One said and deleted since the last round comes pruned, without a
            // body: Synapse serves a redacted event so, and such an event is neither mail nor
            // context.)
            let mut gone: std::collections::HashSet<String> = Default::default();
            let levels = room.power_levels().await.ok();
            for (_, ev) in &events {
                let Some(target) = event::redacts(ev) else {
                    continue;
                };
                let redacter = ev.get("sender").and_then(Value::as_str).unwrap_or_default();
                let author = events
                    .iter()
                    .find(|(_, e)| e.get("event_id").and_then(Value::as_str) == Some(target))
                    .and_then(|(_, e)| e.get("sender").and_then(Value::as_str))
                    .or_else(|| {
                        self.timelines.get(&info.room_id).and_then(|tl| {
                            tl.iter()
                                .find(|(_, l)| l.event_id == target)
                                .map(|(_, l)| l.sender.as_str())
                        })
                    });
                let may = match (&levels, matrix_sdk::ruma::UserId::parse(redacter)) {
                    (Some(l), Ok(u)) => l.user_can_redact_event_of_other(&u),
                    _ => false,
                };
                if event::redaction_counts(redacter, author, may) {
                    gone.insert(target.to_owned());
                } else {
                    tracing::warn!(persona = %self.persona.id, room = %info.room_id, redacter, target, "a redaction by someone without power over the line is ignored");
                }
            }
            if !gone.is_empty() {
                let tl = self.timelines.entry(info.room_id.clone()).or_default();
                for (_, l) in tl.iter_mut().filter(|(_, l)| gone.contains(&l.event_id)) {
                    l.text = event::DELETED.to_owned();
                }
                redacted.extend(gone.iter().map(|id| (info.room_id.clone(), id.clone())));
            }
            if since.is_some() && mail_from < events.len() {
                let before = update.timeline.prev_batch.as_deref();
                lines.extend(self.backfill(&room, &info.room_id, &events, before).await);
            }
            for (i, (utd, ev)) in events.into_iter().enumerate() {
                let sender_name = self.sender_name(&room, &ev).await;
                let id = ev
                    .get("event_id")
                    .and_then(Value::as_str)
                    .unwrap_or_default();
                let tl = self.timelines.entry(info.room_id.clone()).or_default();
                let seen = tl.iter().any(|(_, l)| l.event_id == id);
                // The line a reaction annotates, when the timeline holds it.
                let reacted = event::reaction(&ev).and_then(|(target, _)| {
                    tl.iter()
                        .find(|(_, l)| l.event_id == target)
                        .map(|(_, l)| l.clone())
                });
                if !seen {
                    let line = event::context_line(&ev, sender_name.clone()).or_else(|| {
                        event::reaction_line(&ev, sender_name.clone(), reacted.as_ref())
                    });
                    if let Some(line) = line {
                        let thread = event::thread_of(&ev).map(str::to_owned);
                        tl.push_back((thread.clone(), line.clone()));
                        if tl.len() > TIMELINE_CAP {
                            tl.pop_front();
                        }
                        lines.push(TimelineLine {
                            room_id: info.room_id.clone(),
                            thread,
                            line,
                        });
                    }
                }
                if since.is_none() || i < mail_from {
                    continue;
                }
                let mail =
                    event::delivery(&ev, &info, &self.me, sender_name.clone()).or_else(|| {
                        event::reaction_delivery(
                            &ev,
                            &info,
                            &self.me,
                            sender_name,
                            reacted.as_ref(),
                            &self.persona.operators,
                        )
                    });
                if let Some(mut d) = mail {
                    d.context = event::context_for(
                        tl.iter(),
                        &d.event_id,
                        d.thread_root.as_deref(),
                        self.persona.limits.context_lines,
                        self.persona.limits.context_bytes,
                    );
                    if utd && event::predates(d.ts, self.device_created_ms().await) {
                        // Written before her device existed: its key was shared with no device
                        // of hers, so only her key backup could hold it. One lookup, then the
                        // placeholder at once: waiting would change nothing.
                        self.stats.undecryptable.fetch_add(1, Ordering::Relaxed);
                        let clear =
                            match matrix_sdk::ruma::OwnedEventId::try_from(d.event_id.as_str()) {
                                Ok(eid) => self.decrypted(&room, &eid).await,
                                Err(_) => None,
                            };
                        match clear
                            .and_then(|v| {
                                event::delivery(&v, &info, &self.me, d.sender_name.clone())
                            })
                            .filter(|c| c.text != event::UNDECRYPTABLE)
                        {
                            Some(mut c) => {
                                c.context = std::mem::take(&mut d.context);
                                self.stats.decrypted_late.fetch_add(1, Ordering::Relaxed);
                                tracing::info!(persona = %self.persona.id, event = %c.event_id, "written before her device existed: decrypted at once with the key from her backup");
                                deliveries.push(c);
                            }
                            None => {
                                self.stats
                                    .undecryptable_delivered
                                    .fetch_add(1, Ordering::Relaxed);
                                tracing::warn!(persona = %self.persona.id, event = %d.event_id, room = %info.room_id, "undecryptable: written before her device existed, so its key was never shared with her and her key backup does not hold it; delivered as a placeholder now (ask the sender to write it again)");
                                deliveries.push(d);
                            }
                        }
                    } else if utd {
                        self.stats.undecryptable.fetch_add(1, Ordering::Relaxed);
                        tracing::warn!(persona = %self.persona.id, event = %d.event_id, room = %info.room_id, "undecryptable event held; retried each round");
                        hold.push(Held {
                            since_ms: now_ms,
                            delivery: d,
                        });
                    } else {
                        deliveries.push(d);
                    }
                }
            }
        }
        self.thread_roots(
            deliveries
                .iter_mut()
                .chain(hold.iter_mut().map(|h| &mut h.delivery)),
        )
        .await;
        self.reply_targets(
            deliveries
                .iter_mut()
                .chain(hold.iter_mut().map(|h| &mut h.delivery)),
        )
        .await;
        for d in deliveries
            .iter_mut()
            .chain(hold.iter_mut().map(|h| &mut h.delivery))
        {
            d.to_you = d.to_you || self.answers_her(d);
        }
        let inbox = self.inbox.clone();
        let id = self.persona.id.clone();
        let next = resp.next_batch.clone();
        let assigned = tokio::task::spawn_blocking(move || {
            let write = SyncWrite {
                deliveries: &deliveries,
                lines: &lines,
                hold: &hold,
                release: &release,
                redacted: &redacted,
                partial,
            };
            inbox.ingest_sync(&id, &next, write)
        })
        .await??;
        if partial {
            self.partial_token = Some(resp.next_batch.clone());
        }
        self.stats.syncs.fetch_add(1, Ordering::Relaxed);
        self.stats
            .last_sync_ms
            .store(u64::try_from(unix_ms()).unwrap_or(0), Ordering::Relaxed);
        if !assigned.is_empty() {
            self.stats
                .delivered
                .fetch_add(assigned.len() as u64, Ordering::Relaxed);
            tracing::debug!(persona = %self.persona.id, new = assigned.len(), "mail stored");
            self.signals.mail.notify_one();
        }
        Ok(assigned.len())
    }

    /// Retries the held (undecryptable) events: those that decrypt now, and those whose wait
    /// ran out (as placeholders), come back as deliveries with their ids to release.
    async fn retry_held(&mut self) -> Result<(Vec<wire::docs::Delivery>, Vec<String>), EarError> {
        let held = self.inbox.held(&self.persona.id)?;
        let mut out = Vec::new();
        let mut release = Vec::new();
        let now_ms = unix_ms();
        let wait_ms = self
            .persona
            .limits
            .undecryptable_wait_secs
            .saturating_mul(1000) as i64;
        for h in held {
            let d = &h.delivery;
            let room = matrix_sdk::ruma::OwnedRoomId::try_from(d.room_id.as_str())
                .ok()
                .and_then(|id| self.client.get_room(&id));
            let event_id = matrix_sdk::ruma::OwnedEventId::try_from(d.event_id.as_str()).ok();
            let clear = match (room, event_id) {
                (Some(room), Some(event_id)) => self.decrypted(&room, &event_id).await,
                _ => None,
            };
            let info = RoomInfo {
                room_id: d.room_id.clone(),
                alias: d.room_alias.clone(),
                is_direct: d.is_direct,
            };
            if let Some(mut clear) = clear
                .and_then(|v| event::delivery(&v, &info, &self.me, d.sender_name.clone()))
                .filter(|c| c.text != event::UNDECRYPTABLE)
            {
                clear.context = d.context.clone();
                self.stats.decrypted_late.fetch_add(1, Ordering::Relaxed);
                tracing::info!(persona = %self.persona.id, event = %d.event_id, "held event decrypted");
                release.push(d.event_id.clone());
                out.push(clear);
            } else if now_ms - h.since_ms >= wait_ms {
                self.stats
                    .undecryptable_delivered
                    .fetch_add(1, Ordering::Relaxed);
                tracing::warn!(persona = %self.persona.id, event = %d.event_id, "still undecryptable; delivered as a placeholder");
                release.push(d.event_id.clone());
                out.push(h.delivery);
            }
        }
        Ok((out, release))
    }

    /// A held event in clear, if it decrypts now. When it does not, its room key is looked up
    /// in her key backup (a key the SDK also asks her other devices and the sender for) and
    /// the event tried once more.
    async fn decrypted(
        &mut self,
        room: &matrix_sdk::Room,
        event_id: &matrix_sdk::ruma::EventId,
    ) -> Option<Value> {
        /// The event's JSON when it decrypted, `Err` with its session id when it did not.
        fn clear(
            ev: &matrix_sdk::deserialized_responses::TimelineEvent,
        ) -> Result<Value, Option<String>> {
            let v: Value = serde_json::from_str(ev.raw().json().get()).map_err(|_| None)?;
            if matches!(ev.kind, TimelineEventKind::UnableToDecrypt { .. }) {
                return Err(v["content"]["session_id"].as_str().map(str::to_owned));
            }
            Ok(v)
        }
        let session = match clear(&room.event(event_id, None).await.ok()?) {
            Ok(v) => return Some(v),
            Err(session) => session?,
        };
        let now = std::time::Instant::now();
        let recent = |at: &std::time::Instant| now.duration_since(*at) < BACKUP_LOOKUP_EVERY;
        self.looked_up.retain(|_, at| recent(at));
        if self.looked_up.contains_key(&session) {
            return None;
        }
        self.looked_up.insert(session.clone(), now);
        match self
            .client
            .encryption()
            .backups()
            .download_room_key(room.room_id(), &session)
            .await
        {
            Ok(true) => {
                tracing::info!(persona = %self.persona.id, event = %event_id, "room key looked up in her key backup");
            }
            Ok(false) => return None,
            Err(e) => {
                tracing::debug!(persona = %self.persona.id, event = %event_id, "room key not in her key backup: {e}");
                return None;
            }
        }
        clear(&room.event(event_id, None).await.ok()?).ok()
    }

    /// Loads a room's stored timeline the first time the room is seen in this process.
    fn timeline_loaded(&mut self, room_id: &str) -> Result<(), InboxError> {
        if !self.timelines.contains_key(room_id) {
            let stored = self.inbox.timeline(&self.persona.id, room_id)?;
            self.timelines.insert(
                room_id.to_owned(),
                stored.into_iter().map(|l| (l.thread, l.line)).collect(),
            );
        }
        Ok(())
    }

    /// Whether `d` answers her: a reply to a line of hers, or a line in a thread she has
    /// spoken in (its root hers, or a reply of hers in it), as her room's recent timeline and
    /// the delivery's context show. Such a line is addressed to her, as a mention is.
    fn answers_her(&self, d: &wire::docs::Delivery) -> bool {
        let me = self.me.user_id.as_str();
        let tl = self.timelines.get(&d.room_id);
        let lines = || {
            tl.into_iter()
                .flatten()
                .map(|(t, l)| (t.as_deref(), l))
                .chain(d.context.iter().map(|l| (d.thread_root.as_deref(), l)))
        };
        let hers = |id: &str| lines().any(|(_, l)| l.event_id == id && l.sender == me);
        let reply = d.reply_to.as_deref().is_some_and(hers);
        let thread = d.thread_root.as_deref().is_some_and(|root| {
            hers(root) || lines().any(|(t, l)| t == Some(root) && l.sender == me)
        });
        reply || thread
    }

    async fn sender_name(&self, room: &Room, ev: &Value) -> Option<String> {
        let sender = ev.get("sender")?.as_str()?;
        let user = matrix_sdk::ruma::UserId::parse(sender).ok()?;
        let member = room.get_member_no_sync(&user).await.ok()??;
        member.display_name().map(str::to_owned)
    }

    /// Events between the previous token and a limited timeline's start, oldest first.
    async fn gap_fill(
        &self,
        room: &Room,
        prev_batch: &str,
        since: &str,
    ) -> Result<Vec<(bool, Value)>, EarError> {
        let limits = &self.persona.limits;
        let mut out = Vec::new();
        let mut from = prev_batch.to_owned();
        loop {
            let mut opts = MessagesOptions::backward().from(from.as_str());
            opts.to = Some(since.to_owned());
            opts.limit = UInt::new(limits.fetch_limit.min(1000) as u64).unwrap_or_default();
            let page = room.messages(opts).await?;
            let n = page.chunk.len();
            for ev in page.chunk {
                let utd = matches!(ev.kind, TimelineEventKind::UnableToDecrypt { .. });
                if let Ok(v) = serde_json::from_str::<Value>(ev.raw().json().get()) {
                    out.push((utd, v));
                }
            }
            match page.end {
                Some(end) if n > 0 && out.len() < limits.gap_fill_max => from = end,
                Some(_) if out.len() >= limits.gap_fill_max => {
                    tracing::warn!(persona = %self.persona.id, room = %room.room_id(), max = limits.gap_fill_max,
                        "gap larger than gap_fill_max; older events of this gap are not mail");
                    break;
                }
                _ => break,
            }
        }
        out.truncate(limits.gap_fill_max);
        out.reverse();
        self.stats.gap_fills.fetch_add(1, Ordering::Relaxed);
        self.stats
            .gap_events
            .fetch_add(out.len() as u64, Ordering::Relaxed);
        tracing::info!(persona = %self.persona.id, room = %room.room_id(), events = out.len(), "gap filled");
        Ok(out)
    }

    async fn consider_invite(&self, room_id: &OwnedRoomId, invite: &InvitedRoom) {
        let stripped: Vec<Value> = invite
            .invite_state
            .events
            .iter()
            .filter_map(|raw| serde_json::from_str(raw.json().get()).ok())
            .collect();
        let inviter = event::inviter(stripped.iter(), &self.me.user_id).map(str::to_owned);
        match inviter {
            Some(who) if self.persona.operators.contains(&who) => {
                match self.client.join_room_by_id(room_id).await {
                    Ok(_) => {
                        tracing::info!(persona = %self.persona.id, room = %room_id, inviter = %who, "joined an operator's invite")
                    }
                    Err(e) => {
                        tracing::warn!(persona = %self.persona.id, room = %room_id, error = %e, "joining an operator's invite failed; retried on the next sync")
                    }
                }
            }
            other => {
                tracing::info!(persona = %self.persona.id, room = %room_id, inviter = ?other, "invite from a non-operator ignored")
            }
        }
    }
}

/// Joins her configured rooms; returns the resolved room ids and, per room that failed, why.
pub async fn join_configured(
    client: &Client,
    persona: &Persona,
) -> (HashMap<String, OwnedRoomId>, Vec<(String, String)>) {
    let mut joined = HashMap::new();
    let mut failed = Vec::new();
    for name in &persona.rooms {
        let resolved = if name.starts_with('#') {
            match matrix_sdk::ruma::RoomAliasId::parse(name) {
                Ok(alias) => client
                    .resolve_room_alias(&alias)
                    .await
                    .map(|r| r.room_id)
                    .map_err(|e| format!("alias {name} does not resolve: {e}")),
                Err(e) => Err(format!("{name} is not a room alias: {e}")),
            }
        } else {
            OwnedRoomId::try_from(name.as_str())
                .map_err(|e| format!("{name} is not a room id: {e}"))
        };
        let joined_room = match resolved {
            Ok(id) => client
                .join_room_by_id(&id)
                .await
                .map(|_| id)
                .map_err(|e| format!("joining {name} failed: {e}")),
            Err(e) => Err(e),
        };
        match joined_room {
            Ok(id) => {
                joined.insert(name.clone(), id);
            }
            Err(why) => {
                tracing::error!(persona = %persona.id, room = %name, "{why}");
                failed.push((name.clone(), why));
            }
        }
    }
    (joined, failed)
}

mod context;
