//! Every decoder on arbitrary bytes: no panic, and packets re-encode to the same length.
#![no_main]

use libfuzzer_sys::fuzz_target;
use wire::docs::{ConnectPayload, Request};
use wire::msg::{FrameDecoder, Message};
use wire::packet::Packet;

fuzz_target!(|data: &[u8]| {
    if let Ok(p) = Packet::decode(data) {
        let mut out = Vec::new();
        p.encode(&mut out).unwrap();
        assert_eq!(out.len(), data.len());
        let _ = Message::decode(p.payload);
    }
    if let Ok(Message::DocumentPutRaw(put)) = Message::decode(data) {
        let _ = Request::from_document(&put.document);
    }
    let mut d = FrameDecoder::new(1 << 20);
    d.push(data);
    while let Ok(Some(f)) = d.next_frame() {
        let _ = Message::decode(&f);
    }
    let _ = d.finish();
    let _ = ConnectPayload::decode(data);
});
