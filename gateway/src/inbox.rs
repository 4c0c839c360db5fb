//! The durable inbox: what was said to each Persona, kept until it is acknowledged.
//!
//! One sled tree `inbox` holds every Persona; each key starts with a kind byte and the Persona id:
//! - `c` persona, last seq -> a chunk: the deliveries of one sync response (MessagePack array
//!   of encoded deliveries), removed once all of it is acknowledged
//! - `x` persona, last seq -> when it was stored and the event ids of that chunk (deduplication;
//!   kept after ack, because sync is at-least-once and may hand an acknowledged event back; the
//!   last [`DEDUPE_WINDOW`] ids are kept, far more than a replayed response or a gap fill can
//!   repeat, and none older than the retention ([`Inbox::prune`]))
//! - `m` persona, name -> value (`next_seq`, `acked`, `token`, and `s:NAME` for the session's
//!   values)
//! - `u` persona, event id -> an event held until it decrypts ([`Held`])
//! - `r` persona, room id -> the room's recent timeline (its last [`TIMELINE_CAP`] lines, for
//!   context)
//!
//! - `n`, `i`, `l` persona, ... -> session notes waiting to be shown, note ids, the latest
//!   note of each replacing kind ([`notes`])
//! - `o` persona, seq -> her replies' extension fields waiting for a client ([`outbox`])
//! - `m` persona, `retired` -> seqs taken out of her mail into context ([`retire`])
//! - `a` persona, first seq -> a batch set aside after the model API kept refusing it
//!   ([`aside`])
//!
//! and a tree `receipts`: persona, request id -> when it was stored and the send receipt (kept
//! for the retention, [`Inbox::prune`]).
//!
//! [`Inbox::ingest`] stores one sync response's new deliveries and its next sync token as ONE
//! atomic batch and flushes before returning: a delivery is visible (to [`Inbox::pending`])
//! only once it is on disk, and the token is never ahead of what it covers. Seqs are per
//! Persona, dense, monotonic, never reused, and survive restarts; so what is pending is exactly
//! the seqs after the ack watermark, but those a live Persona's turn loop retired into context
//! ([`retire`]).
//!
//! Why chunks: sled pays per key, not per byte. Two keys per delivery (record and event index)
//! cost ~3 ms per 100-delivery response and missed the latency target; one chunk and one id list
//! per response cost a fraction of that (README, inbox benchmark).
//!
//! Invariant: one task ingests for a Persona (its ear): `ingest` reads the dedupe set and the
//! seq counter, then writes one batch. Acks may run concurrently (they touch other keys).
//! Stores written by the first layout (a key per delivery) are converted when opened.

use std::collections::{HashMap, HashSet, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};

use parking_lot::{MappedRwLockReadGuard, RwLock, RwLockReadGuard};

use serde::{de::DeserializeOwned, Serialize};
use serde_bytes::ByteBuf;
use wire::docs::{Delivery, SendReceipt};

/// Inbox failures.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum InboxError {
    /// The store failed (I/O, corruption reported by sled).
    #[error("inbox store: {0}")]
    Store(#[from] sled::Error),
    /// A stored value does not decode.
    #[error("inbox record {key:?} is unreadable: {reason}")]
    Corrupt {
        /// Which key.
        key: String,
        /// What went wrong.
        reason: String,
    },
    /// Another inbox (this process or another: a gateway running with this state directory)
    /// holds it.
    #[error("the inbox {path} is in use (a gateway is running with it)")]
    Locked {
        /// The inbox directory.
        path: String,
    },
    /// A file operation around the store failed (its lock file, a compaction's copy).
    #[error("inbox: {what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// Why it failed.
        source: std::io::Error,
    },
    /// A compaction could not reopen the store it swapped in (said in the log); the files
    /// are left for the next start to recover.
    #[error("the inbox store is closed: a compaction could not reopen it; restart the gateway")]
    Closed,
    /// An ack beyond the highest seq ever assigned (a client bug; nothing changes).
    #[error("ack through {through} is beyond the highest seq assigned ({highest})")]
    AckBeyondHighest {
        /// Requested.
        through: u64,
        /// Highest assigned.
        highest: u64,
    },
}

/// How long [`Inbox::open`] waits for another holder of the database lock.
pub const LOCK_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// sled reports a held lock as an I/O error "could not acquire lock" (EAGAIN from flock).
fn is_lock_contention(e: &sled::Error) -> bool {
    match e {
        sled::Error::Io(io) => {
            io.kind() == std::io::ErrorKind::WouldBlock
                || io.to_string().contains("could not acquire lock")
        }
        _ => false,
    }
}

impl InboxError {
    /// Someone else holds the inbox (its lock file, or sled's lock).
    pub fn is_contention(&self) -> bool {
        match self {
            Self::Locked { .. } => true,
            Self::Store(e) => is_lock_contention(e),
            _ => false,
        }
    }
}

/// A page of pending deliveries (non-consuming).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Page {
    /// In seq order.
    pub deliveries: Vec<Delivery>,
    /// The last seq the page covers (the request's `after` when empty).
    pub through_seq: u64,
    /// More pending deliveries follow.
    pub more: bool,
    /// Pending deliveries in all.
    pub pending_count: u64,
}

/// Where a Persona's inbox stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Counts {
    /// Highest seq assigned (0 = none yet).
    pub highest: u64,
    /// Acknowledged through.
    pub acked_through: u64,
    /// Stored and not acknowledged.
    pub pending: u64,
}

/// The inbox of every Persona of one gateway.
#[derive(Debug, Clone)]
pub struct Inbox {
    /// The open store. Every method holds a (recursive) read guard for its whole body, so
    /// [`Inbox::compact`] (the only writer) swaps in a compacted copy between operations,
    /// never inside one.
    stores: Arc<RwLock<Option<Stores>>>,
    /// Where the store lives (the compacted copy replaces it there).
    path: Arc<PathBuf>,
    /// Bytes on disk at the last count of the live records or compaction (0 after opening):
    /// [`Inbox::compact_if_wasteful`] counts again only once the files have doubled past it.
    baseline: Arc<AtomicU64>,
    /// Held (an exclusive `flock` on `<inbox>.lock`) while any handle is open: a compaction
    /// renames the store's directory, which no other process may have open meanwhile.
    _lock: Arc<std::fs::File>,
    /// Per Persona, the event ids of the last [`DEDUPE_WINDOW`] deliveries, loaded on first use.
    seen: Arc<Mutex<HashMap<String, SeenSlot>>>,
    dedupe_window: usize,
}

/// Runs `f`, which may block (a flush, or a wait while a compaction holds the store), without
/// stalling the async tasks around it: on a worker of a multi-thread runtime (the gateway's ear,
/// turn loop and mouth run there) the worker first hands its other tasks to another thread
/// ([`tokio::task::block_in_place`]); on a current-thread runtime (the CultNet service's own
/// thread, where waiting for the flush is the point of its group commit), on a blocking-pool
/// thread or outside any runtime it simply runs.
fn blocking<T>(f: impl FnOnce() -> T) -> T {
    use tokio::runtime::{Handle, RuntimeFlavor};
    match Handle::try_current().map(|h| h.runtime_flavor()) {
        Ok(RuntimeFlavor::MultiThread) => tokio::task::block_in_place(f),
        _ => f(),
    }
}

/// One open sled database and its trees.
#[derive(Debug)]
struct Stores {
    db: sled::Db,
    tree: sled::Tree,
    receipts: sled::Tree,
}

impl Stores {
    /// Writes what is in memory to disk (the one part of an inbox operation that waits for the
    /// disk: with sled's own flusher off, reads and writes stay in memory until this).
    fn flush(&self) -> Result<(), sled::Error> {
        blocking(|| self.db.flush()).map(drop)
    }

    fn open(path: &Path) -> Result<Self, sled::Error> {
        // Every write is flushed by us before it counts; sled's periodic background flush would
        // only compete with those flushes.
        let db = sled::Config::new()
            .path(path)
            .flush_every_ms(None)
            .mode(sled::Mode::HighThroughput)
            .open()?;
        Ok(Self {
            tree: db.open_tree("inbox")?,
            receipts: db.open_tree("receipts")?,
            db,
        })
    }
}

const CHUNK: u8 = b'c';
const IDS: u8 = b'x';
const META: u8 = b'm';
const ROOM: u8 = b'r';
const HELD: u8 = b'u';
/// CultNet Connect nonces used, by agent: `k` agent 0 nonce -> issued-at ms.
const NONCE: u8 = b'k';
/// Kinds of the first layout, converted by [`Inbox::open`].
const OLD_DELIVERY: u8 = b'd';
const OLD_EVENT: u8 = b'e';
const OLD_TIMELINE: u8 = b't';

/// Event ids remembered per Persona for deduplication. A sync replay repeats at most one
/// response and a gap fill at most `gap_fill_max` (1000) events, so this is ten times either.
pub const DEDUPE_WINDOW: usize = 10_000;

/// A Persona's dedupe set behind its own lock (`None` until loaded).
type SeenSlot = Arc<Mutex<Option<Seen>>>;

/// The dedupe set of one Persona, and its id records oldest first (key seq, id count).
#[derive(Debug, Default)]
struct Seen {
    ids: HashSet<Box<str>>,
    records: VecDeque<(u64, usize)>,
}

/// An `x` value: when it was stored (ms since the epoch; `None` in the first layout, which
/// stored the ids alone) and the ids.
fn decode_ids(k: &[u8], v: &[u8]) -> Result<(Option<u64>, Vec<String>), InboxError> {
    if let Ok((at, ids)) = rmp_serde::from_slice::<(u64, Vec<String>)>(v) {
        return Ok((Some(at), ids));
    }
    Ok((None, decode(k, v)?))
}

fn now_ms() -> u64 {
    u64::try_from(crate::clock::unix_ms()).unwrap_or(0)
}

/// Lines of recent timeline kept per room (enough for 20 lines of context plus a thread's).
pub const TIMELINE_CAP: usize = 64;

/// A line of a room's recent timeline: the room, the thread it belongs to, the line.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct TimelineLine {
    /// Room id.
    pub room_id: String,
    /// Thread root, for a thread message.
    pub thread: Option<String>,
    /// The line.
    pub line: wire::docs::ContextLine,
}

/// What one sync response writes besides its token (see [`Inbox::ingest_sync`]).
#[derive(Debug, Clone, Copy, Default)]
pub struct SyncWrite<'a> {
    /// New deliveries (duplicates by event id are dropped).
    pub deliveries: &'a [Delivery],
    /// Timeline lines for context.
    pub lines: &'a [TimelineLine],
    /// Events to hold until they decrypt (or their wait ends).
    pub hold: &'a [Held],
    /// Held event ids now resolved (delivered in this same batch, or given up).
    pub release: &'a [String],
    /// Events deleted (redacted), by room and event id: blanked ([`crate::event::DELETED`])
    /// in pending mail and its context and in the rooms' timelines, and no longer held.
    pub redacted: &'a [(String, String)],
    /// A response of a round that synced her operators' DMs and invites alone while her inbox
    /// was full: its token is not her position (the full sync resumes from the stored one and
    /// meets these events again, deduplicated), so it is not stored.
    pub partial: bool,
}

/// An event that could not be decrypted yet: retried each sync round, and delivered with a
/// placeholder text once its wait ends, never dropped.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Held {
    /// When it was first seen (ms since the epoch).
    pub since_ms: i64,
    /// The delivery it becomes if it never decrypts (placeholder text, context filled).
    pub delivery: Delivery,
}

fn room_key(persona: &str, room: &str) -> Vec<u8> {
    kkey(ROOM, persona, room.as_bytes())
}

fn kkey(kind: u8, persona: &str, rest: &[u8]) -> Vec<u8> {
    let mut k = Vec::with_capacity(2 + persona.len() + rest.len());
    k.push(kind);
    k.extend_from_slice(persona.as_bytes());
    k.push(0);
    k.extend_from_slice(rest);
    k
}

fn key(persona: &str, rest: &[u8]) -> Vec<u8> {
    kkey(META, persona, rest)
}

fn chunk_key(persona: &str, last_seq: u64) -> Vec<u8> {
    kkey(CHUNK, persona, &last_seq.to_be_bytes())
}

fn ids_key(persona: &str, last_seq: u64) -> Vec<u8> {
    kkey(IDS, persona, &last_seq.to_be_bytes())
}

/// Splits a key into its Persona and the rest (after the kind byte and the 0 separator).
fn split_key(k: &[u8]) -> Option<(&str, &[u8])> {
    let body = k.get(1..)?;
    let sep = body.iter().position(|b| *b == 0)?;
    let persona = std::str::from_utf8(&body[..sep]).ok()?;
    Some((persona, &body[sep + 1..]))
}

fn u64_of(v: &[u8]) -> u64 {
    let mut b = [0u8; 8];
    let n = v.len().min(8);
    b[8 - n..].copy_from_slice(&v[v.len() - n..]);
    u64::from_be_bytes(b)
}

fn encode<T: Serialize>(v: &T) -> Vec<u8> {
    // Deliveries and receipts hold strings, numbers and lists only: encoding cannot fail.
    rmp_serde::to_vec_named(v).unwrap_or_default()
}

fn decode<T: DeserializeOwned>(k: &[u8], v: &[u8]) -> Result<T, InboxError> {
    rmp_serde::from_slice(v).map_err(|e| InboxError::Corrupt {
        key: String::from_utf8_lossy(k).into_owned(),
        reason: e.to_string(),
    })
}

impl Inbox {
    /// Opens (or creates) the inbox at `path`. If another handle (or a process still exiting)
    /// holds the database lock, waits up to [`LOCK_WAIT`] for it: sled 0.34 releases the lock
    /// from a background thread after its `Db` is dropped (spacejam/sled#1289).
    pub fn open(path: &Path) -> Result<Self, InboxError> {
        let deadline = std::time::Instant::now() + LOCK_WAIT;
        loop {
            let contended = match Self::open_once(path) {
                Err(e) if e.is_contention() => e,
                other => return other,
            };
            if std::time::Instant::now() >= deadline {
                return Err(contended);
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
    }

    fn open_once(path: &Path) -> Result<Self, InboxError> {
        let lock = compact::lock(path)?;
        compact::recover(path)?;
        let inbox = Self {
            _lock: Arc::new(lock),
            stores: Arc::new(RwLock::new(Some(Stores::open(path)?))),
            path: Arc::new(path.to_owned()),
            // Nothing counted yet: the first check looks at the live share.
            baseline: Arc::new(AtomicU64::new(0)),
            seen: Arc::default(),
            dedupe_window: DEDUPE_WINDOW,
        };
        inbox.convert_first_layout()?;
        Ok(inbox)
    }

    /// The open store, for the length of one operation. Recursive: an operation calling
    /// another must not wait behind a compaction that waits for the first.
    /// While a compaction holds the store, the wait runs off the runtime (see [`blocking`]).
    fn stores(&self) -> Result<MappedRwLockReadGuard<'_, Stores>, InboxError> {
        let guard = match self.stores.try_read_recursive() {
            Some(guard) => guard,
            None => blocking(|| self.stores.read_recursive()),
        };
        RwLockReadGuard::try_map(guard, Option::as_ref).map_err(|_| InboxError::Closed)
    }

    /// A smaller dedupe window, for tests of its edge.
    #[cfg(test)]
    fn with_dedupe_window(mut self, window: usize) -> Self {
        self.dedupe_window = window;
        self
    }

    /// Converts keys of the first layout (`d` a delivery per key, `e` an event index entry per
    /// key, `t` a timeline line per key) into chunks, id records and room records, in one
    /// flushed batch, so an inbox written by an earlier build keeps everything it held.
    fn convert_first_layout(&self) -> Result<(), InboxError> {
        let st = self.stores()?;
        let mut ops = sled::Batch::default();
        let mut converted = 0usize;
        for item in st.tree.scan_prefix([OLD_DELIVERY]) {
            let (k, v) = item?;
            let Some((persona, rest)) = split_key(&k) else {
                continue;
            };
            ops.insert(
                chunk_key(persona, u64_of(rest)),
                encode(&[ByteBuf::from(v.to_vec())]),
            );
            ops.remove(k);
            converted += 1;
        }
        let mut ids: std::collections::BTreeMap<String, (u64, Vec<String>)> = Default::default();
        for item in st.tree.scan_prefix([OLD_EVENT]) {
            let (k, v) = item?;
            if let Some((persona, event_id)) = split_key(&k) {
                let entry = ids.entry(persona.to_owned()).or_default();
                entry.0 = entry.0.max(u64_of(&v));
                entry.1.push(String::from_utf8_lossy(event_id).into_owned());
            }
            ops.remove(k);
            converted += 1;
        }
        for (persona, (last, list)) in ids {
            ops.insert(ids_key(&persona, last), encode(&list));
        }
        let mut rooms: std::collections::BTreeMap<(String, String), Vec<TimelineLine>> =
            Default::default();
        for item in st.tree.scan_prefix([OLD_TIMELINE]) {
            let (k, v) = item?;
            if let Some((persona, _)) = split_key(&k) {
                let line: TimelineLine = decode(&k, &v)?;
                rooms
                    .entry((persona.to_owned(), line.room_id.clone()))
                    .or_default()
                    .push(line);
            }
            ops.remove(k);
            converted += 1;
        }
        for ((persona, room), mut lines) in rooms {
            let excess = lines.len().saturating_sub(TIMELINE_CAP);
            lines.drain(..excess);
            ops.insert(room_key(&persona, &room), encode(&lines));
        }
        if converted > 0 {
            st.tree.apply_batch(ops)?;
            st.flush()?;
            tracing::info!(keys = converted, "inbox converted from its first layout");
        }
        Ok(())
    }

    /// Runs `f` on the Persona's dedupe set, loading it from the id records on first use.
    /// Each Persona has its own lock, so one Persona's ingest does not wait for another's.
    fn with_seen<T>(
        &self,
        persona: &str,
        f: impl FnOnce(&mut Seen) -> Result<T, InboxError>,
    ) -> Result<T, InboxError> {
        let st = self.stores()?;
        let slot = {
            let mut all = self.seen.lock().unwrap_or_else(|e| e.into_inner());
            all.entry(persona.to_owned()).or_default().clone()
        };
        let mut slot = slot.lock().unwrap_or_else(|e| e.into_inner());
        if slot.is_none() {
            let mut seen = Seen::default();
            for item in st.tree.scan_prefix(kkey(IDS, persona, b"")) {
                let (k, v) = item?;
                let (_, list) = decode_ids(&k, &v)?;
                let last = split_key(&k).map_or(0, |(_, rest)| u64_of(rest));
                seen.records.push_back((last, list.len()));
                seen.ids
                    .extend(list.into_iter().map(String::into_boxed_str));
            }
            *slot = Some(seen);
        }
        let Some(seen) = slot.as_mut() else {
            return Err(InboxError::Corrupt {
                key: persona.to_owned(),
                reason: "dedupe set not loaded".into(),
            });
        };
        let out = f(seen);
        if out.is_err() {
            // What is in memory may now be ahead of the store: load it again next time.
            *slot = None;
        }
        out
    }

    /// Stores one sync response: each delivery whose event id is new gets the next seq; the
    /// next sync token is stored with them, atomically, and flushed before this returns.
    /// Returns the seqs assigned, in order (duplicates get none).
    pub fn ingest(
        &self,
        persona: &str,
        next_token: &str,
        batch: &[Delivery],
    ) -> Result<Vec<u64>, InboxError> {
        self.ingest_sync(
            persona,
            next_token,
            SyncWrite {
                deliveries: batch,
                ..SyncWrite::default()
            },
        )
    }

    /// [`Inbox::ingest`] with everything else a sync response changes, in the same atomic
    /// batch: timeline lines (each room keeps its last [`TIMELINE_CAP`]), events held back
    /// because they could not be decrypted yet, and held events now resolved.
    pub fn ingest_sync(
        &self,
        persona: &str,
        next_token: &str,
        write: SyncWrite<'_>,
    ) -> Result<Vec<u64>, InboxError> {
        let st = self.stores()?;
        let SyncWrite {
            deliveries: batch,
            lines,
            hold,
            release,
            redacted,
            partial,
        } = write;
        // Before the token moves on: a crash after this replays the sync, which blanks again.
        self.redact_pending(persona, redacted)?;
        self.with_seen(persona, |seen| {
            let next_key = key(persona, b"next_seq");
            let first = st.tree.get(&next_key)?.map(|v| u64_of(&v)).unwrap_or(1);
            let mut next = first;
            let mut ops = sled::Batch::default();
            let mut assigned = Vec::new();
            let mut chunk = Vec::new();
            let mut ids: Vec<&str> = Vec::new();
            for d in batch {
                if seen.ids.contains(d.event_id.as_str()) || ids.contains(&d.event_id.as_str()) {
                    continue;
                }
                let mut stored = d.clone();
                stored.seq = next;
                stored.persona = persona.to_owned();
                chunk.push(ByteBuf::from(encode(&stored)));
                ids.push(&d.event_id);
                assigned.push(next);
                next += 1;
            }
            for h in hold {
                let hk = kkey(HELD, persona, h.delivery.event_id.as_bytes());
                let delivered = seen.ids.contains(h.delivery.event_id.as_str())
                    || ids.contains(&h.delivery.event_id.as_str());
                // A replayed sync must not restart the wait of an event already held.
                if !delivered && st.tree.get(&hk)?.is_none() {
                    ops.insert(hk, encode(h));
                }
            }
            for event_id in release.iter().chain(redacted.iter().map(|(_, id)| id)) {
                ops.remove(kkey(HELD, persona, event_id.as_bytes()));
            }
            self.add_lines(persona, lines, redacted, &mut ops)?;
            if let Some(&last) = assigned.last() {
                ops.insert(chunk_key(persona, last), encode(&chunk));
                ops.insert(ids_key(persona, last), encode(&(now_ms(), &ids)));
                seen.records.push_back((last, ids.len()));
                seen.ids.extend(ids.iter().map(|id| Box::<str>::from(*id)));
                // Forget the oldest id records beyond the window.
                let mut total: usize = seen.records.iter().map(|(_, n)| n).sum();
                while let Some(&(old, n)) = seen.records.front() {
                    if total - n < self.dedupe_window {
                        break;
                    }
                    let k = ids_key(persona, old);
                    if let Some(v) = st.tree.get(&k)? {
                        let (_, list) = decode_ids(&k, &v)?;
                        for id in list {
                            seen.ids.remove(id.as_str());
                        }
                    }
                    ops.remove(k);
                    seen.records.pop_front();
                    total -= n;
                }
            }
            ops.insert(next_key, &next.to_be_bytes());
            if !partial {
                ops.insert(key(persona, b"token"), next_token.as_bytes());
            }
            st.tree.apply_batch(ops)?;
            st.flush()?;
            Ok(assigned)
        })
    }

    /// Appends timeline lines to their rooms' records (one record per room, its last
    /// [`TIMELINE_CAP`] lines) in `ops`, blanking the `redacted` ones.
    fn add_lines(
        &self,
        persona: &str,
        lines: &[TimelineLine],
        redacted: &[(String, String)],
        ops: &mut sled::Batch,
    ) -> Result<(), InboxError> {
        let mut per_room: std::collections::BTreeMap<&str, Vec<&TimelineLine>> = Default::default();
        for l in lines {
            per_room.entry(l.room_id.as_str()).or_default().push(l);
        }
        for (room, _) in redacted {
            per_room.entry(room.as_str()).or_default();
        }
        for (room, added) in per_room {
            let mut kept = self.timeline(persona, room)?;
            kept.extend(added.into_iter().cloned());
            for l in kept.iter_mut() {
                if redacted.iter().any(|(_, id)| *id == l.line.event_id) {
                    l.line.text = crate::event::DELETED.to_owned();
                }
            }
            // Lines read later for context (`/messages`) are older than those stored: keep the
            // record in time order (stable, so equal times keep their arrival order).
            kept.sort_by_key(|l| l.line.ts);
            let excess = kept.len().saturating_sub(TIMELINE_CAP);
            kept.drain(..excess);
            ops.insert(room_key(persona, room), encode(&kept));
        }
        Ok(())
    }

    /// Blanks the `redacted` events in pending mail: a delivery's text, and the lines of its
    /// context. Each chunk is swapped only if unchanged since it was read, and read again if
    /// it changed meanwhile (an ack that removed it wins: its mail is gone anyway).
    fn redact_pending(
        &self,
        persona: &str,
        redacted: &[(String, String)],
    ) -> Result<(), InboxError> {
        if redacted.is_empty() {
            return Ok(());
        }
        let st = self.stores()?;
        let gone = |id: &str| redacted.iter().any(|(_, r)| r == id);
        let from = self.counts(persona)?.acked_through.saturating_add(1);
        let keys: Vec<sled::IVec> = st
            .tree
            .range(chunk_key(persona, from)..=chunk_key(persona, u64::MAX))
            .keys()
            .collect::<Result<_, _>>()?;
        for k in keys {
            while let Some(v) = st.tree.get(&k)? {
                let chunk: Vec<ByteBuf> = decode(&k, &v)?;
                let mut changed = false;
                let mut out = Vec::with_capacity(chunk.len());
                for raw in chunk {
                    let mut d: Delivery = decode(&k, &raw)?;
                    let mut blanked = gone(&d.event_id);
                    if blanked {
                        d.text = crate::event::DELETED.to_owned();
                    }
                    for c in d.context.iter_mut().filter(|c| gone(&c.event_id)) {
                        c.text = crate::event::DELETED.to_owned();
                        blanked = true;
                    }
                    changed |= blanked;
                    out.push(if blanked {
                        ByteBuf::from(encode(&d))
                    } else {
                        raw
                    });
                }
                if !changed
                    || st
                        .tree
                        .compare_and_swap(&k, Some(&v), Some(encode(&out)))?
                        .is_ok()
                {
                    break;
                }
            }
        }
        Ok(())
    }

    /// The events held back because they could not be decrypted yet, oldest first by key.
    pub fn held(&self, persona: &str) -> Result<Vec<Held>, InboxError> {
        let st = self.stores()?;
        st.tree
            .scan_prefix(kkey(HELD, persona, b""))
            .map(|kv| {
                let (k, v) = kv?;
                decode(&k, &v)
            })
            .collect()
    }

    /// A room's stored recent timeline, oldest first.
    pub fn timeline(&self, persona: &str, room_id: &str) -> Result<Vec<TimelineLine>, InboxError> {
        let st = self.stores()?;
        let k = room_key(persona, room_id);
        Ok(match st.tree.get(&k)? {
            Some(v) => decode(&k, &v)?,
            None => Vec::new(),
        })
    }

    /// The rooms with a stored timeline.
    pub fn timeline_rooms(&self, persona: &str) -> Result<Vec<String>, InboxError> {
        let st = self.stores()?;
        st.tree
            .scan_prefix(kkey(ROOM, persona, b""))
            .keys()
            .map(|k| {
                let k = k?;
                Ok(split_key(&k)
                    .map(|(_, room)| String::from_utf8_lossy(room).into_owned())
                    .unwrap_or_default())
            })
            .collect()
    }

    /// The stored sync position (`None` before the first sync).
    pub fn sync_token(&self, persona: &str) -> Result<Option<String>, InboxError> {
        let st = self.stores()?;
        Ok(st
            .tree
            .get(key(persona, b"token"))?
            .map(|v| String::from_utf8_lossy(&v).into_owned()))
    }

    /// Highest, acknowledged and pending counts. Seqs are dense and every seq after the ack
    /// watermark is stored but those retired into context ([`retire`]), so pending is their
    /// difference less the retired.
    pub fn counts(&self, persona: &str) -> Result<Counts, InboxError> {
        let st = self.stores()?;
        let highest = st
            .tree
            .get(key(persona, b"next_seq"))?
            .map(|v| u64_of(&v))
            .unwrap_or(1)
            .saturating_sub(1);
        let acked_through = st
            .tree
            .get(key(persona, b"acked"))?
            .map(|v| u64_of(&v))
            .unwrap_or(0);
        let holes = retire::holes_above(&self.retired_ranges(&st, persona)?, acked_through);
        Ok(Counts {
            highest,
            acked_through,
            pending: highest.saturating_sub(acked_through).saturating_sub(holes),
        })
    }

    /// Pending deliveries with seq > `after`, at most `limit`, and (with `reply_bytes`) no more
    /// than fit that many encoded bytes. Never drops a delivery to fit: the page stops before
    /// it, except a first delivery that alone is too big, whose text is cut and flagged.
    pub fn pending(
        &self,
        persona: &str,
        after: u64,
        limit: usize,
        reply_bytes: Option<usize>,
    ) -> Result<Page, InboxError> {
        let st = self.stores()?;
        let counts = self.counts(persona)?;
        let from = after.max(counts.acked_through).saturating_add(1);
        let mut deliveries = Vec::new();
        let mut bytes = 0usize;
        let mut full = false;
        // The chunk holding `from` is the first whose last seq is at or after it.
        'chunks: for item in st
            .tree
            .range(chunk_key(persona, from)..=chunk_key(persona, u64::MAX))
        {
            let (k, v) = item?;
            let chunk: Vec<ByteBuf> = decode(&k, &v)?;
            // Seqs in a chunk are dense, ending at the key's: start at `from` without decoding
            // the deliveries before it (checked; a chunk that is not dense is walked whole).
            let last = split_key(&k).map_or(0, |(_, rest)| u64_of(rest));
            let first = (last + 1).saturating_sub(chunk.len() as u64);
            let mut skip = usize::try_from(from.saturating_sub(first)).unwrap_or(0);
            if skip > 0 {
                let at: Option<Delivery> = chunk.get(skip).and_then(|raw| decode(&k, raw).ok());
                if at.is_none_or(|d| d.seq != from) {
                    skip = 0;
                }
            }
            for raw in chunk.into_iter().skip(skip) {
                if deliveries.len() >= limit.max(1) {
                    full = true;
                    break 'chunks;
                }
                let mut d: Delivery = decode(&k, &raw)?;
                if d.seq < from {
                    continue;
                }
                if let Some(cap) = reply_bytes {
                    let size = raw.len();
                    if bytes + size > cap {
                        if deliveries.is_empty() {
                            // Alone too big: cut the text (at a char boundary) and say so.
                            let keep = cap.saturating_sub(size - d.text.len());
                            crate::event::truncate_text(&mut d.text, keep);
                            d.truncated = true;
                            deliveries.push(d);
                        }
                        full = true;
                        break 'chunks;
                    }
                    bytes += size;
                }
                deliveries.push(d);
            }
        }
        let through_seq = deliveries.last().map_or(after, |d| d.seq);
        let last_live = retire::last_live(&self.retired_ranges(&st, persona)?, counts.highest);
        Ok(Page {
            more: full || through_seq.max(from - 1) < last_live,
            deliveries,
            through_seq,
            pending_count: counts.pending,
        })
    }

    /// Acknowledges everything through `through`: idempotent; beyond the highest assigned seq
    /// it is refused and nothing changes. Flushed before it returns. A chunk is removed once
    /// all of it is acknowledged; until then the watermark hides its acknowledged part.
    pub fn ack(&self, persona: &str, through: u64) -> Result<Counts, InboxError> {
        let (after, changed) = self.ack_unflushed(persona, through)?;
        if changed {
            self.flush()?;
        }
        Ok(after)
    }

    /// [`Inbox::ack`] without the flush, for group commit: the ack is visible at once, and
    /// durable after the next [`Inbox::flush`]; nobody may be told it is done before that.
    /// Says whether it wrote anything.
    pub fn ack_unflushed(&self, persona: &str, through: u64) -> Result<(Counts, bool), InboxError> {
        let st = self.stores()?;
        let mut ops = sled::Batch::default();
        let (after, changed) = self.ack_ops(persona, through, &mut ops)?;
        if changed {
            st.tree.apply_batch(ops)?;
        }
        Ok((after, changed))
    }

    /// Makes every write so far durable (one fsync for however many acks came before it).
    pub fn flush(&self) -> Result<(), InboxError> {
        let st = self.stores()?;
        st.flush()?;
        Ok(())
    }

    /// A session value of the Persona (`s:NAME` in the meta keys): session id, generation,
    /// the batch in flight.
    pub fn session_value(&self, persona: &str, name: &str) -> Result<Option<String>, InboxError> {
        let st = self.stores()?;
        Ok(st
            .tree
            .get(key(persona, format!("s:{name}").as_bytes()))?
            .map(|v| String::from_utf8_lossy(&v).into_owned()))
    }

    /// Sets (or with `None` removes) a session value; flushed before it returns.
    pub fn set_session_value(
        &self,
        persona: &str,
        name: &str,
        value: Option<&str>,
    ) -> Result<(), InboxError> {
        self.set_session_values(persona, &[(name, value)])
    }

    /// Sets (or with `None` removes) several session values at once: all or none of them,
    /// flushed once before it returns.
    pub fn set_session_values(
        &self,
        persona: &str,
        values: &[(&str, Option<&str>)],
    ) -> Result<(), InboxError> {
        let st = self.stores()?;
        let mut batch = sled::Batch::default();
        for (name, value) in values {
            let k = key(persona, format!("s:{name}").as_bytes());
            match value {
                Some(v) => batch.insert(k, v.as_bytes()),
                None => batch.remove(k),
            }
        }
        st.tree.apply_batch(batch)?;
        st.flush()?;
        Ok(())
    }

    /// The stored receipt of a send request, if it was sent before.
    pub fn receipt(
        &self,
        persona: &str,
        request_id: &str,
    ) -> Result<Option<SendReceipt>, InboxError> {
        Ok(self
            .receipt_with_digest(persona, request_id)?
            .map(|(r, _)| r))
    }

    /// Remembers a CultNet Connect nonce `agent` used from `from`, signed at `issued_at_ms`
    /// (flushed: a gateway restarted within the Connect's time window must still refuse its
    /// replay from anywhere else).
    pub fn remember_nonce(
        &self,
        agent: &str,
        nonce: &str,
        issued_at_ms: u64,
        from: std::net::SocketAddr,
    ) -> Result<(), InboxError> {
        let st = self.stores()?;
        let mut v = issued_at_ms.to_be_bytes().to_vec();
        v.extend_from_slice(from.to_string().as_bytes());
        st.tree.insert(kkey(NONCE, agent, nonce.as_bytes()), v)?;
        st.flush()?;
        Ok(())
    }

    /// The Connect nonces signed at or after `since_ms`, as (agent, nonce, issued at, the
    /// address that used it); older ones are forgotten.
    #[allow(clippy::type_complexity)]
    pub fn recent_nonces(
        &self,
        since_ms: u64,
    ) -> Result<Vec<(String, String, u64, Option<std::net::SocketAddr>)>, InboxError> {
        let st = self.stores()?;
        let mut out = Vec::new();
        let mut old = sled::Batch::default();
        for item in st.tree.scan_prefix([NONCE]) {
            let (k, v) = item?;
            let at = u64_of(&v);
            let from = v
                .get(8..)
                .and_then(|b| std::str::from_utf8(b).ok())
                .and_then(|s| s.parse().ok());
            match split_key(&k) {
                Some((agent, nonce)) if at >= since_ms => out.push((
                    agent.to_owned(),
                    String::from_utf8_lossy(nonce).into_owned(),
                    at,
                    from,
                )),
                _ => old.remove(k),
            }
        }
        st.tree.apply_batch(old)?;
        Ok(out)
    }

    /// Stores a send receipt (flushed) so a repeat of the request is answered without sending.
    pub fn store_receipt(&self, persona: &str, receipt: &SendReceipt) -> Result<(), InboxError> {
        self.put_receipt(persona, receipt, encode(&(now_ms(), receipt)))
    }

    /// [`Inbox::store_receipt`] with the digest of the message sent, so a repeat of its request
    /// id with another message can be told apart.
    pub fn store_receipt_with_digest(
        &self,
        persona: &str,
        receipt: &SendReceipt,
        digest: &str,
    ) -> Result<(), InboxError> {
        self.put_receipt(persona, receipt, encode(&(now_ms(), receipt, digest)))
    }

    fn put_receipt(
        &self,
        persona: &str,
        receipt: &SendReceipt,
        record: Vec<u8>,
    ) -> Result<(), InboxError> {
        let st = self.stores()?;
        st.receipts
            .insert(key(persona, receipt.request_id.as_bytes()), record)?;
        st.flush()?;
        Ok(())
    }

    /// The receipt of `request_id` and the digest of its message, when it was kept (receipts
    /// stored before digests were kept have none).
    pub fn receipt_with_digest(
        &self,
        persona: &str,
        request_id: &str,
    ) -> Result<Option<(SendReceipt, Option<String>)>, InboxError> {
        let st = self.stores()?;
        let k = key(persona, request_id.as_bytes());
        let Some(v) = st.receipts.get(&k)? else {
            return Ok(None);
        };
        decode_receipt(&k, &v).map(|(_, r, digest)| Some((r, digest)))
    }
}

pub mod aside;
pub mod compact;
pub mod notes;
pub mod outbox;
pub mod retention;
pub mod retire;

pub use aside::SetAside;
pub use compact::{CompactWhen, Compacted};
pub use notes::{Note, NotePut};
pub use outbox::{ExtensionPage, TurnCommit};
pub use retention::{Pruned, Retention};
pub use retire::Retired;

/// A stored receipt: when it was stored (`None` in the first layout), the receipt, and the
/// digest of its message (kept since repeats with another message are refused).
fn decode_receipt(
    k: &[u8],
    v: &[u8],
) -> Result<(Option<u64>, SendReceipt, Option<String>), InboxError> {
    if let Ok((at, r, digest)) = rmp_serde::from_slice::<(u64, SendReceipt, String)>(v) {
        return Ok((Some(at), r, Some(digest)));
    }
    if let Ok((at, r)) = rmp_serde::from_slice::<(u64, SendReceipt)>(v) {
        return Ok((Some(at), r, None));
    }
    Ok((None, decode(k, v)?, None))
}

#[cfg(test)]
mod tests;
