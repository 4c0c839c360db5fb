//! The durable inbox: what was said to each Persona, kept until it is acknowledged.
//!
//! One sled tree `inbox` holds every Persona; each key starts with a kind byte and the Persona id:
//! - `d` persona, seq -> delivery (MessagePack)
//! - `e` persona, event id -> seq (deduplication; kept after ack, because sync is
//!   at-least-once and may hand an acknowledged event back)
//! - `m` persona, name -> value (`next_seq`, `acked`, `token`, `tl_next`, and `s:NAME` for
//!   the session's values)
//! - `u` persona, event id -> an event held until it decrypts ([`Held`])
//! - `t` persona, room id, counter -> timeline line (the room's recent lines, for context;
//!   trimmed to the last [`TIMELINE_CAP`] per room by each later sync response)
//!
//! and a tree `receipts`: persona, request id -> send receipt.
//!
//! [`Inbox::ingest`] stores one sync response's new deliveries and its next sync token as ONE
//! atomic batch and flushes before returning: a delivery is visible (to [`Inbox::pending`])
//! only once it is on disk, and the token is never ahead of what it covers. Seqs are per
//! Persona, monotonic, never reused, and survive restarts.
//!
//! Invariant: one task ingests for a Persona (its ear): `ingest` reads the event index and the
//! seq counter, then writes one batch. Acks may run concurrently (they touch other keys).
//! A single tree with `apply_batch` is several times faster than a sled transaction across
//! trees (README, inbox benchmark).

use std::path::Path;

use serde::{de::DeserializeOwned, Serialize};
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
    db: sled::Db,
    tree: sled::Tree,
    receipts: sled::Tree,
}

const DELIVERY: u8 = b'd';
const EVENT: u8 = b'e';
const META: u8 = b'm';
const TIMELINE: u8 = b't';
const HELD: u8 = b'u';

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

fn room_key(persona: &str, room: &str, counter: Option<u64>) -> Vec<u8> {
    let mut rest = room.as_bytes().to_vec();
    rest.push(0);
    if let Some(c) = counter {
        rest.extend_from_slice(&c.to_be_bytes());
    }
    kkey(TIMELINE, persona, &rest)
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

fn seq_key(persona: &str, seq: u64) -> Vec<u8> {
    kkey(DELIVERY, persona, &seq.to_be_bytes())
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
            match Self::open_once(path) {
                Err(InboxError::Store(e))
                    if is_lock_contention(&e) && std::time::Instant::now() < deadline =>
                {
                    std::thread::sleep(std::time::Duration::from_millis(10));
                }
                other => return other,
            }
        }
    }

    fn open_once(path: &Path) -> Result<Self, InboxError> {
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
        let SyncWrite {
            deliveries: batch,
            lines,
            hold,
            release,
        } = write;
        let next_key = key(persona, b"next_seq");
        let mut next = self.tree.get(&next_key)?.map(|v| u64_of(&v)).unwrap_or(1);
        let mut batch_ops = sled::Batch::default();
        let mut assigned = Vec::new();
        let mut fresh = std::collections::HashSet::new();
        for d in batch {
            let ek = kkey(EVENT, persona, d.event_id.as_bytes());
            if !fresh.insert(d.event_id.as_str()) || self.tree.get(&ek)?.is_some() {
                continue;
            }
            let seq = next;
            next += 1;
            let mut stored = d.clone();
            stored.seq = seq;
            stored.persona = persona.to_owned();
            batch_ops.insert(seq_key(persona, seq), encode(&stored));
            batch_ops.insert(ek, &seq.to_be_bytes());
            assigned.push(seq);
        }
        if !lines.is_empty() {
            let tl_key = key(persona, b"tl_next");
            let mut counter = self.tree.get(&tl_key)?.map(|v| u64_of(&v)).unwrap_or(0);
            let mut per_room: std::collections::BTreeMap<&str, usize> = Default::default();
            for l in lines {
                batch_ops.insert(room_key(persona, &l.room_id, Some(counter)), encode(l));
                counter += 1;
                *per_room.entry(l.room_id.as_str()).or_default() += 1;
            }
            batch_ops.insert(tl_key, &counter.to_be_bytes());
            for (room, added) in per_room {
                let old: Vec<_> = self
                    .tree
                    .scan_prefix(room_key(persona, room, None))
                    .keys()
                    .collect::<Result<_, _>>()?;
                let total = old.len() + added;
                for k in old.into_iter().take(total.saturating_sub(TIMELINE_CAP)) {
                    batch_ops.remove(k);
                }
            }
        }
        for h in hold {
            let hk = kkey(HELD, persona, h.delivery.event_id.as_bytes());
            let delivered = self
                .tree
                .get(kkey(EVENT, persona, h.delivery.event_id.as_bytes()))?
                .is_some();
            // A replayed sync must not restart the wait of an event already held.
            if !delivered && self.tree.get(&hk)?.is_none() {
                batch_ops.insert(hk, encode(h));
            }
        }
        for event_id in release {
            batch_ops.remove(kkey(HELD, persona, event_id.as_bytes()));
        }
        batch_ops.insert(next_key, &next.to_be_bytes());
        batch_ops.insert(key(persona, b"token"), next_token.as_bytes());
        self.tree.apply_batch(batch_ops)?;
        self.db.flush()?;
        Ok(assigned)
    }

    /// The events held back because they could not be decrypted yet, oldest first by key.
    pub fn held(&self, persona: &str) -> Result<Vec<Held>, InboxError> {
        self.tree
            .scan_prefix(kkey(HELD, persona, b""))
            .map(|kv| {
                let (k, v) = kv?;
                decode(&k, &v)
            })
            .collect()
    }

    /// A room's stored recent timeline, oldest first.
    pub fn timeline(&self, persona: &str, room_id: &str) -> Result<Vec<TimelineLine>, InboxError> {
        self.tree
            .scan_prefix(room_key(persona, room_id, None))
            .map(|kv| {
                let (k, v) = kv?;
                decode(&k, &v)
            })
            .collect()
    }

    /// The rooms with a stored timeline.
    pub fn timeline_rooms(&self, persona: &str) -> Result<Vec<String>, InboxError> {
        let prefix = kkey(TIMELINE, persona, b"");
        let mut rooms: Vec<String> = Vec::new();
        for k in self.tree.scan_prefix(&prefix).keys() {
            let k = k?;
            let rest = &k[prefix.len()..];
            let room = rest.split(|b| *b == 0).next().unwrap_or_default();
            let room = String::from_utf8_lossy(room).into_owned();
            if rooms.last() != Some(&room) {
                rooms.push(room);
            }
        }
        Ok(rooms)
    }

    /// The stored sync position (`None` before the first sync).
    pub fn sync_token(&self, persona: &str) -> Result<Option<String>, InboxError> {
        Ok(self
            .tree
            .get(key(persona, b"token"))?
            .map(|v| String::from_utf8_lossy(&v).into_owned()))
    }

    /// Highest, acknowledged and pending counts.
    pub fn counts(&self, persona: &str) -> Result<Counts, InboxError> {
        let highest = self
            .tree
            .get(key(persona, b"next_seq"))?
            .map(|v| u64_of(&v))
            .unwrap_or(1)
            - 1;
        let acked_through = self
            .tree
            .get(key(persona, b"acked"))?
            .map(|v| u64_of(&v))
            .unwrap_or(0);
        let pending = self.tree.scan_prefix(kkey(DELIVERY, persona, b"")).count() as u64;
        Ok(Counts {
            highest,
            acked_through,
            pending,
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
        let counts = self.counts(persona)?;
        let mut deliveries = Vec::new();
        let mut bytes = 0usize;
        let mut more = false;
        for item in self
            .tree
            .range(seq_key(persona, after.saturating_add(1))..seq_key(persona, u64::MAX))
        {
            let (k, v) = item?;
            if deliveries.len() >= limit.max(1) {
                more = true;
                break;
            }
            let mut d: Delivery = decode(&k, &v)?;
            if let Some(cap) = reply_bytes {
                let size = v.len();
                if bytes + size > cap {
                    if deliveries.is_empty() {
                        // Alone too big: cut the text (at a char boundary) and say so.
                        let keep = cap.saturating_sub(size - d.text.len()).min(d.text.len());
                        let cut = (0..=keep)
                            .rev()
                            .find(|&i| d.text.is_char_boundary(i))
                            .unwrap_or(0);
                        d.text.truncate(cut);
                        d.truncated = true;
                        deliveries.push(d);
                    }
                    more = true;
                    break;
                }
                bytes += size;
            }
            deliveries.push(d);
        }
        if !more && deliveries.len() >= limit.max(1) {
            more = self
                .tree
                .range(
                    seq_key(persona, deliveries.last().map_or(after, |d| d.seq) + 1)
                        ..seq_key(persona, u64::MAX),
                )
                .next()
                .is_some();
        }
        let through_seq = deliveries.last().map_or(after, |d| d.seq);
        Ok(Page {
            deliveries,
            through_seq,
            more,
            pending_count: counts.pending,
        })
    }

    /// Acknowledges everything through `through`: idempotent; beyond the highest assigned seq
    /// it is refused and nothing changes. Flushed before it returns.
    pub fn ack(&self, persona: &str, through: u64) -> Result<Counts, InboxError> {
        let c = self.counts(persona)?;
        if through > c.highest {
            return Err(InboxError::AckBeyondHighest {
                through,
                highest: c.highest,
            });
        }
        if through <= c.acked_through {
            return Ok(c);
        }
        let mut ops = sled::Batch::default();
        let mut removed = 0;
        for k in self
            .tree
            .range(seq_key(persona, 0)..=seq_key(persona, through))
            .keys()
        {
            ops.remove(k?);
            removed += 1;
        }
        ops.insert(key(persona, b"acked"), &through.to_be_bytes());
        self.tree.apply_batch(ops)?;
        self.db.flush()?;
        Ok(Counts {
            highest: c.highest,
            acked_through: through,
            pending: c.pending - removed,
        })
    }

    /// A session value of the Persona (`s:NAME` in the meta keys): session id, generation,
    /// the batch in flight.
    pub fn session_value(&self, persona: &str, name: &str) -> Result<Option<String>, InboxError> {
        Ok(self
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
        let k = key(persona, format!("s:{name}").as_bytes());
        match value {
            Some(v) => self.tree.insert(k, v.as_bytes())?,
            None => self.tree.remove(k)?,
        };
        self.db.flush()?;
        Ok(())
    }

    /// The stored receipt of a send request, if it was sent before.
    pub fn receipt(
        &self,
        persona: &str,
        request_id: &str,
    ) -> Result<Option<SendReceipt>, InboxError> {
        let k = key(persona, request_id.as_bytes());
        self.receipts.get(&k)?.map(|v| decode(&k, &v)).transpose()
    }

    /// Stores a send receipt (flushed) so a repeat of the request is answered without sending.
    pub fn store_receipt(&self, persona: &str, receipt: &SendReceipt) -> Result<(), InboxError> {
        self.receipts
            .insert(key(persona, receipt.request_id.as_bytes()), encode(receipt))?;
        self.db.flush()?;
        Ok(())
    }
}

#[cfg(test)]
mod tests;
