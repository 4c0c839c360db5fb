//! Retention: what the inbox keeps after it has done its work. The event-id index (sync
//! deduplication) and the send receipts (exactly-once sends) grow with every delivery and
//! every send; [`Inbox::prune`] removes the records older than their retention. Records from
//! before they carried a time are stamped with the time of the first prune that sees them, so
//! they go one retention later.

use std::time::Duration;

use super::{decode_ids, decode_receipt, encode, split_key, Inbox, InboxError, IDS};

/// A Persona's session value naming a request-id prefix whose send receipts pruning keeps,
/// whatever their age: her turn loop sets it to the turn in flight (its says' ids begin with
/// it) and clears it when the turn is committed.
pub const KEEP_RECEIPTS: &str = "keep_receipts";

/// How long records are kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Retention {
    /// Event ids of delivered events (a sync that hands back an event older than this
    /// delivers it again). Counted too: at most [`super::DEDUPE_WINDOW`] per Persona.
    pub event_ids: Duration,
    /// Send receipts (a send request repeated after this is sent again).
    pub receipts: Duration,
}

impl From<&crate::config::RetentionConfig> for Retention {
    /// What `[retention]` keeps.
    fn from(r: &crate::config::RetentionConfig) -> Self {
        let days = |d: u32| std::time::Duration::from_secs(u64::from(d.max(1)) * 86_400);
        Self {
            event_ids: days(r.event_ids_days),
            receipts: days(r.receipts_days),
        }
    }
}

impl Default for Retention {
    fn default() -> Self {
        let days = |d: u64| Duration::from_secs(d * 86_400);
        Self {
            event_ids: days(30),
            receipts: days(30),
        }
    }
}

/// What one [`Inbox::prune`] removed and stamped.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Pruned {
    /// Event-id records removed (one per stored sync response).
    pub id_records: u64,
    /// Send receipts removed.
    pub receipts: u64,
    /// Records without a time, stamped now.
    pub stamped: u64,
}

impl Inbox {
    /// Removes event-id records and send receipts older than `keep` at `now_ms`, for every
    /// Persona; flushed before it returns. Meant for a periodic task, off the async runtime.
    pub fn prune(&self, now_ms: u64, keep: Retention) -> Result<Pruned, InboxError> {
        let st = self.stores()?;
        let mut out = Pruned::default();
        let horizon =
            |d: Duration| now_ms.saturating_sub(u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
        let (ids_before, receipts_before) = (horizon(keep.event_ids), horizon(keep.receipts));
        let mut ops = sled::Batch::default();
        let mut touched = std::collections::BTreeSet::new();
        for item in st.tree.scan_prefix([IDS]) {
            let (k, v) = item?;
            let (at, ids) = decode_ids(&k, &v)?;
            match at {
                None => {
                    ops.insert(k.to_vec(), encode(&(now_ms, &ids)));
                    out.stamped += 1;
                }
                Some(at) if at < ids_before => {
                    ops.remove(k.to_vec());
                    out.id_records += 1;
                    if let Some((persona, _)) = split_key(&k) {
                        touched.insert(persona.to_owned());
                    }
                }
                Some(_) => {}
            }
        }
        st.tree.apply_batch(ops)?;
        // The Personas whose dedupe sets lost records load them again from the store.
        if !touched.is_empty() {
            let mut all = self.seen.lock().unwrap_or_else(|e| e.into_inner());
            for persona in &touched {
                all.remove(persona);
            }
        }
        let mut ops = sled::Batch::default();
        // The receipts a Persona still needs (her reply waiting to be sent again, her batch in
        // flight): kept whatever their age, or its says would go out a second time.
        let mut needed: std::collections::HashMap<String, Option<String>> = Default::default();
        for item in st.receipts.iter() {
            let (k, v) = item?;
            let (at, receipt, _) = decode_receipt(&k, &v)?;
            if let Some((persona, id)) = split_key(&k) {
                let prefix = match needed.get(persona) {
                    Some(p) => p.clone(),
                    None => {
                        let p = self.session_value(persona, KEEP_RECEIPTS)?;
                        needed.insert(persona.to_owned(), p.clone());
                        p
                    }
                };
                if prefix.is_some_and(|p| !p.is_empty() && id.starts_with(p.as_bytes())) {
                    continue;
                }
            }
            match at {
                None => {
                    ops.insert(k.to_vec(), encode(&(now_ms, &receipt)));
                    out.stamped += 1;
                }
                Some(at) if at < receipts_before => {
                    ops.remove(k.to_vec());
                    out.receipts += 1;
                }
                Some(_) => {}
            }
        }
        st.receipts.apply_batch(ops)?;
        st.flush()?;
        Ok(out)
    }
}
