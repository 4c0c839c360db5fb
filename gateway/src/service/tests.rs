use std::sync::Arc;
use std::time::Duration;

use ed25519_dalek::SigningKey;
use wire::docs::{
    AckRequest, Delivery, PendingPage, PendingRequest, SendRequest, StatusRequest, TurnRequest,
};
use wire::hub::HubError;
use wire::msg::{Hello, SchemaCatalogRequest};
use wire::session::GATEWAY_CONNECTION_ID;

use super::run::{endpoint_event, DRAIN_SESSIONS, DRAIN_TASKS};
use super::*;

const NOW: u64 = 1_800_000_000_000;

fn key(seed: u8) -> SigningKey {
    SigningKey::from_bytes(&[seed; 32])
}

fn client(agent: &str, seed: u8, personas: &[&str], verbs: &[Verb]) -> Client {
    Client::for_key(agent, &key(seed).verifying_key(), personas, verbs)
}

fn port(trigger: Option<Arc<Notify>>) -> Port {
    Port {
        turn_requests: trigger,
        ..Port::new("@mira:l", 1000)
    }
}

struct Fixture {
    svc: Service,
    inbox: Inbox,
    metrics: Arc<crate::metrics::Metrics>,
    trigger: Arc<Notify>,
    _dir: crate::scratch::Dir,
}

fn fixture(name: &str) -> Fixture {
    let dir = crate::scratch::Dir::new(&format!("service-{name}"));
    let inbox = Inbox::open(&dir).unwrap();
    let trigger = Arc::new(Notify::new());
    let mut ports = BTreeMap::new();
    ports.insert("mira".to_owned(), port(Some(trigger.clone())));
    ports.insert("otto".to_owned(), port(None));
    let clients = [
        client("organ", 1, &["mira"], &Verb::ALL),
        client("heartbeat", 2, &["*"], &[Verb::Status, Verb::Turn]),
    ];
    let metrics = crate::metrics::unserved();
    Fixture {
        svc: Service::new(
            "gw-test",
            GATEWAY_CONNECTION_ID,
            120,
            inbox.clone(),
            &clients,
            ports,
        )
        .with_metrics(metrics.clone()),
        metrics,
        inbox,
        trigger,
        _dir: dir,
    }
}

fn peer(n: u16) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 40_000 + n))
}

fn connect(
    svc: &mut Service,
    p: SocketAddr,
    agent: &str,
    seed: u8,
    nonce: &str,
) -> Result<String, Refusal> {
    let payload = ConnectPayload::sign(&key(seed), GATEWAY_CONNECTION_ID, agent, NOW, nonce);
    svc.authenticate(p, &payload.encode(), NOW)
}

fn frame(bytes: Vec<u8>) -> Frame {
    Frame {
        channel: Arc::from(CHANNEL),
        payload: Bytes::from(bytes),
    }
}

fn put<T: Serialize>(schema: &str, record_key: &str, payload: &T) -> Frame {
    frame(
        Message::DocumentPutRaw(Put {
            message_id: "m1".into(),
            document: RawDocument::from_payload(
                schema,
                record_key,
                "2026-12-02T00:00:00Z",
                payload,
            ),
        })
        .encode(),
    )
}

fn reply(answers: &[Answer]) -> Message {
    match answers.first() {
        Some(Answer::Reply(b)) | Some(Answer::AfterFlush { ok: b, .. }) => {
            Message::decode(b).unwrap()
        }
        other => panic!("expected a reply, got {other:?}"),
    }
}

/// The receipt document of the first answer: its schema, record key and payload.
fn receipt<T: serde::de::DeserializeOwned>(answers: &[Answer]) -> (String, String, T) {
    match reply(answers) {
        Message::DocumentPutRaw(p) => {
            assert_eq!(p.document.source_runtime_id.as_deref(), Some("gw-test"));
            let payload = p.document.payload_as().unwrap();
            (p.document.schema_id, p.document.record_key, payload)
        }
        other => panic!("expected a receipt, got {other:?}"),
    }
}

fn error_text(answers: &[Answer]) -> String {
    match reply(answers) {
        Message::Error(e) => e.error,
        other => panic!("expected an error, got {other:?}"),
    }
}

#[test]
fn connect_needs_a_configured_agent_its_pinned_key_a_fresh_time_and_a_new_nonce() {
    let mut f = fixture("auth");
    assert_eq!(
        connect(&mut f.svc, peer(1), "organ", 1, "n1").unwrap(),
        "organ"
    );
    // Signed by another key.
    assert!(matches!(
        connect(&mut f.svc, peer(2), "organ", 9, "n2"),
        Err(Refusal::Auth(AuthError::BadSignature(_)))
    ));
    assert!(matches!(
        connect(&mut f.svc, peer(2), "stranger", 1, "n3"),
        Err(Refusal::UnknownAgent(a)) if a == "stranger"
    ));
    // The same nonce again from another address: a replay.
    assert!(matches!(
        connect(&mut f.svc, peer(3), "organ", 1, "n1"),
        Err(Refusal::Replay(_))
    ));
    // From the address that used it, it is that client resending its Connect (its first
    // answer was lost to a full waiting room): let through, still checked.
    assert_eq!(
        connect(&mut f.svc, peer(1), "organ", 1, "n1").unwrap(),
        "organ"
    );
    let forged = ConnectPayload::sign(&key(9), GATEWAY_CONNECTION_ID, "organ", NOW, "n1");
    assert!(matches!(
        f.svc.authenticate(peer(1), &forged.encode(), NOW),
        Err(Refusal::Auth(AuthError::BadSignature(_)))
    ));
    // Signed for another service's connection id.
    let other = ConnectPayload::sign(&key(1), 0xE91F_0001, "organ", NOW, "n4");
    assert!(matches!(
        f.svc.authenticate(peer(4), &other.encode(), NOW),
        Err(Refusal::Auth(AuthError::BadSignature(_)))
    ));
    // Issued too long ago.
    let stale = ConnectPayload::sign(&key(1), GATEWAY_CONNECTION_ID, "organ", NOW - 121_000, "n5");
    assert!(matches!(
        f.svc.authenticate(peer(5), &stale.encode(), NOW),
        Err(Refusal::Auth(AuthError::Stale { .. }))
    ));
    assert!(matches!(
        f.svc.authenticate(peer(6), b"\xc1 not msgpack", NOW),
        Err(Refusal::Auth(AuthError::Malformed(_)))
    ));
    assert_eq!(f.svc.stats().accepted, 2);
    assert_eq!(f.svc.stats().refused, 7);
    // Refused peers are not heard.
    assert!(f.svc.handle(peer(2), &frame(vec![0xc0])).is_empty());
}

#[test]
fn hello_catalog_and_bad_messages_are_answered() {
    let mut f = fixture("hello");
    connect(&mut f.svc, peer(1), "organ", 1, "n").unwrap();
    let hello = Message::Hello(Hello {
        runtime_id: "organ-1".into(),
        runtime_kind: "organ".into(),
        ..Hello::default()
    });
    let Message::Hello(h) = reply(&f.svc.handle(peer(1), &frame(hello.encode()))) else {
        panic!()
    };
    assert_eq!(h.runtime_id, "gw-test");
    assert!(h
        .supported_document_types
        .unwrap()
        .contains(&ids::SEND_REQUEST.to_owned()));
    // A second hello in the same session, and an error from the client, are not answered
    // (two peers that answer those would talk forever).
    assert!(f.svc.handle(peer(1), &frame(hello.encode())).is_empty());
    let err = Message::Error(wire::msg::ErrorMsg {
        error: "client-side trouble".into(),
    });
    assert!(f.svc.handle(peer(1), &frame(err.encode())).is_empty());
    let cat = Message::SchemaCatalogRequest(SchemaCatalogRequest {
        message_id: "c1".into(),
        ..SchemaCatalogRequest::default()
    });
    let Message::SchemaCatalogResponse(r) = reply(&f.svc.handle(peer(1), &frame(cat.encode())))
    else {
        panic!()
    };
    assert_eq!(r.message_id, "c1");
    assert!(!r.schemas.is_empty());
    assert!(
        error_text(&f.svc.handle(peer(1), &frame(b"\x93garbage".to_vec())))
            .contains("does not decode")
    );
    let unknown = put("bifrost.something_else.v0", "k9", &AckRequest::default());
    let text = error_text(&f.svc.handle(peer(1), &unknown));
    assert!(
        text.contains("\"k9\"") && text.contains("bifrost.something_else.v0"),
        "{text}"
    );
    // Another channel is not for requests.
    let other = Frame {
        channel: Arc::from("realtime"),
        payload: Bytes::from(hello.encode()),
    };
    assert!(f.svc.handle(peer(1), &other).is_empty());
    assert_eq!(f.svc.stats().bad_messages, 3);
}

fn d(event: &str) -> Delivery {
    Delivery {
        event_id: event.into(),
        room_id: "!r:l".into(),
        sender: "@ann:l".into(),
        text: format!("said {event}"),
        ..Delivery::default()
    }
}

#[test]
fn pending_and_ack_go_to_the_inbox() {
    let mut f = fixture("pending");
    f.inbox
        .ingest("mira", "t1", &[d("$1"), d("$2"), d("$3")])
        .unwrap();
    connect(&mut f.svc, peer(1), "organ", 1, "n").unwrap();
    let req = PendingRequest {
        persona: "mira".into(),
        after_seq: 1,
        limit: Some(1),
        reply_bytes: None,
    };
    let (schema, key, page): (_, _, PendingPage) = receipt(
        &f.svc
            .handle(peer(1), &put(ids::PENDING_REQUEST, "r1", &req)),
    );
    assert_eq!((schema.as_str(), key.as_str()), (ids::PENDING_PAGE, "r1"));
    assert_eq!(page.deliveries.len(), 1);
    assert_eq!(page.deliveries[0].event_id, "$2");
    assert_eq!(
        (page.through_seq, page.more, page.pending_count),
        (2, true, 3)
    );
    let ack = AckRequest {
        persona: "mira".into(),
        through_seq: 2,
    };
    let (_, key, r): (_, _, AckReceipt) =
        receipt(&f.svc.handle(peer(1), &put(ids::ACK_REQUEST, "r2", &ack)));
    assert_eq!(key, "r2");
    assert_eq!(
        (r.status, r.through_seq, r.pending_count),
        (Status::Ok, 2, 1)
    );
    assert_eq!(f.inbox.counts("mira").unwrap().acked_through, 2);
    let beyond = AckRequest {
        persona: "mira".into(),
        through_seq: 99,
    };
    let (_, _, r): (_, _, AckReceipt) =
        receipt(&f.svc.handle(peer(1), &put(ids::ACK_REQUEST, "r3", &beyond)));
    assert_eq!(r.status, Status::Rejected);
    assert!(r.error.unwrap().contains("beyond the highest"));
    assert_eq!(
        f.inbox.counts("mira").unwrap().acked_through,
        2,
        "nothing changed"
    );
}

#[test]
fn clients_act_only_for_their_personas_and_verbs() {
    let mut f = fixture("perm");
    f.inbox.ingest("otto", "t", &[d("$1")]).unwrap();
    connect(&mut f.svc, peer(1), "organ", 1, "a").unwrap();
    connect(&mut f.svc, peer(2), "heartbeat", 2, "b").unwrap();
    let ack = AckRequest {
        persona: "otto".into(),
        through_seq: 1,
    };
    let (_, _, r): (_, _, AckReceipt) =
        receipt(&f.svc.handle(peer(1), &put(ids::ACK_REQUEST, "x", &ack)));
    assert_eq!(r.status, Status::Rejected);
    assert!(r.error.unwrap().contains("may not act for \"otto\""));
    // heartbeat may act for every Persona, but only status and turn.
    let (_, _, r): (_, _, AckReceipt) =
        receipt(&f.svc.handle(peer(2), &put(ids::ACK_REQUEST, "y", &ack)));
    assert!(r.error.unwrap().contains("may not make Ack"));
    assert_eq!(f.inbox.counts("otto").unwrap().acked_through, 0);
    let pending = PendingRequest {
        persona: "otto".into(),
        ..PendingRequest::default()
    };
    assert!(error_text(
        &f.svc
            .handle(peer(1), &put(ids::PENDING_REQUEST, "z", &pending))
    )
    .contains("may not act for"));
    let nobody = PendingRequest {
        persona: "nobody".into(),
        ..PendingRequest::default()
    };
    assert!(error_text(
        &f.svc
            .handle(peer(1), &put(ids::PENDING_REQUEST, "w", &nobody))
    )
    .contains("no Persona \"nobody\""));
    // Status shows what the client may see.
    let (_, _, s): (_, _, GatewayStatus) = receipt(&f.svc.handle(
        peer(1),
        &put(ids::STATUS_REQUEST, "s", &StatusRequest::default()),
    ));
    assert_eq!(s.personas.len(), 1);
    assert_eq!(s.personas[0].persona, "mira");
    assert_eq!(s.peers, 2);
    let (_, _, s): (_, _, GatewayStatus) = receipt(&f.svc.handle(
        peer(2),
        &put(ids::STATUS_REQUEST, "s", &StatusRequest::default()),
    ));
    let otto = s.personas.iter().find(|p| p.persona == "otto").unwrap();
    assert_eq!((otto.pending_count, otto.highest_seq), (1, 1));
    assert_eq!(f.svc.stats().rejected, 4);
}

#[test]
fn turns_wake_a_live_session_and_sends_need_a_running_persona() {
    let mut f = fixture("turn");
    connect(&mut f.svc, peer(2), "heartbeat", 2, "b").unwrap();
    connect(&mut f.svc, peer(1), "organ", 1, "a").unwrap();
    let turn = |p: &str| TurnRequest {
        persona: p.into(),
        reason: Some("test".into()),
    };
    let (_, _, r): (_, _, TurnReceipt) = receipt(
        &f.svc
            .handle(peer(2), &put(ids::TURN_REQUEST, "t1", &turn("mira"))),
    );
    assert_eq!(r.status, Status::Ok);
    // The trigger holds a permit: a waiter returns at once.
    let waited = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap()
        .block_on(async {
            tokio::time::timeout(std::time::Duration::from_millis(100), f.trigger.notified()).await
        });
    assert!(
        waited.is_ok(),
        "the turn request did not reach her turn loop"
    );
    let (_, _, r): (_, _, TurnReceipt) = receipt(
        &f.svc
            .handle(peer(2), &put(ids::TURN_REQUEST, "t2", &turn("otto"))),
    );
    assert_eq!(r.status, Status::Rejected);
    assert!(r.error.unwrap().contains("mouth-only"));
    let send = SendRequest {
        request_id: "q1".into(),
        persona: "mira".into(),
        room: "!r:l".into(),
        text: "hi".into(),
        ..SendRequest::default()
    };
    let (schema, _, r): (_, _, SendReceipt) =
        receipt(&f.svc.handle(peer(1), &put(ids::SEND_REQUEST, "q1", &send)));
    assert_eq!(schema, ids::SEND_RECEIPT);
    assert_eq!((r.status, r.request_id.as_str()), (Status::Failed, "q1"));
    assert!(r.error.unwrap().contains("not running"));
    let unnamed = SendRequest {
        request_id: " ".into(),
        ..send
    };
    let (_, _, r): (_, _, SendReceipt) = receipt(
        &f.svc
            .handle(peer(1), &put(ids::SEND_REQUEST, "q2", &unnamed)),
    );
    assert_eq!(r.status, Status::Rejected);
    assert!(r.error.unwrap().contains("needs a requestId"));
}

#[test]
fn an_unknown_agent_and_a_bad_signature_read_the_same_to_the_client() {
    let mut f = fixture("same-words");
    let unknown = connect(&mut f.svc, peer(1), "stranger", 1, "u1").unwrap_err();
    // organ's id with another key's signature.
    let forged = connect(&mut f.svc, peer(2), "organ", 9, "u2").unwrap_err();
    assert!(matches!(unknown, Refusal::UnknownAgent(_)));
    assert!(matches!(forged, Refusal::Auth(AuthError::BadSignature(_))));
    assert_eq!(unknown.to_client(), forged.to_client());
    // The log keeps them apart.
    assert_ne!(unknown.to_string(), forged.to_string());
}

#[test]
fn a_reload_that_changes_or_removes_a_key_ends_that_agents_sessions() {
    let mut f = fixture("rekeyed");
    connect(&mut f.svc, peer(1), "organ", 1, "r1").unwrap();
    connect(&mut f.svc, peer(2), "heartbeat", 2, "r2").unwrap();
    let mut ports = BTreeMap::new();
    ports.insert("mira".to_owned(), port(None));
    // organ's key rotated; heartbeat's unchanged.
    let ended = f.svc.update(Update {
        clients: vec![
            client("organ", 3, &["mira"], &Verb::ALL),
            client("heartbeat", 2, &["*"], &[Verb::Status, Verb::Turn]),
        ],
        ports: ports.clone(),
        applied: None,
    });
    assert_eq!(ended, [peer(1)]);
    let status = StatusRequest::default();
    assert!(
        f.svc
            .handle(peer(1), &put(ids::STATUS_REQUEST, "s1", &status))
            .is_empty(),
        "the old key's session still answered"
    );
    assert!(!f
        .svc
        .handle(peer(2), &put(ids::STATUS_REQUEST, "s2", &status))
        .is_empty());
    // Removed altogether: its session ends too; the new key gets in.
    connect(&mut f.svc, peer(3), "organ", 3, "r3").unwrap();
    let ended = f.svc.update(Update {
        clients: vec![client("organ", 3, &["mira"], &Verb::ALL)],
        ports,
        applied: None,
    });
    assert_eq!(ended, [peer(2)]);
}

#[test]
fn bad_signatures_from_one_address_are_refused_unchecked_past_its_budget() {
    let mut f = fixture("budget");
    let mut refusals = Vec::new();
    for i in 0..100 {
        // organ's id, another key's signature.
        refusals.push(connect(&mut f.svc, peer(1), "organ", 9, &format!("b{i}")).unwrap_err());
    }
    let checked = refusals
        .iter()
        .filter(|r| matches!(r, Refusal::Auth(AuthError::BadSignature(_))))
        .count();
    assert_eq!(checked, limits::VERIFY_BURST as usize);
    assert!(matches!(refusals.last(), Some(Refusal::AddressBudget)));
    // Another address, and the right key, are not held up.
    connect(&mut f.svc, peer(2), "organ", 1, "good").unwrap();
}

#[test]
fn an_agent_past_its_nonce_quota_is_refused_and_only_it() {
    let mut f = fixture("quota");
    f.svc.nonce_quota = 5;
    for i in 0..5 {
        connect(&mut f.svc, peer(10 + i), "organ", 1, &format!("q{i}")).unwrap();
    }
    assert!(matches!(
        connect(&mut f.svc, peer(20), "organ", 1, "q-over"),
        Err(Refusal::AgentQuota(a)) if a == "organ"
    ));
    // Another agent still gets in.
    connect(&mut f.svc, peer(21), "heartbeat", 2, "h1").unwrap();
}

#[test]
fn a_connect_payload_cannot_be_replayed_to_a_restarted_gateway() {
    let f = fixture("restart-replay");
    let now = u64::try_from(crate::clock::unix_ms()).unwrap();
    let payload =
        ConnectPayload::sign(&key(1), GATEWAY_CONNECTION_ID, "organ", now, "captured").encode();
    let mut svc = f.svc;
    svc.authenticate(peer(1), &payload, now).unwrap();
    // The gateway restarts (a new service on the same inbox); whoever held its port meanwhile
    // replays the payload it captured.
    let clients = [client("organ", 1, &["mira"], &Verb::ALL)];
    let mut restarted = Service::new(
        "gw-test-2",
        GATEWAY_CONNECTION_ID,
        120,
        f.inbox.clone(),
        &clients,
        BTreeMap::new(),
    );
    assert!(matches!(
        restarted.authenticate(peer(9), &payload, now + 1000),
        Err(Refusal::Replay(a)) if a == "organ"
    ));
    // A fresh payload gets in.
    let fresh =
        ConnectPayload::sign(&key(1), GATEWAY_CONNECTION_ID, "organ", now, "fresh").encode();
    restarted.authenticate(peer(9), &fresh, now + 1000).unwrap();
}

#[test]
fn a_client_cannot_take_a_request_id_of_the_gateways_own() {
    let mut f = fixture("reserved");
    connect(&mut f.svc, peer(1), "organ", 1, "n1").unwrap();
    for (i, id) in ["turn:mira:1-3:0", "checkpoint:mira:0:1", "client:5:other:x"]
        .iter()
        .enumerate()
    {
        let send = SendRequest {
            request_id: (*id).into(),
            persona: "mira".into(),
            room: "!r:l".into(),
            text: "hi".into(),
            ..SendRequest::default()
        };
        let key = format!("k{i}");
        let (_, _, r): (_, _, SendReceipt) =
            receipt(&f.svc.handle(peer(1), &put(ids::SEND_REQUEST, &key, &send)));
        assert_eq!((r.status, r.request_id.as_str()), (Status::Rejected, *id));
        assert!(r.error.unwrap().contains("the gateway's own"), "{id}");
    }
}

#[test]
fn owned_request_ids_keep_agents_and_ids_apart() {
    let a = owned_request_id("organ", "r-1");
    assert_eq!(a, owned_request_id("organ", "r-1"));
    assert_ne!(a, owned_request_id("heartbeat", "r-1"));
    assert_ne!(a, owned_request_id("organ", "r-2"));
    // No (agent, id) pair meets another by where the colon falls.
    assert_ne!(owned_request_id("a:b", "c"), owned_request_id("a", "b:c"));
    assert!(
        reserved_prefix(&a).is_some(),
        "owned ids are out of clients' reach"
    );
    assert_eq!(reserved_prefix("turn:vera:1-1:0"), Some("turn:"));
    assert_eq!(reserved_prefix("ops-1"), None);
}

#[test]
fn rfc3339_matches_known_instants() {
    assert_eq!(rfc3339(0), "1970-01-01T00:00:00.000Z");
    assert_eq!(rfc3339(951_782_400_123), "2000-02-29T00:00:00.123Z");
    assert_eq!(rfc3339(1_796_256_000_000), "2026-12-03T00:00:00.000Z");
    assert_eq!(rfc3339(-1), "1969-12-31T23:59:59.999Z");
    assert_eq!(rfc3339(1_796_392_628_045), "2026-12-04T13:57:08.045Z");
    assert_eq!(rfc3339(932_114_486_706), "1999-07-16T08:41:26.706Z");
    assert_eq!(rfc3339(253_402_300_799_999), "9999-12-31T23:59:59.999Z");
    // Past year 9999 the general form still says when.
    assert_eq!(rfc3339(253_402_300_800_000), "10000-01-01T00:00:00.000Z");
}

#[test]
fn notes_are_stored_for_a_live_session_and_refused_with_a_reason() {
    use wire::docs::{NoteReceipt, NoteRequest};
    let mut f = fixture("notes");
    connect(&mut f.svc, peer(1), "organ", 1, "n").unwrap();
    connect(&mut f.svc, peer(2), "heartbeat", 2, "n").unwrap();
    let note = |persona: &str, id: &str, text: &str, wake: bool| NoteRequest {
        persona: persona.into(),
        note_id: id.into(),
        kind: "state".into(),
        text: text.into(),
        wake,
    };
    let (schema, key, r): (_, _, NoteReceipt) = receipt(&f.svc.handle(
        peer(1),
        &put(ids::NOTE_REQUEST, "k1", &note("mira", "s1", "calm", false)),
    ));
    assert_eq!((schema.as_str(), key.as_str()), (ids::NOTE_RECEIPT, "k1"));
    assert_eq!(
        (r.status, r.duplicate, r.pending_notes),
        (Status::Ok, false, 1)
    );
    assert_eq!(f.inbox.pending_notes("mira").unwrap()[0].text, "calm");
    // Without wake, her turn loop is not woken; with wake, it is (once, not for a repeat).
    let woken = |t: &Arc<Notify>| {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap();
        rt.block_on(async {
            tokio::time::timeout(std::time::Duration::from_millis(20), t.notified())
                .await
                .is_ok()
        })
    };
    assert!(!woken(&f.trigger));
    let (_, _, r): (_, _, NoteReceipt) = receipt(&f.svc.handle(
        peer(1),
        &put(ids::NOTE_REQUEST, "k2", &note("mira", "s2", "tired", true)),
    ));
    assert_eq!((r.status, r.pending_notes), (Status::Ok, 1), "{r:?}");
    assert!(woken(&f.trigger));
    let (_, _, r): (_, _, NoteReceipt) = receipt(&f.svc.handle(
        peer(1),
        &put(ids::NOTE_REQUEST, "k3", &note("mira", "s2", "tired", true)),
    ));
    assert!(r.duplicate);
    assert!(!woken(&f.trigger));
    // Refusals, each with its reason.
    let refused = |svc: &mut Service, p: SocketAddr, n: &NoteRequest| -> NoteReceipt {
        let (_, _, r): (_, _, NoteReceipt) =
            receipt(&svc.handle(p, &put(ids::NOTE_REQUEST, "kx", n)));
        assert_eq!(r.status, Status::Rejected, "{r:?}");
        r
    };
    let big = refused(
        &mut f.svc,
        peer(1),
        &note("mira", "b", &"x".repeat(20_000), false),
    );
    assert!(big.error.unwrap().contains("20000 bytes"));
    let off = refused(&mut f.svc, peer(1), &note("otto", "o", "x", false));
    assert!(off.error.unwrap().contains("may not act for"));
    let verb = refused(&mut f.svc, peer(2), &note("mira", "h", "x", false));
    assert!(verb.error.unwrap().contains("Note"));
    assert_eq!(f.inbox.pending_notes("mira").unwrap().len(), 1);
}

#[test]
fn session_verbs_reach_only_a_live_session() {
    use wire::docs::{ControlAction, ControlReceipt, ControlRequest};
    let mut f = fixture("control");
    // otto is mouth-only; the organ may act for mira only, so give one client both.
    f.svc.clients.insert(
        "ops".into(),
        (
            key(3).verifying_key(),
            client("ops", 3, &["*"], &[Verb::Session]),
        ),
    );
    connect(&mut f.svc, peer(1), "ops", 3, "n").unwrap();
    let req = |persona: &str| ControlRequest {
        persona: persona.into(),
        action: ControlAction::Reset,
        model: None,
        batch: None,
    };
    let (_, _, r): (_, _, ControlReceipt) = receipt(
        &f.svc
            .handle(peer(1), &put(ids::CONTROL_REQUEST, "c1", &req("otto"))),
    );
    assert_eq!(r.status, Status::Rejected);
    assert!(r.error.unwrap().contains("mouth-only"));
    // mira's port has no control channel in this fixture: her loop is "not running".
    let (_, _, r): (_, _, ControlReceipt) = receipt(
        &f.svc
            .handle(peer(1), &put(ids::CONTROL_REQUEST, "c2", &req("mira"))),
    );
    assert_eq!(r.status, Status::Rejected, "{r:?}");
    // With a channel, the verb is queued and its receipt comes from the loop.
    let (tx, mut rx) = mpsc::channel(1);
    f.svc.ports.get_mut("mira").unwrap().controls = Some(tx);
    let answers = f
        .svc
        .handle(peer(1), &put(ids::CONTROL_REQUEST, "c3", &req("mira")));
    assert!(matches!(&answers[..], [Answer::Control { record_key, .. }] if record_key == "c3"));
    let queued = rx.try_recv().unwrap();
    assert_eq!(queued.request.action, ControlAction::Reset);
    // A full queue is answered at once: failed, retry later.
    let _second = f
        .svc
        .handle(peer(1), &put(ids::CONTROL_REQUEST, "c4", &req("mira")));
    let (_, _, r): (_, _, ControlReceipt) = receipt(
        &f.svc
            .handle(peer(1), &put(ids::CONTROL_REQUEST, "c5", &req("mira"))),
    );
    assert_eq!(r.status, Status::Failed);
    assert!(r.error.unwrap().contains("retry later"));
}

#[test]
fn a_client_over_its_rate_is_answered_failed_then_cut_off_and_others_go_on() {
    let mut f = fixture("rate");
    f.svc.limits = ClientLimits {
        requests_per_sec: 10.0,
        burst: 3.0,
        max_in_flight: 16,
    };
    connect(&mut f.svc, peer(1), "organ", 1, "n1").unwrap();
    connect(&mut f.svc, peer(2), "heartbeat", 2, "n2").unwrap();
    let t0 = std::time::Instant::now();
    let ack = |seq| AckRequest {
        persona: "mira".into(),
        through_seq: seq,
    };
    let status = put(ids::STATUS_REQUEST, "s", &StatusRequest::default());
    for i in 0..3 {
        let answers = f.svc.handle_at(
            peer(1),
            &put(ids::ACK_REQUEST, &format!("a{i}"), &ack(0)),
            t0,
        );
        let (_, _, r): (_, _, AckReceipt) = receipt(&answers);
        assert_eq!(r.status, Status::Ok);
    }
    // The fourth at once is over the burst: failed, retry later, under its own record key.
    let answers = f
        .svc
        .handle_at(peer(1), &put(ids::ACK_REQUEST, "a3", &ack(0)), t0);
    let (_, key, r): (_, _, AckReceipt) = receipt(&answers);
    assert_eq!((key.as_str(), r.status), ("a3", Status::Failed));
    assert!(r.error.unwrap().contains("retry later"));
    // A request without a status field gets an error naming the limit.
    assert!(error_text(&f.svc.handle_at(peer(1), &status, t0)).contains("rate limit"));
    // The other client is not affected.
    let (_, _, s): (_, _, GatewayStatus) = receipt(&f.svc.handle_at(peer(2), &status, t0));
    assert_eq!(s.personas.len(), 2);
    // Going on for a whole burst after being told ends the session, with the reason.
    let answers = f.svc.handle_at(peer(1), &status, t0);
    assert!(error_text(&answers).contains("rate limit"));
    let answers = f.svc.handle_at(peer(1), &status, t0);
    assert!(
        matches!(&answers[..], [Answer::Disconnect(why)] if why.contains("rate limit")),
        "{answers:?}"
    );
    assert_eq!((f.svc.stats().limited, f.svc.stats().cut_off), (3, 1));
    assert!(
        f.svc.handle_at(peer(1), &status, t0).is_empty(),
        "forgotten"
    );
    // 100 ms later the bucket has refilled for the other client too.
    let later = t0 + std::time::Duration::from_millis(100);
    let (_, _, s): (_, _, GatewayStatus) = receipt(&f.svc.handle_at(peer(2), &status, later));
    assert_eq!(s.personas.len(), 2);
    // The budget is the agent's: reconnecting (a new address, a new nonce) does not refill it,
    // and it has not come back from being told within the second: cut off again.
    connect(&mut f.svc, peer(3), "organ", 1, "n3").unwrap();
    let answers = f.svc.handle_at(peer(3), &status, t0);
    assert!(
        matches!(&answers[..], [Answer::Disconnect(why)] if why.contains("rate limit")),
        "{answers:?}"
    );
    // A second on, its bucket has refilled at its rate, on a new session as on the old.
    connect(&mut f.svc, peer(4), "organ", 1, "n4").unwrap();
    let second = t0 + std::time::Duration::from_secs(1);
    let (_, _, s): (_, _, GatewayStatus) = receipt(&f.svc.handle_at(peer(4), &status, second));
    assert_eq!(s.personas.len(), 1, "the organ's one Persona");
}

/// A second QUIC connection from the same address and port does not take over the first's
/// session: it is refused, and a frame of any connection but the session's is not taken.
#[test]
fn a_second_quic_connection_from_one_address_cannot_take_over_the_first() {
    let mut f = fixture("quic-two");
    let mut quic = HashMap::new();
    let now = u64::try_from(crate::clock::unix_ms()).unwrap();
    let connect = |quic: &mut HashMap<_, _>, svc: &mut Service, id: usize, nonce: &str| {
        let (tx, rx) = crate::answers::answer_queue(4, 1 << 20);
        let (verdict, told) = tokio::sync::oneshot::channel();
        let payload = ConnectPayload::sign(&key(1), GATEWAY_CONNECTION_ID, "organ", now, nonce);
        let mut out = Vec::new();
        remote_event(
            svc,
            quic,
            Remote::Connect {
                peer: peer(7),
                payload: payload.encode().into(),
                id,
                out: tx,
                verdict,
            },
            &mut out,
        );
        (told.blocking_recv(), rx)
    };
    let (first, _first_rx) = connect(&mut quic, &mut f.svc, 70, "c1");
    assert_eq!(first, Ok(Ok(())));
    let (second, _second_rx) = connect(&mut quic, &mut f.svc, 71, "c2");
    assert!(
        matches!(&second, Ok(Err(why)) if why.contains("another connection")),
        "{second:?}"
    );
    // A frame that is not the session's connection's is not answered.
    let status = put(ids::STATUS_REQUEST, "s1", &StatusRequest::default());
    let mut out = Vec::new();
    remote_event(
        &mut f.svc,
        &mut quic,
        Remote::Frame {
            peer: peer(7),
            id: 71,
            payload: status.payload.clone(),
        },
        &mut out,
    );
    assert!(out.is_empty(), "answered another connection's frame");
    remote_event(
        &mut f.svc,
        &mut quic,
        Remote::Frame {
            peer: peer(7),
            id: 70,
            payload: status.payload,
        },
        &mut out,
    );
    assert_eq!(out.len(), 1, "the session's own frame is answered");
}

/// A QUIC client that does not read is cut off by the loop or by a send's or verb's task;
/// either way it is counted once, when cut or when its connection ends. A connection that just
/// ends is no cut-off.
#[test]
fn a_quic_client_cut_off_anywhere_is_counted_once() {
    let mut f = fixture("quic-cut");
    let mut quic = HashMap::new();
    let mut out = Vec::new();
    let now = u64::try_from(crate::clock::unix_ms()).unwrap();
    let open = |svc: &mut Service, quic: &mut HashMap<_, _>, n: u16| {
        let (tx, _rx) = crate::answers::answer_queue(4, 1 << 20);
        let (verdict, told) = tokio::sync::oneshot::channel();
        let nonce = format!("quic-{n}");
        let payload = ConnectPayload::sign(&key(1), GATEWAY_CONNECTION_ID, "organ", now, &nonce);
        let connect = Remote::Connect {
            peer: peer(n),
            payload: payload.encode().into(),
            id: usize::from(n),
            out: tx.clone(),
            verdict,
        };
        let mut out = Vec::new();
        remote_event(svc, quic, connect, &mut out);
        assert!(out.is_empty());
        assert_eq!(told.blocking_recv(), Ok(Ok(())));
        assert!(svc.peers.contains_key(&peer(n)));
        tx
    };
    let gone = |n: u16| Remote::Gone {
        peer: peer(n),
        id: usize::from(n),
    };

    // Cut by a task: counted when its connection ends, and forgotten then.
    let task_cut = open(&mut f.svc, &mut quic, 1);
    assert!(task_cut.cut(), "the first cut");
    assert_eq!(f.svc.stats().cut_off, 0);
    remote_event(&mut f.svc, &mut quic, gone(1), &mut out);
    assert_eq!(f.svc.stats().cut_off, 1);
    assert!(!f.svc.peers.contains_key(&peer(1)));

    // Ended by the client: forgotten, not counted.
    open(&mut f.svc, &mut quic, 2);
    remote_event(&mut f.svc, &mut quic, gone(2), &mut out);
    assert_eq!(f.svc.stats().cut_off, 1);
    assert!(!f.svc.peers.contains_key(&peer(2)));

    // Cut by the loop: counted at once; a task's later cut and the connection's end add nothing.
    let loop_cut = open(&mut f.svc, &mut quic, 3);
    cut_off_quic(&mut f.svc, &mut quic, peer(3));
    assert_eq!(f.svc.stats().cut_off, 2);
    assert!(loop_cut.was_cut());
    assert!(!loop_cut.cut(), "already cut");
    remote_event(&mut f.svc, &mut quic, gone(3), &mut out);
    assert_eq!(f.svc.stats().cut_off, 2);
    assert!(out.is_empty(), "no answers to any of this");
    // The metrics handed to the service count them too.
    let unread = f
        .metrics
        .clients_cut_off
        .get_or_create(&crate::metrics::ReasonLabel {
            reason: "unread".into(),
        })
        .get();
    assert_eq!(unread, 2);
}

#[test]
fn acks_wait_for_one_flush_and_a_client_has_a_bounded_number_in_flight() {
    use wire::docs::{ControlAction, ControlReceipt, ControlRequest};
    let mut f = fixture("group");
    f.svc.limits.max_in_flight = 1;
    f.inbox
        .ingest("mira", "t1", &[d("$1"), d("$2"), d("$3")])
        .unwrap();
    connect(&mut f.svc, peer(1), "organ", 1, "n").unwrap();
    for seq in 1..=3 {
        let ack = AckRequest {
            persona: "mira".into(),
            through_seq: seq,
        };
        let answers = f
            .svc
            .handle(peer(1), &put(ids::ACK_REQUEST, &format!("a{seq}"), &ack));
        assert!(
            matches!(answers[0], Answer::AfterFlush { .. }),
            "{answers:?}"
        );
    }
    assert_eq!(f.inbox.counts("mira").unwrap().acked_through, 3);
    f.svc.commit().unwrap();
    f.svc.commit().unwrap();
    assert_eq!(
        f.svc.stats().flushes,
        1,
        "three acks, one flush; nothing new, none"
    );
    // In flight: one verb queued holds the client's only slot until its answer is dropped.
    let (tx, _rx) = mpsc::channel(8);
    f.svc.ports.get_mut("mira").unwrap().controls = Some(tx);
    let req = ControlRequest {
        persona: "mira".into(),
        action: ControlAction::Compact,
        model: None,
        batch: None,
    };
    let first = f
        .svc
        .handle(peer(1), &put(ids::CONTROL_REQUEST, "c1", &req));
    assert!(matches!(&first[..], [Answer::Control { .. }]));
    let (_, _, r): (_, _, ControlReceipt) = receipt(
        &f.svc
            .handle(peer(1), &put(ids::CONTROL_REQUEST, "c2", &req)),
    );
    assert_eq!(r.status, Status::Failed);
    assert!(r.error.unwrap().contains("in flight"));
    drop(first);
    let third = f
        .svc
        .handle(peer(1), &put(ids::CONTROL_REQUEST, "c3", &req));
    assert!(matches!(&third[..], [Answer::Control { .. }]));
}

/// A Connect datagram (sequence `sequence`) carrying `payload`.
fn connect_datagram(sequence: u32, payload: &[u8]) -> Vec<u8> {
    let mut datagram = Vec::new();
    wire::packet::Packet {
        ptype: wire::packet::PacketType::Connect,
        flags: wire::packet::Flags(wire::packet::Flags::RELIABLE),
        connection_id: GATEWAY_CONNECTION_ID,
        sequence,
        ack: 0,
        ack_mask: 0,
        fragment: wire::packet::Fragment::default(),
        channel: "control",
        payload,
    }
    .encode(&mut datagram)
    .unwrap();
    datagram
}

/// Sends a valid Connect of the organ's from a socket of its own, and waits for the endpoint
/// to report it.
async fn connect_request(ep: &mut Endpoint, nonce: &str) -> (std::net::UdpSocket, EndpointEvent) {
    let raw = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    let now = u64::try_from(crate::clock::unix_ms()).unwrap();
    let payload = ConnectPayload::sign(&key(1), GATEWAY_CONNECTION_ID, "organ", now, nonce);
    raw.send_to(&connect_datagram(7, &payload.encode()), ep.local_addr())
        .unwrap();
    let event = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            ep.ready().await;
            assert!(ep.pump());
            if let Some(e) = ep.poll_event() {
                return e;
            }
        }
    })
    .await
    .expect("the endpoint reported the Connect");
    assert!(
        matches!(&event, EndpointEvent::Hub(HubEvent::ConnectRequest(r)) if r.peer == raw.local_addr().unwrap()),
        "{event:?}"
    );
    (raw, event)
}

/// A valid Connect whose accept opens no session (every session slot taken, or its verdict
/// too late) leaves no record of a peer behind, so it is not counted as one for ever; one that
/// opens a session keeps its record.
#[tokio::test]
async fn a_verdict_that_opened_no_session_leaves_no_peer_behind() {
    let mut f = fixture("not-applied");
    let mut cfg = crate::endpoint::EndpointConfig::new("127.0.0.1:0".parse().unwrap(), 5);
    cfg.hub.max_peers = 1;
    cfg.hub.pending_timeout = Duration::from_millis(100);
    let mut ep = Endpoint::bind(cfg).await.unwrap();
    let mut out = Vec::new();

    // Its verdict comes after the waiting room's timeout.
    let (late, event) = connect_request(&mut ep, "late").await;
    tokio::time::sleep(Duration::from_millis(150)).await;
    endpoint_event(&mut f.svc, &mut ep, event, &mut out);
    assert!(matches!(
        ep.poll_event(),
        Some(EndpointEvent::AcceptNotApplied { error: HubError::Expired(p), .. }) if p == late.local_addr().unwrap()
    ));
    assert!(f.svc.peer_addrs().is_empty(), "a Connect accepted too late");

    // The only slot is taken while it waits (the verdict on another Connect comes first).
    let (full, waiting) = connect_request(&mut ep, "full").await;
    let (opened, event) = connect_request(&mut ep, "opens").await;
    endpoint_event(&mut f.svc, &mut ep, event, &mut out);
    let opened = opened.local_addr().unwrap();
    assert!(ep.has_session(opened));
    assert_eq!(f.svc.peer_addrs(), vec![opened]);
    endpoint_event(&mut f.svc, &mut ep, waiting, &mut out);
    assert!(matches!(
        ep.poll_event(),
        Some(EndpointEvent::AcceptNotApplied { error: HubError::Full(p), .. }) if p == full.local_addr().unwrap()
    ));
    assert_eq!(
        f.svc.peer_addrs(),
        vec![opened],
        "a Connect turned away for want of a slot"
    );
    assert!(out.is_empty());
}

/// Two Connects from one address in one read, the first valid and the second signed with the
/// wrong key (a newer Connect, so the first's accept is superseded, and the second is refused):
/// no session opens, and no record of a peer stays behind (the status counts only the real
/// client).
#[tokio::test]
async fn a_superseded_connect_whose_successor_is_refused_leaves_no_peer() {
    let f = fixture("superseded-refused");
    let endpoint = Endpoint::bind(crate::endpoint::EndpointConfig::new(
        "127.0.0.1:0".parse().unwrap(),
        9,
    ))
    .await
    .unwrap();
    let server = endpoint.local_addr();
    let (stop_tx, stop) = watch::channel(false);
    let serving = tokio::spawn(serve(f.svc, endpoint, stop));

    let now = u64::try_from(crate::clock::unix_ms()).unwrap();
    let good = ConnectPayload::sign(&key(1), GATEWAY_CONNECTION_ID, "organ", now, "first");
    let forged = ConnectPayload::sign(&key(3), GATEWAY_CONNECTION_ID, "organ", now, "second");
    let raw = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    for (sequence, payload) in [(100, good.encode()), (200, forged.encode())] {
        // Sent before this task yields, so the service reads both in one pump.
        raw.send_to(&connect_datagram(sequence, &payload), server)
            .unwrap();
    }
    let mut buf = [0u8; 2048];
    raw.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let raw = tokio::task::spawn_blocking(move || raw.recv(&mut buf).map(|n| buf[..n].to_vec()));

    let mut c =
        crate::client::Client::connect(server, "heartbeat", &key(2), Duration::from_secs(10))
            .await
            .unwrap();
    let reply = raw.await.unwrap().expect("the replay was answered");
    let reply = wire::packet::Packet::decode(&reply).unwrap();
    assert_eq!(
        reply.ptype,
        wire::packet::PacketType::Disconnect,
        "{reply:?}"
    );
    let s: GatewayStatus = c
        .request(ids::STATUS_REQUEST, "s", &StatusRequest::default())
        .await
        .unwrap();
    assert_eq!(s.peers, 1, "only the heartbeat is a peer");
    stop_tx.send(true).unwrap();
    serving.await.unwrap();
}

/// A service told to stop lets the verb in flight answer (its client gets the receipt), tells
/// a request made meanwhile to retry later, then ends each session with the reason, within
/// its bound. Before, it closed the sessions at once and the verb's receipt was lost.
#[tokio::test]
async fn a_stopping_service_answers_what_is_in_flight_then_says_why() {
    use wire::docs::{ControlAction, ControlReceipt, ControlRequest, TurnReceipt};
    let mut f = fixture("drain");
    f.svc.clients.insert(
        "ops".into(),
        (
            key(3).verifying_key(),
            client("ops", 3, &["mira"], &[Verb::Session]),
        ),
    );
    let (controls, mut queued) = mpsc::channel(1);
    f.svc.ports.get_mut("mira").unwrap().controls = Some(controls);
    let endpoint = Endpoint::bind(crate::endpoint::EndpointConfig::new(
        "127.0.0.1:0".parse().unwrap(),
        11,
    ))
    .await
    .unwrap();
    let server = endpoint.local_addr();
    let (stop_tx, stop) = watch::channel(false);
    let serving = tokio::spawn(serve(f.svc, endpoint, stop));
    let wait = Duration::from_secs(10);
    let mut ops = crate::client::Client::connect(server, "ops", &key(3), wait)
        .await
        .unwrap();
    let mut heartbeat = crate::client::Client::connect(server, "heartbeat", &key(2), wait)
        .await
        .unwrap();

    let verb = tokio::spawn(async move {
        let req = ControlRequest {
            persona: "mira".into(),
            action: ControlAction::Reset,
            model: None,
            batch: None,
        };
        let receipt = ops
            .request::<_, ControlReceipt>(ids::CONTROL_REQUEST, "c1", &req)
            .await;
        (receipt, ops.next_message().await)
    });
    let control = tokio::time::timeout(wait, queued.recv())
        .await
        .unwrap()
        .expect("the verb reached her turn loop");
    let stopped_at = std::time::Instant::now();
    stop_tx.send(true).unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;

    let turn: TurnReceipt = heartbeat
        .request(
            ids::TURN_REQUEST,
            "t1",
            &TurnRequest {
                persona: "mira".into(),
                ..TurnRequest::default()
            },
        )
        .await
        .unwrap();
    assert_eq!(turn.status, Status::Failed, "{turn:?}");
    assert!(
        turn.error
            .as_deref()
            .unwrap_or("")
            .contains("shutting down"),
        "{turn:?}"
    );

    control
        .reply
        .send(ControlReceipt {
            persona: "mira".into(),
            action: ControlAction::Reset,
            status: Status::Ok,
            ..ControlReceipt::default()
        })
        .unwrap();
    let (receipt, after) = verb.await.unwrap();
    let receipt = receipt.expect("the verb in flight was answered");
    assert_eq!(receipt.status, Status::Ok, "{receipt:?}");
    match after {
        Err(crate::client::ClientError::Closed(reason)) => {
            assert!(
                format!("{reason:?}").contains("shutting down"),
                "{reason:?}"
            );
        }
        other => panic!("the session should end with the reason: {other:?}"),
    }
    tokio::time::timeout(wait, serving).await.unwrap().unwrap();
    let took = stopped_at.elapsed();
    assert!(
        took < DRAIN_TASKS + DRAIN_SESSIONS + Duration::from_secs(1),
        "stopping took {took:?}"
    );
}

/// A loopback session is bound to the local user whose socket opened it: a block's `uids`
/// admit only those users' sockets (and never a QUIC connection); a session whose address
/// passed to another user, or to no one, is forgotten unserved and counted.
#[test]
fn a_session_is_its_owners_and_ends_when_its_address_is_anothers() {
    use super::owner::{Owner, OwnerError};
    let dir = crate::scratch::Dir::new("service-owner");
    let inbox = Inbox::open(&dir).unwrap();
    let mut ports = BTreeMap::new();
    ports.insert("mira".to_owned(), port(None));
    let mut kept = client("kept", 3, &["mira"], &Verb::ALL);
    kept.uids = Some(vec![1000]);
    let clients = [client("organ", 1, &["mira"], &Verb::ALL), kept];
    let metrics = crate::metrics::unserved();
    let mut svc = Service::new(
        "gw-test",
        GATEWAY_CONNECTION_ID,
        120,
        inbox,
        &clients,
        ports,
    )
    .with_metrics(metrics.clone());
    let sign = |seed: u8, agent: &str, nonce: &str| {
        ConnectPayload::sign(&key(seed), GATEWAY_CONNECTION_ID, agent, NOW, nonce).encode()
    };
    let status = || {
        put(
            ids::STATUS_REQUEST,
            "s",
            &StatusRequest {
                persona: Some("mira".into()),
            },
        )
    };
    // Any user's socket, for a block without uids: the session is that user's.
    let organ = svc.authenticate_local(peer(1), &sign(1, "organ", "a"), NOW, || {
        Ok(Owner::User(1001))
    });
    assert_eq!(organ, Ok("organ".to_owned()));
    assert!(svc.is_bound(peer(1)));
    assert_eq!(svc.check_owner(peer(1), Ok(Owner::User(1001))), Ok(()));
    assert!(!svc.handle(peer(1), &status()).is_empty());
    // Its port bound by another user's process: forgotten, nothing served.
    assert_eq!(
        svc.check_owner(peer(1), Ok(Owner::User(65534))),
        Err(OwnerError::Changed {
            was: 1001,
            now: 65534
        })
    );
    assert!(!svc.is_bound(peer(1)));
    assert!(svc.handle(peer(1), &status()).is_empty());
    assert_eq!(svc.stats().cut_off, 1);
    // A socket that is gone ends the session too.
    svc.authenticate_local(peer(2), &sign(1, "organ", "b"), NOW, || Ok(Owner::User(7)))
        .unwrap();
    assert_eq!(
        svc.check_owner(peer(2), Ok(Owner::Nobody)),
        Err(OwnerError::Nobody)
    );
    assert!(svc.handle(peer(2), &status()).is_empty());
    // A block with uids: only those users' sockets, even with the key.
    let refused = svc.authenticate_local(peer(3), &sign(3, "kept", "c"), NOW, || {
        Ok(Owner::User(1001))
    });
    assert!(
        matches!(
            &refused,
            Err(Refusal::Owner(OwnerError::NotAllowed { uid: 1001, .. }))
        ),
        "{refused:?}"
    );
    assert_eq!(refused.map_err(|r| r.reason()), Err("owner"));
    assert!(svc.handle(peer(3), &status()).is_empty());
    let kept = svc.authenticate_local(peer(4), &sign(3, "kept", "d"), NOW, || {
        Ok(Owner::User(1000))
    });
    assert_eq!(kept, Ok("kept".to_owned()));
    // ... and never over QUIC, where no local user can be told.
    assert_eq!(
        svc.authenticate(peer(5), &sign(3, "kept", "e"), NOW),
        Err(Refusal::Owner(OwnerError::NotLocal))
    );
    // The socket table unreadable: a block without uids is served unbound, one with is not.
    svc.authenticate_local(
        peer(6),
        &sign(1, "organ", "f"),
        NOW,
        || Err("EACCES".into()),
    )
    .unwrap();
    assert!(!svc.is_bound(peer(6)));
    assert!(matches!(
        svc.authenticate_local(peer(7), &sign(3, "kept", "g"), NOW, || Err("EACCES".into())),
        Err(Refusal::Owner(OwnerError::Unreadable(_)))
    ));
}

/// At the edge, with real sockets: a session opened from a socket of this process is bound to
/// this process's user; once that socket is closed, its next request past the last finding
/// (`owner::RECHECK`) ends the session unserved, and so does a Pong at once.
#[tokio::test]
async fn a_closed_clients_address_ends_its_session_unserved() {
    let mut f = fixture("closed-owner");
    let cfg = crate::endpoint::EndpointConfig::new("127.0.0.1:0".parse().unwrap(), 5);
    let mut ep = Endpoint::bind(cfg).await.unwrap();
    let mut out = Vec::new();
    let status = put(
        ids::STATUS_REQUEST,
        "s1",
        &StatusRequest {
            persona: Some("mira".into()),
        },
    );
    let request = |peer: SocketAddr| {
        EndpointEvent::Hub(HubEvent::Frame {
            peer,
            frame: status.clone(),
        })
    };
    let (raw, event) = connect_request(&mut ep, "owned").await;
    let addr = raw.local_addr().unwrap();
    endpoint_event(&mut f.svc, &mut ep, event, &mut out);
    assert!(ep.has_session(addr));
    assert!(f.svc.is_bound(addr), "bound to this process's user");
    tokio::time::sleep(owner::RECHECK).await;
    endpoint_event(&mut f.svc, &mut ep, request(addr), &mut out);
    assert_eq!(out.len(), 1, "served while its socket is open");
    drop(raw);
    tokio::time::sleep(owner::RECHECK).await;
    endpoint_event(&mut f.svc, &mut ep, request(addr), &mut out);
    assert_eq!(out.len(), 1, "served after its socket closed");
    ep.flush().await;
    assert!(
        !ep.has_session(addr),
        "its Disconnect sent, the session is gone"
    );
    assert!(f.svc.peer_addrs().is_empty());
    assert_eq!(f.svc.stats().cut_off, 1);

    // A Pong is checked at once.
    let (raw, event) = connect_request(&mut ep, "pong").await;
    let addr = raw.local_addr().unwrap();
    endpoint_event(&mut f.svc, &mut ep, event, &mut out);
    assert!(ep.has_session(addr));
    drop(raw);
    let pong = EndpointEvent::Hub(HubEvent::Pong {
        peer: addr,
        payload: Bytes::from_static(b"keepalive"),
    });
    endpoint_event(&mut f.svc, &mut ep, pong, &mut out);
    ep.flush().await;
    assert!(!ep.has_session(addr));
    assert_eq!(f.svc.stats().cut_off, 2);
}
