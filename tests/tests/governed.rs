//! What she spends is governed, end to end (`cultnet-gateway run`, a real Synapse, the real
//! claude CLI against the mock Messages API):
//! - with a daily cap, turns stop once her billed spend reaches it, her mail waits, her status
//!   and metrics say so, and a reload with a higher cap answers everything that waited, once;
//! - by default only lines addressed to her start turns, the rest ride with her next turn;
//!   ambient mail keeps its interval;
//! - one member mentioning her again and again starts at most her hourly turns;
//! - a burst of 300 lines from three people reaches her once each, in order, in few turns;
//! - two Personas whose every reply names the other stop within `bot_exchanges`, and a human
//!   line lets them start again;
//! - with `start = "minds"`, only a CultNet turn request starts a turn.

use std::time::{Duration, Instant};

use ed25519_dalek::SigningKey;
use gateway::client::Client;
use matrix_sdk::ruma::events::room::message::RoomMessageEventContent;
use serde_json::json;
use tests::live::{
    from_vera, live_section, member, request_turn, turns_since, until_joined, vera_live_in,
    wait_for_reply, with_turns,
};
use tests::matrix::{add_metrics, public_room, scrape, write_config, GatewayProcess, Scene};
use tests::mock_api::{LedgerEntry, MockApi, MockConfig};
use tests::procfs::{children, Watch};
use tests::synapse::Limits;
use wire::docs::Status;

/// How many times `line` (a whole chat line's text) was sent to the model in `turns`.
fn shown(turns: &[LedgerEntry], line: &str) -> usize {
    let needle = format!(": {line}\n");
    turns
        .iter()
        .map(|e| e.last_user_text.matches(&needle).count())
        .sum()
}

/// Waits until the mock has had no request for `quiet`.
async fn until_quiet(mock: &MockApi, quiet: Duration) {
    let mut last = mock.ledger().len();
    let mut since = Instant::now();
    let deadline = Instant::now() + Duration::from_secs(180);
    while since.elapsed() < quiet {
        assert!(Instant::now() < deadline, "the model was never quiet");
        tokio::time::sleep(Duration::from_millis(200)).await;
        let n = mock.ledger().len();
        if n != last {
            last = n;
            since = Instant::now();
        }
    }
}

/// Her status file.
fn status(dir: &std::path::Path) -> serde_json::Value {
    std::fs::read(dir.join("state/personas/vera/status.json"))
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or_default()
}

/// The gauge `name` for vera in a scrape of `gw`'s metrics (0 when absent).
fn gauge(gw: &GatewayProcess, name: &str) -> f64 {
    scrape(gw.metrics_addr(), gw)
        .get(&format!("cultnet_gateway_{name}{{persona=\"vera\"}}"))
        .copied()
        .unwrap_or(0.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_her_daily_cap_her_mail_waits_and_a_higher_cap_answers_it_once() {
    let scene = Scene::new("governed-budget", Limits::Relaxed).await;
    let (url, ann, dir) = (scene.url.clone(), &scene.ann, scene.dir.clone());
    let lobby = public_room(ann, "gb-lobby").await;
    let room = lobby.room_id().to_string();
    let mock = MockApi::start(MockConfig::default()).await.unwrap();
    let (session, _) = live_section(&dir, &mock, 2000, "");
    // One turn per line this test sends: not the rules users get.
    let session = tests::live::every_line(&session);
    // A cap her first turn (a cache write of her doctrine) already passes.
    let budget = |usd: &str| format!("{session}\n[persona.budget]\nusd_per_day = {usd}\n");
    let config = write_config(
        &dir,
        &url,
        &scene.vera_token,
        &["#gb-lobby:localhost"],
        &[],
        &budget("0.001"),
    );
    add_metrics(&config, "127.0.0.1:0");
    let gw = GatewayProcess::start(&config);
    let say = |text: &str| json!({"say": [{"room": room, "text": text}]});
    let chat = |text: &str| RoomMessageEventContent::text_plain(text);

    mock.script(say("hello all"));
    lobby.send(chat("hello vera")).await.unwrap();
    wait_for_reply(ann, &lobby, "hello all", Duration::from_secs(90)).await;
    let first_cost: f64 = mock.ledger().iter().map(|e| e.cost).sum();
    assert!(first_cost > 0.001, "her first turn cost only ${first_cost}");

    // Over the cap: three lines wait; no request reaches the API.
    let billed = mock.ledger().len();
    mock.script(say("caught up"));
    for line in ["waiting one", "waiting two", "waiting three"] {
        lobby.send(chat(line)).await.unwrap();
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    while status(&dir)["over_budget"].is_null() {
        assert!(
            Instant::now() < deadline,
            "her status never said over_budget: {}\nlog:\n{}",
            status(&dir),
            gw.log()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // Past the debounce (200 ms, 1 s at most) several times over.
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(
        mock.ledger().len(),
        billed,
        "a request past her cap: {:?}",
        mock.ledger()[billed..]
            .iter()
            .map(|e| &e.last_user_text)
            .collect::<Vec<_>>()
    );
    let st = status(&dir);
    let over = &st["over_budget"];
    assert_eq!(over["cap_usd"], 0.001, "{st}");
    assert!(over["spent_usd"].as_f64().unwrap_or(0.0) >= 0.001, "{st}");
    let in_a_day = over["resumes_at_ms"].as_i64().unwrap_or(0)
        - std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis() as i64;
    assert!(
        in_a_day > 23 * 3_600_000 && in_a_day <= 24 * 3_600_000,
        "she resumes in {in_a_day} ms"
    );
    assert!(
        st["last_error"]
            .as_str()
            .unwrap_or_default()
            .starts_with("over_budget: "),
        "{st}"
    );
    assert_eq!(gauge(&gw, "over_budget"), 1.0);
    assert!(gauge(&gw, "budget_resumes_at_seconds") > 0.0);
    assert!(!from_vera(ann, &lobby)
        .await
        .iter()
        .any(|b| b == "caught up"));

    // A reload with a higher cap: what waited is answered, once, in one batch.
    std::fs::write(
        &config,
        std::fs::read_to_string(&config)
            .unwrap()
            .replace("usd_per_day = 0.001", "usd_per_day = 100.0"),
    )
    .unwrap();
    gw.reload();
    wait_for_reply(ann, &lobby, "caught up", Duration::from_secs(90)).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let said = from_vera(ann, &lobby).await;
    assert_eq!(
        said.iter().filter(|b| *b == "caught up").count(),
        1,
        "{said:?}"
    );
    let sent: Vec<String> = mock.ledger()[billed..]
        .iter()
        .filter(|e| e.status == 200)
        .map(|e| e.last_user_text.clone())
        .collect();
    for line in ["waiting one", "waiting two", "waiting three"] {
        assert_eq!(
            sent.iter().filter(|t| t.contains(line)).count(),
            1,
            "{line:?} in {sent:?}"
        );
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while gauge(&gw, "over_budget") != 0.0 || !status(&dir)["over_budget"].is_null() {
        assert!(Instant::now() < deadline, "still over: {}", status(&dir));
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(gw.stop().success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unaddressed_lines_ride_with_her_next_addressed_turn_and_ambient_mail_keeps_its_interval() {
    let scene = Scene::new("governed-addressed", Limits::Relaxed).await;
    let ann = &scene.ann;
    let mock = MockApi::start(MockConfig::default()).await.unwrap();
    let (session, _) = live_section(&scene.dir, &mock, 2000, "");
    let session = with_turns(&session, "start = \"addressed\"");
    let (lobby, config, gw) = vera_live_in(&scene, "ga-lobby", &session, &[], "").await;
    let room = lobby.room_id().to_string();
    let chat = |text: &str| RoomMessageEventContent::text_plain(text);

    // Ten lines meant for no one, each past the debounce (200 ms): no turn.
    for i in 0..10 {
        lobby.send(chat(&format!("lunch note {i}"))).await.unwrap();
        tokio::time::sleep(Duration::from_millis(400)).await;
    }
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(
        turns_since(&mock, 0).is_empty(),
        "unaddressed lines started a turn"
    );
    // A line to her: one turn, which carries the ten.
    mock.script(json!({"say": [{"room": room, "text": "got all of it"}]}));
    lobby
        .send(chat("vera, did you follow all that?"))
        .await
        .unwrap();
    wait_for_reply(ann, &lobby, "got all of it", Duration::from_secs(90)).await;
    let turns = turns_since(&mock, 0);
    assert_eq!(turns.len(), 1, "{turns:?}");
    for i in 0..10 {
        assert_eq!(shown(&turns, &format!("lunch note {i}")), 1, "{i}");
    }
    assert!(turns[0]
        .last_user_text
        .contains("[to you]: vera, did you follow all that?"));

    // Ambient mail, at most one turn every 4 s: 24 lines over 12 s.
    std::fs::write(
        &config,
        std::fs::read_to_string(&config).unwrap().replace(
            "start = \"addressed\"",
            "start = \"addressed\"\nambient_every_secs = 4",
        ),
    )
    .unwrap();
    gw.reload();
    until_joined(ann, &lobby, "@vera:localhost", &gw).await;
    let from = mock.ledger().len();
    for i in 0..24 {
        lobby.send(chat(&format!("chatter {i}"))).await.unwrap();
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    while shown(&turns_since(&mock, from), "chatter 23") == 0 {
        assert!(Instant::now() < deadline, "the chatter never reached her");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let turns = turns_since(&mock, from);
    for i in 0..24 {
        assert_eq!(shown(&turns, &format!("chatter {i}")), 1, "{i}");
    }
    assert!(turns.len() >= 2, "{} turn(s)", turns.len());
    let gaps: Vec<f64> = turns.windows(2).map(|w| w[1].at - w[0].at).collect();
    println!(
        "ambient turns: {} for 24 lines over 12 s, gaps {gaps:?} s",
        turns.len()
    );
    assert!(
        gaps.iter().all(|g| *g >= 3.5),
        "ambient turns closer than the 4 s interval: {gaps:?}"
    );
    assert!(gw.stop().success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_mentioning_her_again_and_again_starts_at_most_her_hourly_turns() {
    let scene = Scene::new("governed-sender", Limits::Relaxed).await;
    let ann = &scene.ann;
    let mock = MockApi::start(MockConfig::default()).await.unwrap();
    let (session, _) = live_section(&scene.dir, &mock, 2000, "");
    let session = with_turns(&session, "start = \"addressed\"\nper_sender_per_hour = 3");
    let (lobby, _, gw) = vera_live_in(&scene, "gs-lobby", &session, &[], "").await;
    let room = lobby.room_id().to_string();
    let m_lobby = member(&scene, "mallory", "#gs-lobby:localhost").await;
    let chat = |text: &str| RoomMessageEventContent::text_plain(text);

    // Thirty mentions in 15 s, each past the debounce.
    for i in 0..30 {
        m_lobby
            .send(chat(&format!("vera, look {i}")))
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    until_quiet(&mock, Duration::from_secs(4)).await;
    let by_mallory = turns_since(&mock, 0).len();
    println!("30 mentions in 15 s from one member: {by_mallory} turn(s)");
    assert!(
        (1..=3).contains(&by_mallory),
        "{by_mallory} turns from one member"
    );
    // Another member is not held, and her turn carries what waited.
    mock.script(json!({"say": [{"room": room, "text": "yes, ann"}]}));
    lobby.send(chat("vera, a word?")).await.unwrap();
    wait_for_reply(ann, &lobby, "yes, ann", Duration::from_secs(90)).await;
    until_quiet(&mock, Duration::from_secs(4)).await;
    // What waited is more than one batch (`max_batch` 20): her line's turn may take two.
    let turns = turns_since(&mock, 0);
    assert!(
        (by_mallory + 1..=by_mallory + 2).contains(&turns.len()),
        "{} turns",
        turns.len()
    );
    assert_eq!(shown(&turns, "vera, a word?"), 1);
    for i in 0..30 {
        assert_eq!(shown(&turns, &format!("vera, look {i}")), 1, "{i}");
    }
    assert!(gw.stop().success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_300_lines_from_three_people_reaches_her_once_each_in_few_turns() {
    let scene = Scene::new("governed-burst", Limits::Relaxed).await;
    let mock = MockApi::start(MockConfig::default()).await.unwrap();
    let (session, _) = live_section(&scene.dir, &mock, 2000, "");
    let session = with_turns(&session, "start = \"all\"\nper_sender_per_hour = 1000");
    let (lobby, _, gw) = vera_live_in(&scene, "gu-lobby", &session, &[], "").await;
    let mut talkers = vec![lobby.clone()];
    for name in ["bob", "carol"] {
        talkers.push(member(&scene, name, "#gu-lobby:localhost").await);
    }

    // Three people, 100 lines each, one every 100 ms.
    let started = Instant::now();
    let sends = talkers.into_iter().enumerate().map(|(who, room)| {
        tokio::spawn(async move {
            for i in 0..100 {
                room.send(RoomMessageEventContent::text_plain(format!(
                    "p{who} line {i}"
                )))
                .await
                .unwrap();
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
    });
    for s in sends.collect::<Vec<_>>() {
        s.await.unwrap();
    }
    let took = started.elapsed();
    let deadline = Instant::now() + Duration::from_secs(120);
    while (0..3).any(|w| shown(&turns_since(&mock, 0), &format!("p{w} line 99")) == 0) {
        assert!(
            Instant::now() < deadline,
            "the burst never reached her; log:\n{}",
            gw.log()
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let turns = turns_since(&mock, 0);
    println!(
        "300 lines from 3 people in {:.1} s: {} turns",
        took.as_secs_f64(),
        turns.len()
    );
    assert!(turns.len() <= 20, "{} turns", turns.len());
    // Once each, and each person's lines in order.
    let all: String = turns.iter().map(|e| e.last_user_text.as_str()).collect();
    for w in 0..3 {
        let mut at = 0;
        for i in 0..100 {
            let needle = format!(": p{w} line {i}\n");
            assert_eq!(all.matches(&needle).count(), 1, "{needle:?}");
            let pos = all.find(&needle).unwrap_or_default();
            assert!(pos >= at, "{needle:?} out of order");
            at = pos;
        }
    }
    assert!(gw.stop().success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_personas_naming_each_other_stop_within_their_bot_exchanges() {
    let scene = Scene::new("governed-bots", Limits::Relaxed).await;
    // The responder answers every line addressed to her, quoting it: a reply to a line that
    // names both names both, so each answers the other.
    let (lobby, mock, gw) = tests::live::live_cast(
        &scene,
        &["vera", "mira"],
        "gx-lobby",
        "",
        "start = \"addressed\"\nbot_exchanges = 2",
    )
    .await;

    for round in 0..2 {
        let from = mock.ledger().len();
        lobby
            .send(RoomMessageEventContent::text_plain(format!(
                "vera and mira, round {round}: talk"
            )))
            .await
            .unwrap();
        until_quiet(&mock, Duration::from_secs(8)).await;
        let n = turns_since(&mock, from).len();
        println!("round {round}: {n} turns after one human line (bot_exchanges 2)");
        // Each answers the human once, then at most two of the other's lines in a row.
        assert!(n >= 4, "they did not answer each other: {n} turns");
        assert!(n <= 2 * (1 + 2), "the exchange ran on: {n} turns");
    }
    assert!(gw.stop().success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_start_minds_only_a_cultnet_turn_request_starts_a_turn() {
    let scene = Scene::new("governed-minds", Limits::Relaxed).await;
    let ann = &scene.ann;
    let mock = MockApi::start(MockConfig::default()).await.unwrap();
    let (session, _) = live_section(&scene.dir, &mock, 2000, "");
    let heart = SigningKey::from_bytes(&[41; 32]);
    let (lobby, _, gw) = vera_live_in(
        &scene,
        "gm-lobby",
        &with_turns(&session, "start = \"minds\""),
        &["@ann:localhost"],
        &tests::live::client_block("heart", &heart, &["vera"], &["turn"]),
    )
    .await;
    let room = lobby.room_id().to_string();
    // Her operator, addressing her: no turn.
    lobby
        .send(RoomMessageEventContent::text_plain("vera, are you there?"))
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert!(turns_since(&mock, 0).is_empty(), "a line started a turn");
    mock.script(json!({"say": [{"room": room, "text": "here, on my heartbeat"}]}));
    let mut c = Client::connect(gw.cultnet_addr(), "heart", &heart, Duration::from_secs(30))
        .await
        .unwrap();
    let r = request_turn(&mut c, "vera", "beat-1", Some("heartbeat")).await;
    assert_eq!(r.status, Status::Ok, "{r:?}");
    wait_for_reply(
        ann,
        &lobby,
        "here, on my heartbeat",
        Duration::from_secs(60),
    )
    .await;
    let turns = turns_since(&mock, 0);
    assert_eq!(turns.len(), 1);
    assert_eq!(shown(&turns, "vera, are you there?"), 1);
    c.close().await;
    assert!(gw.stop().success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn six_live_personas_with_two_live_processes_answer_every_batch() {
    const NAMES: [&str; 6] = ["vera", "mira", "nora", "olga", "pia", "ruth"];
    let scene = Scene::new("governed-live", Limits::Relaxed).await;
    let ann = &scene.ann;
    let (lobby, mock, gw) = tests::live::live_cast(
        &scene,
        &NAMES,
        "gl-lobby",
        "[sessions]\nmax_live = 2\n",
        "start = \"addressed\"",
    )
    .await;
    // Watch the gateway's children the whole time: never more than two live processes.
    let pid = gw.pid();
    let watch = Watch::children_of(pid);
    let mut per_round = Vec::new();
    for round in 1..=2 {
        let from = mock.ledger().len();
        for name in NAMES {
            lobby
                .send(RoomMessageEventContent::text_plain(format!(
                    "{name}, round {round}?"
                )))
                .await
                .unwrap();
        }
        let deadline = Instant::now() + Duration::from_secs(180);
        for name in NAMES {
            while tests::live::said_by(ann, &lobby, &format!("@{name}:localhost"))
                .await
                .iter()
                .filter(|b| b.starts_with("ann, you said"))
                .count()
                < round
            {
                assert!(
                    Instant::now() < deadline,
                    "{name} never answered round {round}; log:\n{}",
                    gw.log()
                );
                tokio::time::sleep(Duration::from_millis(300)).await;
            }
        }
        per_round.push(turns_since(&mock, from));
    }
    // The last two answered are still live: their next turns keep their processes.
    until_quiet(&mock, Duration::from_secs(2)).await;
    let live: Vec<u32> = children(pid).iter().map(|(p, _)| *p).collect();
    let (most, rss_mib) = watch.stop();
    let evictions = gw
        .log()
        .matches("to make room for another Persona's")
        .count();
    let cost = |turns: &[LedgerEntry]| {
        turns.iter().map(|e| e.cost).sum::<f64>() / turns.len().max(1) as f64
    };
    let writes = |turns: &[LedgerEntry]| {
        turns
            .iter()
            .map(|e| e.usage.cache_write_5m + e.usage.cache_write_1h)
            .sum::<u64>()
            / turns.len().max(1) as u64
    };
    println!(
        "6 live Personas, max_live 2: at most {most} live processes, {evictions} evictions, \
         {:.0} MiB RSS per live process (mean of samples); round 1 (new sessions) ${:.5}/turn, \
         round 2 (every one resumed after eviction, cache warm) ${:.5}/turn, {} cache-write \
         tokens/turn; {} processes live at the end",
        rss_mib,
        cost(&per_round[0]),
        cost(&per_round[1]),
        writes(&per_round[1]),
        live.len()
    );
    assert!(most <= 2, "{most} live processes at once");
    // Each Persona past the first two needs one in each round; no turn needs more than one.
    let turns: usize = per_round.iter().map(Vec::len).sum();
    assert!(
        (8..=turns).contains(&evictions),
        "{evictions} evictions for {turns} turns"
    );
    assert!(live.len() <= 2);
    for (round, turns) in per_round.iter().enumerate() {
        assert!(
            turns.len() >= NAMES.len(),
            "round {}: {} turns",
            round + 1,
            turns.len()
        );
    }
    assert!(gw.stop().success());
}
