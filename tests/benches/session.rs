//! The session benchmark: each committed workload (`fixtures/workload/*.json`, see
//! `tests::workload::Shape`) replayed through the real claude CLI against the mock Messages API
//! on a virtual clock, three ways, once with a 1-hour and once with a 5-minute cache TTL:
//!
//! - **rebuild**: a new process per batch with the doctrine and state as system prompt and 20
//!   context lines per delivery (the old design);
//! - **resume**: a new process per batch that resumes one session (`claude -p --resume`, its
//!   own auto-compaction on: the CLI's defaults, the way a per-turn harness runs it), fed the
//!   same batches as live;
//! - **live**: one process fed each batch, every fresh start, compaction (by the CLI's
//!   `/compact`), eviction and keep-warm decided by `session::policy::decide`; with 5 minutes
//!   also without keep-warm and with keep-warm unpredicted, to show what prediction does.
//!
//! For each: the mock's billed cost, cache hit share, and message-to-reply latency (batch
//! ready -> reply in hand; the mock answers after a fixed `LATENCY_MS`, default 200). For live:
//! its schedule's cost against the hindsight optimum (fresh starts, compactions and keep-warm
//! refreshes chosen knowing every gap and size in advance) under one cost model.
//!
//! `cargo bench -p tests --bench session` (all workloads, about an hour). `WORKLOADS=busy-room,
//! quiet-dms` picks some, `BATCHES=N` replays only the first N batches of each, `TTLS=5m` one
//! TTL; `LEAD_SECS=N` and `COLD_FACTOR=F` change the policy's refresh lead (its ceiling: the lead
//! is measured from her refreshes) and continuity factor,
//! `SCHEDULE=1` prints where live lost to the optimum, `LEDGER=1` the mock's requests;
//! `SEASONED=1` lets live learn her gaps of another day of the same shape first (a Persona the
//! gateway already knows; her gaps are stored and outlive a restart); `DAYS=N` replays N days
//! of the shape in one life (the committed day first). The summary tables at
//! the end are the README's.

use std::collections::{BTreeMap, VecDeque};
use std::path::Path;
use std::time::{Duration, Instant};

use gateway::config::Limits;
use serde_json::Value;
use session::cost::{Prices, Ttl};
use session::driver::{one_shot, refresh_fork, Cli, CliConfig, Compaction};
use session::policy::{decide, next_check, Decision, Outcome, PolicyConfig, Process, Telemetry};
use session::render::{render, reply_schema, Seen};
use tests::mock_api::{MockApi, MockConfig};
use tests::workload::Shape;
use wire::docs::{ContextLine, Delivery};

/// What a turn started from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Reset {
    /// The conversation so far.
    None,
    /// A fresh session rehydrated from the rooms' recent lines.
    Fresh,
    /// The conversation compacted to base + summary.
    Compact,
}

/// What the cost model needs about one turn of a live replay.
#[derive(Clone, Copy, Debug)]
struct Step {
    /// Virtual seconds since the previous turn.
    gap: u64,
    /// Keep-warm refreshes the replay made in that gap.
    refreshes: u32,
    /// Seconds since the previous touch of the cache (turn or refresh).
    idle: u64,
    /// Tokens this turn added to the conversation (batch, reply).
    growth: u64,
    /// What a fresh start would have sent at this turn.
    rehydration: u64,
    /// What the replay did before this turn.
    reset: Reset,
}

/// One way's run on one workload and TTL.
#[derive(Default)]
struct Report {
    label: String,
    steps: Vec<Step>,
    turns: usize,
    cost: f64,
    prompt_tokens: u64,
    cache_read: u64,
    restarts: BTreeMap<String, usize>,
    keep_warm: usize,
    keep_warm_cost: f64,
    evictions: usize,
    summaries: Vec<u64>,
    latency: Vec<Duration>,
    base: u64,
}

impl Report {
    /// This report with the mock's bill for `turns` turns under `label`.
    fn billed(self, label: String, mock: &MockApi, turns: usize) -> Report {
        let ledger = mock.ledger();
        Report {
            label,
            turns,
            cost: ledger.iter().map(|e| e.cost).sum(),
            prompt_tokens: ledger.iter().map(|e| e.usage.prompt_tokens()).sum(),
            cache_read: ledger.iter().map(|e| e.usage.cache_read).sum(),
            ..self
        }
    }
    fn per_turn(&self) -> f64 {
        self.cost / self.turns.max(1) as f64
    }
    fn hit(&self) -> f64 {
        self.cache_read as f64 / self.prompt_tokens.max(1) as f64
    }
    fn p50(&self) -> Duration {
        let mut l = self.latency.clone();
        l.sort();
        l.get(l.len() / 2).copied().unwrap_or_default()
    }
}

/// Everything one replay needs.
struct Run<'a> {
    w: &'a Value,
    batches: usize,
    ttl: Ttl,
    latency: Duration,
    scratch: std::path::PathBuf,
    /// Her gaps of the day before, learned before the first batch (`SEASONED=1`): a Persona
    /// whose habits the gateway already knows, as it does after a restart. Empty: a new one.
    yesterday: &'a [Duration],
}

impl Run<'_> {
    async fn mock(&self) -> MockApi {
        MockApi::start(MockConfig {
            latency: self.latency,
            ..MockConfig::default()
        })
        .await
        .expect("mock")
    }

    fn dir(&self, way: &str) -> std::path::PathBuf {
        let dir = self.scratch.join(format!("{way}-{:?}", self.ttl));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("scratch dir");
        dir
    }

    fn batches(&self) -> impl Iterator<Item = &Value> {
        self.w["batches"]
            .as_array()
            .into_iter()
            .flatten()
            .take(self.batches)
    }

    fn doctrine(&self) -> &str {
        self.w["doctrine"].as_str().unwrap_or_default()
    }

    fn state(&self) -> &str {
        self.w["state"].as_str().unwrap_or_default()
    }

    /// Her `[persona.limits]`: the gateway's defaults, except for the long conversation, run
    /// as a Persona configured to keep her last documents (`context_bytes` 320 KiB).
    fn limits(&self) -> Limits {
        let mut limits = Limits::default();
        if self.w["name"] == "long-conversation" {
            limits.context_bytes = 327_680;
        }
        limits
    }
}

fn cfg(mock: &MockApi, dir: &Path, system: &Path, ttl: Ttl) -> CliConfig {
    CliConfig {
        exe: tests::claude_cli::executable(),
        model: "claude-sonnet-4-6".into(),
        system_prompt_file: system.to_path_buf(),
        json_schema: reply_schema(),
        config_dir: dir.join("config"),
        work_dir: dir.join("work"),
        api_base_url: mock.url(),
        credential: session::driver::Credential::ApiKey("mock-key".into()),
        cache_ttl: ttl,
        thinking: false,
        session_id: None,
        resume: false,
        system_prompt_changed: false,
        max_retries: Some(1),
        turn_timeout: Duration::from_secs(300),
        grace: Duration::from_secs(10),
    }
}

fn deliveries(batch: &Value, seq: &mut u64) -> Vec<Delivery> {
    batch["deliveries"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|d| {
            *seq += 1;
            Delivery {
                seq: *seq,
                persona: "mira".into(),
                room_id: d["room"].as_str().unwrap_or_default().into(),
                is_direct: d["direct"].as_bool().unwrap_or(false),
                event_id: format!("$e{seq}"),
                sender: d["sender"].as_str().unwrap_or_default().into(),
                ts: *seq as i64,
                text: d["text"].as_str().unwrap_or_default().into(),
                to_you: true,
                ..Delivery::default()
            }
        })
        .collect()
}

/// Per-room recent lines (bounded, each with its thread as the ear keeps them): what a
/// delivery's context and a fresh start are drawn from, and the rebuild baseline's context.
#[derive(Default)]
struct Timelines(BTreeMap<String, VecDeque<(Option<String>, ContextLine)>>);

impl Timelines {
    /// As the ear: each line goes into her room's timeline, then its delivery carries the
    /// lines before it (render leaves out those the session has seen).
    fn receive(&mut self, ds: &mut [Delivery], limits: &Limits) {
        for d in ds.iter_mut() {
            self.push(d);
            d.context = self.before(&d.room_id, &d.event_id, limits);
        }
    }

    fn push(&mut self, d: &Delivery) {
        self.line(
            &d.room_id,
            ContextLine {
                event_id: d.event_id.clone(),
                sender: d.sender.clone(),
                sender_name: None,
                ts: d.ts,
                text: d.text.clone(),
            },
        );
    }
    /// Her own reply lines: the gateway's timelines hold what she said too (her `/sync`
    /// echoes), so a fresh start and the rebuild baseline's context carry them. Their event
    /// ids, which the live session marks seen as the gateway does with its send receipts.
    fn push_reply(&mut self, reply: &Value, seq: &mut u64) -> Vec<String> {
        let mut ids = Vec::new();
        for say in reply["say"].as_array().into_iter().flatten() {
            *seq += 1;
            let id = format!("$e{seq}");
            ids.push(id.clone());
            self.line(
                say["room"].as_str().unwrap_or_default(),
                ContextLine {
                    event_id: id,
                    sender: "@mira:localhost".into(),
                    sender_name: None,
                    ts: *seq as i64,
                    text: say["text"].as_str().unwrap_or_default().into(),
                },
            );
        }
        ids
    }
    fn line(&mut self, room: &str, line: ContextLine) {
        let t = self.0.entry(room.to_owned()).or_default();
        if t.len() >= gateway::inbox::TIMELINE_CAP {
            t.pop_front();
        }
        t.push_back((None, line));
    }
    /// Each room's lines, as the gateway reads them from its inbox.
    fn rooms(&self) -> Vec<(&str, Vec<ContextLine>)> {
        self.0
            .iter()
            .map(|(room, lines)| {
                (
                    room.as_str(),
                    lines.iter().map(|(_, l)| l.clone()).collect(),
                )
            })
            .collect()
    }
    /// What a fresh start sends besides the batch, as the gateway's: her state and the last
    /// `context_lines` of each room, at most half of `context_bytes` of lines, rooms in the
    /// inbox's order.
    fn rehydration(&self, state: &str, limits: &Limits, seen: &mut Seen) -> String {
        let rooms = self.rooms();
        session::render::rehydration(
            &[session::render::Note::new("state", state)],
            &rooms,
            limits.context_lines,
            limits.context_bytes / 2,
            seen,
        )
    }
    /// The size of what a fresh start would write, as the gateway reckons it: the
    /// rehydration's bytes and those of the lines the live session holds (`held`) that it
    /// leaves out.
    fn fresh_start_bytes(&self, state: &str, limits: &Limits, held: &Seen) -> (usize, usize) {
        session::render::fresh_start_bytes(
            &[session::render::Note::new("state", state)],
            &self.rooms(),
            limits.context_lines,
            limits.context_bytes,
            held,
        )
    }
    /// A live delivery's context, as the ear gives it: the room's lines before `event_id`, at
    /// most `context_lines` and `context_bytes` (render leaves out those the session has seen).
    fn before(&self, room: &str, event_id: &str, limits: &Limits) -> Vec<ContextLine> {
        self.0
            .get(room)
            .map(|t| {
                gateway::event::context_for(
                    t.iter(),
                    event_id,
                    None,
                    limits.context_lines,
                    limits.context_bytes,
                )
            })
            .unwrap_or_default()
    }
    /// The old design's context: the room's last 20 lines.
    fn context(&self, room: &str) -> Vec<ContextLine> {
        let mut c: Vec<ContextLine> = self
            .0
            .get(room)
            .map(|t| {
                t.iter()
                    .skip(t.len().saturating_sub(20))
                    .map(|(_, l)| l.clone())
                    .collect()
            })
            .unwrap_or_default();
        // The old design always sent 20 lines; pad a young room with older filler lines.
        while c.len() < 20 {
            c.insert(
                0,
                ContextLine {
                    event_id: format!("$old{}", c.len()),
                    sender: "@old:localhost".into(),
                    sender_name: None,
                    ts: 0,
                    text: "an older line from before the replay started, about as long as chat"
                        .into(),
                },
            );
        }
        c
    }
}

/// Keep-warm as the live replay runs it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum KeepWarm {
    Off,
    Plain,
    Predictive,
}

async fn live(run: &Run<'_>, keep: KeepWarm) -> Report {
    let mock = run.mock().await;
    let ttl = run.ttl;
    let dir = run.dir(&format!("live-{keep:?}"));
    let system = dir.join("doctrine.md");
    std::fs::write(&system, run.doctrine()).expect("doctrine");
    let state = run.state();
    let base_cfg = cfg(&mock, &dir, &system, ttl);
    let mut pc = PolicyConfig {
        keep_warm: keep != KeepWarm::Off,
        predictive: keep == KeepWarm::Predictive,
        ..PolicyConfig::for_ttl(ttl)
    };
    // LEAD_SECS=N: refresh at most N seconds before expiry instead of the default ceiling.
    if let Some(lead) = env_parsed("LEAD_SECS") {
        pc.keep_warm_lead = Duration::from_secs(lead);
    }
    // COLD_FACTOR=F: after an expired cache, start fresh once the conversation is F times the
    // rehydration (the default, 1.0, is cost alone; more pays for continuity).
    if let Some(f) = env_parsed("COLD_FACTOR") {
        pc.cold_prefix_factor = f;
    }
    let prices = Prices::default();
    let origin = Instant::now();
    let mut offset = Duration::ZERO; // the mock's clock = real time + offset
    let mut cli: Option<Cli> = None;
    let mut sid: Option<String> = None;
    let mut seen = Seen::default();
    let mut timelines = Timelines::default();
    let limits = run.limits();
    let base_tokens = (run.doctrine().len() / 4 + state.len() / 4) as u64;
    let mut t = Telemetry::default();
    for &gap in run.yesterday {
        t.gaps.observe(gap);
    }
    let mut r = Report::default();
    let mut seq = 0u64;
    let mut last_touch_off = Duration::ZERO;
    let mut last_turn_off = Duration::ZERO;
    for (i, batch) in run.batches().enumerate() {
        // Idle until the batch arrives: keep-warm and eviction as the policy says.
        let arrive = offset + tests::workload::gap(batch);
        t.batch_waiting = false;
        t.process = if cli.is_some() {
            Process::Running
        } else {
            Process::Stopped
        };
        let mut refreshes = 0;
        let mut fired = None;
        while let Some(at) = next_check(&t, &pc, fired) {
            let at_off = at.saturating_duration_since(origin);
            if at_off >= arrive || sid.is_none() {
                break;
            }
            if at_off > offset {
                mock.advance(at_off - offset);
                offset = at_off;
            }
            fired = Some(at);
            match decide(&t, origin + offset, &pc) {
                Decision::KeepWarm => {
                    let before = mock.ledger().len();
                    let started = Instant::now();
                    if let Some(id) = &sid {
                        let _ = refresh_fork(&base_cfg, id).await;
                    }
                    let took = started.elapsed();
                    let ledger = mock.ledger();
                    let spent: f64 = ledger[before..].iter().map(|e| e.cost).sum();
                    let usage = ledger[before..].last().map(|e| e.usage).unwrap_or_default();
                    if t.after_keep_warm(&usage, spent, origin + offset, took, &pc) {
                        *r.restarts.entry("missed refreshes".into()).or_insert(0) += 1;
                    }
                    last_touch_off = offset;
                    r.keep_warm += 1;
                    r.keep_warm_cost += spent;
                    refreshes += 1;
                }
                Decision::Evict => {
                    if let Some(c) = cli.take() {
                        c.shutdown(Duration::from_secs(5)).await;
                    }
                    t.process = Process::Stopped;
                    r.evictions += 1;
                }
                // A declined refresh: the gateway looks again at the next check (eviction).
                _ => {}
            }
        }
        if arrive > offset {
            mock.advance(arrive - offset);
            offset = arrive;
        }
        let mut ds = deliveries(batch, &mut seq);
        timelines.receive(&mut ds, &limits);
        let ready = Instant::now();
        t.batch_arrived(origin + offset);
        t.batch_waiting = true;
        let (rehydrated, resent) = timelines.fresh_start_bytes(state, &limits, &seen);
        t.rehydration_tokens = (rehydrated / 4) as u64 + base_tokens;
        t.resend_tokens = (resent / 4) as u64;
        t.base_tokens = base_tokens;
        let decision = if sid.is_none() {
            Decision::Continue
        } else {
            decide(&t, origin + offset, &pc)
        };
        let mut reset = if sid.is_none() {
            Reset::Fresh
        } else {
            Reset::None
        };
        match decision {
            Decision::FreshStart(why) => {
                *r.restarts.entry(format!("fresh {why:?}")).or_insert(0) += 1;
                reset = Reset::Fresh;
            }
            Decision::Compact(why) => {
                *r.restarts.entry(format!("compact {why:?}")).or_insert(0) += 1;
                reset = Reset::Compact;
            }
            _ => {}
        }
        if reset == Reset::Compact {
            if cli.is_none() {
                let mut c = base_cfg.clone();
                c.session_id = sid.clone();
                c.resume = true;
                cli = Some(Cli::spawn(c).await.expect("CLI ready"));
            }
            let before = mock.ledger().len();
            let compacted = match cli.as_mut() {
                Some(c) => c.compact().await.ok().and_then(|turn| turn.compacted),
                None => None,
            };
            let summary: u64 = mock.ledger()[before..].iter().map(|e| e.usage.output).sum();
            match compacted {
                Some(m) => {
                    r.summaries.push(summary);
                    t.after_compact(m.post_tokens, summary, origin + offset);
                }
                None => {
                    eprintln!("batch {}: /compact did not compact; fresh start", i + 1);
                    reset = Reset::Fresh;
                }
            }
        }
        if reset == Reset::Fresh {
            if let Some(c) = cli.take() {
                c.shutdown(Duration::from_secs(5)).await;
            }
            sid = Some(tests::claude_cli::new_session_id());
            seen.clear();
            t.after_fresh_start();
        }
        let mut text = render(&ds, &mut seen, &[]);
        if reset == Reset::Fresh {
            text.push_str(&timelines.rehydration(state, &limits, &mut seen));
        }
        if cli.is_none() {
            let mut c = base_cfg.clone();
            c.session_id = sid.clone();
            c.resume = reset != Reset::Fresh;
            cli = Some(Cli::spawn(c).await.expect("CLI ready"));
        }
        mock.script(batch["reply"].clone());
        let Some(c) = cli.as_mut() else {
            unreachable!()
        };
        let turn = c.turn(&text).await.expect("turn");
        let _ = session::render::validate(
            turn.result.structured_output.as_ref(),
            &[ds[0].room_id.as_str()],
        );
        r.latency.push(ready.elapsed());
        let last = mock.ledger().last().cloned().expect("a request");
        let u = last.usage;
        let before = match reset {
            Reset::None => t.prefix_tokens,
            Reset::Fresh => t.rehydration_tokens,
            Reset::Compact => base_tokens + r.summaries.last().copied().unwrap_or(0),
        };
        r.steps.push(Step {
            gap: (offset - last_turn_off).as_secs(),
            refreshes,
            idle: (offset - last_touch_off).as_secs(),
            growth: (u.prompt_tokens() + u.output).saturating_sub(before),
            rehydration: t.rehydration_tokens,
            reset,
        });
        last_touch_off = offset;
        last_turn_off = offset;
        // The virtual clock stands still during a turn: its request began when it ended.
        t.after_turn(
            &u,
            turn.result.outcome(),
            origin + offset,
            origin + offset,
            &prices,
        );
        // Her reply: into the timelines, and seen (the gateway marks what it sent).
        for id in timelines.push_reply(&batch["reply"], &mut seq) {
            seen.insert(&id);
        }
        if t.last_outcome != Outcome::Ok {
            eprintln!("batch {}: outcome {:?}", i + 1, t.last_outcome);
        }
    }
    if let Some(c) = cli.take() {
        c.shutdown(Duration::from_secs(5)).await;
    }
    let label = match keep {
        KeepWarm::Off => "live, no keep-warm",
        KeepWarm::Plain => "live, keep-warm unpredicted",
        KeepWarm::Predictive => "live",
    };
    if std::env::var_os("LEDGER").is_some() {
        // Every request as billed, to see where a run's money went.
        for e in mock.ledger() {
            println!(
                "    #{:<4} t={:>8.0}s prompt {:>7} read {:>7} write {:>7} out {:>5} ${:.4} {:?}",
                e.n,
                e.at,
                e.prompt_tokens,
                e.usage.cache_read,
                e.usage.cache_write_5m + e.usage.cache_write_1h,
                e.usage.output,
                e.cost,
                e.last_user_text.chars().take(40).collect::<String>()
            );
            if std::env::var_os("LEDGER_BLOCKS").is_some() {
                println!(
                    "          blocks {} first {:x?} system {:?}",
                    e.block_hashes.len(),
                    &e.block_hashes[..e.block_hashes.len().min(4)],
                    e.system_text.chars().take(160).collect::<String>()
                );
            }
        }
    }
    let turns = r.steps.len();
    Report {
        base: base_tokens,
        ..r
    }
    .billed(format!("{label}, TTL {}", ttl_name(ttl)), &mock, turns)
}

fn ttl_name(ttl: Ttl) -> &'static str {
    match ttl {
        Ttl::OneHour => "1h",
        Ttl::FiveMinutes => "5m",
    }
}

/// A setting from the environment, when it is set and parses.
fn env_parsed<T: std::str::FromStr>(name: &str) -> Option<T> {
    std::env::var(name).ok().and_then(|v| v.parse().ok())
}

/// How a schedule bridges a gap longer than the TTL.
#[derive(Clone, Copy, Debug)]
enum Bridge {
    /// Knowing the gap: refreshes through it or a rewrite, whichever is cheaper.
    Hindsight,
    /// Not knowing it: a refresh at each of the first `n` expiries, then let it expire.
    Threshold(u64),
}

/// The cost model shared by our schedule and the optimum.
struct Model {
    ttl: u64,
    p: Prices,
    w: f64,
    /// Base (system prompt and state) and the summary a compaction writes.
    base: u64,
    summary: u64,
}

impl Model {
    fn new(ttl: Ttl, base: u64, summary: u64) -> Self {
        let p = Prices::default();
        Self {
            ttl: ttl.duration().as_secs(),
            w: p.write(ttl),
            p,
            base,
            summary,
        }
    }

    fn refresh(&self, prefix: u64) -> f64 {
        Prices::dollars(prefix, self.p.cache_read)
            + Prices::dollars(session::policy::REFRESH_WRITE_TOKENS, self.w)
            + Prices::dollars(8, self.p.output)
    }

    /// Bringing a `prefix` back after `gap` seconds: a read if warm, else the cheaper of a
    /// rewrite or enough refreshes to keep it warm (the optimum's choice; ours is given).
    fn reach(&self, prefix: u64, gap: u64) -> f64 {
        self.bridge(prefix, gap, Bridge::Hindsight)
    }

    /// What the refreshes made during `gap` cost when the prefix is then dropped (a fresh
    /// start): none in hindsight, the threshold's (or fewer, if the gap ended first) otherwise.
    fn refreshed(&self, prefix: u64, gap: u64, how: Bridge) -> f64 {
        match how {
            Bridge::Hindsight => 0.0,
            Bridge::Threshold(n) => (gap / self.ttl).min(n) as f64 * self.refresh(prefix),
        }
    }

    /// Bringing a `prefix` back after `gap` seconds, bridged `how`.
    fn bridge(&self, prefix: u64, gap: u64, how: Bridge) -> f64 {
        let read = Prices::dollars(prefix, self.p.cache_read);
        if gap < self.ttl {
            return read;
        }
        let expiries = gap / self.ttl;
        let kept = expiries as f64 * self.refresh(prefix) + read;
        let rewrite = Prices::dollars(prefix, self.w);
        match how {
            Bridge::Hindsight => kept.min(rewrite),
            Bridge::Threshold(n) if expiries <= n => kept,
            Bridge::Threshold(n) => n as f64 * self.refresh(prefix) + rewrite,
        }
    }

    /// A compaction of `prefix` reached with `reach` dollars: the summary as output, then base
    /// and summary written.
    fn compaction(&self, reach: f64) -> f64 {
        reach
            + Prices::dollars(self.summary, self.p.output)
            + Prices::dollars(self.base + self.summary, self.w)
    }

    /// Cost of the schedule the replay followed.
    fn ours(&self, steps: &[Step]) -> f64 {
        let mut prefix = 0u64;
        let mut cost = 0.0;
        for s in steps {
            cost += s.refreshes as f64 * self.refresh(prefix);
            let reach = if s.idle < self.ttl {
                Prices::dollars(prefix, self.p.cache_read)
            } else {
                Prices::dollars(prefix, self.w)
            };
            match s.reset {
                Reset::Fresh => {
                    cost += Prices::dollars(s.rehydration, self.w);
                    prefix = s.rehydration;
                }
                Reset::Compact => {
                    cost += self.compaction(reach);
                    prefix = self.base + self.summary;
                }
                Reset::None => cost += reach,
            }
            cost += Prices::dollars(s.growth, self.w);
            prefix += s.growth;
        }
        cost
    }

    /// Where our schedule loses to the optimum's way of bridging each gap (`SCHEDULE=1`): per
    /// turn, what bringing the prefix back cost us (our refreshes, then a read, a rewrite, a
    /// fresh start's rehydration or a compaction) against the cheapest way to bring the same
    /// prefix back (a read, refreshes through the gap, or a rewrite).
    fn explain(&self, steps: &[Step]) {
        let mut prefix = 0u64;
        let mut lost_by = [0.0f64; 5];
        const WHY: [&str; 5] = [
            "kept warm, more refreshes than the gap needed",
            "refreshed, then let it expire",
            "let it expire where refreshing was cheaper",
            "started fresh",
            "compacted",
        ];
        for (i, s) in steps.iter().enumerate() {
            let refreshed = s.refreshes as f64 * self.refresh(prefix);
            let reach = if s.idle < self.ttl {
                Prices::dollars(prefix, self.p.cache_read)
            } else {
                Prices::dollars(prefix, self.w)
            };
            let ours = refreshed
                + match s.reset {
                    Reset::None => reach,
                    Reset::Fresh => Prices::dollars(s.rehydration, self.w),
                    Reset::Compact => self.compaction(reach),
                };
            let best = self.reach(prefix, s.gap);
            let lost = ours - best;
            let why = match s.reset {
                _ if i == 0 => None,
                Reset::Fresh => Some(3),
                Reset::Compact => Some(4),
                Reset::None if lost < 1e-6 => None,
                Reset::None if s.idle < self.ttl => Some(0),
                Reset::None if s.refreshes > 0 => Some(1),
                Reset::None => Some(2),
            };
            if let Some(k) = why {
                lost_by[k] += lost;
                let what = WHY[k];
                println!(
                    "    turn {:>3} gap {:>6}s idle {:>6}s refreshes {:>3} prefix {:>7}: ours ${:.4} best bridge ${:.4}: {what}",
                    i + 1,
                    s.gap,
                    s.idle,
                    s.refreshes,
                    prefix,
                    ours,
                    best
                );
            }
            prefix = match s.reset {
                Reset::Fresh => s.rehydration,
                Reset::Compact => self.base + self.summary,
                Reset::None => prefix,
            } + s.growth;
        }
        let parts: Vec<String> = WHY
            .iter()
            .zip(lost_by)
            .map(|(why, lost)| format!("{why} ${lost:.4}"))
            .collect();
        println!(
            "    against the best bridge of each gap (a reset's later savings not counted): {}",
            parts.join("; ")
        );
    }

    /// The cheapest schedule in hindsight: before each turn, go on (reading, rewriting or
    /// having kept the prefix warm), start fresh, or compact. Dynamic programming over the last
    /// reset and its kind; the first turn always starts fresh.
    fn optimum(&self, steps: &[Step]) -> f64 {
        self.optimum_with(steps, Bridge::Hindsight)
    }

    /// The best one keep-warm threshold could do on these gaps: the number of expiries to
    /// refresh through (then let the cache expire) chosen in hindsight for the whole run, each
    /// gap not known in advance, resets still chosen in hindsight. For gaps drawn from one
    /// distribution, a threshold is the best any rule that knows the distribution but not
    /// each gap can do, so its distance to [`Model::optimum`] is the price of not knowing the
    /// gaps, which no online keep-warm rule avoids. Returns the threshold and its cost.
    fn best_threshold(&self, steps: &[Step]) -> (u64, f64) {
        let longest = steps.iter().map(|s| s.gap / self.ttl).max().unwrap_or(0);
        (0..=longest)
            .map(|n| (n, self.optimum_with(steps, Bridge::Threshold(n))))
            .fold((0, f64::INFINITY), |a, b| if b.1 < a.1 { b } else { a })
    }

    /// [`Model::optimum`] with every gap bridged `how`.
    fn optimum_with(&self, steps: &[Step], how: Bridge) -> f64 {
        let n = steps.len();
        if n == 0 {
            return 0.0;
        }
        // best[k][kind]: cheapest cost of turns 0..k with a reset of `kind` (0 fresh,
        // 1 compact) right before turn k, excluding turn k's own reset cost and after.
        let mut best = vec![[f64::INFINITY; 2]; n + 1];
        best[0][0] = 0.0;
        let mut answer = f64::INFINITY;
        for j in 0..n {
            for kind in 0..2 {
                let start = best[j][kind];
                if !start.is_finite() {
                    continue;
                }
                // The reset itself.
                let (mut cost, mut prefix) = if kind == 0 {
                    (
                        start + Prices::dollars(steps[j].rehydration, self.w),
                        steps[j].rehydration,
                    )
                } else {
                    (start, self.base + self.summary)
                };
                cost += Prices::dollars(steps[j].growth, self.w);
                prefix += steps[j].growth;
                // Serve turns j+1.. without a reset, branching off a reset before each.
                for k in j + 1..=n {
                    if k == n {
                        answer = answer.min(cost);
                        break;
                    }
                    let reach = self.bridge(prefix, steps[k].gap, how);
                    // A fresh start drops the prefix; the refreshes a rule not knowing
                    // the gap made before it are paid all the same.
                    let refreshed = self.refreshed(prefix, steps[k].gap, how);
                    best[k][0] = best[k][0].min(cost + refreshed);
                    best[k][1] = best[k][1].min(cost + self.compaction(reach));
                    cost += reach + Prices::dollars(steps[k].growth, self.w);
                    prefix += steps[k].growth;
                }
            }
        }
        answer
    }
}

async fn rebuild(run: &Run<'_>) -> Report {
    let mock = run.mock().await;
    let dir = run.dir("rebuild");
    let system = dir.join("system.md");
    // The old design: doctrine and state in every prompt.
    std::fs::write(
        &system,
        format!("{}\n\n## your state\n{}", run.doctrine(), run.state()),
    )
    .expect("system");
    let base = cfg(&mock, &dir, &system, run.ttl);
    let mut timelines = Timelines::default();
    let mut seq = 0u64;
    let mut latency = Vec::new();
    for batch in run.batches() {
        mock.advance(tests::workload::gap(batch));
        let ready = Instant::now();
        let mut ds = deliveries(batch, &mut seq);
        for d in ds.iter_mut() {
            d.context = timelines.context(&d.room_id);
        }
        // A new process knows nothing: every context line is sent again.
        let text = render(&ds, &mut Seen::default(), &[]);
        let mut c = base.clone();
        c.session_id = Some(tests::claude_cli::new_session_id());
        let mut cli = Cli::spawn(c).await.expect("CLI ready");
        mock.script(batch["reply"].clone());
        let _ = cli.turn(&text).await.expect("turn");
        latency.push(ready.elapsed());
        cli.shutdown(Duration::from_secs(5)).await;
        for d in &ds {
            timelines.push(d);
        }
        timelines.push_reply(&batch["reply"], &mut seq);
    }
    let turns = latency.len();
    Report {
        latency,
        ..Report::default()
    }
    .billed(format!("rebuild, TTL {}", ttl_name(run.ttl)), &mock, turns)
}

/// A new process per batch resuming one session, with the CLI's defaults (its own
/// auto-compaction), fed the batches live is fed (the ear's context, her replies seen): the
/// gateway with a process per turn instead of its policy. The first batch carries her state and
/// the rooms' lines like a fresh start.
async fn resume(run: &Run<'_>) -> Report {
    let mock = run.mock().await;
    let dir = run.dir("resume");
    let system = dir.join("doctrine.md");
    std::fs::write(&system, run.doctrine()).expect("doctrine");
    let base = cfg(&mock, &dir, &system, run.ttl);
    let sid = tests::claude_cli::new_session_id();
    let limits = run.limits();
    let mut timelines = Timelines::default();
    let mut seen = Seen::default();
    let mut seq = 0u64;
    let mut latency = Vec::new();
    let mut failures = 0;
    for (i, batch) in run.batches().enumerate() {
        mock.advance(tests::workload::gap(batch));
        let ready = Instant::now();
        // The gateway's batch, as live gets it: each delivery with the ear's context, leaving
        // out what the session has seen (her replies included); only the process differs.
        let mut ds = deliveries(batch, &mut seq);
        timelines.receive(&mut ds, &limits);
        let mut text = render(&ds, &mut seen, &[]);
        if i == 0 {
            text.push_str(&timelines.rehydration(run.state(), &limits, &mut seen));
        }
        mock.script(batch["reply"].clone());
        match one_shot(&base, &sid, i > 0, &text, Compaction::Cli).await {
            Ok(r) if !r.is_error => {}
            Ok(r) => {
                failures += 1;
                eprintln!("resume batch {}: {:?}", i + 1, r.errors);
            }
            Err(e) => {
                failures += 1;
                eprintln!("resume batch {}: {e}", i + 1);
            }
        }
        latency.push(ready.elapsed());
        for id in timelines.push_reply(&batch["reply"], &mut seq) {
            seen.insert(&id);
        }
    }
    let turns = latency.len();
    let mut r = Report {
        latency,
        ..Report::default()
    }
    .billed(
        format!("resume per turn, TTL {}", ttl_name(run.ttl)),
        &mock,
        turns,
    );
    if failures > 0 {
        r.restarts.insert("failed turns".into(), failures);
    }
    // Compactions the CLI made by itself: its summary requests.
    let compactions = mock.ledger().iter().filter(|e| e.is_summary()).count();
    if compactions > 0 {
        r.restarts.insert("CLI compactions".into(), compactions);
    }
    r
}

fn print(r: &Report, baseline: &Report) {
    println!(
        "  {:36} ${:.5}/turn ({:.2}x rebuild); cache hit {:.1}%; latency p50 {:.0} ms; resets {:?}; keep-warm {} (${:.4}); evictions {}",
        r.label,
        r.per_turn(),
        r.cost / baseline.cost,
        100.0 * r.hit(),
        r.p50().as_secs_f64() * 1e3,
        r.restarts,
        r.keep_warm,
        r.keep_warm_cost,
        r.evictions
    );
}

/// One row of the summary: a workload at a TTL.
struct Row {
    workload: &'static str,
    ttl: Ttl,
    rebuild: Report,
    resume: Report,
    live: Report,
    /// With 5 minutes: live without keep-warm and with it unpredicted.
    off: Option<Report>,
    plain: Option<Report>,
}

/// The cost model for a live run: its base, and the mean of its measured summaries.
fn model_for(r: &Report, ttl: Ttl) -> Model {
    let summary = if r.summaries.is_empty() {
        PolicyConfig::default().compact_summary_tokens
    } else {
        r.summaries.iter().sum::<u64>() / r.summaries.len() as u64
    };
    Model::new(ttl, r.base, summary)
}

fn optimum_ratio(r: &Report, ttl: Ttl) -> f64 {
    let m = model_for(r, ttl);
    m.ours(&r.steps) / m.optimum(&r.steps)
}

/// The best keep-warm threshold in hindsight (expiries refreshed through) and its cost over
/// the optimum's.
fn threshold_ratio(r: &Report, ttl: Ttl) -> (u64, f64) {
    let m = model_for(r, ttl);
    let (n, cost) = m.best_threshold(&r.steps);
    let optimum = m.optimum(&r.steps);
    // Each gap's threshold bridge is one of the optimum's choices for it.
    assert!(
        cost >= optimum - 1e-9,
        "threshold {cost} below optimum {optimum}"
    );
    (n, cost / optimum)
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let shapes: Vec<Shape> = match std::env::var("WORKLOADS") {
        Ok(v) => v
            .split(',')
            .map(|n| Shape::from_name(n.trim()).expect("a workload name"))
            .collect(),
        Err(_) => Shape::ALL.to_vec(),
    };
    let ttls: Vec<Ttl> = match std::env::var("TTLS").as_deref() {
        Ok("1h") => vec![Ttl::OneHour],
        Ok("5m") => vec![Ttl::FiveMinutes],
        _ => vec![Ttl::OneHour, Ttl::FiveMinutes],
    };
    let only = env_parsed("BATCHES");
    // SEASONED=1: live knows her gaps of another day of the same shape before the first batch.
    let seasoned = std::env::var_os("SEASONED").is_some();
    let days: u64 = env_parsed("DAYS").unwrap_or(1).max(1);
    let latency = Duration::from_millis(env_parsed("LATENCY_MS").unwrap_or(200));
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let scratch_dir = tests::ScratchDir::new("bench-session");
    let scratch = scratch_dir.path();
    let mut rows = Vec::new();
    rt.block_on(async {
        for shape in shapes {
            let mut w = tests::workload::load(shape).expect("committed workload");
            // DAYS=N: the committed day, then N-1 more of the same shape (drawn from other
            // seeds than SEASONED's day before), one life: how a rule that pays back over time
            // (ski rental) fares past one day's end.
            for day in 1..days {
                let more = shape.another_day(day + 1)["batches"].take();
                if let (Some(all), Value::Array(more)) = (w["batches"].as_array_mut(), more) {
                    all.extend(more);
                }
            }
            let total = w["batches"].as_array().map_or(0, Vec::len);
            let n = only.unwrap_or(usize::MAX).min(total);
            // The day before's gaps between batches (its first gap follows the day before it).
            let yesterday: Vec<Duration> = if seasoned {
                let day = shape.another_day(1);
                day["batches"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .skip(1)
                    .map(tests::workload::gap)
                    .collect()
            } else {
                Vec::new()
            };
            println!(
                "{} ({n} batches{})",
                shape.name(),
                if seasoned {
                    ", her gaps of the day before known"
                } else {
                    ""
                }
            );
            for &ttl in &ttls {
                let run = Run {
                    w: &w,
                    batches: n,
                    ttl,
                    latency,
                    scratch: scratch.join(shape.name()),
                    yesterday: &yesterday,
                };
                let rebuild = rebuild(&run).await;
                print(&rebuild, &rebuild);
                let resume = resume(&run).await;
                print(&resume, &rebuild);
                let live_r = live(&run, KeepWarm::Predictive).await;
                print(&live_r, &rebuild);
                let (n, by_threshold) = threshold_ratio(&live_r, ttl);
                println!(
                    "  {:36} schedule vs hindsight optimum (keep-warm included): {:.3}x; best one threshold in hindsight ({n} refreshes): {by_threshold:.3}x; summaries {:?}",
                    "",
                    optimum_ratio(&live_r, ttl),
                    live_r.summaries
                );
                if std::env::var_os("SCHEDULE").is_some() {
                    model_for(&live_r, ttl).explain(&live_r.steps);
                }
                let (mut off, mut plain) = (None, None);
                if ttl == Ttl::FiveMinutes {
                    let o = live(&run, KeepWarm::Off).await;
                    print(&o, &rebuild);
                    let p = live(&run, KeepWarm::Plain).await;
                    print(&p, &rebuild);
                    off = Some(o);
                    plain = Some(p);
                }
                rows.push(Row {
                    workload: shape.name(),
                    ttl,
                    rebuild,
                    resume,
                    live: live_r,
                    off,
                    plain,
                });
            }
        }
    });
    println!();
    println!("| workload | TTL | rebuild $/turn | resume $/turn | live $/turn | live / rebuild | live / resume | live / optimum | live hit | latency p50 live / resume / rebuild | live resets |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    for r in &rows {
        println!(
            "| {} | {} | {:.5} | {:.5} | {:.5} | {:.2}x | {:.2}x | {:.3}x | {:.1}% | {:.0} / {:.0} / {:.0} ms | {} |",
            r.workload,
            ttl_name(r.ttl),
            r.rebuild.per_turn(),
            r.resume.per_turn(),
            r.live.per_turn(),
            r.live.cost / r.rebuild.cost,
            r.live.cost / r.resume.cost,
            optimum_ratio(&r.live, r.ttl),
            100.0 * r.live.hit(),
            r.live.p50().as_secs_f64() * 1e3,
            r.resume.p50().as_secs_f64() * 1e3,
            r.rebuild.p50().as_secs_f64() * 1e3,
            r.live
                .restarts
                .iter()
                .map(|(k, v)| format!("{k} {v}"))
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    println!();
    println!("| workload (5 min) | no keep-warm $ | keep-warm unpredicted $ (refreshes) | predictive $ (refreshes) |");
    println!("|---|---|---|---|");
    for r in rows.iter().filter(|r| r.ttl == Ttl::FiveMinutes) {
        if let (Some(off), Some(plain)) = (&r.off, &r.plain) {
            println!(
                "| {} | {:.4} | {:.4} ({}) | {:.4} ({}) |",
                r.workload, off.cost, plain.cost, plain.keep_warm, r.live.cost, r.live.keep_warm
            );
        }
    }
    println!();
    // What any schedule could reach against the rivals: the optimum's cost (by the model's
    // ratio, applied to live's billed cost) and the best one threshold's (what an online rule
    // that knew her gap distribution could expect) over rebuild's and resume's billed costs.
    println!("| workload | TTL | live / optimum | best one threshold / optimum | its threshold (refreshes in a silence) | optimum / rebuild | best threshold / rebuild | optimum / resume |");
    println!("|---|---|---|---|---|---|---|---|");
    for r in &rows {
        let (n, by_threshold) = threshold_ratio(&r.live, r.ttl);
        let ratio = optimum_ratio(&r.live, r.ttl);
        let optimum = r.live.cost / ratio;
        println!(
            "| {} | {} | {ratio:.3}x | {by_threshold:.3}x | {n} | {:.2}x | {:.2}x | {:.2}x |",
            r.workload,
            ttl_name(r.ttl),
            optimum / r.rebuild.cost,
            optimum * by_threshold / r.rebuild.cost,
            optimum / r.resume.cost,
        );
    }
    let summaries: Vec<u64> = rows.iter().flat_map(|r| r.live.summaries.clone()).collect();
    println!();
    println!(
        "compaction summaries measured (tokens): {summaries:?}; the policy's guess before any: {}",
        PolicyConfig::default().compact_summary_tokens
    );
}
