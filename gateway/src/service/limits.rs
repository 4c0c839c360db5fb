//! Per-client limits and a rate-limited refusal log: what keeps one busy, buggy or hostile
//! client from starving the others. Pure: time is passed in.

use std::collections::HashMap;
use std::net::IpAddr;
use std::time::{Duration, Instant};

/// What one authenticated client may ask of the service.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ClientLimits {
    /// Requests per second, sustained (a token bucket refilled at this rate).
    pub requests_per_sec: f64,
    /// Requests it may make at once above the rate (the bucket's size).
    pub burst: f64,
    /// Requests of its own still running (sends waiting for the homeserver, session verbs
    /// waiting for her turn loop); beyond it a request is answered `failed`.
    pub max_in_flight: usize,
}

impl From<&crate::config::CultNet> for ClientLimits {
    /// The per-client limits `[cultnet]` sets.
    fn from(c: &crate::config::CultNet) -> Self {
        Self {
            requests_per_sec: f64::from(c.requests_per_sec.max(1)),
            burst: f64::from(c.request_burst.max(1)),
            max_in_flight: c.max_in_flight.max(1),
        }
    }
}

impl Default for ClientLimits {
    fn default() -> Self {
        Self {
            requests_per_sec: 10_000.0,
            burst: 10_000.0,
            max_in_flight: 16,
        }
    }
}

/// What [`Budget::take`] decided about one request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Within its limits.
    Allow,
    /// Over its rate: answer `failed`, retry later.
    Refuse,
    /// Refused more than a burst's worth within one second (it does not slow down when
    /// told): disconnect it.
    Disconnect,
}

/// One client's token bucket.
#[derive(Clone, Debug)]
pub struct Budget {
    tokens: f64,
    last: Instant,
    /// Requests refused since `window` began (a window lasts a second).
    refused: u64,
    window: Instant,
}

impl Budget {
    /// A full bucket at `now`.
    pub fn new(limits: &ClientLimits, now: Instant) -> Self {
        Self {
            tokens: limits.burst.max(1.0),
            last: now,
            refused: 0,
            window: now,
        }
    }

    /// Spends one request at `now`.
    pub fn take(&mut self, limits: &ClientLimits, now: Instant) -> Verdict {
        let dt = now.saturating_duration_since(self.last).as_secs_f64();
        self.last = self.last.max(now);
        self.tokens = (self.tokens + dt * limits.requests_per_sec).min(limits.burst.max(1.0));
        if now >= self.window + Duration::from_secs(1) {
            self.window = now;
            self.refused = 0;
        }
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            return Verdict::Allow;
        }
        self.refused += 1;
        if self.refused as f64 > limits.burst.max(1.0) {
            Verdict::Disconnect
        } else {
            Verdict::Refuse
        }
    }
}

/// Refusal lines per source address, at most one per [`RefusalLog::EVERY`]; and at most
/// [`RefusalLog::PER_SECOND`] lines a second from everyone together. What is held back is
/// counted and reported with the next line that is let through.
#[derive(Debug, Default)]
pub struct RefusalLog {
    last: HashMap<IpAddr, Instant>,
    second: Option<Instant>,
    in_second: u32,
    suppressed: u64,
}

impl RefusalLog {
    /// One line per address at most this often.
    pub const EVERY: Duration = Duration::from_secs(10);
    /// Lines per second from all addresses together, at most.
    pub const PER_SECOND: u32 = 10;
    /// Addresses remembered (a spray from more is forgotten wholesale; the global cap holds).
    const MAX_ADDRESSES: usize = 4096;

    /// Whether a refusal from `ip` at `now` may be logged; `Some(n)` = yes, and `n` refusals
    /// were held back since the last line.
    pub fn admit(&mut self, ip: IpAddr, now: Instant) -> Option<u64> {
        if self.last.get(&ip).is_some_and(|t| now < *t + Self::EVERY) {
            self.suppressed += 1;
            return None;
        }
        match self.second {
            Some(s) if now < s + Duration::from_secs(1) => {
                if self.in_second >= Self::PER_SECOND {
                    self.suppressed += 1;
                    return None;
                }
            }
            _ => {
                self.second = Some(now);
                self.in_second = 0;
            }
        }
        self.in_second += 1;
        if self.last.len() >= Self::MAX_ADDRESSES {
            self.last.clear();
        }
        self.last.insert(ip, now);
        Some(std::mem::take(&mut self.suppressed))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bucket_allows_its_burst_then_its_rate_then_disconnects_a_client_that_ignores_it() {
        let l = ClientLimits {
            requests_per_sec: 100.0,
            burst: 10.0,
            max_in_flight: 1,
        };
        let t0 = Instant::now();
        let mut b = Budget::new(&l, t0);
        let allowed = (0..10).filter(|_| b.take(&l, t0) == Verdict::Allow).count();
        assert_eq!(allowed, 10);
        assert_eq!(b.take(&l, t0), Verdict::Refuse);
        // 10 ms later one more token.
        let t1 = t0 + Duration::from_millis(10);
        assert_eq!(b.take(&l, t1), Verdict::Allow);
        assert_eq!(b.take(&l, t1), Verdict::Refuse);
        // A client refused more than a burst's worth (10) within a second is cut off: two
        // refusals so far, eight more are refused, the eleventh ends it.
        let verdicts: Vec<_> = (0..11).map(|_| b.take(&l, t1)).collect();
        assert_eq!(verdicts.last(), Some(&Verdict::Disconnect));
        assert_eq!(
            verdicts.iter().filter(|v| **v == Verdict::Refuse).count(),
            8
        );
        // Time heals: after a second the bucket is full again (never more than the burst).
        let t2 = t1 + Duration::from_secs(5);
        let allowed = (0..20).filter(|_| b.take(&l, t2) == Verdict::Allow).count();
        assert_eq!(allowed, 10);
    }

    #[test]
    fn refusals_are_logged_once_per_address_and_a_few_a_second_overall() {
        let mut log = RefusalLog::default();
        let t0 = Instant::now();
        let ip = |i: u8| IpAddr::from([127, 0, 0, i]);
        assert_eq!(log.admit(ip(1), t0), Some(0));
        assert_eq!(log.admit(ip(1), t0 + Duration::from_secs(1)), None);
        // 249 addresses in one second: PER_SECOND lines, the first reporting the one line held
        // back before, the rest counted.
        let t1 = t0 + Duration::from_secs(2);
        let logged: Vec<u64> = (2..=250u8).filter_map(|i| log.admit(ip(i), t1)).collect();
        assert_eq!(logged.len(), RefusalLog::PER_SECOND as usize);
        assert_eq!(logged[0], 1);
        // The next line let through reports what was held back since.
        let t2 = t0 + Duration::from_secs(11);
        assert_eq!(log.admit(ip(1), t2), Some(249 - 10));
    }
}

/// Connects from one address whose signature is checked, at most, per second sustained...
pub const VERIFIES_PER_SEC: f64 = 20.0;
/// ...and at once above that rate.
pub const VERIFY_BURST: f64 = 40.0;
/// Addresses tracked at most; past it the ones with a full bucket are forgotten.
const VERIFY_ADDRESSES: usize = 4096;

/// Each source address's budget of signature checks (an ed25519 verify costs the service's one
/// thread tens of microseconds): a process sending Connects with bad signatures from one
/// address is refused before any is checked once it spends its budget, and other addresses
/// are not touched. Pure: time is passed in (ms).
#[derive(Debug, Default)]
pub struct VerifyBudget {
    buckets: HashMap<std::net::SocketAddr, (f64, u64)>,
}

impl VerifyBudget {
    /// Takes one check for `peer` at `now_ms`; `false` when its budget is spent.
    pub fn take(&mut self, peer: std::net::SocketAddr, now_ms: u64) -> bool {
        if self.buckets.len() >= VERIFY_ADDRESSES {
            self.buckets.retain(|_, (tokens, last)| {
                let refilled =
                    *tokens + now_ms.saturating_sub(*last) as f64 / 1000.0 * VERIFIES_PER_SEC;
                refilled < VERIFY_BURST
            });
        }
        let (tokens, last) = self.buckets.entry(peer).or_insert((VERIFY_BURST, now_ms));
        *tokens = (*tokens + now_ms.saturating_sub(*last) as f64 / 1000.0 * VERIFIES_PER_SEC)
            .min(VERIFY_BURST);
        *last = now_ms.max(*last);
        if *tokens >= 1.0 {
            *tokens -= 1.0;
            true
        } else {
            false
        }
    }
}

#[cfg(test)]
mod verify_budget_tests {
    use super::*;

    fn addr(port: u16) -> std::net::SocketAddr {
        std::net::SocketAddr::from(([127, 0, 0, 1], port))
    }

    #[test]
    fn an_address_gets_its_burst_then_its_rate_and_others_are_untouched() {
        let mut b = VerifyBudget::default();
        let now = 1_000_000;
        let taken = (0..100).filter(|_| b.take(addr(1), now)).count();
        assert_eq!(taken, VERIFY_BURST as usize);
        assert!(b.take(addr(2), now), "another address has its own budget");
        // A second later, a second's worth more.
        let later = (0..100).filter(|_| b.take(addr(1), now + 1000)).count();
        assert_eq!(later, VERIFIES_PER_SEC as usize);
    }
}
