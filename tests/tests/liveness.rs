//! Nothing a room does can silence her, end to end (`cultnet-gateway run`, a real Synapse, the
//! real claude CLI against the mock Messages API), with her default turn rules:
//! - a chatty member's lines meant for no one never fill her inbox: past her room's bound they
//!   are retired into context; her operator's DM invite is joined and his DM answered in one
//!   turn, and the room's newest lines reach her next room turn;
//! - a mouth-only Persona whose CultNet clients have not acknowledged her mail (her inbox at
//!   `max_pending`) still joins her operator's DM and stores his lines, and her rooms wait on
//!   the homeserver until acks free room;
//! - a batch the API refuses for its content is tried once more degraded, then set aside; her
//!   operator's next DM is answered, she is told, and the batch can be retried or dropped.

use std::time::{Duration, Instant};

use ed25519_dalek::SigningKey;
use gateway::client::Client;
use matrix_sdk::ruma::events::room::message::RoomMessageEventContent;
use tests::live::{
    client_block, control, live_section, member, open_dm, turns_since, vera_live_in,
    wait_for_reply, with_turns,
};
use tests::matrix::{add_metrics, scrape, user_client, GatewayProcess, Scene};
use tests::mock_api::{MockApi, MockConfig};
use tests::synapse::Limits;
use wire::docs::{
    ids, AckReceipt, AckRequest, ControlAction, PendingPage, PendingRequest, SetAsideBatch, Status,
};

/// The metric `name` for vera in a scrape of `gw`'s metrics (0 when absent).
fn metric(gw: &GatewayProcess, name: &str) -> f64 {
    scrape(gw.metrics_addr(), gw)
        .get(&format!("cultnet_gateway_{name}{{persona=\"vera\"}}"))
        .copied()
        .unwrap_or(0.0)
}

fn chat(text: &str) -> RoomMessageEventContent {
    RoomMessageEventContent::text_plain(text)
}

/// The mock (answering every line addressed to her, `latency` before each answer) and vera
/// live with her default turn rules and `extra` after her session section (limits, a budget,
/// a client block), in a new public room `#ALIAS:localhost` that ann made, ann her operator:
/// the mock, the room, her config and the running gateway once she has joined.
async fn vera_live(
    scene: &Scene,
    alias: &str,
    latency: Duration,
    extra: &str,
) -> (
    MockApi,
    matrix_sdk::Room,
    std::path::PathBuf,
    GatewayProcess,
) {
    let mock = MockApi::start(MockConfig {
        responder: true,
        latency,
        ..MockConfig::default()
    })
    .await
    .expect("the mock");
    let (session, _) = live_section(&scene.dir, &mock, 2000, "");
    let session = with_turns(&session, "");
    let (room, config, gw) = vera_live_in(scene, alias, &session, &["@ann:localhost"], extra).await;
    (mock, room, config, gw)
}

/// Waits (up to `secs`) until vera has said in `room` a line that starts with `start`, as
/// ann sees it; her lines there.
async fn until_said(
    scene: &Scene,
    room: &matrix_sdk::Room,
    start: &str,
    secs: u64,
    gw: &GatewayProcess,
) -> Vec<String> {
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        let got = tests::live::from_vera(&scene.ann, room).await;
        if got.iter().any(|b| b.starts_with(start)) {
            return got;
        }
        assert!(
            Instant::now() < deadline,
            "she never said {start:?}: {got:?}\nlog:\n{}",
            gw.log()
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chatty_room_never_keeps_her_from_her_operator() {
    let scene = Scene::new("live-chatty", Limits::Relaxed).await;
    // Her default turn rules; an inbox that 60 waiting lines would fill three times over.
    let (mock, room, config, gw) = vera_live(
        &scene,
        "lv-chatty",
        Duration::ZERO,
        "\n[persona.limits]\nmax_pending = 30\n",
    )
    .await;
    drop(gw);
    add_metrics(&config, "127.0.0.1:0");
    let gw = GatewayProcess::start(&config);
    let bob = member(&scene, "bob", "#lv-chatty:localhost").await;
    let _ = room;

    let mut regret = None;
    for i in 1..=60 {
        let sent = bob
            .send(chat(&format!("chatter {i:03} about lunch")))
            .await
            .unwrap();
        if i == 59 {
            regret = Some(sent.response.event_id);
        }
    }
    // The lines reach her inbox and, past the room's bound, are retired into context.
    let deadline = Instant::now() + Duration::from_secs(60);
    while metric(&gw, "mail_retired_total") < 40.0 {
        assert!(
            Instant::now() < deadline,
            "her waiting mail was never bounded; retired {}\nlog:\n{}",
            metric(&gw, "mail_retired_total"),
            gw.log()
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    assert!(
        turns_since(&mock, 0).is_empty(),
        "lines meant for no one started a turn"
    );

    // Her operator opens a DM and speaks: she joins and answers in one turn.
    let before = mock.ledger().len();
    let dm = open_dm(&scene.ann, &gw).await;
    dm.send(chat("Vera, are you there?")).await.unwrap();
    until_said(
        &scene,
        &dm,
        "ann, you said \"Vera, are you there?\"",
        90,
        &gw,
    )
    .await;
    let turns = turns_since(&mock, before);
    assert_eq!(
        turns.len(),
        1,
        "her operator's DM took more than one turn: {:#?}",
        turns.iter().map(|t| &t.last_user_text).collect::<Vec<_>>()
    );
    assert!(turns[0].last_user_text.contains("Vera, are you there?"));

    // Bob deletes one of his waiting lines: it is dropped from her mail.
    bob.redact(&regret.expect("line 59"), None, None)
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_secs(2)).await;
    // Back in the room her operator asks her: the room's newest lines reach that turn, the
    // oldest were retired past what she is shown.
    let before = mock.ledger().len();
    let lobby = scene
        .ann
        .get_room(bob.room_id())
        .expect("ann is in the room");
    lobby
        .send(chat("Vera, what is bob on about?"))
        .await
        .unwrap();
    let got = wait_for_reply(
        &scene.ann,
        &lobby,
        &format!(
            "ann, you said \"Vera, what is bob on about?\": heard, and answered here in {}.",
            lobby.room_id()
        ),
        Duration::from_secs(90),
    )
    .await;
    let turns = turns_since(&mock, before);
    assert_eq!(turns.len(), 1, "one question, one turn: {got:?}");
    let text = &turns[0].user_text;
    for newest in ["chatter 060", "chatter 045"] {
        assert!(
            text.contains(newest),
            "{newest} is not in her turn:\n{text}"
        );
    }
    assert!(
        !text.contains("chatter 001"),
        "the oldest line was not retired:\n{text}"
    );
    assert!(
        !text.contains("chatter 059")
            && !text.contains("(@bob:localhost): (this message was deleted)"),
        "a deleted line reached her as mail:\n{text}"
    );
    let status: serde_json::Value = serde_json::from_slice(
        &std::fs::read(scene.dir.join("state/personas/vera/status.json")).unwrap(),
    )
    .unwrap();
    assert!(
        status["retired_lines"].as_u64().unwrap_or(0) >= 40,
        "{status}"
    );
    let out = tests::matrix::run_cli(&["status"], &config);
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(
        table.contains("holds back:") && table.contains("retired into her rooms' context"),
        "{table}"
    );
}

/// Mail through `after` for vera: a page of at most 100.
async fn page(c: &mut Client, key: &str, after: u64) -> PendingPage {
    c.request(
        ids::PENDING_REQUEST,
        key,
        &PendingRequest {
            persona: "vera".into(),
            after_seq: after,
            limit: Some(100),
            reply_bytes: None,
        },
    )
    .await
    .expect("a page")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_inbox_still_takes_her_operators_dm() {
    let scene = Scene::new("live-full", Limits::Relaxed).await;
    let organ = SigningKey::from_bytes(&[21; 32]);
    let extra = format!(
        "\n[persona.limits]\nmax_pending = 10\n{}",
        client_block("organ", &organ, &["vera"], &["pending", "ack", "status"])
    );
    // Mouth-only: her mail waits for a CultNet client's ack.
    let (lobby, config, gw) =
        vera_live_in(&scene, "lv-full", "", &["@ann:localhost"], &extra).await;
    drop(gw);
    add_metrics(&config, "127.0.0.1:0");
    let gw = GatewayProcess::start(&config);
    let bob = member(&scene, "bob", "#lv-full:localhost").await;
    let _ = lobby;
    let mut c = Client::connect(gw.cultnet_addr(), "organ", &organ, Duration::from_secs(30))
        .await
        .unwrap();

    // Bob fills her inbox, one line per sync, past what it may hold.
    for i in 1..=12 {
        bob.send(chat(&format!("filler {i:02}"))).await.unwrap();
        tokio::time::sleep(Duration::from_millis(150)).await;
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let p = page(
            &mut c,
            &format!("fill{}", deadline.elapsed().as_millis()),
            0,
        )
        .await;
        if p.pending_count >= 10 {
            break;
        }
        assert!(Instant::now() < deadline, "her inbox never filled: {p:?}");
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    // Held: more of bob's lines stay on the homeserver.
    for i in 13..=15 {
        bob.send(chat(&format!("filler {i:02}"))).await.unwrap();
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(metric(&gw, "sync_held_back") > 0.0 || gw.log().contains("her inbox is full"));
    // Her status says she holds back, and why.
    let st: wire::docs::GatewayStatus = c
        .request(
            ids::STATUS_REQUEST,
            "status-full",
            &wire::docs::StatusRequest {
                persona: Some("vera".into()),
            },
        )
        .await
        .unwrap();
    let vera = &st.personas[0];
    assert_eq!(vera.sync_state, "held", "{vera:?}");
    assert!(
        vera.last_error
            .as_deref()
            .is_some_and(|e| e.contains("her inbox is full")),
        "{vera:?}"
    );

    // Her operator's DM: joined, and his line stored though her inbox is full.
    let dm = open_dm(&scene.ann, &gw).await;
    dm.send(chat("Vera, the deploy is at noon")).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    let p = loop {
        let p = page(&mut c, &format!("dm{}", deadline.elapsed().as_millis()), 0).await;
        if p.deliveries
            .iter()
            .any(|d| d.text == "Vera, the deploy is at noon")
        {
            break p;
        }
        assert!(
            Instant::now() < deadline,
            "her operator's DM never reached her full inbox: {p:?}\nlog:\n{}",
            gw.log()
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    };
    assert!(
        !p.deliveries.iter().any(|d| d.text == "filler 15"),
        "her rooms were not held back while her inbox was full"
    );

    // Acks free room: the room's lines held on the homeserver come, once each.
    let ack: AckReceipt = c
        .request(
            ids::ACK_REQUEST,
            "ack1",
            &AckRequest {
                persona: "vera".into(),
                through_seq: p.through_seq,
            },
        )
        .await
        .unwrap();
    assert_eq!(ack.pending_count, 0, "{ack:?}");
    let deadline = Instant::now() + Duration::from_secs(60);
    let rest = loop {
        let p = page(
            &mut c,
            &format!("rest{}", deadline.elapsed().as_millis()),
            p.through_seq,
        )
        .await;
        if p.deliveries.iter().any(|d| d.text == "filler 15") {
            break p;
        }
        assert!(
            Instant::now() < deadline,
            "the held lines never came: {p:?}\nlog:\n{}",
            gw.log()
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    };
    let texts: Vec<&str> = rest.deliveries.iter().map(|d| d.text.as_str()).collect();
    assert_eq!(
        texts
            .iter()
            .filter(|t| **t == "Vera, the deploy is at noon")
            .count(),
        0,
        "her operator's DM came twice: {texts:?}"
    );
    for i in 13..=15 {
        let line = format!("filler {i:02}");
        assert_eq!(
            texts.iter().filter(|t| **t == line).count(),
            1,
            "{line}: {texts:?}"
        );
    }
    c.close().await;
}

/// The CLI runs the API refused: the pinned CLI sends a refused request once more at once
/// (fixtures/claude-cli-2.1.332/README.md), so refusals within a second are one run.
fn refused_runs(mock: &MockApi) -> usize {
    let mut runs = 0;
    let mut last = f64::NEG_INFINITY;
    for e in mock.ledger().iter().filter(|e| e.status == 400) {
        if e.at - last > 1.0 {
            runs += 1;
        }
        last = e.at;
    }
    runs
}

/// Waits (up to two minutes) until her set-aside batches, as the `session status` verb lists
/// them, are as `done` wants; that list.
async fn until_set_aside(
    c: &mut Client,
    gw: &GatewayProcess,
    done: impl Fn(&[SetAsideBatch]) -> bool,
) -> Vec<SetAsideBatch> {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let key = format!("st{}", deadline.elapsed().as_nanos());
        let r = control(c, &key, ControlAction::Status, None, None).await;
        if done(&r.set_aside) {
            return r.set_aside;
        }
        assert!(
            Instant::now() < deadline,
            "her set-aside batches never came to be as wanted: {r:?}\nlog:\n{}",
            gw.log()
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_the_api_refuses_is_tried_degraded_once_then_set_aside_and_mail_flows() {
    let scene = Scene::new("live-refused", Limits::Relaxed).await;
    let ops = SigningKey::from_bytes(&[22; 32]);
    let (mock, lobby, _config, gw) = vera_live(
        &scene,
        "lv-refused",
        Duration::ZERO,
        &client_block("ops", &ops, &["vera"], &["session", "status"]),
    )
    .await;
    let mut c = Client::connect(gw.cultnet_addr(), "ops", &ops, Duration::from_secs(30))
        .await
        .unwrap();

    // A line the API will not take, whatever is retried.
    mock.refuse("UNTAKEABLE");
    lobby
        .send(chat("Vera, look at this: UNTAKEABLE"))
        .await
        .unwrap();
    let aside = until_set_aside(&mut c, &gw, |l| !l.is_empty()).await;
    let runs = refused_runs(&mock);
    assert_eq!(
        runs,
        2,
        "refused once whole, once degraded, then no more\nlog:\n{}",
        gw.log()
    );
    assert_eq!(aside[0].messages, 1, "{aside:?}");
    let requests = mock.ledger().len();

    // Her operator's next line is answered, and she is told what was set aside.
    let dm = open_dm(&scene.ann, &gw).await;
    dm.send(chat("Vera, are you there?")).await.unwrap();
    until_said(
        &scene,
        &dm,
        "ann, you said \"Vera, are you there?\"",
        90,
        &gw,
    )
    .await;
    let turns = turns_since(&mock, requests);
    assert_eq!(turns.len(), 1, "one turn for his DM");
    assert!(
        turns[0]
            .last_user_text
            .contains("were set aside unanswered"),
        "she was not told: {}",
        turns[0].last_user_text
    );
    assert!(
        !turns[0].user_text.contains("UNTAKEABLE"),
        "the refused line is in her session still"
    );

    // Retried, it is refused again and set aside again (under its new id); dropped, it is gone.
    let r = control(
        &mut c,
        "retry",
        ControlAction::Retry,
        None,
        Some(aside[0].batch),
    )
    .await;
    assert_eq!(r.status, Status::Ok, "{r:?}");
    let first = aside[0].batch;
    let again = until_set_aside(&mut c, &gw, |l| l.iter().any(|a| a.batch != first)).await;
    assert_eq!(again.len(), 1, "{again:?}");
    assert_eq!(
        refused_runs(&mock),
        4,
        "the retry was tried whole and degraded, no more"
    );
    let r = control(
        &mut c,
        "drop",
        ControlAction::Drop,
        None,
        Some(again[0].batch),
    )
    .await;
    assert_eq!((r.status, r.set_aside.len()), (Status::Ok, 0), "{r:?}");
    let r = control(
        &mut c,
        "drop2",
        ControlAction::Drop,
        None,
        Some(again[0].batch),
    )
    .await;
    assert_eq!(r.status, Status::Rejected, "{r:?}");
    c.close().await;
}

/// Her status file.
fn status_file(scene: &Scene) -> serde_json::Value {
    serde_json::from_slice(
        &std::fs::read(scene.dir.join("state/personas/vera/status.json")).unwrap_or_default(),
    )
    .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_lines_meant_for_no_one_cost_her_neither_dollars_nor_her_conversation() {
    let scene = Scene::new("live-long", Limits::Relaxed).await;
    let (mock, lobby, _config, gw) = vera_live(&scene, "lv-long", Duration::ZERO, "").await;
    let bob = member(&scene, "bob", "#lv-long:localhost").await;
    let answer = |q: &str| {
        format!(
            "ann, you said \"{q}\": heard, and answered here in {}.",
            lobby.room_id()
        )
    };
    lobby.send(chat("Vera, good morning")).await.unwrap();
    let got = wait_for_reply(
        &scene.ann,
        &lobby,
        &answer("Vera, good morning"),
        Duration::from_secs(90),
    )
    .await;
    assert!(
        got.contains(&answer("Vera, good morning")),
        "{got:?}\nlog:\n{}",
        gw.log()
    );
    let first = status_file(&scene);
    let session_id = first["session_id"].as_str().expect("a session").to_owned();
    let before = mock.ledger().len();
    let first_prompt = mock.ledger().last().map_or(0, |e| e.prompt_tokens);

    // Twenty lines of 60 KiB meant for no one (300,000 tokens by the mock's count: more than
    // her window), then her operator asks.
    for i in 1..=20 {
        let line = format!("{i:02} {}", "blah ".repeat(60 * 1024 / 5));
        bob.send(chat(&line)).await.unwrap();
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    lobby.send(chat("Vera, anything new?")).await.unwrap();
    let got = wait_for_reply(
        &scene.ann,
        &lobby,
        &answer("Vera, anything new?"),
        Duration::from_secs(120),
    )
    .await;
    assert!(
        got.contains(&answer("Vera, anything new?")),
        "{got:?}\nlog:\n{}",
        gw.log()
    );

    let after = &mock.ledger()[before..];
    assert!(
        after.iter().all(|e| !e.is_summary() && e.status == 200),
        "a compaction or a refusal: {:?}",
        after
            .iter()
            .map(|e| (e.status, e.is_summary()))
            .collect::<Vec<_>>()
    );
    let now = status_file(&scene);
    assert_eq!(
        now["session_id"].as_str(),
        Some(session_id.as_str()),
        "her session changed"
    );
    assert_eq!(now["generation"], first["generation"], "a fresh start");
    assert_eq!(now["compactions"].as_u64().unwrap_or(0), 0);
    // What the turn added to her prompt: within what one room's waiting mail may show.
    let turn = after.last().expect("her turn");
    let added = turn.prompt_tokens.saturating_sub(first_prompt);
    assert!(
        added < 12_000,
        "her turn added {added} tokens of prompt (billed input {} uncached, {} written)",
        turn.usage.input,
        turn.usage.cache_write_5m + turn.usage.cache_write_1h
    );
    assert!(
        turn.last_user_text.contains("it was not meant for you"),
        "{}",
        &turn.last_user_text[..turn.last_user_text.len().min(2000)]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_naming_her_in_a_thread_of_his_choosing_does_not_steer_her_answer_to_her_operator()
{
    let scene = Scene::new("live-steer", Limits::Relaxed).await;
    // Her first turn takes a while: what is said meanwhile waits for the next one.
    let (mock, lobby, _config, gw) =
        vera_live(&scene, "lv-steer", Duration::from_secs(4), "").await;
    let bob = member(&scene, "bob", "#lv-steer:localhost").await;
    let root = bob
        .send(chat("my own little thread"))
        .await
        .unwrap()
        .response
        .event_id
        .to_string();
    let answered = |q: &str| {
        format!(
            "ann, you said \"{q}\": heard, and answered here in {}.",
            lobby.room_id()
        )
    };
    lobby.send(chat("Vera, first question?")).await.unwrap();
    // Her first turn is under way when the two lines come.
    let deadline = Instant::now() + Duration::from_secs(60);
    while mock.ledger().is_empty() {
        assert!(Instant::now() < deadline, "no turn\nlog:\n{}", gw.log());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    lobby.send(chat("Vera, second question?")).await.unwrap();
    bob.send_raw(
        "m.room.message",
        serde_json::json!({"msgtype": "m.text", "body": "vera, over here",
            "m.relates_to": {"rel_type": "m.thread", "event_id": root, "is_falling_back": true,
                             "m.in_reply_to": {"event_id": root}}}),
    )
    .await
    .unwrap();
    let got = wait_for_reply(
        &scene.ann,
        &lobby,
        &answered("Vera, second question?"),
        Duration::from_secs(120),
    )
    .await;
    assert!(
        got.contains(&answered("Vera, second question?")),
        "{got:?}\nlog:\n{}",
        gw.log()
    );
    // Both lines came in one turn, and her answer to her operator is in the main timeline.
    let turns = turns_since(&mock, 0);
    let both = turns
        .iter()
        .find(|t| t.last_user_text.contains("Vera, second question?"))
        .expect("the turn");
    assert!(
        both.last_user_text.contains("vera, over here"),
        "{}",
        both.last_user_text
    );
    let hers = tests::live::contents_by(&scene.ann, &lobby, "@vera:localhost").await;
    let to_ann = hers
        .iter()
        .find(|c| c["body"] == answered("Vera, second question?"))
        .expect("her answer");
    assert!(
        to_ann["m.relates_to"]["rel_type"] != "m.thread",
        "her answer to her operator went into the member's thread: {to_ann}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operators_dm_written_before_her_device_existed_reaches_her_at_once() {
    let scene = Scene::new("live-predates", Limits::Relaxed).await;
    let mock = MockApi::start(MockConfig {
        responder: true,
        ..MockConfig::default()
    })
    .await
    .unwrap();
    let (session, _) = live_section(&scene.dir, &mock, 2000, "");
    // Her defaults: an undecryptable line is held ten minutes, but not this one.
    let config = tests::live::operated(&scene, &with_turns(&session, ""));
    let vera: matrix_sdk::ruma::OwnedUserId = "@vera:localhost".try_into().unwrap();
    let dm = scene.ann.create_dm(&vera).await.unwrap();
    dm.send(chat("Vera, did you get the keys?")).await.unwrap();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let started = Instant::now();
    let gw = GatewayProcess::start(&config);
    // Far within the ten minutes such a line is otherwise held.
    let deadline = Instant::now() + Duration::from_secs(120);
    let got = loop {
        let got = tests::live::from_vera(&scene.ann, &dm).await;
        if !got.is_empty() {
            break got;
        }
        assert!(
            Instant::now() < deadline,
            "her operator's early DM never reached her\nlog:\n{}",
            gw.log()
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    };
    assert!(
        got[0].contains("(this message could not be decrypted)"),
        "{got:?}"
    );
    assert!(started.elapsed() < Duration::from_secs(120));
    assert!(
        gw.log().contains("written before her device existed"),
        "the log does not say why:\n{}",
        gw.log()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_invite_to_her_operators_room_sent_by_a_stranger_is_not_joined() {
    use matrix_sdk::ruma::api::client::room::create_room::v3::{Request, RoomPreset};
    let scene = Scene::new("live-invite", Limits::Relaxed).await;
    // Mouth-only is enough: joining is the ear's.
    let config = tests::live::operated(&scene, "");
    let gw = GatewayProcess::start(&config);
    scene.hs.register("eve", "eve-pw");
    let eve = user_client(&scene.url, "eve", "eve-pw", &scene.dir.join("eve")).await;
    // Her operator's room (its creation and state are his), which a stranger may invite to.
    let mut req = Request::new();
    req.preset = Some(RoomPreset::PublicChat);
    req.name = Some("ann's office".into());
    // Anyone in it may invite.
    req.power_level_content_override = Some(matrix_sdk::ruma::serde::Raw::from_json(
        serde_json::value::to_raw_value(&serde_json::json!({"invite": 0})).unwrap(),
    ));
    let office = scene.ann.create_room(req).await.unwrap();
    eve.join_room_by_id(office.room_id()).await.unwrap();
    let office_as_eve = eve.get_room(office.room_id()).expect("eve is in it");
    let vera: matrix_sdk::ruma::OwnedUserId = "@vera:localhost".try_into().unwrap();
    office_as_eve.invite_user_by_id(&vera).await.unwrap();
    // And her operator's own invite, after it: joined.
    let dm = open_dm(&scene.ann, &gw).await;
    let _ = dm;
    gw.wait_log(
        "invite from a non-operator ignored",
        Duration::from_secs(30),
    );
    assert!(
        !tests::matrix::has_joined(&scene.ann, &office, &vera).await,
        "she joined a room a stranger invited her to\nlog:\n{}",
        gw.log()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn her_budget_spent_by_a_members_mentions_leaves_her_operators_reserve_and_one_notice() {
    let scene = Scene::new("live-reserve", Limits::Relaxed).await;
    // Her first turn (her doctrine written to the cache for an hour) costs about $0.046, later
    // ones about $0.004: a cap of $0.10 with half of it kept for her operators.
    let (_mock, lobby, _config, gw) = vera_live(
        &scene,
        "lv-reserve",
        Duration::ZERO,
        "\n[persona.budget]\nusd_per_day = 0.10\noperator_reserve = 0.5\n",
    )
    .await;
    let bob = member(&scene, "bob", "#lv-reserve:localhost").await;
    let dm = open_dm(&scene.ann, &gw).await;
    dm.send(chat("Vera, good morning")).await.unwrap();
    until_said(&scene, &dm, "ann, you said \"Vera, good morning\"", 90, &gw).await;

    // Bob's mentions spend the public share.
    let mut spent_by_bob = 0;
    for i in 1..=5 {
        let q = format!("vera, question {i} from bob");
        bob.send(chat(&q)).await.unwrap();
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut answered = false;
        while Instant::now() < deadline {
            let got = tests::live::from_vera(&scene.ann, &lobby).await;
            if got.iter().any(|b| b.contains(&q)) {
                answered = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
        if !answered {
            break;
        }
        spent_by_bob += 1;
    }
    assert!(
        (1..5).contains(&spent_by_bob),
        "the public share should end within bob's five questions, after {spent_by_bob}\nlog:\n{}",
        gw.log()
    );
    // Her operator is answered from the reserve; he was told once.
    dm.send(chat("Vera, still there?")).await.unwrap();
    let got = until_said(&scene, &dm, "ann, you said \"Vera, still there?\"", 90, &gw).await;
    let notices: Vec<&String> = got.iter().filter(|b| b.contains("daily budget")).collect();
    assert_eq!(notices.len(), 1, "{got:?}");
    assert!(
        notices[0].contains("usd_per_day") && notices[0].contains("from the reserve"),
        "{}",
        notices[0]
    );
    dm.send(chat("Vera, and now?")).await.unwrap();
    let got = until_said(&scene, &dm, "ann, you said \"Vera, and now?\"", 90, &gw).await;
    assert_eq!(
        got.iter().filter(|b| b.contains("daily budget")).count(),
        1,
        "told more than once: {got:?}"
    );
    // Bob still waits.
    let q = "vera, are you ignoring me?";
    bob.send(chat(q)).await.unwrap();
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert!(
        !tests::live::from_vera(&scene.ann, &lobby)
            .await
            .iter()
            .any(|b| b.contains(q)),
        "a member was answered past the public share"
    );
}
