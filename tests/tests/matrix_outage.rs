//! The ear and mouth under pressure, against a real Synapse: a full inbox holds the ear back
//! until acks free room; Synapse's default rate limits make 429s that are waited out; a
//! homeserver stopped for 20 s is recovered from. Nothing is lost, nothing doubled.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use matrix_sdk::ruma::events::room::message::RoomMessageEventContent;
use tests::matrix::{persona, public_room, room_bodies, sync, Gateway, Scene};
use tests::synapse::Limits;
use tokio::sync::watch;
use wire::docs::{SendRequest, Status};

async fn hall(client: &matrix_sdk::Client) -> matrix_sdk::Room {
    public_room(client, "hall").await
}

async fn wait_pending(inbox: &gateway::inbox::Inbox, want: u64, within: Duration) -> u64 {
    let deadline = Instant::now() + within;
    loop {
        let n = inbox.counts("vera").unwrap().pending;
        if n >= want || Instant::now() > deadline {
            return n;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn pending_texts(inbox: &gateway::inbox::Inbox) -> Vec<String> {
    let page = inbox.pending("vera", 0, 100, None).unwrap();
    page.deliveries.into_iter().map(|d| d.text).collect()
}

fn say(id: &str, text: &str) -> SendRequest {
    SendRequest {
        request_id: id.into(),
        persona: "vera".into(),
        room: "#hall:localhost".into(),
        text: text.into(),
        thread_root: None,
        reply_to: None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_inbox_holds_the_ear_back_until_acks_free_room() {
    let scene = Scene::new("holdback", Limits::Relaxed).await;
    let (url, ann, dir) = (scene.url.clone(), &scene.ann, scene.dir.clone());
    let room = hall(ann).await;
    let mut p = persona(&url, "vera", &["#hall:localhost"], &[]);
    p.limits.max_pending = 5;
    let token = scene.vera_token.clone();
    let gw = Gateway::start(&p, &token, &dir.join("gw")).await;
    let (inbox, stats) = (gw.inbox.clone(), gw.stats.clone());
    let (stop, stopped) = watch::channel(false);
    let ear = tokio::spawn(gw.ear.run(stopped));
    for i in 0..6 {
        room.send(RoomMessageEventContent::text_plain(format!("first {i}")))
            .await
            .unwrap();
    }
    assert!(wait_pending(&inbox, 5, Duration::from_secs(20)).await >= 5);
    let held = inbox.counts("vera").unwrap().pending;
    for i in 0..4 {
        room.send(RoomMessageEventContent::text_plain(format!("later {i}")))
            .await
            .unwrap();
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        inbox.counts("vera").unwrap().pending,
        held,
        "the ear synced past max_pending"
    );
    assert!(stats.held_back.load(Ordering::Relaxed) > 0);
    let c = inbox.counts("vera").unwrap();
    inbox.ack("vera", c.highest).unwrap();
    // The ear looks again within 5 s (at once when the turn loop signals its ack).
    assert_eq!(
        wait_pending(&inbox, 10 - held, Duration::from_secs(20)).await,
        10 - held
    );
    let texts = pending_texts(&inbox);
    assert_eq!(texts.last().map(String::as_str), Some("later 3"));
    let _ = stop.send(true);
    ear.await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn default_rate_limits_are_waited_out() {
    let scene = Scene::new("ratelimit", Limits::Default).await;
    let (url, ann, dir) = (scene.url.clone(), &scene.ann, scene.dir.clone());
    let room = hall(ann).await;
    let p = persona(&url, "vera", &["#hall:localhost"], &[]);
    let token = scene.vera_token.clone();
    let gw = Gateway::start(&p, &token, &dir.join("gw")).await;
    const N: usize = 14;
    for i in 0..N {
        let r = gw
            .mouth
            .send(&say(&format!("burst-{i}"), &format!("burst {i}")))
            .await;
        assert_eq!(r.status, Status::Ok, "send {i}: {r:?}");
    }
    assert!(
        gw.mouth.retries() > 0,
        "no 429 was met: the test proves nothing"
    );
    sync(ann).await;
    let bodies = room_bodies(&room, 50).await;
    let want: Vec<_> = (0..N).map(|i| format!("burst {i}")).collect();
    assert_eq!(
        bodies
            .iter()
            .filter(|b| b.starts_with("burst "))
            .cloned()
            .collect::<Vec<_>>(),
        want
    );
    gw.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_homeserver_outage_of_20_s_loses_nothing() {
    let mut scene = Scene::new("outage", Limits::Relaxed).await;
    let (url, ann, dir) = (scene.url.clone(), &scene.ann, scene.dir.clone());
    let room = hall(ann).await;
    let p = persona(&url, "vera", &["#hall:localhost"], &[]);
    let token = scene.vera_token.clone();
    let gw = Gateway::start(&p, &token, &dir.join("gw")).await;
    let (inbox, stats, mouth) = (gw.inbox.clone(), gw.stats.clone(), gw.mouth.clone());
    let (stop, stopped) = watch::channel(false);
    let ear = tokio::spawn(gw.ear.run(stopped));
    for i in 0..3 {
        room.send(RoomMessageEventContent::text_plain(format!("before {i}")))
            .await
            .unwrap();
    }
    assert_eq!(wait_pending(&inbox, 3, Duration::from_secs(20)).await, 3);
    scene.hs.stop();
    let down = mouth
        .send(&say("during-outage", "said during the outage"))
        .await;
    assert_eq!(down.status, Status::Failed, "{down:?}");
    tokio::time::sleep(Duration::from_secs(20)).await;
    scene.hs.restart();
    for i in 0..3 {
        room.send(RoomMessageEventContent::text_plain(format!("after {i}")))
            .await
            .unwrap();
    }
    assert_eq!(wait_pending(&inbox, 6, Duration::from_secs(60)).await, 6);
    assert!(
        stats.errors.load(Ordering::Relaxed) > 0,
        "the ear never saw the outage"
    );
    let texts = pending_texts(&inbox);
    assert_eq!(
        texts,
        ["before 0", "before 1", "before 2", "after 0", "after 1", "after 2"]
    );
    // The failed send, repeated now, goes out once.
    let again = mouth
        .send(&say("during-outage", "said during the outage"))
        .await;
    assert_eq!(again.status, Status::Ok, "{again:?}");
    sync(ann).await;
    let bodies = room_bodies(&room, 50).await;
    assert_eq!(
        bodies
            .iter()
            .filter(|b| *b == "said during the outage")
            .count(),
        1
    );
    let _ = stop.send(true);
    ear.await.unwrap();
}

/// Synapse does not rate-limit `/sync`; a proxy in front of it answers syncs with 429. The ear
/// waits as asked, by `retry_after_ms` in the body (twice 1.5 s) and by the `Retry-After`
/// header (twice 2 s), counts them, and delivers each message once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_429_on_sync_is_waited_out_as_asked() {
    use tests::fault_proxy::{FaultProxy, Hint};
    let scene = Scene::new("sync429", Limits::Relaxed).await;
    let (url, ann, dir) = (scene.url.clone(), &scene.ann, scene.dir.clone());
    let room = hall(ann).await;
    let proxy = FaultProxy::start(&url).await;
    let p = persona(&proxy.url(), "vera", &["#hall:localhost"], &[]);
    let gw = Gateway::start(&p, &scene.vera_token, &dir.join("gw")).await;
    let (inbox, stats) = (gw.inbox.clone(), gw.stats.clone());
    let (stop, stopped) = watch::channel(false);
    let ear = tokio::spawn(gw.ear.run(stopped));
    for (i, hint) in [Hint::Body(Duration::from_millis(1500)), Hint::Header(2)]
        .into_iter()
        .enumerate()
    {
        // The ear's current long poll already went through: the message that ends it comes
        // at once, and the syncs after it are answered with 429.
        proxy.rate_limit_syncs(2, hint);
        room.send(RoomMessageEventContent::text_plain(format!("wake {i}")))
            .await
            .unwrap();
        let n = 2 * i as u64 + 1;
        assert_eq!(wait_pending(&inbox, n, Duration::from_secs(30)).await, n);
        room.send(RoomMessageEventContent::text_plain(format!("limited {i}")))
            .await
            .unwrap();
        assert_eq!(
            wait_pending(&inbox, n + 1, Duration::from_secs(30)).await,
            n + 1
        );
        let delivered = Instant::now();
        assert_eq!(proxy.answered(), 2 * (i as u32 + 1));
        let first = proxy.first_429_at().expect("a 429 went out");
        assert!(
            delivered - first >= hint.wait() * 2,
            "{hint:?}: delivered {:?} after the first 429; the requested waits were not honoured",
            delivered - first
        );
    }
    assert_eq!(stats.rate_limited.load(Ordering::Relaxed), 4);
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(
        pending_texts(&inbox),
        ["wake 0", "limited 0", "wake 1", "limited 1"]
    );
    let _ = stop.send(true);
    ear.await.unwrap();
}
