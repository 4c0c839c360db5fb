//! One test per session/hub rule, each driven over the simulated link or by hand-made packets.

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;

use super::sim::Pair;
use crate::error::{CloseReason, SendError};
use crate::hub::{Hub, HubConfig, HubError, HubEvent};
use crate::packet::{Flags, Fragment, Packet, PacketType};
use crate::session::{PeerRules, SessionConfig};

fn cfg() -> HubConfig {
    HubConfig::default()
}

fn connect_bytes(conn: u32, seq: u32, payload: &[u8]) -> Vec<u8> {
    let mut b = Vec::new();
    Packet {
        ptype: PacketType::Connect,
        flags: Flags(Flags::RELIABLE | Flags::ORDERED),
        connection_id: conn,
        sequence: seq,
        ack: 0,
        ack_mask: 0,
        fragment: Fragment::default(),
        channel: "control",
        payload,
    }
    .encode(&mut b)
    .unwrap();
    b
}

fn drain(hub: &mut Hub, now: std::time::Instant) -> Vec<(SocketAddr, Vec<u8>)> {
    let mut out = Vec::new();
    loop {
        let mut buf = Vec::new();
        match hub.poll_transmit(now, &mut buf) {
            Some(to) => out.push((to, buf)),
            None => return out,
        }
    }
}

/// Accepts the Connect waiting from `peer`, as an owner answering at once would.
fn accept_waiting(
    hub: &mut Hub,
    now: std::time::Instant,
    peer: SocketAddr,
) -> Result<(), HubError> {
    let req = hub.waiting(peer).cloned().expect("no connect waiting");
    hub.accept(now, &req)
}

fn events(hub: &mut Hub) -> Vec<HubEvent> {
    std::iter::from_fn(|| hub.poll_event()).collect()
}

/// A hub on `cfg()` as `tune` changes it, the time now, and its connection id.
fn hub_with(tune: impl FnOnce(&mut HubConfig)) -> (Hub, std::time::Instant, u32) {
    let mut c = cfg();
    tune(&mut c);
    let hub = Hub::new(c, 3);
    let conn = hub.config().session.connection_id;
    (hub, std::time::Instant::now(), conn)
}

/// The Connects the hub has reported so far, in order.
fn requests(hub: &mut Hub) -> Vec<crate::hub::ConnectRequest> {
    events(hub)
        .into_iter()
        .filter_map(|e| match e {
            HubEvent::ConnectRequest(r) => Some(r),
            _ => None,
        })
        .collect()
}

#[test]
fn repeated_connect_gets_identical_accept_bytes_then_an_ack() {
    let mut hub = Hub::new(cfg(), 3);
    let now = std::time::Instant::now();
    let peer: SocketAddr = "127.0.0.1:9".parse().unwrap();
    let c = connect_bytes(hub.config().session.connection_id, 77, b"creds");
    hub.handle(now, peer, &c);
    accept_waiting(&mut hub, now, peer).unwrap();
    let first = drain(&mut hub, now);
    assert_eq!(first.len(), 1);
    hub.handle(now, peer, &c);
    let again = drain(&mut hub, now);
    assert_eq!(
        again, first,
        "a repeated Connect must get the same Accept bytes"
    );
    assert!(events(&mut hub)
        .iter()
        .all(|e| !matches!(e, HubEvent::Disconnected { .. })));
    // Once the Accept is acked, a repeat gets an Ack naming the Connect.
    let accept = Packet::decode(&first[0].1).unwrap();
    let mut ack = Vec::new();
    Packet {
        ptype: PacketType::Ack,
        flags: Flags(0),
        sequence: 0,
        ack: accept.sequence,
        ack_mask: 0,
        channel: "control",
        payload: b"",
        ..accept
    }
    .encode(&mut ack)
    .unwrap();
    hub.handle(now, peer, &ack);
    assert!(events(&mut hub).contains(&HubEvent::Connected {
        peer,
        accept: Bytes::new()
    }));
    hub.handle(now, peer, &c);
    let out = drain(&mut hub, now);
    let p = Packet::decode(&out[0].1).unwrap();
    assert_eq!((p.ptype, p.ack), (PacketType::Ack, 77));
}

#[test]
fn connect_with_new_payload_replaces_the_session() {
    let mut hub = Hub::new(cfg(), 3);
    let now = std::time::Instant::now();
    let peer: SocketAddr = "127.0.0.1:9".parse().unwrap();
    let conn = hub.config().session.connection_id;
    hub.handle(now, peer, &connect_bytes(conn, 5, b"old"));
    accept_waiting(&mut hub, now, peer).unwrap();
    drain(&mut hub, now);
    events(&mut hub);
    hub.handle(now, peer, &connect_bytes(conn, 5, b"new"));
    let ev = events(&mut hub);
    assert_eq!(
        ev,
        vec![
            HubEvent::Disconnected {
                peer,
                reason: CloseReason::Replaced
            },
            HubEvent::ConnectRequest(hub.waiting(peer).cloned().expect("the new connect waits")),
        ]
    );
    assert_eq!(&hub.waiting(peer).unwrap().payload[..], b"new");
    assert_eq!(hub.stats().replaced, 1);
}

#[test]
fn wrong_connection_id_touches_nothing() {
    let mut hub = Hub::new(cfg(), 3);
    let now = std::time::Instant::now();
    let peer: SocketAddr = "127.0.0.1:9".parse().unwrap();
    hub.handle(now, peer, &connect_bytes(0xE91F_0001, 1, b"x"));
    assert!(events(&mut hub).is_empty());
    assert!(drain(&mut hub, now).is_empty());
    assert_eq!(hub.stats().wrong_connection_id, 1);
    hub.handle(now, peer, b"garbage");
    assert_eq!(hub.stats().malformed, 1);
}

#[test]
fn refusal_reaches_the_client_with_its_reason() {
    let mut pair = Pair::new(11, cfg());
    pair.auto_accept = false;
    let b = pair.b.addr;
    pair.a
        .hub
        .connect(pair.now, b, Bytes::from_static(b"bad creds"));
    pair.flush();
    pair.step();
    pair.flush();
    let req = pair.b.events.iter().find_map(|e| match e {
        HubEvent::ConnectRequest(req) => Some(req.clone()),
        _ => None,
    });
    let req = req.expect("no connect request");
    assert_eq!(&req.payload[..], b"bad creds");
    pair.b.hub.refuse(&req, "unknown agent").unwrap();
    pair.drive_until(100, |p| {
        p.a.events
            .iter()
            .any(|e| matches!(e, HubEvent::Disconnected { .. }))
    });
    assert!(pair.a.events.contains(&HubEvent::Disconnected {
        peer: b,
        reason: CloseReason::Peer("unknown agent".into())
    }));
    assert_eq!(pair.b.hub.peer_count(), 0);
    assert_eq!(pair.b.hub.stats().refused, 1);
}

#[test]
fn peer_cap_turns_away_extra_connects() {
    let mut c = cfg();
    c.max_peers = 2;
    let mut hub = Hub::new(c, 3);
    let now = std::time::Instant::now();
    let conn = hub.config().session.connection_id;
    for port in 1..=3u16 {
        let peer = SocketAddr::from(([127, 0, 0, 1], port));
        hub.handle(now, peer, &connect_bytes(conn, 1, b"x"));
        if let Some(req) = hub.waiting(peer).cloned() {
            hub.accept(now, &req).unwrap();
        }
    }
    assert_eq!(hub.peer_count(), 2);
    assert_eq!(hub.stats().peers_full, 1);
    let out = drain(&mut hub, now);
    let refused = out
        .iter()
        .find(|(to, _)| to.port() == 3)
        .expect("third peer got no answer");
    let p = Packet::decode(&refused.1).unwrap();
    assert_eq!(
        (p.ptype, p.payload),
        (PacketType::Disconnect, &b"server full"[..])
    );
}

#[test]
fn window_queues_instead_of_dropping() {
    let mut pair = Pair::new(5, cfg());
    pair.connect();
    let b = pair.b.addr;
    // Cut the link: nothing gets acked.
    pair.b.impair.loss = 1.0;
    for i in 0..100u32 {
        pair.a
            .hub
            .send(pair.now, b, "schema", Bytes::from(i.to_be_bytes().to_vec()))
            .unwrap();
    }
    pair.flush();
    let s = pair.a.hub.session(b).unwrap();
    assert_eq!(s.in_flight(), 32);
    assert_eq!(s.queued_bytes(), 68 * 4);
    pair.b.impair.loss = 0.0;
    assert!(pair.drive_until(50_000, |p| Pair::frames(&p.b.events).len() == 100));
    let got: Vec<u32> = Pair::frames(&pair.b.events)
        .iter()
        .map(|(_, p)| u32::from_be_bytes([p[0], p[1], p[2], p[3]]))
        .collect();
    assert_eq!(got, (0..100).collect::<Vec<_>>());
}

#[test]
fn queue_full_is_backpressure_not_loss() {
    let mut c = cfg();
    c.session.max_queued_bytes = 1000;
    let mut pair = Pair::new(5, c);
    pair.connect();
    let b = pair.b.addr;
    pair.a
        .hub
        .send(pair.now, b, "schema", Bytes::from(vec![0; 900]))
        .unwrap();
    let err = pair
        .a
        .hub
        .send(pair.now, b, "schema", Bytes::from(vec![0; 200]))
        .unwrap_err();
    assert!(matches!(err, SendError::QueueFull { .. }));
    assert!(matches!(
        pair.a.hub.send(
            pair.now,
            b,
            "schema",
            Bytes::from(vec![0; 17 * 1024 * 1024])
        ),
        Err(SendError::TooLarge { .. })
    ));
    assert_eq!(
        pair.a.hub.send(
            pair.now,
            "127.0.0.1:1".parse().unwrap(),
            "schema",
            Bytes::new()
        ),
        Err(SendError::UnknownPeer)
    );
}

#[test]
fn media_expires_and_does_not_block_ordered_frames() {
    let mut pair = Pair::new(9, cfg());
    pair.connect();
    let b = pair.b.addr;
    pair.b.impair.loss = 1.0;
    pair.a
        .hub
        .send(pair.now, b, "media", Bytes::from_static(b"stale video"))
        .unwrap();
    // Let its 75 ms expiry pass while the link drops everything.
    let until = pair.now + Duration::from_millis(100);
    while pair.now < until {
        pair.step();
    }
    pair.b.impair.loss = 0.0;
    pair.a
        .hub
        .send(pair.now, b, "schema", Bytes::from_static(b"after"))
        .unwrap();
    assert!(pair.drive_until(10_000, |p| Pair::frames(&p.b.events)
        .iter()
        .any(|(c, _)| c == "schema")));
    let frames = Pair::frames(&pair.b.events);
    assert!(
        !frames.iter().any(|(c, _)| c == "media"),
        "expired media was delivered"
    );
    assert_eq!(pair.a.hub.stats().sessions.expired, 1);
}

#[test]
fn silence_timeout_closes_both_ways() {
    let mut c = cfg();
    c.session.keepalive = None;
    c.session.silence_timeout = Some(Duration::from_secs(2));
    let mut pair = Pair::new(4, c);
    pair.connect();
    pair.a.impair.loss = 1.0;
    pair.b.impair.loss = 1.0;
    assert!(pair.drive_until(1000, |p| p
        .a
        .events
        .iter()
        .any(|e| matches!(e, HubEvent::Disconnected { .. }))));
    assert!(pair.a.events.iter().any(|e| matches!(
        e,
        HubEvent::Disconnected {
            reason: CloseReason::SilenceTimeout,
            ..
        }
    )));
}

#[test]
fn keepalive_keeps_an_idle_session_open() {
    let mut c = cfg();
    c.session.keepalive = Some(Duration::from_secs(1));
    c.session.silence_timeout = Some(Duration::from_secs(3));
    let mut pair = Pair::new(4, c);
    pair.connect();
    let end = pair.now + Duration::from_secs(60);
    while pair.now < end {
        pair.step();
    }
    assert!(pair.a.hub.session(pair.b.addr).unwrap().is_connected());
    assert!(!pair
        .b
        .events
        .iter()
        .any(|e| matches!(e, HubEvent::Disconnected { .. })));
}

#[test]
fn unanswered_connect_is_abandoned_after_3s() {
    let mut pair = Pair::new(4, cfg());
    pair.b.impair.loss = 1.0;
    let b = pair.b.addr;
    let start = pair.now;
    pair.a.hub.connect(pair.now, b, Bytes::from_static(b"x"));
    assert!(pair.drive_until(1000, |p| p
        .a
        .events
        .iter()
        .any(|e| matches!(e, HubEvent::Disconnected { .. }))));
    assert!(pair.a.events.contains(&HubEvent::Disconnected {
        peer: b,
        reason: CloseReason::ConnectTimeout
    }));
    assert_eq!(pair.now - start, Duration::from_secs(3));
}

#[test]
fn accept_that_does_not_ack_our_connect_is_ignored() {
    let mut hub = Hub::new(cfg(), 3);
    let now = std::time::Instant::now();
    let server: SocketAddr = "127.0.0.1:9".parse().unwrap();
    hub.connect(now, server, Bytes::from_static(b"x"));
    let out = drain(&mut hub, now);
    let connect = Packet::decode(&out[0].1).unwrap();
    let mut accept = Vec::new();
    Packet {
        ptype: PacketType::Accept,
        sequence: 500,
        ack: connect.sequence.wrapping_add(1),
        payload: b"",
        ..connect
    }
    .encode(&mut accept)
    .unwrap();
    hub.handle(now, server, &accept);
    assert!(events(&mut hub).is_empty());
    assert!(!hub.session(server).unwrap().is_connected());
}

/// A packet as an arbitrary (possibly older-rules) peer would send it: Data on `schema`,
/// everything else on `control`, no acks.
fn raw(conn: u32, ptype: PacketType, flags: u8, seq: u32, payload: &[u8]) -> Vec<u8> {
    let mut b = Vec::new();
    Packet {
        ptype,
        flags: Flags(flags),
        connection_id: conn,
        sequence: seq,
        ack: 0,
        ack_mask: 0,
        fragment: Fragment::default(),
        channel: if ptype == PacketType::Data {
            "schema"
        } else {
            "control"
        },
        payload,
    }
    .encode(&mut b)
    .unwrap();
    b
}

fn frag_packet(conn: u32, seq: u32, id: u16, index: u16, count: u16, body: &[u8]) -> Vec<u8> {
    let mut b = Vec::new();
    Packet {
        ptype: PacketType::Data,
        flags: Flags(Flags::RELIABLE | Flags::ORDERED),
        connection_id: conn,
        sequence: seq,
        ack: 0,
        ack_mask: 0,
        fragment: Fragment { id, index, count },
        channel: "schema",
        payload: body,
    }
    .encode(&mut b)
    .unwrap();
    b
}

fn server_with_client(c: HubConfig) -> (Hub, SocketAddr, u32, std::time::Instant) {
    let mut hub = Hub::new(c, 3);
    let now = std::time::Instant::now();
    let peer: SocketAddr = "127.0.0.1:9".parse().unwrap();
    let conn = hub.config().session.connection_id;
    hub.handle(now, peer, &connect_bytes(conn, 1000, b"x"));
    accept_waiting(&mut hub, now, peer).unwrap();
    drain(&mut hub, now);
    events(&mut hub);
    (hub, peer, conn, now)
}

#[test]
fn fragment_sets_are_capped_at_64_per_peer() {
    let (mut hub, peer, conn, now) = server_with_client(cfg());
    // 70 incomplete sets (first of two fragments each), at sequences that leave gaps.
    for i in 0..70u16 {
        hub.handle(
            now,
            peer,
            &frag_packet(conn, 1002 + 2 * i as u32, i + 1, 0, 2, b"part"),
        );
    }
    let s = hub.session(peer).unwrap();
    assert_eq!(s.stats().memory_drops, 6);
    assert!(s.receive_buffered_bytes() <= 64 * (4 + 64));
    // The dropped fragments were not acked (the sender will resend them): no Ack names them.
    let acked: Vec<u32> = drain(&mut hub, now)
        .iter()
        .filter_map(|(_, b)| Packet::decode(b).ok().map(|p| p.ack))
        .collect();
    assert!(
        !acked.contains(&(1002 + 2 * 69)),
        "a dropped fragment was acked"
    );
    assert!(
        acked.contains(&(1002 + 2 * 63)),
        "an accepted fragment was not acked"
    );
}

#[test]
fn oversize_fragmented_frame_closes_the_session() {
    let mut c = cfg();
    c.session.max_payload = 1000;
    let (mut hub, peer, conn, now) = server_with_client(c);
    let body = vec![0u8; 600];
    hub.handle(now, peer, &frag_packet(conn, 1001, 1, 0, 2, &body));
    hub.handle(now, peer, &frag_packet(conn, 1002, 1, 1, 2, &body));
    let ev = events(&mut hub);
    assert!(
        ev.iter().any(|e| matches!(
            e,
            HubEvent::Disconnected {
                reason: CloseReason::PeerMisbehaved(_),
                ..
            }
        )),
        "{ev:?}"
    );
}

#[test]
fn incomplete_fragment_sets_expire() {
    let mut c = cfg();
    c.session.reassembly_timeout = Duration::from_secs(1);
    c.session.silence_timeout = None;
    let (mut hub, peer, conn, now) = server_with_client(c);
    hub.handle(now, peer, &frag_packet(conn, 1001, 1, 0, 3, b"a"));
    assert!(hub.session(peer).unwrap().receive_buffered_bytes() > 0);
    hub.handle_timeout(now + Duration::from_secs(2));
    let s = hub.session(peer).unwrap();
    assert_eq!(s.stats().reassembly_expired, 1);
    assert_eq!(s.receive_buffered_bytes(), 0);
}

#[test]
fn ordered_but_unreliable_is_invalid() {
    let (mut hub, peer, conn, now) = server_with_client(cfg());
    let mut b = Vec::new();
    Packet {
        ptype: PacketType::Data,
        flags: Flags(Flags::ORDERED),
        connection_id: conn,
        sequence: 0,
        ack: 0,
        ack_mask: 0,
        fragment: Fragment::default(),
        channel: "x",
        payload: b"y",
    }
    .encode(&mut b)
    .unwrap();
    hub.handle(now, peer, &b);
    assert!(events(&mut hub).is_empty());
    assert_eq!(hub.session(peer).unwrap().stats().invalid, 1);
}

#[test]
fn every_reliable_arrival_is_acked_even_duplicates_and_held_back() {
    let (mut hub, peer, conn, now) = server_with_client(cfg());
    let data = |seq: u32| frag_packet(conn, seq, 0, 0, 0, b"d");
    // 1003 arrives before 1001/1002: held back, still acked.
    hub.handle(now, peer, &data(1003));
    let out = drain(&mut hub, now);
    assert!(out.iter().any(|(_, b)| {
        let p = Packet::decode(b).unwrap();
        p.ptype == PacketType::Ack && p.ack == 1003
    }));
    hub.handle(now, peer, &data(1001));
    hub.handle(now, peer, &data(1002));
    drain(&mut hub, now);
    // A duplicate of an old one far behind the newest is acked by name.
    for s in 1004..1060 {
        hub.handle(now, peer, &data(s));
    }
    drain(&mut hub, now);
    hub.handle(now, peer, &data(1001));
    let acks: Vec<u32> = drain(&mut hub, now)
        .iter()
        .map(|(_, b)| Packet::decode(b).unwrap())
        .filter(|p| p.ptype == PacketType::Ack)
        .map(|p| p.ack)
        .collect();
    assert!(
        acks.contains(&1001),
        "duplicate not acked by name: {acks:?}"
    );
    let frames = events(&mut hub)
        .into_iter()
        .filter(|e| matches!(e, HubEvent::Frame { .. }))
        .count();
    assert_eq!(frames, 59);
    assert_eq!(hub.session(peer).unwrap().stats().duplicates, 1);
}

#[test]
fn older_peer_lost_ack_hole_is_skipped() {
    let mut c = cfg();
    c.session.legacy_hole_timeout = Duration::from_millis(500);
    c.session.silence_timeout = None;
    let (mut hub, peer, conn, now) = server_with_client(c);
    let mk = |ptype, flags, seq, payload: &[u8]| raw(conn, ptype, flags, seq, payload);
    // Older peer: its ack takes 1001; the ping at 1002 is lost; data 1003 must not wait forever.
    hub.handle(now, peer, &mk(PacketType::Ack, 0, 1001, b""));
    hub.handle(now, peer, &mk(PacketType::Data, 3, 1003, b"hello"));
    assert_eq!(hub.session(peer).unwrap().peer_rules(), PeerRules::Older);
    assert!(!events(&mut hub)
        .iter()
        .any(|e| matches!(e, HubEvent::Frame { .. })));
    hub.handle_timeout(now + Duration::from_millis(600));
    let ev = events(&mut hub);
    assert!(
        ev.iter()
            .any(|e| matches!(e, HubEvent::Frame { frame, .. } if &frame.payload[..] == b"hello")),
        "{ev:?}"
    );
    assert_eq!(hub.session(peer).unwrap().stats().holes_skipped, 1);
}

#[test]
fn newer_peer_sends_sequence_zero_on_unsequenced_packets() {
    let mut pair = Pair::new(8, cfg());
    pair.connect();
    let b = pair.b.addr;
    pair.a
        .hub
        .send(pair.now, b, "realtime", Bytes::from_static(b"r"))
        .unwrap();
    pair.a.hub.ping(b, b"p").unwrap();
    let mut buf = Vec::new();
    let mut seen = 0;
    while pair.a.hub.poll_transmit(pair.now, &mut buf).is_some() {
        let p = Packet::decode(&buf).unwrap();
        assert_eq!(p.sequence, 0, "{:?}", p.ptype);
        buf.clear();
        seen += 1;
    }
    assert_eq!(seen, 2);
}

#[test]
fn default_config_matches_the_facts() {
    let c = SessionConfig::default();
    assert_eq!(c.window, 32);
    assert_eq!(c.max_fragment_sets, 64);
    assert_eq!(c.max_payload, 16 * 1024 * 1024);
    assert_eq!(c.initial_resend_delay, Duration::from_millis(250));
    assert_eq!(c.connect_timeout, Duration::from_secs(3));
    assert_eq!(c.media_expiry, Duration::from_millis(75));
}

#[test]
fn frame_arriving_for_a_skipped_hole_is_delivered_late_not_dropped() {
    let mut c = cfg();
    c.session.silence_timeout = None;
    let (mut hub, peer, conn, now) = server_with_client(c);
    let mk = |ptype, flags, seq, payload: &[u8]| raw(conn, ptype, flags, seq, payload);
    hub.handle(now, peer, &mk(PacketType::Ack, 0, 1001, b""));
    hub.handle(now, peer, &mk(PacketType::Data, 3, 1003, b"second"));
    hub.handle_timeout(now + Duration::from_secs(2));
    // 1002 was a data frame whose resend comes after the skip.
    hub.handle(
        now + Duration::from_secs(2),
        peer,
        &mk(PacketType::Data, 3, 1002, b"first"),
    );
    let frames: Vec<Bytes> = events(&mut hub)
        .into_iter()
        .filter_map(|e| match e {
            HubEvent::Frame { frame, .. } => Some(frame.payload),
            _ => None,
        })
        .collect();
    assert_eq!(
        frames,
        vec![Bytes::from_static(b"second"), Bytes::from_static(b"first")]
    );
    let s = hub.session(peer).unwrap().stats();
    assert_eq!(
        (s.holes_skipped, s.late_after_skip, s.duplicates),
        (1, 1, 0)
    );
}

#[test]
fn unanswered_connects_expire_and_free_their_slot() {
    let (mut hub, now, conn) = hub_with(|c| {
        c.max_pending = 1;
    });
    let first: SocketAddr = "127.0.0.1:1".parse().unwrap();
    hub.handle(now, first, &connect_bytes(conn, 1, b"x"));
    assert_eq!(hub.pending_count(), 1);
    let req = hub.waiting(first).cloned().unwrap();
    let later = hub.poll_timeout().expect("pending connect has no deadline");
    assert_eq!(later, now + Duration::from_secs(2));
    hub.handle_timeout(later);
    assert_eq!(hub.stats().unanswered_connects, 1);
    assert_eq!(hub.pending_count(), 0);
    // A verdict that comes too late opens nothing: the client has given up by now.
    assert_eq!(hub.accept(later, &req), Err(HubError::Expired(first)));
    assert_eq!(hub.peer_count(), 0);
}

#[test]
fn a_full_waiting_room_drops_its_oldest_copy_but_a_verdict_on_it_still_counts() {
    let (mut hub, now, conn) = hub_with(|c| {
        c.max_pending = 1;
    });
    let first: SocketAddr = "127.0.0.1:1".parse().unwrap();
    let second: SocketAddr = "127.0.0.1:2".parse().unwrap();
    hub.handle(now, first, &connect_bytes(conn, 1, b"x"));
    hub.handle(
        now + Duration::from_millis(1),
        second,
        &connect_bytes(conn, 1, b"y"),
    );
    assert_eq!(
        (
            hub.stats().pending_evicted,
            hub.stats().peers_full,
            hub.pending_count()
        ),
        (1, 0, 1)
    );
    assert!(hub.waiting(first).is_none(), "the oldest copy makes room");
    let reqs = requests(&mut hub);
    assert_eq!(reqs.len(), 2, "both were reported to the owner");
    hub.accept(now, &reqs[0])
        .expect("the evicted one's verdict holds");
    hub.accept(now, &reqs[1]).expect("the newcomer waits");
    assert_eq!(hub.peer_count(), 2);
    assert_eq!(hub.pending_count(), 0);
    // A second verdict on the same Connect changes nothing.
    assert_eq!(
        hub.accept(now, &reqs[0]),
        Err(HubError::AlreadyAccepted(first))
    );
    assert_eq!(
        hub.refuse(&reqs[0], "late"),
        Err(HubError::Superseded(first))
    );
    assert_eq!(hub.stats().refused, 0);
}

#[test]
fn verdicts_that_come_after_the_sessions_filled_up_keep_the_peer_cap() {
    let (mut hub, now, conn) = hub_with(|c| {
        c.max_peers = 1;
    });
    let a: SocketAddr = "127.0.0.1:1".parse().unwrap();
    let b: SocketAddr = "127.0.0.1:2".parse().unwrap();
    // Both arrive while there is room; both are judged good.
    hub.handle(now, a, &connect_bytes(conn, 1, b"x"));
    hub.handle(now, b, &connect_bytes(conn, 1, b"y"));
    let (ra, rb) = (
        hub.waiting(a).cloned().unwrap(),
        hub.waiting(b).cloned().unwrap(),
    );
    hub.accept(now, &ra).unwrap();
    assert_eq!(hub.accept(now, &rb), Err(HubError::Full(b)));
    assert_eq!((hub.peer_count(), hub.stats().peers_full), (1, 1));
    let told = drain(&mut hub, now)
        .into_iter()
        .filter(|(to, _)| *to == b)
        .map(|(_, d)| {
            Packet::decode(&d)
                .map(|p| (p.ptype, p.payload.to_vec()))
                .unwrap()
        })
        .collect::<Vec<_>>();
    assert_eq!(
        told,
        vec![(PacketType::Disconnect, b"server full".to_vec())]
    );
}

#[test]
fn a_verdict_on_a_connect_replaced_by_a_newer_one_is_not_applied() {
    let (mut hub, now, conn) = hub_with(|_| {});
    let peer: SocketAddr = "127.0.0.1:1".parse().unwrap();
    hub.handle(now, peer, &connect_bytes(conn, 1, b"old"));
    let old = hub.waiting(peer).cloned().unwrap();
    hub.handle(now, peer, &connect_bytes(conn, 2, b"new"));
    assert_eq!(hub.accept(now, &old), Err(HubError::Superseded(peer)));
    assert_eq!(hub.refuse(&old, "no"), Err(HubError::Superseded(peer)));
    assert_eq!(hub.peer_count(), 0);
    accept_waiting(&mut hub, now, peer).expect("the newer one is answered");
    assert_eq!(&hub.session(peer).unwrap().connect_payload()[..], b"new");
}

#[test]
fn a_refusal_of_an_evicted_connect_still_tells_its_client() {
    let (mut hub, now, conn) = hub_with(|c| {
        c.max_pending = 1;
    });
    let first: SocketAddr = "127.0.0.1:1".parse().unwrap();
    hub.handle(now, first, &connect_bytes(conn, 1, b"x"));
    let req = hub.waiting(first).cloned().unwrap();
    hub.handle(
        now,
        "127.0.0.1:2".parse().unwrap(),
        &connect_bytes(conn, 1, b"y"),
    );
    assert!(hub.waiting(first).is_none());
    hub.refuse(&req, "unknown agent").unwrap();
    let out = drain(&mut hub, now);
    assert_eq!(out.len(), 1);
    assert_eq!(out[0].0, first);
    let p = Packet::decode(&out[0].1).unwrap();
    assert_eq!(
        (p.ptype, p.payload),
        (PacketType::Disconnect, &b"unknown agent"[..])
    );
}

#[test]
fn an_oversized_connect_is_refused_without_the_owner() {
    let (mut hub, now, conn) = hub_with(|_| {});
    let peer: SocketAddr = "127.0.0.1:1".parse().unwrap();
    let max = hub.config().max_connect_payload;
    hub.handle(now, peer, &connect_bytes(conn, 1, &vec![7; max + 1]));
    assert!(events(&mut hub).is_empty());
    assert_eq!(hub.pending_count(), 0);
    assert_eq!(hub.stats().oversized_connects, 1);
    let out = drain(&mut hub, now);
    let p = Packet::decode(&out[0].1).unwrap();
    assert_eq!(
        (p.ptype, p.payload),
        (PacketType::Disconnect, &b"connect payload too large"[..])
    );
    // At the limit it is the owner's to judge.
    hub.handle(now, peer, &connect_bytes(conn, 2, &vec![7; max]));
    assert_eq!(events(&mut hub).len(), 1);
}

/// The owner lags far behind a flood of Connects (its events queue behind them, as the gateway's
/// do under load): the waiting room turns over many times before the owner reaches the real
/// client's Connect, yet its verdict still lets the client in.
#[test]
fn an_owner_lagging_behind_a_connect_flood_still_lets_a_client_in() {
    let (mut hub, now, conn) = hub_with(|c| {
        c.max_pending = 16;
    });
    let real: SocketAddr = "127.0.0.1:4000".parse().unwrap();
    for i in 0..500u32 {
        let from = SocketAddr::from(([127, 0, (i / 250) as u8 + 1, (i % 250) as u8 + 1], 9));
        let at = now + Duration::from_micros(u64::from(i));
        hub.handle(at, from, &connect_bytes(conn, i, b"junk"));
        if i == 10 {
            hub.handle(at, real, &connect_bytes(conn, 7, b"real"));
        }
    }
    assert!(
        hub.waiting(real).is_none(),
        "evicted long before the owner gets to it"
    );
    for req in requests(&mut hub) {
        if &req.payload[..] == b"real" {
            hub.accept(now, &req).expect("the verdict still holds");
        } else {
            let _ = hub.refuse(&req, "bad credentials");
        }
    }
    assert_eq!(hub.peer_count(), 1);
    assert!(hub.session(real).is_some());
    assert_eq!(hub.stats().refused, 500);
    assert!(drain(&mut hub, now).iter().any(|(to, _)| *to == real));
}

/// Connects sprayed from 500 loopback addresses never take a session slot nor keep a real
/// client out: interleaved with the flood, its Connect is still waiting when the (lagging) owner
/// answers.
#[test]
fn connect_spray_from_many_addresses_does_not_lock_out_a_client() {
    let (mut hub, now, conn) = hub_with(|c| {
        c.max_peers = 4;
        c.max_pending = 16;
    });
    let real: SocketAddr = "127.0.0.1:4000".parse().unwrap();
    for i in 0..500u32 {
        let from = SocketAddr::from(([127, 0, (i / 250) as u8 + 1, (i % 250) as u8 + 1], 9));
        hub.handle(now, from, &connect_bytes(conn, i, b"junk"));
        if i == 250 {
            hub.handle(now, real, &connect_bytes(conn, 7, b"real"));
        }
        assert!(hub.pending_count() <= 16);
        if i % 10 != 9 {
            continue; // The owner lags: it answers every tenth datagram.
        }
        // The owner answers what it is asked, in order: junk is refused, the client accepted.
        for e in events(&mut hub) {
            if let HubEvent::ConnectRequest(req) = e {
                if &req.payload[..] == b"real" {
                    hub.accept(now, &req)
                        .expect("the client's connect was still waiting");
                } else {
                    let _ = hub.refuse(&req, "bad credentials");
                }
            }
        }
        drain(&mut hub, now);
    }
    assert_eq!(hub.peer_count(), 1);
    assert!(hub.session(real).is_some());
    assert_eq!(hub.stats().peers_full, 0);
    assert_eq!(hub.stats().refused, 500);
}

/// Frames B received before the first Disconnected event, as big-endian numbers, and that
/// event's reason.
fn numbers_then_disconnect(events: &[HubEvent]) -> (Vec<u32>, Option<CloseReason>) {
    let mut got = Vec::new();
    for e in events {
        match e {
            HubEvent::Frame { frame, .. } => {
                let p = &frame.payload;
                got.push(u32::from_be_bytes([p[0], p[1], p[2], p[3]]));
            }
            HubEvent::Disconnected { reason, .. } => return (got, Some(reason.clone())),
            _ => {}
        }
    }
    (got, None)
}

#[test]
fn a_finished_session_delivers_what_was_queued_then_disconnects() {
    let mut pair = Pair::new(21, cfg());
    pair.connect();
    let a = pair.a.addr;
    // Lossy towards A: some of B's frames and the acks for them need resending.
    pair.a.impair.loss = 0.2;
    pair.b.impair.loss = 0.2;
    for i in 0..100u32 {
        pair.b
            .hub
            .send(pair.now, a, "schema", Bytes::from(i.to_be_bytes().to_vec()))
            .unwrap();
    }
    // More than the window: 68 of them still wait behind it.
    assert!(pair.b.hub.session(a).unwrap().queued_bytes() > 0);
    pair.b.hub.finish(pair.now, a, "limits exceeded");
    assert!(pair.b.hub.session(a).unwrap().is_finishing());
    // It takes nothing new.
    assert_eq!(
        pair.b
            .hub
            .send(pair.now, a, "schema", Bytes::from_static(b"late")),
        Err(SendError::NotConnected)
    );
    let start = pair.now;
    assert!(
        pair.drive_until(100_000, |p| numbers_then_disconnect(&p.a.events)
            .1
            .is_some())
    );
    let (got, reason) = numbers_then_disconnect(&pair.a.events);
    assert_eq!(
        got,
        (0..100).collect::<Vec<_>>(),
        "everything, in order, first"
    );
    assert_eq!(reason, Some(CloseReason::Peer("limits exceeded".into())));
    assert!(
        pair.now < start + cfg().session.finish_linger,
        "it closed when delivered, not at the linger's end"
    );
    assert!(
        pair.drive_until(1000, |p| p.b.hub.session(a).is_none()),
        "reaped"
    );
}

#[test]
fn a_finishing_session_waits_for_its_acks_at_most_the_linger() {
    let mut c = cfg();
    c.session.keepalive = None;
    let linger = c.session.finish_linger;
    let mut pair = Pair::new(22, c);
    pair.connect();
    let a = pair.a.addr;
    // Nothing reaches A any more: nothing B sends is ever acknowledged.
    pair.a.impair.loss = 1.0;
    pair.b
        .hub
        .send(pair.now, a, "schema", Bytes::from_static(b"lost"))
        .unwrap();
    let start = pair.now;
    pair.b.hub.finish(pair.now, a, "bye");
    assert!(pair.drive_until(10_000, |p| p.now >= start + linger / 2));
    assert!(
        pair.b.hub.session(a).is_some_and(|s| s.is_finishing()),
        "still trying halfway through the linger"
    );
    assert!(pair.drive_until(10_000, |p| p.b.hub.session(a).is_none()));
    assert!(
        pair.now >= start + linger,
        "closed at {:?}",
        pair.now - start
    );
    assert!(
        pair.now < start + linger * 2,
        "closed at {:?}",
        pair.now - start
    );
}

#[test]
fn finishing_a_session_with_nothing_queued_or_not_yet_connected_closes_it_at_once() {
    let mut pair = Pair::new(23, cfg());
    pair.connect();
    let (a, b) = (pair.a.addr, pair.b.addr);
    pair.b.hub.finish(pair.now, a, "now");
    assert!(pair.b.hub.session(a).unwrap().close_reason().is_some());
    assert!(pair.drive_until(1000, |p| numbers_then_disconnect(&p.a.events).1.is_some()));
    // A client whose Connect is unanswered has nothing to deliver: it closes at once too.
    let mut lone = Hub::new(cfg(), 3);
    lone.connect(pair.now, b, Bytes::from_static(b"join"));
    lone.finish(pair.now, b, "never mind");
    assert!(lone.session(b).unwrap().close_reason().is_some());
}

/// What an older-rules peer (cultnet-rs at 402f6e7) sends once it has delivered a frame: an Ack
/// taking the next number from its one counter, naming the newest packet it received and the
/// 32 before it.
fn older_ack(conn: u32, seq: u32, newest: u32, received: impl Fn(u32) -> bool) -> Vec<u8> {
    let mut mask = 0u32;
    for bit in 0..32 {
        if newest > bit + 1 && received(newest - bit - 1) {
            mask |= 1 << bit;
        }
    }
    let mut b = Vec::new();
    Packet {
        ptype: PacketType::Ack,
        flags: Flags(0),
        connection_id: conn,
        sequence: seq,
        ack: newest,
        ack_mask: mask,
        fragment: Fragment::default(),
        channel: "control",
        payload: b"",
    }
    .encode(&mut b)
    .unwrap();
    b
}

#[test]
fn an_older_peer_gets_a_60kb_page_whole_and_its_one_ack_settles_it() {
    let mut c = cfg();
    c.session.silence_timeout = None;
    let (mut hub, peer, conn, now) = server_with_client(c);
    // Its ack takes a number: it follows the older rules. Then its request.
    hub.handle(now, peer, &raw(conn, PacketType::Ack, 0, 1001, b""));
    hub.handle(
        now,
        peer,
        &raw(conn, PacketType::Data, 3, 1002, b"pending?"),
    );
    assert_eq!(hub.session(peer).unwrap().peer_rules(), PeerRules::Older);
    drain(&mut hub, now);
    events(&mut hub);
    let page: Vec<u8> = (0..60_000u32).map(|i| (i % 251) as u8).collect();
    hub.send(now, peer, "schema", Bytes::from(page.clone()))
        .unwrap();
    // Every fragment goes out at once, without waiting for an ack that peer would not send
    // before it has the whole frame.
    let datagrams = drain(&mut hub, now);
    let data: Vec<_> = datagrams
        .iter()
        .map(|(_, b)| Packet::decode(b).unwrap())
        .filter(|p| p.ptype == PacketType::Data)
        .map(|p| (p.sequence, p.fragment, p.payload.len()))
        .collect();
    let count = data.first().map(|(_, f, _)| f.count).unwrap_or(0);
    assert!(
        (2..=32).contains(&count),
        "{count} fragments: its one ack covers at most 33"
    );
    assert_eq!(data.len(), count as usize, "the whole set at once");
    assert_eq!(data.iter().map(|(_, _, n)| n).sum::<usize>(), page.len());
    let first = data[0].0;
    let last = data[data.len() - 1].0;
    assert_eq!(last - first + 1, u32::from(count), "consecutive sequences");
    // Its one ack after delivering the page settles every fragment: nothing is resent.
    let set = first..=last;
    hub.handle(
        now,
        peer,
        &older_ack(conn, 1003, last, |s| set.contains(&s) || s <= first),
    );
    assert_eq!(hub.session(peer).unwrap().in_flight(), 0);
    let later = now + Duration::from_secs(5);
    hub.handle_timeout(later);
    let resent = drain(&mut hub, later)
        .iter()
        .map(|(_, b)| Packet::decode(b).unwrap())
        .filter(|p| p.ptype == PacketType::Data)
        .count();
    assert_eq!(resent, 0);
}

/// An unsequenced Data packet on `channel`, as whoever holds a peer's address could send it.
fn unsequenced(conn: u32, channel: &str, payload: &[u8]) -> Vec<u8> {
    let mut b = Vec::new();
    Packet {
        ptype: PacketType::Data,
        flags: Flags(0),
        connection_id: conn,
        sequence: 0,
        ack: 0,
        ack_mask: 0,
        fragment: Fragment::default(),
        channel,
        payload,
    }
    .encode(&mut b)
    .unwrap();
    b
}

#[test]
fn an_unsequenced_packet_on_a_reliable_channel_is_not_delivered() {
    let (mut hub, peer, conn, now) = server_with_client(cfg());
    // Whoever holds the peer's address sends a request unsequenced, outside its sequence.
    hub.handle(now, peer, &unsequenced(conn, "schema", b"forged"));
    assert!(!events(&mut hub)
        .iter()
        .any(|e| matches!(e, HubEvent::Frame { .. })));
    assert_eq!(hub.session(peer).unwrap().stats().invalid, 1);
    // On a channel whose rule is unreliable, the same is a frame.
    hub.handle(now, peer, &unsequenced(conn, "realtime", b"r"));
    assert!(events(&mut hub)
        .iter()
        .any(|e| matches!(e, HubEvent::Frame { .. })));
}

#[test]
fn guessing_at_a_sessions_sequence_ends_it_after_a_bounded_number_of_tries() {
    let (mut hub, peer, conn, now) = server_with_client(cfg());
    let max = hub.config().session.max_out_of_window;
    // Whoever took the peer's address guesses sequences far from the session's.
    for i in 0..max {
        let guess = 0x4000_0000u32.wrapping_add((i as u32) * 7919);
        hub.handle(now, peer, &raw(conn, PacketType::Data, 3, guess, b"forged"));
        if i + 1 < max {
            assert!(
                hub.session(peer).is_some(),
                "closed after {} guesses",
                i + 1
            );
        }
    }
    let ev = events(&mut hub);
    assert!(
        !ev.iter().any(|e| matches!(e, HubEvent::Frame { .. })),
        "a guess was delivered"
    );
    assert!(
        ev.iter().any(|e| matches!(
            e,
            HubEvent::Disconnected {
                reason: crate::error::CloseReason::PeerMisbehaved(_),
                ..
            }
        )),
        "{ev:?}"
    );
}
