//! What of her waiting mail stays mail. Pure: the caller passes her pending mail in and retires
//! what comes out (takes it out of her mail; it stays in the room's timeline, so she sees the
//! newest of it as context at her next turn).
//!
//! Mail that starts no turn waits and rides with her next one. Left alone, a lively room's
//! lines would pile up without end: her inbox would fill, her ear would hold back at
//! `max_pending`, and her operator's DM would wait behind a room's small talk. So:
//!
//! - **the per-room bound** ([`Bound`]): in each public room, the members' waiting lines (every
//!   line but her operators' and DMs', addressed or not) keep at most the newest
//!   [`Bound::lines`] lines and [`Bound::bytes`] bytes of text (the newest line always); older
//!   ones are retired;
//! - **the trigger's reach** ([`reach`]): a line that starts a turn is in that turn's batch.
//!   When the unaddressed lines ahead of it would push it past `max_batch`, the oldest of them
//!   are retired, so one addressed line buys one turn, not several.
//!
//! - **what a line that is not hers shows** ([`to_cut`]): a member's line in a turn's batch
//!   that is not addressed to her shows at most [`Bound::line_bytes`] of its text, so a member's
//!   long lines meant for no one cost what a short one does and never push her session towards
//!   its window.
//!
//! Her operators' lines and DM lines are never retired or cut here: they are hers to answer.
//! With `start = "all"` every line starts a turn, so none waits and none is bounded or cut.

use wire::docs::Delivery;

use crate::admission::Line;
use crate::render::Conversation;

/// How much of the members' waiting mail one public room keeps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Bound {
    /// Lines kept per room (at least one).
    pub lines: usize,
    /// Bytes of text kept per room (the newest line is kept whatever its size).
    pub bytes: usize,
    /// Bytes of text a member's line not addressed to her shows in a batch.
    pub line_bytes: usize,
}

impl Default for Bound {
    /// As much as one turn shows of a room as context: 20 lines, 16 KiB.
    fn default() -> Self {
        Self {
            lines: 20,
            bytes: 16 * 1024,
            line_bytes: 2048,
        }
    }
}

/// Whether the bound may retire `d`: a member's line in a public room.
fn boundable(d: &Delivery, l: &Line<'_>) -> bool {
    !d.is_direct && !l.operator
}

/// The seqs of her waiting mail past the per-room bound, in seq order. `pending` (in seq
/// order) and `lines` (her rules' view of the same mail) are parallel.
pub fn overflow(pending: &[Delivery], lines: &[Line<'_>], bound: Bound) -> Vec<u64> {
    let max_lines = bound.lines.max(1);
    // Per room: lines and bytes kept so far, walking from the newest.
    let mut kept: std::collections::HashMap<&str, (usize, usize)> = Default::default();
    let mut out = Vec::new();
    for (d, l) in pending.iter().zip(lines).rev() {
        if !boundable(d, l) {
            continue;
        }
        let (n, bytes) = kept.entry(d.room_id.as_str()).or_default();
        let size = d.text.len();
        let fits = *n == 0 || (*n < max_lines && bytes.saturating_add(size) <= bound.bytes);
        if fits {
            *n += 1;
            *bytes = bytes.saturating_add(size);
        } else {
            // Once a room is full, everything older in it goes too.
            *n = usize::MAX;
            out.push(d.seq);
        }
    }
    out.reverse();
    out
}

/// The indices of `batch` (with `lines`, her rules' view of it) whose text is longer than a line
/// not addressed to her may show: members' lines in public rooms, not addressed to her.
pub fn to_cut(batch: &[Delivery], lines: &[Line<'_>], bound: Bound) -> Vec<usize> {
    batch
        .iter()
        .zip(lines)
        .enumerate()
        .filter(|(_, (d, l))| boundable(d, l) && !l.addressed && d.text.len() > bound.line_bytes)
        .map(|(i, _)| i)
        .collect()
}

/// The seqs to retire so that a turn started by the line at `trigger` takes it. A batch is the
/// run from the oldest pending line that shares its conversation, at most `max_batch`:
/// - when the trigger is in another conversation than that oldest line (her operator's DM
///   behind a room's waiting lines), every member line ahead of it is retired: they started
///   no turn, and her operator does not wait a turn for them;
/// - when the batch would end before it in its own conversation, the oldest unaddressed member
///   lines ahead of it, as many as it takes (or as there are).
///
/// Empty when the batch reaches it already, or retiring cannot make it (another conversation's
/// line that is not a member's comes first).
pub fn reach(
    pending: &[Delivery],
    lines: &[Line<'_>],
    trigger: usize,
    max_batch: usize,
) -> Vec<u64> {
    let max_batch = max_batch.max(1);
    let (Some(head), Some(hit)) = (pending.first(), pending.get(trigger)) else {
        return Vec::new();
    };
    let conv = Conversation::of(hit);
    let ahead = || pending[..trigger].iter().zip(lines);
    if Conversation::of(head) != conv {
        if ahead().any(|(d, l)| Conversation::of(d) != conv && !boundable(d, l)) {
            return Vec::new();
        }
        return ahead()
            .filter(|(d, l)| boundable(d, l) && Conversation::of(d) != conv)
            .map(|(d, _)| d.seq)
            .collect();
    }
    if trigger < max_batch
        || pending[..trigger]
            .iter()
            .any(|d| Conversation::of(d) != conv)
    {
        return Vec::new();
    }
    let excess = trigger + 1 - max_batch;
    ahead()
        .filter(|(d, l)| boundable(d, l) && !l.addressed)
        .take(excess)
        .map(|(d, _)| d.seq)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn mail(seq: u64, room: &str, sender: &str, text: &str) -> Delivery {
        Delivery {
            seq,
            room_id: room.into(),
            sender: sender.into(),
            text: text.into(),
            ..Delivery::default()
        }
    }

    fn view<'a>(pending: &'a [Delivery], addressed: &[u64], operator: &str) -> Vec<Line<'a>> {
        pending
            .iter()
            .map(|d| Line {
                room: &d.room_id,
                sender: &d.sender,
                addressed: d.is_direct || addressed.contains(&d.seq),
                operator: d.sender == operator,
                bot: false,
            })
            .collect()
    }

    const OP: &str = "@ann:l";

    #[test]
    fn a_room_keeps_its_newest_lines_and_the_rest_is_retired() {
        let pending: Vec<Delivery> = (1..=30).map(|s| mail(s, "!a", "@bob:l", "lol")).collect();
        let lines = view(&pending, &[], OP);
        let bound = Bound {
            lines: 20,
            bytes: 1 << 20,
            ..Bound::default()
        };
        assert_eq!(
            overflow(&pending, &lines, bound),
            (1..=10).collect::<Vec<_>>()
        );
        // Within the bound nothing goes.
        assert!(overflow(&pending[10..], &lines[10..], bound).is_empty());
    }

    #[test]
    fn the_bound_is_per_room_and_spares_operators_and_dms() {
        let mut pending = Vec::new();
        let mut seq = 0;
        let mut push = |room: &str, sender: &str, direct: bool| {
            seq += 1;
            let mut d = mail(seq, room, sender, "x");
            d.is_direct = direct;
            pending.push(d);
        };
        push("!a", OP, false); // 1: her operator's, kept
        for _ in 0..5 {
            push("!a", "@bob:l", false); // 2..=6
        }
        push("!dm", OP, true); // 7
        push("!dm", "@ann2:l", true); // 8: a DM line, kept
        for _ in 0..3 {
            push("!b", "@eve:l", false); // 9..=11
        }
        let lines = view(&pending, &[], OP);
        let bound = Bound {
            lines: 3,
            bytes: 1 << 20,
            ..Bound::default()
        };
        // Room !a keeps its newest three of bob's; !b is within its bound.
        assert_eq!(overflow(&pending, &lines, bound), vec![2, 3]);
    }

    #[test]
    fn bytes_bound_a_room_but_its_newest_line_is_always_kept() {
        let big = "y".repeat(60 * 1024);
        let pending: Vec<Delivery> = (1..=20).map(|s| mail(s, "!a", "@bob:l", &big)).collect();
        let lines = view(&pending, &[], OP);
        let out = overflow(&pending, &lines, Bound::default());
        assert_eq!(out, (1..=19).collect::<Vec<_>>());
        // A small line newer than a big one: the big one does not fit behind it.
        let pending = vec![
            mail(1, "!a", "@bob:l", "hi"),
            mail(2, "!a", "@bob:l", &big),
            mail(3, "!a", "@bob:l", "ok"),
        ];
        let lines = view(&pending, &[], OP);
        assert_eq!(overflow(&pending, &lines, Bound::default()), vec![1, 2]);
    }

    #[test]
    fn a_trigger_past_the_batch_retires_the_oldest_unaddressed_lines_ahead_of_it() {
        let mut pending: Vec<Delivery> =
            (1..=30).map(|s| mail(s, "!a", "@bob:l", "chat")).collect();
        pending.push(mail(31, "!a", "@cat:l", "vera?"));
        // Line 5 is addressed too: it is not retired to make room.
        let lines = view(&pending, &[5, 31], OP);
        let out = reach(&pending, &lines, 30, 20);
        assert_eq!(out.len(), 11);
        assert!(!out.contains(&5));
        assert_eq!(out.first(), Some(&1));
        // Within reach: nothing.
        assert!(reach(&pending, &lines, 19, 20).is_empty());
        // Another conversation ahead of it: retiring public lines would not help.
        let mut dm = mail(1, "!dm", OP, "hi");
        dm.is_direct = true;
        let mut with_dm = vec![dm];
        with_dm.extend(pending.iter().skip(1).cloned());
        let lines = view(&with_dm, &[31], OP);
        assert!(reach(&with_dm, &lines, 30, 20).is_empty());
    }

    #[test]
    fn only_a_members_long_line_not_meant_for_her_is_cut() {
        let long = "w".repeat(5000);
        let mut dm = mail(4, "!dm", "@bob:l", &long);
        dm.is_direct = true;
        let batch = vec![
            mail(1, "!a", "@bob:l", &long),   // cut
            mail(2, "!a", "@bob:l", &long),   // addressed: whole
            mail(3, "!a", OP, &long),         // her operator's: whole
            dm,                               // a DM: whole
            mail(5, "!a", "@eve:l", "short"), // short: whole
        ];
        let lines = view(&batch, &[2], OP);
        assert_eq!(to_cut(&batch, &lines, Bound::default()), vec![0]);
    }

    #[test]
    fn her_operators_dm_does_not_wait_a_turn_behind_a_rooms_waiting_lines() {
        let mut pending: Vec<Delivery> = (1..=5).map(|s| mail(s, "!a", "@bob:l", "chat")).collect();
        let mut dm = mail(6, "!dm", OP, "are you there?");
        dm.is_direct = true;
        pending.push(dm);
        pending.push(mail(7, "!a", "@bob:l", "after"));
        // Line 2 was addressed but held (its sender past the hour): it waits all the same.
        let lines = view(&pending, &[2], OP);
        assert_eq!(reach(&pending, &lines, 5, 20), vec![1, 2, 3, 4, 5]);
        // Her operator's own line in the room ahead of it is not retired: no retiring then.
        pending[0].sender = OP.into();
        let lines = view(&pending, &[2], OP);
        assert!(reach(&pending, &lines, 5, 20).is_empty());
    }

    proptest! {
        /// Whatever the mail, what the bound keeps of each room is within it, nothing of an
        /// operator's or a DM's is retired, and what is retired is older than what is kept in
        /// its room.
        #[test]
        fn what_stays_is_within_the_bound(
            spec in proptest::collection::vec((0u8..3, 0u8..3, 0usize..3000, any::<bool>()), 0..80),
            max_lines in 1usize..10,
            max_bytes in 0usize..8000,
        ) {
            let rooms = ["!a", "!b", "!dm"];
            let senders = [OP, "@bob:l", "@eve:l"];
            let pending: Vec<Delivery> = spec
                .iter()
                .enumerate()
                .map(|(i, (r, s, len, _))| {
                    let mut d = mail(i as u64 + 1, rooms[*r as usize], senders[*s as usize], &"z".repeat(*len));
                    d.is_direct = *r == 2;
                    d
                })
                .collect();
            let addressed: Vec<u64> = spec
                .iter()
                .enumerate()
                .filter(|(_, (.., a))| *a)
                .map(|(i, _)| i as u64 + 1)
                .collect();
            let lines = view(&pending, &addressed, OP);
            let bound = Bound { lines: max_lines, bytes: max_bytes, ..Bound::default() };
            let out = overflow(&pending, &lines, bound);
            for room in ["!a", "!b"] {
                let kept: Vec<&Delivery> = pending
                    .iter()
                    .filter(|d| d.room_id == room && d.sender != OP && !out.contains(&d.seq))
                    .collect();
                prop_assert!(kept.len() <= max_lines);
                let bytes: usize = kept.iter().map(|d| d.text.len()).sum();
                prop_assert!(kept.len() <= 1 || bytes <= max_bytes);
                let oldest_kept = kept.first().map(|d| d.seq).unwrap_or(u64::MAX);
                for s in out.iter().filter(|s| pending[**s as usize - 1].room_id == room) {
                    prop_assert!(*s < oldest_kept);
                }
            }
            for s in &out {
                let d = &pending[*s as usize - 1];
                prop_assert!(d.sender != OP && !d.is_direct);
            }
        }
    }
}
