//! Session notes: what her Minds tell her live session (her state, campaigns, spend, runs, or
//! anything else), kept durably until a turn has shown them to her.
//!
//! Keys in the `inbox` tree (see the module docs of [`crate::inbox`] for the layout):
//! - `n` persona, note seq -> a [`Note`] waiting to be shown (removed once shown)
//! - `i` persona, note id -> its seq (a repeated note id is recognised, shown or not)
//! - `l` persona, kind -> the latest text of a replacing kind (for a fresh session)
//! - `m` persona, `note_next` -> the next note seq
//!
//! A note of a replacing kind ([`wire::docs::REPLACING_NOTE_KINDS`]) supersedes a waiting note
//! of its kind: she is only ever shown the latest.

use serde::{Deserialize, Serialize};
use wire::docs::NoteRequest;

use super::{decode, encode, key, kkey, u64_of, Inbox, InboxError};

const NOTE: u8 = b'n';
const NOTE_ID: u8 = b'i';
const LATEST: u8 = b'l';

/// The most note ids remembered per Persona for idempotency (the oldest are forgotten).
pub const NOTE_IDS_KEPT: usize = 10_000;

/// The most notes waiting for her next batch, per Persona: past it the oldest waiting note is
/// dropped (counted), so her Minds cannot make every turn of hers read without end.
pub const MAX_WAITING_NOTES: usize = 32;

/// The most bytes of text of the notes waiting for her next batch, per Persona (the newest note
/// is kept whatever its size, up to [`wire::docs::MAX_NOTE_BYTES`]).
pub const MAX_WAITING_NOTE_BYTES: usize = 48 * 1024;

/// A stored note.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Note {
    /// Per-Persona note seq: monotonic, never reused.
    pub seq: u64,
    /// The caller's id.
    pub note_id: String,
    /// Its kind.
    pub kind: String,
    /// Its text.
    pub text: String,
    /// Whether it asked for a turn of its own.
    pub wake: bool,
    /// When it was stored (ms since the epoch).
    pub at_ms: i64,
}

/// What storing a note did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NotePut {
    /// The note id was seen before: nothing changed.
    pub duplicate: bool,
    /// Notes waiting now.
    pub pending: u64,
    /// Older waiting notes dropped to keep within [`MAX_WAITING_NOTES`] and
    /// [`MAX_WAITING_NOTE_BYTES`].
    pub dropped: u64,
}

pub(super) fn note_key(persona: &str, seq: u64) -> Vec<u8> {
    kkey(NOTE, persona, &seq.to_be_bytes())
}

fn id_key(persona: &str, note_id: &str) -> Vec<u8> {
    kkey(NOTE_ID, persona, note_id.as_bytes())
}

fn latest_key(persona: &str, kind: &str) -> Vec<u8> {
    kkey(LATEST, persona, kind.as_bytes())
}

impl Inbox {
    /// Stores a (checked) note, flushed before it returns. A repeated note id changes nothing;
    /// a note of a replacing kind removes the waiting note of its kind and becomes the latest.
    pub fn put_note(&self, req: &NoteRequest, at_ms: i64) -> Result<NotePut, InboxError> {
        let st = self.stores()?;
        let persona = req.persona.as_str();
        if st.tree.get(id_key(persona, &req.note_id))?.is_some() {
            return Ok(NotePut {
                duplicate: true,
                pending: self.pending_notes(persona)?.len() as u64,
                dropped: 0,
            });
        }
        let seq = st
            .tree
            .get(key(persona, b"note_next"))?
            .map_or(1, |v| u64_of(&v));
        let mut ops = sled::Batch::default();
        let waiting = self.pending_notes(persona)?;
        let mut kept: Vec<&Note> = waiting.iter().collect();
        if req.replacing() {
            for old in waiting.iter().filter(|n| n.kind == req.kind) {
                ops.remove(note_key(persona, old.seq));
            }
            kept.retain(|n| n.kind != req.kind);
            ops.insert(latest_key(persona, &req.kind), req.text.as_bytes());
        }
        // Within the caps, oldest dropped first (the new note is always kept).
        let mut bytes: usize = kept.iter().map(|n| n.text.len()).sum::<usize>() + req.text.len();
        let mut dropped = 0u64;
        while !kept.is_empty()
            && (kept.len() + 1 > MAX_WAITING_NOTES || bytes > MAX_WAITING_NOTE_BYTES)
        {
            let old = kept.remove(0);
            bytes -= old.text.len();
            ops.remove(note_key(persona, old.seq));
            dropped += 1;
        }
        if dropped > 0 {
            let total = st
                .tree
                .get(key(persona, b"notes_dropped"))?
                .map_or(0, |v| u64_of(&v));
            ops.insert(
                key(persona, b"notes_dropped"),
                &(total + dropped).to_be_bytes(),
            );
        }
        let pending = kept.len() as u64 + 1;
        let note = Note {
            seq,
            note_id: req.note_id.clone(),
            kind: req.kind.clone(),
            text: req.text.clone(),
            wake: req.wake,
            at_ms,
        };
        ops.insert(note_key(persona, seq), encode(&note));
        ops.insert(id_key(persona, &req.note_id), &seq.to_be_bytes());
        ops.insert(key(persona, b"note_next"), &(seq + 1).to_be_bytes());
        self.forget_old_note_ids(persona, seq, &mut ops)?;
        st.tree.apply_batch(ops)?;
        st.flush()?;
        Ok(NotePut {
            duplicate: false,
            pending,
            dropped,
        })
    }

    /// Note ids older than the last [`NOTE_IDS_KEPT`] notes are forgotten (every 1000 notes).
    fn forget_old_note_ids(
        &self,
        persona: &str,
        seq: u64,
        ops: &mut sled::Batch,
    ) -> Result<(), InboxError> {
        let st = self.stores()?;
        if !seq.is_multiple_of(1000) || seq <= NOTE_IDS_KEPT as u64 {
            return Ok(());
        }
        let horizon = seq - NOTE_IDS_KEPT as u64;
        let prefix = kkey(NOTE_ID, persona, b"");
        for item in st.tree.scan_prefix(&prefix) {
            let (k, v) = item?;
            if u64_of(&v) < horizon {
                ops.remove(k);
            }
        }
        Ok(())
    }

    /// Waiting notes dropped in all to keep within the caps.
    pub fn notes_dropped(&self, persona: &str) -> Result<u64, InboxError> {
        let st = self.stores()?;
        Ok(st
            .tree
            .get(key(persona, b"notes_dropped"))?
            .map_or(0, |v| u64_of(&v)))
    }

    /// Notes waiting to be shown, oldest first.
    pub fn pending_notes(&self, persona: &str) -> Result<Vec<Note>, InboxError> {
        let st = self.stores()?;
        st.tree
            .scan_prefix(kkey(NOTE, persona, b""))
            .map(|item| {
                let (k, v) = item?;
                decode(&k, &v)
            })
            .collect()
    }

    /// The latest text of each replacing kind, in [`wire::docs::REPLACING_NOTE_KINDS`] order.
    pub fn latest_notes(&self, persona: &str) -> Result<Vec<(String, String)>, InboxError> {
        let st = self.stores()?;
        let mut out = Vec::new();
        for kind in wire::docs::REPLACING_NOTE_KINDS {
            if let Some(v) = st.tree.get(latest_key(persona, kind))? {
                out.push((kind.to_owned(), String::from_utf8_lossy(&v).into_owned()));
            }
        }
        Ok(out)
    }
}
