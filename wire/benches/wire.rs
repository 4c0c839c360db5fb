//! Criterion: encode + decode of a 64-byte data packet, a `cultnet.schema.v0` hello, and the
//! gateway's status answer as its client reads it (the message, then the document's payload).

use criterion::{black_box, criterion_group, criterion_main, Criterion};
use wire::docs::{ids, GatewayStatus, PersonaStatus};
use wire::msg::{Message, Put, RawDocument};
use wire::packet::{Flags, Fragment, Packet, PacketType};

fn codec(c: &mut Criterion) {
    let payload = [7u8; 64];
    let mut buf = Vec::with_capacity(256);
    c.bench_function("packet encode+decode 64B data", |b| {
        b.iter(|| {
            buf.clear();
            Packet {
                ptype: PacketType::Data,
                flags: Flags(Flags::RELIABLE | Flags::ORDERED),
                connection_id: 0xE91F_0004,
                sequence: black_box(12345),
                ack: 77,
                ack_mask: 0xFFFF_0000,
                fragment: Fragment::default(),
                channel: "schema",
                payload: black_box(&payload),
            }
            .encode(&mut buf)
            .unwrap();
            let p = Packet::decode(black_box(&buf)).unwrap();
            black_box(p.sequence);
        })
    });
    let hello = include_bytes!("../../fixtures/cultnet/hello.msgpack");
    c.bench_function("message decode hello", |b| {
        b.iter(|| Message::decode(black_box(hello)).unwrap())
    });
    let status = GatewayStatus {
        runtime_id: "cultnet-gateway-8d6f0c2e-3a41-4f5e-9b0e-2f4c1d7a9e11".into(),
        version: "0.1.0".into(),
        started_at: "2026-12-04T10:20:58Z".into(),
        peers: 3,
        personas: vec![PersonaStatus {
            persona: "mira".into(),
            user_id: "@mira:localhost".into(),
            sync_state: "syncing".into(),
            pending_count: 4,
            highest_seq: 1200,
            acked_through: 1196,
            last_error: None,
        }],
    };
    let answer = Message::DocumentPutRaw(Put {
        message_id: "6b1f7c7e-2d2b-4a57-8f43-64a0a3e0c1d9".into(),
        document: RawDocument::from_payload(ids::STATUS, "r1", "2026-12-04T10:21:00Z", &status),
    })
    .encode();
    c.bench_function("message decode status answer + payload", |b| {
        b.iter(|| match Message::decode(black_box(&answer)).unwrap() {
            Message::DocumentPutRaw(p) => p.document.payload_as::<GatewayStatus>().unwrap(),
            _ => unreachable!("encoded as a put"),
        })
    });
}

criterion_group!(benches, codec);
criterion_main!(benches);
