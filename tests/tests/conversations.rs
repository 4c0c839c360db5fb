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
