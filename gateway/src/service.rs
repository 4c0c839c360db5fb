//! The CultNet service: what local clients (Mind organs, a heartbeat, operator tools) ask of the
//! gateway over the loopback endpoint, and its answers.
//!
//! - **Connect**: a client's Connect payload is a signed [`ConnectPayload`]; it is accepted only
//!   when its agent id is configured (`[[cultnet.client]]`), the signature verifies under that
//!   agent's pinned ed25519 key for this service's connection id, `issuedAt` is within
//!   `max_skew_secs` of now, and the nonce was not used before (replay). Every refusal says why
//!   to the client and in the log.
//! - **Requests** are `cultnet.document_put_raw.v0` documents whose schema id names the request
//!   ([`wire::docs`]); the answer is the receipt document under the same record key. A client may
//!   act only for the Personas and verbs its config names. Refused ack, send and turn requests get
//!   their receipt with status `rejected` and the reason; a refused pending or status request, a
//!   message that does not decode and a document of an unknown type get `cultnet.error.v0`
//!   naming the record key.
//! - `cultnet.hello.v0` is answered with the gateway's hello (once per session), and a schema
//!   catalog request with the catalog. A client's `cultnet.error.v0` is logged, never answered.
//!
//! [`Service`] holds the rules and answers what it can at once; a send, which may wait for the
//! homeserver, comes back as [`Answer::Send`] for [`serve`] to run on its own task, so one slow
//! homeserver does not hold other clients up.
//!
//! # Under load and attack
//! - [`start`] runs the service loop on a thread of its own, so sled's blocking calls never
//!   stall the runtime that runs the ears, mouths and turns. The loop drives the endpoint (its
//!   socket and hub) itself: a request is read, answered and its answer sent in one task, with
//!   no hop between tasks.
//! - Acks are group-committed: the loop takes every event waiting, applies the acks, flushes
//!   the inbox once, and only then answers them ([`Answer::AfterFlush`]).
//! - Each authenticated client has a budget ([`ClientLimits`]): requests per second (a token
//!   bucket), requests of its own in flight; past them it is answered `failed` (retry later),
//!   and one refused more than a burst's worth within a second (it does not slow down when
//!   told) is disconnected with the reason.
//!   A client that does not read its answers fills its session's send queue and is
//!   disconnected too. The others are not affected.
//! - Connect refusals are logged at most once per source address per 10 s and 10 a second in
//!   all ([`limits::RefusalLog`]); a replayed nonce is refused before its signature is checked.
//! - Stopping loses no answer in flight, within a bound: the sends and verbs running answer
//!   (at most 2.5 s; meanwhile new requests are answered `failed`, retry later, and Connects
//!   refused), then each RUDP session delivers what is queued and ends with the reason (at
//!   most 1.5 s more).

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use bytes::Bytes;
use ed25519_dalek::VerifyingKey;
use serde::Serialize;
use tokio::sync::{mpsc, watch, Notify};
use wire::docs::{
    ids, AckReceipt, AuthError, ConnectPayload, ControlReceipt, ExtensionAckReceipt, GatewayStatus,
    NoteReceipt, PersonaStatus, Request, SendReceipt, Status, TurnReceipt,
};
use wire::hub::HubEvent;
use wire::msg::{ErrorMsg, Message, Put, RawDocument};
use wire::session::Frame;

use crate::answers::{AnswerTx, Unqueued};
use crate::config::{Client, Verb};
use crate::ear::{EarStats, Signals};
use crate::endpoint::{Endpoint, EndpointEvent, EndpointHandle};
use crate::inbox::Inbox;
use crate::mouth::Mouth;

pub mod limits;
pub use limits::ClientLimits;
use limits::{Budget, RefusalLog, Verdict};

/// The channel requests and answers travel on.
pub const CHANNEL: &str = "schema";
/// Deliveries per page when the request names no limit, and the most one page holds.
pub const DEFAULT_PAGE: u32 = 50;
/// The most deliveries one page holds.
pub const MAX_PAGE: u32 = 500;
/// Encoded bytes per page when the request names none, and the most it may ask for.
pub const DEFAULT_REPLY_BYTES: u32 = 256 * 1024;
/// The most encoded bytes one page may ask for.
pub const MAX_REPLY_BYTES: u32 = 4 * 1024 * 1024;
/// Sends waiting for the homeserver at once, at most (all clients together); beyond it a send
/// is answered `failed` at once, to be retried.
pub const MAX_SENDS_IN_FLIGHT: usize = 64;
/// Connect nonces remembered at most (older ones are beyond the skew window anyway).
const MAX_NONCES: usize = 100_000;

/// Why a Connect was refused (the client is told the same text).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Refusal {
    /// The payload is not a signed Connect payload, or the signature or time is wrong.
    #[error("{0}")]
    Auth(#[from] AuthError),
    /// No client with this agent id is configured.
    #[error("agent {0:?} is not a configured client")]
    UnknownAgent(String),
    /// This nonce was used before.
    #[error("nonce already used by agent {0:?} (replayed connect)")]
    Replay(String),
}

impl Refusal {
    /// A short name for the reason (a metrics label).
    pub fn reason(&self) -> &'static str {
        match self {
            Self::Auth(AuthError::BadSignature(_)) => "bad_signature",
            Self::Auth(AuthError::Stale { .. }) => "stale",
            Self::Auth(_) => "malformed",
            Self::UnknownAgent(_) => "unknown_agent",
            Self::Replay(_) => "replay",
        }
    }
}

/// What a Persona offers the service: her inbox side is shared; a mouth and a turn trigger only
/// when she is running.
#[derive(Clone)]
pub struct Port {
    /// Her Matrix user id.
    pub user_id: String,
    /// Pending deliveries at which her ear holds back.
    pub max_pending: u64,
    /// Her mouth (absent when she could not start).
    pub mouth: Option<Mouth>,
    /// Her turn loop's trigger (absent when her session is off).
    pub turn_requests: Option<Arc<Notify>>,
    /// Her turn loop's verbs (absent when her session is off).
    pub controls: Option<mpsc::Sender<crate::turns::Control>>,
    /// Her signals (acks wake her ear when it holds back).
    pub signals: Arc<Signals>,
    /// Her ear's counters.
    pub ear: Option<Arc<EarStats>>,
    /// Why she is not running, when she is not.
    pub failed: Option<String>,
}

impl Port {
    /// A Persona with nothing running for her yet (no mouth, no turn loop, no ear): what the
    /// service knows of one that failed to start (with `failed` set), and of one in tests.
    pub fn new(user_id: &str, max_pending: u64) -> Self {
        Self {
            user_id: user_id.to_owned(),
            max_pending,
            mouth: None,
            turn_requests: None,
            controls: None,
            signals: Arc::default(),
            ear: None,
            failed: None,
        }
    }
}

impl std::fmt::Debug for Port {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Port")
            .field("user_id", &self.user_id)
            .field("running", &self.mouth.is_some())
            .field("failed", &self.failed)
            .finish()
    }
}

/// An answer that needs the network: run by [`serve`] on its own task.
#[derive(Debug)]
pub enum Answer {
    /// Bytes to send back now.
    Reply(Bytes),
    /// A send for the mouth; its receipt goes back under `record_key`.
    Send {
        /// The request document's record key.
        record_key: String,
        /// The request.
        request: wire::docs::SendRequest,
        /// Her mouth.
        mouth: Mouth,
        /// Counts the request against its client's in-flight limit until dropped.
        slot: InFlight,
    },
    /// A session verb queued for her turn loop; its receipt goes back under `record_key` once
    /// it is applied (at her next turn boundary).
    Control {
        /// The request document's record key.
        record_key: String,
        /// The persona (for a receipt when the loop is gone).
        request: wire::docs::ControlRequest,
        /// Where the receipt comes from.
        receipt: tokio::sync::oneshot::Receiver<ControlReceipt>,
        /// Counts the request against its client's in-flight limit until dropped.
        slot: InFlight,
    },
    /// An answer that may go out only once the inbox is flushed (an ack): `ok` then, or
    /// `failed` if the flush failed.
    AfterFlush {
        /// The receipt.
        ok: Bytes,
        /// The receipt to send instead when the flush failed.
        failed: Bytes,
    },
    /// End this client's session with the reason (it broke its limits).
    Disconnect(String),
    /// A read receipt for the last acknowledged event.
    ReadReceipt {
        /// Her mouth.
        mouth: Mouth,
        /// The room.
        room_id: String,
        /// The event.
        event_id: String,
    },
}

/// One request of a client still running; its client's in-flight count drops when this does.
#[derive(Debug)]
pub struct InFlight(Arc<std::sync::atomic::AtomicUsize>);

impl InFlight {
    fn take(count: &Arc<std::sync::atomic::AtomicUsize>) -> Self {
        count.fetch_add(1, Ordering::Relaxed);
        Self(count.clone())
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// What the service keeps per authenticated session: whose it is. Its limits are the
/// agent's ([`Agent`]), so a client that reconnects does not start over with a full bucket.
#[derive(Debug)]
struct Peer {
    agent: String,
}

/// What the service keeps per configured client (agent), across its sessions and reconnects.
#[derive(Debug)]
struct Agent {
    budget: Budget,
    in_flight: Arc<std::sync::atomic::AtomicUsize>,
}

/// Service counters.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct ServiceStats {
    /// Connects accepted.
    pub accepted: u64,
    /// Connects refused.
    pub refused: u64,
    /// Requests answered with a receipt (any status).
    pub requests: u64,
    /// Requests refused (permission, unknown Persona, bad payload).
    pub rejected: u64,
    /// Messages that did not decode, or were not requests.
    pub bad_messages: u64,
    /// Requests answered `failed` because their client was over its rate or in-flight limit.
    pub limited: u64,
    /// Clients disconnected for breaking their limits.
    pub cut_off: u64,
    /// Inbox flushes (one per batch of acks).
    pub flushes: u64,
}

/// The service's state and rules.
#[derive(Debug)]
pub struct Service {
    runtime_id: String,
    started_at: String,
    connection_id: u32,
    max_skew_ms: u64,
    inbox: Inbox,
    clients: HashMap<String, (VerifyingKey, Client)>,
    ports: BTreeMap<String, Port>,
    peers: HashMap<SocketAddr, Peer>,
    /// One per agent that has made a request (at most one per configured client); made full
    /// at its first request.
    agents: HashMap<String, Agent>,
    greeted: std::collections::HashSet<SocketAddr>,
    /// Nonces used, with when they were signed and the address that used them.
    nonces: HashMap<(String, String), (u64, SocketAddr)>,
    stats: ServiceStats,
    limits: ClientLimits,
    /// Where Connects, peers and limits are counted.
    metrics: Arc<crate::metrics::Metrics>,
    refusals: RefusalLog,
    /// Acks applied but not yet flushed.
    unflushed: bool,
    /// Where sends, verbs and read receipts run (the gateway's main runtime); the current one
    /// when unset.
    tasks: Option<tokio::runtime::Handle>,
}

impl Service {
    /// A service for the configured clients (keys already checked by the config; an invalid one
    /// is left out and logged).
    pub fn new(
        runtime_id: &str,
        connection_id: u32,
        max_skew_secs: u64,
        inbox: Inbox,
        clients: &[Client],
        ports: BTreeMap<String, Port>,
    ) -> Self {
        let clients = pinned(clients);
        Self {
            runtime_id: runtime_id.to_owned(),
            started_at: rfc3339(crate::clock::unix_ms()),
            connection_id,
            max_skew_ms: max_skew_secs.saturating_mul(1000),
            inbox,
            clients,
            ports,
            peers: HashMap::new(),
            agents: HashMap::new(),
            greeted: Default::default(),
            nonces: HashMap::new(),
            stats: ServiceStats::default(),
            limits: ClientLimits::default(),
            metrics: crate::metrics::unserved(),
            refusals: RefusalLog::default(),
            unflushed: false,
            tasks: None,
        }
    }

    /// The same service with these per-client limits.
    pub fn with_limits(mut self, limits: ClientLimits) -> Self {
        self.limits = limits;
        self
    }

    /// Counts Connects, peers and limits in `metrics` (the gateway's, which its exporter
    /// serves).
    pub fn with_metrics(mut self, metrics: Arc<crate::metrics::Metrics>) -> Self {
        self.metrics = metrics;
        self
    }

    /// The same service running its network answers (sends, verbs, read receipts) on `tasks`.
    pub fn with_tasks(mut self, tasks: tokio::runtime::Handle) -> Self {
        self.tasks = Some(tasks);
        self
    }

    /// Makes the acks applied since the last commit durable (one flush for all of them).
    pub fn commit(&mut self) -> Result<(), crate::inbox::InboxError> {
        if !std::mem::take(&mut self.unflushed) {
            return Ok(());
        }
        self.stats.flushes += 1;
        self.inbox.flush()
    }

    /// Counts a request refused for its client's `limit`, here and in the metrics.
    fn count_limited(&mut self, limit: &str) {
        self.stats.limited += 1;
        self.metrics.limited(limit);
    }

    /// Counts a client cut off for its `limit`, here and in the metrics.
    fn count_cut_off(&mut self, limit: &str) {
        self.stats.cut_off += 1;
        self.metrics.cut_off(limit);
    }

    /// Counters.
    pub fn stats(&self) -> ServiceStats {
        self.stats
    }

    /// Checks a Connect payload from `peer` at `now_ms`; on success the peer may send requests
    /// as that agent.
    pub fn authenticate(
        &mut self,
        peer: SocketAddr,
        payload: &[u8],
        now_ms: u64,
    ) -> Result<String, Refusal> {
        let out = self.check_connect(peer, payload, now_ms);
        match &out {
            Ok(agent) => {
                self.stats.accepted += 1;
                self.peers.insert(
                    peer,
                    Peer {
                        agent: agent.clone(),
                    },
                );
                let m = &self.metrics;
                m.connects_accepted.inc();
                m.peers.set(self.peers.len() as i64);
                tracing::info!(%peer, %agent, "CultNet client connected");
            }
            Err(why) => {
                self.stats.refused += 1;
                self.metrics.refused(why.reason());
                if let Some(held_back) = self.refusals.admit(peer.ip(), std::time::Instant::now()) {
                    tracing::warn!(%peer, held_back, "CultNet connect refused: {why}");
                }
            }
        }
        out
    }

    fn check_connect(
        &mut self,
        peer: SocketAddr,
        payload: &[u8],
        now_ms: u64,
    ) -> Result<String, Refusal> {
        let p = ConnectPayload::decode(payload)?;
        let (key, _) = self
            .clients
            .get(&p.agent_id)
            .ok_or_else(|| Refusal::UnknownAgent(p.agent_id.clone()))?;
        // A replayed payload is refused before its signature costs anything (only verified
        // nonces are remembered, so a forger cannot poison this). From the address that used
        // it first, it is that client resending its Connect (its first was dropped from a full
        // waiting room, or answered after it timed out): it is let through.
        if let Some((_, from)) = self.nonces.get(&(p.agent_id.clone(), p.nonce.clone())) {
            if *from != peer {
                return Err(Refusal::Replay(p.agent_id));
            }
            p.verify(key, self.connection_id, now_ms, self.max_skew_ms)?;
            return Ok(p.agent_id);
        }
        p.verify(key, self.connection_id, now_ms, self.max_skew_ms)?;
        // A nonce older than twice the skew cannot pass the time check again: forget those
        // once there are a few.
        let horizon = now_ms.saturating_sub(self.max_skew_ms.saturating_mul(2));
        if self.nonces.len() >= 1024 {
            self.nonces.retain(|_, (at, _)| *at >= horizon);
        }
        if self.nonces.len() >= MAX_NONCES {
            // Only a flood of valid, fresh connects gets here; forgetting the oldest half
            // would reopen a replay window, so refuse until they age out.
            return Err(Refusal::Replay(p.agent_id));
        }
        let fresh = self
            .nonces
            .insert((p.agent_id.clone(), p.nonce.clone()), (p.issued_at, peer))
            .is_none();
        if !fresh {
            return Err(Refusal::Replay(p.agent_id));
        }
        Ok(p.agent_id)
    }

    /// The authenticated peers.
    pub fn peer_addrs(&self) -> Vec<SocketAddr> {
        self.peers.keys().copied().collect()
    }

    /// Forgets a peer whose session ended.
    pub fn forget(&mut self, peer: SocketAddr) {
        self.greeted.remove(&peer);
        if let Some(Peer { agent, .. }) = self.peers.remove(&peer) {
            self.metrics.peers.set(self.peers.len() as i64);
            tracing::info!(%peer, %agent, "CultNet client gone");
        }
    }

    /// Answers one frame from an authenticated peer.
    pub fn handle(&mut self, peer: SocketAddr, frame: &Frame) -> Vec<Answer> {
        self.handle_at(peer, frame, std::time::Instant::now())
    }

    /// [`Service::handle`] at `now` (the client's budget refills with time).
    pub fn handle_at(
        &mut self,
        peer: SocketAddr,
        frame: &Frame,
        now: std::time::Instant,
    ) -> Vec<Answer> {
        let limits = self.limits;
        let Some(p) = self.peers.get(&peer) else {
            return Vec::new();
        };
        let agent = p.agent.clone();
        let a = self.agents.entry(agent.clone()).or_insert_with(|| Agent {
            budget: Budget::new(&limits, now),
            in_flight: Arc::default(),
        });
        let in_flight = a.in_flight.clone();
        match a.budget.take(&limits, now) {
            Verdict::Allow => {}
            Verdict::Refuse => {
                self.count_limited("rate");
                return self.retry_later(
                    frame,
                    format!(
                        "rate limit: {} requests/s (burst {}); retry later",
                        limits.requests_per_sec, limits.burst
                    ),
                );
            }
            Verdict::Disconnect => {
                self.count_cut_off("rate");
                tracing::warn!(%peer, %agent, "CultNet client cut off: it kept going past its rate limit");
                self.forget(peer);
                return vec![Answer::Disconnect(format!(
                    "request rate limit ({} requests/s) exceeded after being told",
                    limits.requests_per_sec
                ))];
            }
        }
        self.handle_allowed(peer, &agent, frame, &in_flight)
    }

    /// The answer to a request that cannot be taken now (its client is over a limit, the
    /// gateway is stopping): its receipt with status `failed` (or an error for requests without
    /// a status); nothing for what is not a request.
    fn retry_later(&self, frame: &Frame, why: String) -> Vec<Answer> {
        let Ok(Message::DocumentPutRaw(put)) = Message::decode(&frame.payload) else {
            return Vec::new();
        };
        let key = put.document.record_key.clone();
        match Request::from_document(&put.document) {
            Ok(req) => vec![self.refusal_with(&req, &key, why, Status::Failed)],
            Err(_) => Vec::new(),
        }
    }

    fn handle_allowed(
        &mut self,
        peer: SocketAddr,
        agent: &str,
        frame: &Frame,
        in_flight: &Arc<std::sync::atomic::AtomicUsize>,
    ) -> Vec<Answer> {
        let agent = agent.to_owned();
        if &*frame.channel != CHANNEL {
            self.stats.bad_messages += 1;
            tracing::debug!(%peer, channel = %frame.channel, "frame on another channel ignored");
            return Vec::new();
        }
        let message = match Message::decode(&frame.payload) {
            Ok(m) => m,
            Err(e) => {
                self.stats.bad_messages += 1;
                return vec![error(format!("message does not decode: {e}"))];
            }
        };
        match message {
            // Answered once per session: a peer that answers every hello with its own would
            // otherwise ping-pong with us forever.
            Message::Hello(h) => {
                if !self.greeted.insert(peer) {
                    tracing::debug!(%peer, runtime = %h.runtime_id, "repeated hello not answered");
                    return Vec::new();
                }
                vec![Answer::Reply(Bytes::from(
                    Message::Hello(wire::docs::gateway_hello(&self.runtime_id)).encode(),
                ))]
            }
            // Never answered, for the same reason.
            Message::Error(e) => {
                tracing::warn!(%peer, %agent, "client reports an error: {}", e.error);
                Vec::new()
            }
            Message::SchemaCatalogRequest(req) => vec![Answer::Reply(Bytes::from(
                Message::SchemaCatalogResponse(wire::contracts::answer(&req)).encode(),
            ))],
            Message::DocumentPutRaw(put) => self.request(&agent, &put.document, in_flight),
            Message::DocumentPut(put) => {
                self.stats.bad_messages += 1;
                vec![error(format!(
                    "request {:?} ({}): send requests as cultnet.document_put_raw.v0",
                    put.document.record_key, put.document.schema_id
                ))]
            }
            other => {
                self.stats.bad_messages += 1;
                vec![error(format!(
                    "{} is not something this gateway answers",
                    other.schema_version()
                ))]
            }
        }
    }

    fn request(
        &mut self,
        agent: &str,
        doc: &RawDocument,
        in_flight: &Arc<std::sync::atomic::AtomicUsize>,
    ) -> Vec<Answer> {
        let key = doc.record_key.clone();
        let req = match Request::from_document(doc) {
            Ok(r) => r,
            Err(e) => {
                self.stats.bad_messages += 1;
                return vec![error(format!("request {key:?} ({}): {e}", doc.schema_id))];
            }
        };
        if let Err(why) = self.permit(agent, &req) {
            self.stats.rejected += 1;
            tracing::warn!(%agent, record = %key, "request refused: {why}");
            return vec![self.refusal(&req, &key, why)];
        }
        let running = in_flight.load(Ordering::Relaxed);
        if matches!(req, Request::Send(_) | Request::Control(_))
            && running >= self.limits.max_in_flight
        {
            self.count_limited("in_flight");
            let why = format!("{running} of your requests are in flight; retry later");
            return vec![self.refusal_with(&req, &key, why, Status::Failed)];
        }
        self.stats.requests += 1;
        match req {
            Request::Pending(r) => {
                let limit = r.limit.unwrap_or(DEFAULT_PAGE).clamp(1, MAX_PAGE) as usize;
                let bytes = r
                    .reply_bytes
                    .unwrap_or(DEFAULT_REPLY_BYTES)
                    .clamp(1024, MAX_REPLY_BYTES) as usize;
                match self
                    .inbox
                    .pending(&r.persona, r.after_seq, limit, Some(bytes))
                {
                    Ok(page) => vec![self.receipt(
                        ids::PENDING_PAGE,
                        &key,
                        &wire::docs::PendingPage {
                            persona: r.persona,
                            deliveries: page.deliveries,
                            through_seq: page.through_seq,
                            more: page.more,
                            pending_count: page.pending_count,
                        },
                    )],
                    Err(e) => vec![error(format!("request {key:?}: inbox: {e}"))],
                }
            }
            Request::Ack(r) => self.ack(&key, r),
            Request::Send(r) => {
                let Some(mouth) = self.ports.get(&r.persona).and_then(|p| p.mouth.clone()) else {
                    return vec![self.receipt(
                        ids::SEND_RECEIPT,
                        &key,
                        &SendReceipt {
                            request_id: r.request_id,
                            status: Status::Failed,
                            error: Some(format!("{} is not running now", r.persona)),
                            ..SendReceipt::default()
                        },
                    )];
                };
                vec![Answer::Send {
                    record_key: key,
                    request: r,
                    mouth,
                    slot: InFlight::take(in_flight),
                }]
            }
            Request::Turn(r) => {
                let trigger = self
                    .ports
                    .get(&r.persona)
                    .and_then(|p| p.turn_requests.clone());
                let receipt = match trigger {
                    Some(t) => {
                        tracing::info!(persona = %r.persona, reason = ?r.reason, %agent, "turn requested");
                        t.notify_one();
                        TurnReceipt {
                            persona: r.persona,
                            status: Status::Ok,
                            ..TurnReceipt::default()
                        }
                    }
                    None => TurnReceipt {
                        persona: r.persona,
                        status: Status::Rejected,
                        error: Some(
                            "her session is off (mouth-only): her Minds drive her turns".into(),
                        ),
                        ..TurnReceipt::default()
                    },
                };
                vec![self.receipt(ids::TURN_RECEIPT, &key, &receipt)]
            }
            Request::Status(r) => {
                let allowed = self.clients.get(agent).map(|(_, c)| c);
                let personas = self
                    .ports
                    .keys()
                    .filter(|p| r.persona.as_deref().is_none_or(|only| only == *p))
                    .filter(|p| allowed.is_some_and(|c| c.allows_persona(p)))
                    .cloned()
                    .collect::<Vec<_>>();
                let status = self.status(&personas);
                vec![self.receipt(ids::STATUS, &key, &status)]
            }
            Request::Note(r) => self.note(&key, r),
            Request::Control(r) => self.control(&key, r, in_flight),
            Request::ExtensionPending(r) => self.extension_page(&key, r),
            Request::ExtensionAck(r) => self.extension_ack(&key, r),
            _ => vec![error(format!("request {key:?}: not supported"))],
        }
    }

    fn ack(&mut self, key: &str, r: wire::docs::AckRequest) -> Vec<Answer> {
        // The event acknowledged last gets her read receipt.
        let last = self
            .inbox
            .pending(&r.persona, r.through_seq.saturating_sub(1), 1, None)
            .ok()
            .and_then(|p| p.deliveries.into_iter().next())
            .filter(|d| d.seq == r.through_seq);
        let port = self.ports.get(&r.persona);
        match self.inbox.ack_unflushed(&r.persona, r.through_seq) {
            Ok((c, changed)) => {
                // Group commit: the receipt waits for the loop's one flush for all acks.
                self.unflushed |= changed;
                let receipt = |status, error| {
                    let r = AckReceipt {
                        persona: r.persona.clone(),
                        status,
                        through_seq: c.acked_through,
                        pending_count: c.pending,
                        error,
                    };
                    receipt_bytes(&self.runtime_id, ids::ACK_RECEIPT, key, &r)
                };
                let mut out = vec![Answer::AfterFlush {
                    ok: receipt(Status::Ok, None),
                    failed: receipt(
                        Status::Failed,
                        Some("the inbox could not write the ack to disk (see the gateway's log); retry".into()),
                    ),
                }];
                if let Some(port) = port {
                    port.signals.acked.notify_one();
                    if let (Some(mouth), Some(d)) = (port.mouth.clone(), last) {
                        out.push(Answer::ReadReceipt {
                            mouth,
                            room_id: d.room_id,
                            event_id: d.event_id,
                        });
                    }
                }
                out
            }
            Err(e) => {
                let pending_count = self.inbox.counts(&r.persona).map_or(0, |c| c.pending);
                vec![self.receipt(
                    ids::ACK_RECEIPT,
                    key,
                    &AckReceipt {
                        persona: r.persona,
                        status: Status::Rejected,
                        through_seq: r.through_seq,
                        pending_count,
                        error: Some(e.to_string()),
                    },
                )]
            }
        }
    }

    /// Whether `agent` may make `req`.
    fn permit(&self, agent: &str, req: &Request) -> Result<(), String> {
        let Some((_, client)) = self.clients.get(agent) else {
            return Err(format!("agent {agent:?} is no longer configured"));
        };
        let verb = match req {
            Request::Pending(_) => Verb::Pending,
            Request::Ack(_) => Verb::Ack,
            Request::Send(_) => Verb::Send,
            Request::Turn(_) => Verb::Turn,
            Request::Status(_) => Verb::Status,
            Request::Note(_) => Verb::Note,
            Request::Control(_) => Verb::Session,
            Request::ExtensionPending(_) | Request::ExtensionAck(_) => Verb::Extensions,
            _ => return Err("unknown request".into()),
        };
        if !client.verbs.contains(&verb) {
            return Err(format!("agent {agent:?} may not make {verb:?} requests"));
        }
        if let Some(persona) = req.persona() {
            if !self.ports.contains_key(persona) {
                return Err(format!("no Persona {persona:?} here"));
            }
            if !client.allows_persona(persona) {
                return Err(format!("agent {agent:?} may not act for {persona:?}"));
            }
        }
        if let Request::Send(s) = req {
            if s.request_id.trim().is_empty() {
                return Err(
                    "a send request needs a requestId (it makes the send exactly-once)".into(),
                );
            }
        }
        Ok(())
    }

    fn refusal(&self, req: &Request, key: &str, why: String) -> Answer {
        self.refusal_with(req, key, why, Status::Rejected)
    }

    /// The receipt of a request not carried out, with `status` (`rejected`: not allowed;
    /// `failed`: retry later), or an error for requests whose answers carry no status.
    fn refusal_with(&self, req: &Request, key: &str, why: String, status: Status) -> Answer {
        match req {
            Request::Ack(r) => self.receipt(
                ids::ACK_RECEIPT,
                key,
                &AckReceipt {
                    persona: r.persona.clone(),
                    status,
                    through_seq: r.through_seq,
                    pending_count: 0,
                    error: Some(why),
                },
            ),
            Request::Send(r) => self.receipt(
                ids::SEND_RECEIPT,
                key,
                &SendReceipt {
                    request_id: r.request_id.clone(),
                    status,
                    error: Some(why),
                    ..SendReceipt::default()
                },
            ),
            Request::Turn(r) => self.receipt(
                ids::TURN_RECEIPT,
                key,
                &TurnReceipt {
                    persona: r.persona.clone(),
                    status,
                    error: Some(why),
                    ..TurnReceipt::default()
                },
            ),
            Request::Note(r) => self.receipt(
                ids::NOTE_RECEIPT,
                key,
                &NoteReceipt {
                    persona: r.persona.clone(),
                    note_id: r.note_id.clone(),
                    status,
                    error: Some(why),
                    ..NoteReceipt::default()
                },
            ),
            Request::Control(r) => self.receipt(
                ids::CONTROL_RECEIPT,
                key,
                &ControlReceipt {
                    persona: r.persona.clone(),
                    action: r.action,
                    status,
                    error: Some(why),
                    ..ControlReceipt::default()
                },
            ),
            Request::ExtensionAck(r) => self.receipt(
                ids::EXTENSION_ACK_RECEIPT,
                key,
                &ExtensionAckReceipt {
                    persona: r.persona.clone(),
                    status,
                    through_seq: r.through_seq,
                    error: Some(why),
                    ..ExtensionAckReceipt::default()
                },
            ),
            _ => error(format!("request {key:?}: {why}")),
        }
    }

    /// A note for her next batch: checked, stored durably, and with `wake` her turn loop woken.
    fn note(&mut self, key: &str, r: wire::docs::NoteRequest) -> Vec<Answer> {
        let trigger = self
            .ports
            .get(&r.persona)
            .and_then(|p| p.turn_requests.clone());
        let Some(trigger) = trigger else {
            let why = "her session is off (mouth-only): notes reach only a live session".to_owned();
            return vec![self.refusal(&Request::Note(r), key, why)];
        };
        if let Err(why) = r.check() {
            return vec![self.refusal(&Request::Note(r), key, why)];
        }
        let receipt = match self.inbox.put_note(&r, crate::clock::unix_ms()) {
            Ok(put) => {
                tracing::info!(persona = %r.persona, note = %r.note_id, kind = %r.kind, wake = r.wake, duplicate = put.duplicate, "note stored");
                if r.wake && !put.duplicate {
                    trigger.notify_one();
                }
                NoteReceipt {
                    persona: r.persona,
                    note_id: r.note_id,
                    status: Status::Ok,
                    duplicate: put.duplicate,
                    pending_notes: put.pending,
                    error: None,
                }
            }
            Err(e) => NoteReceipt {
                persona: r.persona,
                note_id: r.note_id,
                status: Status::Failed,
                error: Some(format!("inbox: {e}")),
                ..NoteReceipt::default()
            },
        };
        vec![self.receipt(ids::NOTE_RECEIPT, key, &receipt)]
    }

    /// A session verb: queued for her turn loop, answered once applied.
    fn control(
        &mut self,
        key: &str,
        r: wire::docs::ControlRequest,
        in_flight: &Arc<std::sync::atomic::AtomicUsize>,
    ) -> Vec<Answer> {
        let Some(controls) = self.ports.get(&r.persona).and_then(|p| p.controls.clone()) else {
            let why = "her session is off (mouth-only): there is no session to act on".to_owned();
            return vec![self.refusal(&Request::Control(r), key, why)];
        };
        let (tx, rx) = tokio::sync::oneshot::channel();
        let failed = |why: &str| ControlReceipt {
            persona: r.persona.clone(),
            action: r.action,
            status: Status::Failed,
            error: Some(why.to_owned()),
            ..ControlReceipt::default()
        };
        match controls.try_send(crate::turns::Control {
            request: r.clone(),
            reply: tx,
        }) {
            Ok(()) => vec![Answer::Control {
                record_key: key.to_owned(),
                request: r,
                receipt: rx,
                slot: InFlight::take(in_flight),
            }],
            Err(mpsc::error::TrySendError::Full(_)) => {
                let receipt = failed("her session has too many verbs waiting; retry later");
                vec![self.receipt(ids::CONTROL_RECEIPT, key, &receipt)]
            }
            Err(mpsc::error::TrySendError::Closed(_)) => {
                let receipt = failed("her turn loop is not running");
                vec![self.receipt(ids::CONTROL_RECEIPT, key, &receipt)]
            }
        }
    }

    fn extension_page(&mut self, key: &str, r: wire::docs::ExtensionPendingRequest) -> Vec<Answer> {
        let limit = r.limit.unwrap_or(DEFAULT_PAGE).clamp(1, MAX_PAGE) as usize;
        match self
            .inbox
            .pending_extensions(&r.persona, r.after_seq, limit)
        {
            Ok(page) => vec![self.receipt(
                ids::EXTENSION_PAGE,
                key,
                &wire::docs::ExtensionPage {
                    persona: r.persona,
                    extensions: page.extensions,
                    through_seq: page.through_seq,
                    more: page.more,
                    pending_count: page.pending_count,
                },
            )],
            Err(e) => vec![error(format!("request {key:?}: inbox: {e}"))],
        }
    }

    fn extension_ack(&mut self, key: &str, r: wire::docs::ExtensionAckRequest) -> Vec<Answer> {
        let receipt = match self.inbox.ack_extensions(&r.persona, r.through_seq) {
            Ok(pending_count) => ExtensionAckReceipt {
                persona: r.persona,
                status: Status::Ok,
                through_seq: r.through_seq,
                pending_count,
                error: None,
            },
            Err(e) => ExtensionAckReceipt {
                status: if matches!(e, crate::inbox::InboxError::AckBeyondHighest { .. }) {
                    Status::Rejected
                } else {
                    Status::Failed
                },
                persona: r.persona,
                through_seq: r.through_seq,
                pending_count: 0,
                error: Some(e.to_string()),
            },
        };
        vec![self.receipt(ids::EXTENSION_ACK_RECEIPT, key, &receipt)]
    }

    /// The gateway's status for these Personas.
    pub fn status(&self, personas: &[String]) -> GatewayStatus {
        GatewayStatus {
            runtime_id: self.runtime_id.clone(),
            version: env!("CARGO_PKG_VERSION").to_owned(),
            started_at: self.started_at.clone(),
            peers: u32::try_from(self.peers.len()).unwrap_or(u32::MAX),
            personas: personas
                .iter()
                .filter_map(|id| Some((id, self.ports.get(id)?)))
                .map(|(id, port)| {
                    let c = self.inbox.counts(id).unwrap_or_default();
                    let sync_state = if port.failed.is_some() {
                        "stopped"
                    } else if c.pending >= port.max_pending {
                        "held"
                    } else if port
                        .ear
                        .as_ref()
                        .is_some_and(|e| e.errors.load(Ordering::Relaxed) > 0)
                    {
                        "syncing (after errors)"
                    } else {
                        "syncing"
                    };
                    PersonaStatus {
                        persona: id.clone(),
                        user_id: port.user_id.clone(),
                        sync_state: sync_state.to_owned(),
                        pending_count: c.pending,
                        highest_seq: c.highest,
                        acked_through: c.acked_through,
                        last_error: port.failed.clone().or_else(|| {
                            port.signals
                                .session_error
                                .lock()
                                .unwrap_or_else(|p| p.into_inner())
                                .clone()
                        }),
                    }
                })
                .collect(),
        }
    }

    fn receipt<T: Serialize>(&self, schema: &str, key: &str, payload: &T) -> Answer {
        Answer::Reply(receipt_bytes(&self.runtime_id, schema, key, payload))
    }
}

/// A receipt document in a `cultnet.document_put_raw.v0` message.
pub fn receipt_bytes<T: Serialize>(
    runtime_id: &str,
    schema: &str,
    key: &str,
    payload: &T,
) -> Bytes {
    let mut doc =
        RawDocument::from_payload(schema, key, &rfc3339(crate::clock::unix_ms()), payload);
    doc.source_runtime_id = Some(runtime_id.to_owned());
    doc.source_role = Some("matrix_gateway".to_owned());
    Bytes::from(
        Message::DocumentPutRaw(Put {
            message_id: message_id(),
            document: doc,
        })
        .encode(),
    )
}

fn error(text: String) -> Answer {
    Answer::Reply(Bytes::from(
        Message::Error(ErrorMsg { error: text }).encode(),
    ))
}

/// A new message id (a v4 UUID, hyphenated), written without the formatting machinery.
pub fn message_id() -> String {
    uuid::Uuid::new_v4()
        .hyphenated()
        .encode_lower(&mut uuid::Uuid::encode_buffer())
        .to_owned()
}

/// `unix_ms` as RFC 3339 in UTC with milliseconds (`1970-01-01T00:00:00.000Z`).
pub fn rfc3339(unix_ms: i64) -> String {
    let secs = unix_ms.div_euclid(1000);
    let ms = unix_ms.rem_euclid(1000);
    let days = secs.div_euclid(86_400);
    let rem = secs.rem_euclid(86_400);
    // Civil from days (H. Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    // Digits by hand rather than `format!`: every answer carries a timestamp.
    if !(0..=9999).contains(&year) {
        // Outside RFC 3339's four digits (a clock far off): the general form.
        return format!(
            "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{ms:03}Z",
            rem / 3600,
            rem % 3600 / 60,
            rem % 60
        );
    }
    let mut out = String::with_capacity(24);
    let fields = [
        (year, 4, '-'),
        (month, 2, '-'),
        (day, 2, 'T'),
        (rem / 3600, 2, ':'),
        (rem % 3600 / 60, 2, ':'),
        (rem % 60, 2, '.'),
        (ms, 3, 'Z'),
    ];
    for (n, width, then) in fields {
        for k in (0..width).rev() {
            let d = n.unsigned_abs() / 10u64.pow(k) % 10;
            out.push(char::from(b'0' + d as u8));
        }
        out.push(then);
    }
    out
}

/// What the QUIC side (`gateway::quic`, above this module) tells the service loop about its connections.
#[derive(Debug)]
pub enum Remote {
    /// A connection's first frame, its Connect payload; the verdict goes back on `verdict`.
    Connect {
        /// The peer.
        peer: SocketAddr,
        /// Its Connect payload.
        payload: Bytes,
        /// Its connection (unique among the QUIC endpoint's).
        id: usize,
        /// Where its answers go (and how it is cut off).
        out: AnswerTx,
        /// `Ok` to go on, `Err(reason)` to close the connection.
        verdict: tokio::sync::oneshot::Sender<Result<(), String>>,
    },
    /// A message from an accepted peer.
    Frame {
        /// The peer.
        peer: SocketAddr,
        /// The message.
        payload: Bytes,
    },
    /// The connection ended.
    Gone {
        /// The peer.
        peer: SocketAddr,
        /// Which connection from that address ended (a newer one from the same address may
        /// be accepted already; its record stays).
        id: usize,
    },
}

/// An accepted QUIC peer: its connection, and where its answers go.
#[derive(Debug)]
struct QuicPeer {
    id: usize,
    out: AnswerTx,
}

/// A QUIC peer whose answer queue is full: it does not read what it asked for.
#[derive(Debug)]
struct Unread(SocketAddr);

/// Where a peer's answers go.
#[derive(Clone, Debug)]
enum Sink {
    Rudp(SocketAddr),
    Quic(SocketAddr, AnswerTx),
}

impl Sink {
    /// Sends from the service loop, never waiting: an RUDP answer goes straight into the
    /// endpoint's queue (a full one is reported as an event), a QUIC answer into its
    /// connection's queue; a full one is [`Unread`], and the loop cuts that peer off, so a
    /// client that does not read cannot hold the loop (and everyone else) up.
    fn send(&self, endpoint: &mut Endpoint, bytes: Bytes) -> Result<(), Unread> {
        match self {
            Sink::Rudp(peer) => endpoint.send(*peer, CHANNEL, bytes),
            Sink::Quic(peer, out) => {
                if out.try_send(bytes) == Err(Unqueued::Full) {
                    return Err(Unread(*peer));
                }
            }
        }
        Ok(())
    }

    /// The same sink for a task of its own (an RUDP answer goes through a handle).
    fn detach(&self, endpoint: &Endpoint) -> TaskSink {
        match self {
            Sink::Rudp(peer) => TaskSink::Rudp(endpoint.handle(), *peer),
            Sink::Quic(peer, out) => TaskSink::Quic(*peer, out.clone()),
        }
    }
}

/// Where an answer computed on a task of its own (a send, a verb) goes.
#[derive(Debug)]
enum TaskSink {
    Rudp(EndpointHandle, SocketAddr),
    Quic(SocketAddr, AnswerTx),
}

impl TaskSink {
    async fn send(&self, bytes: Bytes) {
        match self {
            TaskSink::Rudp(endpoint, peer) => {
                let _ = endpoint.send(*peer, CHANNEL, bytes).await;
            }
            TaskSink::Quic(peer, out) => {
                // As in the loop: a full queue means a client that does not read; its
                // connection closes, and the loop forgets and counts it when the connection
                // reports its end.
                if out.try_send(bytes) == Err(Unqueued::Full) && out.cut() {
                    tracing::warn!(%peer, "CultNet QUIC client cut off: it does not read its answers");
                }
            }
        }
    }
}

/// Runs the service over an endpoint until `stop` turns true.
pub async fn serve(service: Service, endpoint: Endpoint, stop: watch::Receiver<bool>) {
    serve_with(service, endpoint, None, stop).await;
}

/// The configured clients by agent id with their pinned keys (a key that is not an ed25519 key
/// was refused by the config already; should one get here, it is left out and logged).
fn pinned(clients: &[Client]) -> HashMap<String, (VerifyingKey, Client)> {
    clients
        .iter()
        .filter_map(|c| {
            let key = c
                .key_bytes()
                .and_then(|k| VerifyingKey::from_bytes(&k).ok());
            if key.is_none() {
                tracing::error!(agent = %c.agent_id, "client key is not an ed25519 key; left out");
            }
            Some((c.agent_id.clone(), (key?, c.clone())))
        })
        .collect()
}

/// A new set of clients and Personas for a running service (a reloaded config).
#[derive(Debug)]
pub struct Update {
    /// The configured clients (their grants take effect at once; a peer whose agent is gone
    /// is refused from its next request on).
    pub clients: Vec<Client>,
    /// Every Persona as she runs now.
    pub ports: BTreeMap<String, Port>,
    /// Told once the service holds the new set (and no longer the old Personas' handles).
    pub applied: Option<tokio::sync::oneshot::Sender<()>>,
}

impl Service {
    /// Takes a reloaded config's clients and the Personas as they now run.
    pub fn update(&mut self, mut u: Update) {
        self.clients = pinned(&u.clients);
        let clients = &self.clients;
        self.agents.retain(|agent, _| clients.contains_key(agent));
        self.ports = std::mem::take(&mut u.ports);
        tracing::info!(
            clients = self.clients.len(),
            personas = self.ports.len(),
            "CultNet service reloaded"
        );
        if let Some(done) = u.applied.take() {
            let _ = done.send(());
        }
    }
}

/// [`serve`], plus the peers of the QUIC side when `remote` is given.
pub async fn serve_with(
    service: Service,
    endpoint: Endpoint,
    remote: Option<mpsc::Receiver<Remote>>,
    stop: watch::Receiver<bool>,
) {
    serve_updating(service, endpoint, remote, None, stop).await;
}

/// QUIC events the loop takes in one batch at most (their acks share one flush).
const BATCH: usize = 256;

/// [`serve_with`], taking [`Update`]s (a reloaded config) while it runs.
///
/// The loop drives the endpoint itself: each round takes every datagram waiting, answers what
/// can be answered at once, flushes the inbox once for all the acks among them (group commit),
/// then queues the answers and sends them, all without a hop to another task.
pub async fn serve_updating(
    mut service: Service,
    mut endpoint: Endpoint,
    mut remote: Option<mpsc::Receiver<Remote>>,
    mut updates: Option<mpsc::Receiver<Update>>,
    mut stop: watch::Receiver<bool>,
) {
    let tasks = Tasks {
        runtime: service
            .tasks
            .clone()
            .unwrap_or_else(tokio::runtime::Handle::current),
        sends: Arc::new(tokio::sync::Semaphore::new(MAX_SENDS_IN_FLIGHT)),
        running: Arc::new(()),
    };
    let mut quic: HashMap<SocketAddr, QuicPeer> = HashMap::new();
    let mut out: Vec<(Sink, Answer)> = Vec::new();
    let mut unread: Vec<SocketAddr> = Vec::new();
    loop {
        let from_quic = next_from(&mut remote);
        let update = next_from(&mut updates);
        tokio::select! {
            () = endpoint.ready() => {}
            u = update => {
                match u {
                    Some(u) => service.update(u),
                    None => updates = None,
                }
                continue;
            }
            r = from_quic => {
                match r {
                    Some(r) => remote_event(&mut service, &mut quic, r, &mut out),
                    None => remote = None,
                }
            }
            _ = stop.changed() => break,
        };
        if !endpoint.pump() {
            break;
        }
        // Everything waiting joins this round: its acks share one flush.
        while let Some(e) = endpoint.poll_event() {
            endpoint_event(&mut service, &mut endpoint, e, &mut out);
        }
        if let Some(rx) = remote.as_mut() {
            for _ in 0..BATCH {
                let Ok(r) = rx.try_recv() else { break };
                remote_event(&mut service, &mut quic, r, &mut out);
            }
        }
        let flushed = service.commit();
        if let Err(e) = &flushed {
            tracing::error!("CultNet: the inbox could not flush acks: {e}");
        }
        for (sink, answer) in out.drain(..) {
            if let Err(Unread(peer)) = run_answer(
                &service.runtime_id,
                &tasks,
                &mut endpoint,
                &sink,
                answer,
                flushed.is_ok(),
            ) {
                unread.push(peer);
            }
        }
        for peer in unread.drain(..) {
            cut_off_quic(&mut service, &mut quic, peer);
        }
        endpoint.flush().await;
    }
    drain(&mut service, &mut endpoint, &mut remote, &quic, &tasks).await;
}

/// The next message of an optional channel; never, without one (a `select!` branch that
/// cannot fire).
async fn next_from<T>(rx: &mut Option<mpsc::Receiver<T>>) -> Option<T> {
    match rx.as_mut() {
        Some(rx) => rx.recv().await,
        None => std::future::pending().await,
    }
}

/// Why a stopping service's clients are turned away, and its sessions end.
const SHUTTING_DOWN: &str = "the gateway is shutting down";
/// How long a stopping service waits for the answers of the sends and verbs in flight.
const DRAIN_TASKS: std::time::Duration = std::time::Duration::from_millis(2500);
/// How long it then drives its sessions' last answers (a session's own linger is shorter).
const DRAIN_SESSIONS: std::time::Duration = std::time::Duration::from_millis(1500);
/// How long a stopping service takes at most, from `stop` to its loop's end.
pub const DRAIN: std::time::Duration = DRAIN_TASKS.saturating_add(DRAIN_SESSIONS);

/// Stops without losing the answers in flight, bounded in time: the sends and verbs running
/// on tasks answer (new requests are answered `failed`, retry later; new Connects refused),
/// then every RUDP session is finished (its queued answers delivered, then a Disconnect with
/// the reason) and driven until it ends. QUIC connections close with their own endpoint.
async fn drain(
    service: &mut Service,
    endpoint: &mut Endpoint,
    remote: &mut Option<mpsc::Receiver<Remote>>,
    quic: &HashMap<SocketAddr, QuicPeer>,
    tasks: &Tasks,
) {
    let until = tokio::time::Instant::now() + DRAIN_TASKS;
    while tasks.answering() > 0 && tokio::time::Instant::now() < until {
        closing_round(service, endpoint, remote, quic).await;
    }
    if tasks.answering() > 0 {
        tracing::warn!(
            unanswered = tasks.answering(),
            "CultNet service stopping with sends or verbs still unanswered"
        );
    }
    let peers: Vec<SocketAddr> = service
        .peer_addrs()
        .into_iter()
        .filter(|p| endpoint.has_session(*p))
        .collect();
    for peer in &peers {
        endpoint.finish(*peer, SHUTTING_DOWN);
    }
    let until = tokio::time::Instant::now() + DRAIN_SESSIONS;
    while peers.iter().any(|p| endpoint.has_session(*p)) && tokio::time::Instant::now() < until {
        closing_round(service, endpoint, remote, quic).await;
    }
    for peer in peers {
        endpoint.disconnect(peer, SHUTTING_DOWN);
    }
    endpoint.flush().await;
}

/// One round of a stopping service: waits for work (or a short tick, so the caller can see
/// tasks end), turns new requests and Connects away, sends what tasks answered.
async fn closing_round(
    service: &mut Service,
    endpoint: &mut Endpoint,
    remote: &mut Option<mpsc::Receiver<Remote>>,
    quic: &HashMap<SocketAddr, QuicPeer>,
) {
    let from_quic = next_from(remote);
    let mut turned_away = Vec::new();
    tokio::select! {
        () = endpoint.ready() => {}
        r = from_quic => match r {
            Some(Remote::Connect { verdict, .. }) => {
                let _ = verdict.send(Err(SHUTTING_DOWN.to_owned()));
            }
            Some(Remote::Frame { peer, payload }) => {
                if let Some(to) = quic.get(&peer) {
                    let frame = Frame { channel: Arc::from(CHANNEL), payload };
                    turned_away.push((Sink::Quic(peer, to.out.clone()), frame));
                }
            }
            Some(Remote::Gone { peer, .. }) => service.forget(peer),
            None => *remote = None,
        },
        () = tokio::time::sleep(std::time::Duration::from_millis(10)) => {}
    }
    endpoint.pump();
    while let Some(event) = endpoint.poll_event() {
        match event {
            EndpointEvent::Hub(HubEvent::ConnectRequest(req)) => {
                endpoint.refuse(req, SHUTTING_DOWN);
            }
            EndpointEvent::Hub(HubEvent::Frame { peer, frame })
                if service.peers.contains_key(&peer) =>
            {
                turned_away.push((Sink::Rudp(peer), frame));
            }
            EndpointEvent::Hub(HubEvent::Disconnected { peer, .. }) => service.forget(peer),
            EndpointEvent::SendFailed { peer, error } => {
                tracing::debug!(%peer, "answer not sent while stopping: {error}");
            }
            _ => {}
        }
    }
    for (sink, frame) in turned_away {
        for answer in service.retry_later(&frame, format!("{SHUTTING_DOWN}; retry later")) {
            if let Answer::Reply(bytes) = answer {
                let _ = sink.send(endpoint, bytes);
            }
        }
    }
    endpoint.flush().await;
}

/// Takes one endpoint event.
fn endpoint_event(
    service: &mut Service,
    endpoint: &mut Endpoint,
    event: EndpointEvent,
    out: &mut Vec<(Sink, Answer)>,
) {
    let event = match event {
        EndpointEvent::Hub(e) => e,
        EndpointEvent::SendFailed { peer, error } => {
            if matches!(error, wire::error::SendError::QueueFull { .. })
                && service.peers.contains_key(&peer)
            {
                // A client that does not read its answers holds our memory: cut it off.
                service.count_cut_off("unread");
                tracing::warn!(%peer, "CultNet client cut off: it does not read its answers");
                service.forget(peer);
                endpoint.disconnect(peer, "too many answers unread (send queue full)");
                return;
            }
            tracing::warn!(%peer, "answer not sent: {error}");
            return;
        }
        EndpointEvent::AcceptNotApplied { peer, error } => {
            // The record it left was dealt with where the verdict was made (below).
            tracing::debug!(%peer, "CultNet Connect not accepted: {error}");
            return;
        }
    };
    match event {
        HubEvent::ConnectRequest(req) => {
            let now = u64::try_from(crate::clock::unix_ms()).unwrap_or(0);
            let peer = req.peer;
            match service.authenticate(peer, &req.payload, now) {
                Ok(_) => endpoint.accept(req),
                Err(why) => endpoint.refuse(req, &why.to_string()),
            }
            // One rule for every verdict, since verdicts are applied as they are made: if no
            // session is open for the address now, no record of a peer stays. That covers an
            // accept that came too late (`Expired`) or found every slot taken (`Full`), one
            // superseded by a newer Connect waiting from the same address (whose own event
            // comes later and authenticates afresh), and a refusal after an earlier Connect's
            // record was left by a superseded accept. Otherwise the record would count as a
            // peer until a Connect from that address succeeded.
            if !endpoint.has_session(peer) {
                service.forget(peer);
            }
        }
        HubEvent::Frame { peer, frame } => {
            let sink = Sink::Rudp(peer);
            for answer in service.handle(peer, &frame) {
                out.push((sink.clone(), answer));
            }
        }
        HubEvent::Disconnected { peer, reason } => {
            tracing::debug!(%peer, ?reason, "CultNet session ended");
            service.forget(peer);
        }
        HubEvent::Connected { .. } | HubEvent::Pong { .. } => {}
    }
}

/// Cuts off a QUIC peer that does not read its answers, as an RUDP one with a full send queue
/// is: forgotten, counted, and its connection closed with the reason.
fn cut_off_quic(service: &mut Service, quic: &mut HashMap<SocketAddr, QuicPeer>, peer: SocketAddr) {
    // Later answers of the same round find it gone already.
    let Some(gone) = quic.remove(&peer) else {
        return;
    };
    service.count_cut_off("unread");
    service.forget(peer);
    if gone.out.cut() {
        tracing::warn!(%peer, "CultNet QUIC client cut off: it does not read its answers");
    }
}

fn remote_event(
    service: &mut Service,
    quic: &mut HashMap<SocketAddr, QuicPeer>,
    event: Remote,
    out: &mut Vec<(Sink, Answer)>,
) {
    match event {
        Remote::Connect {
            peer,
            payload,
            id,
            out,
            verdict,
        } => {
            let now = u64::try_from(crate::clock::unix_ms()).unwrap_or(0);
            match service.authenticate(peer, &payload, now) {
                Ok(_) => {
                    quic.insert(peer, QuicPeer { id, out });
                    let _ = verdict.send(Ok(()));
                }
                Err(why) => {
                    let _ = verdict.send(Err(why.to_string()));
                }
            }
        }
        Remote::Frame { peer, payload } => {
            let Some(to) = quic.get(&peer) else { return };
            let sink = Sink::Quic(peer, to.out.clone());
            let frame = Frame {
                channel: Arc::from(CHANNEL),
                payload,
            };
            for answer in service.handle(peer, &frame) {
                if matches!(answer, Answer::Disconnect(_)) {
                    // Dropping its sender ends its writer, which closes the connection.
                    quic.remove(&peer);
                }
                out.push((sink.clone(), answer));
            }
        }
        Remote::Gone { peer, id } => {
            if quic.get(&peer).is_some_and(|p| p.id == id) {
                if quic.remove(&peer).is_some_and(|p| p.out.was_cut()) {
                    // Cut off by a send's or verb's task, which cannot reach the stats: the
                    // loop's own cut-offs remove the record at once and never get here.
                    service.count_cut_off("unread");
                }
                service.forget(peer);
            }
        }
    }
}

/// Where the loop runs the answers that wait (sends, verbs, read receipts), and what it knows
/// of them: a send takes one of [`MAX_SENDS_IN_FLIGHT`] permits; every send and verb holds a
/// clone of `running` until its answer is queued, so a stopping loop can wait for them.
struct Tasks {
    runtime: tokio::runtime::Handle,
    sends: Arc<tokio::sync::Semaphore>,
    running: Arc<()>,
}

impl Tasks {
    /// Sends and verbs whose answers are not queued yet.
    fn answering(&self) -> usize {
        Arc::strong_count(&self.running) - 1
    }
}

/// Carries out one answer: queued at once, or handed to a task of its own (a send, a verb).
fn run_answer(
    runtime_id: &str,
    tasks: &Tasks,
    endpoint: &mut Endpoint,
    sink: &Sink,
    answer: Answer,
    flushed: bool,
) -> Result<(), Unread> {
    match answer {
        Answer::Reply(bytes) => return sink.send(endpoint, bytes),
        Answer::AfterFlush { ok, failed } => {
            return sink.send(endpoint, if flushed { ok } else { failed });
        }
        Answer::Disconnect(reason) => match sink {
            // Its last answers (the refusals that told it) go first.
            Sink::Rudp(peer) => endpoint.finish(*peer, &reason),
            Sink::Quic(..) => {} // Its sender was dropped with the peer.
        },
        Answer::Send {
            record_key,
            request,
            mouth,
            slot,
        } => {
            let Ok(permit) = tasks.sends.clone().try_acquire_owned() else {
                // Back-pressure instead of an unbounded pile of tasks; `failed` = retry later.
                let receipt = SendReceipt {
                    request_id: request.request_id,
                    status: Status::Failed,
                    error: Some(format!(
                        "{MAX_SENDS_IN_FLIGHT} sends are in flight; retry later"
                    )),
                    ..SendReceipt::default()
                };
                let bytes = receipt_bytes(runtime_id, ids::SEND_RECEIPT, &record_key, &receipt);
                return sink.send(endpoint, bytes);
            };
            let sink = sink.detach(endpoint);
            let runtime_id = runtime_id.to_owned();
            let running = tasks.running.clone();
            tasks.runtime.spawn(async move {
                let receipt = mouth.send(&request).await;
                drop(permit);
                drop(slot);
                let bytes = receipt_bytes(&runtime_id, ids::SEND_RECEIPT, &record_key, &receipt);
                sink.send(bytes).await;
                // Held (and moved in) until the answer is queued: see `Tasks::answering`.
                drop(running);
            });
        }
        Answer::Control {
            record_key,
            request,
            receipt,
            slot,
        } => {
            let sink = sink.detach(endpoint);
            let runtime_id = runtime_id.to_owned();
            let running = tasks.running.clone();
            tasks.runtime.spawn(async move {
                let receipt = receipt.await.unwrap_or_else(|_| ControlReceipt {
                    persona: request.persona,
                    action: request.action,
                    status: Status::Failed,
                    error: Some("her turn loop stopped before applying it".into()),
                    ..ControlReceipt::default()
                });
                drop(slot);
                let bytes = receipt_bytes(&runtime_id, ids::CONTROL_RECEIPT, &record_key, &receipt);
                sink.send(bytes).await;
                drop(running);
            });
        }
        Answer::ReadReceipt {
            mouth,
            room_id,
            event_id,
        } => {
            tasks
                .runtime
                .spawn(async move { mouth.read_receipt(&room_id, &event_id).await });
        }
    }
    Ok(())
}

/// The settings of the hub under the service: the per-client memory a client can make the
/// gateway hold (its send queue, its half-received requests), kept well below the protocol's
/// defaults, which are sized for media peers.
pub fn hub_config() -> wire::hub::HubConfig {
    let mut cfg = wire::hub::HubConfig::default();
    // A page is at most MAX_REPLY_BYTES; requests are far smaller (a note is 16 KiB at most).
    cfg.session.max_payload = MAX_REPLY_BYTES as usize + 64 * 1024;
    cfg.session.max_reassembly_bytes = cfg.session.max_payload + 64 * 1024;
    cfg.session.max_held_bytes = 1024 * 1024;
    cfg.session.max_queued_bytes = 2 * MAX_REPLY_BYTES as usize;
    cfg
}

/// The running service: its endpoint's address, and a way to wait for its end.
#[derive(Debug)]
pub struct Started {
    /// The endpoint (its address; commands such as stats).
    pub endpoint: EndpointHandle,
    /// Told when the service thread ends.
    pub done: tokio::sync::oneshot::Receiver<()>,
}

/// Starts the endpoint on `bind` and the service loop on a thread of their own (see the module
/// docs); sends, verbs and read receipts run on the calling runtime. Stops when `stop` turns
/// true.
pub async fn start(
    bind: SocketAddr,
    seed: u64,
    service: Service,
    remote: Option<mpsc::Receiver<Remote>>,
    updates: Option<mpsc::Receiver<Update>>,
    stop: watch::Receiver<bool>,
) -> Result<Started, crate::endpoint::EndpointError> {
    let service = service.with_tasks(tokio::runtime::Handle::current());
    let (ready_tx, ready_rx) = tokio::sync::oneshot::channel();
    let (done_tx, done) = tokio::sync::oneshot::channel();
    let thread = std::thread::Builder::new()
        .name("cultnet-service".into())
        .spawn(move || {
            let rt = match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(rt) => rt,
                Err(e) => {
                    let _ = ready_tx.send(Err(crate::endpoint::EndpointError::Bind {
                        addr: bind,
                        source: e,
                    }));
                    return;
                }
            };
            rt.block_on(async move {
                let mut cfg = crate::endpoint::EndpointConfig::new(bind, seed);
                cfg.hub = hub_config();
                match Endpoint::bind(cfg).await {
                    Ok(endpoint) => {
                        let _ = ready_tx.send(Ok(endpoint.handle()));
                        // A task of its own, not the block_on future: a block_on future woken
                        // by I/O costs the runtime an extra non-blocking epoll_wait per round.
                        let serving =
                            tokio::spawn(serve_updating(service, endpoint, remote, updates, stop));
                        if let Err(e) = serving.await {
                            tracing::error!("CultNet service loop ended abnormally: {e}");
                        }
                    }
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                    }
                }
            });
            let _ = done_tx.send(());
        });
    if let Err(e) = thread {
        return Err(crate::endpoint::EndpointError::Bind {
            addr: bind,
            source: e,
        });
    }
    let endpoint = ready_rx
        .await
        .map_err(|_| crate::endpoint::EndpointError::Stopped)??;
    Ok(Started { endpoint, done })
}

#[cfg(test)]
mod tests;
