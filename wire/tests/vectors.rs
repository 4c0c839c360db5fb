//! Every reference vector (fixtures/cultnet, copied from ../shared/vectors/cultnet) decodes to
//! the values its README row names, and packets re-encode byte for byte.

use bytes::Bytes;
use wire::msg::{FrameDecoder, Message, DEFAULT_MAX_FRAME};
use wire::packet::{Flags, Packet, PacketType};

fn fixture(name: &str) -> Vec<u8> {
    let path = format!("{}/../fixtures/cultnet/{name}", env!("CARGO_MANIFEST_DIR"));
    std::fs::read(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
}

fn reencode(bytes: &[u8]) {
    let p = Packet::decode(bytes).unwrap();
    let mut out = Vec::new();
    p.encode(&mut out).unwrap();
    assert_eq!(out, bytes, "re-encoding differs");
}

#[test]
fn rudp_connect() {
    let b = fixture("rudp-connect.bin");
    let p = Packet::decode(&b).unwrap();
    assert_eq!(p.ptype, PacketType::Connect);
    assert_eq!(p.connection_id, 0xE91F_0003);
    assert_eq!(p.sequence, 1);
    assert_eq!(p.channel, "control");
    assert!(p.flags.has(Flags::RELIABLE | Flags::ORDERED));
    assert_eq!(p.payload, b"join");
    reencode(&b);
}

#[test]
fn rudp_accept() {
    let b = fixture("rudp-accept.bin");
    let p = Packet::decode(&b).unwrap();
    assert_eq!(p.ptype, PacketType::Accept);
    assert_eq!((p.sequence, p.ack), (100, 1));
    assert!(p.payload.is_empty());
    reencode(&b);
}

#[test]
fn older_rules_control_packets_consume_sequences() {
    for (name, ptype, seq, payload) in [
        ("rudp-ack.bin", PacketType::Ack, 2, &b""[..]),
        ("rudp-ping.bin", PacketType::Ping, 4, &b"p"[..]),
        (
            "rudp-disconnect.bin",
            PacketType::Disconnect,
            5,
            &b"bye"[..],
        ),
    ] {
        let b = fixture(name);
        let p = Packet::decode(&b).unwrap();
        assert_eq!(p.ptype, ptype, "{name}");
        assert_eq!(p.sequence, seq, "{name}");
        assert_eq!(p.ack, 100, "{name}");
        assert_eq!(p.payload, payload, "{name}");
        assert_eq!(p.channel, "control");
        reencode(&b);
    }
}

#[test]
fn rudp_data_hello() {
    let b = fixture("rudp-data-hello.bin");
    let p = Packet::decode(&b).unwrap();
    assert_eq!(p.ptype, PacketType::Data);
    assert_eq!(p.channel, "schema");
    assert!(p.flags.has(Flags::RELIABLE | Flags::ORDERED));
    assert_eq!((p.sequence, p.ack), (3, 100));
    assert_eq!(p.payload, fixture("hello.msgpack"));
    reencode(&b);
}

fn probe_hello(m: Message) {
    let Message::Hello(h) = m else {
        panic!("not a hello: {m:?}")
    };
    assert_eq!(h.runtime_id, "probe-client");
    assert_eq!(h.runtime_kind, "probe");
    assert_eq!(h.role.as_deref(), Some("tester"));
    assert_eq!(
        h.supported_message_versions,
        Some(vec!["cultnet.document_put_raw.v0".to_owned()])
    );
    assert_eq!(h.supports_schema_catalog, Some(true));
}

#[test]
fn hello_and_its_stream_frame() {
    probe_hello(Message::decode(&fixture("hello.msgpack")).unwrap());
    let mut d = FrameDecoder::new(DEFAULT_MAX_FRAME);
    d.push(&fixture("hello.stream-frame"));
    let f = d.next_frame().unwrap().unwrap();
    assert_eq!(f, Bytes::from(fixture("hello.msgpack")));
    probe_hello(Message::decode(&f).unwrap());
    assert_eq!(
        wire::msg::frame(&f, DEFAULT_MAX_FRAME).unwrap(),
        fixture("hello.stream-frame")
    );
}

#[test]
fn typescript_hello_key_order() {
    let mut d = FrameDecoder::new(DEFAULT_MAX_FRAME);
    d.push(&fixture("ts-hello.stream-frame"));
    let f = d.next_frame().unwrap().unwrap();
    d.finish().unwrap();
    let Message::Hello(h) = Message::decode(&f).unwrap() else {
        panic!()
    };
    assert_eq!(h.runtime_id, "voidbot-main");
    assert_eq!(h.runtime_kind, "node-worker");
    assert_eq!(h.agent_id.as_deref(), Some("void"));
    assert_eq!(h.display_name.as_deref(), Some("Void"));
    assert_eq!(
        h.supported_document_types,
        Some(vec!["ghostlight.agent-state".to_owned()])
    );
}

#[test]
fn document_put_raw() {
    let Message::DocumentPutRaw(p) = Message::decode(&fixture("document_put_raw.msgpack")).unwrap()
    else {
        panic!()
    };
    assert_eq!(p.message_id, "m-1");
    let d = &p.document;
    assert_eq!(d.schema_id, "probe.note.v0");
    assert_eq!(d.record_key, "k1");
    assert_eq!(d.stored_at, "2026-01-01T00:00:00Z");
    assert_eq!(d.payload_encoding.as_deref(), Some("messagepack"));
    assert_eq!(d.payload.as_slice(), &fixture("note-payload.msgpack")[..]);
    assert_eq!(d.source_runtime_id.as_deref(), Some("rt"));
    assert_eq!(
        (
            d.source_agent_id.as_ref(),
            d.source_role.as_ref(),
            d.tags.as_ref()
        ),
        (None, None, None)
    );
    #[derive(serde::Deserialize)]
    struct Note {
        text: String,
    }
    assert_eq!(d.payload_as::<Note>().unwrap().text, "hi");
    // Our encoding decodes to the same value.
    let again = Message::decode(&Message::DocumentPutRaw(p.clone()).encode()).unwrap();
    assert_eq!(again, Message::DocumentPutRaw(p));
}

#[test]
fn document_put() {
    let Message::DocumentPut(p) = Message::decode(&fixture("document_put.msgpack")).unwrap() else {
        panic!()
    };
    assert_eq!(p.message_id, "m-2");
    assert_eq!(p.document.schema_id, "probe.note.v0");
    assert_eq!(p.document.record_key, "k1");
    assert_eq!(p.document.tags, Some(vec!["t".to_owned()]));
    assert_eq!(
        p.document.payload,
        rmpv::Value::Map(vec![("text".into(), "hi".into())])
    );
}

#[test]
fn error_snapshot_and_catalog_requests() {
    let Message::Error(e) = Message::decode(&fixture("error.msgpack")).unwrap() else {
        panic!()
    };
    assert_eq!(e.error, "nope");
    let Message::SnapshotRequest(s) =
        Message::decode(&fixture("snapshot_request.msgpack")).unwrap()
    else {
        panic!()
    };
    assert_eq!(s.message_id, "s-1");
    assert_eq!(s.schema_ids, Some(vec!["probe.note.v0".to_owned()]));
    assert_eq!(s.record_keys, None);
    let Message::SchemaCatalogRequest(c) =
        Message::decode(&fixture("schema_catalog_request.msgpack")).unwrap()
    else {
        panic!()
    };
    assert_eq!(c.message_id, "c-1");
    assert_eq!(c.include_schema_json, Some(false));
}

/// An older-rules client, replayed from the vectors, is served without losing its frames.
#[test]
fn older_peer_replayed_from_vectors() {
    use std::time::Instant;
    use wire::hub::{Hub, HubConfig, HubEvent};
    let mut cfg = HubConfig::default();
    cfg.session.connection_id = 0xE91F_0003;
    let mut hub = Hub::new(cfg, 1);
    let now = Instant::now();
    let peer = "127.0.0.1:4000".parse().unwrap();
    hub.handle(now, peer, &fixture("rudp-connect.bin"));
    let Some(HubEvent::ConnectRequest(req)) = hub.poll_event() else {
        panic!()
    };
    assert_eq!(&req.payload[..], b"join");
    hub.accept(now, &req).unwrap();
    let mut buf = Vec::new();
    assert_eq!(hub.poll_transmit(now, &mut buf), Some(peer));
    let accept = Packet::decode(&buf).unwrap();
    assert_eq!((accept.ptype, accept.ack), (PacketType::Accept, 1));
    let accept_seq = accept.sequence;
    // The vectors were captured against an Accept with sequence 100; rewrite their ack fields.
    let with_ack = |name: &str| {
        let b = fixture(name);
        let p = Packet::decode(&b).unwrap();
        let mut out = Vec::new();
        Packet {
            ack: accept_seq,
            ..p
        }
        .encode(&mut out)
        .unwrap();
        out
    };
    hub.handle(now, peer, &with_ack("rudp-ack.bin"));
    // Data (seq 3) arrives before the Ping (seq 4) and Disconnect (seq 5).
    hub.handle(now, peer, &with_ack("rudp-data-hello.bin"));
    hub.handle(now, peer, &with_ack("rudp-ping.bin"));
    let mut events = Vec::new();
    while let Some(e) = hub.poll_event() {
        events.push(e);
    }
    assert!(events
        .iter()
        .any(|e| matches!(e, HubEvent::Connected { .. })));
    let frames: Vec<_> = events
        .iter()
        .filter_map(|e| match e {
            HubEvent::Frame { frame, .. } => Some(frame.payload.clone()),
            _ => None,
        })
        .collect();
    assert_eq!(frames, vec![Bytes::from(fixture("hello.msgpack"))]);
    let s = hub.session(peer).unwrap();
    assert_eq!(s.peer_rules(), wire::session::PeerRules::Older);
    // Our controls (the ack of the data, the pong) carry sequence 0: that peer's ordered
    // delivery waits for the exact next sequence of a channel, so a control taking a number
    // would hold every later frame; it checks duplicates on Data only.
    let mut pong = false;
    loop {
        buf.clear();
        if hub.poll_transmit(now, &mut buf).is_none() {
            break;
        }
        let p = Packet::decode(&buf).unwrap();
        assert_eq!(
            p.sequence, 0,
            "{:?} takes a sequence towards an older peer",
            p.ptype
        );
        pong |= p.ptype == PacketType::Pong && p.payload == b"p";
    }
    assert!(pong, "ping not answered");
    // Two answers on `schema` after them take consecutive sequences right after the Accept's.
    hub.send(now, peer, "schema", Bytes::from_static(b"one"))
        .unwrap();
    hub.send(now, peer, "schema", Bytes::from_static(b"two"))
        .unwrap();
    let mut data = Vec::new();
    loop {
        buf.clear();
        if hub.poll_transmit(now, &mut buf).is_none() {
            break;
        }
        let p = Packet::decode(&buf).unwrap();
        if p.ptype == PacketType::Data {
            data.push(p.sequence);
        } else {
            assert_eq!(p.sequence, 0, "{:?}", p.ptype);
        }
    }
    assert_eq!(data, [accept_seq + 1, accept_seq + 2]);
    hub.handle(now, peer, &with_ack("rudp-disconnect.bin"));
    let Some(HubEvent::Disconnected { reason, .. }) = hub.poll_event() else {
        panic!()
    };
    assert_eq!(reason, wire::CloseReason::Peer("bye".into()));
}
