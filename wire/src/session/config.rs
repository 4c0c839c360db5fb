//! Session tunables, each with the default the facts or the issue name.

use std::time::Duration;

/// The connection id this service uses. Known services use `0xE91F0001..=0xE91F0003`; this
/// gateway takes the next constant.
pub const GATEWAY_CONNECTION_ID: u32 = 0xE91F_0004;
/// Largest datagram payload IPv4 UDP can carry, minus nothing: the packet header is inside it.
pub const MAX_UDP_DATAGRAM: usize = 65_507;
/// Reliable packets in flight before further frames queue.
pub const DEFAULT_WINDOW: usize = 32;
/// Largest payload a frame may carry (fragmented or not).
pub const DEFAULT_MAX_PAYLOAD: usize = 16 * 1024 * 1024;
/// Pending fragment sets per peer.
pub const DEFAULT_MAX_FRAGMENT_SETS: usize = 64;
/// Fragments per set at most towards an older-rules peer: its one ack after delivering a frame
/// names the newest packet and the 32 before it, so a set of at most 33 is acknowledged whole;
/// 32 also fits the default send window whole.
pub const OLDER_PEER_MAX_FRAGMENTS: usize = 32;
/// Sequences above the received-through watermark that are tracked for duplicates.
pub const DUPLICATE_WINDOW: u32 = 4096;

/// Tunables of one peer session. `Default` gives the values seen in deployed peers where the
/// facts name them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SessionConfig {
    /// The connection id both ends are configured with.
    pub connection_id: u32,
    /// Resend delay before any round trip has been measured (deployed peers: 250 ms).
    pub initial_resend_delay: Duration,
    /// Floor of the adaptive resend delay (SRTT + max(4 RTTVAR, 1 ms) + the ack delay).
    pub min_resend_delay: Duration,
    /// Ceiling of the resend delay after exponential backoff.
    pub max_resend_delay: Duration,
    /// In-order reliable packets are acknowledged together after at most this long...
    pub ack_delay: Duration,
    /// ...or as soon as this many await an ack. Gaps, duplicates and handshake packets are
    /// acknowledged at once (the sender's fast retransmit needs them).
    pub ack_frequency: usize,
    /// Reliable packets in flight; more are queued, not dropped.
    pub window: usize,
    /// Bytes that may wait behind the window before `send` answers `QueueFull`.
    pub max_queued_bytes: usize,
    /// Split payloads larger than this into fragments; `None` = never fragment.
    pub max_fragment_size: Option<usize>,
    /// Largest frame payload accepted or sent.
    pub max_payload: usize,
    /// Pending fragment sets per peer; fragments of further sets are dropped unacknowledged.
    pub max_fragment_sets: usize,
    /// Bytes held by incomplete fragment sets, all sets together.
    pub max_reassembly_bytes: usize,
    /// An incomplete fragment set older than this is dropped.
    pub reassembly_timeout: Duration,
    /// Bytes of ordered frames held back waiting for a gap; beyond it packets are dropped
    /// unacknowledged, so the sender resends them later.
    pub max_held_bytes: usize,
    /// `media` frames still unacknowledged after this are abandoned (only towards peers that
    /// advertised the abandon capability; others get plain reliable delivery).
    pub media_expiry: Duration,
    /// A client gives up on an unanswered Connect after this.
    pub connect_timeout: Duration,
    /// Close the session when nothing arrives for this long; `None` = never.
    pub silence_timeout: Option<Duration>,
    /// Send a Ping when nothing was sent for this long; `None` = the caller pings.
    pub keepalive: Option<Duration>,
    /// Towards an older-rules peer (whose acks and pings consume sequences, so a lost one leaves
    /// a hole no resend fills), skip a hole in ordered delivery after this long. Should exceed
    /// the peer's resend delay (250 ms in deployed peers); a frame that still arrives for a
    /// skipped hole is delivered late, not dropped.
    pub legacy_hole_timeout: Duration,
    /// Reliable packets beyond the duplicate window (a guessed sequence) before the session is
    /// closed: a peer never sends them; whoever took a departed peer's address and guesses at
    /// its sequence does.
    pub max_out_of_window: u64,
    /// Pongs, disconnects and other one-off control packets waiting to go out, at most.
    pub max_control_queue: usize,
    /// Unreliable frames waiting to go out, at most; beyond it the oldest is dropped and counted.
    pub max_unreliable_queue: usize,
    /// A session told to [`finish`](crate::session::Session::finish) sends what it has queued
    /// and waits for the acks at most this long before it disconnects.
    pub finish_linger: Duration,
}

impl Default for SessionConfig {
    fn default() -> Self {
        Self {
            connection_id: GATEWAY_CONNECTION_ID,
            initial_resend_delay: Duration::from_millis(250),
            min_resend_delay: Duration::from_millis(5),
            max_resend_delay: Duration::from_secs(2),
            ack_delay: Duration::from_millis(1),
            ack_frequency: 8,
            window: DEFAULT_WINDOW,
            max_queued_bytes: 32 * 1024 * 1024,
            max_fragment_size: Some(1200),
            max_payload: DEFAULT_MAX_PAYLOAD,
            max_fragment_sets: DEFAULT_MAX_FRAGMENT_SETS,
            max_reassembly_bytes: DEFAULT_MAX_PAYLOAD + 1024 * 1024,
            reassembly_timeout: Duration::from_secs(15),
            max_held_bytes: 8 * 1024 * 1024,
            media_expiry: Duration::from_millis(75),
            connect_timeout: Duration::from_secs(3),
            silence_timeout: Some(Duration::from_secs(30)),
            keepalive: Some(Duration::from_secs(5)),
            legacy_hole_timeout: Duration::from_secs(1),
            max_out_of_window: 64,
            max_control_queue: 64,
            max_unreliable_queue: 1024,
            finish_linger: Duration::from_secs(1),
        }
    }
}
