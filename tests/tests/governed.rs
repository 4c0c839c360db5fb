//! What she spends is governed, end to end (`cultnet-gateway run`, a real Synapse, the real
//! claude CLI against the mock Messages API): with a daily cap, turns stop once her billed
//! spend reaches it, her mail waits, her status and metrics say so, and a reload with a higher
//! cap answers everything that waited, once.

use std::time::{Duration, Instant};

use matrix_sdk::ruma::events::room::message::RoomMessageEventContent;
use serde_json::json;
use tests::live::{from_vera, live_section, wait_for_reply};
use tests::matrix::{add_metrics, public_room, scrape, write_config, GatewayProcess, Scene};
use tests::mock_api::{MockApi, MockConfig};
use tests::synapse::Limits;

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

/// Sends SIGHUP and waits for the reload to be logged.
fn hup(gw: &GatewayProcess) {
    let done = |log: &str| log.matches("SIGHUP: config reloaded").count();
    let before = done(&gw.log());
    std::process::Command::new("kill")
        .args(["-HUP", &gw.pid().to_string()])
        .status()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while done(&gw.log()) == before {
        assert!(Instant::now() < deadline, "no reload; log:\n{}", gw.log());
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_her_daily_cap_her_mail_waits_and_a_higher_cap_answers_it_once() {
    let scene = Scene::new("governed-budget", Limits::Relaxed).await;
    let (url, ann, dir) = (scene.url.clone(), &scene.ann, scene.dir.clone());
    let lobby = public_room(ann, "gb-lobby").await;
    let room = lobby.room_id().to_string();
    let mock = MockApi::start(MockConfig::default()).await.unwrap();
    let (session, _) = live_section(&dir, &mock, 2000, "");
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
    hup(&gw);
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
