//! The session benchmark: the committed reference workload (`fixtures/workload/reference.json`)
//! replayed through the real claude CLI against the mock Messages API on a virtual clock, as a
//! live session (every restart, eviction and keep-warm decided by `session::policy::decide`)
//! and as the rebuild baseline (a new process per batch with the doctrine and state as system
//! prompt and 20 context lines per delivery), once with a 1-hour and once with a 5-minute TTL.
//!
//! `cargo bench -p tests --bench session` (about 5 minutes). `BATCHES=N` replays only the
//! first N batches.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::Value;
use session::cost::{Prices, Ttl};
use session::driver::{refresh_fork, Cli, CliConfig};
use session::policy::{decide, next_check, Decision, Outcome, PolicyConfig, Process, Telemetry};
use session::render::{render, reply_schema, Seen};
use tests::mock_api::{MockApi, MockConfig};
use wire::docs::{ContextLine, Delivery};

/// What the offline optimum needs about one turn of a live replay.
#[derive(Clone, Copy)]
struct Step {
    /// Seconds since the previous turn (or refresh) touched the cache.
    idle: u64,
    /// Tokens this turn added to the conversation (batch, reply).
    growth: u64,
    /// What a fresh start would have sent at this turn.
    rehydration: u64,
    /// Whether the replay restarted here.
    restarted: bool,
}

struct Report {
    label: String,
    steps: Vec<Step>,
    turns: usize,
    cost: f64,
    prompt_tokens: u64,
    cache_read: u64,
    restarts: BTreeMap<String, usize>,
    keep_warm: usize,
    evictions: usize,
    overhead: Vec<Duration>,
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
        turn_timeout: Duration::from_secs(120),
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

/// Per-room recent lines (bounded): what a fresh start rehydrates from, and the rebuild
/// baseline's context.
#[derive(Default)]
struct Timelines(HashMap<String, VecDeque<ContextLine>>);

impl Timelines {
    fn push(&mut self, d: &Delivery) {
        let t = self.0.entry(d.room_id.clone()).or_default();
        if t.len() >= 20 {
            t.pop_front();
        }
        t.push_back(ContextLine {
            event_id: d.event_id.clone(),
            sender: d.sender.clone(),
            sender_name: None,
            ts: d.ts,
            text: d.text.clone(),
        });
    }
    fn rehydration(&self, state: &str) -> String {
        let rooms: Vec<(&str, Vec<ContextLine>)> = self
            .0
            .iter()
            .map(|(room, lines)| (room.as_str(), lines.iter().cloned().collect()))
            .collect();
        session::render::rehydration(
            &[session::render::Note::new("state", state)],
            &rooms,
            10,
            usize::MAX,
        )
    }
    fn context(&self, room: &str) -> Vec<ContextLine> {
        let mut c: Vec<ContextLine> = self
            .0
            .get(room)
            .map(|t| t.iter().cloned().collect())
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

/// The ledger's totals; the caller fills in what only it knows.
fn summarize(label: String, mock: &MockApi, turns: usize) -> Report {
    let ledger = mock.ledger();
    Report {
        label,
        steps: Vec::new(),
        turns,
        cost: ledger.iter().map(|e| e.cost).sum(),
        prompt_tokens: ledger.iter().map(|e| e.usage.prompt_tokens()).sum(),
        cache_read: ledger.iter().map(|e| e.usage.cache_read).sum(),
        restarts: BTreeMap::new(),
        keep_warm: 0,
        evictions: 0,
        overhead: Vec::new(),
    }
}

async fn live(w: &Value, batches: usize, ttl: Ttl, keep_warm: bool) -> Report {
    let mock = MockApi::start(MockConfig::default()).await.expect("mock");
    let dir = std::env::temp_dir().join(format!(
        "cultnet-bench-live-{}-{:?}-{keep_warm}",
        std::process::id(),
        ttl
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("scratch dir");
    let system = dir.join("doctrine.md");
    std::fs::write(&system, w["doctrine"].as_str().unwrap_or_default()).expect("doctrine");
    let state = w["state"].as_str().unwrap_or_default();
    let base_cfg = cfg(&mock, &dir, &system, ttl);
    let pc = PolicyConfig {
        ttl,
        keep_warm,
        ..PolicyConfig::default()
    };
    let prices = Prices::default();
    let origin = Instant::now();
    let mut offset = Duration::ZERO; // the mock's clock = real time + offset
    let mut cli: Option<Cli> = None;
    let mut sid: Option<String> = None;
    let mut seen = Seen::default();
    let mut timelines = Timelines::default();
    let mut t = Telemetry {
        rehydration_tokens: 0,
        ..Telemetry::default()
    };
    let (mut restarts, mut kw, mut ev, mut overhead) = (BTreeMap::new(), 0, 0, Vec::new());
    let mut seq = 0u64;
    let mut steps = Vec::new();
    let mut last_touch_off = Duration::ZERO;
    for (i, batch) in w["batches"]
        .as_array()
        .into_iter()
        .flatten()
        .take(batches)
        .enumerate()
    {
        // Idle until the batch arrives: keep-warm and eviction as the policy says.
        let arrive = offset + Duration::from_secs(batch["gap_secs"].as_u64().unwrap_or(0));
        t.batch_waiting = false;
        t.process = if cli.is_some() {
            Process::Running
        } else {
            Process::Stopped
        };
        while let Some(at) = next_check(&t, &pc) {
            let at_off = at.saturating_duration_since(origin);
            if at_off >= arrive || sid.is_none() {
                break;
            }
            if at_off > offset {
                mock.advance(at_off - offset);
                offset = at_off;
            }
            match decide(&t, origin + offset, &pc) {
                Decision::KeepWarm => {
                    let before = mock.ledger().len();
                    if let Some(id) = &sid {
                        let _ = refresh_fork(&base_cfg, id).await;
                    }
                    let spent: f64 = mock.ledger()[before..].iter().map(|e| e.cost).sum();
                    t.after_keep_warm(spent, origin + offset);
                    last_touch_off = offset;
                    kw += 1;
                }
                Decision::Evict => {
                    if let Some(c) = cli.take() {
                        c.shutdown(Duration::from_secs(5)).await;
                    }
                    t.process = Process::Stopped;
                    ev += 1;
                }
                _ => break,
            }
        }
        if arrive > offset {
            mock.advance(arrive - offset);
            offset = arrive;
        }
        let ds = deliveries(batch, &mut seq);
        let work = Instant::now();
        t.batch_waiting = true;
        t.rehydration_tokens = (timelines.rehydration(state).len() / 4) as u64 + 24_000;
        t.base_tokens = 24_000 + (state.len() / 4) as u64;
        let decision = if sid.is_none() {
            Decision::Continue
        } else {
            decide(&t, origin + offset, &pc)
        };
        let fresh = match decision {
            Decision::FreshStart(r) | Decision::Compact(r) => {
                *restarts.entry(format!("{r:?}")).or_insert(0) += 1;
                true
            }
            _ => sid.is_none(),
        };
        if fresh {
            if let Some(c) = cli.take() {
                c.shutdown(Duration::from_secs(5)).await;
            }
            sid = Some(tests::claude_cli::new_session_id());
            seen.clear();
            t.after_fresh_start();
        }
        let mut text = render(&ds, &mut seen, &[]);
        if fresh {
            text.push_str(&timelines.rehydration(state));
        }
        let mut spent = work.elapsed();
        if cli.is_none() {
            let mut c = base_cfg.clone();
            c.session_id = sid.clone();
            c.resume = !fresh;
            cli = Some(Cli::spawn(c).await.expect("CLI ready"));
        }
        mock.script(batch["reply"].clone());
        let Some(c) = cli.as_mut() else {
            unreachable!()
        };
        let turn = c.turn(&text).await.expect("turn");
        let work = Instant::now();
        let _ = session::render::validate(
            turn.result.structured_output.as_ref(),
            &[ds[0].room_id.as_str()],
        );
        let last = mock.ledger().last().cloned().expect("a request");
        let u = last.usage;
        let growth =
            (u.prompt_tokens() + u.output).saturating_sub(if fresh { 0 } else { t.prefix_tokens });
        steps.push(Step {
            idle: (offset - last_touch_off).as_secs(),
            growth: if fresh {
                growth.saturating_sub(t.rehydration_tokens)
            } else {
                growth
            },
            rehydration: t.rehydration_tokens,
            restarted: fresh,
        });
        last_touch_off = offset;
        t.after_turn(&u, turn.result.outcome(), origin + offset, &prices);
        for d in &ds {
            timelines.push(d);
        }
        spent += work.elapsed();
        overhead.push(spent);
        if t.last_outcome != Outcome::Ok {
            eprintln!("batch {}: outcome {:?}", i + 1, t.last_outcome);
        }
    }
    if let Some(c) = cli.take() {
        c.shutdown(Duration::from_secs(5)).await;
    }
    let label = format!(
        "live, TTL {ttl:?}{}",
        if keep_warm { ", keep-warm" } else { "" }
    );
    Report {
        steps,
        restarts,
        keep_warm: kw,
        evictions: ev,
        overhead,
        ..summarize(label, &mock, batches)
    }
}

/// Model cost of serving `steps` with restarts exactly where `restart[i]` says (restart before
/// turn i: write the rehydration; otherwise read the prefix if the cache is warm, rewrite it
/// if it expired), plus writing each turn's growth.
fn model_cost(steps: &[Step], restart: &[bool], ttl: Ttl, p: &Prices) -> f64 {
    let w = p.write(ttl);
    let mut prefix = 0u64;
    let mut cost = 0.0;
    for (i, s) in steps.iter().enumerate() {
        if i == 0 || restart[i] {
            cost += Prices::dollars(s.rehydration, w);
            prefix = s.rehydration;
        } else if s.idle >= ttl.duration().as_secs() {
            cost += Prices::dollars(prefix, w);
        } else {
            cost += Prices::dollars(prefix, p.cache_read);
        }
        cost += Prices::dollars(s.growth, w);
        prefix += s.growth;
    }
    cost
}

/// The cheapest restart schedule in hindsight for the same steps (dynamic programming over
/// the last restart point), under the same model.
fn optimal_cost(steps: &[Step], ttl: Ttl, p: &Prices) -> f64 {
    let n = steps.len();
    let w = p.write(ttl);
    let mut best = vec![f64::INFINITY; n + 1];
    best[0] = 0.0;
    for k in 1..=n {
        for j in 0..k {
            let mut cost = best[j] + Prices::dollars(steps[j].rehydration, w);
            let mut prefix = steps[j].rehydration;
            for s in &steps[j..k] {
                if !std::ptr::eq(s, &steps[j]) {
                    cost += if s.idle >= ttl.duration().as_secs() {
                        Prices::dollars(prefix, w)
                    } else {
                        Prices::dollars(prefix, p.cache_read)
                    };
                }
                cost += Prices::dollars(s.growth, w);
                prefix += s.growth;
            }
            best[k] = best[k].min(cost);
        }
    }
    best[n]
}

async fn rebuild(w: &Value, batches: usize, ttl: Ttl) -> Report {
    let mock = MockApi::start(MockConfig::default()).await.expect("mock");
    let dir = std::env::temp_dir().join(format!(
        "cultnet-bench-rebuild-{}-{:?}",
        std::process::id(),
        ttl
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("scratch dir");
    let system = dir.join("system.md");
    // The old design: doctrine and state in every prompt.
    std::fs::write(
        &system,
        format!(
            "{}\n\n## your state\n{}",
            w["doctrine"].as_str().unwrap_or_default(),
            w["state"].as_str().unwrap_or_default()
        ),
    )
    .expect("system");
    let base = cfg(&mock, &dir, &system, ttl);
    let mut timelines = Timelines::default();
    let mut offset = Duration::ZERO;
    let mut seq = 0u64;
    let mut overhead = Vec::new();
    for batch in w["batches"].as_array().into_iter().flatten().take(batches) {
        let gap = Duration::from_secs(batch["gap_secs"].as_u64().unwrap_or(0));
        mock.advance(gap);
        offset += gap;
        let work = Instant::now();
        let mut ds = deliveries(batch, &mut seq);
        for d in ds.iter_mut() {
            d.context = timelines.context(&d.room_id);
        }
        // A new process knows nothing: every context line is sent again.
        let text = render(&ds, &mut Seen::default(), &[]);
        overhead.push(work.elapsed());
        let mut c = base.clone();
        c.session_id = Some(tests::claude_cli::new_session_id());
        let mut cli = Cli::spawn(c).await.expect("CLI ready");
        mock.script(batch["reply"].clone());
        let _ = cli.turn(&text).await.expect("turn");
        cli.shutdown(Duration::from_secs(5)).await;
        for d in &ds {
            timelines.push(d);
        }
    }
    Report {
        overhead,
        ..summarize(format!("rebuild, TTL {ttl:?}"), &mock, batches)
    }
}

fn print(r: &Report, baseline: Option<&Report>) {
    let per_turn = r.cost / r.turns as f64;
    let ratio = baseline
        .map(|b| format!("{:.2}x rebuild", r.cost / b.cost))
        .unwrap_or_else(|| "baseline".into());
    let mut o = r.overhead.clone();
    o.sort();
    let p50 = o.get(o.len() / 2).copied().unwrap_or_default();
    println!(
        "{:32} ${:.5}/turn ({ratio}); cache hit {:.1}% of prompt tokens; restarts {:?}; keep-warm {}; evictions {}; gateway work per turn p50 {:.0} us",
        r.label, per_turn, 100.0 * r.cache_read as f64 / r.prompt_tokens.max(1) as f64, r.restarts, r.keep_warm, r.evictions, p50.as_secs_f64() * 1e6
    );
    if !r.steps.is_empty() {
        let ttl = if r.label.contains("OneHour") {
            Ttl::OneHour
        } else {
            Ttl::FiveMinutes
        };
        let p = Prices::default();
        let chosen: Vec<bool> = r.steps.iter().map(|s| s.restarted).collect();
        let ours = model_cost(&r.steps, &chosen, ttl, &p);
        let best = optimal_cost(&r.steps, ttl, &p);
        println!(
            "{:32} restart schedule vs hindsight optimum (same model, keep-warm aside): {:.3}x",
            "",
            ours / best
        );
    }
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let path: PathBuf = [
        env!("CARGO_MANIFEST_DIR"),
        "..",
        "fixtures",
        "workload",
        "reference.json",
    ]
    .iter()
    .collect();
    let w: Value =
        serde_json::from_str(&std::fs::read_to_string(&path).expect("reference workload"))
            .expect("workload JSON");
    let n = std::env::var("BATCHES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(usize::MAX)
        .min(w["batches"].as_array().map_or(0, |b| b.len()));
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        for ttl in [Ttl::OneHour, Ttl::FiveMinutes] {
            let base = rebuild(&w, n, ttl).await;
            print(&base, None);
            let plain = live(&w, n, ttl, false).await;
            print(&plain, Some(&base));
            let warm = live(&w, n, ttl, true).await;
            print(&warm, Some(&base));
        }
    });
}
