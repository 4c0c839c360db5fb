use std::path::{Path, PathBuf};

use wire::docs::SendReceipt;

use super::super::tests::{d, dir, tl};
use super::*;
use crate::inbox::{SyncWrite, TimelineLine};

/// Everything a reader of the inbox can see of `persona`, to compare before and after.
fn snapshot(inbox: &Inbox, persona: &str) -> String {
    let counts = inbox.counts(persona).unwrap();
    let page = inbox.pending(persona, 0, 100_000, None).unwrap();
    let rooms = inbox.timeline_rooms(persona).unwrap();
    let lines: Vec<Vec<TimelineLine>> = rooms
        .iter()
        .map(|r| inbox.timeline(persona, r).unwrap())
        .collect();
    format!(
        "{counts:?} {:?} {rooms:?} {lines:?} {:?} {:?} {:?} {:?}",
        page.deliveries,
        inbox.sync_token(persona).unwrap(),
        inbox.session_value(persona, "id").unwrap(),
        inbox.receipt(persona, "req-1").unwrap(),
        inbox.held(persona).unwrap(),
    )
}

fn receipt(id: &str) -> SendReceipt {
    SendReceipt {
        request_id: id.into(),
        status: wire::docs::Status::Ok,
        event_id: Some(format!("$sent-{id}")),
        room_id: Some("!r".into()),
        error: None,
    }
}

/// `responses` sync responses of 100 deliveries (~300 bytes of text) and their lines, every
/// tenth acknowledging everything before it.
fn fill(inbox: &Inbox, persona: &str, responses: u64, from: u64) {
    for r in from..from + responses {
        let batch: Vec<_> = (0..100)
            .map(|i| d(&format!("${persona}-{r}-{i}"), &"words ".repeat(50)))
            .collect();
        let lines: Vec<_> = (0..100)
            .map(|i| tl(&format!("!room{}", i % 3), &format!("${persona}-{r}-{i}")))
            .collect();
        let write = SyncWrite {
            deliveries: &batch,
            lines: &lines,
            ..SyncWrite::default()
        };
        inbox.ingest_sync(persona, &format!("s{r}"), write).unwrap();
        if r % 10 == 9 {
            let c = inbox.counts(persona).unwrap();
            inbox.ack(persona, c.highest).unwrap();
        }
    }
}

fn leftovers(path: &Path) -> Vec<PathBuf> {
    let Siblings { copy, marker, old } = Siblings::of(path);
    [copy, marker, old]
        .into_iter()
        .filter(|p| p.exists())
        .collect()
}

#[test]
fn compaction_gives_back_the_disk_and_keeps_every_record() {
    let path = dir("compact");
    let inbox = Inbox::open(&path).unwrap();
    fill(&inbox, "mira", 405, 0);
    inbox
        .set_session_value("mira", "id", Some("sess-1"))
        .unwrap();
    inbox.store_receipt("mira", &receipt("req-1")).unwrap();
    let before = snapshot(&inbox, "mira");
    assert_eq!(inbox.counts("mira").unwrap().pending, 500, "{before}");
    let disk = inbox.disk_bytes();

    let c = inbox.compact().unwrap();
    println!("{c:?}");
    assert_eq!(c.before, disk);
    // What stays is the live records and sled's own files (segments, config: 1-1.5 MiB seen).
    assert!(
        c.after < c.before / 2 && c.after < 2 * c.live + (2 << 20),
        "compaction gave back too little: {} -> {} bytes ({} live)",
        c.before,
        c.after,
        c.live
    );
    assert_eq!(inbox.disk_bytes(), c.after);
    assert_eq!(snapshot(&inbox, "mira"), before);
    assert_eq!(leftovers(&path), Vec::<PathBuf>::new());
    // Deduplication still knows the acknowledged events, and seqs go on.
    assert_eq!(
        inbox
            .ingest("mira", "t", &[d("$mira-404-7", "again")])
            .unwrap(),
        Vec::<u64>::new()
    );
    assert_eq!(
        inbox.ingest("mira", "t", &[d("$new", "new")]).unwrap(),
        vec![40_501]
    );
    // And the compacted store is what opens next time.
    let after = snapshot(&inbox, "mira");
    drop(inbox);
    let inbox = Inbox::open(&path).unwrap();
    assert_eq!(snapshot(&inbox, "mira"), after);
}

#[test]
fn compaction_while_others_write_loses_nothing() {
    let path = dir("compact-busy");
    let inbox = Inbox::open(&path).unwrap();
    fill(&inbox, "mira", 25, 0);
    let writer = {
        let inbox = inbox.clone();
        std::thread::spawn(move || fill(&inbox, "otto", 60, 0))
    };
    let acker = {
        let inbox = inbox.clone();
        std::thread::spawn(move || {
            for i in 0..300 {
                inbox
                    .store_receipt("mira", &receipt(&format!("r{i}")))
                    .unwrap();
                let (_, _) = inbox.ack_unflushed("mira", 2_001 + i).unwrap();
                inbox.flush().unwrap();
            }
        })
    };
    let mut compactions = 0;
    while !writer.is_finished() || !acker.is_finished() {
        inbox.compact().unwrap();
        compactions += 1;
    }
    writer.join().unwrap();
    acker.join().unwrap();
    assert!(compactions >= 2, "only {compactions} compactions ran");
    let check = |inbox: &Inbox| {
        let otto = inbox.counts("otto").unwrap();
        assert_eq!(otto.highest, 6_000);
        assert_eq!(otto.acked_through, 6_000);
        let mira = inbox.counts("mira").unwrap();
        assert_eq!((mira.highest, mira.acked_through), (2_500, 2_300));
        let page = inbox.pending("mira", 0, 10_000, None).unwrap();
        let expected: Vec<u64> = (2_301..=2_500).collect();
        let got: Vec<u64> = page.deliveries.iter().map(|d| d.seq).collect();
        assert_eq!(got, expected);
        for i in 0..300 {
            assert!(
                inbox.receipt("mira", &format!("r{i}")).unwrap().is_some(),
                "receipt r{i} lost"
            );
        }
    };
    check(&inbox);
    drop(inbox);
    check(&Inbox::open(&path).unwrap());
}

#[test]
fn compact_if_wasteful_looks_at_the_live_share_and_not_too_often() {
    let path = dir("compact-when");
    let inbox = Inbox::open(&path).unwrap();
    fill(&inbox, "mira", 100, 0);
    drop(inbox);
    // Reopened: the first check counts, whatever the files were at the open.
    let inbox = Inbox::open(&path).unwrap();
    let disk = inbox.disk_bytes();
    let never = CompactWhen {
        min_bytes: disk + 1,
        ..CompactWhen::default()
    };
    assert_eq!(inbox.compact_if_wasteful(never).unwrap(), None);
    // Everything pending: the live records are most of the files.
    let unacked = dir("compact-when-unacked");
    let full = Inbox::open(&unacked).unwrap();
    for r in 0..30 {
        let batch: Vec<_> = (0..100)
            .map(|i| d(&format!("$k{r}-{i}"), &"words ".repeat(200)))
            .collect();
        full.ingest("mira", "t", &batch).unwrap();
    }
    let when = CompactWhen {
        min_bytes: 0,
        ..CompactWhen::default()
    };
    assert_eq!(full.compact_if_wasteful(when).unwrap(), None);
    // Wasteful, but more is live than a copy may hold the inbox for.
    let capped = CompactWhen {
        min_bytes: 0,
        max_live_bytes: 1_000,
        ..CompactWhen::default()
    };
    assert_eq!(inbox.compact_if_wasteful(capped).unwrap(), None);
    drop(inbox);
    let inbox = Inbox::open(&path).unwrap();
    // Mostly acknowledged: compacted, and not looked at again before the files double.
    let c = inbox.compact_if_wasteful(when).unwrap().expect("compacted");
    assert!(c.after < c.before);
    assert_eq!(inbox.compact_if_wasteful(when).unwrap(), None);
    fill(&inbox, "mira", 300, 100);
    assert!(inbox.compact_if_wasteful(when).unwrap().is_some());
}

/// An inbox at `path` whose session value `id` says which one it is.
fn made(path: &Path, which: &str) {
    let inbox = Inbox::open(path).unwrap();
    inbox.ingest("mira", "t", &[d("$1", "a")]).unwrap();
    inbox.set_session_value("mira", "id", Some(which)).unwrap();
}

fn which(path: &Path) -> Option<String> {
    let inbox = Inbox::open(path).unwrap();
    assert_eq!(inbox.counts("mira").unwrap().highest, 1);
    assert_eq!(leftovers(path), Vec::<PathBuf>::new());
    inbox.session_value("mira", "id").unwrap()
}

#[test]
fn an_open_recovers_from_a_crash_at_every_step_of_a_compaction() {
    let marker = |p: &Path| std::fs::write(sibling(p, ".compacted"), b"").unwrap();
    // Copying, no marker yet: the copy is dropped.
    let p = dir("crash-copying");
    made(&p, "original");
    std::fs::create_dir_all(sibling(&p, ".compacting")).unwrap();
    std::fs::write(sibling(&p, ".compacting").join("db"), b"half").unwrap();
    assert_eq!(which(&p).as_deref(), Some("original"));
    // Copy complete, swap not begun: the original stays.
    let p = dir("crash-marked");
    made(&p, "original");
    made(&sibling(&p, ".compacting"), "copy");
    marker(&p);
    assert_eq!(which(&p).as_deref(), Some("original"));
    // The original renamed away, the copy not yet in: the copy goes in.
    let p = dir("crash-between");
    made(&sibling(&p, ".old"), "original");
    made(&sibling(&p, ".compacting"), "copy");
    marker(&p);
    assert_eq!(which(&p).as_deref(), Some("copy"));
    // Swapped, marker and old files not yet removed.
    let p = dir("crash-swapped");
    made(&sibling(&p, ".old"), "original");
    made(&p, "copy");
    marker(&p);
    assert_eq!(which(&p).as_deref(), Some("copy"));
    // Swapped and marker removed; only the old files are left.
    let p = dir("crash-old-left");
    made(&sibling(&p, ".old"), "original");
    made(&p, "copy");
    assert_eq!(which(&p).as_deref(), Some("copy"));
    // A failed swap that could not put the original back.
    let p = dir("crash-not-restored");
    made(&sibling(&p, ".old"), "original");
    assert_eq!(which(&p).as_deref(), Some("original"));
}

/// The ear, the turn loop and the mouth call the inbox on the gateway's runtime workers. While a
/// compaction holds the store their call waits, but the worker's other tasks must go on: with one
/// worker, a ticker keeps ticking through a 300 ms wait (without the hand-off it would not tick
/// at all until the wait ends).
#[test]
fn a_call_waiting_for_a_compaction_does_not_stall_the_runtime() {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    let path = dir("compact-runtime");
    let inbox = Inbox::open(&path).unwrap();
    fill(&inbox, "mira", 3, 0);
    let before = inbox.counts("mira").unwrap();

    // Hold the store as a compaction does, for 300 ms, on a thread of its own.
    let (held_tx, held_rx) = std::sync::mpsc::channel();
    let stores = inbox.stores.clone();
    let holder = std::thread::spawn(move || {
        let guard = stores.write();
        held_tx.send(()).unwrap();
        std::thread::sleep(Duration::from_millis(300));
        drop(guard);
    });
    held_rx.recv().unwrap();

    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_time()
        .build()
        .unwrap();
    let (waited, ticked, counts) = rt.block_on(async move {
        let ticks = Arc::new(AtomicU64::new(0));
        let t = ticks.clone();
        let ticker = tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_millis(1)).await;
                t.fetch_add(1, Ordering::Relaxed);
            }
        });
        // Let the ticker start on the one worker.
        tokio::time::sleep(Duration::from_millis(20)).await;
        let t = ticks.clone();
        let (waited, ticked, counts) = tokio::spawn(async move {
            let start = Instant::now();
            let from = t.load(Ordering::Relaxed);
            let counts = inbox.counts("mira");
            (start.elapsed(), t.load(Ordering::Relaxed) - from, counts)
        })
        .await
        .unwrap();
        ticker.abort();
        (waited, ticked, counts)
    });
    holder.join().unwrap();
    println!("waited {waited:?} while the ticker ticked {ticked} times");
    assert!(
        waited >= Duration::from_millis(200),
        "the call did not wait: {waited:?}"
    );
    assert_eq!(counts.unwrap(), before);
    assert!(
        ticked >= 20,
        "the worker's other task stalled: {ticked} ticks in {waited:?}"
    );
}
