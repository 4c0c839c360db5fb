//! What a Persona's past says about her next batch: the gaps between her batches, newest
//! weighted most, and the chance that the next one arrives within a window given that the
//! silence has already lasted so long.
//!
//! Predictive keep-warm asks it one question while she is idle, at each point where the cache
//! is about to expire: is keeping it warm from now on worth it? Keeping it warm for `k` more
//! refreshes (the first now, each later one only if she is still silent) saves a rewrite of the
//! prefix if her batch comes while they cover it, and costs each refresh made. If the expected
//! net of the best `k` is positive the refresh is made; otherwise the entry is let go (a later
//! refresh could not bring it back). This is the stopping rule's one-step form: a decline is
//! final for this silence, so it looks as far ahead as the refresh budget reaches.
//!
//! Where her past says nothing (fewer than [`GapModel::MIN_GAPS`] gaps, or a silence longer
//! than every one she has shown) the model assumes only that time has no natural scale: a
//! silence that has lasted `s` is as likely to end before `2s` as after, so it is still going
//! at `t` with chance `s / t` (the scale-free prior, "Lindy's law"). Early in a silence that
//! keeps the cache warm; hours into it, when the next refresh's window is a sliver of the
//! silence so far, it lets the entry go. The ski-rental budget bounds the refreshes either way.
//! Taking such a silence to go on forever let her cache go cold an hour past her longest
//! silence yet; leaving it to the budget alone refreshed through nights of ten hours.

use std::collections::VecDeque;
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// Recent gaps between batches, in seconds, newest last, each weighing [`GapModel::DECAY`]
/// times the one after it.
#[derive(Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct GapModel {
    gaps: VecDeque<u32>,
}

/// Short: how many gaps and the newest few (it is in every turn decision's log line).
impl std::fmt::Debug for GapModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let newest: Vec<u32> = self.gaps.iter().rev().take(4).copied().collect();
        f.debug_struct("GapModel")
            .field("gaps", &self.gaps.len())
            .field("newest_secs", &newest)
            .finish()
    }
}

impl GapModel {
    /// Gaps kept (older ones weigh less than 1% anyway).
    pub const KEPT: usize = 96;
    /// Weight of a gap relative to the next newer one: a half-life of about 14 gaps, so a new
    /// habit (a night shift, a quiet week) outweighs the old one within a day of batches.
    pub const DECAY: f64 = 0.95;
    /// Below this many gaps the model does not answer (the caller falls back to ski rental).
    pub const MIN_GAPS: usize = 3;

    /// Books the gap between the end of her last turn and a new batch.
    pub fn observe(&mut self, gap: Duration) {
        if self.gaps.len() == Self::KEPT {
            self.gaps.pop_front();
        }
        self.gaps
            .push_back(u32::try_from(gap.as_secs()).unwrap_or(u32::MAX));
    }

    /// Gaps booked (at most [`GapModel::KEPT`]).
    pub fn len(&self) -> usize {
        self.gaps.len()
    }

    /// Whether no gap is booked.
    pub fn is_empty(&self) -> bool {
        self.gaps.is_empty()
    }

    /// The weighted past gaps at least `since` long: (weight, gap) pairs and their total.
    fn longer(&self, since: u64) -> (Vec<(f64, u64)>, f64) {
        let mut w = 1.0;
        let mut out = Vec::new();
        let mut total = 0.0;
        for &g in self.gaps.iter().rev() {
            let g = u64::from(g);
            if g >= since {
                out.push((w, g));
                total += w;
            }
            w *= Self::DECAY;
        }
        (out, total)
    }

    /// Expected dollars gained by keeping the cache warm from now, at the best horizon: after
    /// a silence of `since`, refresh `i` (0 now) happens at `since + i * period` if she is still
    /// silent and the `k`-th keeps the entry alive until `since + (k - 1) * period + life`;
    /// a batch inside that saves `saving`, each refresh made costs `refresh`. The maximum over
    /// `k` in 1..=`max_refreshes` of that expectation, by her past gaps at least `since` long,
    /// or by the scale-free prior (see the module docs) where there are none to go by.
    pub fn keep_warm_gain(
        &self,
        since: Duration,
        period: Duration,
        life: Duration,
        saving: f64,
        refresh: f64,
        max_refreshes: u32,
    ) -> f64 {
        let (since, period, life) = (since.as_secs(), period.as_secs().max(1), life.as_secs());
        let (longer, total) = if self.gaps.len() < Self::MIN_GAPS {
            (Vec::new(), 0.0)
        } else {
            self.longer(since)
        };
        // The chance she is still silent at `x >= since`, given she is at `since`.
        let still = |x: u64| -> f64 {
            if total > 0.0 {
                longer
                    .iter()
                    .filter(|(_, g)| *g >= x)
                    .map(|(w, _)| w)
                    .sum::<f64>()
                    / total
            } else {
                since.max(1) as f64 / x.max(1) as f64
            }
        };
        let mut best = f64::NEG_INFINITY;
        let mut paid = 0.0;
        for k in 1..=u64::from(max_refreshes.max(1)) {
            // Refresh k-1 is made if she is still silent at its time.
            let at = since + (k - 1) * period;
            paid += refresh * still(at);
            let left = still(at + life);
            best = best.max(saving * (1.0 - left) - paid);
            // Every past silence is covered: a longer horizon can only pay more.
            if left <= 0.0 {
                break;
            }
        }
        best
    }

    /// What her gaps alone say (tests use it; the policy asks [`GapModel::keep_warm_gain`],
    /// which falls back on the prior): the chance that a silence that has lasted `since` ends
    /// before `until`, by the weighted share of past gaps at least `since` long that ended
    /// before `until`. `None` with fewer than [`GapModel::MIN_GAPS`] gaps; 0 when no past gap
    /// lasted `since`.
    #[cfg(test)]
    pub(crate) fn p_within(&self, since: Duration, until: Duration) -> Option<f64> {
        if self.gaps.len() < Self::MIN_GAPS {
            return None;
        }
        let (longer, total) = self.longer(since.as_secs());
        let ended: f64 = longer
            .iter()
            .filter(|(_, g)| *g < until.as_secs())
            .map(|(w, _)| w)
            .sum();
        Some(if total > 0.0 { ended / total } else { 0.0 })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn s(secs: u64) -> Duration {
        Duration::from_secs(secs)
    }

    #[test]
    fn silent_until_it_has_seen_enough() {
        let mut m = GapModel::default();
        for _ in 0..GapModel::MIN_GAPS - 1 {
            m.observe(s(60));
        }
        assert_eq!(m.p_within(s(0), s(300)), None);
        m.observe(s(60));
        assert_eq!(m.p_within(s(0), s(300)), Some(1.0));
    }

    #[test]
    fn conditional_on_the_silence_so_far() {
        // Half the gaps are a minute, half are eight hours.
        let mut m = GapModel::default();
        for _ in 0..20 {
            m.observe(s(60));
            m.observe(s(28_800));
        }
        let p0 = m.p_within(s(0), s(300)).unwrap();
        assert!((0.4..0.6).contains(&p0), "{p0}");
        // Four minutes in, the short gaps are over: nothing will come in the next five.
        assert_eq!(m.p_within(s(240), s(540)), Some(0.0));
        // Past anything seen: taken to go on.
        assert_eq!(m.p_within(s(40_000), s(40_300)), Some(0.0));
    }

    #[test]
    fn new_habits_outweigh_old_ones() {
        let mut m = GapModel::default();
        for _ in 0..GapModel::KEPT {
            m.observe(s(7200));
        }
        for _ in 0..30 {
            m.observe(s(30));
        }
        let p = m.p_within(s(0), s(300)).unwrap();
        assert!(p > 0.75, "{p}");
        assert_eq!(m.len(), GapModel::KEPT);
    }

    #[test]
    fn keeping_warm_pays_when_her_silences_end_within_the_budget() {
        let (period, life) = (s(3540), s(3600));
        let (saving, refresh) = (0.15, 0.008);
        // Her silences last 2-3 hours: two or three refreshes (0.024) save a rewrite (0.15),
        // though the next hour alone rarely ends one.
        let mut m = GapModel::default();
        for i in 0..30 {
            m.observe(s(7200 + i * 120));
        }
        let p_next_hour = m.p_within(s(3540), s(3540 + 3600)).unwrap();
        assert!(p_next_hour < 0.06, "{p_next_hour}");
        let gain = m.keep_warm_gain(s(3540), period, life, saving, refresh, 20);
        assert!(gain > 0.1, "{gain}");
        // A budget of one refresh cannot reach them: not worth it.
        let one = m.keep_warm_gain(s(3540), period, life, saving, refresh, 1);
        assert!(one < 0.0, "{one}");
        // Silences of a day: twenty refreshes cost more than they save.
        let mut m = GapModel::default();
        for _ in 0..30 {
            m.observe(s(86_400));
        }
        let gain = m.keep_warm_gain(s(3540), period, life, saving, refresh, 20);
        assert!(gain <= 0.0, "{gain}");
    }

    #[test]
    fn where_her_past_says_nothing_the_longer_a_silence_the_longer_it_lasts() {
        let (period, life) = (s(290), s(300));
        // A 5-minute cache: a refresh costs a tenth of the rewrite it may save.
        let (saving, refresh) = (0.09, 0.009);
        // No habit yet: five minutes into a silence, the next five end it half the time.
        let new = GapModel::default();
        let early = new.keep_warm_gain(s(290), period, life, saving, refresh, 10);
        let next_one_alone = saving * (1.0 - 290.0 / 590.0) - refresh;
        assert!(next_one_alone > 0.0 && early >= next_one_alone, "{early}");
        // An hour in, the next five minutes end it one time in thirteen: let it go.
        assert!(new.keep_warm_gain(s(3600), period, life, saving, refresh, 10) < 0.0);
        // Her silences have lasted a minute: past that the same prior speaks.
        let mut m = GapModel::default();
        for _ in 0..30 {
            m.observe(s(60));
        }
        assert_eq!(
            m.keep_warm_gain(s(3600), period, life, saving, refresh, 10),
            new.keep_warm_gain(s(3600), period, life, saving, refresh, 10)
        );
        assert!(m.keep_warm_gain(s(290), period, life, saving, refresh, 10) > 0.0);
        // With a one-hour cache (a refresh a sixteenth of the rewrite) it still pays four
        // hours into a silence, not a day.
        let (period, life, saving, refresh) = (s(3590), s(3600), 0.15, 0.0095);
        assert!(new.keep_warm_gain(s(4 * 3600), period, life, saving, refresh, 16) > 0.0);
        assert!(new.keep_warm_gain(s(24 * 3600), period, life, saving, refresh, 16) < 0.0);
    }

    #[test]
    fn round_trips_through_json() {
        let mut m = GapModel::default();
        m.observe(s(5));
        m.observe(Duration::from_secs(u64::MAX));
        let back: GapModel = serde_json::from_str(&serde_json::to_string(&m).unwrap()).unwrap();
        assert_eq!(back, m);
    }

    /// Every horizon up to the budget, without stopping early: what `keep_warm_gain` must equal,
    /// by her gaps, or by the scale-free prior past them.
    fn gain_over_every_horizon(m: &GapModel, since: u64, period: u64, life: u64, max: u32) -> f64 {
        let known = m
            .p_within(s(since), s(u64::MAX / 2))
            .is_some_and(|p| p > 0.0);
        // The chance of having ended before `hi`, silent at `since`.
        let p = |hi: u64| {
            if known {
                m.p_within(s(since), s(hi)).unwrap()
            } else {
                1.0 - since.max(1) as f64 / hi.max(1) as f64
            }
        };
        let mut paid = 0.0;
        let mut best = f64::NEG_INFINITY;
        for k in 1..=u64::from(max) {
            let at = since + (k - 1) * period;
            // Still silent at `at`: 1 - P(ended before at | silent at since).
            paid += 0.008 * (1.0 - p(at));
            best = best.max(0.15 * p(at + life) - paid);
        }
        best
    }

    proptest! {
        #[test]
        fn stopping_once_every_silence_is_covered_changes_nothing(
            gaps in proptest::collection::vec(0u64..50_000, 3..100),
            since in 0u64..20_000,
            max in 1u32..60,
        ) {
            let mut m = GapModel::default();
            for g in gaps {
                m.observe(s(g));
            }
            let got = m.keep_warm_gain(s(since), s(240), s(300), 0.15, 0.008, max);
            let want = gain_over_every_horizon(&m, since, 240, 300, max);
            prop_assert!((got - want).abs() < 1e-9, "{} vs {}", got, want);
        }

        #[test]
        fn a_probability_that_grows_with_the_window(
            gaps in proptest::collection::vec(0u64..50_000, 8..200),
            since in 0u64..40_000,
            a in 0u64..20_000,
            b in 0u64..20_000,
        ) {
            let mut m = GapModel::default();
            for g in gaps {
                m.observe(s(g));
            }
            let (lo, hi) = (a.min(b), a.max(b));
            let p_lo = m.p_within(s(since), s(since + lo)).unwrap();
            let p_hi = m.p_within(s(since), s(since + hi)).unwrap();
            prop_assert!((0.0..=1.0).contains(&p_lo) && (0.0..=1.0).contains(&p_hi));
            prop_assert!(p_lo <= p_hi + 1e-12);
        }
    }
}
