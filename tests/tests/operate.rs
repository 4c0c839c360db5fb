//! Operating the gateway: its Prometheus metrics, `/healthz` and `/readyz`, scraped from the
//! running binary with an HTTP client and parsed with a Prometheus text parser.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use ed25519_dalek::SigningKey;
use gateway::client::Client;
use matrix_sdk::ruma::events::room::message::RoomMessageEventContent;
use tests::live::{live_section, public_hex, wait_for_reply};
use tests::matrix::{add_metrics, public_room, scrape, value, write_config, GatewayProcess, Scene};
use tests::mock_api::{MockApi, MockConfig};
use tests::synapse::Limits;
use wire::docs::{ids, Status};

/// `GET path` on `addr`: status code and body.
fn get(addr: SocketAddr, path: &str) -> Option<(u16, String)> {
    tests::synapse::get(addr.port(), path, None)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_move_with_mail_turns_sends_and_refusals() {
    let scene = Scene::new("operate-metrics", Limits::Relaxed).await;
    let (url, ann, dir) = (scene.url.clone(), &scene.ann, scene.dir.clone());
    let lobby = public_room(ann, "om-lobby").await;
    // Her model is priced by her config, reads at 0.05x: the mock bills by its own table.
    let mock = MockApi::start(MockConfig {
        model_prices: vec![(
            "claude-sonnet-4-6".into(),
            session::cost::Prices {
                input: 2.0,
                cache_write_5m: 2.5,
                cache_write_1h: 4.0,
                cache_read: 0.1,
                output: 10.0,
            },
        )],
        ..MockConfig::default()
    })
    .await
    .unwrap();
    let (session, _) = live_section(
        &dir,
        &mock,
        800,
        "prices = { input = 2.0, cache_read_ratio = 0.05 }",
    );
    // One turn per line this test sends: not the rules users get.
    let session = tests::live::every_line(&session);
    // Turns only on request, so the pending mail can be seen before it is answered.
    let session = tests::live::turns_on_request(&session);
    let heart = SigningKey::from_bytes(&[21; 32]);
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let config = write_config(
        &dir,
        &url,
        &scene.vera_token,
        &["#om-lobby:localhost"],
        &[],
        &format!(
            "{session}\n[[cultnet.client]]\nagent_id = \"heartbeat\"\npublic_key = \"{}\"\npersonas = [\"*\"]\nverbs = [\"turn\"]\n",
            public_hex(&heart)
        ),
    );
    add_metrics(&config, &port.to_string());

    // /readyz answers 503 until she has synced, then 200.
    let watcher = std::thread::spawn(move || {
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut seen = Vec::new();
        while Instant::now() < deadline {
            if let Some((code, _)) = get(port, "/readyz") {
                if seen.last() != Some(&code) {
                    seen.push(code);
                }
                if code == 200 {
                    break;
                }
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        seen
    });
    let gw = GatewayProcess::start(&config);
    assert_eq!(gw.metrics_addr(), port);
    let seen = watcher.join().unwrap();
    assert_eq!(
        seen,
        [503, 200],
        "/readyz answers over the start; log:\n{}",
        gw.log()
    );
    assert_eq!(get(port, "/healthz").map(|(c, _)| c), Some(200));
    assert_eq!(get(port, "/nothing").map(|(c, _)| c), Some(404));

    let m = scrape(port, &gw);
    assert_eq!(value(&m, "cultnet_gateway_pending{persona=\"vera\"}"), 0.0);
    assert!(value(&m, "cultnet_gateway_syncs_total{persona=\"vera\"}") >= 1.0);

    // Mail waits: pending goes up.
    lobby
        .send(RoomMessageEventContent::text_plain("anyone there?"))
        .await
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while value(
        &scrape(port, &gw),
        "cultnet_gateway_pending{persona=\"vera\"}",
    ) < 1.0
    {
        assert!(
            Instant::now() < deadline,
            "pending never rose; log:\n{}",
            gw.log()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // A stranger is refused; the heartbeat asks for her turn; she answers.
    let stranger = SigningKey::from_bytes(&[22; 32]);
    assert!(Client::connect(
        gw.cultnet_addr(),
        "stranger",
        &stranger,
        Duration::from_secs(3)
    )
    .await
    .is_err());
    let mut c = Client::connect(
        gw.cultnet_addr(),
        "heartbeat",
        &heart,
        Duration::from_secs(20),
    )
    .await
    .unwrap();
    let room = lobby.room_id().to_string();
    mock.script(serde_json::json!({"say": [{"room": room, "text": "here"}]}));
    let r = tests::live::request_turn(&mut c, "vera", "t1", None).await;
    assert_eq!(r.status, Status::Ok);
    wait_for_reply(ann, &lobby, "here", Duration::from_secs(60)).await;
    let deadline = Instant::now() + Duration::from_secs(30);
    let m = loop {
        let m = scrape(port, &gw);
        if m.get("cultnet_gateway_turns_total{outcome=\"sent\",persona=\"vera\"}") == Some(&1.0) {
            break m;
        }
        assert!(Instant::now() < deadline, "no turn counted: {m:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    // Pending back down; the send, the tokens, the cost and the refused Connect counted.
    assert_eq!(value(&m, "cultnet_gateway_pending{persona=\"vera\"}"), 0.0);
    assert_eq!(
        value(
            &m,
            "cultnet_gateway_sends_total{outcome=\"ok\",persona=\"vera\"}"
        ),
        1.0
    );
    assert!(
        value(
            &m,
            "cultnet_gateway_tokens_total{kind=\"cache_write\",persona=\"vera\"}"
        ) > 0.0
    );
    // The cost she reports is the mock's bill within 1%.
    let reported = value(&m, "cultnet_gateway_cost_usd_total{persona=\"vera\"}");
    let billed: f64 = mock.ledger().iter().map(|e| e.cost).sum();
    assert!(
        billed > 0.0 && (reported - billed).abs() <= 0.01 * billed,
        "reported ${reported} vs billed ${billed}"
    );
    assert!(
        value(
            &m,
            "cultnet_gateway_refresh_decisions_total{outcome=\"continue\",persona=\"vera\"}"
        ) >= 1.0
    );
    assert_eq!(
        value(
            &m,
            "cultnet_gateway_connects_refused_total{reason=\"unknown_agent\"}"
        ),
        1.0
    );
    assert_eq!(value(&m, "cultnet_gateway_connects_accepted_total{}"), 1.0);
    assert_eq!(value(&m, "cultnet_gateway_cultnet_peers{}"), 1.0);
    assert!(value(&m, "cultnet_gateway_datagrams_in_total{}") > 0.0);
    assert!(
        value(
            &m,
            "cultnet_gateway_turn_duration_seconds_count{persona=\"vera\"}"
        ) >= 1.0
    );
    assert!(value(&m, "cultnet_gateway_sync_lag_seconds{persona=\"vera\"}") < 60.0);
    // The Grafana dashboard asks only for what the gateway exports.
    let dashboard = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../deploy/grafana-dashboard.json"
    ))
    .unwrap();
    let (_, body) = get(port, "/metrics").unwrap();
    let exported: std::collections::HashSet<&str> = body
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.split(['{', ' ']).next())
        .collect();
    let mut asked = 0;
    for (i, _) in dashboard.match_indices("cultnet_gateway_") {
        let name: String = dashboard[i..]
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        if name == "cultnet_gateway_" {
            continue;
        }
        asked += 1;
        assert!(
            exported.contains(name.as_str()),
            "the dashboard asks for {name}, which is not exported"
        );
    }
    assert!(asked >= 20, "{asked}");
    c.close().await;
    assert!(gw.stop().success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_lets_a_turn_end_in_its_grace_or_retries_it_after_the_restart() {
    use tests::live::from_vera;
    use tests::mock_api::Fault;
    let scene = Scene::new("operate-sigterm", Limits::Relaxed).await;
    let (url, ann, dir) = (scene.url.clone(), &scene.ann, scene.dir.clone());
    let lobby = public_room(ann, "os-lobby").await;
    let room = lobby.room_id().to_string();
    let mock = MockApi::start(MockConfig::default()).await.unwrap();
    let (session, _) = live_section(&dir, &mock, 800, "shutdown_grace_secs = 5\n");
    // One turn per line this test sends: not the rules users get.
    let session = tests::live::every_line(&session);
    let config = write_config(
        &dir,
        &url,
        &scene.vera_token,
        &["#os-lobby:localhost"],
        &[],
        &session,
    );
    let in_flight = |from: usize| {
        let deadline = Instant::now() + Duration::from_secs(30);
        while mock.ledger().len() == from {
            assert!(Instant::now() < deadline, "the turn never reached the API");
            std::thread::sleep(Duration::from_millis(50));
        }
    };

    // A turn that ends within the grace is answered before the gateway exits.
    let gw = GatewayProcess::start(&config);
    mock.inject(Fault::Delay(Duration::from_secs(3)));
    mock.script(serde_json::json!({"say": [{"room": room, "text": "in time"}]}));
    let from = mock.ledger().len();
    lobby
        .send(RoomMessageEventContent::text_plain("first"))
        .await
        .unwrap();
    in_flight(from);
    let t0 = Instant::now();
    let log = gw.log();
    let code = gw.stop();
    let took = t0.elapsed();
    assert!(code.success(), "{code:?}; log:\n{log}");
    assert!(took < Duration::from_secs(10), "took {took:?}");
    assert_eq!(from_vera(ann, &lobby).await, ["in time"]);

    // A turn longer than the grace is given up; after the restart it is answered, once.
    std::fs::write(
        &config,
        std::fs::read_to_string(&config)
            .unwrap()
            .replace("shutdown_grace_secs = 5", "shutdown_grace_secs = 1"),
    )
    .unwrap();
    let gw = GatewayProcess::start(&config);
    mock.inject(Fault::Delay(Duration::from_secs(30)));
    // The abandoned request takes the first script; the retry the second.
    for _ in 0..2 {
        mock.script(serde_json::json!({"say": [{"room": room, "text": "after restart"}]}));
    }
    let from = mock.ledger().len();
    lobby
        .send(RoomMessageEventContent::text_plain("second"))
        .await
        .unwrap();
    in_flight(from);
    let t0 = Instant::now();
    let log_before = gw.log();
    let code = gw.stop();
    let took = t0.elapsed();
    assert!(code.success(), "{code:?}; log:\n{log_before}");
    assert!(took < Duration::from_secs(10), "took {took:?}");
    assert_eq!(from_vera(ann, &lobby).await, ["in time"]);
    let gw = GatewayProcess::start(&config);
    wait_for_reply(ann, &lobby, "after restart", Duration::from_secs(90)).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(from_vera(ann, &lobby).await, ["in time", "after restart"]);
    assert!(gw.stop().success());
}

/// The Personas the CultNet status names.
async fn persona_ids(c: &mut Client, key: &str) -> Vec<String> {
    let s: wire::docs::GatewayStatus = c
        .request(
            ids::STATUS_REQUEST,
            key,
            &wire::docs::StatusRequest { persona: None },
        )
        .await
        .unwrap();
    s.personas.into_iter().map(|p| p.persona).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_adds_removes_and_changes_personas_while_another_keeps_answering() {
    use tests::matrix::token_for;
    use wire::docs::{PendingPage, PendingRequest};
    let scene = Scene::new("operate-sighup", Limits::Relaxed).await;
    let (url, ann, dir) = (scene.url.clone(), &scene.ann, scene.dir.clone());
    for who in ["mira", "otto"] {
        scene.hs.register(who, &format!("{who}-pw"));
    }
    let lobby = public_room(ann, "oh-lobby").await;
    let mock = MockApi::start(MockConfig {
        responder: true,
        ..MockConfig::default()
    })
    .await
    .unwrap();
    let (session, _) = live_section(&dir, &mock, 200, "");
    // One turn per line this test sends: not the rules users get.
    let session = tests::live::every_line(&session);
    let mut tokens = HashMap::new();
    tokens.insert("vera", scene.vera_token.clone());
    for who in ["mira", "otto"] {
        let device = format!("GW-{}", who.to_uppercase());
        tokens.insert(
            who,
            token_for(&url, who, &format!("{who}-pw"), &device).await,
        );
    }
    let persona = |id: &str, extra: &str| {
        tests::matrix::persona_block(
            &dir,
            id,
            &url,
            &tokens[id],
            &["#oh-lobby:localhost"],
            &[],
            extra,
        )
    };
    let organ = SigningKey::from_bytes(&[31; 32]);
    let config = dir.join("gateway.toml");
    let write = |verbs: &str, personas: &[String]| {
        std::fs::write(
            &config,
            format!(
                "state_dir = \"{}\"\n[cultnet]\nbind = \"127.0.0.1:0\"\n[[cultnet.client]]\nagent_id = \"organ\"\npublic_key = \"{}\"\npersonas = [\"*\"]\nverbs = [{verbs}]\n{}",
                dir.join("state").display(),
                public_hex(&organ),
                personas.concat()
            ),
        )
        .unwrap();
    };
    let vera = persona("vera", &session);
    write(
        "\"pending\", \"status\"",
        &[vera.clone(), persona("mira", "")],
    );
    let gw = GatewayProcess::start(&config);
    let hup = |gw: &GatewayProcess| gw.reload();
    let ask = |n: &str| format!("Vera, question {n}?");
    let answered = |n: &str| format!("ann, you said \"{}\"", ask(n));
    let vera_answers = |n: String| {
        let lobby = lobby.clone();
        async move {
            let deadline = Instant::now() + Duration::from_secs(60);
            loop {
                let said = tests::live::said_by(ann, &lobby, "@vera:localhost").await;
                if said.iter().any(|b| b.starts_with(&n)) {
                    return;
                }
                assert!(
                    Instant::now() < deadline,
                    "vera did not answer {n:?}: {said:?}"
                );
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    };
    let vera_starts = |gw: &GatewayProcess| {
        gw.log()
            .lines()
            .filter(|l| l.contains("persona started") && l.contains("id=vera"))
            .count()
    };

    lobby
        .send(RoomMessageEventContent::text_plain(ask("one")))
        .await
        .unwrap();
    vera_answers(answered("one")).await;
    let mut c = Client::connect(gw.cultnet_addr(), "organ", &organ, Duration::from_secs(20))
        .await
        .unwrap();
    assert_eq!(persona_ids(&mut c, "s1").await, ["mira", "vera"]);

    // Mira removed, Otto added; Vera untouched and still answering.
    write(
        "\"pending\", \"status\"",
        &[vera.clone(), persona("otto", "")],
    );
    hup(&gw);
    assert_eq!(persona_ids(&mut c, "s2").await, ["otto", "vera"]);
    lobby
        .send(RoomMessageEventContent::text_plain(ask("two")))
        .await
        .unwrap();
    vera_answers(answered("two")).await;

    // Otto changed (a smaller inbox) restarts; the organ loses its pending verb at once.
    write(
        "\"status\"",
        &[
            vera.clone(),
            persona("otto", "[persona.limits]\nmax_pending = 500\n"),
        ],
    );
    hup(&gw);
    let log = gw.log();
    assert!(
        log.contains("stopping her (removed or changed)") && log.contains("persona=otto"),
        "{log}"
    );
    let refused = c
        .request::<_, PendingPage>(
            ids::PENDING_REQUEST,
            "p1",
            &PendingRequest {
                persona: "otto".into(),
                ..PendingRequest::default()
            },
        )
        .await;
    assert!(
        refused.is_err(),
        "the organ kept its pending verb: {refused:?}"
    );

    // A broken config changes nothing.
    std::fs::write(&config, "state_dir = [broken").unwrap();
    hup(&gw);
    assert!(gw.log().contains("is refused"), "{}", gw.log());
    assert_eq!(persona_ids(&mut c, "s3").await, ["otto", "vera"]);
    lobby
        .send(RoomMessageEventContent::text_plain(ask("three")))
        .await
        .unwrap();
    vera_answers(answered("three")).await;
    assert_eq!(vera_starts(&gw), 1, "vera was restarted:\n{}", gw.log());
    c.close().await;
    assert!(gw.stop().success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_report_of_a_200_turn_run_shows_every_series_and_decision() {
    let scene = Scene::new("operate-report", Limits::Relaxed).await;
    let (url, ann, dir) = (scene.url.clone(), &scene.ann, scene.dir.clone());
    let lobby = public_room(ann, "or-lobby").await;
    // The smallest window the config takes, so 200 turns reach the policy's watermark.
    let mock = MockApi::start(MockConfig {
        responder: true,
        context_window: 50_000,
        ..MockConfig::default()
    })
    .await
    .unwrap();
    let (session, _) = live_section(&dir, &mock, 400, "context_window = 50000\n");
    // One turn per line this test sends: not the rules users get.
    let session = tests::live::every_line(&session);
    let session = session
        .replace("debounce_ms = 200", "debounce_ms = 20")
        .replace("max_wait_ms = 1000", "max_wait_ms = 100");
    let config = write_config(
        &dir,
        &url,
        &scene.vera_token,
        &["#or-lobby:localhost"],
        &[],
        &session,
    );
    let gw = GatewayProcess::start(&config);
    let turns = || {
        std::fs::read_to_string(dir.join("state/personas/vera/status.json"))
            .ok()
            .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
            .and_then(|v| v["turns_total"].as_u64())
            .unwrap_or(0)
    };
    for i in 0..200u64 {
        lobby
            .send(RoomMessageEventContent::text_plain(format!(
                "Vera, line {i}: {}",
                "some words of the day ".repeat(8)
            )))
            .await
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(60);
        while turns() <= i {
            assert!(
                Instant::now() < deadline,
                "turn {i} did not happen; log:\n{}",
                gw.log()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    let svg = dir.join("report.svg");
    let out = tests::matrix::run_cli(&["report", "--out", svg.to_str().unwrap()], &config);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = std::fs::read_to_string(&svg).unwrap();
    let doc = roxmltree::Document::parse(&text).expect("well-formed SVG");
    let texts: Vec<&str> = doc
        .descendants()
        .filter(|n| n.has_tag_name("text"))
        .filter_map(|n| n.text())
        .map(str::trim)
        .collect();
    for want in gateway::report::SERIES {
        assert!(texts.contains(&want), "{want:?} missing");
    }
    assert!(
        texts.iter().any(|t| t.starts_with("vera: 200 turns over")),
        "{texts:?}"
    );
    // Each kind of decision is in the legend with its reason and count (`FreshStart(SkiRental) x13`).
    let decisions: Vec<&&str> = texts
        .iter()
        .filter(|t| {
            (t.starts_with("Compact(") || t.starts_with("FreshStart(")) && t.contains(") x")
        })
        .collect();
    assert!(
        !decisions.is_empty(),
        "no refresh decision in 200 turns: {texts:?}"
    );
    println!(
        "report of 200 turns: {} decision markers: {decisions:?}",
        decisions.len()
    );
    if let Ok(keep) = std::env::var("REPORT_SVG") {
        std::fs::copy(&svg, keep).unwrap();
    }
    assert!(gw.stop().success());
    // What the policy learned outlives the process: the gaps between her 200 batches (the
    // newest kept) and the sizes of her compactions' summaries, in her inbox. This run
    // shrinks by fresh starts only (0 compactions measured: under the 8 KiB rehydration cap a
    // fresh start is the cheaper way), so here the summaries check that none is stored
    // without a compaction; a stored compaction size is checked in gateway_run.rs
    // (`a_conversation_outgrowing_the_window_is_compacted_and_goes_on`).
    let inbox = gateway::inbox::Inbox::open(&dir.join("state/inbox")).unwrap();
    let gaps: session::policy::GapModel = serde_json::from_str(
        &inbox
            .session_value("vera", "gaps")
            .unwrap()
            .expect("her gaps stored"),
    )
    .unwrap();
    assert_eq!(gaps.len(), session::policy::GapModel::KEPT);
    let status: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.join("state/personas/vera/status.json")).unwrap(),
    )
    .unwrap();
    let compactions = status["compactions"].as_u64().unwrap_or(0);
    let summaries: Vec<u64> = inbox
        .session_value("vera", "summaries")
        .unwrap()
        .map(|v| serde_json::from_str(&v).unwrap())
        .unwrap_or_default();
    assert_eq!(
        summaries.len() as u64,
        compactions.min(session::policy::Telemetry::SUMMARIES_KEPT as u64),
        "{summaries:?} after {compactions} compactions"
    );
    assert!(summaries.iter().all(|s| *s > 0), "{summaries:?}");
    println!("after 200 turns: {compactions} compactions, summaries {summaries:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_running_gateway_compacts_an_inbox_of_dead_records_and_keeps_what_is_pending() {
    use gateway::inbox::{Inbox, SyncWrite};
    use wire::docs::{AckReceipt, AckRequest, Delivery, PendingPage, PendingRequest};
    let scene = Scene::new("operate-compact", Limits::Relaxed).await;
    let (url, dir) = (scene.url.clone(), scene.dir.clone());
    public_room(&scene.ann, "oc-lobby").await;
    let organ = SigningKey::from_bytes(&[41; 32]);
    let config = write_config(
        &dir,
        &url,
        &scene.vera_token,
        &["#oc-lobby:localhost"],
        &[],
        &(tests::live::client_block("organ", &organ, &["*"], &["pending", "ack"])
            + "\n[retention]\ncompact_above_mib = 1\n"),
    );
    // A first run stores her sync position.
    let gw = GatewayProcess::start(&config);
    gw.wait_log("gateway running", Duration::from_secs(60));
    assert!(gw.stop().success());
    // An inbox that has delivered 20,000 events, all but the last 7 acknowledged: sled keeps
    // the space of every removed chunk.
    let inbox_dir = dir.join("state/inbox");
    let (before, live_before) = {
        let inbox = Inbox::open(&inbox_dir).unwrap();
        let token = inbox.sync_token("vera").unwrap().expect("a sync token");
        for r in 0..200u32 {
            let batch: Vec<Delivery> = (0..100)
                .map(|i| Delivery {
                    event_id: format!("$old-{r}-{i}"),
                    room_id: "!elsewhere:localhost".into(),
                    sender: "@ann:localhost".into(),
                    text: "words ".repeat(50),
                    ..Delivery::default()
                })
                .collect();
            let write = SyncWrite {
                deliveries: &batch,
                ..SyncWrite::default()
            };
            inbox.ingest_sync("vera", &token, write).unwrap();
            inbox
                .ack("vera", inbox.counts("vera").unwrap().highest.min(19_993))
                .unwrap();
        }
        let page = inbox.pending("vera", 0, 100, None).unwrap();
        let ids: Vec<String> = page.deliveries.iter().map(|d| d.event_id.clone()).collect();
        (inbox.disk_bytes(), ids)
    };
    assert_eq!(live_before.len(), 7);
    let gw = GatewayProcess::start(&config);
    gw.wait_log("inbox compacted", Duration::from_secs(60));
    let after = gateway::inbox::compact::bytes_under(&inbox_dir);
    println!("inbox files {before} bytes -> {after} bytes after the gateway's compaction");
    assert!(after * 3 < before, "{before} -> {after} bytes");
    // What was pending still is, and acknowledging it sticks.
    let mut c = Client::connect(gw.cultnet_addr(), "organ", &organ, Duration::from_secs(20))
        .await
        .unwrap();
    let page: PendingPage = c
        .request(
            ids::PENDING_REQUEST,
            "p1",
            &PendingRequest {
                persona: "vera".into(),
                ..PendingRequest::default()
            },
        )
        .await
        .unwrap();
    let got: Vec<String> = page
        .deliveries
        .iter()
        .map(|d| d.event_id.clone())
        .filter(|id| id.starts_with("$old-"))
        .collect();
    assert_eq!(got, live_before);
    let ack: AckReceipt = c
        .request(
            ids::ACK_REQUEST,
            "a1",
            &AckRequest {
                persona: "vera".into(),
                through_seq: 20_000,
            },
        )
        .await
        .unwrap();
    assert_eq!(ack.status, Status::Ok, "{ack:?}");
    // A changed [retention] is taken on SIGHUP, without a restart.
    let text = std::fs::read_to_string(&config).unwrap().replace(
        "compact_above_mib = 1",
        "compact_above_mib = 2\nreceipts_days = 7",
    );
    std::fs::write(&config, text).unwrap();
    std::process::Command::new("kill")
        .args(["-HUP", &gw.pid().to_string()])
        .status()
        .unwrap();
    gw.wait_log("[retention] changed", Duration::from_secs(30));
    c.close().await;
    assert!(gw.stop().success());
    let inbox = Inbox::open(&inbox_dir).unwrap();
    assert!(inbox.counts("vera").unwrap().acked_through >= 20_000);
}
