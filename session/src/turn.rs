//! What her turn loop does next with her pending mail: a pure state machine in the manner of
//! quinn-proto's `Connection`. The edge (`gateway::turns`) looks at her inbox, hands what it
//! sees to [`Drain::next`] with the time, and performs the [`Step`] it gets: waits, coalesces,
//! or runs a turn on the batch it names. What a turn refused as too long leaves for the next
//! one is decided here too ([`after_too_long`]).
//!
//! The rules, each unit-tested below:
//! - a batch in flight when the gateway stopped (its first seq still the first pending) is
//!   taken again whole, whatever her rules say now: it was admitted before;
//! - otherwise her `[persona.turns]` rules ([`crate::admission`]) decide whether her mail
//!   starts a turn, except for the first turn of a drain her Minds asked for;
//! - waiting mail past its room's bound, and unaddressed lines that would keep a turn's batch
//!   from reaching the line that started it, are retired first ([`Step::Retire`],
//!   [`crate::waiting`]);
//! - between two turns of one drain, new mail is coalesced first ([`Step::Coalesce`]);
//! - over her budget, nothing that costs starts ([`Step::OverBudget`]), a retry neither;
//! - with no mail, a note that asked for a turn gets one of its own;
//! - a batch no session could hold is halved, and a message too long alone is cut to half its
//!   text at a time, down to [`MIN_CUT_BYTES`];
//! - no batch is retried forever ([`Trouble::after`]): one the API refuses for its content is
//!   tried once more degraded (media as descriptions, long bodies cut, a fresh session), then
//!   set aside; any other failure that may be the batch's is retried up to [`MAX_FAILURES`]
//!   times, then set aside. What is not the batch's doing (her credential, a rate limit, the
//!   homeserver, the inbox) is retried without counting.

use wire::docs::Delivery;

use crate::admission::{Admission, Line, Rules, Verdict};
use crate::render;
use crate::waiting::{self, Bound};

/// A message is not cut below this: a fresh session that cannot hold even this much has no
/// room for mail at all (her doctrine and state fill the window).
pub const MIN_CUT_BYTES: usize = 1024;

/// How much of a batch that no session could hold the next turn takes: half of it, and a lone
/// message cut to half its text, until it fits. Cleared once a turn goes through.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Shrink {
    /// The first this many deliveries.
    Deliveries(usize),
    /// Delivery `seq` alone, its text cut to `bytes`.
    Cut {
        /// Its seq.
        seq: u64,
        /// The bytes of its text kept.
        bytes: usize,
    },
}

/// What the edge sees of her inbox now.
#[derive(Clone, Copy, Debug)]
pub struct Look<'a> {
    /// Her pending mail, in seq order.
    pub pending: &'a [Delivery],
    /// The same mail as her rules see it (one line each).
    pub lines: &'a [Line<'a>],
    /// The batch in flight when the gateway stopped (its first and last seq), if any.
    pub inflight: Option<(u64, u64)>,
    /// A note waiting asked for a turn of its own.
    pub wake_note: bool,
    /// Her spend has reached her daily cap.
    pub over_budget: bool,
    /// Now, in ms since the epoch.
    pub now_ms: i64,
}

/// What to do next.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Step {
    /// Nothing now: look again on new mail, or at `recheck_at_ms` (a sender's hour or the
    /// ambient interval running out).
    Idle {
        /// When waiting mail may start a turn without new mail.
        recheck_at_ms: Option<i64>,
    },
    /// Her mail would start a turn, but her spend has reached her cap: it waits.
    OverBudget,
    /// Take these seqs out of her mail (they stay in their rooms' timelines, as context), then
    /// look again.
    Retire {
        /// Their seqs, in order.
        seqs: Vec<u64>,
    },
    /// Wait out the debounce (new mail coalesces), then look again.
    Coalesce,
    /// A turn on notes alone.
    Notes,
    /// A turn on the first `take` pending deliveries.
    Turn {
        /// How many of the pending deliveries the batch takes.
        take: usize,
        /// The batch in flight, taken again (its start was booked before).
        retry: bool,
        /// The line that started it (its seq) and whether ambient mail did, to book against
        /// her rules; `None` for a retry or her Minds' request.
        trigger: Option<(u64, bool)>,
        /// Its one message cut to this many bytes of its text.
        cut: Option<usize>,
    },
}

/// One drain of her mail: turns until nothing pending may start one.
#[derive(Clone, Debug)]
pub struct Drain {
    /// Her Minds asked for this drain's first turn.
    forced: bool,
    /// No turn has run in this drain yet.
    first: bool,
    /// The mail was coalesced since the last turn.
    coalesced: bool,
}

impl Drain {
    /// A drain; `forced` when her Minds asked for a turn.
    pub fn new(forced: bool) -> Self {
        Self {
            forced,
            first: true,
            coalesced: false,
        }
    }

    /// The debounce asked for by [`Step::Coalesce`] is over.
    pub fn coalesced(&mut self) {
        self.coalesced = true;
    }

    /// What to do with `look`, given her rules and what they remember, the shrink a batch
    /// refused as too long left, her `max_batch` and the bound on a room's waiting mail.
    pub fn next(
        &mut self,
        look: &Look<'_>,
        admission: &Admission,
        rules: &Rules,
        shrink: Option<Shrink>,
        max_batch: usize,
        bound: Bound,
    ) -> Step {
        let Some(head) = look.pending.first() else {
            return match (look.wake_note, look.over_budget) {
                (false, _) => Step::Idle {
                    recheck_at_ms: None,
                },
                (true, true) => Step::OverBudget,
                (true, false) => Step::Notes,
            };
        };
        let retry = look.inflight.is_some_and(|(first, _)| head.seq == first);
        // With every line starting a turn nothing waits to be bounded.
        if !retry && rules.start != crate::admission::Start::All {
            let seqs = waiting::overflow(look.pending, look.lines, bound);
            if !seqs.is_empty() {
                return Step::Retire { seqs };
            }
        }
        let mut trigger = None;
        if !retry && !self.forced {
            match admission.decide(rules, look.lines, look.now_ms) {
                Verdict::Wait { recheck_at_ms } => return Step::Idle { recheck_at_ms },
                Verdict::Start {
                    trigger: i,
                    ambient,
                } => {
                    let seqs = waiting::reach(look.pending, look.lines, i, max_batch);
                    if !seqs.is_empty() {
                        return Step::Retire { seqs };
                    }
                    trigger = look.pending.get(i).map(|d| (d.seq, ambient));
                }
            }
            if !self.first && !self.coalesced {
                return Step::Coalesce;
            }
        }
        if look.over_budget {
            return Step::OverBudget;
        }
        self.first = false;
        self.forced = false;
        self.coalesced = false;
        let mut take = match look.inflight {
            Some((_, last)) if retry => look.pending.iter().take_while(|d| d.seq <= last).count(),
            _ => render::next_batch(look.pending, max_batch).len(),
        };
        let mut cut = None;
        match shrink {
            Some(Shrink::Deliveries(n)) => take = take.min(n),
            Some(Shrink::Cut { seq, bytes }) => {
                take = take.min(1);
                cut = (head.seq == seq).then_some(bytes);
            }
            None => {}
        }
        Step::Turn {
            take,
            retry,
            trigger: trigger.filter(|_| !retry),
            cut,
        }
    }
}

/// What the next turn takes after a fresh session refused `batch` (as it was shown, cut or not)
/// as too long, `shrink` being what this turn took: half of it, or its one message cut to half
/// its text. `None` when nothing smaller is left to try (the turn fails and the batch waits).
pub fn after_too_long(batch: &[Delivery], shrink: Option<Shrink>) -> Option<Shrink> {
    match batch {
        [] => None,
        [one] => {
            let bytes = match shrink {
                Some(Shrink::Cut { seq, bytes }) if seq == one.seq => bytes / 2,
                _ => one.text.len() / 2,
            };
            (bytes >= MIN_CUT_BYTES).then_some(Shrink::Cut {
                seq: one.seq,
                bytes,
            })
        }
        many => Some(Shrink::Deliveries(many.len() / 2)),
    }
}

/// Bytes a token is taken for when a batch is estimated before any model call: fewer than
/// English text averages (about four), so the estimate errs towards cutting.
pub const BYTES_PER_TOKEN: usize = 3;

/// How much of a batch to take so that it fits, estimated before any model call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fit {
    /// All of it.
    Whole,
    /// Its first this many messages; the rest waits for the next turn.
    Take(usize),
    /// Its first message alone, cut to this many bytes of text.
    Cut(usize),
}

/// What of a batch of messages of `sizes` bytes fits in `room` bytes: all, its longest prefix
/// that fits (the rest is the next turn's, as a batch refused as too long is split), or its
/// first message cut to the room. A room under [`MIN_CUT_BYTES`] is no estimate to act on:
/// the batch is taken whole, and the model's own refusal and [`after_too_long`] decide.
pub fn fit(sizes: &[usize], room: usize) -> Fit {
    if room < MIN_CUT_BYTES || sizes.iter().sum::<usize>() <= room {
        return Fit::Whole;
    }
    let mut total = 0;
    let take = sizes
        .iter()
        .take_while(|s| {
            total += **s;
            total <= room
        })
        .count();
    if take > 0 {
        Fit::Take(take)
    } else {
        Fit::Cut(room)
    }
}

/// Failed turns on one batch before it is set aside (failures not its doing aside).
pub const MAX_FAILURES: u32 = 6;

/// How a turn failed, as far as the batch is concerned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// The model API refused the request for its content (a 4xx other than 401 and 429, or a
    /// fresh session's refusal as too long with nothing smaller left to try).
    Refused,
    /// Something that may be the batch's doing (a server error, a CLI that kept dying).
    Failed,
    /// Not the batch's doing (her credential, a rate limit, the homeserver, the inbox): retried
    /// without counting.
    Elsewhere,
}

/// What the next turn does with a batch that failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Next {
    /// Take it again as it is (after the loop's backoff).
    Retry,
    /// Take it again degraded, in a fresh session.
    Degrade,
    /// Set it aside: kept for her operator, out of her mail; later mail flows.
    SetAside,
}

/// What failed turns on her oldest batch left (kept between turns by the edge, and across a
/// restart of the gateway, so a crash loop does not retry a refused batch for ever).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Trouble {
    /// The batch's first seq.
    first: u64,
    /// It is shown degraded.
    degraded: bool,
    /// Failures counted.
    failed: u32,
}

impl Trouble {
    /// Whether the batch starting at `first` is to be shown degraded.
    pub fn degraded(trouble: Option<Trouble>, first: u64) -> bool {
        trouble.is_some_and(|t| t.first == first && t.degraded)
    }

    /// After a turn on the batch starting at `first` failed with `fault`: what remains, and
    /// what the next turn does. Trouble with another batch is forgotten. A turn on notes alone
    /// (`first` 0) has nothing to set aside and is retried.
    pub fn after(trouble: Option<Trouble>, first: u64, fault: Fault) -> (Option<Trouble>, Next) {
        let mut t = trouble.filter(|t| t.first == first).unwrap_or(Trouble {
            first,
            ..Trouble::default()
        });
        let next = match fault {
            _ if first == 0 => Next::Retry,
            Fault::Elsewhere => Next::Retry,
            Fault::Refused if !t.degraded => {
                t.degraded = true;
                Next::Degrade
            }
            Fault::Refused => Next::SetAside,
            Fault::Failed => {
                t.failed += 1;
                if t.failed >= MAX_FAILURES {
                    Next::SetAside
                } else {
                    Next::Retry
                }
            }
        };
        let kept = (next != Next::SetAside && first != 0).then_some(t);
        (kept, next)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_batch_that_would_not_fit_is_split_and_a_message_too_long_alone_is_cut() {
        assert_eq!(fit(&[100, 200], 1000), Fit::Whole);
        // Three pastes in room for two: two now, the third next turn.
        assert_eq!(fit(&[20_000, 20_000, 20_000], 45_000), Fit::Take(2));
        // One too long alone: cut to the room, never below the floor.
        assert_eq!(fit(&[60 * 1024, 500], 20 * 1024), Fit::Cut(20 * 1024));
        // No room worth the name: the model decides.
        assert_eq!(fit(&[60 * 1024], 10), Fit::Whole);
    }

    #[test]
    fn a_refused_batch_is_degraded_once_then_set_aside() {
        let (t, next) = Trouble::after(None, 7, Fault::Refused);
        assert_eq!(next, Next::Degrade);
        assert!(Trouble::degraded(t, 7));
        // Kept across a restart: read back, it is as it was.
        let back: Option<Trouble> =
            serde_json::from_str(&serde_json::to_string(&t).unwrap()).unwrap();
        assert_eq!(back, t);
        assert!(!Trouble::degraded(t, 8), "another batch is shown whole");
        // Degraded and refused again: set aside, and nothing is left of it.
        assert_eq!(Trouble::after(t, 7, Fault::Refused), (None, Next::SetAside));
        // Failures elsewhere do not count, nor end the degradation.
        let (t2, next) = Trouble::after(t, 7, Fault::Elsewhere);
        assert_eq!((t2, next), (t, Next::Retry));
    }

    #[test]
    fn other_failures_are_retried_up_to_the_ceiling() {
        let mut t = None;
        for _ in 1..MAX_FAILURES {
            let (kept, next) = Trouble::after(t, 3, Fault::Failed);
            assert_eq!(next, Next::Retry);
            t = kept;
        }
        assert_eq!(Trouble::after(t, 3, Fault::Failed).1, Next::SetAside);
        // A new batch starts counting afresh; a notes turn is only ever retried.
        assert_eq!(Trouble::after(t, 9, Fault::Failed).1, Next::Retry);
        for _ in 0..2 * MAX_FAILURES {
            assert_eq!(Trouble::after(None, 0, Fault::Refused), (None, Next::Retry));
        }
        // Failures elsewhere never set a batch aside.
        let mut t = None;
        for _ in 0..10 * MAX_FAILURES {
            let (kept, next) = Trouble::after(t, 3, Fault::Elsewhere);
            assert_eq!(next, Next::Retry);
            t = kept;
        }
    }

    fn mail(seqs: std::ops::RangeInclusive<u64>) -> Vec<Delivery> {
        seqs.map(|seq| Delivery {
            seq,
            room_id: "!a".into(),
            sender: "@ann:l".into(),
            text: "x".repeat(5000),
            ..Delivery::default()
        })
        .collect()
    }

    fn lines(pending: &[Delivery], addressed: bool) -> Vec<Line<'_>> {
        pending
            .iter()
            .map(|d| Line {
                room: &d.room_id,
                sender: &d.sender,
                addressed,
                operator: false,
                bot: false,
            })
            .collect()
    }

    fn look<'a>(pending: &'a [Delivery], lines: &'a [Line<'a>]) -> Look<'a> {
        Look {
            pending,
            lines,
            inflight: None,
            wake_note: false,
            over_budget: false,
            now_ms: 1_000,
        }
    }

    const MAX: usize = 20;
    const B: Bound = Bound {
        lines: 100,
        bytes: usize::MAX,
        line_bytes: usize::MAX,
    };

    #[test]
    fn no_mail_is_idle_unless_a_note_asks_for_a_turn() {
        let (a, r) = (Admission::default(), Rules::default());
        let mut d = Drain::new(false);
        let none = look(&[], &[]);
        assert_eq!(
            d.next(&none, &a, &r, None, MAX, B),
            Step::Idle {
                recheck_at_ms: None
            }
        );
        let wake = Look {
            wake_note: true,
            ..none
        };
        assert_eq!(d.next(&wake, &a, &r, None, MAX, B), Step::Notes);
        let broke = Look {
            over_budget: true,
            ..wake
        };
        assert_eq!(d.next(&broke, &a, &r, None, MAX, B), Step::OverBudget);
    }

    #[test]
    fn her_rules_decide_and_a_second_turn_is_coalesced_first() {
        let (a, r) = (Admission::default(), Rules::default());
        let pending = mail(1..=3);
        let quiet = lines(&pending, false);
        let mut d = Drain::new(false);
        assert!(matches!(
            d.next(&look(&pending, &quiet), &a, &r, None, MAX, B),
            Step::Idle { .. }
        ));
        let asked = lines(&pending, true);
        assert_eq!(
            d.next(&look(&pending, &asked), &a, &r, None, MAX, B),
            Step::Turn {
                take: 3,
                retry: false,
                trigger: Some((1, false)),
                cut: None
            }
        );
        // The next turn of this drain waits for the mail to settle, once.
        assert_eq!(
            d.next(&look(&pending, &asked), &a, &r, None, MAX, B),
            Step::Coalesce
        );
        d.coalesced();
        assert!(matches!(
            d.next(&look(&pending, &asked), &a, &r, None, MAX, B),
            Step::Turn { .. }
        ));
        // A batch takes at most max_batch.
        let many = mail(1..=30);
        let many_lines = lines(&many, true);
        assert!(matches!(
            Drain::new(false).next(&look(&many, &many_lines), &a, &r, None, MAX, B),
            Step::Turn { take: 20, .. }
        ));
    }

    #[test]
    fn her_minds_request_and_a_retry_need_no_rule_but_the_budget_holds_them() {
        let (a, r) = (Admission::default(), Rules::default());
        let pending = mail(4..=9);
        let quiet = lines(&pending, false);
        // Her Minds asked: one turn, no trigger to book; then her rules again.
        let mut d = Drain::new(true);
        assert_eq!(
            d.next(&look(&pending, &quiet), &a, &r, None, MAX, B),
            Step::Turn {
                take: 6,
                retry: false,
                trigger: None,
                cut: None
            }
        );
        assert!(matches!(
            d.next(&look(&pending, &quiet), &a, &r, None, MAX, B),
            Step::Idle { .. }
        ));
        // The batch in flight at a crash is taken again whole, admitted or not.
        let inflight = Look {
            inflight: Some((4, 6)),
            ..look(&pending, &quiet)
        };
        assert_eq!(
            Drain::new(false).next(&inflight, &a, &r, None, MAX, B),
            Step::Turn {
                take: 3,
                retry: true,
                trigger: None,
                cut: None
            }
        );
        // An old in-flight mark (its first seq acked meanwhile) is no retry.
        let stale = Look {
            inflight: Some((2, 3)),
            ..look(&pending, &quiet)
        };
        assert!(matches!(
            Drain::new(false).next(&stale, &a, &r, None, MAX, B),
            Step::Idle { .. }
        ));
        // Over budget nothing starts, a retry neither.
        let broke = Look {
            over_budget: true,
            ..inflight
        };
        assert_eq!(
            Drain::new(true).next(&broke, &a, &r, None, MAX, B),
            Step::OverBudget
        );
    }

    #[test]
    fn a_busy_room_is_retired_past_its_bound_before_anything_else() {
        let (a, r) = (Admission::default(), Rules::default());
        let pending = mail(1..=30);
        let quiet = lines(&pending, false);
        let bound = Bound {
            lines: 20,
            bytes: usize::MAX,
            line_bytes: usize::MAX,
        };
        let mut d = Drain::new(false);
        assert_eq!(
            d.next(&look(&pending, &quiet), &a, &r, None, MAX, bound),
            Step::Retire {
                seqs: (1..=10).collect()
            }
        );
        // Retired, the rest waits as before.
        assert!(matches!(
            d.next(
                &look(&pending[10..], &quiet[10..]),
                &a,
                &r,
                None,
                MAX,
                bound
            ),
            Step::Idle { .. }
        ));
        // With every line starting a turn, none waits to be bounded.
        let all = Rules {
            start: crate::admission::Start::All,
            ..Rules::default()
        };
        assert!(matches!(
            Drain::new(false).next(&look(&pending, &quiet), &a, &all, None, MAX, bound),
            Step::Turn { take: 20, .. }
        ));
        // The batch in flight at a crash is taken again whole, bound or not.
        let inflight = Look {
            inflight: Some((1, 20)),
            ..look(&pending, &quiet)
        };
        assert!(matches!(
            Drain::new(false).next(&inflight, &a, &r, None, MAX, bound),
            Step::Turn {
                take: 20,
                retry: true,
                ..
            }
        ));
    }

    #[test]
    fn a_line_that_starts_a_turn_is_in_its_batch() {
        let (a, r) = (Admission::default(), Rules::default());
        let pending = mail(1..=25);
        let mut asked = lines(&pending, false);
        asked[24].addressed = true;
        let mut d = Drain::new(false);
        // Five unaddressed lines make room for the trigger at index 24.
        assert_eq!(
            d.next(&look(&pending, &asked), &a, &r, None, MAX, B),
            Step::Retire {
                seqs: (1..=5).collect()
            }
        );
        assert_eq!(
            d.next(&look(&pending[5..], &asked[5..]), &a, &r, None, MAX, B),
            Step::Turn {
                take: 20,
                retry: false,
                trigger: Some((25, false)),
                cut: None
            }
        );
    }

    #[test]
    fn a_batch_too_long_is_halved_then_its_message_cut_down_to_the_floor() {
        let (a, r) = (Admission::default(), Rules::default());
        let pending = mail(1..=5);
        let asked = lines(&pending, true);
        // Five refused: the next takes two, then one, then that one cut in half and again.
        let half = after_too_long(&pending, None);
        assert_eq!(half, Some(Shrink::Deliveries(2)));
        assert!(matches!(
            Drain::new(false).next(&look(&pending, &asked), &a, &r, half, MAX, B),
            Step::Turn { take: 2, .. }
        ));
        assert_eq!(
            after_too_long(&pending[..2], half),
            Some(Shrink::Deliveries(1))
        );
        let cut = after_too_long(&pending[..1], Some(Shrink::Deliveries(1)));
        assert_eq!(
            cut,
            Some(Shrink::Cut {
                seq: 1,
                bytes: 2500
            })
        );
        assert_eq!(
            Drain::new(false).next(&look(&pending, &asked), &a, &r, cut, MAX, B),
            Step::Turn {
                take: 1,
                retry: false,
                trigger: Some((1, false)),
                cut: Some(2500)
            }
        );
        let again = after_too_long(&pending[..1], cut);
        assert_eq!(
            again,
            Some(Shrink::Cut {
                seq: 1,
                bytes: 1250
            })
        );
        // Below the floor nothing is left to try; an empty batch neither.
        assert_eq!(after_too_long(&pending[..1], again), None);
        assert_eq!(after_too_long(&[], None), None);
        // A cut meant for another message (acked meanwhile) cuts nothing.
        let other = Some(Shrink::Cut {
            seq: 9,
            bytes: 2000,
        });
        assert!(matches!(
            Drain::new(false).next(&look(&pending, &asked), &a, &r, other, MAX, B),
            Step::Turn {
                take: 1,
                cut: None,
                ..
            }
        ));
    }
}
