//! Her Minds and her live session, end to end (`cultnet-gateway run`, a real Synapse, the real
//! claude CLI against the mock Messages API, CultNet clients over loopback):
//! - a `state` note lands in her next request after the header, not in the system prompt, with
//!   the prompt still read from cache; notes survive `kill -9`; repeats are shown once; an
//!   oversized note is refused; replacing kinds keep only the latest; a reset during a turn
//!   waits for it, and the fresh session starts from the latest notes; the old session resumes;
//! - the restart note is in the first request after a restart and not in the next;
//! - a reply's extension field reaches a client once across `kill -9`, a bad one is corrected;
//!   a waking note gets a turn of its own; a model switch survives a restart; compact shrinks;
//! - a turn refused as too long compacts first (also as the first thing after a restart of the
//!   gateway, billed as the API billed it), then starts fresh;
//! - a reply naming a room not hers sends nothing, and her next batch carries the correction,
//!   across a restart of the gateway; a say the homeserver refuses is named in her next batch;
//! - a batch no session can hold is split, and a message too long alone is cut, saying so; a
//!   refused batch the compaction kept verbatim is retried as a note, not sent twice;
//! - a gap ends when her mail was said, not when a restarted gateway got to it.

use std::time::{Duration, Instant};

use ed25519_dalek::SigningKey;
use gateway::client::Client;
use matrix_sdk::ruma::events::room::message::RoomMessageEventContent;
use serde_json::json;
use session::render::NOTES_LABEL;
use tests::live::{from_vera, live_section, wait_for_reply};
use tests::matrix::{public_room, write_config, GatewayProcess, Scene};
use tests::mock_api::{Fault, LedgerEntry, MockApi, MockConfig};
use tests::synapse::Limits;
use wire::docs::{
    ids, ControlAction, ExtensionAckReceipt, ExtensionAckRequest, ExtensionPage,
    ExtensionPendingRequest, NoteReceipt, NoteRequest, Status,
};

fn note(id: &str, kind: &str, text: &str) -> NoteRequest {
    NoteRequest {
        persona: "vera".into(),
        note_id: id.into(),
        kind: kind.into(),
        text: text.into(),
        wake: false,
    }
}

async fn put_note(c: &mut Client, n: &NoteRequest) -> NoteReceipt {
    c.request(ids::NOTE_REQUEST, &format!("note-{}", n.note_id), n)
        .await
        .unwrap()
}

/// A client line for the config: one of vera's.
fn client_block(agent: &str, key: &SigningKey, verbs: &[&str]) -> String {
    tests::live::client_block(agent, key, &["vera"], verbs)
}

/// Her status file.
fn status(dir: &std::path::Path) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(dir.join("state/personas/vera/status.json")).unwrap())
        .unwrap()
}

/// Waits until the mock has answered `n` more successful requests than `from`; those entries.
async fn answered_since(
    mock: &MockApi,
    from: usize,
    n: usize,
    gw: Option<&GatewayProcess>,
) -> Vec<LedgerEntry> {
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        let got: Vec<LedgerEntry> = mock.ledger()[from..]
            .iter()
            .filter(|e| e.status == 200)
            .cloned()
            .collect();
        if got.len() >= n {
            return got;
        }
        assert!(
            Instant::now() < deadline,
            "{} of {n} requests; log:\n{}",
            got.len(),
            gw.map(GatewayProcess::log).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Waits until her status file counts `n` turns.
async fn turns_total(dir: &std::path::Path, n: u64, gw: &GatewayProcess) {
    let deadline = Instant::now() + Duration::from_secs(90);
    while std::fs::read(dir.join("state/personas/vera/status.json"))
        .ok()
        .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
        .and_then(|v| v["turns_total"].as_u64())
        .unwrap_or(0)
        < n
    {
        assert!(
            Instant::now() < deadline,
            "turn {n} did not happen; log:\n{}",
            gw.log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn notes_reach_her_next_batch_and_a_reset_starts_from_the_latest() {
    let scene = Scene::new("minds-notes", Limits::Relaxed).await;
    let (url, ann, dir) = (scene.url.clone(), &scene.ann, scene.dir.clone());
    let lobby = public_room(ann, "mn-lobby").await;
    let room = lobby.room_id().to_string();
    let mock = MockApi::start(MockConfig::default()).await.unwrap();
    let (session, prompt) = live_section(&dir, &mock, 3000, "");
    // One turn per line this test sends: not the rules users get.
    let session = tests::live::every_line(&session);
    let mind = SigningKey::from_bytes(&[11; 32]);
    let config = write_config(
        &dir,
        &url,
        &scene.vera_token,
        &["#mn-lobby:localhost"],
        &[],
        &format!(
            "{session}{}",
            client_block("mind", &mind, &["note", "session"])
        ),
    );
    let gw = GatewayProcess::start(&config);
    let say = |text: &str| json!({"say": [{"room": room, "text": text}]});
    let chat = |text: &str| RoomMessageEventContent::text_plain(text);

    mock.script(say("hi all"));
    lobby.send(chat("hello vera")).await.unwrap();
    wait_for_reply(ann, &lobby, "hi all", Duration::from_secs(90)).await;
    turns_total(&dir, 1, &gw).await;

    // A state note, its repeat, and one too big; then the gateway dies before she sees it.
    let mut c = Client::connect(gw.cultnet_addr(), "mind", &mind, Duration::from_secs(30))
        .await
        .unwrap();
    let r = put_note(&mut c, &note("s1", "state", "mood: calm")).await;
    assert_eq!(
        (r.status, r.duplicate, r.pending_notes),
        (Status::Ok, false, 1),
        "{r:?}"
    );
    let r = put_note(&mut c, &note("s1", "state", "mood: calm")).await;
    assert_eq!(
        (r.status, r.duplicate, r.pending_notes),
        (Status::Ok, true, 1),
        "{r:?}"
    );
    let big = put_note(&mut c, &note("big", "state", &"x".repeat(20_000))).await;
    assert_eq!(big.status, Status::Rejected);
    assert!(
        big.error
            .as_deref()
            .unwrap_or_default()
            .contains("20000 bytes"),
        "{big:?}"
    );
    c.close().await;
    gw.kill9();

    let gw = GatewayProcess::start(&config);
    let from = mock.ledger().len();
    mock.script(say("second answer"));
    lobby.send(chat("second")).await.unwrap();
    wait_for_reply(ann, &lobby, "second answer", Duration::from_secs(90)).await;
    let e = answered_since(&mock, from, 1, Some(&gw)).await.remove(0);
    let lines: Vec<&str> = e.last_user_text.lines().collect();
    assert!(
        lines[0].starts_with("[cultnet batch "),
        "{}",
        e.last_user_text
    );
    assert_eq!(lines[1], NOTES_LABEL, "{}", e.last_user_text);
    assert!(
        lines
            .iter()
            .any(|l| l.starts_with("[restart] the gateway was restarted")
                && l.contains("your session was resumed")),
        "{}",
        e.last_user_text
    );
    assert_eq!(
        e.last_user_text.matches("[state] mood: calm").count(),
        1,
        "{}",
        e.last_user_text
    );
    assert!(!e.system_text.contains("mood: calm"));
    assert!(e.system_text.contains("You are Vera."));
    let hit = e.usage.cache_read as f64 / e.prompt_tokens as f64;
    assert!(hit >= 0.95, "only {hit:.3} of the prompt from cache: {e:?}");
    println!(
        "state note turn: {:.1}% of {} prompt tokens from cache",
        hit * 100.0,
        e.prompt_tokens
    );

    // The next request carries neither the restart note nor the note already shown.
    let from = mock.ledger().len();
    mock.script(say("third answer"));
    lobby.send(chat("third")).await.unwrap();
    wait_for_reply(ann, &lobby, "third answer", Duration::from_secs(90)).await;
    let e = answered_since(&mock, from, 1, Some(&gw)).await.remove(0);
    assert!(
        !e.last_user_text.contains(NOTES_LABEL),
        "{}",
        e.last_user_text
    );
    assert!(!e.last_user_text.contains("mood: calm"));
    // Her own reply is never shown back to her as context: she said it in this session.
    assert!(
        !e.last_user_text.contains("second answer"),
        "{}",
        e.last_user_text
    );

    // Replacing kinds: a waiting campaigns note is replaced by the next one.
    let mut c = Client::connect(gw.cultnet_addr(), "mind", &mind, Duration::from_secs(30))
        .await
        .unwrap();
    put_note(&mut c, &note("s2", "state", "mood: tired")).await;
    put_note(&mut c, &note("c1", "campaigns", "spring sale")).await;
    let r = put_note(&mut c, &note("c2", "campaigns", "summer sale")).await;
    assert_eq!(
        r.pending_notes, 2,
        "the spring note was not replaced: {r:?}"
    );
    put_note(&mut c, &note("h1", "heads-up", "ops call at nine")).await;
    let from = mock.ledger().len();
    mock.script(say("fourth answer"));
    lobby.send(chat("fourth")).await.unwrap();
    wait_for_reply(ann, &lobby, "fourth answer", Duration::from_secs(90)).await;
    let e = answered_since(&mock, from, 1, Some(&gw)).await.remove(0);
    for want in [
        "[state] mood: tired",
        "[campaigns] summer sale",
        "[heads-up] ops call at nine",
    ] {
        assert!(
            e.last_user_text.contains(want),
            "{want}: {}",
            e.last_user_text
        );
    }
    assert!(!e.user_text.contains("spring sale"));

    // A reset sent while a turn runs waits for its end.
    turns_total(&dir, 4, &gw).await;
    let old = status(&dir)["session_id"].as_str().unwrap().to_owned();
    mock.inject(Fault::Delay(Duration::from_secs(4)));
    mock.script(say("fifth answer"));
    let from = mock.ledger().len();
    lobby.send(chat("fifth")).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while mock.ledger().len() == from {
        assert!(Instant::now() < deadline, "the turn never reached the API");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let reset = tests::live::control(&mut c, "reset-1", ControlAction::Reset, None, None).await;
    let said = from_vera(ann, &lobby).await;
    assert!(
        said.iter().any(|b| b == "fifth answer"),
        "the reset was answered before the turn in flight ended: {said:?}"
    );
    assert_eq!(reset.status, Status::Ok, "{reset:?}");
    assert_eq!(reset.previous_session_id.as_deref(), Some(old.as_str()));
    assert_eq!(reset.session_id, None);
    assert_eq!(reset.generation, 1);

    // The fresh session starts from the latest of each replacing kind and the recent lines.
    let from = mock.ledger().len();
    mock.script(say("sixth answer"));
    lobby.send(chat("sixth")).await.unwrap();
    wait_for_reply(ann, &lobby, "sixth answer", Duration::from_secs(90)).await;
    turns_total(&dir, 6, &gw).await;
    let e = answered_since(&mock, from, 1, Some(&gw)).await.remove(0);
    let new = status(&dir)["session_id"].as_str().unwrap().to_owned();
    assert_ne!(new, old);
    assert!(e.user_text.contains("## your latest notes (before this session)\n[state] mood: tired\n[campaigns] summer sale\n"), "{}", e.user_text);
    // The lobby's earlier lines, hers too, reach the new session once each: as the batch's
    // context, which the recent lines then leave out.
    for line in [
        "hello vera",
        ": hi all\n",
        ": third answer\n",
        ": fifth answer\n",
    ] {
        assert_eq!(
            e.user_text.matches(line).count(),
            1,
            "{line:?}: {}",
            e.user_text
        );
    }
    for gone in ["mood: calm", "spring sale", "ops call at nine"] {
        assert!(
            !e.user_text.contains(gone),
            "{gone:?} came back: {}",
            e.user_text
        );
    }
    let st = tests::live::control(&mut c, "status-1", ControlAction::Status, None, None).await;
    assert_eq!(st.session_id.as_deref(), Some(new.as_str()));
    c.close().await;
    assert!(gw.stop().success());

    // The old session can still be resumed by its id.
    let state = dir.join("state/personas/vera");
    let cfg = session::driver::CliConfig {
        exe: tests::claude_cli::executable(),
        model: "claude-sonnet-4-6".into(),
        system_prompt_file: prompt,
        json_schema: session::render::reply_schema(),
        config_dir: state.join("claude"),
        work_dir: state.join("work"),
        api_base_url: mock.url(),
        credential: session::driver::Credential::ApiKey("mock-key".into()),
        cache_ttl: session::cost::Ttl::OneHour,
        thinking: false,
        session_id: Some(old.clone()),
        resume: true,
        system_prompt_changed: false,
        max_retries: Some(2),
        turn_timeout: Duration::from_secs(60),
        grace: Duration::from_secs(10),
    };
    let from = mock.ledger().len();
    let mut cli = session::driver::Cli::spawn(cfg).await.unwrap();
    let t = cli
        .turn("[cultnet batch 99-99: 1 new message(s)]\n[99] ann: still there?")
        .await
        .unwrap();
    assert!(!t.result.is_error, "{:?}", t.result);
    assert_eq!(t.result.session_id.as_deref(), Some(old.as_str()));
    let e = answered_since(&mock, from, 1, None).await.remove(0);
    assert!(
        e.user_text.contains("hello vera"),
        "the old conversation is not there"
    );
    cli.shutdown(Duration::from_secs(5)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn extensions_reach_a_client_once_and_session_verbs_hold() {
    let scene = Scene::new("minds-ext", Limits::Relaxed).await;
    let (url, ann, dir) = (scene.url.clone(), &scene.ann, scene.dir.clone());
    let lobby = public_room(ann, "me-lobby").await;
    let room = lobby.room_id().to_string();
    let mock = MockApi::start(MockConfig::default()).await.unwrap();
    let schema = dir.join("reply-schema.json");
    std::fs::write(
        &schema,
        json!({"properties": {"start_self_run": {"type": "object", "required": ["brief"],
            "additionalProperties": false,
            "properties": {"brief": {"type": "string", "maxLength": 1000}}}}})
        .to_string(),
    )
    .unwrap();
    let (session, _) = live_section(
        &dir,
        &mock,
        3000,
        &format!(
            "reply_schema_file = \"{}\"\ncheckpoint_before_compact = true\n",
            schema.display()
        ),
    );
    // One turn per line this test sends: not the rules users get.
    let session = tests::live::every_line(&session);
    let organ = SigningKey::from_bytes(&[12; 32]);
    let ops = SigningKey::from_bytes(&[13; 32]);
    let config = write_config(
        &dir,
        &url,
        &scene.vera_token,
        &["#me-lobby:localhost"],
        &[],
        &format!(
            "{session}{}{}",
            client_block("organ", &organ, &["extensions", "note"]),
            client_block("ops", &ops, &["session"])
        ),
    );
    let gw = GatewayProcess::start(&config);
    let chat = |text: &str| RoomMessageEventContent::text_plain(text);

    // Her reply opens a Self run; the gateway dies before any client pulls it.
    mock.script(json!({"say": [{"room": room, "text": "on it"}], "start_self_run": {"brief": "tidy the wiki"}}));
    lobby
        .send(chat("vera, please tidy the wiki"))
        .await
        .unwrap();
    wait_for_reply(ann, &lobby, "on it", Duration::from_secs(90)).await;
    // The turn is over (its record is written after its commit); nobody has pulled yet.
    turns_total(&dir, 1, &gw).await;
    gw.kill9();
    let gw = GatewayProcess::start(&config);
    let mut c = Client::connect(gw.cultnet_addr(), "organ", &organ, Duration::from_secs(30))
        .await
        .unwrap();
    let pull = ExtensionPendingRequest {
        persona: "vera".into(),
        after_seq: 0,
        limit: None,
    };
    let page: ExtensionPage = c
        .request(ids::EXTENSION_PENDING_REQUEST, "x1", &pull)
        .await
        .unwrap();
    assert_eq!(page.extensions.len(), 1, "{page:?}");
    let ext = &page.extensions[0];
    assert_eq!(ext.field, "start_self_run");
    assert_eq!(ext.value, json!({"brief": "tidy the wiki"}));
    assert!(ext.turn_id.starts_with("turn:vera:"), "{ext:?}");
    let ack: ExtensionAckReceipt = c
        .request(
            ids::EXTENSION_ACK_REQUEST,
            "x2",
            &ExtensionAckRequest {
                persona: "vera".into(),
                through_seq: page.through_seq,
            },
        )
        .await
        .unwrap();
    assert_eq!((ack.status, ack.pending_count), (Status::Ok, 0), "{ack:?}");
    let again: ExtensionPage = c
        .request(ids::EXTENSION_PENDING_REQUEST, "x3", &pull)
        .await
        .unwrap();
    assert!(again.extensions.is_empty(), "{again:?}");

    // A field that breaks its schema is bounced back by the CLI (the same schema) and answered
    // again; only the corrected reply goes out, and only its field is stored.
    let from = mock.ledger().len();
    mock.script(json!({"say": [{"room": room, "text": "never sent"}], "start_self_run": {"brief": "x".repeat(1001)}}));
    mock.script(json!({"say": [{"room": room, "text": "blog later"}], "start_self_run": {"brief": "write the blog"}}));
    lobby.send(chat("and the blog?")).await.unwrap();
    wait_for_reply(ann, &lobby, "blog later", Duration::from_secs(90)).await;
    // Her says go out before the turn's commit stores its fields.
    turns_total(&dir, 2, &gw).await;
    let turn = answered_since(&mock, from, 2, Some(&gw)).await;
    assert!(
        turn[1].user_text.contains("maxLength") || turn[1].user_text.contains("1000"),
        "the CLI did not bounce the bad field: {}",
        turn[1].user_text
    );
    assert!(!from_vera(ann, &lobby)
        .await
        .iter()
        .any(|b| b == "never sent"));
    let page: ExtensionPage = c
        .request(ids::EXTENSION_PENDING_REQUEST, "x4", &pull)
        .await
        .unwrap();
    let briefs: Vec<&serde_json::Value> =
        page.extensions.iter().map(|e| &e.value["brief"]).collect();
    assert_eq!(briefs, [&json!("write the blog")]);
    // A note that wakes her: a turn for it alone.
    let from = mock.ledger().len();
    let mut wake = note("r1", "runs", "run 7 finished: wiki tidy");
    wake.wake = true;
    let r = put_note(&mut c, &wake).await;
    assert_eq!(r.status, Status::Ok, "{r:?}");
    let e = answered_since(&mock, from, 1, Some(&gw)).await.remove(0);
    assert_eq!(
        e.last_user_text,
        format!("[cultnet batch from the gateway] notes only, no new messages\n{NOTES_LABEL}\n[runs] run 7 finished: wiki tidy\n")
    );
    turns_total(&dir, 3, &gw).await;

    // Compact (with a checkpoint turn first) shrinks her prefix; a model switch starts fresh on
    // the new model, and stays.
    mock.script(json!({"say": [{"room": room, "text": "not sent"}], "start_self_run": {"brief": "keep: the wiki plan"}}));
    let from = mock.ledger().len();
    let mut o = Client::connect(gw.cultnet_addr(), "ops", &ops, Duration::from_secs(30))
        .await
        .unwrap();
    let before = status(&dir)["turns"]
        .as_array()
        .unwrap()
        .last()
        .unwrap()
        .clone();
    let prefix_before = before["input_tokens"].as_u64().unwrap()
        + before["cache_read_tokens"].as_u64().unwrap()
        + before["cache_write_tokens"].as_u64().unwrap();
    let compact = tests::live::control(&mut o, "c1", ControlAction::Compact, None, None).await;
    assert_eq!(compact.status, Status::Ok, "{compact:?}");
    let after = compact.prefix_tokens.expect("the prefix after compacting");
    assert!(
        after < prefix_before,
        "compacting did not shrink {prefix_before} (now {after})"
    );
    let checkpoint = answered_since(&mock, from, 2, Some(&gw)).await.remove(0);
    assert!(
        checkpoint
            .last_user_text
            .contains("[checkpoint] your conversation is about to be compacted"),
        "{}",
        checkpoint.last_user_text
    );
    let kept: ExtensionPage = c
        .request(ids::EXTENSION_PENDING_REQUEST, "x5", &pull)
        .await
        .unwrap();
    let last = kept.extensions.last().expect("the checkpoint's field");
    assert!(
        last.turn_id.starts_with("checkpoint:vera:"),
        "{last:?}; log:\n{}",
        gw.log()
    );
    assert_eq!(last.value, json!({"brief": "keep: the wiki plan"}));
    assert!(!from_vera(ann, &lobby).await.iter().any(|b| b == "not sent"));
    c.close().await;
    let switch = tests::live::control(
        &mut o,
        "m1",
        ControlAction::Model,
        Some("claude-opus-4-6"),
        None,
    )
    .await;
    assert_eq!(
        (switch.status, switch.model.as_str()),
        (Status::Ok, "claude-opus-4-6"),
        "{switch:?}"
    );
    assert!(switch.previous_session_id.is_some());
    o.close().await;
    assert!(gw.stop().success());
    let gw = GatewayProcess::start(&config);
    let from = mock.ledger().len();
    mock.script(json!({"say": [{"room": room, "text": "on opus now"}]}));
    lobby.send(chat("which model?")).await.unwrap();
    wait_for_reply(ann, &lobby, "on opus now", Duration::from_secs(90)).await;
    let e = answered_since(&mock, from, 1, Some(&gw)).await.remove(0);
    assert_eq!(e.model, "claude-opus-4-6");
    assert!(
        e.last_user_text.contains("this is a fresh session"),
        "{}",
        e.last_user_text
    );
    let mut o = Client::connect(gw.cultnet_addr(), "ops", &ops, Duration::from_secs(30))
        .await
        .unwrap();
    let st = tests::live::control(&mut o, "s1", ControlAction::Status, None, None).await;
    assert_eq!(st.model, "claude-opus-4-6");
    // An organ may not use operators' verbs.
    let mut c = Client::connect(gw.cultnet_addr(), "organ", &organ, Duration::from_secs(30))
        .await
        .unwrap();
    let refused = tests::live::control(&mut c, "r1", ControlAction::Reset, None, None).await;
    assert_eq!(refused.status, Status::Rejected);
    assert!(refused.error.unwrap_or_default().contains("Session"));
    c.close().await;
    o.close().await;
    assert!(gw.stop().success());
}

/// Bodies `user` said in `room`, waiting (up to 90 s) until `text` is among them.
async fn wait_said(
    reader: &matrix_sdk::Client,
    room: &matrix_sdk::Room,
    user: &str,
    text: &str,
    gw: &GatewayProcess,
) -> Vec<String> {
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        let got = tests::live::said_by(reader, room, user).await;
        if got.iter().any(|b| b == text) {
            return got;
        }
        assert!(
            Instant::now() < deadline,
            "{user} never said {text:?} (said {got:?}); log:\n{}",
            gw.log()
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

/// Vera's line in the CultNet status.
async fn persona_status(c: &mut Client, persona: &str) -> wire::docs::PersonaStatus {
    let s: wire::docs::GatewayStatus = c
        .request(
            ids::STATUS_REQUEST,
            &format!("st-{}", uuid_like()),
            &wire::docs::StatusRequest {
                persona: Some(persona.into()),
            },
        )
        .await
        .unwrap();
    s.personas.into_iter().next().unwrap()
}

fn uuid_like() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_key_holds_her_batch_until_rotated_and_an_oauth_token_stays_hidden() {
    use tests::matrix::{token_for, write_private};
    let scene = Scene::new("minds-cred", Limits::Relaxed).await;
    let (url, ann, dir) = (scene.url.clone(), &scene.ann, scene.dir.clone());
    scene.hs.register("mira", "mira-pw");
    let mira_token = token_for(&url, "mira", "mira-pw", "GW-MIRA").await;
    let lobby = public_room(ann, "mc-lobby").await;
    let room = lobby.room_id().to_string();
    let mock = MockApi::start(MockConfig::default()).await.unwrap();
    const OAUTH: &str = "sk-ant-oat01-mira-subscription-token";
    // Vera's key is refused; Mira's subscription token is accepted.
    mock.accept_keys(&[OAUTH]);
    let files = |name: &str, text: &str| {
        let p = dir.join(name);
        write_private(&p, text);
        p
    };
    let vera_key = files("vera.key", "sk-ant-api03-old-vera-key");
    let mira_oauth = files("mira.oauth", OAUTH);
    for (who, name) in [("vera", "Vera"), ("mira", "Mira")] {
        std::fs::write(
            dir.join(format!("{who}.md")),
            format!("You are {name}. ").repeat(800),
        )
        .unwrap();
    }
    let ops = SigningKey::from_bytes(&[14; 32]);
    let persona = |id: &str, token: &str, cred: &str| {
        let session = tests::live::session_section(&dir.join(format!("{id}.md")), &mock, cred, "");
        // One turn per line this test sends: not the rules users get.
        let session = tests::live::every_line(&session);
        tests::matrix::persona_block(
            &dir,
            id,
            &url,
            token,
            &["#mc-lobby:localhost"],
            &[],
            &session,
        )
    };
    let config = dir.join("gateway.toml");
    std::fs::write(
        &config,
        format!(
            "state_dir = \"{}\"\n[cultnet]\nbind = \"127.0.0.1:0\"\n{}\n{}\n{}",
            dir.join("state").display(),
            tests::live::client_block("ops", &ops, &["*"], &["status"]),
            persona(
                "vera",
                &scene.vera_token,
                &format!("api_key_file = \"{}\"", vera_key.display())
            ),
            persona(
                "mira",
                &mira_token,
                &format!("oauth_token_file = \"{}\"", mira_oauth.display())
            ),
        ),
    )
    .unwrap();
    // Logs as the journal gets them: one JSON object per line.
    let gw = GatewayProcess::start_logging(&config, "json");

    // Mira answers while Vera's key is refused.
    mock.script(json!({"say": [{"room": room, "text": "mira here"}]}));
    lobby
        .send(RoomMessageEventContent::text_plain("hello both"))
        .await
        .unwrap();
    wait_said(ann, &lobby, "@mira:localhost", "mira here", &gw).await;
    let mut c = Client::connect(gw.cultnet_addr(), "ops", &ops, Duration::from_secs(30))
        .await
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    let vera = loop {
        let v = persona_status(&mut c, "vera").await;
        if v.last_error.is_some() {
            break v;
        }
        assert!(
            Instant::now() < deadline,
            "no error in her status; log:\n{}",
            gw.log()
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    };
    assert!(
        vera.last_error
            .as_deref()
            .unwrap_or_default()
            .starts_with("unauthorized"),
        "{vera:?}"
    );
    // "hello both" and Mira's answer wait for her.
    assert_eq!((vera.acked_through, vera.pending_count), (0, 2), "{vera:?}");
    assert_eq!(persona_status(&mut c, "mira").await.pending_count, 0);
    let file: serde_json::Value = serde_json::from_slice(
        &std::fs::read(dir.join("state/personas/vera/status.json")).unwrap(),
    )
    .unwrap();
    assert!(
        file["last_error"]
            .as_str()
            .unwrap_or_default()
            .starts_with("unauthorized"),
        "{file}"
    );
    let refused = mock.ledger().iter().filter(|e| e.status == 401).count();
    assert!(refused >= 1);

    // The key file is rotated: she answers, without a restart.
    write_private(&vera_key, "sk-ant-api03-new-vera-key");
    mock.accept_keys(&[OAUTH, "sk-ant-api03-new-vera-key"]);
    mock.script(json!({"say": [{"room": room, "text": "vera is back"}]}));
    let said = wait_said(ann, &lobby, "@vera:localhost", "vera is back", &gw).await;
    assert_eq!(said, ["vera is back"]);
    // Her says go out before her turn is committed: wait for the commit.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let vera = persona_status(&mut c, "vera").await;
        if (vera.pending_count, vera.last_error.as_deref()) == (0, None) {
            break;
        }
        assert!(Instant::now() < deadline, "still {vera:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(gw.log().matches("gateway running").count(), 1);

    // Mira's token went over a file descriptor: not in her CLI's environment or argv.
    let pids = std::process::Command::new("pgrep")
        .args(["-f", &dir.join("mira.md").display().to_string()])
        .output()
        .unwrap();
    let pids = String::from_utf8_lossy(&pids.stdout).to_string();
    assert!(!pids.trim().is_empty(), "no claude process for mira");
    for pid in pids.split_whitespace() {
        let environ = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
        let argv = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        let environ = String::from_utf8_lossy(&environ);
        assert!(
            !environ.contains(OAUTH) && !environ.contains("mira-subscription"),
            "token in environ"
        );
        assert!(
            environ.contains("CLAUDE_CODE_OAUTH_TOKEN_FILE_DESCRIPTOR=3"),
            "{environ}"
        );
        assert!(
            !String::from_utf8_lossy(&argv).contains("mira-subscription"),
            "token in argv"
        );
    }
    let ledger = mock.ledger();
    let mira_auth: Vec<&str> = ledger
        .iter()
        .filter(|e| e.system_text.contains("You are Mira."))
        .map(|e| e.auth.as_str())
        .collect();
    assert!(
        !mira_auth.is_empty() && mira_auth.iter().all(|a| *a == "bearer"),
        "{mira_auth:?}"
    );
    assert!(ledger
        .iter()
        .filter(|e| e.system_text.contains("You are Vera."))
        .all(|e| e.auth == "api-key"));
    let log = gw.log();
    for line in log.lines() {
        let v: serde_json::Value = serde_json::from_str(line)
            .unwrap_or_else(|e| panic!("a log line is not JSON ({e}): {line}"));
        assert!(
            v["timestamp"].is_string() && v["level"].is_string(),
            "{line}"
        );
    }
    // Turn spans name the Persona and the turn.
    assert!(
        log.lines().any(|l| l.contains("\"turn done\"")
            && l.contains("\"persona\":\"mira\"")
            && l.contains("\"turn\":\"turn:mira:")),
        "no turn span in the JSON log"
    );
    for secret in [
        "old-vera-key",
        "new-vera-key",
        "mira-subscription",
        &scene.vera_token,
        &mira_token,
    ] {
        assert!(!log.contains(secret), "a secret reached the log");
    }
    c.close().await;
    assert!(gw.stop().success());
}

/// Vera live against `mock` (a small doctrine) in `rooms` (alias names and rooms ann made),
/// the gateway started and her joins awaited: her config and the gateway.
async fn vera_in(
    scene: &Scene,
    mock: &MockApi,
    rooms: &[(&str, &matrix_sdk::Room)],
) -> (std::path::PathBuf, GatewayProcess) {
    let (session, _) = live_section(&scene.dir, mock, 800, "");
    // One turn per line this test sends: not the rules users get.
    let session = tests::live::every_line(&session);
    let aliases: Vec<String> = rooms
        .iter()
        .map(|(alias, _)| format!("#{alias}:localhost"))
        .collect();
    let aliases: Vec<&str> = aliases.iter().map(String::as_str).collect();
    let config = write_config(
        &scene.dir,
        &scene.url,
        &scene.vera_token,
        &aliases,
        &[],
        &session,
    );
    let gw = GatewayProcess::start(&config);
    for (_, room) in rooms {
        tests::live::until_joined(&scene.ann, room, "@vera:localhost", &gw).await;
    }
    (config, gw)
}

/// Vera live in a public room `alias` that ann made, against a mock whose model window is
/// 15k tokens (her doctrine and tools take ~3k): the scene, the room, the mock, the gateway.
async fn small_window(
    name: &str,
    alias: &str,
) -> (Scene, matrix_sdk::Room, MockApi, GatewayProcess) {
    let scene = Scene::new(name, Limits::Relaxed).await;
    let lobby = public_room(&scene.ann, alias).await;
    let mock = MockApi::start(MockConfig {
        context_window: 15_000,
        ..MockConfig::default()
    })
    .await
    .unwrap();
    let (_, gw) = vera_in(&scene, &mock, &[(alias, &lobby)]).await;
    (scene, lobby, mock, gw)
}

/// Vera live (a small doctrine, a fresh mock) in a public room `alias` that ann made: the
/// scene, the room, the mock, her config and the gateway, started.
async fn live_in_lobby(
    name: &str,
    alias: &str,
) -> (
    Scene,
    matrix_sdk::Room,
    MockApi,
    std::path::PathBuf,
    GatewayProcess,
) {
    let scene = Scene::new(name, Limits::Relaxed).await;
    let lobby = public_room(&scene.ann, alias).await;
    let mock = MockApi::start(MockConfig::default()).await.unwrap();
    let (config, gw) = vera_in(&scene, &mock, &[(alias, &lobby)]).await;
    (scene, lobby, mock, config, gw)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_turn_refused_as_too_long_compacts_first_then_starts_fresh() {
    let (scene, lobby, mock, config, gw) = live_in_lobby("minds-overflow", "mo-lobby").await;
    let (url, ann, dir) = (scene.url.clone(), &scene.ann, scene.dir.clone());
    let room = lobby.room_id().to_string();
    let chat = |text: &str| RoomMessageEventContent::text_plain(text);
    let say = |text: &str| json!({"say": [{"room": room, "text": text}]});
    mock.script(say("one"));
    lobby.send(chat("first")).await.unwrap();
    wait_for_reply(ann, &lobby, "one", Duration::from_secs(90)).await;
    turns_total(&dir, 1, &gw).await;
    let sid = status(&dir)["session_id"].as_str().unwrap().to_owned();
    // The gateway restarts before the refused turn: its compaction is the first result of the
    // resumed session in this run, billed from the running totals kept with the session.
    assert!(gw.stop().success());
    let gw = GatewayProcess::start(&config);
    // A line of hers from another device: context, never a delivery, first shown in the batch
    // that will be refused.
    let phone = tests::matrix::user_client(&url, "vera", "vera-pw", &dir.join("vera-phone")).await;
    let aside = phone
        .get_room(lobby.room_id())
        .expect("vera is in the lobby");
    aside.send(chat("an aside from her phone")).await.unwrap();

    // Refused once: compacted (one summary request), and the same batch goes through.
    let from = mock.ledger().len();
    mock.inject(Fault::PromptTooLong);
    mock.script(say("two"));
    lobby.send(chat("second")).await.unwrap();
    wait_for_reply(ann, &lobby, "two", Duration::from_secs(90)).await;
    turns_total(&dir, 2, &gw).await;
    let codes: Vec<u16> = mock.ledger()[from..].iter().map(|e| e.status).collect();
    assert_eq!(codes, [400, 200, 200], "log:\n{}", gw.log());
    let st = status(&dir);
    assert_eq!(
        (st["compactions"].as_u64(), st["generation"].as_u64()),
        (Some(1), Some(0)),
        "{st}"
    );
    assert_eq!(st["session_id"].as_str(), Some(sid.as_str()));
    let retried = mock.ledger().last().unwrap().last_user_text.clone();
    assert!(retried.contains("second"));
    // The summary is her memory of the lines she saw: they are not sent again as context.
    assert!(!retried.contains("first"), "{retried}");
    // The refused batch was never seen, so its new context comes again with the retry.
    let refused = mock.ledger()[from].last_user_text.clone();
    for text in [&refused, &retried] {
        assert!(
            text.contains("an aside from her phone"),
            "{text}\nlog:\n{}",
            gw.log()
        );
    }

    // Refused again after compacting: a fresh session, given the recent lines.
    let from = mock.ledger().len();
    mock.inject(Fault::PromptTooLong);
    mock.inject(Fault::Pass);
    mock.inject(Fault::PromptTooLong);
    mock.script(say("three"));
    lobby.send(chat("third")).await.unwrap();
    wait_for_reply(ann, &lobby, "three", Duration::from_secs(90)).await;
    turns_total(&dir, 3, &gw).await;
    let codes: Vec<u16> = mock.ledger()[from..].iter().map(|e| e.status).collect();
    assert_eq!(codes, [400, 200, 400, 200], "log:\n{}", gw.log());
    let st = status(&dir);
    assert_eq!(
        (st["compactions"].as_u64(), st["generation"].as_u64()),
        (Some(2), Some(1)),
        "{st}"
    );
    assert_ne!(st["session_id"].as_str(), Some(sid.as_str()));
    let last = mock.ledger().last().unwrap().clone();
    assert!(last.last_user_text.contains("third"));
    // The earlier lines once each (the batch's context), not again as recent lines.
    for line in ["first", "second", ": one\n", ": two\n"] {
        assert_eq!(
            last.last_user_text.matches(line).count(),
            1,
            "{line:?}: {}",
            last.last_user_text
        );
    }
    assert_eq!(
        from_vera(ann, &lobby).await,
        ["one", "an aside from her phone", "two", "three"]
    );
    assert!(gw.stop().success());
    // Each compaction is in her history at what its summary request was billed, the first
    // after the restart too (it is not estimated), and her history is the whole bill.
    let history =
        gateway::turns::read_history(&dir.join("state/personas/vera/turns.jsonl")).unwrap();
    let compactions: Vec<_> = history
        .iter()
        .filter(|r| r.kind == gateway::turns::RecordKind::Compaction)
        .collect();
    let ledger = mock.ledger();
    let summaries: Vec<&LedgerEntry> = ledger.iter().filter(|e| e.is_summary()).collect();
    assert_eq!((compactions.len(), summaries.len()), (2, 2), "{history:?}");
    for (r, e) in compactions.iter().zip(&summaries) {
        assert!(
            (r.cost_usd - e.cost).abs() <= 0.01 * e.cost && r.outcome.ends_with("billed"),
            "recorded {r:?}, billed ${}",
            e.cost
        );
    }
    tests::live::assert_history_is_the_bill(&history, &ledger);
}

/// A reply naming a room that is not hers sends nothing, and her next batch tells her so, also
/// when the gateway restarted in between (the correction is stored with the turn); the batch
/// after that no longer does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reply_to_a_room_not_hers_is_corrected_in_her_next_batch_across_a_restart() {
    let (scene, lobby, mock, config, gw) = live_in_lobby("minds-correct", "mc-lobby").await;
    let (ann, dir) = (&scene.ann, scene.dir.clone());
    mock.script(json!({"say": [{"room": "!elsewhere:localhost", "text": "lost words"}]}));
    lobby
        .send(RoomMessageEventContent::text_plain("where do you answer?"))
        .await
        .unwrap();
    turns_total(&dir, 1, &gw).await;
    let turn = &status(&dir)["turns"][0];
    assert_eq!(turn["says"], 0, "{turn}");
    assert!(
        turn["outcome"]
            .as_str()
            .is_some_and(|o| o.contains("!elsewhere:localhost")),
        "{turn}"
    );
    assert!(gw.stop().success());

    let gw = GatewayProcess::start(&config);
    let correction = "[correction] your last reply was not sent: \"!elsewhere:localhost\" is not one of your rooms";
    corrected_once(
        &mock,
        &gw,
        ann,
        &lobby,
        correction,
        ["here, then", "and again"],
    )
    .await;
    assert_eq!(from_vera(ann, &lobby).await, ["here, then", "and again"]);
    assert!(gw.stop().success());
}

/// Two more batches in `lobby`, answered with `texts`: the first carries `correction`, the
/// second no longer does.
async fn corrected_once(
    mock: &MockApi,
    gw: &GatewayProcess,
    ann: &matrix_sdk::Client,
    lobby: &matrix_sdk::Room,
    correction: &str,
    texts: [&str; 2],
) {
    for (i, text) in texts.into_iter().enumerate() {
        let from = mock.ledger().len();
        let room = lobby.room_id().to_string();
        mock.script(json!({"say": [{"room": room, "text": text}]}));
        lobby
            .send(RoomMessageEventContent::text_plain(format!("message {i}")))
            .await
            .unwrap();
        wait_for_reply(ann, lobby, text, Duration::from_secs(90)).await;
        let asked = answered_since(mock, from, 1, Some(gw)).await.remove(0);
        assert_eq!(
            asked.last_user_text.contains(correction),
            i == 0,
            "batch {i}: {}",
            asked.last_user_text
        );
    }
}

/// A say the homeserver refuses for good (a room where only moderators may speak) is not
/// retried, the reply's other say goes out, and her next batch names the refused say and why;
/// the batch after that no longer does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_say_the_homeserver_refuses_is_named_in_her_next_batch() {
    use matrix_sdk::ruma::api::client::room::create_room::v3::{Request, RoomPreset};
    use matrix_sdk::ruma::serde::Raw;
    let scene = Scene::new("minds-refused", Limits::Relaxed).await;
    let (ann, dir) = (&scene.ann, scene.dir.clone());
    let lobby = public_room(ann, "mr-lobby").await;
    let mut req = Request::new();
    req.room_alias_name = Some("mr-notices".to_owned());
    req.preset = Some(RoomPreset::PublicChat);
    req.power_level_content_override =
        Some(Raw::from_json_string(r#"{"events_default": 50}"#.to_owned()).unwrap());
    let notices = ann.create_room(req).await.unwrap();
    let mock = MockApi::start(MockConfig::default()).await.unwrap();
    // Joined, so what refuses her say is the room's power levels, not her absence.
    let (_, gw) = vera_in(
        &scene,
        &mock,
        &[("mr-lobby", &lobby), ("mr-notices", &notices)],
    )
    .await;
    let (room, hall) = (lobby.room_id().to_string(), notices.room_id().to_string());
    let chat = |text: &str| RoomMessageEventContent::text_plain(text);
    mock.script(json!({"say": [
        {"room": hall, "text": "an announcement she may not make"},
        {"room": room, "text": "**hello** from the lobby"},
    ]}));
    lobby.send(chat("hello")).await.unwrap();
    wait_for_reply(
        ann,
        &lobby,
        "**hello** from the lobby",
        Duration::from_secs(90),
    )
    .await;
    turns_total(&dir, 1, &gw).await;
    let turn = &status(&dir)["turns"][0];
    assert_eq!(turn["says"], 1, "{turn}");
    assert!(
        turn["outcome"]
            .as_str()
            .is_some_and(|o| o.starts_with("sent 1 of 2") && o.contains("M_FORBIDDEN")),
        "{turn}"
    );
    let correction = format!(
        "[correction] your say to {hall} (32 characters, \"an announcement she may not make\") was not sent: homeserver refused (403 M_FORBIDDEN)"
    );
    let typed = "and on: a **Vec<String>**";
    corrected_once(&mock, &gw, ann, &lobby, &correction, ["noted", typed]).await;
    assert!(from_vera(ann, &notices).await.is_empty());
    assert_eq!(
        from_vera(ann, &lobby).await,
        ["**hello** from the lobby", "noted", typed]
    );
    // Her Markdown is rendered for clients beside its source; plain text stays plain.
    let contents = tests::live::contents_by(ann, &lobby, "@vera:localhost").await;
    assert_eq!(
        contents[0]["formatted_body"],
        "<strong>hello</strong> from the lobby"
    );
    assert_eq!(contents[0]["format"], "org.matrix.custom.html");
    assert!(
        contents[1].get("formatted_body").is_none(),
        "{}",
        contents[1]
    );
    // What looks like an HTML tag in her text is her text: escaped, or a client's sanitizer
    // would drop `<String>` and show "a Vec".
    assert_eq!(
        contents[2]["formatted_body"],
        "and on: a <strong>Vec&lt;String&gt;</strong>"
    );
    assert!(gw.stop().success());
}

/// A batch no session can hold (three long pastes, with a small model window) is not lost:
/// the gateway splits it, so every message reaches her; a message too long on its own is cut
/// to what fits, and she is told it was cut. Before, the batch was refused by a compacted and
/// then a fresh session, acked, and never shown to her.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_too_long_for_any_session_is_split_and_a_message_too_long_alone_is_cut() {
    let (scene, lobby, mock, gw) = small_window("minds-toolong", "mt-lobby").await;
    let dir = scene.dir.clone();
    // How often each request the API answered showed her `needle` (her history is sent
    // whole each turn, so a line of hers is in every later request of its session).
    let shown = |needle: &str| -> Vec<usize> {
        mock.ledger()
            .iter()
            .filter(|e| e.status == 200)
            .map(|e| e.user_text.matches(needle).count())
            .filter(|&n| n > 0)
            .collect()
    };
    async fn wait_shown(mock: &MockApi, gw: &GatewayProcess, needle: &str) {
        let deadline = Instant::now() + Duration::from_secs(120);
        while !mock
            .ledger()
            .iter()
            .any(|e| e.status == 200 && e.user_text.contains(needle))
        {
            assert!(
                Instant::now() < deadline,
                "{needle:?} never reached her:\n{}",
                gw.log()
            );
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
    }
    // Three pastes of 20 KB (5k tokens each to the mock), sent together: with her doctrine
    // and tools, more than the 15k-token window in one batch.
    let paste = |i: usize| format!("paste {i}: {}", "lorem ipsum ".repeat(1700));
    for i in 0..3 {
        lobby
            .send(RoomMessageEventContent::text_plain(paste(i)))
            .await
            .unwrap();
    }
    for i in 0..3 {
        wait_shown(&mock, &gw, &format!("paste {i}: lorem")).await;
    }
    let refused = mock.ledger().iter().filter(|e| e.status == 400).count();
    assert!(refused >= 1, "the three did not overflow a session");
    // One paste of 56 KB: alone more than the window, so it is cut to what fits.
    let big = format!("the big one: {}", "dolor sit amet ".repeat(3800));
    lobby
        .send(RoomMessageEventContent::text_plain(&big))
        .await
        .unwrap();
    wait_shown(&mock, &gw, "the big one: dolor").await;
    let cut = mock
        .ledger()
        .into_iter()
        .rfind(|e| e.status == 200)
        .unwrap()
        .last_user_text;
    let note = format!(
        "of its {} bytes; the whole message does not fit your context window]",
        big.len()
    );
    assert!(
        cut.contains(&note),
        "{}",
        &cut[cut.len().saturating_sub(400)..]
    );
    // Every message was shown to her once (no request held one twice), and no turn ended
    // without her reply.
    for i in 0..3 {
        let each = shown(&format!("paste {i}: lorem"));
        assert!(
            !each.is_empty() && each.iter().all(|&n| n == 1),
            "paste {i}: {each:?}"
        );
    }
    turns_total(&dir, 3, &gw).await;
    let history =
        gateway::turns::read_history(&dir.join("state/personas/vera/turns.jsonl")).unwrap();
    for r in &history {
        assert!(!r.outcome.contains("without a structured reply"), "{r:?}");
    }
    assert!(gw.stop().success());
}

/// A batch refused as too long in a session it almost fits: the compaction after it keeps the
/// refused message verbatim past its summary (the CLI's way), so the retry names it in a
/// `[retry]` note instead of sending it again, and she sees it once. Before, the retry sent
/// the batch again and, with room for both, she was shown it twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_refused_as_too_long_is_not_shown_twice_after_the_compaction() {
    let (scene, lobby, mock, gw) = small_window("minds-kept", "mk-lobby").await;
    let dir = scene.dir.clone();
    // Her conversation grows to ~13k of the 15k-token window, a turn at a time.
    let mut turns = 0;
    while mock.ledger().last().map_or(0, |e| e.prompt_tokens) < 12_000 {
        turns += 1;
        let line = format!("chat {turns}: {}", "amet consectetur ".repeat(550));
        lobby
            .send(RoomMessageEventContent::text_plain(line))
            .await
            .unwrap();
        turns_total(&dir, turns, &gw).await;
    }
    let last = mock.ledger().last().unwrap().clone();
    assert_eq!(last.status, 200);
    // Past the window with her conversation, but it fits twice beside a summary.
    let tokens = 15_000 - (last.prompt_tokens + last.usage.output) + 800;
    let long = format!("the long one: {}", "x".repeat(4 * tokens as usize));
    let from = mock.ledger().len();
    lobby
        .send(RoomMessageEventContent::text_plain(&long))
        .await
        .unwrap();
    turns_total(&dir, turns + 1, &gw).await;
    let requests: Vec<(u16, usize)> = mock.ledger()[from..]
        .iter()
        .map(|e| (e.status, e.user_text.matches(&long).count()))
        .collect();
    // Refused; the summary request with it too long as well, then without it; the retry.
    assert_eq!(
        requests[..3],
        [(400, 1), (400, 1), (200, 0)],
        "{requests:?}"
    );
    assert_eq!(
        requests.last(),
        Some(&(200, 1)),
        "{requests:?}\n{}",
        gw.log()
    );
    let retry = mock.ledger().last().unwrap().last_user_text.clone();
    assert!(
        retry.contains("[retry] the batch above was refused as too long"),
        "{retry}"
    );
    let st = status(&dir);
    assert_eq!(st["compactions"].as_u64(), Some(1), "{st}");
    assert!(gw.stop().success());
}

/// Her silence is booked as she kept it, not as the gateway saw it: a message said while the
/// gateway was down ends her gap when it was said (its origin_server_ts), so the downtime
/// does not teach the keep-warm rule that she was silent longer than she was.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gap_ends_when_her_mail_was_said_not_when_a_restarted_gateway_got_to_it() {
    let (scene, lobby, mock, config, gw) = live_in_lobby("minds-gap", "mg-lobby").await;
    let (ann, dir) = (&scene.ann, scene.dir.clone());
    let room = lobby.room_id().to_string();
    let say = |text: &str| json!({"say": [{"room": room, "text": text}]});
    let chat = |text: &str| RoomMessageEventContent::text_plain(text);
    mock.script(say("one"));
    lobby.send(chat("first")).await.unwrap();
    wait_for_reply(ann, &lobby, "one", Duration::from_secs(90)).await;
    turns_total(&dir, 1, &gw).await;
    let last_turn = Instant::now();
    assert!(gw.stop().success());
    lobby.send(chat("said while it was down")).await.unwrap();
    let silence = last_turn.elapsed();
    // Down for 12 s more.
    tokio::time::sleep(Duration::from_secs(12)).await;
    mock.script(say("two"));
    let gw = GatewayProcess::start(&config);
    wait_for_reply(ann, &lobby, "two", Duration::from_secs(90)).await;
    turns_total(&dir, 2, &gw).await;
    assert!(gw.stop().success());
    let inbox = gateway::inbox::Inbox::open(&dir.join("state/inbox")).unwrap();
    let gaps: serde_json::Value =
        serde_json::from_str(&inbox.session_value("vera", "gaps").unwrap().unwrap()).unwrap();
    let booked = gaps["gaps"]
        .as_array()
        .unwrap()
        .last()
        .unwrap()
        .as_u64()
        .unwrap();
    assert!(
        booked <= silence.as_secs() + 2,
        "booked {booked} s for a silence of {silence:?} (the gateway was down 12 s more)"
    );
}
