//! The ear and mouth against a real Synapse: every kind of delivery, an encrypted DM from an
//! operator answered in the encrypted room, first-sync history that is not mail, restarts
//! before and after ack, a 300-message gap filled in order, sends that happen once, a cold
//! room's history read for context, a line said during that read kept in its place, and a
//! deleted message that never reaches her.

use std::time::Duration;

use matrix_sdk::ruma::events::room::message::{MessageType, RoomMessageEventContent};
use matrix_sdk::ruma::events::Mentions;
use matrix_sdk::ruma::OwnedUserId;
use tests::fault_proxy::FaultProxy;
use tests::matrix::{
    has_joined, persona, public_room, room_bodies, sync, token_for, user_client, Gateway, Scene,
};
use tests::synapse::{Limits, Synapse};
use wire::docs::{DeliveryKind, SendRequest, Status};

fn text(body: &str) -> RoomMessageEventContent {
    RoomMessageEventContent::text_plain(body)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deliveries_of_every_kind_and_an_encrypted_dm_answered() {
    let scratch = tests::ScratchDir::new("ear-kinds");
    let dir = scratch.path();
    let hs = Synapse::start(&dir.join("hs"), Limits::Relaxed);
    hs.register("vera", "vera-pw");
    hs.register("ann", "ann-pw");
    hs.register("bob", "bob-pw");
    let url = hs.url();
    let ann = user_client(&url, "ann", "ann-pw", &dir.join("ann")).await;
    let bob = user_client(&url, "bob", "bob-pw", &dir.join("bob")).await;
    let hall = public_room(&ann, "hall").await;
    hall.send(text("history from before she listened"))
        .await
        .unwrap();

    let p = persona(&url, "vera", &["#hall:localhost"], &["@ann:localhost"]);
    let token = token_for(&url, "vera", "vera-pw", &p.device_id).await;
    let mut gw = Gateway::start(&p, &token, &dir.join("gw")).await;
    // The first sync recorded a position and made no mail.
    assert!(gw.inbox.sync_token("vera").unwrap().is_some());
    assert_eq!(gw.inbox.counts("vera").unwrap().pending, 0);

    let vera: OwnedUserId = "@vera:localhost".try_into().unwrap();
    let root = hall
        .send(text("a plain line about the weather"))
        .await
        .unwrap()
        .response
        .event_id;
    hall.send(text("vera, what do you think?")).await.unwrap();
    let mut mention = text("hey you");
    mention = mention.add_mentions(Mentions::with_user_ids([vera.clone()]));
    hall.send(mention).await.unwrap();
    hall.send_raw(
        "m.room.message",
        serde_json::json!({
        "msgtype": "m.text", "body": "in the thread",
        "m.relates_to": {"rel_type": "m.thread", "event_id": root, "is_falling_back": true,
                         "m.in_reply_to": {"event_id": root}}}),
    )
    .await
    .unwrap();
    hall.send_raw(
        "m.room.message",
        serde_json::json!({
        "msgtype": "m.text", "body": "* a plain line about the rain",
        "m.new_content": {"msgtype": "m.text", "body": "a plain line about the rain"},
        "m.relates_to": {"rel_type": "m.replace", "event_id": root}}),
    )
    .await
    .unwrap();
    sync(&bob).await;
    bob.join_room_by_id(hall.room_id()).await.unwrap();
    let bob_hall = bob.get_room(hall.room_id()).unwrap();
    bob_hall
        .send(RoomMessageEventContent::new(MessageType::Notice(
            matrix_sdk::ruma::events::room::message::NoticeMessageEventContent::plain("a notice"),
        )))
        .await
        .unwrap();
    bob_hall
        .send(RoomMessageEventContent::new(MessageType::Emote(
            matrix_sdk::ruma::events::room::message::EmoteMessageEventContent::plain("waves"),
        )))
        .await
        .unwrap();

    gw.until_pending(7, Duration::from_secs(30)).await;
    let page = gw.inbox.pending("vera", 0, 100, None).unwrap();
    let by_text = |t: &str| {
        page.deliveries
            .iter()
            .find(|d| d.text == t)
            .unwrap_or_else(|| panic!("no delivery {t:?} in {:#?}", page.deliveries))
    };
    assert!(
        page.deliveries
            .iter()
            .all(|d| !d.text.contains("history from before")),
        "first-sync history became mail"
    );
    assert_eq!(
        page.deliveries.iter().map(|d| d.seq).collect::<Vec<_>>(),
        (1..=7).collect::<Vec<_>>()
    );
    let plain = by_text("a plain line about the weather");
    assert!(!plain.to_you && plain.kind == DeliveryKind::Text && !plain.is_direct);
    assert_eq!(plain.room_alias.as_deref(), Some("#hall:localhost"));
    assert!(
        plain
            .context
            .iter()
            .any(|c| c.text == "history from before she listened"),
        "context: {:?}",
        plain.context
    );
    assert!(by_text("vera, what do you think?").to_you);
    let m = by_text("hey you");
    assert!(m.to_you && m.mentions == vec!["@vera:localhost".to_owned()]);
    let t = by_text("in the thread");
    assert_eq!(t.thread_root.as_deref(), Some(root.as_str()));
    assert_eq!(
        t.context
            .iter()
            .map(|c| c.event_id.as_str())
            .collect::<Vec<_>>(),
        [root.as_str()],
        "a thread's context is its root"
    );
    let e = by_text("a plain line about the rain");
    assert_eq!(
        (e.kind, e.edit_of.as_deref()),
        (DeliveryKind::Edit, Some(root.as_str()))
    );
    assert_eq!(by_text("a notice").kind, DeliveryKind::Notice);
    assert_eq!(by_text("waves").kind, DeliveryKind::Emote);
    gw.inbox.ack("vera", 7).unwrap();

    // An encrypted DM from the operator: joined, decrypted, answered encrypted.
    let dm = ann.create_dm(&vera).await.expect("create dm");
    assert!(dm.latest_encryption_state().await.unwrap().is_encrypted());
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        gw.ear.round(Duration::from_millis(200)).await.unwrap();
        if has_joined(&ann, &dm, &vera).await {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "she did not join the operator's DM"
        );
    }
    dm.send(text("a secret for vera")).await.unwrap();
    gw.until_pending(1, Duration::from_secs(20)).await;
    let d = gw
        .inbox
        .pending("vera", 7, 10, None)
        .unwrap()
        .deliveries
        .remove(0);
    assert_eq!(d.text, "a secret for vera");
    assert!(d.is_direct && d.to_you);
    assert_eq!(
        gw.stats
            .undecryptable
            .load(std::sync::atomic::Ordering::Relaxed),
        0
    );
    let receipt = gw
        .mouth
        .send(&SendRequest {
            request_id: "dm-answer-1".into(),
            persona: "vera".into(),
            room: d.room_id.clone(),
            text: "the answer, encrypted".into(),
            thread_root: None,
            reply_to: Some(d.event_id.clone()),
        })
        .await;
    assert_eq!(receipt.status, Status::Ok, "{receipt:?}");
    sync(&ann).await;
    let bodies = room_bodies(&dm, 10).await;
    assert!(
        bodies.iter().any(|b| b == "the answer, encrypted"),
        "ann reads {bodies:?}"
    );
    // On the wire it was encrypted.
    let raw = tests::synapse::get(
        hs.port,
        &format!(
            "/_matrix/client/v3/rooms/{}/event/{}",
            dm.room_id(),
            receipt.event_id.as_deref().unwrap()
        ),
        Some(&token),
    )
    .unwrap();
    assert!(raw.1.contains("m.room.encrypted"), "{}", raw.1);

    // Not her room, an unknown alias, oversize text: typed refusals, nothing sent.
    let bob_room = public_room(&bob, "bobs").await;
    for (room, text, want) in [
        (
            bob_room.room_id().to_string(),
            "hi".to_owned(),
            "not in room",
        ),
        (
            "#nowhere:localhost".to_owned(),
            "hi".to_owned(),
            "unknown room",
        ),
        (
            d.room_id.clone(),
            "x".repeat(gateway::mouth::MAX_TEXT_BYTES + 1),
            "outside",
        ),
    ] {
        let r = gw
            .mouth
            .send(&SendRequest {
                request_id: format!("bad-{want}"),
                persona: "vera".into(),
                room,
                text,
                thread_root: None,
                reply_to: None,
            })
            .await;
        assert_eq!(r.status, Status::Rejected, "{r:?}");
        assert!(
            r.error.as_deref().unwrap_or_default().contains(want),
            "{r:?}"
        );
    }
    gw.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restarts_gap_fill_and_sends_once() {
    let scene = Scene::new("ear-restarts", Limits::Relaxed).await;
    let (url, ann, dir) = (scene.url.clone(), &scene.ann, scene.dir.clone());
    let hall = public_room(ann, "hall").await;
    let p = persona(&url, "vera", &["#hall:localhost"], &["@ann:localhost"]);
    let token = scene.vera_token.clone();
    let state = dir.join("gw");
    let mut gw = Gateway::start(&p, &token, &state).await;
    for i in 0..5 {
        hall.send(text(&format!("before ack {i}"))).await.unwrap();
    }
    gw.until_pending(5, Duration::from_secs(20)).await;
    let first = gw.inbox.pending("vera", 0, 100, None).unwrap();
    gw.stop().await;

    // Restart before ack: the same deliveries, same seqs; more syncing adds nothing.
    let mut gw = Gateway::start(&p, &token, &state).await;
    let again = gw.inbox.pending("vera", 0, 100, None).unwrap();
    assert_eq!(first, again);
    gw.ear.round(Duration::from_millis(300)).await.unwrap();
    assert_eq!(gw.inbox.counts("vera").unwrap().highest, 5);
    gw.inbox.ack("vera", 5).unwrap();
    gw.stop().await;

    // Restart after ack: nothing redelivered.
    let mut gw = Gateway::start(&p, &token, &state).await;
    gw.ear.round(Duration::from_millis(300)).await.unwrap();
    let c = gw.inbox.counts("vera").unwrap();
    assert_eq!((c.highest, c.pending), (5, 0));
    gw.stop().await;

    // 300 messages while she is down: all delivered, in order, via gap fill.
    for i in 0..300 {
        hall.send(text(&format!("while down {i}"))).await.unwrap();
    }
    let mut gw = Gateway::start(&p, &token, &state).await;
    gw.until_pending(300, Duration::from_secs(60)).await;
    let page = gw.inbox.pending("vera", 5, 1000, None).unwrap();
    let texts: Vec<_> = page.deliveries.iter().map(|d| d.text.clone()).collect();
    let want: Vec<_> = (0..300).map(|i| format!("while down {i}")).collect();
    assert_eq!(texts, want);
    assert_eq!(
        page.deliveries.iter().map(|d| d.seq).collect::<Vec<_>>(),
        (6..=305).collect::<Vec<_>>()
    );
    assert!(
        gw.stats
            .gap_fills
            .load(std::sync::atomic::Ordering::Relaxed)
            >= 1,
        "the gap was not filled"
    );

    // The same send twice, across a restart, and with the receipt lost: one event.
    let req = SendRequest {
        request_id: "once-1".into(),
        persona: "vera".into(),
        room: "#hall:localhost".into(),
        text: "said once".into(),
        thread_root: None,
        reply_to: None,
    };
    let a = gw.mouth.send(&req).await;
    let b = gw.mouth.send(&req).await;
    assert_eq!(a.status, Status::Ok, "{a:?}");
    assert_eq!(a, b);
    gw.stop().await;
    let gw = Gateway::start(&p, &token, &state).await;
    assert_eq!(gw.mouth.send(&req).await, a);
    gw.stop().await;
    // A crash between the PUT and storing the receipt: a fresh inbox (no receipt), same device.
    let lost = dir.join("gw-lost-receipt");
    std::fs::create_dir_all(&lost).unwrap();
    copy_dir(&state.join("personas"), &lost.join("personas"));
    let gw = Gateway::start(&p, &token, &lost).await;
    let c = gw.mouth.send(&req).await;
    assert_eq!(
        c.event_id, a.event_id,
        "a repeated txn id must return the first event"
    );
    gw.stop().await;
    sync(ann).await;
    let bodies = room_bodies(&hall, 50).await;
    assert_eq!(
        bodies.iter().filter(|b| *b == "said once").count(),
        1,
        "{bodies:?}"
    );
}

fn copy_dir(from: &std::path::Path, to: &std::path::Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        let dest = to.join(e.file_name());
        if e.file_type().unwrap().is_dir() {
            copy_dir(&e.path(), &dest);
        } else {
            std::fs::copy(e.path(), dest).unwrap();
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_undecryptable_event_is_held_retried_then_delivered_as_a_placeholder() {
    let scene = Scene::new("ear-utd", Limits::Relaxed).await;
    let hall = public_room(&scene.ann, "hall").await;
    let mut p = persona(&scene.url, "vera", &["#hall:localhost"], &[]);
    p.limits.undecryptable_wait_secs = 2;
    let mut gw = Gateway::start(&p, &scene.vera_token, &scene.dir.join("gw")).await;
    // A megolm event whose session nobody ever shared with her.
    hall.send_raw(
        "m.room.encrypted",
        serde_json::json!({
            "algorithm": "m.megolm.v1.aes-sha2",
            "sender_key": "aGVsbG8gd29ybGQgaGVsbG8gd29ybGQgaGVsbG8gd28",
            "session_id": "c2Vzc2lvbiB0aGF0IG5ldmVyIHdhcyBzaGFyZWQgd2l0aA",
            "device_id": "NOPE",
            "ciphertext": "AwgAEnB0aGlzIGlzIG5vdCBhIHJlYWwgY2lwaGVydGV4dA",
        }),
    )
    .await
    .unwrap();
    hall.send(text("a clear line after it")).await.unwrap();
    gw.until_pending(1, Duration::from_secs(20)).await;
    let held = gw.inbox.held("vera").unwrap();
    assert_eq!(
        held.len(),
        1,
        "the undecryptable event is held, not delivered"
    );
    assert_eq!(
        gw.stats
            .undecryptable
            .load(std::sync::atomic::Ordering::Relaxed),
        1
    );
    let first = gw.inbox.pending("vera", 0, 10, None).unwrap();
    assert_eq!(first.deliveries.len(), 1);
    assert_eq!(first.deliveries[0].text, "a clear line after it");
    // Retried every round; after its wait it is delivered with a placeholder, never dropped.
    gw.until_pending(2, Duration::from_secs(20)).await;
    let page = gw.inbox.pending("vera", 0, 10, None).unwrap();
    assert_eq!(page.deliveries[1].text, gateway::event::UNDECRYPTABLE);
    assert_eq!(page.deliveries[1].event_id, held[0].delivery.event_id);
    assert!(gw.inbox.held("vera").unwrap().is_empty());
    assert_eq!(
        gw.stats
            .undecryptable_delivered
            .load(std::sync::atomic::Ordering::Relaxed),
        1
    );
    gw.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thread_root_older_than_the_stored_timeline_is_fetched_for_context() {
    let scene = Scene::new("ear-root", Limits::Relaxed).await;
    let hall = public_room(&scene.ann, "hall").await;
    let p = persona(&scene.url, "vera", &["#hall:localhost"], &[]);
    let mut gw = Gateway::start(&p, &scene.vera_token, &scene.dir.join("gw")).await;
    let root = hall
        .send(text("the root of it all"))
        .await
        .unwrap()
        .response
        .event_id;
    let in_thread = |body: &str| {
        serde_json::json!({"msgtype": "m.text", "body": body,
            "m.relates_to": {"rel_type": "m.thread", "event_id": root, "is_falling_back": true,
                             "m.in_reply_to": {"event_id": root}}})
    };
    for i in 0..2 {
        hall.send_raw("m.room.message", in_thread(&format!("early reply {i}")))
            .await
            .unwrap();
    }
    for i in 0..gateway::inbox::TIMELINE_CAP + 6 {
        hall.send(text(&format!("filler {i}"))).await.unwrap();
    }
    gw.until_pending(
        gateway::inbox::TIMELINE_CAP as u64 + 9,
        Duration::from_secs(30),
    )
    .await;
    let n = gw.inbox.counts("vera").unwrap().highest;
    gw.inbox.ack("vera", n).unwrap();
    hall.send_raw("m.room.message", in_thread("late in the thread"))
        .await
        .unwrap();
    gw.until_pending(1, Duration::from_secs(20)).await;
    let d = gw
        .inbox
        .pending("vera", n, 10, None)
        .unwrap()
        .deliveries
        .remove(0);
    assert_eq!(d.text, "late in the thread");
    assert_eq!(
        d.context
            .iter()
            .map(|c| c.text.as_str())
            .collect::<Vec<_>>(),
        ["the root of it all", "early reply 0", "early reply 1"],
        "the thread was trimmed from the stored timeline and must be fetched"
    );

    // A DM invite from someone who is not her operator is ignored (she has none here).
    scene.hs.register("eve", "eve-pw");
    let eve = user_client(&scene.url, "eve", "eve-pw", &scene.dir.join("eve")).await;
    let vera: OwnedUserId = "@vera:localhost".try_into().unwrap();
    let spam = eve.create_dm(&vera).await.unwrap();
    for _ in 0..3 {
        gw.ear.round(Duration::from_millis(300)).await.unwrap();
    }
    assert!(
        !has_joined(&eve, &spam, &vera).await,
        "she joined a stranger's DM"
    );
    assert!(gw
        .client
        .get_room(spam.room_id())
        .is_none_or(|r| r.state() != matrix_sdk::RoomState::Joined));
    gw.stop().await;
}

/// A public room `#den` that ann made and said thirty lines in (`old 0` to `old 29`).
async fn den_of_thirty(scene: &Scene) -> matrix_sdk::Room {
    let den = public_room(&scene.ann, "den").await;
    for i in 0..30 {
        den.send(text(&format!("old {i}"))).await.unwrap();
    }
    den
}

/// A cold start: her first sync seeds fewer lines than a delivery's context needs
/// (`fetch_limit` 5), so the room's history is read once with `/messages`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cold_room_reads_its_history_for_context() {
    let scene = Scene::new("ear-cold", Limits::Relaxed).await;
    let den = den_of_thirty(&scene).await;
    let mut p = persona(&scene.url, "vera", &["#den:localhost"], &[]);
    p.limits.fetch_limit = 5;
    let mut gw = Gateway::start(&p, &scene.vera_token, &scene.dir.join("gw")).await;
    let seeded = gw.inbox.timeline("vera", den.room_id().as_str()).unwrap();
    assert!(
        seeded.len() < 20,
        "the first sync seeded {} lines",
        seeded.len()
    );
    den.send(text("the question")).await.unwrap();
    gw.until_pending(1, Duration::from_secs(20)).await;
    let d = gw
        .inbox
        .pending("vera", 0, 1, None)
        .unwrap()
        .deliveries
        .remove(0);
    assert_eq!(d.text, "the question");
    let want: Vec<String> = (10..30).map(|i| format!("old {i}")).collect();
    assert_eq!(
        d.context.iter().map(|c| c.text.clone()).collect::<Vec<_>>(),
        want
    );
    // The lines read are stored in time order for the next delivery and for restarts.
    let stored = gw.inbox.timeline("vera", den.room_id().as_str()).unwrap();
    let texts: Vec<&str> = stored.iter().map(|l| l.line.text.as_str()).collect();
    assert_eq!(texts.last(), Some(&"the question"));
    assert!(
        texts.windows(2).all(|w| w[0] != w[1]),
        "no line twice: {texts:?}"
    );
    let pos = |t: &str| texts.iter().position(|x| *x == t);
    assert!(pos("old 10") < pos("old 29"), "{texts:?}");
}

/// A room that moves on while the ear reads its history: the line said during the read is
/// not taken for an old one. It is delivered after the question with the question in its
/// context, and the question's context does not hold it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_line_said_while_the_ear_reads_history_keeps_its_place() {
    let scene = Scene::new("ear-race", Limits::Relaxed).await;
    let den = den_of_thirty(&scene).await;
    let proxy = FaultProxy::start(&scene.url).await;
    let mut p = persona(&proxy.url(), "vera", &["#den:localhost"], &[]);
    p.limits.fetch_limit = 5;
    let mut gw = Gateway::start(&p, &scene.vera_token, &scene.dir.join("gw")).await;
    proxy.hold_history();
    let reads = proxy.history_reads();
    den.send(text("the question")).await.unwrap();
    let room_moves_on = async {
        // The ear has the question and reads the room's past (held): a follow-up is said.
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        while proxy.history_reads() == reads {
            assert!(
                std::time::Instant::now() < deadline,
                "the ear never read the room's history"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        den.send(text("a follow-up")).await.unwrap();
        proxy.release_history();
    };
    tokio::join!(gw.until_pending(1, Duration::from_secs(30)), room_moves_on);
    gw.until_pending(2, Duration::from_secs(20)).await;
    let ds = gw.inbox.pending("vera", 0, 10, None).unwrap().deliveries;
    let texts = |ls: &[wire::docs::ContextLine]| -> Vec<String> {
        ls.iter().map(|l| l.text.clone()).collect()
    };
    assert_eq!(
        ds.iter().map(|d| d.text.as_str()).collect::<Vec<_>>(),
        ["the question", "a follow-up"]
    );
    let want: Vec<String> = (10..30).map(|i| format!("old {i}")).collect();
    assert_eq!(texts(&ds[0].context), want, "the question's context");
    assert_eq!(
        texts(&ds[1].context).last().map(String::as_str),
        Some("the question"),
        "the follow-up's context: {:?}",
        texts(&ds[1].context)
    );
    let stored = gw.inbox.timeline("vera", den.room_id().as_str()).unwrap();
    let order: Vec<&str> = stored.iter().map(|l| l.line.text.as_str()).collect();
    assert_eq!(
        order[order.len() - 3..],
        ["old 29", "the question", "a follow-up"],
        "{order:?}"
    );
}

/// A message deleted (redacted) before she read it never reaches her. One stored as mail
/// already is blanked where it waits, and in the context of the mail after it. One said and
/// deleted between two rounds is neither mail nor context. Neither is in her room's timeline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_message_never_reaches_her() {
    let scene = Scene::new("ear-redact", Limits::Relaxed).await;
    let hall = public_room(&scene.ann, "redact-hall").await;
    let p = persona(&scene.url, "vera", &["#redact-hall:localhost"], &[]);
    let mut gw = Gateway::start(&p, &scene.vera_token, &scene.dir.join("gw")).await;
    let secret = hall
        .send(text("my password is hunter2"))
        .await
        .unwrap()
        .response
        .event_id;
    gw.until_pending(1, Duration::from_secs(20)).await;
    hall.redact(&secret, Some("oops"), None).await.unwrap();
    hall.send(text("ignore that")).await.unwrap();
    let quick = hall
        .send(text("and my pin is 1234"))
        .await
        .unwrap()
        .response
        .event_id;
    hall.redact(&quick, None, None).await.unwrap();
    hall.send(text("sorry")).await.unwrap();
    gw.until_pending(3, Duration::from_secs(20)).await;
    let page = gw.inbox.pending("vera", 0, 100, None).unwrap();
    let texts: Vec<&str> = page.deliveries.iter().map(|d| d.text.as_str()).collect();
    assert_eq!(
        texts,
        ["(this message was deleted)", "ignore that", "sorry"]
    );
    let context: Vec<&str> = page.deliveries[1]
        .context
        .iter()
        .map(|c| c.text.as_str())
        .collect();
    assert_eq!(context, ["(this message was deleted)"]);
    let timeline = gw.inbox.timeline("vera", hall.room_id().as_str()).unwrap();
    let kept = format!("{:?} {timeline:?}", page.deliveries);
    for secret in ["hunter2", "1234"] {
        assert!(!kept.contains(secret), "{secret} is kept: {kept}");
    }
    assert_eq!(timeline.len(), 3, "{timeline:?}");
}
