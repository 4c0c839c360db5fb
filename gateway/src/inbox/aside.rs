//! Batches set aside: mail the model API kept refusing (or that kept failing), taken out of her
//! pending run so later mail flows, and kept whole until her operator retries it (it comes
//! back as new mail, after what is pending) or drops it.
//!
//! Keys (see [`crate::inbox`] for the layout): `a` persona, first seq -> a [`SetAside`].

use serde::{Deserialize, Serialize};
use serde_bytes::ByteBuf;
use wire::docs::Delivery;

use super::{chunk_key, decode, encode, key, kkey, u64_of, Counts, Inbox, InboxError};

const ASIDE: u8 = b'a';

fn aside_key(persona: &str, id: u64) -> Vec<u8> {
    kkey(ASIDE, persona, &id.to_be_bytes())
}

/// A batch set aside.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SetAside {
    /// Its id: the first seq it had.
    pub id: u64,
    /// Its deliveries, as they were.
    pub deliveries: Vec<Delivery>,
    /// Why (the API's refusal, the last failure).
    pub why: String,
    /// When (ms since the epoch).
    pub at_ms: i64,
    /// She was told of it (in a note of a turn that went through).
    #[serde(default)]
    pub told: bool,
}

impl Inbox {
    /// Sets `batch` (a prefix of her pending mail) aside in one flushed batch: kept under its
    /// first seq, acknowledged, no longer in flight.
    pub fn set_aside(
        &self,
        persona: &str,
        batch: &[Delivery],
        why: &str,
        at_ms: i64,
    ) -> Result<Counts, InboxError> {
        let st = self.stores()?;
        let (Some(first), Some(last)) = (batch.first(), batch.last()) else {
            return self.counts(persona);
        };
        let record = SetAside {
            id: first.seq,
            deliveries: batch.to_vec(),
            why: why.to_owned(),
            at_ms,
            told: false,
        };
        let mut ops = sled::Batch::default();
        ops.insert(aside_key(persona, first.seq), encode(&record));
        let (counts, _) = self.ack_ops(persona, last.seq, &mut ops)?;
        ops.remove(key(persona, b"s:inflight"));
        ops.remove(key(persona, b"s:inflight_notes"));
        st.tree.apply_batch(ops)?;
        st.flush()?;
        Ok(counts)
    }

    /// Her batches set aside, oldest first.
    pub fn set_aside_list(&self, persona: &str) -> Result<Vec<SetAside>, InboxError> {
        let st = self.stores()?;
        st.tree
            .scan_prefix(kkey(ASIDE, persona, b""))
            .map(|kv| {
                let (k, v) = kv?;
                decode(&k, &v)
            })
            .collect()
    }

    /// Marks her set-aside batches as told to her.
    pub fn set_aside_told(&self, persona: &str, ids: &[u64]) -> Result<(), InboxError> {
        let st = self.stores()?;
        for id in ids {
            let k = aside_key(persona, *id);
            if let Some(v) = st.tree.get(&k)? {
                let mut a: SetAside = decode(&k, &v)?;
                a.told = true;
                // Lost to a concurrent retry or drop: then it is gone anyway.
                let _ = st.tree.compare_and_swap(&k, Some(&v), Some(encode(&a)))?;
            }
        }
        st.flush()?;
        Ok(())
    }

    /// Drops set-aside batch `id`; whether there was one.
    pub fn drop_set_aside(&self, persona: &str, id: u64) -> Result<bool, InboxError> {
        let st = self.stores()?;
        let gone = st.tree.remove(aside_key(persona, id))?.is_some();
        st.flush()?;
        Ok(gone)
    }

    /// Puts set-aside batch `id` back into her mail, after what is pending, with new seqs (seqs
    /// are never reused), in one flushed batch; the new seqs (`None` when there is no such
    /// batch).
    pub fn retry_set_aside(&self, persona: &str, id: u64) -> Result<Option<Vec<u64>>, InboxError> {
        let st = self.stores()?;
        let k = aside_key(persona, id);
        // Under the dedupe set's lock: the ear's ingest reads and moves the seq counter too.
        self.with_seen(persona, |_| {
            let Some(v) = st.tree.get(&k)? else {
                return Ok(None);
            };
            let a: SetAside = decode(&k, &v)?;
            let next_key = key(persona, b"next_seq");
            let mut next = st.tree.get(&next_key)?.map_or(1, |v| u64_of(&v));
            let mut chunk = Vec::with_capacity(a.deliveries.len());
            let mut seqs = Vec::with_capacity(a.deliveries.len());
            for d in &a.deliveries {
                let mut d = d.clone();
                d.seq = next;
                chunk.push(ByteBuf::from(encode(&d)));
                seqs.push(next);
                next += 1;
            }
            let mut ops = sled::Batch::default();
            if let Some(&last) = seqs.last() {
                ops.insert(chunk_key(persona, last), encode(&chunk));
            }
            ops.insert(next_key, &next.to_be_bytes());
            ops.remove(k.clone());
            st.tree.apply_batch(ops)?;
            st.flush()?;
            Ok(Some(seqs))
        })
    }
}
