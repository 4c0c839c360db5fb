//! The refresh policy: a pure function of measured telemetry, the time and the configuration.
//!
//! Called before each turn (a batch is waiting) and on the timer it asks for
//! ([`next_check`]) while idle. Rules, in order:
//! 1. The last turn was refused as too long (HTTP 400, or the CLI's own blocking limit, which it
//!    enforces without calling the API) -> compact or start fresh, whichever costs less.
//! 2. The context is past the watermark (well before the blocking limit) -> the same choice.
//! 3. A batch waits, the cache has expired, and the prefix is large: resuming would rewrite the
//!    whole prefix at the write price, so start fresh (rehydrated) if that is cheaper.
//! 4. Ski rental: shrink (compact or start fresh, whichever costs less) once the cache reads
//!    (turns' and keep-warm refreshes') paid above the rehydration size since the last fresh
//!    start reach the cost of a fresh start (at most twice the hindsight optimum).
//! 5. Idle (no batch): refresh the cache shortly before it expires while the refreshes paid
//!    since the last turn stay below the cost of the rewrite they avoid (ski rental again),
//!    and only when a batch is likely enough to come while the refreshed entries live for the
//!    saving to beat the refreshes' price (by her gaps, [`GapModel`], or where they say
//!    nothing by a scale-free prior: the longer a silence has lasted, the longer it goes on);
//!    otherwise evict a process idle for longer than `evict_after` (its session stays resumable).
//!
//! A fresh start's cost ([`rebuild_cost`]) counts what it writes: the rehydration now, and the
//! recent lines of her rooms that the rehydration leaves out, which each room's next batch
//! shows again. The rent weighed against it (rule 4) is the reads above the rehydration alone,
//! since a new session starts from that and the lines come back only with their rooms. After an
//! expired cache (rule 3) the comparison is with the rehydration alone too: a cold session
//! rewrites its whole conversation at every expiry, a room's lines are sent again once (in the
//! session benchmark, counting them there cost the reference 0.6% more with 5 minutes). A room
//! that never speaks again makes the price an overestimate, and loosens rule 4's bound of twice
//! the optimum by as much.
//! A compaction's cost counts the summary it writes: the mean of the last compactions' summary
//! sizes once there has been one, `compact_summary_tokens` before.
//!
//! Every rule's inputs are in [`Telemetry`], so a logged decision can be replayed.

use std::time::{Duration, Instant};

use crate::cost::{Prices, Ttl};

pub mod gaps;
pub mod kept;
pub use gaps::GapModel;
pub use kept::KeptTelemetry;

/// Policy constants.
#[derive(Clone, Debug, PartialEq)]
pub struct PolicyConfig {
    /// The model's context window (tokens).
    pub context_window: u64,
    /// The CLI refuses turns at `context_window - blocking_margin` (200k window: 177k).
    pub blocking_margin: u64,
    /// Act once the prefix passes this share of the blocking limit.
    pub watermark: f64,
    /// Cache lifetime in use.
    pub ttl: Ttl,
    /// Price table.
    pub prices: Prices,
    /// Evict a live process idle this long.
    pub evict_after: Duration,
    /// Start fresh after an expired cache only when the cold prefix is this many times the
    /// rehydration size (continuity is worth something).
    pub cold_prefix_factor: f64,
    /// Expected size of a compaction summary (tokens of output, then of prefix) until one
    /// has been measured.
    pub compact_summary_tokens: u64,
    /// Refresh the cache before it expires (bounded by ski rental).
    pub keep_warm: bool,
    /// Refresh only when a batch is likely enough before the refreshed entry expires, by her
    /// gaps or, where they say nothing, a scale-free prior (see [`GapModel`]); off, the
    /// ski-rental bound alone.
    pub predictive: bool,
    /// How long before the reckoned expiry a refresh fires, at most: its own start-up (a CLI
    /// start and one request, 1-2 s) with room to spare. Once her refreshes have been timed
    /// the lead is measured instead ([`Telemetry::keep_warm_lead`]), never more than this.
    /// The expiry is reckoned from the start of the last request that read the cache (a
    /// turn's last request, a refresh), never from a turn's end: a long reply streams after
    /// its read. Each refresh buys `ttl - lead` of warmth, so a long lead is paid for in
    /// refreshes.
    pub keep_warm_lead: Duration,
}

impl Default for PolicyConfig {
    fn default() -> Self {
        Self {
            context_window: 200_000,
            blocking_margin: 23_000,
            watermark: 0.75,
            ttl: Ttl::OneHour,
            prices: Prices::default(),
            evict_after: Duration::from_secs(2 * 3600),
            cold_prefix_factor: 1.0,
            compact_summary_tokens: 4_000,
            keep_warm: true,
            predictive: true,
            keep_warm_lead: Duration::from_secs(10),
        }
    }
}

impl PolicyConfig {
    /// Defaults for a cache TTL: keep-warm on, predicted from her gaps, with either TTL. In
    /// the session benchmark (docs/economics.md) with 5 minutes it saved up to 62% against none, broke even
    /// where it never fired, and cost 3% more on quiet operator DMs; unpredicted, it cost up to
    /// 1.8x what none did.
    ///
    /// A refresh fires at most `keep_warm_lead` (10 s, at most a tenth of the TTL) before the
    /// expiry; once her refreshes are timed, three times the slowest (at least 3 s).
    /// While a turn's touch was taken at its end, the first refresh after it needed a lead
    /// covering the reply's streaming too (a tenth of the TTL, at most a minute): with 5
    /// minutes that cost one refresh in ten on gaps kept warm.
    pub fn for_ttl(ttl: Ttl) -> Self {
        let defaults = Self::default();
        Self {
            ttl,
            keep_warm_lead: defaults.keep_warm_lead.min(ttl.duration() / 10),
            ..defaults
        }
    }

    /// Where the CLI starts refusing turns.
    pub fn blocking_limit(&self) -> u64 {
        self.context_window.saturating_sub(self.blocking_margin)
    }

    /// Prefix size at which rule 2 acts.
    pub fn watermark_tokens(&self) -> u64 {
        (self.blocking_limit() as f64 * self.watermark) as u64
    }
}

/// How the last turn ended.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Outcome {
    /// No turn yet.
    #[default]
    None,
    /// A result without error.
    Ok,
    /// HTTP 400 prompt too long.
    PromptTooLong,
    /// The CLI refused the turn at its blocking limit.
    BlockingLimit,
    /// Retries exhausted or another API error (handled by the caller's retry, not here).
    ApiError,
}

/// Whether a CLI process is running for the Persona.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Process {
    /// Running and idle between turns.
    Running,
    /// Not running (never started, evicted, or crashed); the session can be resumed.
    #[default]
    Stopped,
}

/// What the policy sees, all measured.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Telemetry {
    /// Whether a batch is waiting for a turn.
    pub batch_waiting: bool,
    /// The process.
    pub process: Process,
    /// How the last turn ended.
    pub last_outcome: Outcome,
    /// The conversation's size: the last request's prompt tokens plus its output.
    pub prefix_tokens: u64,
    /// What a fresh start would send: system prompt, Persona state, recent room timelines.
    pub rehydration_tokens: u64,
    /// Her rooms' recent lines that the session holds and a fresh start's rehydration would
    /// leave out (it carries at most half of `context_bytes` of lines): each of those rooms'
    /// next batch shows them again as context, so a fresh start writes them too. With more
    /// rooms than the rehydration holds, this is most of a fresh start's price.
    pub resend_tokens: u64,
    /// The part of the rehydration that a compaction keeps too (system prompt and state).
    pub base_tokens: u64,
    /// When the last request that read or wrote the cache began (a turn's last request, a
    /// keep-warm refresh, a compaction): never later than the read, so the expiry reckoned
    /// from it is never late.
    pub last_cache_touch: Option<Instant>,
    /// End of the last turn.
    pub last_turn_at: Option<Instant>,
    /// Dollars of cache reads (turns' and keep-warm refreshes') above the rehydration size,
    /// summed since the last fresh start: the rent of the conversation, which ski rental weighs
    /// against a fresh start.
    pub excess_read_cost: f64,
    /// Dollars of keep-warm refreshes since the last turn.
    pub keep_warm_cost: f64,
    /// Her gaps between batches.
    pub gaps: GapModel,
    /// The last compactions' summary sizes (output tokens), newest last, at most
    /// [`Telemetry::SUMMARIES_KEPT`].
    pub summaries: Vec<u64>,
    /// How long her last keep-warm refreshes took, start to result, newest last (at most
    /// [`Telemetry::REFRESHES_KEPT`]); one that found the cache expired counts as the
    /// configured lead. See [`Telemetry::keep_warm_lead`].
    pub refreshes_took: Vec<Duration>,
}

impl Telemetry {
    /// Compaction summaries remembered for the learned size.
    pub const SUMMARIES_KEPT: usize = 4;
    /// Refresh durations remembered for the measured lead: one that found the cache expired
    /// holds the lead at its ceiling for this many refreshes.
    pub const REFRESHES_KEPT: usize = 16;
    /// The measured lead is this many times the slowest refresh remembered...
    pub const LEAD_MARGIN: u32 = 3;
    /// ...and never shorter than this.
    pub const MIN_LEAD: Duration = Duration::from_secs(3);

    /// What a fresh start writes: the rehydration, then the lines its rooms send again.
    pub fn fresh_start_tokens(&self) -> u64 {
        self.rehydration_tokens.saturating_add(self.resend_tokens)
    }

    /// How long before the reckoned expiry a refresh fires. A refresh's request reads the
    /// cache some time after it starts (the CLI's start-up, then the request's way to the
    /// API); its whole duration, answer included, bounds that. So the lead is
    /// [`Self::LEAD_MARGIN`] times the slowest of her last refreshes, at least
    /// [`Self::MIN_LEAD`] and at most the configured `keep_warm_lead`, which is also the lead
    /// before any refresh has been timed. A lead too short costs a rewrite of the whole
    /// prefix (1.25x against a read's 0.1x, the saving of hundreds of refreshes' shorter
    /// leads), so a refresh that finds the cache expired puts the lead back at its ceiling
    /// for the next [`Self::REFRESHES_KEPT`] refreshes.
    pub fn keep_warm_lead(&self, c: &PolicyConfig) -> Duration {
        match self.refreshes_took.iter().max() {
            None => c.keep_warm_lead,
            Some(slowest) => slowest
                .saturating_mul(Self::LEAD_MARGIN)
                .max(Self::MIN_LEAD)
                .min(c.keep_warm_lead),
        }
    }

    /// Books a batch ready at `now`: its gap since her last turn feeds [`GapModel`]. Whether
    /// a gap was booked (not before her first turn).
    pub fn batch_arrived(&mut self, now: Instant) -> bool {
        let Some(at) = self.last_turn_at else {
            return false;
        };
        self.gaps.observe(now.saturating_duration_since(at));
        true
    }

    /// The summary size a compaction is expected to write: the mean of the last ones measured,
    /// or the configured guess before any.
    pub fn summary_tokens(&self, c: &PolicyConfig) -> u64 {
        match self.summaries.len() as u64 {
            0 => c.compact_summary_tokens,
            n => self.summaries.iter().sum::<u64>() / n,
        }
    }

    /// Books a finished turn: its usage (the last request's), how it ended, when its last
    /// request began (`read_at`, the cache's touch) and when it ended (`now`, her last turn,
    /// from which her next gap is measured).
    pub fn after_turn(
        &mut self,
        usage: &crate::cost::Usage,
        outcome: Outcome,
        read_at: Instant,
        now: Instant,
        prices: &Prices,
    ) {
        self.prefix_tokens = usage.prompt_tokens() + usage.output;
        self.excess_read_cost += Prices::dollars(
            usage.cache_read.saturating_sub(self.rehydration_tokens),
            prices.cache_read,
        );
        self.last_cache_touch = Some(read_at.min(now));
        self.last_turn_at = Some(now);
        self.last_outcome = outcome;
        self.keep_warm_cost = 0.0;
    }

    /// Books the reads of a turn's requests before its last (a reply bounced by the schema is
    /// asked for again, the conversation read each time): their read above the rehydration
    /// is rent like the last one's, which [`Self::after_turn`] books.
    pub fn book_earlier_reads(&mut self, reads: &[u64], prices: &Prices) {
        for read in reads {
            self.excess_read_cost += Prices::dollars(
                read.saturating_sub(self.rehydration_tokens),
                prices.cache_read,
            );
        }
    }

    /// Books a fresh start: the ski-rental account starts over.
    pub fn after_fresh_start(&mut self) {
        self.excess_read_cost = 0.0;
    }

    /// After a compaction whose request began at `read_at`: the conversation is now
    /// `post_tokens` long (summary and what was kept), and the read cost above the
    /// rehydration starts again from zero. `summary_tokens` (what the compaction wrote) is
    /// learned for the next one; 0 (not measured) is not.
    pub fn after_compact(&mut self, post_tokens: u64, summary_tokens: u64, read_at: Instant) {
        if summary_tokens > 0 {
            if self.summaries.len() == Self::SUMMARIES_KEPT {
                self.summaries.remove(0);
            }
            self.summaries.push(summary_tokens);
        }
        self.prefix_tokens = post_tokens;
        self.excess_read_cost = 0.0;
        self.last_outcome = Outcome::Ok;
        self.last_cache_touch = Some(read_at);
    }

    /// Whether a keep-warm refresh with `usage` found (part of) the cache expired: it read
    /// less than nine tenths of the prefix.
    fn refresh_missed(&self, usage: &crate::cost::Usage) -> bool {
        usage.cache_read.saturating_mul(10) < self.prefix_tokens.saturating_mul(9)
    }

    /// Books a keep-warm refresh with `usage`, costing `dollars`, started at `started` (before
    /// its request read the cache, so the expiry reckoned from it is never late) and taking
    /// `took`. One that missed (`refresh_missed`) holds the lead at the configured
    /// ceiling (see [`Self::keep_warm_lead`]). A long last reply, written in its tail, can
    /// look like a miss too; then the lead is only longer than it need be for a while.
    /// Whether it missed, for the caller's log and count.
    pub fn after_keep_warm(
        &mut self,
        usage: &crate::cost::Usage,
        dollars: f64,
        started: Instant,
        took: Duration,
        c: &PolicyConfig,
    ) -> bool {
        let missed = self.refresh_missed(usage);
        self.keep_warm_cost += dollars;
        // Its read of the conversation beyond the rehydration is rent too.
        self.excess_read_cost += Prices::dollars(
            usage.cache_read.saturating_sub(self.rehydration_tokens),
            c.prices.cache_read,
        );
        self.last_cache_touch = Some(started);
        if self.refreshes_took.len() == Self::REFRESHES_KEPT {
            self.refreshes_took.remove(0);
        }
        self.refreshes_took
            .push(if missed { c.keep_warm_lead } else { took });
        missed
    }
}

/// Why a session is compacted or restarted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reason {
    /// HTTP 400.
    PromptTooLong,
    /// The CLI's blocking limit.
    BlockingLimit,
    /// Past the watermark.
    Watermark,
    /// The cache expired and the prefix is large.
    ColdCache,
    /// The ski-rental rule.
    SkiRental,
}

/// What to do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decision {
    /// Go on (run the waiting batch in the live session, or stay idle).
    Continue,
    /// Compact the conversation, then go on.
    Compact(Reason),
    /// Start a new session rehydrated from the recent timelines.
    FreshStart(Reason),
    /// Stop the idle process; resume later.
    Evict,
    /// Refresh the cache now with a forked, unpersisted one-line request.
    KeepWarm,
}

/// Dollars to start fresh: write the rehydration prefix, and the lines of her rooms that it
/// leaves out and their next batches show again ([`Telemetry::resend_tokens`]).
pub fn rebuild_cost(t: &Telemetry, c: &PolicyConfig) -> f64 {
    Prices::dollars(t.fresh_start_tokens(), c.prices.write(c.ttl))
}

/// Dollars to compact now: read (or, cold, rewrite) the prefix, write the summary as output,
/// then write base + summary as the new prefix.
pub fn compact_cost(t: &Telemetry, c: &PolicyConfig, now: Instant) -> f64 {
    let p = &c.prices;
    let read = if warm(t, c, now) {
        p.cache_read
    } else {
        p.write(c.ttl)
    };
    let summary = t.summary_tokens(c);
    Prices::dollars(t.prefix_tokens, read)
        + Prices::dollars(summary, p.output)
        + Prices::dollars(t.base_tokens + summary, p.write(c.ttl))
}

/// Tokens a keep-warm refresh writes: the tail after the conversation's entry (her last
/// reply) and its ping, measured at about 210 on the mock.
pub const REFRESH_WRITE_TOKENS: u64 = 256;

/// Dollars one keep-warm refresh costs: a read of the prefix, a write of its tail and ping
/// (each ping is new, see `driver::refresh_fork`), a few tokens of output.
pub fn refresh_cost(t: &Telemetry, c: &PolicyConfig) -> f64 {
    Prices::dollars(t.prefix_tokens, c.prices.cache_read)
        + Prices::dollars(REFRESH_WRITE_TOKENS, c.prices.write(c.ttl))
        + Prices::dollars(8, c.prices.output)
}

/// Dollars of the rewrite a keep-warm refresh avoids: her next turn would rewrite the prefix,
/// or start fresh if that is cheaper.
pub fn avoided_rewrite_cost(t: &Telemetry, c: &PolicyConfig) -> f64 {
    Prices::dollars(t.prefix_tokens, c.prices.write(c.ttl)).min(rebuild_cost(t, c))
}

/// Whether the cache entry is still alive at `now`.
pub fn warm(t: &Telemetry, c: &PolicyConfig, now: Instant) -> bool {
    t.last_cache_touch
        .is_some_and(|at| now < at + c.ttl.duration())
}

/// The decision (see the module docs for the rules).
pub fn decide(t: &Telemetry, now: Instant, c: &PolicyConfig) -> Decision {
    let shrink = |reason| {
        if compact_cost(t, c, now) < rebuild_cost(t, c) {
            Decision::Compact(reason)
        } else {
            Decision::FreshStart(reason)
        }
    };
    match t.last_outcome {
        Outcome::PromptTooLong => return shrink(Reason::PromptTooLong),
        Outcome::BlockingLimit => return shrink(Reason::BlockingLimit),
        _ => {}
    }
    if t.prefix_tokens >= c.watermark_tokens() {
        return shrink(Reason::Watermark);
    }
    if t.batch_waiting {
        let cold = t.last_cache_touch.is_some() && !warm(t, c, now);
        if cold && t.prefix_tokens as f64 > t.rehydration_tokens as f64 * c.cold_prefix_factor {
            return Decision::FreshStart(Reason::ColdCache);
        }
        if t.excess_read_cost >= rebuild_cost(t, c) && t.prefix_tokens > t.fresh_start_tokens() {
            return shrink(Reason::SkiRental);
        }
        return Decision::Continue;
    }
    if keep_warm_due(t, now, c) {
        return Decision::KeepWarm;
    }
    if t.process == Process::Running && t.last_turn_at.is_some_and(|at| now >= at + c.evict_after) {
        return Decision::Evict;
    }
    Decision::Continue
}

/// Whether an idle session should refresh its cache now.
fn keep_warm_due(t: &Telemetry, now: Instant, c: &PolicyConfig) -> bool {
    let Some(touch) = t.last_cache_touch else {
        return false;
    };
    if !c.keep_warm || t.prefix_tokens == 0 {
        return false;
    }
    let expiry = touch + c.ttl.duration();
    let lead = t.keep_warm_lead(c);
    let fire_at = expiry.checked_sub(lead).unwrap_or(touch);
    let rewrite = avoided_rewrite_cost(t, c);
    let refresh = refresh_cost(t, c);
    if !(now >= fire_at && now < expiry && t.keep_warm_cost + refresh <= rewrite) {
        return false;
    }
    if !c.predictive {
        return true;
    }
    // Kept warm, her next batch reads the prefix instead of rewriting it; the refreshes the
    // ski-rental budget still allows are the horizon.
    let idle = t
        .last_turn_at
        .map_or(Duration::ZERO, |at| now.saturating_duration_since(at));
    let saving = rewrite - Prices::dollars(t.prefix_tokens, c.prices.cache_read);
    let left = ((rewrite - t.keep_warm_cost) / refresh)
        .floor()
        .clamp(1.0, 1e4) as u32;
    let period = c.ttl.duration().saturating_sub(lead);
    t.gaps
        .keep_warm_gain(idle, period, c.ttl.duration(), saving, refresh, left)
        > 0.0
}

/// When an idle session should be looked at again (keep-warm or eviction), if ever, leaving
/// out `fired`: a check that already ran and changed nothing (a declined refresh) is not
/// asked for again, but the next one (eviction) still is.
pub fn next_check(t: &Telemetry, c: &PolicyConfig, fired: Option<Instant>) -> Option<Instant> {
    let keep_warm = t
        .last_cache_touch
        .filter(|_| c.keep_warm && t.prefix_tokens > 0)
        .map(|touch| {
            (touch + c.ttl.duration())
                .checked_sub(t.keep_warm_lead(c))
                .unwrap_or(touch)
        });
    let evict = t
        .last_turn_at
        .filter(|_| t.process == Process::Running)
        .map(|at| at + c.evict_after);
    [keep_warm, evict]
        .into_iter()
        .flatten()
        .filter(|at| Some(*at) != fired)
        .min()
}

/// What her idle timer does when it fires, from the policy's decision and what holds around it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Idle {
    /// Refresh her cache (a keep-warm fork of her session).
    KeepWarm,
    /// Stop her idle process (her session stays on disk).
    Evict,
    /// Nothing now.
    Nothing,
    /// A keep-warm the policy wanted, skipped: her spend is past the public share of her cap
    /// (what is left is her operators' turns), or past the cap. Not tried again before her next
    /// turn.
    SkipForBudget,
}

/// The idle action for `decision`, when she has a session (`has_session`) and her budget is
/// open (`budget_open`: below the public share of her cap). Only a keep-warm depends on them: it
/// needs a session to fork, and it is spend no one asked for, so it waits for an open budget.
pub fn idle(decision: Decision, has_session: bool, budget_open: bool) -> Idle {
    match decision {
        Decision::KeepWarm if !has_session => Idle::Nothing,
        Decision::KeepWarm if !budget_open => Idle::SkipForBudget,
        Decision::KeepWarm => Idle::KeepWarm,
        Decision::Evict => Idle::Evict,
        _ => Idle::Nothing,
    }
}

#[cfg(test)]
mod tests;
