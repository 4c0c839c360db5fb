//! Inbox ingest with durability: sync responses of 100 deliveries and their 100 timeline lines,
//! each response stored as one atomic sled batch and flushed (fsync) before it counts, as the ear
//! does. Prints deliveries/s and the latency from a
//! sync response to its deliveries being visible (p50, p99), homeserver excluded.
//! Then the disk it takes: a million deliveries (10,000 responses of 100, with their timeline
//! lines), each tenth response acknowledged with everything before it, then the bytes of the
//! sled files per delivery, before and after a prune of everything past its retention, and after
//! a compaction; then the same deliveries with `compact_if_wasteful` every 10,000 (as the
//! gateway runs it: peak and final bytes); then how long compacting a 40 MB backlog holds the
//! inbox.
//! Then a busy room as a live Persona's turn loop meets it: responses of 10 lines meant for no
//! one, each followed by the retire of everything past the room's newest 20 (with one line
//! older than them all still pending, so the retired seqs stay holes above the watermark):
//! retire latency, and `counts` (which every pending, ack and status request reads) with those
//! holes against an inbox without.
//! `cargo bench -p gateway --bench inbox`; `RESPONSES=N` (default 300); `DISK_DELIVERIES=N`
//! (default 1,000,000; 0 skips).

mod support;

use std::time::{Duration, Instant};

use gateway::inbox::compact::bytes_under;
use gateway::inbox::{Inbox, SyncWrite, TimelineLine};
use wire::docs::ContextLine;

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let responses = support::env_count("RESPONSES", 300);
    let (dir, inbox) = fresh("bench");
    let mut lat = Vec::new();
    let start = Instant::now();
    for r in 0..responses {
        let batch = support::response(r);
        let lines: Vec<TimelineLine> = batch
            .iter()
            .map(|d| TimelineLine {
                room_id: d.room_id.clone(),
                thread: None,
                line: ContextLine {
                    event_id: d.event_id.clone(),
                    sender: d.sender.clone(),
                    sender_name: None,
                    ts: 0,
                    text: d.text.clone(),
                },
            })
            .collect();
        let t0 = Instant::now();
        inbox
            .ingest_sync(
                "mira",
                &format!("s{r}"),
                SyncWrite {
                    deliveries: &batch,
                    lines: &lines,
                    ..SyncWrite::default()
                },
            )
            .expect("ingest");
        lat.push(t0.elapsed());
        // Keep the inbox at a realistic size: ack what the consumer would have handled.
        if r % 10 == 9 {
            let c = inbox.counts("mira").expect("counts");
            inbox.ack("mira", c.highest).expect("ack");
        }
    }
    let total = start.elapsed();
    lat.sort();
    let pct = |p: usize| lat[(lat.len() * p / 100).min(lat.len() - 1)];
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    println!(
        "inbox ingest, 100 deliveries and 100 timeline lines per sync response, flushed: {:.0} deliveries/s ({responses} responses); sync response -> visible: p50 {:.0} us, p99 {:.0} us",
        (responses * 100) as f64 / total.as_secs_f64(),
        us(pct(50)),
        us(pct(99))
    );
    drop(dir);
    busy_room(responses);
    let deliveries = support::env_count("DISK_DELIVERIES", 1_000_000);
    disk(deliveries);
    disk_checked(deliveries);
    held_with_a_backlog();
}

/// A busy room: `responses` responses of 10 waiting lines, each followed by the retire of all
/// but the newest 20 (one older line, meant for her, stays pending throughout).
fn busy_room(responses: u64) {
    let (_dir, inbox) = fresh("busy");
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    let first = support::response(u64::MAX)[..1].to_vec();
    inbox.ingest("mira", "s-first", &first).expect("ingest");
    let mut retire = Vec::new();
    for r in 0..responses {
        let batch = support::response(r)[..10].to_vec();
        inbox
            .ingest("mira", &format!("s{r}"), &batch)
            .expect("ingest");
        let page = inbox.pending("mira", 0, 1000, None).expect("pending");
        let waiting = &page.deliveries[1..];
        let over: Vec<u64> = waiting[..waiting.len().saturating_sub(20)]
            .iter()
            .map(|d| d.seq)
            .collect();
        let t0 = Instant::now();
        inbox.retire("mira", &over).expect("retire");
        retire.push(t0.elapsed());
    }
    retire.sort();
    let pct = |v: &[Duration], p: usize| v[(v.len() * p / 100).min(v.len() - 1)];
    let counts_time = |inbox: &Inbox| {
        let n = 20_000;
        let t0 = Instant::now();
        for _ in 0..n {
            std::hint::black_box(inbox.counts("mira").expect("counts"));
        }
        t0.elapsed() / n
    };
    let with_holes = counts_time(&inbox);
    let c = inbox.counts("mira").expect("counts");
    let (_plain_dir, plain) = fresh("plain");
    plain
        .ingest("mira", "s", &support::response(0)[..21])
        .expect("ingest");
    let without = counts_time(&plain);
    println!(
        "busy room, {responses} responses of 10 lines, all but the newest 20 retired after each: retire p50 {:.0} us, p99 {:.0} us; {} pending of {} stored; counts {:.2} us with the retired holes, {:.2} us without",
        us(pct(&retire, 50)),
        us(pct(&retire, 99)),
        c.pending,
        c.highest,
        us(with_holes),
        us(without),
    );
}

fn lines_of(batch: &[wire::docs::Delivery]) -> Vec<TimelineLine> {
    batch
        .iter()
        .map(|d| TimelineLine {
            room_id: d.room_id.clone(),
            thread: None,
            line: ContextLine {
                event_id: d.event_id.clone(),
                sender: d.sender.clone(),
                sender_name: None,
                ts: 0,
                text: d.text.clone(),
            },
        })
        .collect()
}

/// A fresh inbox in a scratch directory (removed when the first is dropped), named for the
/// measurement.
fn fresh(name: &str) -> (support::Scratch, Inbox) {
    let dir = support::scratch(&format!("inbox-{name}"));
    let inbox = Inbox::open(&dir.path).expect("open");
    (dir, inbox)
}

/// Stores `deliveries` (rounded up to responses of 100, with their timeline lines), each tenth
/// response acknowledged with everything before it, and everything at the end; `every_100`
/// runs after each hundredth response. Returns the responses stored.
fn deliver(inbox: &Inbox, deliveries: u64, mut every_100: impl FnMut(&Inbox)) -> u64 {
    let responses = deliveries.div_ceil(100);
    for r in 0..responses {
        let batch = support::response(r);
        let lines = lines_of(&batch);
        inbox
            .ingest_sync(
                "mira",
                &format!("s{r}"),
                SyncWrite {
                    deliveries: &batch,
                    lines: &lines,
                    ..SyncWrite::default()
                },
            )
            .expect("ingest");
        if r % 10 == 9 {
            let c = inbox.counts("mira").expect("counts");
            inbox.ack("mira", c.highest).expect("ack");
        }
        if r % 100 == 99 {
            every_100(inbox);
        }
    }
    let c = inbox.counts("mira").expect("counts");
    inbox.ack("mira", c.highest).expect("ack");
    responses
}

/// The disk after `deliveries`, all acknowledged: as sled leaves it, after pruning and
/// reopening, and after one compaction.
fn disk(deliveries: u64) {
    if deliveries == 0 {
        return;
    }
    let (dir, inbox) = fresh("disk");
    let start = Instant::now();
    let responses = deliver(&inbox, deliveries, |_| {});
    let took = start.elapsed();
    let before = bytes_under(&dir.path);
    let now = u64::try_from(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis()),
    )
    .unwrap_or(0);
    let pruned = inbox
        .prune(now + 31 * 86_400_000, gateway::inbox::Retention::default())
        .expect("prune");
    drop(inbox);
    let reopened = Inbox::open(&dir.path).expect("reopen");
    let after = bytes_under(&dir.path);
    let compacted = reopened.compact().expect("compact");
    drop(reopened);
    let n = (responses * 100) as f64;
    println!(
        "inbox disk after {} deliveries and acks ({:.1} s): {} bytes on disk, {:.0} bytes per delivery; after pruning {} id records past the 30-day retention and reopening: {} bytes ({:.0} per delivery); after compaction: {} bytes ({:.1} per delivery; {} records, {} bytes live), the inbox held {:.0} ms",
        responses * 100,
        took.as_secs_f64(),
        before,
        before as f64 / n,
        pruned.id_records,
        after,
        after as f64 / n,
        compacted.after,
        compacted.after as f64 / n,
        compacted.records,
        compacted.live,
        compacted.held.as_secs_f64() * 1000.0,
    );
    drop(dir);
}

/// The disk as a running gateway keeps it: `compact_if_wasteful` (defaults) every 10,000
/// deliveries, as its hourly task does; the peak and final bytes.
fn disk_checked(deliveries: u64) {
    if deliveries == 0 {
        return;
    }
    let (dir, inbox) = fresh("disk-checked");
    let start = Instant::now();
    let (mut peak, mut held) = (0u64, Vec::new());
    let responses = deliver(&inbox, deliveries, |inbox| {
        peak = peak.max(inbox.disk_bytes());
        if let Some(c) = inbox
            .compact_if_wasteful(gateway::inbox::CompactWhen::default())
            .expect("compact")
        {
            held.push(c.held.as_secs_f64() * 1e3);
        }
    });
    println!(
        "inbox disk with compact_if_wasteful every 10,000 of {} deliveries ({:.1} s): peak {} bytes, at the end {} bytes; {} compactions holding the inbox {:.0}-{:.0} ms",
        responses * 100,
        start.elapsed().as_secs_f64(),
        peak,
        inbox.disk_bytes(),
        held.len(),
        held.iter().copied().fold(f64::INFINITY, f64::min),
        held.iter().copied().fold(0.0, f64::max),
    );
    drop(inbox);
    drop(dir);
}

/// How long a compaction holds the inbox when it copies a backlog near the default cap
/// (`max_live_bytes`, 32 MiB): 45,000 unacknowledged deliveries of ~700 bytes.
fn held_with_a_backlog() {
    let (dir, inbox) = fresh("backlog");
    for r in 0..450 {
        inbox
            .ingest("mira", &format!("s{r}"), &support::response(r))
            .expect("ingest");
    }
    let c = inbox.compact().expect("compact");
    println!(
        "compaction of a backlog: {} bytes live in {} records ({} bytes of files before, {} after): the inbox held {:.0} ms",
        c.live,
        c.records,
        c.before,
        c.after,
        c.held.as_secs_f64() * 1000.0
    );
    drop(inbox);
    drop(dir);
}
