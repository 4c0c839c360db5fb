//! Conversations as people have them in Matrix, end to end (`cultnet-gateway run`, a real
//! Synapse, the real claude CLI against the mock Messages API): her answer to a line written
//! in a thread stays in that thread (`m.thread`, with the reply fallback for clients without
//! threads), unless her say names the main timeline; her says carry `m.mentions`, naming the
//! sender a reply answers, so clients ping exactly them; a reply to her line, and a line in a
//! thread she has spoken in, are addressed to her as a mention is.

use std::time::Duration;

use matrix_sdk::ruma::events::room::message::RoomMessageEventContent;
use serde_json::json;
use tests::live::{
    contents_by, live_section, messages_by, vera_live_in, wait_for_reply, with_turns,
};
use tests::matrix::Scene;
use tests::mock_api::{MockApi, MockConfig};
use tests::synapse::Limits;

/// Says `text` in `room`; its event id.
async fn said_in(room: &matrix_sdk::Room, text: &str) -> String {
    room.send(RoomMessageEventContent::text_plain(text))
        .await
        .unwrap()
        .response
        .event_id
        .to_string()
}

/// A line in the thread of `root`, as a client writes it (with the reply fallback).
fn in_thread(root: &str, body: &str) -> serde_json::Value {
    json!({"msgtype": "m.text", "body": body,
        "m.relates_to": {"rel_type": "m.thread", "event_id": root, "is_falling_back": true,
                         "m.in_reply_to": {"event_id": root}}})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn her_answer_to_a_line_in_a_thread_stays_in_the_thread() {
    let scene = Scene::new("conv-thread", Limits::Relaxed).await;
    let ann = &scene.ann;
    let mock = MockApi::start(MockConfig::default()).await.unwrap();
    let (session, _) = live_section(&scene.dir, &mock, 2000, "");
    // One turn per line this test sends: not the rules users get.
    let session = tests::live::every_line(&session);
    let (lobby, _, gw) = vera_live_in(&scene, "ct-lobby", &session, &[], "").await;
    let room = lobby.room_id().to_string();
    mock.script(json!({"say": [{"room": room, "text": "hello all"}]}));
    lobby
        .send(RoomMessageEventContent::text_plain("hello vera"))
        .await
        .unwrap();
    wait_for_reply(ann, &lobby, "hello all", Duration::from_secs(90)).await;

    // A thread, and a line in it addressed to her, as a client writes it.
    let root = said_in(&lobby, "a topic for later").await;
    let in_thread = |body: &str| in_thread(&root, body);
    mock.script(json!({"say": [{"room": room, "text": "in the thread"}]}));
    lobby
        .send_raw("m.room.message", in_thread("vera, what do you think?"))
        .await
        .unwrap();
    wait_for_reply(ann, &lobby, "in the thread", Duration::from_secs(90)).await;
    // She may still answer in the main timeline, by saying so.
    mock.script(json!({"say": [{"room": room, "text": "to everyone", "threadRoot": "main"}]}));
    lobby
        .send_raw("m.room.message", in_thread("vera, tell the room"))
        .await
        .unwrap();
    wait_for_reply(ann, &lobby, "to everyone", Duration::from_secs(90)).await;

    // A reply to one line: it mentions its sender.
    let asked = said_in(&lobby, "vera, who am I?").await;
    mock.script(json!({"say": [{"room": room, "text": "you asked it", "replyTo": asked}]}));
    wait_for_reply(ann, &lobby, "you asked it", Duration::from_secs(90)).await;

    let hers = contents_by(ann, &lobby, "@vera:localhost").await;
    let said = |body: &str| {
        hers.iter()
            .find(|c| c["body"] == body)
            .cloned()
            .unwrap_or_else(|| panic!("{body:?} not in {hers:?}"))
    };
    let threaded = said("in the thread");
    assert_eq!(
        threaded["m.relates_to"]["rel_type"], "m.thread",
        "{threaded}"
    );
    assert_eq!(threaded["m.relates_to"]["event_id"], root.as_str());
    assert_eq!(
        threaded["m.relates_to"]["m.in_reply_to"]["event_id"],
        root.as_str(),
        "the reply fallback for clients without threads"
    );
    assert_eq!(threaded["m.relates_to"]["is_falling_back"], true);
    let main = said("to everyone");
    assert!(main.get("m.relates_to").is_none(), "{main}");
    let first = said("hello all");
    assert!(first.get("m.relates_to").is_none(), "{first}");
    // Mentions: none where she names no one, her asker where she replies.
    assert_eq!(threaded["m.mentions"], json!({}), "{threaded}");
    let reply = said("you asked it");
    assert_eq!(
        reply["m.relates_to"]["m.in_reply_to"]["event_id"],
        asked.as_str()
    );
    assert_eq!(
        reply["m.mentions"],
        json!({"user_ids": ["@ann:localhost"]}),
        "{reply}"
    );
    assert!(gw.stop().success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reply_to_her_or_a_line_in_her_thread_is_addressed_to_her() {
    let scene = Scene::new("conv-addressed", Limits::Relaxed).await;
    let ann = &scene.ann;
    let mock = MockApi::start(MockConfig::default()).await.unwrap();
    let (session, _) = live_section(&scene.dir, &mock, 2000, "");
    let session = with_turns(&session, "start = \"addressed\"");
    let (lobby, _, gw) = vera_live_in(&scene, "ca-lobby", &session, &[], "").await;
    let room = lobby.room_id().to_string();
    let say = |text: &str| json!({"say": [{"room": room, "text": text}]});
    let turns = || mock.ledger().iter().filter(|e| e.status == 200).count();

    mock.script(say("hi ann"));
    lobby
        .send(RoomMessageEventContent::text_plain("vera, hello"))
        .await
        .unwrap();
    wait_for_reply(ann, &lobby, "hi ann", Duration::from_secs(90)).await;
    let hers = messages_by(ann, &lobby, "@vera:localhost").await;
    let hi = hers[0]["event_id"].as_str().unwrap().to_owned();

    // A line for no one starts nothing.
    lobby
        .send(RoomMessageEventContent::text_plain("lunch, anyone?"))
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(turns(), 1, "a line for no one started a turn");

    // A reply to her line, without her name.
    mock.script(say("then this"));
    lobby
        .send_raw(
            "m.room.message",
            json!({"msgtype": "m.text", "body": "and then?",
                   "m.relates_to": {"m.in_reply_to": {"event_id": hi}}}),
        )
        .await
        .unwrap();
    wait_for_reply(ann, &lobby, "then this", Duration::from_secs(90)).await;

    // A thread she has spoken in: its next line, without her name, is for her.
    let root = said_in(&lobby, "plans for friday").await;
    let in_thread = |body: &str| in_thread(&root, body);
    mock.script(say("count me in"));
    lobby
        .send_raw("m.room.message", in_thread("vera, coming?"))
        .await
        .unwrap();
    wait_for_reply(ann, &lobby, "count me in", Duration::from_secs(90)).await;
    mock.script(say("noon"));
    lobby
        .send_raw("m.room.message", in_thread("what time works?"))
        .await
        .unwrap();
    wait_for_reply(ann, &lobby, "noon", Duration::from_secs(90)).await;

    let sent: Vec<String> = mock
        .ledger()
        .iter()
        .filter(|e| e.status == 200)
        .map(|e| e.last_user_text.clone())
        .collect();
    assert_eq!(sent.len(), 4, "{sent:#?}");
    for (turn, line) in [(1, "and then?"), (3, "what time works?")] {
        assert!(
            sent[turn]
                .lines()
                .any(|l| l.ends_with(&format!(": {line}")) && l.contains("[to you]")),
            "{line:?} was not addressed to her: {}",
            sent[turn]
        );
    }
    // The line for no one rode with the next turn.
    assert!(sent[1].contains("lunch, anyone?"), "{}", sent[1]);
    assert!(gw.stop().success());
}

/// Her events in `room`, whole, as `reader` sees them, of any type (reactions too).
async fn her_events(
    reader: &matrix_sdk::Client,
    room: &matrix_sdk::Room,
) -> Vec<serde_json::Value> {
    tests::matrix::sync(reader).await;
    let mut opts = matrix_sdk::room::MessagesOptions::backward();
    opts.limit = 100u32.into();
    let msgs = room.messages(opts).await.unwrap();
    let mut out: Vec<serde_json::Value> = msgs
        .chunk
        .iter()
        .filter_map(|e| serde_json::from_str::<serde_json::Value>(e.raw().json().get()).ok())
        .filter(|v| v["sender"] == "@vera:localhost")
        .collect();
    out.reverse();
    out
}

/// What her latest turn was shown (the newest user message of the mock's last answered
/// request).
fn last_batch(mock: &MockApi) -> String {
    mock.ledger()
        .iter()
        .rev()
        .find(|e| e.status == 200)
        .map(|e| e.last_user_text.clone())
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn she_sees_what_a_reply_answers_and_answers_a_line_by_its_handle_with_a_pill() {
    let scene = Scene::new("conv-reply", Limits::Relaxed).await;
    let ann = &scene.ann;
    let mock = MockApi::start(MockConfig::default()).await.unwrap();
    let (session, _) = live_section(&scene.dir, &mock, 2000, "");
    // One turn per line this test sends: not the rules users get.
    let session = tests::live::every_line(&session);
    let (lobby, _, gw) = vera_live_in(&scene, "cr-lobby", &session, &[], "").await;
    let room = lobby.room_id().to_string();
    let noon = said_in(&lobby, "vera, the deploy is at noon").await;
    mock.script(json!({"say": [{"room": room, "text": "noted"}]}));
    wait_for_reply(ann, &lobby, "noted", Duration::from_secs(90)).await;

    // A reply to a line she saw a turn ago: her batch quotes it, by its handle.
    let h = session::handle::of(&noon);
    mock.script(json!({"say": [{"room": room, "text": "yes, still noon, ann", "replyTo": h}]}));
    lobby
        .send_raw(
            "m.room.message",
            json!({"msgtype": "m.text",
                   "body": "> <@ann:localhost> vera, the deploy is at noon\n\nis that still right, vera?",
                   "m.relates_to": {"m.in_reply_to": {"event_id": noon}}}),
        )
        .await
        .unwrap();
    wait_for_reply(ann, &lobby, "yes, still noon, ann", Duration::from_secs(90)).await;
    let batch = last_batch(&mock);
    let line = batch
        .lines()
        .find(|l| l.ends_with(": is that still right, vera?"))
        .unwrap_or_else(|| panic!("the reply is not in her batch:\n{batch}"));
    assert!(
        line.contains(&format!(
            "[reply to {h} \"ann\": \"vera, the deploy is at noon\"]"
        )),
        "{line}"
    );
    // Her say answering by handle is a Matrix reply to that line, mentioning and pilling ann.
    let hers = contents_by(ann, &lobby, "@vera:localhost").await;
    let reply = hers
        .iter()
        .find(|c| c["body"] == "yes, still noon, ann")
        .unwrap();
    assert_eq!(
        reply["m.relates_to"]["m.in_reply_to"]["event_id"],
        noon.as_str()
    );
    assert_eq!(reply["m.mentions"], json!({"user_ids": ["@ann:localhost"]}));
    assert_eq!(
        reply["formatted_body"],
        "yes, still noon, <a href=\"https://matrix.to/#/@ann:localhost\">ann</a>",
        "{reply}"
    );
    assert!(gw.stop().success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_edit_is_answered_once_and_she_can_correct_her_own_line() {
    let scene = Scene::new("conv-edit", Limits::Relaxed).await;
    let ann = &scene.ann;
    let mock = MockApi::start(MockConfig::default()).await.unwrap();
    // Her turns wait 4 s for more lines, so an edit made at once lands in the same batch.
    let (session, _) = live_section(&scene.dir, &mock, 2000, "");
    // One turn per line this test sends: not the rules users get.
    let session = tests::live::every_line(&session);
    let session = session.replace("debounce_ms = 200\n", "debounce_ms = 4000\n");
    assert!(session.contains("debounce_ms = 4000"), "{session}");
    let (lobby, _, gw) = vera_live_in(&scene, "ce-lobby", &session, &[], "").await;
    let room = lobby.room_id().to_string();
    let edit = |of: &str, body: &str| {
        json!({"msgtype": "m.text", "body": format!("* {body}"),
               "m.new_content": {"msgtype": "m.text", "body": body},
               "m.relates_to": {"rel_type": "m.replace", "event_id": of}})
    };
    mock.script(json!({"say": [{"room": room, "text": "6"}]}));
    let asked = said_in(&lobby, "vera, what is 2+2?").await;
    lobby
        .send_raw("m.room.message", edit(&asked, "vera, what is 3+3?"))
        .await
        .unwrap();
    wait_for_reply(ann, &lobby, "6", Duration::from_secs(90)).await;
    tokio::time::sleep(Duration::from_secs(6)).await;
    let turns: Vec<String> = mock
        .ledger()
        .iter()
        .filter(|e| e.status == 200)
        .map(|e| e.last_user_text.clone())
        .collect();
    assert_eq!(turns.len(), 1, "the edit was answered apart: {turns:#?}");
    let shown: Vec<&str> = turns[0].lines().filter(|l| l.contains("what is")).collect();
    assert_eq!(shown.len(), 1, "{}", turns[0]);
    assert!(
        shown[0].ends_with("[edited]: vera, what is 3+3?"),
        "{}",
        turns[0]
    );

    // An edit of the line after her answer: an edit of the handle she saw.
    mock.script(json!({"say": [{"room": room, "text": "8"}]}));
    lobby
        .send_raw("m.room.message", edit(&asked, "vera, what is 4+4?"))
        .await
        .unwrap();
    wait_for_reply(ann, &lobby, "8", Duration::from_secs(90)).await;
    let batch = last_batch(&mock);
    assert!(
        batch.contains(&format!(
            "[edit of {}]: vera, what is 4+4?",
            session::handle::of(&asked)
        )),
        "{batch}"
    );

    // She corrects her own line, by its handle: an m.replace of her event.
    let eight = messages_by(ann, &lobby, "@vera:localhost")
        .await
        .iter()
        .find(|m| m["content"]["body"] == "8")
        .and_then(|m| m["event_id"].as_str().map(str::to_owned))
        .unwrap();
    mock.script(json!({"say": [{"room": room, "text": "eight",
                                "replaces": session::handle::of(&eight)}]}));
    said_in(&lobby, "vera, spell it out").await;
    wait_for_reply(ann, &lobby, "* eight", Duration::from_secs(90)).await;
    let hers = contents_by(ann, &lobby, "@vera:localhost").await;
    let fix = hers.iter().find(|c| c["body"] == "* eight").unwrap();
    assert_eq!(
        fix["m.relates_to"],
        json!({"rel_type": "m.replace", "event_id": eight})
    );
    assert_eq!(fix["m.new_content"]["body"], "eight");
    assert!(gw.stop().success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn her_operators_reaction_to_her_reaches_her_and_she_reacts_by_handle() {
    let scene = Scene::new("conv-react", Limits::Relaxed).await;
    let ann = &scene.ann;
    let mock = MockApi::start(MockConfig::default()).await.unwrap();
    let (session, _) = live_section(&scene.dir, &mock, 2000, "");
    // One turn per line this test sends: not the rules users get.
    let session = tests::live::every_line(&session);
    let (lobby, _, gw) = vera_live_in(&scene, "cx-lobby", &session, &["@ann:localhost"], "").await;
    let room = lobby.room_id().to_string();
    // She acknowledges a line with a reaction, and answers.
    let ping = said_in(&lobby, "vera, ping").await;
    mock.script(json!({"say": [{"room": room, "text": "pong"}],
                       "react": [{"to": session::handle::of(&ping), "key": "👀"}]}));
    wait_for_reply(ann, &lobby, "pong", Duration::from_secs(90)).await;
    let events = her_events(ann, &lobby).await;
    let reaction = events
        .iter()
        .find(|e| e["type"] == "m.reaction")
        .unwrap_or_else(|| panic!("no reaction of hers: {events:#?}"));
    assert_eq!(
        reaction["content"]["m.relates_to"],
        json!({"rel_type": "m.annotation", "event_id": ping, "key": "👀"})
    );
    let pong = events
        .iter()
        .find(|e| e["content"]["body"] == "pong")
        .and_then(|e| e["event_id"].as_str().map(str::to_owned))
        .unwrap();

    // Her operator reacts to her line: it starts her next turn, which shows it.
    mock.script(json!({"say": [{"room": room, "text": "glad it helped"}]}));
    lobby
        .send_raw(
            "m.reaction",
            json!({"m.relates_to": {"rel_type": "m.annotation", "event_id": pong, "key": "👍"}}),
        )
        .await
        .unwrap();
    wait_for_reply(ann, &lobby, "glad it helped", Duration::from_secs(90)).await;
    let batch = last_batch(&mock);
    assert!(
        batch.contains(&format!(
            "reacted \"👍\" to {} (\"pong\")",
            session::handle::of(&pong)
        )),
        "{batch}"
    );
    assert!(gw.stop().success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operators_encrypted_dm_written_before_her_first_start_is_answered_once() {
    let scene = Scene::new("conv-prestart", Limits::Relaxed).await;
    let ann = &scene.ann;
    let mock = MockApi::start(MockConfig::default()).await.unwrap();
    let (session, _) = live_section(&scene.dir, &mock, 2000, "");
    // One turn per line this test sends: not the rules users get.
    let session = tests::live::every_line(&session);
    let config = tests::live::operated(
        &scene,
        &format!("{session}\n[persona.limits]\nundecryptable_wait_secs = 3\n"),
    );
    // Her operator opens a DM and writes in it before she ever ran: her device has no keys
    // yet, so the message is encrypted to no device of hers.
    let vera: matrix_sdk::ruma::OwnedUserId = "@vera:localhost".try_into().unwrap();
    let dm = ann.create_dm(&vera).await.unwrap();
    dm.send(RoomMessageEventContent::text_plain("vera, are you there?"))
        .await
        .unwrap();
    let room = dm.room_id().to_string();
    mock.script(json!({"say": [{"room": room, "text": "I am, but I could not read that"}]}));
    let gw = tests::matrix::GatewayProcess::start(&config);
    let got = wait_for_reply(
        ann,
        &dm,
        "I am, but I could not read that",
        Duration::from_secs(90),
    )
    .await;
    assert_eq!(
        got,
        ["I am, but I could not read that"],
        "log:\n{}",
        gw.log()
    );
    let batch = last_batch(&mock);
    assert!(
        batch.contains("(this message could not be decrypted)") && batch.contains("[to you]"),
        "{batch}"
    );
    assert!(
        gw.log().contains("delivered as a placeholder"),
        "log:\n{}",
        gw.log()
    );
    // Answered once.
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(tests::live::from_vera(ann, &dm).await.len(), 1);
    let turns = mock.ledger().iter().filter(|e| e.status == 200).count();
    assert_eq!(turns, 1);
    assert!(gw.stop().success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn media_in_an_encrypted_dm_reach_her_as_an_image_a_text_and_a_description() {
    use matrix_sdk::attachment::AttachmentConfig;
    let scene = Scene::new("conv-media", Limits::Relaxed).await;
    let ann = &scene.ann;
    let mock = MockApi::start(MockConfig::default()).await.unwrap();
    let (session, _) = live_section(&scene.dir, &mock, 2000, "");
    // One turn per line this test sends: not the rules users get.
    let session = tests::live::every_line(&session);
    let config = tests::live::operated(&scene, &session);
    let gw = tests::matrix::GatewayProcess::start(&config);
    let dm = tests::live::open_dm(ann, &gw).await;
    let room = dm.room_id().to_string();
    let say = |text: &str| json!({"say": [{"room": room, "text": text}]});
    mock.script(say("hello ann"));
    dm.send(RoomMessageEventContent::text_plain("hello vera"))
        .await
        .unwrap();
    wait_for_reply(ann, &dm, "hello ann", Duration::from_secs(90)).await;
    let for_turn = |answer: &str| {
        mock.ledger()
            .into_iter()
            .rev()
            .find(|e| e.status == 200)
            .unwrap_or_else(|| panic!("no turn before {answer:?}"))
    };

    // An image, encrypted: the model's request carries its bytes as an image block.
    let png = std::fs::read(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../fixtures/media/gradient.png"
    ))
    .unwrap();
    mock.script(say("a gradient"));
    dm.send_attachment(
        "gradient.png",
        &"image/png".parse::<mime::Mime>().unwrap(),
        png.clone(),
        AttachmentConfig::new(),
    )
    .await
    .unwrap();
    wait_for_reply(ann, &dm, "a gradient", Duration::from_secs(90)).await;
    let turn = for_turn("a gradient");
    assert_eq!(
        turn.images,
        [("image/png".to_owned(), png.clone())],
        "log:\n{}",
        gw.log()
    );
    // The pinned CLI passes the block on as given and adds a text block after it naming where
    // it stored the image: in her own private directory (CLAUDE_CODE_TMPDIR), not /tmp.
    assert!(
        turn.user_text.contains("gradient.png") && turn.user_text.contains("(image 1 attached)"),
        "{}",
        turn.user_text
    );
    let stored = turn
        .last_user_text
        .strip_prefix("[Image: source: ")
        .and_then(|p| p.strip_suffix(']'))
        .unwrap_or_else(|| panic!("{}", turn.last_user_text));
    let tmp = scene.dir.join("state/personas/vera/claude/tmp");
    assert!(std::path::Path::new(stored).starts_with(&tmp), "{stored}");
    assert_eq!(std::fs::read(stored).unwrap(), png);

    // A 2 KB text file: its text, under its line.
    let notes: String = (0..100)
        .map(|i| format!("line {i:04} of the notes\n"))
        .collect();
    assert!(notes.len() >= 2000);
    mock.script(say("read it"));
    dm.send_attachment(
        "notes.txt",
        &"text/plain".parse::<mime::Mime>().unwrap(),
        notes.clone().into_bytes(),
        AttachmentConfig::new(),
    )
    .await
    .unwrap();
    wait_for_reply(ann, &dm, "read it", Duration::from_secs(90)).await;
    let turn = for_turn("read it");
    assert!(turn.images.is_empty());
    let batch = &turn.last_user_text;
    assert!(
        batch.contains(&format!("--- the file's text ({} bytes) ---", notes.len())),
        "{batch}"
    );
    assert!(
        batch.contains("    line 0042 of the notes\n"),
        "indented as data: {batch}"
    );

    // A 50 MB file: its description only.
    mock.script(say("too big to read"));
    dm.send_raw(
        "m.room.message",
        json!({"msgtype": "m.file", "body": "dump.bin", "url": "mxc://localhost/none",
               "info": {"mimetype": "application/octet-stream", "size": 52_428_800u64}}),
    )
    .await
    .unwrap();
    wait_for_reply(ann, &dm, "too big to read", Duration::from_secs(90)).await;
    let turn = for_turn("too big to read");
    assert!(turn.images.is_empty());
    assert!(
        turn.last_user_text
            .contains("[media]: [m.file, application/octet-stream, 50.0 MB] dump.bin"),
        "{}",
        turn.last_user_text
    );
    assert!(gw.stop().success());
}
