//! The older-rules CultNet runtime (cultnet-rs at 402f6e7), recorded against the gateway, replayed
//! against the gateway's hub as it is now.
//!
//! `fixtures/cultnet-interop/cultnet-rs-402f6e7.jsonl` holds every datagram of one session between
//! that runtime's own RUDP socket transport and codec (run unchanged; the harness is in
//! `fixtures/cultnet-interop/harness/`) and a running gateway: its Connect, hello, a schema catalog
//! request, 10 s of quiet, a status request, then a request for a ~58 KB page. The runtime's
//! codec accepted the gateway's hello, catalog and receipts, it got its answer after the quiet,
//! and it got the page without sending anything but the request.
//!
//! Here the peer's recorded datagrams are played into a fresh hub at their recorded times (its
//! acks renumbered onto this hub's sequences), each of its requests answered with the answer the
//! gateway gave then, and what the hub sends is checked against what that runtime can take,
//! as read in its code and seen running it: controls carry sequence 0 (its ordered delivery
//! waits for the exact next sequence of a channel), data on `schema` is numbered without gaps,
//! a fragment set is at most 32 fragments (its one ack after delivery names the newest packet
//! and the 32 before it) and goes out whole at once (it acks nothing before a whole frame), and
//! after its recorded acks nothing is left unacknowledged.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use bytes::Bytes;
use wire::hub::{Hub, HubEvent};
use wire::msg::Message;
use wire::packet::{Packet, PacketType};

struct Datagram {
    t: Duration,
    to_gateway: bool,
    bytes: Vec<u8>,
}

fn recording() -> Vec<Datagram> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../fixtures/cultnet-interop/cultnet-rs-402f6e7.jsonl");
    let text = std::fs::read_to_string(&path).expect("the recording");
    text.lines()
        .map(|line| {
            let v: serde_json::Value = serde_json::from_str(line).expect("a JSON line");
            let hex = v["hex"].as_str().expect("hex");
            Datagram {
                t: Duration::from_millis(v["t_ms"].as_u64().expect("t_ms")),
                to_gateway: v["dir"] == "p>g",
                bytes: (0..hex.len() / 2)
                    .map(|i| u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).expect("hex"))
                    .collect(),
            }
        })
        .collect()
}

/// The gateway's answers as the peer received them, reassembled, in order.
fn recorded_answers(rec: &[Datagram]) -> Vec<Bytes> {
    let mut sets: BTreeMap<u16, BTreeMap<u16, Vec<u8>>> = BTreeMap::new();
    let mut seen = std::collections::HashSet::new();
    let mut out = Vec::new();
    for d in rec.iter().filter(|d| !d.to_gateway) {
        let p = Packet::decode(&d.bytes).expect("a CNR0 packet");
        if p.ptype != PacketType::Data || p.channel != "schema" || !seen.insert(p.sequence) {
            continue;
        }
        if p.fragment.count <= 1 {
            out.push(Bytes::copy_from_slice(p.payload));
            continue;
        }
        let set = sets.entry(p.fragment.id).or_default();
        set.insert(p.fragment.index, p.payload.to_vec());
        if set.len() == usize::from(p.fragment.count) {
            let whole: Vec<u8> = sets
                .remove(&p.fragment.id)
                .into_iter()
                .flat_map(|s| s.into_values().flatten())
                .collect();
            out.push(Bytes::from(whole));
        }
    }
    out
}

fn accept_sequence(rec: &[Datagram]) -> u32 {
    rec.iter()
        .filter(|d| !d.to_gateway)
        .map(|d| Packet::decode(&d.bytes).expect("a CNR0 packet"))
        .find(|p| p.ptype == PacketType::Accept)
        .map(|p| p.sequence)
        .expect("the recorded Accept")
}

/// `bytes` with its ack field moved from the recorded gateway's numbering onto ours.
fn renumbered(bytes: &[u8], recorded_accept: u32, our_accept: u32) -> Vec<u8> {
    let p = Packet::decode(bytes).expect("a CNR0 packet");
    let ack = if p.ack == 0 {
        0
    } else {
        p.ack.wrapping_sub(recorded_accept).wrapping_add(our_accept)
    };
    let mut out = Vec::new();
    Packet { ack, ..p }.encode(&mut out).expect("encodes");
    out
}

#[test]
fn the_older_runtime_recorded_against_the_gateway_is_served_by_its_rules() {
    let rec = recording();
    let answers = recorded_answers(&rec);
    assert!(answers.len() >= 4, "{} answers recorded", answers.len());
    let recorded_accept = accept_sequence(&rec);
    let peer: SocketAddr = "127.0.0.1:40000".parse().expect("an address");
    let mut hub = Hub::new(gateway::service::hub_config(), 7);
    let start = Instant::now();
    let mut our_accept = None;
    let mut requests = Vec::new();
    let mut next_answer = 0;
    // The peer's packets in order; before each, the hub's timers up to its time.
    let drain = |hub: &mut Hub, t: Duration, sent: &mut Vec<(Duration, Vec<u8>)>| {
        let now = start + t;
        hub.handle_timeout(now);
        let mut buf = Vec::new();
        while hub.poll_transmit(now, &mut buf).is_some() {
            sent.push((t, std::mem::take(&mut buf)));
        }
    };
    let mut out: Vec<(Duration, Vec<u8>)> = Vec::new();
    let mut last = Duration::ZERO;
    let mut unacked_at_goodbye = None;
    for d in rec.iter().filter(|d| d.to_gateway) {
        // Every 10 ms of recorded time in between: the hub's timers (keepalive, resends).
        while last + Duration::from_millis(10) < d.t {
            last += Duration::from_millis(10);
            drain(&mut hub, last, &mut out);
        }
        last = d.t;
        let now = start + d.t;
        // Its last packet says goodbye: by then nothing of ours may wait for an ack.
        let kind = Packet::decode(&d.bytes).expect("theirs").ptype;
        if kind == PacketType::Disconnect {
            let s = hub.session(peer).expect("the session");
            unacked_at_goodbye = Some(s.in_flight());
        }
        let bytes = match our_accept {
            Some(ours) => renumbered(&d.bytes, recorded_accept, ours),
            None => d.bytes.clone(),
        };
        hub.handle(now, peer, &bytes);
        while let Some(e) = hub.poll_event() {
            match e {
                HubEvent::ConnectRequest(req) => hub.accept(now, &req).expect("accepts"),
                HubEvent::Frame { frame, .. } => {
                    requests.push(Message::decode(&frame.payload).map(|m| m.schema_version()));
                    if let Some(a) = answers.get(next_answer) {
                        hub.send(now, peer, "schema", a.clone()).expect("queues");
                    }
                    next_answer += 1;
                }
                _ => {}
            }
        }
        drain(&mut hub, d.t, &mut out);
        if our_accept.is_none() {
            our_accept = out
                .iter()
                .map(|(_, b)| Packet::decode(b).expect("ours"))
                .find(|p| p.ptype == PacketType::Accept)
                .map(|p| p.sequence);
        }
    }
    // Its requests reached the hub whole and our codec reads them.
    let read: Vec<_> = requests.iter().map(|r| r.as_ref().ok().copied()).collect();
    assert_eq!(
        read,
        [
            Some("cultnet.hello.v0"),
            Some("cultnet.schema_catalog_request.v0"),
            Some("cultnet.document_put_raw.v0"),
            Some("cultnet.document_put_raw.v0"),
        ]
    );
    let our_accept = our_accept.expect("the hub accepted");
    let packets: Vec<(Duration, Packet)> = out
        .iter()
        .map(|(t, b)| (*t, Packet::decode(b).expect("ours")))
        .collect();
    // Controls carry sequence 0.
    for (t, p) in &packets {
        if !matches!(p.ptype, PacketType::Data | PacketType::Accept) {
            assert_eq!(p.sequence, 0, "{:?} at {t:?} takes a sequence", p.ptype);
        }
    }
    // Data on `schema` is numbered from the Accept on without a gap (resends repeat numbers).
    let mut data: Vec<u32> = packets
        .iter()
        .filter(|(_, p)| p.ptype == PacketType::Data)
        .map(|(_, p)| p.sequence)
        .collect();
    data.sort_unstable();
    data.dedup();
    let expected: Vec<u32> = (1..=data.len() as u32)
        .map(|i| our_accept.wrapping_add(i))
        .collect();
    assert_eq!(data, expected, "a gap in the schema sequence");
    // Keepalives went out during the quiet, and did not take numbers.
    let pings = packets
        .iter()
        .filter(|(_, p)| p.ptype == PacketType::Ping)
        .count();
    assert!(pings >= 1, "no keepalive during 10 s of quiet");
    // Each fragment set: at most 32 fragments, all sent at the same moment.
    let mut sets: BTreeMap<u16, Vec<(Duration, u16)>> = BTreeMap::new();
    for (t, p) in &packets {
        if p.ptype == PacketType::Data && p.fragment.count > 1 {
            sets.entry(p.fragment.id)
                .or_default()
                .push((*t, p.fragment.count));
        }
    }
    assert!(!sets.is_empty(), "no page large enough to fragment");
    for (id, frags) in &sets {
        let count = frags[0].1;
        assert!(count <= 32, "set {id}: {count} fragments");
        let first = frags[0].0;
        let whole = frags.iter().filter(|(t, _)| *t == first).count();
        assert_eq!(whole, usize::from(count), "set {id} not sent whole at once");
    }
    // After the peer's recorded acks, nothing of ours waits for one.
    assert_eq!(
        unacked_at_goodbye,
        Some(0),
        "packets never acknowledged by that peer"
    );
}
