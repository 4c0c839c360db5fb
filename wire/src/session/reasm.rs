//! Fragment reassembly with hard limits: a bounded number of sets, bounded bytes, a timeout.
//!
//! Invariant: `sets.len() <= max_sets`; `bytes` is the sum over all sets of their parts'
//! payload plus [`ITEM_OVERHEAD`] per part, and never exceeds `max_bytes`.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};

use super::recv::ITEM_OVERHEAD;
use super::seq;
use crate::packet::Fragment;

#[derive(Debug)]
struct Set {
    channel: Arc<str>,
    id: u16,
    count: u16,
    parts: BTreeMap<u16, Bytes>,
    payload_bytes: usize,
    started: Instant,
    max_seq: u32,
}

/// Why a fragment was not taken.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum FragError {
    /// No room for another set or more bytes now: drop it unacknowledged, the sender resends.
    Full,
    /// The fragment contradicts its set or makes it exceed the maximum payload.
    Misbehaved(&'static str),
}

/// A reassembled frame and the highest sequence among its fragments.
#[derive(Debug)]
pub(crate) struct Done {
    pub(crate) payload: Bytes,
    pub(crate) max_seq: u32,
}

#[derive(Debug)]
pub(crate) struct Reassembly {
    sets: Vec<Set>,
    bytes: usize,
    max_sets: usize,
    max_bytes: usize,
    max_payload: usize,
}

impl Reassembly {
    pub(crate) fn new(max_sets: usize, max_bytes: usize, max_payload: usize) -> Self {
        Self {
            sets: Vec::new(),
            bytes: 0,
            max_sets,
            max_bytes,
            max_payload,
        }
    }

    /// Bytes held, overhead included.
    pub(crate) fn bytes(&self) -> usize {
        self.bytes
    }

    /// Takes one fragment; returns the whole frame once its last fragment arrived.
    pub(crate) fn insert(
        &mut self,
        now: Instant,
        channel: &Arc<str>,
        frag: Fragment,
        s: u32,
        payload: &[u8],
    ) -> Result<Option<Done>, FragError> {
        if frag.count == 0 || frag.index >= frag.count {
            return Err(FragError::Misbehaved("fragment index outside its count"));
        }
        let cost = payload.len() + ITEM_OVERHEAD;
        let pos = self
            .sets
            .iter()
            .position(|set| set.id == frag.id && *set.channel == **channel);
        let pos = match pos {
            Some(p) => p,
            None => {
                if self.sets.len() >= self.max_sets {
                    return Err(FragError::Full);
                }
                self.sets.push(Set {
                    channel: channel.clone(),
                    id: frag.id,
                    count: frag.count,
                    parts: BTreeMap::new(),
                    payload_bytes: 0,
                    started: now,
                    max_seq: s,
                });
                self.sets.len() - 1
            }
        };
        let set = &mut self.sets[pos];
        if set.count != frag.count {
            return Err(FragError::Misbehaved("fragment count changed within a set"));
        }
        if set.parts.contains_key(&frag.index) {
            return Ok(None);
        }
        if set.payload_bytes + payload.len() > self.max_payload {
            let set = self.sets.swap_remove(pos);
            self.bytes -= set
                .parts
                .values()
                .map(|p| p.len() + ITEM_OVERHEAD)
                .sum::<usize>();
            return Err(FragError::Misbehaved(
                "fragmented frame exceeds the maximum payload",
            ));
        }
        if self.bytes + cost > self.max_bytes {
            if set.parts.is_empty() {
                self.sets.swap_remove(pos);
            }
            return Err(FragError::Full);
        }
        set.parts
            .insert(frag.index, Bytes::copy_from_slice(payload));
        set.payload_bytes += payload.len();
        self.bytes += cost;
        if s != 0 && seq::after(s, set.max_seq) {
            set.max_seq = s;
        }
        if set.parts.len() < set.count as usize {
            return Ok(None);
        }
        let set = self.sets.swap_remove(pos);
        self.bytes -= set.payload_bytes + set.parts.len() * ITEM_OVERHEAD;
        let mut whole = BytesMut::with_capacity(set.payload_bytes);
        for part in set.parts.values() {
            whole.extend_from_slice(part);
        }
        Ok(Some(Done {
            payload: whole.freeze(),
            max_seq: set.max_seq,
        }))
    }

    /// When the oldest set times out.
    pub(crate) fn next_deadline(&self, timeout: Duration) -> Option<Instant> {
        self.sets.iter().map(|s| s.started + timeout).min()
    }

    /// Drops sets older than `timeout`; returns how many.
    pub(crate) fn expire(&mut self, now: Instant, timeout: Duration) -> usize {
        let before = self.sets.len();
        let mut freed = 0;
        self.sets.retain(|s| {
            let keep = now < s.started + timeout;
            if !keep {
                freed += s.payload_bytes + s.parts.len() * ITEM_OVERHEAD;
            }
            keep
        });
        self.bytes -= freed;
        before - self.sets.len()
    }
}
