//! Many peers on one socket: one [`Session`] per remote address, all sharing the service's
//! connection id.
//!
//! The calling contract is the session's: after every input ([`Hub::handle`], commands,
//! [`Hub::handle_timeout`]) drain [`Hub::poll_transmit`], then [`Hub::poll_event`], then read
//! [`Hub::poll_timeout`]. A Connect from a new address is not a session yet: it comes out as
//! [`HubEvent::ConnectRequest`] and the owner answers with [`Hub::accept`] or [`Hub::refuse`].
//!
//! # Rules
//! - The connection id is checked right after the (stateless) decode, before any state is read.
//! - A retransmitted Connect (same sequence and payload) is answered with the same Accept bytes,
//!   or an Ack once the Accept was acknowledged; a Connect with a new payload or sequence
//!   replaces the session ([`HubEvent::Disconnected`] with `Replaced`, then a new request).
//! - Admission has two quotas. At most `max_peers` sessions: a Connect beyond them gets a
//!   Disconnect (`server full`). Apart from those, at most `max_pending` Connects wait for the
//!   owner's answer, each for at most `pending_timeout`; when that quota is full the OLDEST
//!   waiting Connect is dropped (silently, counted) to make room. So Connects sprayed from many
//!   addresses can neither take session slots nor hold the waiting room.
//! - The waiting room only dedupes resent Connects and bounds the hub's memory: the verdict
//!   does not depend on it. Each [`ConnectRequest`] carries what answering it needs, so an
//!   owner that lags behind a flood (its events queued behind many Connects) still accepts a
//!   real client whose waiting Connect was evicted meanwhile, as long as it answers within
//!   `pending_timeout` of the Connect's arrival and no newer Connect from that address came.
//! - A Connect payload larger than `max_connect_payload` is refused at once (credentials are a
//!   few hundred bytes): whatever the owner has not yet answered costs at most that each.
//! - Each session bounds its own memory (see [`SessionConfig`]), so the hub's memory is bounded
//!   by `max_peers` times that plus `max_pending` Connect payloads, whatever arrives.

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::time::Instant;

use bytes::Bytes;

use crate::error::{CloseReason, SendError};
use crate::packet::{Flags, Fragment, Header, Packet, PacketType, CONTROL_CHANNEL};
use crate::session::{Frame, Role, Session, SessionConfig, SessionEvent, SessionStats};

/// Hub tunables.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HubConfig {
    /// Applied to every session.
    pub session: SessionConfig,
    /// Sessions (accepted peers), at most.
    pub max_peers: usize,
    /// Connects waiting for the owner's answer, at most (separate from `max_peers`); when full,
    /// the oldest waiting one is dropped for the newcomer.
    pub max_pending: usize,
    /// A Connect the owner has not answered within this is forgotten, and a verdict given later
    /// than this after its arrival no longer opens a session (the client has given up).
    pub pending_timeout: std::time::Duration,
    /// Largest Connect payload (credentials); a larger one is refused without the owner.
    pub max_connect_payload: usize,
    /// Raw answers (refusals) waiting to go out, at most; more are dropped.
    pub max_raw_queue: usize,
}

impl Default for HubConfig {
    fn default() -> Self {
        Self {
            session: SessionConfig::default(),
            max_peers: 256,
            max_pending: 64,
            pending_timeout: std::time::Duration::from_secs(2),
            max_connect_payload: 4096,
            max_raw_queue: 256,
        }
    }
}

/// What the hub reports.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HubEvent {
    /// A new peer asks to connect with these credentials: call [`Hub::accept`] or
    /// [`Hub::refuse`] with it.
    ConnectRequest(ConnectRequest),
    /// A session's handshake completed.
    Connected {
        /// The peer.
        peer: SocketAddr,
        /// The Accept's payload (what the server sent with it; empty on the server's side).
        accept: Bytes,
    },
    /// A frame arrived.
    Frame {
        /// From whom.
        peer: SocketAddr,
        /// What.
        frame: Frame,
    },
    /// A Pong arrived.
    Pong {
        /// From whom.
        peer: SocketAddr,
        /// The echoed payload.
        payload: Bytes,
    },
    /// A session ended (not reported for [`Hub::disconnect`]).
    Disconnected {
        /// The peer.
        peer: SocketAddr,
        /// Why.
        reason: CloseReason,
    },
}

/// Hub-wide counters. `sessions` sums every session's counters, ended ones included.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HubStats {
    /// Datagrams that are not CNR0 packets.
    pub malformed: u64,
    /// Packets with another service's connection id.
    pub wrong_connection_id: u64,
    /// Non-Connect packets from addresses without a session.
    pub unknown_peer: u64,
    /// Connects refused by the owner.
    pub refused: u64,
    /// Connects turned away because `max_peers` was reached.
    pub peers_full: u64,
    /// Sessions replaced by a new Connect from the same address.
    pub replaced: u64,
    /// Refusals dropped because the raw queue was full.
    pub raw_dropped: u64,
    /// Connects forgotten because the owner did not answer within the pending timeout.
    pub unanswered_connects: u64,
    /// Waiting Connects dropped to make room for a newer one (the pending quota was full).
    pub pending_evicted: u64,
    /// Connects refused because their payload exceeded `max_connect_payload`.
    pub oversized_connects: u64,
    /// Summed session counters.
    pub sessions: SessionStats,
}

/// Why a verdict on a Connect was not applied.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum HubError {
    /// The Connect arrived longer than `pending_timeout` ago: its client has given up.
    #[error("the connect from {0} waited too long for an answer")]
    Expired(SocketAddr),
    /// A newer Connect from that address replaced this one (it gets its own request).
    #[error("the connect from {0} was replaced by a newer one")]
    Superseded(SocketAddr),
    /// This Connect was accepted already (a second verdict on a resent Connect).
    #[error("the connect from {0} was accepted already")]
    AlreadyAccepted(SocketAddr),
    /// `max_peers` sessions exist: the client was told `server full`.
    #[error("no session slot left for {0}")]
    Full(SocketAddr),
}

/// A Connect waiting for the owner's verdict. It holds everything answering it needs, so the
/// verdict does not depend on the hub still holding its own copy (see the module docs).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConnectRequest {
    /// The peer's address.
    pub peer: SocketAddr,
    /// Its Connect payload (credentials), at most `max_connect_payload` bytes.
    pub payload: Bytes,
    /// When the Connect arrived.
    at: Instant,
    sequence: u32,
    flags: Flags,
}

impl ConnectRequest {
    /// Whether a Connect with this sequence and payload is this one (a resend carries both).
    fn is(&self, sequence: u32, payload: &[u8]) -> bool {
        self.sequence == sequence && self.payload[..] == *payload
    }
}

/// Whether `s` is the server session a Connect with this sequence and payload opened.
fn opened_by(s: &Session, sequence: u32, payload: &[u8]) -> bool {
    s.role() == Role::Server
        && s.connect_sequence() == sequence
        && s.connect_payload()[..] == *payload
}

#[derive(Debug)]
struct Entry {
    session: Session,
    /// Invariant: true iff the address is in `Hub::dirty`.
    queued: bool,
}

/// A many-peer CultNet endpoint without I/O (see the module docs).
#[derive(Debug)]
pub struct Hub {
    cfg: HubConfig,
    peers: HashMap<SocketAddr, Entry>,
    pending: HashMap<SocketAddr, ConnectRequest>,
    dirty: VecDeque<SocketAddr>,
    raw: VecDeque<(SocketAddr, Vec<u8>)>,
    events: VecDeque<HubEvent>,
    stats: HubStats,
    retired: SessionStats,
    rng: u64,
}

impl Hub {
    /// A hub; `seed` drives the random initial sequences (pass real randomness in production).
    pub fn new(cfg: HubConfig, seed: u64) -> Self {
        Self {
            cfg,
            peers: HashMap::new(),
            pending: HashMap::new(),
            dirty: VecDeque::new(),
            raw: VecDeque::new(),
            events: VecDeque::new(),
            stats: HubStats::default(),
            retired: SessionStats::default(),
            rng: seed | 1,
        }
    }

    /// The configuration.
    pub fn config(&self) -> &HubConfig {
        &self.cfg
    }

    /// Counters, session counters summed.
    pub fn stats(&self) -> HubStats {
        let mut s = self.stats;
        s.sessions = self.retired;
        for e in self.peers.values() {
            add(&mut s.sessions, &e.session.stats());
        }
        s
    }

    /// Number of sessions (any state).
    pub fn peer_count(&self) -> usize {
        self.peers.len()
    }

    /// Number of Connects waiting for the owner's answer.
    pub fn pending_count(&self) -> usize {
        self.pending.len()
    }

    /// The Connect from `peer` waiting for a verdict, if the waiting room still holds it.
    pub fn waiting(&self, peer: SocketAddr) -> Option<&ConnectRequest> {
        self.pending.get(&peer)
    }

    /// The session for `peer`, to read its state.
    pub fn session(&self, peer: SocketAddr) -> Option<&Session> {
        self.peers.get(&peer).map(|e| &e.session)
    }

    /// Addresses with a session.
    pub fn peers(&self) -> impl Iterator<Item = SocketAddr> + '_ {
        self.peers.keys().copied()
    }

    /// Feeds one datagram received from `from`.
    pub fn handle(&mut self, now: Instant, from: SocketAddr, datagram: &[u8]) {
        let Ok(p) = Packet::decode(datagram) else {
            self.stats.malformed += 1;
            return;
        };
        if p.connection_id != self.cfg.session.connection_id {
            self.stats.wrong_connection_id += 1;
            return;
        }
        if p.ptype == PacketType::Connect {
            self.on_connect(now, from, &p);
            return;
        }
        let Some(entry) = self.peers.get_mut(&from) else {
            self.stats.unknown_peer += 1;
            return;
        };
        entry.session.handle(now, &p);
        self.after(from);
    }

    /// Accepts a Connect: the session starts and its Accept goes out. Applied even if the
    /// waiting room evicted the hub's copy, unless the Connect is older than `pending_timeout`,
    /// a newer Connect from that address replaced it, it was accepted already, or `max_peers`
    /// sessions exist by now (then the client is told `server full`).
    pub fn accept(&mut self, now: Instant, req: &ConnectRequest) -> Result<(), HubError> {
        self.accept_with(now, req, Bytes::new())
    }

    /// [`Hub::accept`], the Accept carrying `payload` (e.g. the server's proof of its key, for
    /// clients that pinned it).
    pub fn accept_with(
        &mut self,
        now: Instant,
        req: &ConnectRequest,
        payload: Bytes,
    ) -> Result<(), HubError> {
        let peer = req.peer;
        self.take_pending(req)?;
        if let Some(e) = self.peers.get(&peer) {
            return Err(if opened_by(&e.session, req.sequence, &req.payload) {
                HubError::AlreadyAccepted(peer)
            } else {
                HubError::Superseded(peer)
            });
        }
        if now.saturating_duration_since(req.at) >= self.cfg.pending_timeout {
            return Err(HubError::Expired(peer));
        }
        if self.peers.len() >= self.cfg.max_peers {
            // Sessions filled up while this Connect waited: the quota holds.
            self.turn_away_full(peer);
            return Err(HubError::Full(peer));
        }
        let connect = Packet {
            ptype: PacketType::Connect,
            flags: req.flags,
            connection_id: self.cfg.session.connection_id,
            sequence: req.sequence,
            ack: 0,
            ack_mask: 0,
            fragment: Fragment::default(),
            channel: CONTROL_CHANNEL,
            payload: &req.payload,
        };
        let seq = self.initial_seq();
        let session = Session::accept_with(now, self.cfg.session.clone(), &connect, seq, payload);
        self.insert(peer, session);
        Ok(())
    }

    /// Refuses a Connect with a Disconnect carrying `reason` (even if the waiting room evicted
    /// it: its client learns why), unless that address has since connected again.
    pub fn refuse(&mut self, req: &ConnectRequest, reason: &str) -> Result<(), HubError> {
        self.take_pending(req)?;
        if self.peers.contains_key(&req.peer) {
            return Err(HubError::Superseded(req.peer));
        }
        self.stats.refused += 1;
        self.push_raw(req.peer, PacketType::Disconnect, reason.as_bytes());
        Ok(())
    }

    /// Removes the waiting copy of `req`, if there is one; a different Connect waiting from
    /// that address means `req` is stale.
    fn take_pending(&mut self, req: &ConnectRequest) -> Result<(), HubError> {
        match self.pending.get(&req.peer) {
            Some(p) if p.is(req.sequence, &req.payload) => {
                self.pending.remove(&req.peer);
                Ok(())
            }
            Some(_) => Err(HubError::Superseded(req.peer)),
            None => Ok(()),
        }
    }

    /// Opens a client session to `peer` with `payload` as credentials (replacing any session
    /// with that address).
    pub fn connect(&mut self, now: Instant, peer: SocketAddr, payload: Bytes) {
        if let Some(mut old) = self.peers.remove(&peer) {
            old.session.close("replaced");
            add(&mut self.retired, &old.session.stats());
        }
        let seq = self.initial_seq();
        let session = Session::connect(now, self.cfg.session.clone(), payload, seq);
        self.insert(peer, session);
    }

    /// Sends a frame to `peer` on `channel` (delivery by channel name).
    pub fn send(
        &mut self,
        now: Instant,
        peer: SocketAddr,
        channel: &str,
        payload: Bytes,
    ) -> Result<(), SendError> {
        let entry = self.peers.get_mut(&peer).ok_or(SendError::UnknownPeer)?;
        entry.session.send(now, channel, payload)?;
        self.after(peer);
        Ok(())
    }

    /// Pings `peer`.
    pub fn ping(&mut self, peer: SocketAddr, payload: &[u8]) -> Result<(), SendError> {
        let entry = self.peers.get_mut(&peer).ok_or(SendError::UnknownPeer)?;
        entry.session.ping(payload);
        self.after(peer);
        Ok(())
    }

    /// Closes the session with `peer`, sending a Disconnect with `reason`.
    pub fn disconnect(&mut self, peer: SocketAddr, reason: &str) {
        if let Some(e) = self.peers.get_mut(&peer) {
            e.session.close(reason);
            self.after(peer);
        }
    }

    /// Closes the session with `peer` once what is queued for it is delivered (see
    /// [`Session::finish`]): a peer sent away still reads the answers it was given first.
    pub fn finish(&mut self, now: Instant, peer: SocketAddr, reason: &str) {
        if let Some(e) = self.peers.get_mut(&peer) {
            e.session.finish(now, reason);
            self.after(peer);
        }
    }

    /// Runs every session's timers, and forgets Connects the owner left unanswered for longer
    /// than the pending timeout (so they cannot hold the waiting room).
    pub fn handle_timeout(&mut self, now: Instant) {
        let limit = self.cfg.pending_timeout;
        let before = self.pending.len();
        self.pending.retain(|_, p| now < p.at + limit);
        self.stats.unanswered_connects += (before - self.pending.len()) as u64;
        let due: Vec<SocketAddr> = self
            .peers
            .iter()
            .filter(|(_, e)| e.session.poll_timeout().is_some_and(|t| t <= now))
            .map(|(a, _)| *a)
            .collect();
        for peer in due {
            if let Some(e) = self.peers.get_mut(&peer) {
                e.session.handle_timeout(now);
            }
            self.after(peer);
        }
    }

    /// Writes the next datagram into `buf` (appending) and returns its destination, or `None`.
    pub fn poll_transmit(&mut self, now: Instant, buf: &mut Vec<u8>) -> Option<SocketAddr> {
        if let Some((to, bytes)) = self.raw.pop_front() {
            buf.extend_from_slice(&bytes);
            return Some(to);
        }
        while let Some(peer) = self.dirty.pop_front() {
            let Some(e) = self.peers.get_mut(&peer) else {
                continue;
            };
            if e.session.poll_transmit(now, buf) {
                if e.session.wants_transmit() {
                    self.dirty.push_back(peer);
                } else {
                    e.queued = false;
                    self.reap(peer);
                }
                return Some(peer);
            }
            e.queued = false;
            self.reap(peer);
        }
        None
    }

    /// Whether an event is waiting for [`poll_event`](Self::poll_event).
    pub fn has_events(&self) -> bool {
        !self.events.is_empty()
    }

    /// The next event, if any.
    pub fn poll_event(&mut self) -> Option<HubEvent> {
        self.events.pop_front()
    }

    /// The earliest session timer (or pending-Connect expiry).
    pub fn poll_timeout(&self) -> Option<Instant> {
        let limit = self.cfg.pending_timeout;
        let sessions = self.peers.values().filter_map(|e| e.session.poll_timeout());
        let pending = self.pending.values().map(|p| p.at + limit);
        sessions.chain(pending).min()
    }

    fn on_connect(&mut self, now: Instant, from: SocketAddr, p: &Packet<'_>) {
        if let Some(e) = self.peers.get_mut(&from) {
            if opened_by(&e.session, p.sequence, p.payload) && e.session.close_reason().is_none() {
                e.session.handle(now, p);
                self.after(from);
                return;
            }
            let old = self.peers.remove(&from).map(|e| e.session);
            if let Some(old) = old {
                add(&mut self.retired, &old.stats());
                if old.close_reason().is_none() {
                    self.stats.replaced += 1;
                    self.events.push_back(HubEvent::Disconnected {
                        peer: from,
                        reason: CloseReason::Replaced,
                    });
                }
            }
        }
        if let Some(pending) = self.pending.get(&from) {
            if pending.is(p.sequence, p.payload) {
                return; // Still waiting for the owner's answer.
            }
            self.pending.remove(&from);
        }
        if p.payload.len() > self.cfg.max_connect_payload {
            self.stats.oversized_connects += 1;
            self.push_raw(from, PacketType::Disconnect, b"connect payload too large");
            return;
        }
        if self.peers.len() >= self.cfg.max_peers {
            self.turn_away_full(from);
            return;
        }
        if self.pending.len() >= self.cfg.max_pending.max(1) {
            // The oldest waiter makes room: a flood cannot hold the waiting room, and a real
            // client whose Connect was dropped resends it.
            let oldest = self
                .pending
                .iter()
                .min_by_key(|(_, p)| p.at)
                .map(|(a, _)| *a);
            if let Some(oldest) = oldest {
                self.pending.remove(&oldest);
                self.stats.pending_evicted += 1;
            }
        }
        let req = ConnectRequest {
            peer: from,
            payload: Bytes::copy_from_slice(p.payload),
            at: now,
            sequence: p.sequence,
            flags: p.flags,
        };
        self.pending.insert(from, req.clone());
        self.events.push_back(HubEvent::ConnectRequest(req));
    }

    fn insert(&mut self, peer: SocketAddr, session: Session) {
        self.peers.insert(
            peer,
            Entry {
                session,
                queued: false,
            },
        );
        self.after(peer);
    }

    /// Moves a session's events out and queues it for transmit if it has something to send.
    fn after(&mut self, peer: SocketAddr) {
        let Some(e) = self.peers.get_mut(&peer) else {
            return;
        };
        while let Some(ev) = e.session.poll_event() {
            self.events.push_back(match ev {
                SessionEvent::Connected => HubEvent::Connected {
                    peer,
                    accept: match e.session.role() {
                        Role::Client => e.session.accept_payload().clone(),
                        Role::Server => Bytes::new(),
                    },
                },
                SessionEvent::Frame(frame) => HubEvent::Frame { peer, frame },
                SessionEvent::Pong(payload) => HubEvent::Pong { peer, payload },
                SessionEvent::Disconnected(reason) => HubEvent::Disconnected { peer, reason },
            });
        }
        if e.session.wants_transmit() {
            if !e.queued {
                e.queued = true;
                self.dirty.push_back(peer);
            }
        } else if !e.queued {
            self.reap(peer);
        }
    }

    /// Forgets a closed session once it has nothing left to send.
    fn reap(&mut self, peer: SocketAddr) {
        let closed = self
            .peers
            .get(&peer)
            .is_some_and(|e| e.session.close_reason().is_some() && !e.session.wants_transmit());
        if closed {
            if let Some(e) = self.peers.remove(&peer) {
                add(&mut self.retired, &e.session.stats());
            }
        }
    }

    /// Tells `peer` there is no session slot for it (`max_peers` reached).
    fn turn_away_full(&mut self, peer: SocketAddr) {
        self.stats.peers_full += 1;
        self.push_raw(peer, PacketType::Disconnect, b"server full");
    }

    fn push_raw(&mut self, to: SocketAddr, ptype: PacketType, payload: &[u8]) {
        if self.raw.len() >= self.cfg.max_raw_queue {
            self.stats.raw_dropped += 1;
            return;
        }
        let mut bytes = Vec::new();
        let _ = crate::packet::encode_parts(
            &mut bytes,
            Header {
                ptype,
                flags: Flags(0),
                connection_id: self.cfg.session.connection_id,
                sequence: 0,
                ack: 0,
                ack_mask: 0,
                fragment: Fragment::default(),
            },
            CONTROL_CHANNEL,
            &[&payload[..payload.len().min(1024)]],
        );
        self.raw.push_back((to, bytes));
    }

    /// A random initial sequence in `[1, 2^31)` (xorshift64*).
    fn initial_seq(&mut self) -> u32 {
        self.rng ^= self.rng >> 12;
        self.rng ^= self.rng << 25;
        self.rng ^= self.rng >> 27;
        let r = self.rng.wrapping_mul(0x2545_F491_4F6C_DD1D);
        ((r >> 33) as u32 % 0x7FFF_FFFF) + 1
    }
}

fn add(total: &mut SessionStats, s: &SessionStats) {
    total.packets_in += s.packets_in;
    total.packets_out += s.packets_out;
    total.frames_in += s.frames_in;
    total.frames_out += s.frames_out;
    total.duplicates += s.duplicates;
    total.resends += s.resends;
    total.expired += s.expired;
    total.out_of_window += s.out_of_window;
    total.invalid += s.invalid;
    total.stale += s.stale;
    total.memory_drops += s.memory_drops;
    total.reassembly_expired += s.reassembly_expired;
    total.unreliable_dropped += s.unreliable_dropped;
    total.holes_skipped += s.holes_skipped;
    total.late_after_skip += s.late_after_skip;
}
