//! The outbox of her replies' extension fields (`start_self_run`, `remember`, ... as her
//! `reply_schema_file` names them), and the commit that ends a turn.
//!
//! Keys in the `inbox` tree:
//! - `o` persona, seq -> a [`ReplyExtension`] (removed once acknowledged)
//! - `m` persona, `ext_next` / `ext_acked` -> the next seq and the ack watermark
//!
//! [`Inbox::commit_turn`] writes, in ONE flushed sled batch, the ack of the turn's deliveries,
//! the removal of the notes it showed, its extension fields and the session values that go
//! with it (what her session has seen, a correction for her next batch): a turn either
//! happened in the store (mail acked, notes shown, extensions waiting for a client) or not at
//! all, so a crash between the reply and the commit retries the whole turn, and its fields
//! are stored once.

use wire::docs::ReplyExtension;

use super::notes::note_key;
use super::{chunk_key, decode, encode, key, kkey, u64_of, Counts, Inbox, InboxError};

const OUT: u8 = b'o';

fn out_key(persona: &str, seq: u64) -> Vec<u8> {
    kkey(OUT, persona, &seq.to_be_bytes())
}

/// What a finished turn commits.
#[derive(Debug, Clone, Default)]
pub struct TurnCommit<'a> {
    /// Acknowledge deliveries through this seq (none for a turn on notes alone).
    pub ack_through: Option<u64>,
    /// The notes it showed (their seqs).
    pub notes_shown: &'a [u64],
    /// The turn's id (stable across its retries).
    pub turn_id: &'a str,
    /// Its reply's extension fields, in reply order.
    pub extensions: &'a [(String, serde_json::Value)],
    /// When it ended (ms since the epoch; kept as the session value `last_turn_ms`).
    pub at_ms: i64,
    /// Session values set (or with `None` removed) with the turn, as
    /// [`Inbox::set_session_values`] would.
    pub values: &'a [(&'a str, Option<&'a str>)],
}

/// A page of the outbox.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExtensionPage {
    /// In seq order.
    pub extensions: Vec<ReplyExtension>,
    /// The last seq the page covers (the request's `after` when empty).
    pub through_seq: u64,
    /// More follow.
    pub more: bool,
    /// Pending in all.
    pub pending_count: u64,
}

impl Inbox {
    /// Acks the deliveries through `through` into `ops` (see [`Inbox::ack`]): the counts after,
    /// and whether `ops` now holds anything (nothing when `through` was acknowledged already).
    pub(super) fn ack_ops(
        &self,
        persona: &str,
        through: u64,
        ops: &mut sled::Batch,
    ) -> Result<(Counts, bool), InboxError> {
        let st = self.stores()?;
        let c = self.counts(persona)?;
        if through > c.highest {
            return Err(InboxError::AckBeyondHighest {
                through,
                highest: c.highest,
            });
        }
        if through <= c.acked_through {
            return Ok((c, false));
        }
        for k in st
            .tree
            .range(chunk_key(persona, 0)..=chunk_key(persona, through))
            .keys()
        {
            ops.remove(k?);
        }
        ops.insert(key(persona, b"acked"), &through.to_be_bytes());
        let holes = super::retire::holes_above(&self.retired_ranges(&st, persona)?, through);
        let after = Counts {
            highest: c.highest,
            acked_through: through,
            pending: (c.highest - through).saturating_sub(holes),
        };
        Ok((after, true))
    }

    /// Ends a turn in one flushed batch: its deliveries acked, its notes shown, its extension
    /// fields queued for CultNet clients.
    pub fn commit_turn(&self, persona: &str, t: &TurnCommit<'_>) -> Result<Counts, InboxError> {
        let st = self.stores()?;
        let mut ops = sled::Batch::default();
        let counts = match t.ack_through {
            Some(through) => self.ack_ops(persona, through, &mut ops)?.0,
            None => self.counts(persona)?,
        };
        for seq in t.notes_shown {
            ops.remove(note_key(persona, *seq));
        }
        let mut next = st
            .tree
            .get(key(persona, b"ext_next"))?
            .map_or(1, |v| u64_of(&v));
        for (field, value) in t.extensions {
            let ext = ReplyExtension {
                seq: next,
                persona: persona.to_owned(),
                turn_id: t.turn_id.to_owned(),
                field: field.clone(),
                value: value.clone(),
            };
            ops.insert(out_key(persona, next), encode(&ext));
            next += 1;
        }
        ops.insert(key(persona, b"ext_next"), &next.to_be_bytes());
        // The batch is over: nothing is in flight (a checkpoint turn, which shows neither mail
        // nor notes, runs inside a batch and leaves its marks), and she last spoke now.
        if t.ack_through.is_some() || !t.notes_shown.is_empty() {
            ops.remove(key(persona, b"s:inflight"));
            ops.remove(key(persona, b"s:inflight_notes"));
        }
        ops.insert(
            key(persona, b"s:last_turn_ms"),
            t.at_ms.to_string().as_bytes(),
        );
        for (name, value) in t.values {
            let k = key(persona, format!("s:{name}").as_bytes());
            match value {
                Some(v) => ops.insert(k, v.as_bytes()),
                None => ops.remove(k),
            }
        }
        st.tree.apply_batch(ops)?;
        st.flush()?;
        Ok(counts)
    }

    /// Highest extension seq assigned and the ack watermark.
    fn extension_marks(&self, persona: &str) -> Result<(u64, u64), InboxError> {
        let st = self.stores()?;
        let highest = st
            .tree
            .get(key(persona, b"ext_next"))?
            .map_or(1, |v| u64_of(&v))
            .saturating_sub(1);
        let acked = st
            .tree
            .get(key(persona, b"ext_acked"))?
            .map_or(0, |v| u64_of(&v));
        Ok((highest, acked))
    }

    /// Extension fields with seq > `after`, at most `limit`, not consumed.
    pub fn pending_extensions(
        &self,
        persona: &str,
        after: u64,
        limit: usize,
    ) -> Result<ExtensionPage, InboxError> {
        let st = self.stores()?;
        let (highest, acked) = self.extension_marks(persona)?;
        let from = after.max(acked).saturating_add(1);
        let mut extensions = Vec::new();
        for item in st
            .tree
            .range(out_key(persona, from)..=out_key(persona, u64::MAX))
            .take(limit.max(1))
        {
            let (k, v) = item?;
            extensions.push(decode::<ReplyExtension>(&k, &v)?);
        }
        let through_seq = extensions.last().map_or(after, |e| e.seq);
        Ok(ExtensionPage {
            more: through_seq.max(from - 1) < highest,
            extensions,
            through_seq,
            pending_count: highest.saturating_sub(acked),
        })
    }

    /// Acknowledges extension fields through `through`: idempotent, flushed; beyond the highest
    /// assigned seq it is refused and nothing changes. Returns what is still pending.
    pub fn ack_extensions(&self, persona: &str, through: u64) -> Result<u64, InboxError> {
        let st = self.stores()?;
        let (highest, _) = self.extension_marks(persona)?;
        if through > highest {
            return Err(InboxError::AckBeyondHighest { through, highest });
        }
        // The watermark only moves forward, whoever acks at the same time: it is swapped in
        // only over the value read (sled's compare-and-swap), else read again.
        let mark = key(persona, b"ext_acked");
        loop {
            let current = st.tree.get(&mark)?;
            let acked = current.as_deref().map_or(0, u64_of);
            if through <= acked {
                return Ok(highest.saturating_sub(acked));
            }
            let swapped =
                st.tree
                    .compare_and_swap(&mark, current, Some(through.to_be_bytes().to_vec()))?;
            if swapped.is_ok() {
                break;
            }
        }
        let mut ops = sled::Batch::default();
        for k in st
            .tree
            .range(out_key(persona, 0)..=out_key(persona, through))
            .keys()
        {
            ops.remove(k?);
        }
        st.tree.apply_batch(ops)?;
        st.flush()?;
        Ok(highest - through)
    }
}
