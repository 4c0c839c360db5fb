//! What she may spend: a rolling 24-hour window of her billed spend against her operator's
//! daily cap. Pure: the caller passes the time in (ms since the epoch) and the spend it booked.
//!
//! Once the spend in the window reaches the cap, nothing that costs starts for her (no turn,
//! no keep-warm refresh, no compaction); her mail waits, nothing lost. She resumes when enough
//! of her spend has left the window to bring it below the cap, or when her operator raises
//! the cap.

use std::collections::VecDeque;

/// The window a daily cap covers, in ms.
pub const WINDOW_MS: i64 = 24 * 60 * 60 * 1000;

/// Her spend over the last [`WINDOW_MS`]: what was billed and when, oldest first.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Spend {
    entries: VecDeque<(i64, f64)>,
}

/// Whether she may spend now.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Allowance {
    /// Below the cap (or no cap).
    Open,
    /// At or above the cap: nothing that costs starts before `resumes_at_ms`.
    Over {
        /// Spent in the window (dollars).
        spent_usd: f64,
        /// The cap (dollars).
        cap_usd: f64,
        /// When enough of the spend has left the window (ms since the epoch).
        resumes_at_ms: i64,
    },
}

impl Spend {
    /// Books `usd` billed at `at_ms` (a negative or non-finite amount books nothing). Entries
    /// may come out of order (history read back): each is placed by its time.
    pub fn add(&mut self, at_ms: i64, usd: f64) {
        if !(usd.is_finite() && usd > 0.0) {
            return;
        }
        let at = self.entries.partition_point(|(t, _)| *t <= at_ms);
        self.entries.insert(at, (at_ms, usd));
    }

    /// Forgets what left the window before `now_ms`.
    fn expire(&mut self, now_ms: i64) {
        while self
            .entries
            .front()
            .is_some_and(|(t, _)| *t <= now_ms - WINDOW_MS)
        {
            self.entries.pop_front();
        }
    }

    /// Spent in the window that ends at `now_ms`, in dollars.
    pub fn spent(&mut self, now_ms: i64) -> f64 {
        self.expire(now_ms);
        self.entries.iter().map(|(_, usd)| usd).sum()
    }

    /// Whether she may spend at `now_ms` under a cap of `cap_usd` a day (`None`: no cap).
    pub fn allowance(&mut self, now_ms: i64, cap_usd: Option<f64>) -> Allowance {
        // What left the window goes, cap or no cap: the record stays bounded by a day.
        let spent = self.spent(now_ms);
        let Some(cap) = cap_usd else {
            return Allowance::Open;
        };
        if spent < cap {
            return Allowance::Open;
        }
        // The oldest entries leave first; she resumes once what stays is below the cap.
        let mut left = spent;
        let mut resumes_at_ms = now_ms;
        for (t, usd) in &self.entries {
            left -= usd;
            resumes_at_ms = t + WINDOW_MS;
            if left < cap {
                break;
            }
        }
        Allowance::Over {
            spent_usd: spent,
            cap_usd: cap,
            resumes_at_ms,
        }
    }
}

/// What her spend leaves her, with a share of her cap kept for her operators.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Share {
    /// Below the public share (or no cap): anything may start.
    Open,
    /// The public share is spent: only what her operators say (their lines, their DMs) starts
    /// a turn, from the reserve; the rest waits until `resumes_at_ms`.
    Operators {
        /// Spent in the window (dollars).
        spent_usd: f64,
        /// The cap (dollars).
        cap_usd: f64,
        /// The public share: the cap less the reserve (dollars).
        public_usd: f64,
        /// When enough has left the window for the public share to open again.
        resumes_at_ms: i64,
    },
    /// The whole cap is spent: nothing that costs starts before `resumes_at_ms`.
    Over {
        /// Spent in the window (dollars).
        spent_usd: f64,
        /// The cap (dollars).
        cap_usd: f64,
        /// When enough has left the window to bring it below the cap.
        resumes_at_ms: i64,
    },
}

impl Spend {
    /// Her share at `now_ms` under a cap of `cap_usd` a day (`None`: no cap) of which
    /// `reserve` (a share, 0 to 1) is kept for her operators.
    pub fn share(&mut self, now_ms: i64, cap_usd: Option<f64>, reserve: f64) -> Share {
        match self.allowance(now_ms, cap_usd) {
            Allowance::Over {
                spent_usd,
                cap_usd,
                resumes_at_ms,
            } => {
                return Share::Over {
                    spent_usd,
                    cap_usd,
                    resumes_at_ms,
                }
            }
            Allowance::Open => {}
        }
        let Some(cap) = cap_usd else {
            return Share::Open;
        };
        let public = cap * (1.0 - reserve.clamp(0.0, 1.0));
        match self.allowance(now_ms, Some(public)) {
            Allowance::Over {
                spent_usd,
                resumes_at_ms,
                ..
            } => Share::Operators {
                spent_usd,
                cap_usd: cap,
                public_usd: public,
                resumes_at_ms,
            },
            Allowance::Open => Share::Open,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const H: i64 = 60 * 60 * 1000;

    #[test]
    fn no_cap_is_always_open() {
        let mut s = Spend::default();
        s.add(0, 1e9);
        assert_eq!(s.allowance(1, None), Allowance::Open);
        // And what left the window is forgotten all the same.
        assert_eq!(s.allowance(WINDOW_MS + 1, None), Allowance::Open);
        assert!(s.entries.is_empty());
    }

    #[test]
    fn the_cap_closes_at_its_amount_and_opens_as_spend_leaves_the_window() {
        let mut s = Spend::default();
        s.add(0, 1.0);
        s.add(2 * H, 2.0);
        assert_eq!(s.allowance(3 * H, Some(3.5)), Allowance::Open);
        s.add(4 * H, 0.5);
        // 3.5 of 3.5: closed, until the first dollar leaves (at 24 h), leaving 2.5.
        assert_eq!(
            s.allowance(5 * H, Some(3.5)),
            Allowance::Over {
                spent_usd: 3.5,
                cap_usd: 3.5,
                resumes_at_ms: 24 * H
            }
        );
        // A lower cap needs more to leave: 3.5 -> 2.5 -> 0.5 at 26 h.
        assert!(matches!(
            s.allowance(5 * H, Some(1.0)),
            Allowance::Over { resumes_at_ms, .. } if resumes_at_ms == 26 * H
        ));
        // A raised cap opens at once; the window moving on opens too.
        assert_eq!(s.allowance(5 * H, Some(10.0)), Allowance::Open);
        assert_eq!(s.allowance(24 * H, Some(3.5)), Allowance::Open);
        assert!((s.spent(24 * H) - 2.5).abs() < 1e-9);
        assert_eq!(s.spent(29 * H), 0.0);
    }

    #[test]
    fn the_reserve_is_her_operators_after_the_public_share_is_spent() {
        let mut s = Spend::default();
        s.add(0, 1.0);
        // A cap of 4 with a quarter kept: the public share is 3.
        assert_eq!(s.share(H, Some(4.0), 0.25), Share::Open);
        s.add(2 * H, 2.5);
        assert_eq!(
            s.share(3 * H, Some(4.0), 0.25),
            Share::Operators {
                spent_usd: 3.5,
                cap_usd: 4.0,
                public_usd: 3.0,
                resumes_at_ms: 24 * H
            }
        );
        s.add(4 * H, 0.5);
        assert!(matches!(
            s.share(5 * H, Some(4.0), 0.25),
            Share::Over { resumes_at_ms, .. } if resumes_at_ms == 24 * H
        ));
        // No reserve: the public share is the cap; no cap: always open.
        assert!(matches!(s.share(5 * H, Some(4.5), 0.0), Share::Open));
        assert_eq!(s.share(5 * H, None, 0.5), Share::Open);
        // The window moving on opens the reserve, then the public share again.
        assert!(matches!(
            s.share(24 * H, Some(4.0), 0.25),
            Share::Operators { resumes_at_ms, .. } if resumes_at_ms == 26 * H
        ));
        assert_eq!(s.share(26 * H, Some(4.0), 0.25), Share::Open);
    }

    #[test]
    fn history_read_out_of_order_is_placed_by_time_and_bad_amounts_book_nothing() {
        let mut s = Spend::default();
        s.add(5 * H, 1.0);
        s.add(H, 1.0);
        s.add(3 * H, f64::NAN);
        s.add(3 * H, -4.0);
        assert_eq!(s.spent(6 * H), 2.0);
        assert!(matches!(
            s.allowance(6 * H, Some(1.5)),
            Allowance::Over { resumes_at_ms, .. } if resumes_at_ms == 25 * H
        ));
    }
}
