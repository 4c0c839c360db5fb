//! One peer session under the newer CultNet session rules, tolerant of older peers.
//!
//! A [`Session`] never touches a socket or a clock. The caller feeds it decoded packets with
//! [`Session::handle`], application frames with [`Session::send`], and the time with
//! [`Session::handle_timeout`]; it drains, in this order after every input:
//! 1. [`Session::poll_transmit`] until it returns false (datagrams to send),
//! 2. [`Session::poll_event`] until `None` (frames, connection changes),
//! 3. [`Session::poll_timeout`] (when to call `handle_timeout` next).
//!
//! Time must never go backwards between calls; extra `handle_timeout` calls are harmless.
//! Once closed, a session stays closed ([`Session::close_reason`]) but can still emit its one
//! Disconnect packet.
//!
//! # Rules it follows
//! Only reliable packets consume the sequence counter (random initial value); Ack, Ping, Pong
//! and unreliable packets carry 0, `latest` frames a per-channel counter from 1. Reliable
//! packets are deduplicated by a 4096-sequence window above a received-through watermark and
//! acknowledged every time they arrive, duplicates and held-back ones included: an Ack names the
//! packet, its mask the 32 before it; every outgoing packet also carries the highest sequence
//! received. Ordered frames wait behind gaps in the one reliable sequence. At most `window`
//! reliable packets are in flight; more queue. A packet is resent when three packets sent after
//! it are acknowledged (fast retransmit) or its adaptive timer (SRTT + 4 RTTVAR, doubled per
//! resend) fires; at most `window` packets are ever outstanding, which paces resends.
//!
//! # Older peers
//! A peer whose Ack, Ping, Pong or unreliable packets carry non-zero sequences follows the older
//! rules (one counter for every packet). Its non-reliable sequences fill the gaps they leave in
//! our view of its reliable sequence, and a gap no resend will ever fill (its lost ack) is
//! skipped after `legacy_hole_timeout`. Towards it this side keeps to what that peer can take
//! (cultnet-rs at 402f6e7, read and run):
//! - controls (Ack, Ping, Pong, Disconnect) carry sequence 0: its ordered delivery waits for the
//!   exact next sequence of a channel and never skips one, so a control taking a number between
//!   two `schema` frames would hold every later frame forever; it checks duplicates on Data
//!   only, so repeated 0s are harmless. Unreliable Data still takes numbers (it would drop
//!   repeated 0s as duplicates).
//! - a fragment set has at most [`OLDER_PEER_MAX_FRAGMENTS`] fragments (larger fragments
//!   instead, up to a datagram), and once started goes out whole past the send window: that
//!   peer acknowledges only when it delivers a whole frame, naming its newest packet and the
//!   32 before it, and has no send window; a larger set, or one cut by our window, would wait
//!   for an ack it never sends, and part of it would never be acknowledged.

mod config;
mod reasm;
mod recv;
pub(crate) mod seq;

pub use config::*;

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;

use crate::error::{CloseReason, SendError};
use crate::packet::{self, Flags, Fragment, Header, Packet, PacketType, CONTROL_CHANNEL};
use reasm::{FragError, Reassembly};
use recv::{Class, Recv};

/// One application frame received from the peer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Frame {
    /// The channel it came on.
    pub channel: Arc<str>,
    /// Its bytes (reassembled when it was fragmented).
    pub payload: Bytes,
}

/// What a session reports to its owner.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SessionEvent {
    /// The handshake completed.
    Connected,
    /// A frame arrived.
    Frame(Frame),
    /// A Pong arrived, echoing this payload.
    Pong(Bytes),
    /// The session ended (not reported for [`Session::close`], which the owner asked for).
    Disconnected(CloseReason),
}

/// How a frame travels; by default chosen from the channel name ([`Delivery::for_channel`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Delivery {
    /// Resent until acked, delivered in order (`schema`).
    ReliableOrdered,
    /// Resent until acked or until `expire_after`, delivered on arrival (`media`).
    Reliable {
        /// Give up after this long (needs the peer's abandon capability).
        expire_after: Option<Duration>,
    },
    /// Sent once; older frames than the newest delivered are dropped (`latest`).
    Sequenced,
    /// Sent once, delivered on arrival (`realtime` and any other name).
    Unreliable,
}

impl Delivery {
    /// The rule each known channel follows: `schema` reliable+ordered, `latest`
    /// unreliable+sequenced, `realtime` unreliable, `media` reliable with expiry; anything else
    /// unreliable.
    pub fn for_channel(channel: &str, cfg: &SessionConfig) -> Self {
        match channel {
            "schema" => Self::ReliableOrdered,
            "latest" => Self::Sequenced,
            "media" => Self::Reliable {
                expire_after: Some(cfg.media_expiry),
            },
            _ => Self::Unreliable,
        }
    }

    fn flags(self) -> u8 {
        match self {
            Self::ReliableOrdered => Flags::RELIABLE | Flags::ORDERED,
            Self::Reliable { .. } => Flags::RELIABLE,
            Self::Sequenced => Flags::SEQUENCED,
            Self::Unreliable => 0,
        }
    }
}

/// Which end of the handshake this session is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// Sent the Connect.
    Client,
    /// Answered with an Accept.
    Server,
}

/// Which generation of session rules the peer follows (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PeerRules {
    /// Only reliable packets are sequenced (assumed until the peer shows otherwise).
    Newer,
    /// Every packet is sequenced from one counter.
    Older,
}

/// Where the handshake stands.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum State {
    /// Client: Connect sent, no Accept yet.
    Connecting,
    /// Server: Accept sent, not yet acknowledged.
    Accepting,
    /// Both sides agree the session is open.
    Connected,
    /// Ended, for this reason.
    Closed(CloseReason),
}

/// Counters for one session; the hub sums them over its peers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SessionStats {
    /// Packets handed to [`Session::handle`].
    pub packets_in: u64,
    /// Datagrams produced by [`Session::poll_transmit`].
    pub packets_out: u64,
    /// Frames delivered to the owner.
    pub frames_in: u64,
    /// Frames accepted by [`Session::send`].
    pub frames_out: u64,
    /// Reliable packets that arrived again (re-acked, not redelivered).
    pub duplicates: u64,
    /// Reliable packets sent more than once.
    pub resends: u64,
    /// `media` frames abandoned after their expiry.
    pub expired: u64,
    /// Reliable packets too far ahead of the watermark (dropped, not acked).
    pub out_of_window: u64,
    /// Packets breaking a rule (ordered but not reliable, bad fragment, sequence 0 reliable).
    pub invalid: u64,
    /// `latest` frames older than the newest delivered.
    pub stale: u64,
    /// Packets dropped unacked because hold-back or reassembly memory was full.
    pub memory_drops: u64,
    /// Incomplete fragment sets dropped at their timeout.
    pub reassembly_expired: u64,
    /// Unreliable frames dropped because the unreliable queue was full.
    pub unreliable_dropped: u64,
    /// Gaps skipped towards an older-rules peer.
    pub holes_skipped: u64,
    /// Frames that arrived for a skipped gap and were delivered out of order.
    pub late_after_skip: u64,
}

#[derive(Debug)]
struct Outgoing {
    ptype: PacketType,
    flags: u8,
    channel: Arc<str>,
    payload: Bytes,
    fragment: Fragment,
    expires: Option<Instant>,
}

#[derive(Debug)]
struct InFlight {
    seq: u32,
    out: Outgoing,
    first_sent: Option<Instant>,
    last_sent: Option<Instant>,
    sends: u32,
    /// Highest sequence sent when this was last transmitted; three acked beyond it = lost.
    high_water: u32,
    abandoned: bool,
    acked: bool,
    due: bool,
}

#[derive(Debug)]
struct Rtt {
    srtt: Option<Duration>,
    rttvar: Duration,
}

impl Rtt {
    /// RFC 6298 smoothing.
    fn sample(&mut self, r: Duration) {
        match self.srtt {
            None => {
                self.srtt = Some(r);
                self.rttvar = r / 2;
            }
            Some(srtt) => {
                let delta = srtt.abs_diff(r);
                self.rttvar = (self.rttvar * 3 + delta) / 4;
                self.srtt = Some((srtt * 7 + r) / 8);
            }
        }
    }
}

/// Unreliable frames wait here; `seq` is the `latest` counter (0 for others).
#[derive(Debug)]
struct Unrel {
    out: Outgoing,
    seq: u32,
}

/// Largest number of distinct `latest` channels tracked per direction.
const MAX_LATEST_CHANNELS: usize = 64;
/// Largest number of channel names interned per session.
const MAX_INTERNED_CHANNELS: usize = 32;

/// A CultNet peer session (see the module docs for the calling contract).
#[derive(Debug)]
pub struct Session {
    cfg: SessionConfig,
    role: Role,
    state: State,
    rules: PeerRules,
    /// The peer understands abandon notices (it set the bit on its Connect/Accept).
    peer_abandon: bool,
    next_seq: u32,
    /// Invariant: at most `cfg.window` entries, in sending order; past it only while a fragment
    /// set goes out whole to an older-rules peer (at most [`OLDER_PEER_MAX_FRAGMENTS`] more).
    in_flight: VecDeque<InFlight>,
    /// Reliable frames waiting for the window. Invariant: `queued_bytes` = their payload bytes.
    queue: VecDeque<Outgoing>,
    queued_bytes: usize,
    unreliable: VecDeque<Unrel>,
    /// Pre-encoded one-off packets (Pong, Disconnect, replayed Accept).
    control: VecDeque<Vec<u8>>,
    latest_out: Vec<(Arc<str>, u32)>,
    latest_in: Vec<(Arc<str>, u32)>,
    next_fragment_id: u16,
    largest_acked: Option<u32>,
    highest_sent: u32,
    rtt: Rtt,
    recv: Recv,
    /// Pending acks must go out now (gap, duplicate, handshake, count or delay reached).
    ack_now: bool,
    /// When the oldest pending in-order ack must go out at the latest.
    ack_deadline: Option<Instant>,
    reasm: Reassembly,
    created: Instant,
    last_recv: Instant,
    last_send: Instant,
    connect_seq: u32,
    connect_payload: Bytes,
    /// The Accept's payload: what the server sent with it (on a client), or sends (on a server).
    accept_payload: Bytes,
    accept_bytes: Vec<u8>,
    events: VecDeque<SessionEvent>,
    stats: SessionStats,
    channels: Vec<Arc<str>>,
    /// Told to [`finish`](Session::finish): the reason it will close with, and when it closes
    /// at the latest.
    finishing: Option<(String, Instant)>,
}

impl Session {
    fn new(now: Instant, cfg: SessionConfig, role: Role, initial_seq: u32) -> Self {
        let reasm = Reassembly::new(
            cfg.max_fragment_sets,
            cfg.max_reassembly_bytes,
            cfg.max_payload,
        );
        Self {
            role,
            state: if role == Role::Client {
                State::Connecting
            } else {
                State::Accepting
            },
            rules: PeerRules::Newer,
            peer_abandon: false,
            next_seq: if initial_seq == 0 { 1 } else { initial_seq },
            in_flight: VecDeque::new(),
            queue: VecDeque::new(),
            queued_bytes: 0,
            unreliable: VecDeque::new(),
            control: VecDeque::new(),
            latest_out: Vec::new(),
            latest_in: Vec::new(),
            next_fragment_id: 1,
            largest_acked: None,
            highest_sent: 0,
            rtt: Rtt {
                srtt: None,
                rttvar: Duration::ZERO,
            },
            recv: Recv::new(),
            ack_now: false,
            ack_deadline: None,
            reasm,
            created: now,
            last_recv: now,
            last_send: now,
            connect_seq: 0,
            connect_payload: Bytes::new(),
            accept_payload: Bytes::new(),
            accept_bytes: Vec::new(),
            events: VecDeque::new(),
            stats: SessionStats::default(),
            channels: Vec::new(),
            finishing: None,
            cfg,
        }
    }

    /// Starts a client session: queues a Connect carrying `payload` (the credentials).
    /// `initial_seq` should be random in `[1, 2^31)`.
    pub fn connect(now: Instant, cfg: SessionConfig, payload: Bytes, initial_seq: u32) -> Self {
        let mut s = Self::new(now, cfg, Role::Client, initial_seq);
        let seq = s.take_seq();
        s.connect_seq = seq;
        s.connect_payload = payload.clone();
        let channel = s.intern(CONTROL_CHANNEL);
        s.push_in_flight(
            seq,
            Outgoing {
                ptype: PacketType::Connect,
                flags: Flags::RELIABLE | Flags::ORDERED | Flags::ABANDON,
                channel,
                payload,
                fragment: Fragment::default(),
                expires: None,
            },
        );
        s
    }

    /// Starts a server session from a peer's Connect (already accepted by the owner) and queues
    /// the Accept. `initial_seq` should be random in `[1, 2^31)`.
    pub fn accept(
        now: Instant,
        cfg: SessionConfig,
        connect: &Packet<'_>,
        initial_seq: u32,
    ) -> Self {
        Self::accept_with(now, cfg, connect, initial_seq, Bytes::new())
    }

    /// [`Session::accept`] with a payload in the Accept (e.g. the server's proof of its key).
    pub fn accept_with(
        now: Instant,
        cfg: SessionConfig,
        connect: &Packet<'_>,
        initial_seq: u32,
        payload: Bytes,
    ) -> Self {
        let mut s = Self::new(now, cfg, Role::Server, initial_seq);
        s.accept_payload = payload.clone();
        s.stats.packets_in += 1;
        s.connect_seq = connect.sequence;
        s.connect_payload = Bytes::copy_from_slice(connect.payload);
        s.peer_abandon = connect.flags.has(Flags::ABANDON);
        s.recv.start_at(connect.sequence);
        let seq = s.take_seq();
        let channel = s.intern(CONTROL_CHANNEL);
        s.push_in_flight(
            seq,
            Outgoing {
                ptype: PacketType::Accept,
                flags: Flags::RELIABLE | Flags::ORDERED | Flags::ABANDON,
                channel,
                payload,
                fragment: Fragment::default(),
                expires: None,
            },
        );
        // Encode the Accept once so a repeated Connect is answered with identical bytes.
        let mut bytes = Vec::new();
        let e = &s.in_flight[0];
        let _ = packet::encode_parts(
            &mut bytes,
            Header {
                ptype: PacketType::Accept,
                flags: Flags(e.out.flags),
                connection_id: s.cfg.connection_id,
                sequence: seq,
                ack: connect.sequence,
                ack_mask: 0,
                fragment: Fragment::default(),
            },
            CONTROL_CHANNEL,
            &[&s.accept_payload],
        );
        s.accept_bytes = bytes;
        s
    }

    // ---- getters ----

    /// The Accept's payload: on a client, what the server sent with its Accept (empty before
    /// it, or when it sent none); on a server, what its Accept carries.
    pub fn accept_payload(&self) -> &Bytes {
        &self.accept_payload
    }

    /// Where the handshake stands.
    pub fn state(&self) -> &State {
        &self.state
    }

    /// Whether frames flow (handshake done, not closed).
    pub fn is_connected(&self) -> bool {
        self.state == State::Connected
    }

    /// Why the session ended, if it did. Sticky.
    pub fn close_reason(&self) -> Option<&CloseReason> {
        match &self.state {
            State::Closed(r) => Some(r),
            _ => None,
        }
    }

    /// Client or server.
    pub fn role(&self) -> Role {
        self.role
    }

    /// The rules the peer has shown it follows.
    pub fn peer_rules(&self) -> PeerRules {
        self.rules
    }

    /// The peer's Connect payload (server) or ours (client).
    pub fn connect_payload(&self) -> &Bytes {
        &self.connect_payload
    }

    /// The sequence of the Connect that opened this session.
    pub fn connect_sequence(&self) -> u32 {
        self.connect_seq
    }

    /// The exact bytes of this server session's Accept (empty for a client).
    pub fn accept_bytes(&self) -> &[u8] {
        &self.accept_bytes
    }

    /// Counters.
    pub fn stats(&self) -> SessionStats {
        self.stats
    }

    /// The smoothed round-trip time, once measured.
    pub fn rtt(&self) -> Option<Duration> {
        self.rtt.srtt
    }

    /// Reliable packets sent and not yet acknowledged.
    pub fn in_flight(&self) -> usize {
        self.in_flight.len()
    }

    /// Bytes waiting behind the send window.
    pub fn queued_bytes(&self) -> usize {
        self.queued_bytes
    }

    /// Bytes this session holds on the receive side (held-back frames and fragments).
    pub fn receive_buffered_bytes(&self) -> usize {
        self.recv.held_bytes + self.reasm.bytes()
    }

    /// Whether [`Session::poll_transmit`] has something to send now.
    pub fn wants_transmit(&self) -> bool {
        if !self.control.is_empty() {
            return true;
        }
        if matches!(self.state, State::Closed(_)) {
            return false;
        }
        (self.ack_now && self.recv.has_pending_acks())
            || self.in_flight.iter().any(|e| e.due)
            || (self.state == State::Connected && !self.queue.is_empty() && self.window_open())
            || (self.state == State::Connected && !self.unreliable.is_empty())
    }

    /// Whether `send` would accept `len` more reliable bytes now.
    pub fn wants_send(&self, len: usize) -> bool {
        !matches!(self.state, State::Closed(_))
            && self.queued_bytes + len <= self.cfg.max_queued_bytes
    }

    // ---- app commands ----

    /// Sends `payload` on `channel` with the channel's rule ([`Delivery::for_channel`]).
    pub fn send(&mut self, now: Instant, channel: &str, payload: Bytes) -> Result<(), SendError> {
        let delivery = Delivery::for_channel(channel, &self.cfg);
        self.send_with(now, channel, delivery, payload)
    }

    /// Sends `payload` on `channel` with an explicit delivery rule. Frames sent before the
    /// handshake completes wait for it.
    pub fn send_with(
        &mut self,
        now: Instant,
        channel: &str,
        delivery: Delivery,
        payload: Bytes,
    ) -> Result<(), SendError> {
        if matches!(self.state, State::Closed(_)) || self.finishing.is_some() {
            return Err(SendError::NotConnected);
        }
        if channel.len() > 255 {
            return Err(SendError::ChannelTooLong { len: channel.len() });
        }
        let len = payload.len();
        if len > self.cfg.max_payload {
            return Err(SendError::TooLarge {
                len,
                max: self.cfg.max_payload,
            });
        }
        let single = packet::MAX_SINGLE_PAYLOAD - channel.len();
        let piece = match self.cfg.max_fragment_size {
            // An older-rules peer acknowledges a set only by the one ack after its delivery.
            Some(f) if len > f && self.rules == PeerRules::Older => {
                let most = OLDER_PEER_MAX_FRAGMENTS.min(self.cfg.window).max(1);
                f.max(len.div_ceil(most)).clamp(1, single)
            }
            Some(f) if len > f => f.clamp(1, single),
            _ if len > single => return Err(SendError::NeedsFragmentation { len }),
            _ => len.max(1),
        };
        let count = len.div_ceil(piece).max(1);
        if count > u16::MAX as usize {
            return Err(SendError::TooLarge {
                len,
                max: piece * u16::MAX as usize,
            });
        }
        let reliable = matches!(
            delivery,
            Delivery::ReliableOrdered | Delivery::Reliable { .. }
        );
        if reliable && self.queued_bytes + len > self.cfg.max_queued_bytes {
            return Err(SendError::QueueFull {
                queued_bytes: self.queued_bytes,
            });
        }
        let channel = self.intern(channel);
        let expires = match delivery {
            Delivery::Reliable {
                expire_after: Some(d),
            } => Some(now + d),
            _ => None,
        };
        let fragment_id = if count > 1 {
            self.take_fragment_id()
        } else {
            0
        };
        let latest_seq = if delivery == Delivery::Sequenced {
            bump(&mut self.latest_out, &channel)
        } else {
            0
        };
        for i in 0..count {
            let part = if count == 1 {
                payload.clone()
            } else {
                payload.slice(i * piece..((i + 1) * piece).min(len))
            };
            let out = Outgoing {
                ptype: PacketType::Data,
                flags: delivery.flags(),
                channel: channel.clone(),
                payload: part,
                fragment: if count > 1 {
                    Fragment {
                        id: fragment_id,
                        index: i as u16,
                        count: count as u16,
                    }
                } else {
                    Fragment::default()
                },
                expires,
            };
            if reliable {
                self.queued_bytes += out.payload.len();
                self.queue.push_back(out);
            } else {
                if self.unreliable.len() >= self.cfg.max_unreliable_queue {
                    self.unreliable.pop_front();
                    self.stats.unreliable_dropped += 1;
                }
                self.unreliable.push_back(Unrel {
                    out,
                    seq: latest_seq,
                });
            }
        }
        self.stats.frames_out += 1;
        Ok(())
    }

    /// Queues a Ping carrying `payload`; the Pong comes back as [`SessionEvent::Pong`].
    pub fn ping(&mut self, payload: &[u8]) {
        self.push_control(PacketType::Ping, payload);
    }

    /// Closes the session: queues one Disconnect carrying `reason` and drops everything unsent.
    pub fn close(&mut self, reason: &str) {
        if matches!(self.state, State::Closed(_)) {
            return;
        }
        self.push_control(PacketType::Disconnect, reason.as_bytes());
        self.shut(CloseReason::Local(reason.to_owned()));
    }

    /// Closes once what is already queued has been delivered: no new frame is taken, the
    /// queued and unacknowledged ones go on being sent and resent, and when every one is
    /// acknowledged (or `finish_linger` has passed) the peer gets a Disconnect with `reason`,
    /// as from [`close`](Session::close). So a peer being sent away still reads the answers it
    /// was given before. A session not yet connected closes at once.
    pub fn finish(&mut self, now: Instant, reason: &str) {
        if matches!(self.state, State::Closed(_)) || self.finishing.is_some() {
            return;
        }
        if self.state != State::Connected {
            self.close(reason);
            return;
        }
        self.finishing = Some((reason.to_owned(), now + self.cfg.finish_linger));
        self.finish_if_done(now);
    }

    /// Whether the session was told to [`finish`](Session::finish) and has not closed yet.
    pub fn is_finishing(&self) -> bool {
        self.finishing.is_some()
    }

    /// Closes a finishing session whose frames are all delivered or whose linger is over.
    fn finish_if_done(&mut self, now: Instant) {
        let Some((_, deadline)) = &self.finishing else {
            return;
        };
        let delivered = self.queue.is_empty()
            && self.unreliable.is_empty()
            && self.in_flight.iter().all(|e| e.acked);
        if delivered || now >= *deadline {
            if let Some((reason, _)) = self.finishing.take() {
                self.close(&reason);
            }
        }
    }

    // ---- inputs ----

    /// Feeds one packet from the peer (already decoded, connection id already checked).
    pub fn handle(&mut self, now: Instant, p: &Packet<'_>) {
        if matches!(self.state, State::Closed(_)) {
            return;
        }
        self.stats.packets_in += 1;
        self.last_recv = now;
        let reliable = p.flags.has(Flags::RELIABLE);
        let abandon_notice = p.ptype == PacketType::Ack && p.flags.has(Flags::ABANDON);
        // `latest` frames carry their own channel counter under both rules, so only other
        // unreliable packets with a sequence reveal an older-rules peer.
        if !reliable
            && p.sequence != 0
            && !abandon_notice
            && !p.flags.has(Flags::SEQUENCED)
            && p.ptype != PacketType::Connect
        {
            self.rules = PeerRules::Older;
        }
        if p.ptype != PacketType::Connect {
            self.on_ack(now, p.ack, p.ack_mask);
        }
        match p.ptype {
            PacketType::Connect => self.on_repeated_connect(p),
            PacketType::Accept => self.on_accept(now, p),
            PacketType::Data => self.on_data(now, p),
            PacketType::Ack => {
                if abandon_notice && p.sequence != 0 {
                    self.on_reliable(now, p.sequence, |_| Ok(None));
                } else {
                    self.consume_legacy_seq(now, p.sequence);
                }
            }
            PacketType::Ping => {
                self.consume_legacy_seq(now, p.sequence);
                if self.control.len() < self.cfg.max_control_queue {
                    self.push_control(PacketType::Pong, p.payload);
                }
            }
            PacketType::Pong => {
                self.consume_legacy_seq(now, p.sequence);
                self.events
                    .push_back(SessionEvent::Pong(Bytes::copy_from_slice(p.payload)));
            }
            PacketType::Disconnect => {
                let reason = String::from_utf8_lossy(p.payload).into_owned();
                self.in_flight.clear();
                self.shut(CloseReason::Peer(reason.clone()));
                self.events
                    .push_back(SessionEvent::Disconnected(CloseReason::Peer(reason)));
            }
        }
        self.finish_if_done(now);
    }

    /// Runs the timers due at `now`: resends, expiry, keepalive, silence and connect timeouts,
    /// reassembly timeouts, older-peer gap skipping. Idempotent.
    pub fn handle_timeout(&mut self, now: Instant) {
        if matches!(self.state, State::Closed(_)) {
            return;
        }
        if self.state == State::Connecting && now >= self.created + self.cfg.connect_timeout {
            self.fail(CloseReason::ConnectTimeout);
            return;
        }
        if let Some(t) = self.cfg.silence_timeout {
            if now >= self.last_recv + t {
                self.fail(CloseReason::SilenceTimeout);
                return;
            }
        }
        if self.ack_deadline.is_some_and(|t| now >= t) {
            self.ack_now = true;
        }
        let rto = self.rto();
        let max = self.cfg.max_resend_delay;
        let expire = self.peer_abandon;
        for e in self.in_flight.iter_mut() {
            if e.acked || e.due {
                continue;
            }
            if expire && !e.abandoned && e.out.expires.is_some_and(|t| now >= t) {
                e.abandoned = true;
                e.out.payload = Bytes::new();
                e.due = true;
                self.stats.expired += 1;
                continue;
            }
            if let Some(last) = e.last_sent {
                if now >= last + backoff(rto, e.sends, max) {
                    e.due = true;
                }
            }
        }
        if let Some(k) = self.cfg.keepalive {
            if self.state == State::Connected && now >= self.last_send + k {
                self.push_control(PacketType::Ping, b"keepalive");
            }
        }
        let n = self.reasm.expire(now, self.cfg.reassembly_timeout);
        self.stats.reassembly_expired += n as u64;
        if self.rules == PeerRules::Older {
            if let Some(since) = self.recv.hole_since {
                if now >= since + self.cfg.legacy_hole_timeout && self.recv.has_hole() {
                    let events = &mut self.events;
                    let stats = &mut self.stats;
                    if self.recv.skip_hole(now, |f| {
                        stats.frames_in += 1;
                        events.push_back(SessionEvent::Frame(f))
                    }) {
                        self.stats.holes_skipped += 1;
                    }
                }
            }
        }
        self.finish_if_done(now);
    }

    // ---- outputs ----

    /// Writes the next datagram to send into `buf` (appending) and returns true, or returns
    /// false when there is nothing to send now.
    pub fn poll_transmit(&mut self, now: Instant, buf: &mut Vec<u8>) -> bool {
        if let Some(bytes) = self.control.pop_front() {
            buf.extend_from_slice(&bytes);
            self.sent(now);
            return true;
        }
        if matches!(self.state, State::Closed(_)) {
            return false;
        }
        if self.state == State::Connected {
            self.fill_window(now);
        }
        if let Some(i) = self.in_flight.iter().position(|e| e.due) {
            self.transmit_in_flight(now, i, buf);
            return true;
        }
        if !self.ack_now {
            // Pending in-order acks wait for their deadline or count.
        } else if let Some((ack, mask)) = self.recv.next_ack() {
            self.encode_ack(buf, ack, mask);
            self.sent(now);
            return true;
        }
        if self.state == State::Connected {
            if let Some(u) = self.unreliable.pop_front() {
                let sequence = if self.rules == PeerRules::Older {
                    self.take_seq()
                } else {
                    u.seq
                };
                let acks = self.ack_fields();
                let channel = u.out.channel.clone();
                self.encode(
                    buf,
                    u.out.ptype,
                    u.out.flags,
                    sequence,
                    acks,
                    u.out.fragment,
                    &channel,
                    &[&u.out.payload],
                );
                self.sent(now);
                return true;
            }
        }
        false
    }

    /// The next event, if any.
    pub fn poll_event(&mut self) -> Option<SessionEvent> {
        self.events.pop_front()
    }

    /// When [`Session::handle_timeout`] should next be called; `None` = no timer armed.
    pub fn poll_timeout(&self) -> Option<Instant> {
        if matches!(self.state, State::Closed(_)) {
            return None;
        }
        let mut t: Option<Instant> = None;
        let mut at = |x: Instant| t = Some(t.map_or(x, |t| t.min(x)));
        if self.state == State::Connecting {
            at(self.created + self.cfg.connect_timeout);
        }
        if let Some(d) = self.ack_deadline {
            at(d);
        }
        if let Some((_, d)) = &self.finishing {
            at(*d);
        }
        if let Some(s) = self.cfg.silence_timeout {
            at(self.last_recv + s);
        }
        if let Some(k) = self.cfg.keepalive {
            if self.state == State::Connected {
                at(self.last_send + k);
            }
        }
        let rto = self.rto();
        for e in &self.in_flight {
            if e.acked || e.due {
                continue;
            }
            if let Some(last) = e.last_sent {
                at(last + backoff(rto, e.sends, self.cfg.max_resend_delay));
            }
            if self.peer_abandon && !e.abandoned {
                if let Some(x) = e.out.expires {
                    at(x);
                }
            }
        }
        if let Some(x) = self.reasm.next_deadline(self.cfg.reassembly_timeout) {
            at(x);
        }
        if self.rules == PeerRules::Older {
            if let Some(since) = self.recv.hole_since {
                at(since + self.cfg.legacy_hole_timeout);
            }
        }
        t
    }

    // ---- internals ----

    fn on_repeated_connect(&mut self, p: &Packet<'_>) {
        // The hub sends a new Connect (new payload or sequence) to a fresh session; one that
        // reaches here is a retransmission of ours.
        if self.role != Role::Server {
            self.stats.invalid += 1;
            return;
        }
        if self.state == State::Accepting {
            let bytes = self.accept_bytes.clone();
            self.control.push_back(bytes);
        } else {
            self.ack_at_once(p.sequence);
        }
    }

    fn on_accept(&mut self, now: Instant, p: &Packet<'_>) {
        if self.role != Role::Client {
            self.stats.invalid += 1;
            return;
        }
        if self.state == State::Connecting {
            if p.ack != self.connect_seq {
                // Counts only if it acks our own pending Connect.
                self.stats.invalid += 1;
                return;
            }
            self.peer_abandon = p.flags.has(Flags::ABANDON);
            self.accept_payload = Bytes::copy_from_slice(p.payload);
            self.recv.start_at(p.sequence);
            self.ack_at_once(p.sequence);
            self.state = State::Connected;
            self.events.push_back(SessionEvent::Connected);
            self.recv.advance(now, |_| {});
        } else if self.recv.received(p.sequence) {
            self.stats.duplicates += 1;
            self.ack_at_once(p.sequence);
        } else {
            self.stats.invalid += 1;
        }
    }

    fn on_data(&mut self, now: Instant, p: &Packet<'_>) {
        let reliable = p.flags.has(Flags::RELIABLE);
        let ordered = p.flags.has(Flags::ORDERED);
        if ordered && !reliable {
            self.stats.invalid += 1;
            return;
        }
        // A channel whose rule is reliable (`schema`, `media`) takes only reliable packets: they
        // are numbered in this session's sequence, which an unsequenced packet from whoever
        // holds the peer's address would bypass.
        if !reliable
            && matches!(
                Delivery::for_channel(p.channel, &self.cfg),
                Delivery::ReliableOrdered | Delivery::Reliable { .. }
            )
        {
            self.stats.invalid += 1;
            return;
        }
        if self.state == State::Connecting {
            return;
        }
        if self.state == State::Accepting && reliable {
            // The client only sends data once it has our Accept.
            self.set_connected();
        }
        let channel = self.intern(p.channel);
        if reliable {
            if p.sequence == 0 {
                self.stats.invalid += 1;
                return;
            }
            let frag = p.fragment;
            let payload = p.payload;
            self.on_reliable(now, p.sequence, |s| {
                if frag.count == 0 {
                    let f = Frame {
                        channel: channel.clone(),
                        payload: Bytes::copy_from_slice(payload),
                    };
                    return Ok(Some(Hold {
                        frame: f,
                        ordered,
                        at: None,
                    }));
                }
                match s.reasm.insert(now, &channel, frag, p.sequence, payload) {
                    Ok(None) => Ok(None),
                    Ok(Some(done)) => Ok(Some(Hold {
                        frame: Frame {
                            channel: channel.clone(),
                            payload: done.payload,
                        },
                        ordered,
                        at: Some(done.max_seq),
                    })),
                    Err(FragError::Full) => Err(Refuse::Memory),
                    Err(FragError::Misbehaved(why)) => Err(Refuse::Fatal(why)),
                }
            });
            return;
        }
        self.consume_legacy_seq(now, p.sequence);
        let payload = if p.fragment.count > 0 {
            match self
                .reasm
                .insert(now, &channel, p.fragment, p.sequence, p.payload)
            {
                Ok(Some(done)) => done.payload,
                Ok(None) => return,
                Err(FragError::Full) => {
                    self.stats.memory_drops += 1;
                    return;
                }
                Err(FragError::Misbehaved(_)) => {
                    self.stats.invalid += 1;
                    return;
                }
            }
        } else {
            Bytes::copy_from_slice(p.payload)
        };
        if p.flags.has(Flags::SEQUENCED) {
            let fresh = match self.latest_in.iter_mut().find(|(c, _)| **c == *channel) {
                Some((_, last)) => {
                    let fresh = seq::after(p.sequence, *last);
                    if fresh {
                        *last = p.sequence;
                    }
                    fresh
                }
                None => {
                    if self.latest_in.len() >= MAX_LATEST_CHANNELS {
                        self.latest_in.remove(0);
                    }
                    self.latest_in.push((channel.clone(), p.sequence));
                    true
                }
            };
            if !fresh {
                self.stats.stale += 1;
                return;
            }
        }
        self.deliver(Frame { channel, payload });
    }

    /// The common path of every reliable arrival: classify, let `take` decide what it holds,
    /// mark it received, ack it, advance the watermark.
    fn on_reliable(
        &mut self,
        now: Instant,
        s: u32,
        take: impl FnOnce(&mut Self) -> Result<Option<Hold>, Refuse>,
    ) {
        let idx = match self.recv.classify(s) {
            Class::Duplicate => {
                if self.recv.take_skipped(s) {
                    // An older peer's hole we gave up on was a real frame after all: deliver
                    // it late rather than lose it.
                    if let Ok(Some(Hold {
                        frame, at: None, ..
                    })) = take(self)
                    {
                        self.stats.late_after_skip += 1;
                        self.deliver(frame);
                    }
                } else {
                    self.stats.duplicates += 1;
                }
                self.ack_at_once(s);
                return;
            }
            Class::OutOfWindow => {
                self.stats.out_of_window += 1;
                // A peer never sends that far ahead of what it has had acknowledged (its window
                // is far smaller than ours); whoever does is guessing this session's sequence
                // (a process that took a departed peer's address): it gets a bounded number of
                // guesses, then the session ends.
                if self.stats.out_of_window >= self.cfg.max_out_of_window {
                    self.fail(CloseReason::PeerMisbehaved(
                        "too many packets outside this session's sequence".into(),
                    ));
                }
                return;
            }
            Class::New(idx) => idx,
        };
        let hold = match take(self) {
            Ok(h) => h,
            Err(Refuse::Memory) => {
                self.stats.memory_drops += 1;
                return;
            }
            Err(Refuse::Fatal(why)) => {
                self.stats.invalid += 1;
                self.push_control(PacketType::Disconnect, why.as_bytes());
                self.fail_quiet(CloseReason::PeerMisbehaved(why.to_owned()));
                return;
            }
        };
        match hold {
            None => self.recv.mark(idx, s, None),
            Some(Hold {
                frame,
                ordered: true,
                at: None,
            }) => {
                if idx > 0 && self.recv.held_bytes + frame.payload.len() > self.cfg.max_held_bytes {
                    self.stats.memory_drops += 1;
                    return;
                }
                self.recv.mark(idx, s, Some(frame));
            }
            Some(Hold {
                frame,
                ordered: true,
                at: Some(last),
            }) => {
                self.recv.mark(idx, s, None);
                if !self.recv.place(last, frame) {
                    self.stats.invalid += 1;
                }
            }
            Some(Hold {
                frame,
                ordered: false,
                ..
            }) => {
                self.recv.mark(idx, s, None);
                self.deliver(frame);
            }
        }
        self.recv.want_ack(s);
        let events = &mut self.events;
        let stats = &mut self.stats;
        self.recv.advance(now, |f| {
            stats.frames_in += 1;
            events.push_back(SessionEvent::Frame(f));
        });
        if self.recv.pending_ack_count() >= self.cfg.ack_frequency {
            // Ack now, inside the burst, not once after it: several acks per window mean a
            // lost one is covered by the next instead of stalling the sender's window.
            if let Some((ack, mask)) = self.recv.next_ack() {
                self.push_ack(ack, mask);
            }
        } else if idx > 0 {
            // Out of order: the sender may be waiting on this ack to retransmit.
            self.ack_now = true;
        } else if self.ack_deadline.is_none() {
            self.ack_deadline = Some(now + self.cfg.ack_delay);
        }
    }

    fn ack_at_once(&mut self, s: u32) {
        self.recv.want_ack(s);
        self.ack_now = true;
    }

    /// An older-rules peer's non-reliable sequence fills its slot in the reliable sequence.
    fn consume_legacy_seq(&mut self, now: Instant, s: u32) {
        if self.rules != PeerRules::Older || s == 0 {
            return;
        }
        if let Class::New(idx) = self.recv.classify(s) {
            self.recv.mark(idx, s, None);
            let events = &mut self.events;
            let stats = &mut self.stats;
            self.recv.advance(now, |f| {
                stats.frames_in += 1;
                events.push_back(SessionEvent::Frame(f));
            });
        }
    }

    fn on_ack(&mut self, now: Instant, ack: u32, mask: u32) {
        if ack == 0 || self.in_flight.is_empty() {
            return;
        }
        let mut largest: Option<u32> = None;
        let mut accept_acked = false;
        let rtt = &mut self.rtt;
        for e in self.in_flight.iter_mut() {
            if e.acked || e.sends == 0 || !seq::covered(ack, mask, e.seq) {
                continue;
            }
            e.acked = true;
            if e.sends == 1 && !e.abandoned {
                if let Some(t) = e.first_sent {
                    rtt.sample(now.saturating_duration_since(t));
                }
            }
            if e.out.ptype == PacketType::Accept {
                accept_acked = true;
            }
            if largest.is_none_or(|l| seq::after(e.seq, l)) {
                largest = Some(e.seq);
            }
        }
        if accept_acked && self.state == State::Accepting {
            self.set_connected();
        }
        if let Some(l) = largest {
            if self.largest_acked.is_none_or(|x| seq::after(l, x)) {
                self.largest_acked = Some(l);
            }
        }
        if let Some(la) = self.largest_acked {
            for e in self.in_flight.iter_mut() {
                if !e.acked && !e.due && e.sends > 0 && seq::diff(la, e.high_water) >= 3 {
                    e.due = true;
                }
            }
        }
        // Acked entries behind an unacked one leave the window too.
        self.in_flight.retain(|e| !e.acked);
    }

    fn set_connected(&mut self) {
        if self.state != State::Connected {
            self.state = State::Connected;
            self.events.push_back(SessionEvent::Connected);
        }
    }

    /// Whether the next queued reliable packet may go in flight: the window has room, or it
    /// continues a fragment set already started towards an older-rules peer (which
    /// acknowledges nothing of a set before it has all of it).
    fn window_open(&self) -> bool {
        self.in_flight.len() < self.cfg.window
            || (self.rules == PeerRules::Older
                && self
                    .queue
                    .front()
                    .is_some_and(|o| o.fragment.count > 1 && o.fragment.index > 0))
    }

    fn fill_window(&mut self, now: Instant) {
        while self.window_open() {
            let Some(out) = self.queue.pop_front() else {
                break;
            };
            self.queued_bytes -= out.payload.len();
            if out.expires.is_some_and(|t| now >= t) && self.peer_abandon {
                self.stats.expired += 1;
                continue;
            }
            let seq = self.take_seq();
            self.push_in_flight(seq, out);
        }
    }

    fn push_in_flight(&mut self, seq: u32, out: Outgoing) {
        self.in_flight.push_back(InFlight {
            seq,
            out,
            first_sent: None,
            last_sent: None,
            sends: 0,
            high_water: seq,
            abandoned: false,
            acked: false,
            due: true,
        });
    }

    fn transmit_in_flight(&mut self, now: Instant, i: usize, buf: &mut Vec<u8>) {
        let acks = self.ack_fields();
        let e = &self.in_flight[i];
        let (ptype, flags, sequence, acks) = if e.abandoned {
            (PacketType::Ack, Flags::ABANDON, e.seq, acks)
        } else {
            let acks = match e.out.ptype {
                PacketType::Accept => (self.connect_seq, 0),
                PacketType::Connect => (0, 0),
                _ => acks,
            };
            (e.out.ptype, e.out.flags, e.seq, acks)
        };
        let channel = e.out.channel.clone();
        let payload = e.out.payload.clone();
        let fragment = if e.abandoned {
            Fragment::default()
        } else {
            e.out.fragment
        };
        self.encode(
            buf,
            ptype,
            flags,
            sequence,
            acks,
            fragment,
            &channel,
            &[&payload],
        );
        if seq::after(sequence, self.highest_sent) || self.highest_sent == 0 {
            self.highest_sent = sequence;
        }
        let highest = self.highest_sent;
        let e = &mut self.in_flight[i];
        if e.sends > 0 {
            self.stats.resends += 1;
        }
        e.sends += 1;
        e.first_sent.get_or_insert(now);
        e.last_sent = Some(now);
        e.high_water = highest;
        e.due = false;
        self.sent(now);
    }

    #[allow(clippy::too_many_arguments)]
    fn encode(
        &mut self,
        buf: &mut Vec<u8>,
        ptype: PacketType,
        flags: u8,
        sequence: u32,
        (ack, ack_mask): (u32, u32),
        fragment: Fragment,
        channel: &str,
        payload: &[&[u8]],
    ) {
        // Channel lengths were checked at send time; control names are constants.
        let _ = packet::encode_parts(
            buf,
            Header {
                ptype,
                flags: Flags(flags),
                connection_id: self.cfg.connection_id,
                sequence,
                ack,
                ack_mask,
                fragment,
            },
            channel,
            payload,
        );
        if ack != 0 {
            self.recv.acked_by(ack, ack_mask);
            if !self.recv.has_pending_acks() {
                // Invariant: the ack timer runs only while acks are pending.
                self.ack_now = false;
                self.ack_deadline = None;
            }
        }
    }

    /// The (ack, mask) every packet carries: the highest reliable sequence received.
    fn ack_fields(&self) -> (u32, u32) {
        let h = self.recv.highest;
        if h == 0 {
            (0, 0)
        } else {
            (h, self.recv.mask_for(h))
        }
    }

    /// Queues an explicit Ack naming `ack` (already taken off the pending list).
    fn push_ack(&mut self, ack: u32, mask: u32) {
        let mut bytes = Vec::with_capacity(packet::FIXED_HEADER_LEN + CONTROL_CHANNEL.len());
        self.encode_ack(&mut bytes, ack, mask);
        self.control.push_back(bytes);
    }

    /// Appends an explicit Ack naming `ack` to `buf`.
    fn encode_ack(&mut self, buf: &mut Vec<u8>, ack: u32, mask: u32) {
        // Sequence 0 under both rules (see the module docs on older peers).
        let sequence = 0;
        self.encode(
            buf,
            PacketType::Ack,
            0,
            sequence,
            (ack, mask),
            Fragment::default(),
            CONTROL_CHANNEL,
            &[],
        );
    }

    fn push_control(&mut self, ptype: PacketType, payload: &[u8]) {
        // Sequence 0 under both rules (see the module docs on older peers).
        let sequence = 0;
        let acks = self.ack_fields();
        let mut bytes = Vec::with_capacity(packet::FIXED_HEADER_LEN + 7 + payload.len());
        let payload = &payload[..payload
            .len()
            .min(packet::MAX_SINGLE_PAYLOAD - CONTROL_CHANNEL.len())];
        self.encode(
            &mut bytes,
            ptype,
            0,
            sequence,
            acks,
            Fragment::default(),
            CONTROL_CHANNEL,
            &[payload],
        );
        self.control.push_back(bytes);
    }

    fn deliver(&mut self, f: Frame) {
        self.stats.frames_in += 1;
        self.events.push_back(SessionEvent::Frame(f));
    }

    fn sent(&mut self, now: Instant) {
        self.stats.packets_out += 1;
        self.last_send = now;
    }

    fn take_seq(&mut self) -> u32 {
        let s = self.next_seq;
        self.next_seq = seq::next(s);
        s
    }

    fn take_fragment_id(&mut self) -> u16 {
        let id = self.next_fragment_id;
        self.next_fragment_id = match id.wrapping_add(1) {
            0 => 1,
            n => n,
        };
        id
    }

    fn intern(&mut self, name: &str) -> Arc<str> {
        if let Some(c) = self.channels.iter().find(|c| ***c == *name) {
            return c.clone();
        }
        let c: Arc<str> = Arc::from(name);
        if self.channels.len() < MAX_INTERNED_CHANNELS {
            self.channels.push(c.clone());
        }
        c
    }

    fn rto(&self) -> Duration {
        match self.rtt.srtt {
            None => self.cfg.initial_resend_delay,
            // QUIC's probe timeout: the peer may hold its ack for up to its ack delay.
            Some(srtt) => {
                (srtt + (self.rtt.rttvar * 4).max(Duration::from_millis(1)) + self.cfg.ack_delay)
                    .clamp(self.cfg.min_resend_delay, self.cfg.max_resend_delay)
            }
        }
    }

    fn shut(&mut self, reason: CloseReason) {
        self.state = State::Closed(reason);
        self.finishing = None;
        self.in_flight.clear();
        self.queue.clear();
        self.queued_bytes = 0;
        self.unreliable.clear();
    }

    /// Closes for `reason`, telling the peer and the owner.
    fn fail(&mut self, reason: CloseReason) {
        self.push_control(PacketType::Disconnect, reason.to_string().as_bytes());
        self.fail_quiet(reason);
    }

    fn fail_quiet(&mut self, reason: CloseReason) {
        self.shut(reason.clone());
        self.events.push_back(SessionEvent::Disconnected(reason));
    }
}

struct Hold {
    frame: Frame,
    ordered: bool,
    /// For a reassembled ordered frame: the sequence of its last fragment, where it is placed.
    at: Option<u32>,
}

enum Refuse {
    Memory,
    Fatal(&'static str),
}

fn backoff(rto: Duration, sends: u32, max: Duration) -> Duration {
    let shift = sends.saturating_sub(1).min(10);
    (rto * (1u32 << shift)).min(max)
}

fn bump(counters: &mut Vec<(Arc<str>, u32)>, channel: &Arc<str>) -> u32 {
    if let Some((_, n)) = counters.iter_mut().find(|(c, _)| **c == **channel) {
        *n = seq::next(*n);
        return *n;
    }
    if counters.len() >= MAX_LATEST_CHANNELS {
        counters.remove(0);
    }
    counters.push((channel.clone(), 1));
    1
}
