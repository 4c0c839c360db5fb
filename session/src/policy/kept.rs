//! What [`Telemetry`] knows of a session between its turns, in a form that outlives the
//! process: a gateway restarted during her silence goes on keeping her cache warm, and prices
//! her next turn, as if it had not stopped.
//!
//! Without it a restart forgot her conversation's size and when her cache was last touched:
//! no refresh came before her next turn (with a 1-hour TTL, a silence of hours then rewrites a
//! conversation the refreshes would have kept at a tenth of the price), and the cold-cache
//! and ski-rental rules could not act on her first turn after it.
//!
//! [`Instant`]s do not outlive a process, so times are kept as Unix milliseconds and turned
//! back into instants of the new process; the clock of both is passed in.

use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::Telemetry;

/// The part of [`Telemetry`] that describes her session rather than this process.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct KeptTelemetry {
    /// [`Telemetry::prefix_tokens`].
    pub prefix_tokens: u64,
    /// [`Telemetry::rehydration_tokens`] at her last turn.
    pub rehydration_tokens: u64,
    /// [`Telemetry::resend_tokens`] at her last turn.
    pub resend_tokens: u64,
    /// [`Telemetry::base_tokens`].
    pub base_tokens: u64,
    /// [`Telemetry::excess_read_cost`]: ski rental's rent so far.
    pub excess_read_cost: f64,
    /// [`Telemetry::keep_warm_cost`]: the refreshes since her last turn.
    pub keep_warm_cost: f64,
    /// [`Telemetry::last_cache_touch`], Unix milliseconds.
    pub last_cache_touch_ms: Option<i64>,
    /// [`Telemetry::last_turn_at`], Unix milliseconds.
    pub last_turn_ms: Option<i64>,
}

impl Telemetry {
    /// What to keep, `now` being `now_ms` on the Unix clock.
    pub fn keep(&self, now: Instant, now_ms: i64) -> KeptTelemetry {
        let ms = |at: Instant| now_ms - now.saturating_duration_since(at).as_millis() as i64;
        KeptTelemetry {
            prefix_tokens: self.prefix_tokens,
            rehydration_tokens: self.rehydration_tokens,
            resend_tokens: self.resend_tokens,
            base_tokens: self.base_tokens,
            excess_read_cost: self.excess_read_cost,
            keep_warm_cost: self.keep_warm_cost,
            last_cache_touch_ms: self.last_cache_touch.map(ms),
            last_turn_ms: self.last_turn_at.map(ms),
        }
    }

    /// Takes back what [`Telemetry::keep`] kept, `now` being `now_ms` on the Unix clock.
    ///
    /// A time older than this process's clock can show (on some platforms instants start at
    /// the machine's boot) is left unknown, except a cache touch older than `ttl`: the entry
    /// has expired, which any instant before `now - ttl` says as well, so the cold-cache rule
    /// still acts. A time in the future (the Unix clock set back) is taken as now.
    pub fn restore(&mut self, k: &KeptTelemetry, now: Instant, now_ms: i64, ttl: Duration) {
        let ago = |ms: i64| Duration::from_millis(now_ms.saturating_sub(ms).max(0) as u64);
        self.prefix_tokens = k.prefix_tokens;
        self.rehydration_tokens = k.rehydration_tokens;
        self.resend_tokens = k.resend_tokens;
        self.base_tokens = k.base_tokens;
        self.excess_read_cost = k.excess_read_cost;
        self.keep_warm_cost = k.keep_warm_cost;
        self.last_cache_touch = k.last_cache_touch_ms.map(ago).and_then(|ago| {
            now.checked_sub(ago).or_else(|| {
                (ago > ttl)
                    .then(|| now.checked_sub(ttl + Duration::from_secs(1)))
                    .flatten()
            })
        });
        self.last_turn_at = k.last_turn_ms.map(ago).and_then(|ago| now.checked_sub(ago));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cost::Ttl;
    use crate::policy::{decide, next_check, warm, Decision, PolicyConfig};

    /// An instant an hour ahead, so that the times before it exist on a machine just booted.
    fn later() -> Instant {
        Instant::now() + Duration::from_secs(3600)
    }

    fn told(now: Instant) -> Telemetry {
        Telemetry {
            prefix_tokens: 40_000,
            rehydration_tokens: 28_000,
            resend_tokens: 1_200,
            base_tokens: 26_000,
            excess_read_cost: 0.031,
            keep_warm_cost: 0.012,
            last_cache_touch: Some(now - Duration::from_secs(200)),
            last_turn_at: Some(now - Duration::from_secs(230)),
            ..Telemetry::default()
        }
    }

    #[test]
    fn a_restart_keeps_what_the_policy_knew_of_her_session() {
        let c = PolicyConfig::for_ttl(Ttl::FiveMinutes);
        let before = later();
        let t = told(before);
        let kept: KeptTelemetry =
            serde_json::from_str(&serde_json::to_string(&t.keep(before, 1_000_000_000)).unwrap())
                .unwrap();
        assert_eq!(kept.last_cache_touch_ms, Some(1_000_000_000 - 200_000));
        assert_eq!(kept.last_turn_ms, Some(1_000_000_000 - 230_000));
        // The new process starts 30 s later on both clocks.
        let now = before + Duration::from_secs(30);
        let mut back = Telemetry::default();
        back.restore(&kept, now, 1_000_030_000, c.ttl.duration());
        assert_eq!(back, t);
        // So the refresh comes when it would have: before the entry's expiry.
        assert_eq!(
            next_check(&back, &c, None),
            next_check(&t, &c, None),
            "{back:?}"
        );
        let at = next_check(&back, &c, None).unwrap();
        assert!(warm(&back, &c, at));
        assert_eq!(decide(&back, at, &c), decide(&t, at, &c));
    }

    #[test]
    fn a_restart_after_her_cache_expired_knows_it_expired() {
        let c = PolicyConfig::for_ttl(Ttl::FiveMinutes);
        let before = later();
        let kept = told(before).keep(before, 1_000_000_000);
        // Back a year later, longer than this process's instants reach back.
        let now = before + Duration::from_secs(60);
        let mut back = Telemetry::default();
        back.restore(
            &kept,
            now,
            1_000_000_000 + 365 * 86_400_000,
            c.ttl.duration(),
        );
        assert_eq!(back.prefix_tokens, 40_000);
        assert!(back.last_cache_touch.is_some(), "{back:?}");
        assert!(!warm(&back, &c, now));
        // No refresh of an expired entry; her next batch finds the cache cold, and her
        // conversation (40k) larger than a fresh start (28k): she starts fresh.
        assert_eq!(decide(&back, now, &c), Decision::Continue);
        back.batch_waiting = true;
        assert_eq!(
            decide(&back, now, &c),
            Decision::FreshStart(crate::policy::Reason::ColdCache)
        );
    }

    #[test]
    fn a_unix_clock_set_back_is_taken_as_now() {
        let c = PolicyConfig::for_ttl(Ttl::FiveMinutes);
        let before = later();
        let kept = told(before).keep(before, 1_000_000_000);
        let now = before + Duration::from_secs(5);
        let mut back = Telemetry::default();
        back.restore(&kept, now, 900_000_000, c.ttl.duration());
        assert_eq!(back.last_cache_touch, Some(now));
        assert_eq!(back.last_turn_at, Some(now));
    }
}
