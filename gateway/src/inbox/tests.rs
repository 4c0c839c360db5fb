use std::collections::BTreeMap;

use proptest::prelude::*;
use wire::docs::{Delivery, SendReceipt, Status};

use super::*;

/// Where a test's inbox lives (not created yet); removed with its lock file when dropped.
pub(super) fn dir(name: &str) -> crate::scratch::Dir {
    crate::scratch::Dir::new(&format!("inbox-{name}"))
}

pub(super) fn d(event: &str, text: &str) -> Delivery {
    Delivery {
        event_id: event.into(),
        room_id: "!r".into(),
        sender: "@a:l".into(),
        text: text.into(),
        ..Delivery::default()
    }
}

fn seqs(p: &Page) -> Vec<u64> {
    p.deliveries.iter().map(|d| d.seq).collect()
}

#[test]
fn seqs_dedupe_and_token_in_one_step() {
    let path = dir("basic");
    let inbox = Inbox::open(&path).unwrap();
    assert_eq!(inbox.sync_token("mira").unwrap(), None);
    let got = inbox
        .ingest(
            "mira",
            "t1",
            &[d("$1", "a"), d("$2", "b"), d("$1", "a again")],
        )
        .unwrap();
    assert_eq!(
        got,
        vec![1, 2],
        "the same event twice in one response is one delivery"
    );
    assert_eq!(inbox.sync_token("mira").unwrap().as_deref(), Some("t1"));
    // Sync is at-least-once: the same events again make nothing new.
    assert_eq!(
        inbox
            .ingest("mira", "t2", &[d("$2", "b"), d("$3", "c")])
            .unwrap(),
        vec![3]
    );
    let page = inbox.pending("mira", 0, 100, None).unwrap();
    assert_eq!(seqs(&page), vec![1, 2, 3]);
    assert_eq!(page.deliveries[0].persona, "mira");
    assert_eq!(
        (page.through_seq, page.more, page.pending_count),
        (3, false, 3)
    );
    // Personas do not see each other's mail.
    assert_eq!(inbox.ingest("otto", "x", &[d("$1", "a")]).unwrap(), vec![1]);
    assert_eq!(
        inbox.counts("mira").unwrap(),
        Counts {
            highest: 3,
            acked_through: 0,
            pending: 3
        }
    );
}

#[test]
fn restart_before_and_after_ack() {
    let path = dir("restart");
    {
        let inbox = Inbox::open(&path).unwrap();
        inbox
            .ingest("mira", "t1", &[d("$1", "a"), d("$2", "b"), d("$3", "c")])
            .unwrap();
    }
    let inbox = Inbox::open(&path).unwrap();
    let page = inbox.pending("mira", 0, 100, None).unwrap();
    assert_eq!(
        seqs(&page),
        vec![1, 2, 3],
        "same deliveries, same seqs after a restart"
    );
    assert_eq!(inbox.sync_token("mira").unwrap().as_deref(), Some("t1"));
    inbox.ack("mira", 2).unwrap();
    drop(inbox);
    let inbox = Inbox::open(&path).unwrap();
    assert_eq!(
        seqs(&inbox.pending("mira", 0, 100, None).unwrap()),
        vec![3],
        "nothing acked comes back"
    );
    // An acknowledged event handed back by sync is not mail again; seqs go on, never reused.
    assert_eq!(
        inbox
            .ingest("mira", "t2", &[d("$1", "a"), d("$4", "d")])
            .unwrap(),
        vec![4]
    );
}

#[test]
fn ack_is_idempotent_and_bounded() {
    let inbox = Inbox::open(&dir("ack")).unwrap();
    inbox
        .ingest("mira", "t", &[d("$1", "a"), d("$2", "b")])
        .unwrap();
    assert!(matches!(
        inbox.ack("mira", 3),
        Err(InboxError::AckBeyondHighest {
            through: 3,
            highest: 2
        })
    ));
    assert_eq!(
        inbox.counts("mira").unwrap().pending,
        2,
        "a refused ack changes nothing"
    );
    let c = inbox.ack("mira", 1).unwrap();
    assert_eq!((c.acked_through, c.pending), (1, 1));
    let again = inbox.ack("mira", 1).unwrap();
    assert_eq!(again, c);
    assert_eq!(inbox.ack("mira", 0).unwrap(), c, "an older ack is a no-op");
    assert!(matches!(
        inbox.ack("nobody", 1),
        Err(InboxError::AckBeyondHighest { highest: 0, .. })
    ));
}

#[test]
fn pages_never_drop_a_delivery_to_fit() {
    let inbox = Inbox::open(&dir("pages")).unwrap();
    let long = "x".repeat(2000);
    inbox
        .ingest(
            "mira",
            "t",
            &[d("$1", "short"), d("$2", &long), d("$3", "short")],
        )
        .unwrap();
    let p = inbox.pending("mira", 0, 2, None).unwrap();
    assert_eq!((seqs(&p), p.more, p.through_seq), (vec![1, 2], true, 2));
    // A byte cap stops the page before the big one instead of skipping it...
    let p = inbox.pending("mira", 0, 100, Some(500)).unwrap();
    assert_eq!((seqs(&p), p.more), (vec![1], true));
    // ...and a page that starts with it carries it cut and flagged.
    let p = inbox.pending("mira", 1, 100, Some(500)).unwrap();
    assert_eq!(seqs(&p), vec![2]);
    assert!(
        p.deliveries[0].truncated && p.deliveries[0].text.len() < 500,
        "{}",
        p.deliveries[0].text.len()
    );
    // Reading is not consuming.
    assert_eq!(
        inbox.pending("mira", 0, 100, None).unwrap().deliveries[1].text,
        long
    );
}

#[test]
fn receipts_survive_restarts() {
    let path = dir("receipts");
    let r = SendReceipt {
        request_id: "turn:mira:1-1:0".into(),
        status: Status::Ok,
        event_id: Some("$sent".into()),
        room_id: Some("!r".into()),
        error: None,
    };
    {
        let inbox = Inbox::open(&path).unwrap();
        assert_eq!(inbox.receipt("mira", &r.request_id).unwrap(), None);
        inbox.store_receipt("mira", &r).unwrap();
    }
    let inbox = Inbox::open(&path).unwrap();
    assert_eq!(
        inbox.receipt("mira", &r.request_id).unwrap(),
        Some(r.clone())
    );
    assert_eq!(inbox.receipt("otto", &r.request_id).unwrap(), None);
}

/// The receipt of a send `id` that went out.
fn sent(id: &str) -> SendReceipt {
    SendReceipt {
        request_id: id.into(),
        status: Status::Ok,
        event_id: Some("$sent".into()),
        room_id: Some("!r".into()),
        error: None,
    }
}

#[test]
fn receipts_a_turn_in_flight_still_needs_outlive_their_retention() {
    let path = dir("prune-keep");
    let inbox = Inbox::open(&path).unwrap();
    let now = u64::try_from(crate::clock::unix_ms()).unwrap();
    let r = sent;
    for id in [
        "turn:vera:5-7:0",
        "turn:vera:5-7:1",
        "turn:vera:1-4:0",
        "ops-1",
    ] {
        inbox.store_receipt("vera", &r(id)).unwrap();
    }
    // Her reply to 5-7 waits to be sent again (the homeserver was away for days).
    inbox
        .set_session_value("vera", retention::KEEP_RECEIPTS, Some("turn:vera:5-7:"))
        .unwrap();
    let keep = Retention {
        event_ids: std::time::Duration::from_secs(86_400),
        receipts: std::time::Duration::from_secs(86_400),
    };
    let p = inbox.prune(now + 3 * 86_400_000, keep).unwrap();
    assert_eq!(p.receipts, 2);
    assert!(inbox.receipt("vera", "turn:vera:5-7:0").unwrap().is_some());
    assert!(inbox.receipt("vera", "turn:vera:5-7:1").unwrap().is_some());
    assert!(inbox.receipt("vera", "turn:vera:1-4:0").unwrap().is_none());
    assert!(inbox.receipt("vera", "ops-1").unwrap().is_none());
    // Committed: they age out like the rest.
    inbox
        .set_session_value("vera", retention::KEEP_RECEIPTS, None)
        .unwrap();
    let p = inbox.prune(now + 3 * 86_400_000, keep).unwrap();
    assert_eq!(p.receipts, 2);
}

#[test]
fn event_ids_and_receipts_are_pruned_by_age_and_old_records_get_a_time() {
    let path = dir("prune");
    let inbox = Inbox::open(&path).unwrap();
    let now = u64::try_from(crate::clock::unix_ms()).unwrap();
    let day = 86_400_000u64;
    let r = sent;
    inbox
        .ingest("mira", "t1", &[d("$1", "a"), d("$2", "b")])
        .unwrap();
    inbox.store_receipt("mira", &r("req-1")).unwrap();
    // A record in the first layout (ids alone, a bare receipt): no time.
    inbox
        .stores()
        .unwrap()
        .tree
        .insert(ids_key("otto", 7), encode(&vec!["$old".to_owned()]))
        .unwrap();
    inbox
        .stores()
        .unwrap()
        .receipts
        .insert(key("otto", b"req-0"), encode(&r("req-0")))
        .unwrap();
    inbox.ingest("otto", "t", &[d("$old", "again")]).unwrap();
    assert_eq!(
        inbox.counts("otto").unwrap().highest,
        0,
        "deduped by the old record"
    );
    assert_eq!(inbox.receipt("otto", "req-0").unwrap(), Some(r("req-0")));
    let keep = Retention {
        event_ids: std::time::Duration::from_secs(3 * 86_400),
        receipts: std::time::Duration::from_secs(5 * 86_400),
    };
    // Two days on: nothing is old enough; the untimed records are stamped.
    let p = inbox.prune(now + 2 * day, keep).unwrap();
    assert_eq!(
        p,
        Pruned {
            id_records: 0,
            receipts: 0,
            stamped: 2
        }
    );
    assert_eq!(inbox.receipt("mira", "req-1").unwrap(), Some(r("req-1")));
    // Four days on: mira's ids go (a sync handing them back now delivers them again), her
    // receipt stays (5 days); the stamped records are two days old.
    let p = inbox.prune(now + 4 * day, keep).unwrap();
    assert_eq!(
        p,
        Pruned {
            id_records: 1,
            receipts: 0,
            stamped: 0
        }
    );
    let again = inbox.ingest("mira", "t2", &[d("$1", "a")]).unwrap();
    assert_eq!(again, vec![3], "pruned ids no longer dedupe");
    inbox.ingest("otto", "t", &[d("$old", "again")]).unwrap();
    assert_eq!(
        inbox.counts("otto").unwrap().highest,
        0,
        "stamped record still dedupes"
    );
    // Six days on: mira's receipt goes; of the stamped ones (4 days after their stamp) the
    // id record goes, the receipt not yet; mira's new id record is as old as her first.
    let p = inbox.prune(now + 6 * day, keep).unwrap();
    assert_eq!((p.receipts, p.id_records), (1, 2));
    assert_eq!(inbox.receipt("mira", "req-1").unwrap(), None);
    assert_eq!(inbox.receipt("otto", "req-0").unwrap(), Some(r("req-0")));
    let p = inbox.prune(now + 8 * day, keep).unwrap();
    assert_eq!((p.receipts, p.id_records), (1, 0));
    assert_eq!(inbox.receipt("otto", "req-0").unwrap(), None);
    // What is pending is never touched by retention.
    assert_eq!(inbox.counts("mira").unwrap().pending, 3);
    // Survives a restart.
    drop(inbox);
    let inbox = Inbox::open(&path).unwrap();
    assert_eq!(
        inbox.pending("mira", 0, 10, None).unwrap().deliveries.len(),
        3
    );
}

#[test]
fn open_waits_for_a_lock_being_released_and_gives_up_on_one_that_is_not() {
    let path = dir("lock");
    let held = Inbox::open(&path).unwrap();
    held.ingest("mira", "t", &[d("$1", "a")]).unwrap();
    // Held for good: a typed error after the bounded wait, not a hang.
    let started = std::time::Instant::now();
    let err = Inbox::open(&path).unwrap_err();
    assert!(matches!(err, InboxError::Locked { .. }), "{err}");
    assert!(
        started.elapsed() >= LOCK_WAIT,
        "gave up after {:?}",
        started.elapsed()
    );
    // Released a little later (as sled does after a drop): the open waits and succeeds.
    let releaser = std::thread::spawn(move || {
        std::thread::sleep(std::time::Duration::from_millis(200));
        drop(held);
    });
    let again = Inbox::open(&path).expect("opened once the lock was released");
    releaser.join().unwrap();
    assert_eq!(again.counts("mira").unwrap().highest, 1);
}

#[derive(Debug, Clone)]
enum Op {
    Ingest(Vec<u8>),
    Ack(u8),
    Retire(Vec<u8>),
    Reopen,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => proptest::collection::vec(0u8..40, 0..8).prop_map(Op::Ingest),
        2 => (0u8..50).prop_map(Op::Ack),
        2 => proptest::collection::vec(0u8..50, 0..6).prop_map(Op::Retire),
        1 => Just(Op::Reopen),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]
    /// Against a model: every event gets exactly one seq, seqs are dense and increasing,
    /// nothing acknowledged or retired reappears, nothing else is lost, across reopenings.
    #[test]
    fn matches_the_model(ops in proptest::collection::vec(op(), 1..30)) {
        let path = dir("prop");
        let mut inbox = Inbox::open(&path).unwrap();
        let mut model: BTreeMap<u64, String> = BTreeMap::new();
        let mut seen: BTreeMap<String, u64> = BTreeMap::new();
        let (mut next, mut acked) = (1u64, 0u64);
        for (i, op) in ops.into_iter().enumerate() {
            match op {
                Op::Ingest(events) => {
                    let batch: Vec<Delivery> = events.iter().map(|e| d(&format!("${e}"), "x")).collect();
                    let got = inbox.ingest("p", &format!("t{i}"), &batch).unwrap();
                    let mut want = Vec::new();
                    for e in &batch {
                        if !seen.contains_key(&e.event_id) {
                            seen.insert(e.event_id.clone(), next);
                            model.insert(next, e.event_id.clone());
                            want.push(next);
                            next += 1;
                        }
                    }
                    prop_assert_eq!(got, want);
                }
                Op::Ack(t) => {
                    let t = t as u64;
                    match inbox.ack("p", t) {
                        Ok(_) => {
                            prop_assert!(t < next);
                            if t > acked {
                                acked = t;
                                model.retain(|s, _| *s > t);
                            }
                        }
                        Err(InboxError::AckBeyondHighest { .. }) => prop_assert!(t >= next),
                        Err(e) => prop_assert!(false, "{e}"),
                    }
                }
                Op::Retire(seqs) => {
                    let seqs: Vec<u64> = seqs.into_iter().map(u64::from).collect();
                    let before = model.len();
                    model.retain(|s, _| !seqs.contains(s));
                    let r = inbox.retire("p", &seqs).unwrap();
                    prop_assert_eq!(r.lines as usize, before - model.len());
                    prop_assert_eq!(r.pending, model.len() as u64);
                }
                Op::Reopen => {
                    drop(inbox);
                    inbox = Inbox::open(&path).unwrap();
                }
            }
            let page = inbox.pending("p", 0, 1000, None).unwrap();
            let got: Vec<(u64, String)> = page.deliveries.iter().map(|d| (d.seq, d.event_id.clone())).collect();
            let want: Vec<(u64, String)> = model.iter().map(|(s, e)| (*s, e.clone())).collect();
            prop_assert_eq!(got, want);
            // A page from any point, of any size, across chunk boundaries.
            let (after, limit) = (i as u64 % (next + 1), 1 + i % 4);
            let page = inbox.pending("p", after, limit, None).unwrap();
            let want: Vec<u64> = model.keys().copied().filter(|s| *s > after).collect();
            prop_assert_eq!(seqs(&page), want.iter().copied().take(limit).collect::<Vec<_>>());
            prop_assert_eq!(page.more, want.len() > limit);
            prop_assert_eq!(inbox.counts("p").unwrap(), Counts { highest: next - 1, acked_through: acked, pending: model.len() as u64 });
        }
    }
}

pub(super) fn tl(room: &str, id: &str) -> TimelineLine {
    TimelineLine {
        room_id: room.into(),
        thread: None,
        line: wire::docs::ContextLine {
            event_id: id.into(),
            sender: "@a:l".into(),
            sender_name: None,
            ts: 1,
            text: format!("text {id}"),
        },
    }
}

#[test]
fn timelines_are_stored_per_room_bounded_and_survive_reopen() {
    let dir = dir("timeline");
    {
        let inbox = Inbox::open(&dir).unwrap();
        let lines: Vec<_> = (0..TIMELINE_CAP + 10)
            .map(|i| tl("!a", &format!("$a{i}")))
            .collect();
        inbox
            .ingest_sync(
                "p",
                "t1",
                SyncWrite {
                    lines: &lines,
                    ..Default::default()
                },
            )
            .unwrap();
        inbox
            .ingest_sync(
                "p",
                "t2",
                SyncWrite {
                    lines: &[tl("!b", "$b0"), tl("!a", "$last")],
                    ..Default::default()
                },
            )
            .unwrap();
        let a = inbox.timeline("p", "!a").unwrap();
        assert_eq!(a.len(), TIMELINE_CAP);
        assert_eq!(a.last().unwrap().line.event_id, "$last");
        assert_eq!(a[0].line.event_id, "$a11", "the oldest lines go first");
        assert!(inbox.timeline("other", "!a").unwrap().is_empty());
    }
    let inbox = Inbox::open(&dir).unwrap();
    assert_eq!(inbox.timeline("p", "!b").unwrap(), vec![tl("!b", "$b0")]);
    assert_eq!(inbox.sync_token("p").unwrap().as_deref(), Some("t2"));
}

#[test]
fn session_values_are_set_removed_and_kept_apart_from_the_inbox() {
    let dir = dir("session-values");
    {
        let inbox = Inbox::open(&dir).unwrap();
        inbox
            .set_session_value("p", "session_id", Some("abc"))
            .unwrap();
        inbox
            .set_session_value("p", "token", Some("not the sync token"))
            .unwrap();
        inbox
            .set_session_value("q", "session_id", Some("other"))
            .unwrap();
        assert_eq!(inbox.sync_token("p").unwrap(), None);
        inbox.set_session_value("q", "session_id", None).unwrap();
        // Several at once: one set, one removed.
        inbox
            .set_session_values("p", &[("policy", Some("{}")), ("token", None)])
            .unwrap();
    }
    let inbox = Inbox::open(&dir).unwrap();
    assert_eq!(
        inbox.session_value("p", "session_id").unwrap().as_deref(),
        Some("abc")
    );
    assert_eq!(inbox.session_value("q", "session_id").unwrap(), None);
    assert_eq!(
        inbox.session_value("p", "policy").unwrap().as_deref(),
        Some("{}")
    );
    assert_eq!(inbox.session_value("p", "token").unwrap(), None);
}

#[test]
fn held_events_keep_their_first_wait_and_leave_when_released_or_delivered() {
    let dir = dir("held");
    let inbox = Inbox::open(&dir).unwrap();
    let held = |id: &str, since| Held {
        since_ms: since,
        delivery: d(id, "(undecryptable)"),
    };
    inbox
        .ingest_sync(
            "p",
            "t1",
            SyncWrite {
                hold: &[held("$x", 100), held("$y", 100)],
                ..Default::default()
            },
        )
        .unwrap();
    // A replay of the same response does not restart the wait.
    inbox
        .ingest_sync(
            "p",
            "t1",
            SyncWrite {
                hold: &[held("$x", 999)],
                ..Default::default()
            },
        )
        .unwrap();
    assert_eq!(
        inbox.held("p").unwrap(),
        vec![held("$x", 100), held("$y", 100)]
    );
    // $x decrypted: delivered and released in one batch.
    let seqs = inbox
        .ingest_sync(
            "p",
            "t2",
            SyncWrite {
                deliveries: &[d("$x", "clear text")],
                release: &["$x".to_owned()],
                ..Default::default()
            },
        )
        .unwrap();
    assert_eq!(seqs, vec![1]);
    assert_eq!(inbox.held("p").unwrap(), vec![held("$y", 100)]);
    // A delivered event is never held again, even if a replay shows it undecryptable.
    inbox
        .ingest_sync(
            "p",
            "t2",
            SyncWrite {
                hold: &[held("$x", 5)],
                ..Default::default()
            },
        )
        .unwrap();
    assert_eq!(inbox.held("p").unwrap().len(), 1);
    assert_eq!(inbox.counts("p").unwrap().pending, 1);
}

#[test]
fn a_partly_acknowledged_response_keeps_its_rest_across_reopen() {
    let path = dir("partial");
    {
        let inbox = Inbox::open(&path).unwrap();
        let batch: Vec<_> = (0..5).map(|i| d(&format!("${i}"), "x")).collect();
        inbox.ingest("p", "t1", &batch).unwrap();
        inbox.ingest("p", "t2", &[d("$5", "y")]).unwrap();
        inbox.ack("p", 3).unwrap();
        assert_eq!(
            seqs(&inbox.pending("p", 0, 10, None).unwrap()),
            vec![4, 5, 6]
        );
        // Asking from before the watermark does not bring acknowledged ones back.
        assert_eq!(seqs(&inbox.pending("p", 1, 2, None).unwrap()), vec![4, 5]);
    }
    let inbox = Inbox::open(&path).unwrap();
    assert_eq!(
        seqs(&inbox.pending("p", 0, 10, None).unwrap()),
        vec![4, 5, 6]
    );
    inbox.ack("p", 5).unwrap();
    assert_eq!(seqs(&inbox.pending("p", 0, 10, None).unwrap()), vec![6]);
    // The acknowledged events are still known: a replay makes nothing new.
    assert!(inbox.ingest("p", "t3", &[d("$0", "x")]).unwrap().is_empty());
    inbox.ack("p", 6).unwrap();
    assert_eq!(
        inbox.stores().unwrap().tree.scan_prefix([CHUNK]).count(),
        0,
        "no chunk is left"
    );
}

#[test]
fn dedupe_remembers_a_window_of_ids_across_reopen() {
    let path = dir("window");
    {
        let inbox = Inbox::open(&path).unwrap().with_dedupe_window(4);
        for i in 0..6 {
            inbox.ingest("p", "t", &[d(&format!("${i}"), "x")]).unwrap();
        }
        // The last four ids are remembered; the oldest are forgotten, records and all.
        assert!(inbox
            .ingest("p", "t", &[d("$5", "x"), d("$2", "x")])
            .unwrap()
            .is_empty());
        assert_eq!(
            inbox
                .stores()
                .unwrap()
                .tree
                .scan_prefix(kkey(IDS, "p", b""))
                .count(),
            4
        );
        assert_eq!(inbox.ingest("p", "t", &[d("$0", "x")]).unwrap(), vec![7]);
    }
    // After a reopen the set is rebuilt from the records (the default window is larger).
    let inbox = Inbox::open(&path).unwrap();
    assert!(inbox
        .ingest("p", "t", &[d("$3", "x"), d("$0", "x")])
        .unwrap()
        .is_empty());
    assert_eq!(inbox.ingest("p", "t", &[d("$1", "x")]).unwrap(), vec![8]);
}

#[test]
fn an_inbox_of_the_first_layout_is_converted_with_nothing_lost() {
    let path = dir("convert");
    {
        // Written the way the first layout did: a key per delivery, per event, per line.
        let db = sled::open(&path).unwrap();
        let tree = db.open_tree("inbox").unwrap();
        for seq in [2u64, 3] {
            let mut stored = d(&format!("${seq}"), "old");
            stored.seq = seq;
            stored.persona = "p".into();
            tree.insert(kkey(OLD_DELIVERY, "p", &seq.to_be_bytes()), encode(&stored))
                .unwrap();
        }
        for seq in 1u64..=3 {
            tree.insert(
                kkey(OLD_EVENT, "p", format!("${seq}").as_bytes()),
                &seq.to_be_bytes(),
            )
            .unwrap();
        }
        for i in 0u64..2 {
            let mut rest = b"!a".to_vec();
            rest.push(0);
            rest.extend_from_slice(&i.to_be_bytes());
            tree.insert(
                kkey(OLD_TIMELINE, "p", &rest),
                encode(&tl("!a", &format!("$t{i}"))),
            )
            .unwrap();
        }
        tree.insert(key("p", b"next_seq"), &4u64.to_be_bytes())
            .unwrap();
        tree.insert(key("p", b"acked"), &1u64.to_be_bytes())
            .unwrap();
        db.flush().unwrap();
    }
    let inbox = Inbox::open(&path).unwrap();
    let page = inbox.pending("p", 0, 10, None).unwrap();
    assert_eq!(seqs(&page), vec![2, 3]);
    assert_eq!(page.deliveries[0].text, "old");
    assert!(inbox
        .ingest("p", "t", &[d("$1", "x"), d("$3", "x")])
        .unwrap()
        .is_empty());
    assert_eq!(inbox.ingest("p", "t", &[d("$new", "x")]).unwrap(), vec![4]);
    let lines: Vec<_> = inbox
        .timeline("p", "!a")
        .unwrap()
        .into_iter()
        .map(|l| l.line.event_id)
        .collect();
    assert_eq!(lines, vec!["$t0", "$t1"]);
    for kind in [OLD_DELIVERY, OLD_EVENT, OLD_TIMELINE] {
        assert_eq!(inbox.stores().unwrap().tree.scan_prefix([kind]).count(), 0);
    }
    inbox.ack("p", 4).unwrap();
    assert_eq!(inbox.counts("p").unwrap().pending, 0);
}

fn note(id: &str, kind: &str, text: &str) -> wire::docs::NoteRequest {
    wire::docs::NoteRequest {
        persona: "mira".into(),
        note_id: id.into(),
        kind: kind.into(),
        text: text.into(),
        wake: false,
    }
}

fn note_texts(inbox: &Inbox) -> Vec<String> {
    inbox
        .pending_notes("mira")
        .unwrap()
        .into_iter()
        .map(|n| n.text)
        .collect()
}

#[test]
fn notes_are_idempotent_replace_their_kind_and_survive_reopening() {
    let path = dir("notes");
    let inbox = Inbox::open(&path).unwrap();
    let put = inbox.put_note(&note("a", "state", "calm"), 1).unwrap();
    assert_eq!((put.duplicate, put.pending), (false, 1));
    inbox
        .put_note(&note("b", "heads-up", "ops at 9"), 2)
        .unwrap();
    // The same id again (even with other text) changes nothing.
    let again = inbox.put_note(&note("a", "state", "changed"), 3).unwrap();
    assert_eq!((again.duplicate, again.pending), (true, 2));
    // A newer state replaces the waiting one; other kinds are appended.
    let newer = inbox.put_note(&note("c", "state", "tired"), 4).unwrap();
    assert_eq!(newer.pending, 2);
    inbox.put_note(&note("d", "heads-up", "lunch"), 5).unwrap();
    assert_eq!(note_texts(&inbox), ["ops at 9", "tired", "lunch"]);
    assert_eq!(
        inbox.latest_notes("mira").unwrap(),
        [("state".to_owned(), "tired".to_owned())]
    );
    assert!(inbox.pending_notes("other").unwrap().is_empty());
    drop(inbox);

    let inbox = Inbox::open(&path).unwrap();
    assert_eq!(note_texts(&inbox), ["ops at 9", "tired", "lunch"]);
    let seqs: Vec<u64> = inbox
        .pending_notes("mira")
        .unwrap()
        .iter()
        .map(|n| n.seq)
        .collect();
    assert_eq!(seqs, [2, 3, 4], "a replaced note keeps its seq unused");
    // Shown notes are gone; their ids still make a repeat a duplicate.
    inbox
        .commit_turn(
            "mira",
            &TurnCommit {
                notes_shown: &seqs[..2],
                turn_id: "t",
                ..TurnCommit::default()
            },
        )
        .unwrap();
    assert_eq!(note_texts(&inbox), ["lunch"]);
    assert!(
        inbox
            .put_note(&note("b", "heads-up", "x"), 6)
            .unwrap()
            .duplicate
    );
    // A state after the shown one is new mail for her, and the latest.
    inbox.put_note(&note("e", "state", "rested"), 7).unwrap();
    assert_eq!(note_texts(&inbox), ["lunch", "rested"]);
    assert_eq!(inbox.latest_notes("mira").unwrap()[0].1, "rested");
}

#[test]
fn a_turn_commits_its_ack_notes_and_extensions_together() {
    let path = dir("outbox");
    let inbox = Inbox::open(&path).unwrap();
    inbox
        .ingest("mira", "t1", &[d("$1", "a"), d("$2", "b"), d("$3", "c")])
        .unwrap();
    inbox
        .put_note(&note("n1", "runs", "run 7 done"), 1)
        .unwrap();
    let shown: Vec<u64> = inbox
        .pending_notes("mira")
        .unwrap()
        .iter()
        .map(|n| n.seq)
        .collect();
    let fields = vec![
        (
            "start_self_run".to_owned(),
            serde_json::json!({"brief": "tidy the wiki"}),
        ),
        ("remember".to_owned(), serde_json::json!([{"text": "x"}])),
    ];
    // An ack beyond the highest seq refuses the whole commit: nothing changes.
    let bad = inbox.commit_turn(
        "mira",
        &TurnCommit {
            ack_through: Some(9),
            notes_shown: &shown,
            turn_id: "turn:mira:1-9",
            extensions: &fields,
            at_ms: 5,
            values: &[("correction", Some("not this"))],
        },
    );
    assert!(matches!(bad, Err(InboxError::AckBeyondHighest { .. })));
    assert_eq!(inbox.pending_notes("mira").unwrap().len(), 1);
    assert_eq!(inbox.session_value("mira", "correction").unwrap(), None);
    inbox
        .set_session_value("mira", "reply", Some("{}"))
        .unwrap();
    assert_eq!(
        inbox
            .pending_extensions("mira", 0, 10)
            .unwrap()
            .pending_count,
        0
    );

    let c = inbox
        .commit_turn(
            "mira",
            &TurnCommit {
                ack_through: Some(2),
                notes_shown: &shown,
                turn_id: "turn:mira:1-2",
                extensions: &fields,
                at_ms: 6,
                // Session values go with the turn: one set, one removed.
                values: &[("correction", Some("fix it")), ("reply", None)],
            },
        )
        .unwrap();
    assert_eq!((c.acked_through, c.pending), (2, 1));
    assert!(inbox.pending_notes("mira").unwrap().is_empty());
    assert_eq!(
        inbox
            .session_value("mira", "last_turn_ms")
            .unwrap()
            .as_deref(),
        Some("6")
    );
    drop(inbox);

    let inbox = Inbox::open(&path).unwrap();
    assert_eq!(
        inbox
            .session_value("mira", "correction")
            .unwrap()
            .as_deref(),
        Some("fix it")
    );
    assert_eq!(inbox.session_value("mira", "reply").unwrap(), None);
    let page = inbox.pending_extensions("mira", 0, 1).unwrap();
    assert_eq!(page.extensions.len(), 1);
    assert_eq!(page.extensions[0].field, "start_self_run");
    assert_eq!(page.extensions[0].turn_id, "turn:mira:1-2");
    assert_eq!(page.extensions[0].value["brief"], "tidy the wiki");
    assert!(page.more);
    assert_eq!(page.pending_count, 2);
    // Pages do not consume; acks do, idempotently, and not beyond the highest.
    let all = inbox.pending_extensions("mira", 0, 10).unwrap();
    assert_eq!(all.extensions.len(), 2);
    assert!(!all.more);
    assert!(matches!(
        inbox.ack_extensions("mira", 3),
        Err(InboxError::AckBeyondHighest {
            through: 3,
            highest: 2
        })
    ));
    assert_eq!(inbox.ack_extensions("mira", 1).unwrap(), 1);
    assert_eq!(inbox.ack_extensions("mira", 1).unwrap(), 1);
    let rest = inbox.pending_extensions("mira", 0, 10).unwrap();
    assert_eq!(rest.extensions[0].seq, 2);
    assert_eq!(rest.extensions[0].value, serde_json::json!([{"text": "x"}]));
    assert_eq!(inbox.ack_extensions("mira", 2).unwrap(), 0);
    let none = inbox.pending_extensions("mira", 0, 10).unwrap();
    assert!(none.extensions.is_empty() && !none.more && none.pending_count == 0);
    // The next turn's fields continue the seqs.
    inbox
        .commit_turn(
            "mira",
            &TurnCommit {
                ack_through: Some(3),
                turn_id: "turn:mira:3-3",
                extensions: &fields[1..],
                ..TurnCommit::default()
            },
        )
        .unwrap();
    assert_eq!(
        inbox.pending_extensions("mira", 0, 10).unwrap().extensions[0].seq,
        3
    );
    assert_eq!(inbox.counts("mira").unwrap().pending, 0);
}

#[test]
fn a_redaction_blanks_pending_mail_its_context_and_the_timeline_and_drops_what_is_held() {
    let dir = dir("redacted");
    let inbox = Inbox::open(&dir).unwrap();
    // A line of room !r saying `text`.
    let said = |id: &str, text: &str| {
        let mut l = tl("!r", id);
        l.line.text = text.into();
        l
    };
    let mut after = d("$b", "ignore that");
    after.context = vec![said("$a", "my password is hunter2").line];
    let timeline = [
        said("$a", "my password is hunter2"),
        said("$b", "ignore that"),
    ];
    inbox
        .ingest_sync(
            "p",
            "t1",
            SyncWrite {
                deliveries: &[d("$a", "my password is hunter2"), after, d("$c", "kept")],
                lines: &timeline,
                hold: &[Held {
                    since_ms: 1,
                    delivery: d("$h", "(undecryptable)"),
                }],
                ..Default::default()
            },
        )
        .unwrap();
    let redacted = [
        ("!r".to_owned(), "$a".to_owned()),
        ("!r".to_owned(), "$h".to_owned()),
    ];
    inbox
        .ingest_sync(
            "p",
            "t2",
            SyncWrite {
                redacted: &redacted,
                ..Default::default()
            },
        )
        .unwrap();
    let page = inbox.pending("p", 0, 10, None).unwrap();
    let texts: Vec<&str> = page.deliveries.iter().map(|d| d.text.as_str()).collect();
    assert_eq!(texts, [crate::event::DELETED, "ignore that", "kept"]);
    assert_eq!(page.deliveries[1].context[0].text, crate::event::DELETED);
    // Seqs and counts stand: nothing is renumbered, the blanked mail is acked like any.
    assert_eq!(seqs(&page), vec![1, 2, 3]);
    assert_eq!(inbox.counts("p").unwrap().pending, 3);
    let kept: Vec<String> = inbox
        .timeline("p", "!r")
        .unwrap()
        .into_iter()
        .map(|l| l.line.text)
        .collect();
    assert_eq!(kept, [crate::event::DELETED, "ignore that"]);
    assert!(inbox.held("p").unwrap().is_empty());
    // Acked mail is not touched (nor read back to life).
    inbox.ack("p", 3).unwrap();
    inbox
        .ingest_sync(
            "p",
            "t3",
            SyncWrite {
                redacted: &[("!r".to_owned(), "$c".to_owned())],
                ..Default::default()
            },
        )
        .unwrap();
    assert!(inbox
        .pending("p", 0, 10, None)
        .unwrap()
        .deliveries
        .is_empty());
}

#[test]
fn the_extensions_watermark_only_moves_forward_under_concurrent_acks() {
    let path = dir("ext-race");
    let inbox = Inbox::open(&path).unwrap();
    let fields: Vec<(String, serde_json::Value)> = (0..200)
        .map(|i| (format!("f{i}"), serde_json::json!(i)))
        .collect();
    inbox
        .commit_turn(
            "mira",
            &TurnCommit {
                turn_id: "turn:mira:n1-1",
                extensions: &fields,
                at_ms: 1,
                ..TurnCommit::default()
            },
        )
        .unwrap();
    // Four clients ack the same marks at once, each in its own order.
    let threads: Vec<_> = (0..4u64)
        .map(|t| {
            let inbox = inbox.clone();
            std::thread::spawn(move || {
                let mut marks: Vec<u64> = (1..=200).collect();
                // A different order per thread: a stride through the marks.
                let stride = [1, 7, 13, 31][t as usize];
                marks.sort_by_key(|m| (m * stride) % 211);
                for m in marks {
                    inbox.ack_extensions("mira", m).unwrap();
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let page = inbox.pending_extensions("mira", 0, 10).unwrap();
    assert_eq!(page.pending_count, 0, "the watermark moved back");
    assert!(page.extensions.is_empty());
}

#[test]
fn a_batch_set_aside_leaves_her_mail_and_comes_back_on_retry_with_new_seqs() {
    let path = dir("aside");
    let inbox = Inbox::open(&path).unwrap();
    inbox
        .ingest("p", "t1", &[d("$1", "a"), d("$2", "b"), d("$3", "c")])
        .unwrap();
    inbox
        .set_session_value("p", "inflight", Some("1-2"))
        .unwrap();
    let page = inbox.pending("p", 0, 10, None).unwrap();
    let c = inbox
        .set_aside("p", &page.deliveries[..2], "HTTP 400", 5)
        .unwrap();
    assert_eq!((c.acked_through, c.pending), (2, 1));
    assert_eq!(inbox.session_value("p", "inflight").unwrap(), None);
    assert_eq!(seqs(&inbox.pending("p", 0, 10, None).unwrap()), vec![3]);
    drop(inbox);
    let inbox = Inbox::open(&path).unwrap();
    let list = inbox.set_aside_list("p").unwrap();
    assert_eq!(list.len(), 1);
    assert_eq!(
        (list[0].id, list[0].why.as_str(), list[0].told),
        (1, "HTTP 400", false)
    );
    inbox.set_aside_told("p", &[1]).unwrap();
    assert!(inbox.set_aside_list("p").unwrap()[0].told);
    // Retried: after what is pending, with seqs never used before; a sync meanwhile is not
    // disturbed.
    assert_eq!(inbox.retry_set_aside("p", 1).unwrap(), Some(vec![4, 5]));
    assert_eq!(inbox.ingest("p", "t2", &[d("$4", "d")]).unwrap(), vec![6]);
    let page = inbox.pending("p", 0, 10, None).unwrap();
    let texts: Vec<&str> = page.deliveries.iter().map(|d| d.text.as_str()).collect();
    assert_eq!(
        (seqs(&page), texts),
        (vec![3, 4, 5, 6], vec!["c", "a", "b", "d"])
    );
    assert!(inbox.set_aside_list("p").unwrap().is_empty());
    assert_eq!(inbox.retry_set_aside("p", 1).unwrap(), None);
    // Dropped: gone for good.
    let page = inbox.pending("p", 0, 1, None).unwrap();
    inbox
        .set_aside("p", &page.deliveries, "HTTP 413", 6)
        .unwrap();
    assert!(inbox.drop_set_aside("p", 3).unwrap());
    assert!(!inbox.drop_set_aside("p", 3).unwrap());
    assert!(inbox.set_aside_list("p").unwrap().is_empty());
    assert_eq!(inbox.counts("p").unwrap().pending, 3);
}

#[test]
fn waiting_notes_are_capped_in_count_and_bytes_oldest_dropped_and_counted() {
    use super::notes::{MAX_WAITING_NOTES, MAX_WAITING_NOTE_BYTES};
    let path = dir("notes-cap");
    let inbox = Inbox::open(&path).unwrap();
    for i in 0..MAX_WAITING_NOTES + 5 {
        let put = inbox
            .put_note(&note(&format!("n{i}"), "log", "short"), 1)
            .unwrap();
        assert!(put.pending as usize <= MAX_WAITING_NOTES);
    }
    let texts = inbox.pending_notes("mira").unwrap();
    assert_eq!(texts.len(), MAX_WAITING_NOTES);
    assert_eq!(texts[0].note_id, "n5", "the oldest went first");
    assert_eq!(inbox.notes_dropped("mira").unwrap(), 5);
    // Bytes: three big notes do not fit together; the newest is always kept.
    let big = "b".repeat(MAX_WAITING_NOTE_BYTES / 2);
    for i in 0..3 {
        inbox
            .put_note(&note(&format!("big{i}"), "log", &big), 2)
            .unwrap();
    }
    let waiting = inbox.pending_notes("mira").unwrap();
    let bytes: usize = waiting.iter().map(|n| n.text.len()).sum();
    assert!(bytes <= MAX_WAITING_NOTE_BYTES, "{bytes}");
    assert_eq!(waiting.last().map(|n| n.note_id.as_str()), Some("big2"));
}
