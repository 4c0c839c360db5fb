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

mod auth;
mod control;
pub mod limits;
mod mail;
mod minds;
pub mod owner;
mod receipts;
mod remote;
mod run;
mod status;

use auth::pinned;
pub use auth::{server_key, Refusal, MAX_NONCES_PER_AGENT, NOT_ADMITTED};
pub use limits::ClientLimits;
use limits::{Budget, RefusalLog, Verdict, VerifyBudget};
pub use mail::{owned_request_id, reserved_prefix, RESERVED_PREFIXES};
use receipts::error;
pub use receipts::{message_id, receipt_bytes, rfc3339};
pub use remote::Remote;
use remote::{cut_off_quic, remote_event, QuicPeer, Sink, Unread};
pub use run::{hub_config, serve, serve_updating, serve_with, start, Started, Update, DRAIN};

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
        /// The request, its request id made the client's own ([`owned_request_id`]).
        request: wire::docs::SendRequest,
        /// The request id as the client gave it, for its receipt.
        client_request_id: String,
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
    /// The local user whose socket opened the session (loopback RUDP; `None`: over QUIC, or
    /// the socket table could not be read).
    uid: Option<u32>,
    /// When its owner was last found unchanged ([`owner::RECHECK`]).
    owner_checked: std::time::Instant,
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
    /// Nonces remembered per agent (each agent has its own quota of them).
    nonce_counts: HashMap<String, usize>,
    /// Each agent's quota ([`MAX_NONCES_PER_AGENT`]).
    nonce_quota: usize,
    /// Each address's budget of signature checks.
    verifies: VerifyBudget,
    stats: ServiceStats,
    limits: ClientLimits,
    /// Where Connects, peers and limits are counted.
    metrics: Arc<crate::metrics::Metrics>,
    /// The gateway's own key, whose proof its Accepts carry.
    server_key: Option<ed25519_dalek::SigningKey>,
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
        let max_skew_ms = max_skew_secs.saturating_mul(1000);
        // The nonces used before a restart that are still within the time window: their
        // payloads must not get in again.
        let since = u64::try_from(crate::clock::unix_ms())
            .unwrap_or(0)
            .saturating_sub(max_skew_ms.saturating_mul(2));
        let (mut nonces, mut nonce_counts) = (HashMap::new(), HashMap::new());
        match inbox.recent_nonces(since) {
            Ok(kept) => {
                for (agent, nonce, at, from) in kept {
                    *nonce_counts.entry(agent.clone()).or_default() += 1;
                    let from = from.unwrap_or_else(|| SocketAddr::from(([0, 0, 0, 0], 0)));
                    nonces.insert((agent, nonce), (at, from));
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "connect nonces of the last run not read: their payloads could be replayed")
            }
        }
        Self {
            runtime_id: runtime_id.to_owned(),
            started_at: rfc3339(crate::clock::unix_ms()),
            connection_id,
            max_skew_ms,
            inbox,
            clients,
            ports,
            peers: HashMap::new(),
            agents: HashMap::new(),
            greeted: Default::default(),
            nonces,
            nonce_counts,
            nonce_quota: MAX_NONCES_PER_AGENT,
            verifies: VerifyBudget::default(),
            stats: ServiceStats::default(),
            limits: ClientLimits::default(),
            metrics: crate::metrics::unserved(),
            server_key: None,
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

    /// Signs its Accepts with the gateway's key (`STATE/cultnet/server.key`), so that clients
    /// that pinned it know they reached the gateway ([`wire::docs::ServerProof`]).
    pub fn with_server_key(mut self, key: ed25519_dalek::SigningKey) -> Self {
        self.server_key = Some(key);
        self
    }

    /// The Accept payload for a Connect carrying `connect_payload`: the server's proof, or
    /// nothing without a key.
    pub fn accept_payload(&self, connect_payload: &[u8]) -> Bytes {
        self.server_key.as_ref().map_or_else(Bytes::new, |k| {
            Bytes::from(
                wire::docs::ServerProof::sign(k, self.connection_id, connect_payload).encode(),
            )
        })
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
            tracing::debug!(%peer, channel = ?frame.channel, "frame on another channel ignored");
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
                    tracing::debug!(%peer, runtime = ?h.runtime_id, "repeated hello not answered");
                    return Vec::new();
                }
                vec![Answer::Reply(Bytes::from(
                    Message::Hello(wire::docs::gateway_hello(&self.runtime_id)).encode(),
                ))]
            }
            // Never answered, for the same reason.
            Message::Error(e) => {
                tracing::warn!(%peer, %agent, error = ?e.error, "client reports an error");
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
            tracing::warn!(%agent, record = ?key, why = ?why, "request refused");
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
            Request::Pending(r) => self.pending_page(&key, r),
            Request::Ack(r) => self.ack(&key, r),
            Request::Send(r) => self.send(agent, key, r, in_flight),
            Request::Turn(r) => self.turn(agent, &key, r),
            Request::Status(r) => self.status_request(agent, &key, r),
            Request::Note(r) => self.note(&key, r),
            Request::Control(r) => self.control(&key, r, in_flight),
            Request::ExtensionPending(r) => self.extension_page(&key, r),
            Request::ExtensionAck(r) => self.extension_ack(&key, r),
            _ => vec![error(format!("request {key:?}: not supported"))],
        }
    }
}

#[cfg(test)]
mod tests;
