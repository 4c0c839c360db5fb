//! Criterion: encode + decode of a 64-byte data packet, and a `cultnet.schema.v0` hello.

use criterion::{black_box, criterion_group, criterion_main, Criterion};
use wire::msg::Message;
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
}

criterion_group!(benches, codec);
criterion_main!(benches);
