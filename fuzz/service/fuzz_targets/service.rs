//! An authenticated CultNet client's session with the gateway service, fed an arbitrary
//! sequence of messages: raw bytes, documents of every request type with arbitrary payload
//! bytes, and well-formed requests with fuzzed fields (Personas, seqs, texts, record keys), on
//! the real sled inbox. No panic; every answer the service sends is a message that decodes;
//! acks never move the watermark beyond what was delivered, nor backwards.
#![no_main]

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use bytes::Bytes;
use ed25519_dalek::SigningKey;
use gateway::config::{Client, Verb};
use gateway::inbox::Inbox;
use gateway::service::{Answer, ClientLimits, Port, Service, CHANNEL};
use libfuzzer_sys::fuzz_target;
use wire::docs::{ids, ConnectPayload, Delivery};
use wire::msg::{Message, Put, RawDocument};
use wire::session::{Frame, GATEWAY_CONNECTION_ID};

const SCHEMAS: [&str; 12] = [
    ids::PENDING_REQUEST,
    ids::ACK_REQUEST,
    ids::SEND_REQUEST,
    ids::TURN_REQUEST,
    ids::STATUS_REQUEST,
    ids::NOTE_REQUEST,
    ids::CONTROL_REQUEST,
    ids::EXTENSION_PENDING_REQUEST,
    ids::EXTENSION_ACK_REQUEST,
    ids::PENDING_PAGE,
    ids::DELIVERY,
    "cultnet.unknown.v0",
];
const PERSONAS: [&str; 4] = ["mira", "otto", "nobody", ""];

/// One inbox for the whole run (opening sled per input would be the whole cost); each input
/// gets a fresh Service over it.
fn inbox() -> &'static Mutex<Inbox> {
    static INBOX: OnceLock<Mutex<Inbox>> = OnceLock::new();
    INBOX.get_or_init(|| {
        // A fuzzing run ends with exit(), never dropping this: earlier runs' directories (their
        // processes gone) are removed here instead.
        let base = std::env::temp_dir();
        for entry in std::fs::read_dir(&base).into_iter().flatten().flatten() {
            let name = entry.file_name();
            let pid = name
                .to_str()
                .and_then(|n| n.strip_prefix("cultnet-fuzz-service-"));
            if pid.is_some_and(|p| !std::path::Path::new("/proc").join(p).exists()) {
                let _ = std::fs::remove_dir_all(entry.path());
            }
        }
        let dir = base.join(format!("cultnet-fuzz-service-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let inbox = Inbox::open(&dir.join("inbox")).expect("inbox");
        let d = |i: u64| Delivery {
            event_id: format!("$e{i}"),
            room_id: "!r:l".into(),
            sender: "@ann:l".into(),
            text: format!("line {i}"),
            ..Delivery::default()
        };
        for r in 0..3u64 {
            let batch: Vec<Delivery> = (0..20).map(|i| d(r * 20 + i)).collect();
            inbox
                .ingest("mira", &format!("t{r}"), &batch)
                .expect("ingest");
        }
        Mutex::new(inbox)
    })
}

fn take<'a>(data: &mut &'a [u8], n: usize) -> &'a [u8] {
    let n = n.min(data.len());
    let (head, tail) = data.split_at(n);
    *data = tail;
    head
}

fn byte(data: &mut &[u8]) -> u8 {
    take(data, 1).first().copied().unwrap_or(0)
}

fn text(data: &mut &[u8]) -> String {
    let n = byte(data) as usize % 48;
    String::from_utf8_lossy(take(data, n)).into_owned()
}

fn put(schema: &str, key: &str, payload: Vec<u8>) -> Vec<u8> {
    let mut doc = RawDocument::from_payload(schema, key, "2026-12-03T00:00:00Z", &());
    doc.payload = serde_bytes::ByteBuf::from(payload);
    Message::DocumentPutRaw(Put {
        message_id: "m".into(),
        document: doc,
    })
    .encode()
}

/// A well-formed request of a fuzz-chosen type with fuzzed fields.
fn request(data: &mut &[u8]) -> Vec<u8> {
    use wire::docs::*;
    let kind = byte(data) % 7;
    let persona = PERSONAS[byte(data) as usize % PERSONAS.len()].to_owned();
    let seq = u64::from(byte(data)) % 80;
    let key = text(data);
    let doc = |schema: &str, p: &dyn erased::Payload| p.document(schema, &key);
    let bytes = match kind {
        0 => doc(
            ids::PENDING_REQUEST,
            &PendingRequest {
                persona,
                after_seq: seq,
                limit: Some(u32::from(byte(data))),
                reply_bytes: Some(u32::from(byte(data)) * 64),
            },
        ),
        1 => doc(
            ids::ACK_REQUEST,
            &AckRequest {
                persona,
                through_seq: seq,
            },
        ),
        2 => doc(
            ids::STATUS_REQUEST,
            &StatusRequest {
                persona: Some(persona),
            },
        ),
        3 => doc(
            ids::TURN_REQUEST,
            &TurnRequest {
                persona,
                ..TurnRequest::default()
            },
        ),
        4 => doc(
            ids::NOTE_REQUEST,
            &NoteRequest {
                persona,
                note_id: text(data),
                kind: text(data),
                text: text(data),
                ..NoteRequest::default()
            },
        ),
        5 => doc(
            ids::EXTENSION_PENDING_REQUEST,
            &ExtensionPendingRequest {
                persona,
                after_seq: seq,
                limit: Some(u32::from(byte(data))),
            },
        ),
        _ => doc(
            ids::EXTENSION_ACK_REQUEST,
            &ExtensionAckRequest {
                persona,
                through_seq: seq,
            },
        ),
    };
    bytes
}

mod erased {
    use serde::Serialize;
    pub trait Payload {
        fn document(&self, schema: &str, key: &str) -> Vec<u8>;
    }
    impl<T: Serialize> Payload for T {
        fn document(&self, schema: &str, key: &str) -> Vec<u8> {
            wire::msg::Message::DocumentPutRaw(wire::msg::Put {
                message_id: "m".into(),
                document: wire::msg::RawDocument::from_payload(
                    schema,
                    key,
                    "2026-12-03T00:00:00Z",
                    self,
                ),
            })
            .encode()
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let inbox = inbox().lock().unwrap_or_else(|p| p.into_inner()).clone();
    let key = SigningKey::from_bytes(&[5; 32]);
    let clients = [Client::for_key(
        "organ",
        &key.verifying_key(),
        &["mira", "otto"],
        &Verb::ALL,
    )];
    let mut ports = BTreeMap::new();
    ports.insert("mira".to_owned(), Port::new("@mira:l", 1000));
    ports.insert("otto".to_owned(), Port::new("@otto:l", 1000));
    let mut svc = Service::new(
        "fuzz",
        GATEWAY_CONNECTION_ID,
        120,
        inbox.clone(),
        &clients,
        ports,
    )
    .with_limits(ClientLimits {
        requests_per_sec: 50.0,
        burst: 20.0,
        max_in_flight: 2,
    });
    let now_ms = 1_800_000_000_000;
    let peer: SocketAddr = "127.0.0.1:9".parse().unwrap();
    let payload = ConnectPayload::sign(&key, GATEWAY_CONNECTION_ID, "organ", now_ms, "n1");
    svc.authenticate(peer, &payload.encode(), now_ms)
        .expect("the pinned client connects");
    let mut now = Instant::now();
    let before = inbox.counts("mira").expect("counts");
    let mut rest = data;
    while !rest.is_empty() {
        let mode = byte(&mut rest);
        let bytes = match mode % 4 {
            0 => {
                let n = u16::from_be_bytes([byte(&mut rest), byte(&mut rest)]) as usize % 2048;
                take(&mut rest, n).to_vec()
            }
            1 => {
                let schema = SCHEMAS[byte(&mut rest) as usize % SCHEMAS.len()];
                let n = byte(&mut rest) as usize;
                put(schema, "k", take(&mut rest, n).to_vec())
            }
            _ => request(&mut rest),
        };
        let channel: Arc<str> = if mode & 0x80 != 0 {
            Arc::from("control")
        } else {
            Arc::from(CHANNEL)
        };
        now += Duration::from_millis(u64::from(mode & 0x30));
        let frame = Frame {
            channel,
            payload: Bytes::from(bytes),
        };
        for answer in svc.handle_at(peer, &frame, now) {
            match answer {
                Answer::Reply(b) | Answer::AfterFlush { ok: b, .. } => {
                    Message::decode(&b).expect("every answer decodes");
                }
                Answer::Disconnect(_) => return,
                _ => {}
            }
        }
        svc.commit().expect("flush");
        let c = inbox.counts("mira").expect("counts");
        assert!(c.acked_through <= c.highest && c.acked_through >= before.acked_through);
    }
});
