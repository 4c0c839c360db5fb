//! Retiring waiting mail into context: a live Persona's turn loop takes lines out of her
//! pending mail that no turn will carry ([`session::waiting`] decides which). A retired line is
//! not lost: it stays in its room's timeline (`r` keys), where she reads the newest of it as
//! context at her next turn; it is only no longer mail.
//!
//! Keys (see [`crate::inbox`] for the layout): `m` persona, `retired` -> the retired seqs above
//! the ack watermark, as sorted, disjoint inclusive ranges. Seqs stay monotonic and are never
//! reused; a retired seq is a hole in the pending run, so [`Inbox::counts`] subtracts the holes
//! above the watermark. Acks need not touch the ranges (what they cover is below the watermark
//! and no longer counted); a retire prunes them.

use serde_bytes::ByteBuf;
use wire::docs::Delivery;

use super::{chunk_key, decode, encode, key, Inbox, InboxError, Stores};

/// Retired seqs as sorted, disjoint, inclusive ranges.
pub(super) type Ranges = Vec<(u64, u64)>;

/// What a retire did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Retired {
    /// Lines taken out of her mail now (a seq already gone counts nothing).
    pub lines: u64,
    /// Pending lines after it.
    pub pending: u64,
}

/// The seqs of `ranges` above `acked`.
pub(super) fn holes_above(ranges: &[(u64, u64)], acked: u64) -> u64 {
    ranges
        .iter()
        .filter(|(_, last)| *last > acked)
        .map(|(first, last)| last - (*first).max(acked + 1) + 1)
        .sum()
}

/// The highest seq at or below `highest` that is not retired (0 when none is).
pub(super) fn last_live(ranges: &[(u64, u64)], highest: u64) -> u64 {
    let mut top = highest;
    for (first, last) in ranges.iter().rev() {
        if *first <= top && top <= *last {
            top = first.saturating_sub(1);
        }
    }
    top
}

/// `ranges` with `seqs` added, and those at or below `acked` dropped.
fn merged(ranges: &[(u64, u64)], seqs: &[u64], acked: u64) -> Ranges {
    let mut all: Vec<(u64, u64)> = ranges
        .iter()
        .copied()
        .chain(seqs.iter().map(|s| (*s, *s)))
        .filter(|(_, last)| *last > acked)
        .map(|(first, last)| (first.max(acked + 1), last))
        .collect();
    all.sort_unstable();
    let mut out: Ranges = Vec::with_capacity(all.len());
    for (first, last) in all {
        match out.last_mut() {
            Some((_, l)) if first <= l.saturating_add(1) => *l = (*l).max(last),
            _ => out.push((first, last)),
        }
    }
    out
}

impl Inbox {
    /// The retired seqs above the watermark.
    pub(super) fn retired_ranges(&self, st: &Stores, persona: &str) -> Result<Ranges, InboxError> {
        let k = key(persona, b"retired");
        Ok(match st.tree.get(&k)? {
            Some(v) => decode(&k, &v)?,
            None => Vec::new(),
        })
    }

    /// Takes `seqs` out of her pending mail (they stay in their rooms' timelines), flushed
    /// before it returns. Seqs not pending (acked, retired before, or never assigned) are
    /// skipped. Each chunk is swapped only if unchanged since it was read (a redaction may
    /// rewrite it meanwhile; an ack that removed it wins).
    pub fn retire(&self, persona: &str, seqs: &[u64]) -> Result<Retired, InboxError> {
        let st = self.stores()?;
        let counts = self.counts(persona)?;
        let mut wanted: Vec<u64> = seqs
            .iter()
            .copied()
            .filter(|s| *s > counts.acked_through && *s <= counts.highest)
            .collect();
        wanted.sort_unstable();
        wanted.dedup();
        let Some(&lowest) = wanted.first() else {
            return Ok(Retired {
                lines: 0,
                pending: counts.pending,
            });
        };
        let mut removed: Vec<u64> = Vec::new();
        let keys: Vec<sled::IVec> = st
            .tree
            .range(chunk_key(persona, lowest)..=chunk_key(persona, u64::MAX))
            .keys()
            .collect::<Result<_, _>>()?;
        for k in keys {
            while let Some(v) = st.tree.get(&k)? {
                let chunk: Vec<ByteBuf> = decode(&k, &v)?;
                let mut out = Vec::with_capacity(chunk.len());
                let mut gone = Vec::new();
                for raw in chunk {
                    let d: Delivery = decode(&k, &raw)?;
                    if wanted.binary_search(&d.seq).is_ok() {
                        gone.push(d.seq);
                    } else {
                        out.push(raw);
                    }
                }
                if gone.is_empty() {
                    break;
                }
                let new = if out.is_empty() {
                    None
                } else {
                    Some(encode(&out))
                };
                if st.tree.compare_and_swap(&k, Some(&v), new)?.is_ok() {
                    removed.extend(gone);
                    break;
                }
            }
        }
        // The ranges have one writer (her turn loop); acks only move the watermark past them.
        let ranges = self.retired_ranges(&st, persona)?;
        let acked = self.counts(persona)?.acked_through;
        st.tree.insert(
            key(persona, b"retired"),
            encode(&merged(&ranges, &removed, acked)),
        )?;
        st.flush()?;
        Ok(Retired {
            lines: removed.len() as u64,
            pending: self.counts(persona)?.pending,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_merge_and_count_above_the_watermark() {
        let r = merged(&[], &[5, 3, 4, 9], 0);
        assert_eq!(r, vec![(3, 5), (9, 9)]);
        assert_eq!(holes_above(&r, 0), 4);
        assert_eq!(holes_above(&r, 4), 2);
        assert_eq!(holes_above(&r, 9), 0);
        // Acked ones are dropped at the next merge.
        assert_eq!(merged(&r, &[10], 4), vec![(5, 5), (9, 10)]);
        assert_eq!(last_live(&[(9, 10)], 10), 8);
        assert_eq!(last_live(&[(1, 3), (4, 10)], 10), 0);
        assert_eq!(last_live(&[(3, 5)], 10), 10);
    }
}
