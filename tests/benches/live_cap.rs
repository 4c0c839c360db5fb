//! What the gateway-wide cap on live claude processes (`[sessions] max_live`) saves and costs:
//! six live Personas in one room of a real Synapse, the real CLI against the mock Messages API
//! (1-hour cache), three rounds in which each is asked one line in turn and answers it. Run with
//! every process kept (`max_live = 6`) and with two (`max_live = 2`: each turn evicts the least
//! recently used idle process and resumes her session inside the cache TTL). Reports the peak
//! of live processes, their mean RSS (sampled from /proc every 100 ms), the evictions, and the
//! cost and line -> reply latency of the turns after the first round.
//! `cargo bench -p tests --bench live_cap`.

use std::time::{Duration, Instant};

use matrix_sdk::ruma::events::room::message::RoomMessageEventContent;
use tests::matrix::Scene;
use tests::procfs::Watch;
use tests::synapse::Limits;

const NAMES: [&str; 6] = ["vera", "mira", "nora", "olga", "pia", "ruth"];
const ROUNDS: usize = 3;

/// One run's figures.
struct Figures {
    max_live: usize,
    peak: usize,
    rss_mib: f64,
    evictions: usize,
    cost_per_turn: f64,
    p50_ms: f64,
    p90_ms: f64,
}

async fn run(max_live: usize) -> Figures {
    let scene = Scene::new(&format!("bench-live-cap-{max_live}"), Limits::Relaxed).await;
    let ann = &scene.ann;
    let (lobby, mock, gw) = tests::live::live_cast(
        &scene,
        &NAMES,
        "cap-lobby",
        &format!("[sessions]\nmax_live = {max_live}\n"),
        "start = \"addressed\"",
    )
    .await;
    let pid = gw.pid();
    let watch = Watch::children_of(pid);
    let mut latencies = Vec::new();
    let mut from = 0;
    for round in 1..=ROUNDS {
        if round == 2 {
            from = mock.ledger().len();
        }
        for name in NAMES {
            let asked = format!("{name}, round {round}?");
            let sent = Instant::now();
            lobby
                .send(RoomMessageEventContent::text_plain(&asked))
                .await
                .expect("send");
            let deadline = Instant::now() + Duration::from_secs(120);
            loop {
                let said = tests::live::said_by(ann, &lobby, &format!("@{name}:localhost")).await;
                if said.iter().any(|b| b.contains(&asked)) {
                    break;
                }
                assert!(
                    Instant::now() < deadline,
                    "{name} never answered round {round}"
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            if round > 1 {
                latencies.push(sent.elapsed().as_secs_f64() * 1000.0);
            }
        }
    }
    let (peak, rss_mib) = watch.stop();
    let turns: Vec<f64> = mock.ledger()[from..]
        .iter()
        .filter(|e| e.status == 200 && !e.is_summary())
        .map(|e| e.cost)
        .collect();
    let evictions = gw
        .log()
        .matches("to make room for another Persona's")
        .count();
    assert!(gw.stop().success());
    latencies.sort_by(f64::total_cmp);
    let at = |q: f64| latencies[((latencies.len() - 1) as f64 * q).round() as usize];
    Figures {
        max_live,
        peak,
        rss_mib,
        evictions,
        cost_per_turn: turns.iter().sum::<f64>() / turns.len().max(1) as f64,
        p50_ms: at(0.5),
        p90_ms: at(0.9),
    }
}

fn main() {
    if std::env::args().any(|a| a == "--list" || a == "--test") {
        return;
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let figures: Vec<Figures> = [6, 2].into_iter().map(|m| rt.block_on(run(m))).collect();
    println!("\n6 live Personas, {ROUNDS} rounds of one line each (rounds 2-{ROUNDS} measured):");
    println!("| max_live | peak live processes | RSS per live process | evictions | cost per turn | line -> reply p50 | p90 |");
    println!("|---|---|---|---|---|---|---|");
    for f in &figures {
        println!(
            "| {} | {} | {:.0} MiB | {} | ${:.5} | {:.0} ms | {:.0} ms |",
            f.max_live, f.peak, f.rss_mib, f.evictions, f.cost_per_turn, f.p50_ms, f.p90_ms
        );
    }
}
