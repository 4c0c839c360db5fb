//! CultNet over QUIC for remote peers, over real loopback sockets: the in-process service with a
//! QUIC server (a certificate made in the state directory), and a quinn client that pins it.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::Duration;

use ed25519_dalek::SigningKey;
use gateway::client::{ClientError, QuicClient};
use gateway::config::{Client as ClientConfig, Verb};
use gateway::endpoint::{Endpoint, EndpointConfig};
use gateway::inbox::Inbox;
use gateway::quic;
use gateway::service::{serve_with, ClientLimits, Port, Service};
use wire::docs::{ids, Delivery, PendingPage, PendingRequest};
use wire::msg::{Message, Put, RawDocument};
use wire::session::GATEWAY_CONNECTION_ID;

/// A test's state directory, removed when dropped.
fn state_dir(name: &str) -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix(&format!("cultnet-quic-{name}-"))
        .tempdir()
        .unwrap()
}

/// Starts the service with a QUIC side; returns its QUIC address and certificate.
async fn gateway(dir: &std::path::Path, key: &SigningKey) -> (SocketAddr, quic::Identity) {
    let (addr, cert, _) = gateway_with(dir, key, ClientLimits::default()).await;
    (addr, cert)
}

/// As [`gateway`], with these per-client limits; the third address is the RUDP side's.
async fn gateway_with(
    dir: &std::path::Path,
    key: &SigningKey,
    limits: ClientLimits,
) -> (SocketAddr, quic::Identity, SocketAddr) {
    let g = start(dir, key, limits, Port::new("@mira:l", 1000)).await;
    let (addr, cert, rudp) = (g.addr, g.cert, g.rudp);
    // Runs until the test ends: nothing sends stop.
    let (stop, serving) = (g.stop, g.serving);
    tokio::spawn(async move {
        let _ = serving.await;
        drop(stop);
    });
    (addr, cert, rudp)
}

/// A running service with its QUIC side, and what stops it.
struct Gateway {
    addr: SocketAddr,
    cert: quic::Identity,
    rudp: SocketAddr,
    stop: tokio::sync::watch::Sender<bool>,
    accepting: tokio::task::JoinHandle<()>,
    serving: tokio::task::JoinHandle<()>,
}

/// Starts the service (Mira on `port`, two deliveries pending) with a QUIC side.
async fn start(
    dir: &std::path::Path,
    key: &SigningKey,
    limits: ClientLimits,
    port: Port,
) -> Gateway {
    let inbox = Inbox::open(&dir.join("inbox")).unwrap();
    let d = |e: &str| Delivery {
        event_id: e.into(),
        room_id: "!r:l".into(),
        sender: "@ann:l".into(),
        text: format!("said {e}"),
        ..Delivery::default()
    };
    inbox.ingest("mira", "t", &[d("$1"), d("$2")]).unwrap();
    let clients = [ClientConfig::for_key(
        "far-organ",
        &key.verifying_key(),
        &["mira"],
        &Verb::ALL,
    )];
    let mut ports = BTreeMap::new();
    ports.insert("mira".to_owned(), port);
    let service = Service::new(
        "gw-quic",
        GATEWAY_CONNECTION_ID,
        120,
        inbox,
        &clients,
        ports,
    )
    .with_limits(limits);
    let endpoint = Endpoint::bind(EndpointConfig::new("127.0.0.1:0".parse().unwrap(), 1))
        .await
        .unwrap();
    let server = quic::server(
        "127.0.0.1:0".parse().unwrap(),
        quic::identity(None, None, dir).unwrap(),
    )
    .unwrap();
    let addr = server.local_addr().unwrap();
    let rudp = endpoint.local_addr();
    let (tx, rx) = tokio::sync::mpsc::channel(64);
    let (stop_tx, stop) = tokio::sync::watch::channel(false);
    let accepting = tokio::spawn(quic::accept(
        server,
        tx,
        gateway::metrics::unserved(),
        stop.clone(),
    ));
    let serving = tokio::spawn(serve_with(service, endpoint, Some(rx), stop));
    Gateway {
        addr,
        cert: quic::identity(None, None, dir).unwrap(),
        rudp,
        stop: stop_tx,
        accepting,
        serving,
    }
}

async fn far(
    addr: SocketAddr,
    pinned: &quic::Identity,
    key: &SigningKey,
) -> Result<QuicClient, ClientError> {
    QuicClient::connect(
        addr,
        pinned.certs[0].as_ref(),
        "far-organ",
        key,
        Duration::from_secs(10),
    )
    .await
}

fn pending_request() -> PendingRequest {
    PendingRequest {
        persona: "mira".into(),
        ..PendingRequest::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_remote_client_with_a_pinned_key_is_served_over_quic() {
    let tmp = state_dir("served");
    let dir = tmp.path();
    let key = SigningKey::from_bytes(&[21; 32]);
    let (addr, cert) = gateway(dir, &key).await;
    let mut far = far(addr, &cert, &key).await.unwrap();
    let page: PendingPage = far
        .request(ids::PENDING_REQUEST, "far-1", &pending_request())
        .await
        .unwrap();
    let texts: Vec<&str> = page.deliveries.iter().map(|d| d.text.as_str()).collect();
    assert_eq!(texts, ["said $1", "said $2"]);
    // Garbage gets an error and the connection goes on.
    far.send_raw(b"\xc1").await.unwrap();
    assert!(matches!(
        far.next_message().await.unwrap(),
        Message::Error(_)
    ));
    let again: PendingPage = far
        .request(ids::PENDING_REQUEST, "far-2", &pending_request())
        .await
        .unwrap();
    assert_eq!(again.pending_count, 2);
    far.close().await;
    // The certificate made on first start is kept: a restart serves the same one.
    let kept = quic::identity(None, None, dir).unwrap();
    assert_eq!(kept.fingerprint(), cert.fingerprint());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_key_is_refused_and_an_unpinned_server_is_not_trusted() {
    let tmp = state_dir("refused");
    let dir = tmp.path();
    let key = SigningKey::from_bytes(&[21; 32]);
    let (addr, cert) = gateway(dir, &key).await;
    let wrong = SigningKey::from_bytes(&[22; 32]);
    let mut far_wrong = far(addr, &cert, &wrong).await.unwrap();
    let refused = far_wrong
        .request::<_, PendingPage>(ids::PENDING_REQUEST, "x", &pending_request())
        .await;
    match refused {
        Err(ClientError::Refused(why)) => assert!(why.contains("signature"), "{why}"),
        other => panic!("a wrong key was not refused: {other:?}"),
    }
    // A client pinning another certificate does not get a connection at all.
    let other = quic::identity(None, None, state_dir("other").path()).unwrap();
    assert!(matches!(
        far(addr, &other, &key).await,
        Err(ClientError::Quic(_))
    ));
}

/// A pending request from the far organ, encoded (its answer, two deliveries, is a few hundred
/// bytes).
fn raw_pending(i: usize) -> Vec<u8> {
    let mut doc = RawDocument::from_payload(
        ids::PENDING_REQUEST,
        &format!("hog-{i}"),
        "2026-12-04T00:00:00Z",
        &pending_request(),
    );
    doc.source_agent_id = Some("far-organ".into());
    Message::DocumentPutRaw(Put {
        message_id: format!("m{i}"),
        document: doc,
    })
    .encode()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_does_not_read_is_cut_off_and_does_not_hold_up_the_others() {
    let tmp = state_dir("unread");
    let dir = tmp.path();
    let key = SigningKey::from_bytes(&[21; 32]);
    let (addr, cert) = gateway(dir, &key).await;
    let mut other = far(addr, &cert, &key).await.unwrap();
    let mut hog = far(addr, &cert, &key).await.unwrap();

    // The hog asks and never reads: its stream's flow control fills (the client's default
    // window, ~1.25 MB), then its connection's answer queue.
    let hog = tokio::spawn(async move {
        let mut sent = 0;
        loop {
            if let Err(e) = hog.send_raw(&raw_pending(sent)).await {
                return (sent, e);
            }
            sent += 1;
            assert!(sent < 100_000, "a client that never reads was not cut off");
        }
    });
    // Meanwhile the other is served, promptly (before the fix the service loop waited on the
    // hog's full queue, and this timed out).
    let mut asked = 0;
    while !hog.is_finished() {
        asked += 1;
        let page: PendingPage = tokio::time::timeout(
            Duration::from_secs(5),
            other.request(
                ids::PENDING_REQUEST,
                &format!("o-{asked}"),
                &pending_request(),
            ),
        )
        .await
        .expect("the other client waited behind the hog")
        .unwrap();
        assert_eq!(page.pending_count, 2);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (sent, cut) = hog.await.unwrap();
    match cut {
        ClientError::Refused(why) => assert!(why.contains("unread"), "{why}"),
        other => panic!("the hog's connection ended otherwise: {other:?}"),
    }
    let page: PendingPage = other
        .request(ids::PENDING_REQUEST, "o-after", &pending_request())
        .await
        .unwrap();
    assert_eq!(page.pending_count, 2);
    // Cut off, it is no longer a peer (and it can connect again).
    let mut again = far(addr, &cert, &key).await.unwrap();
    let page: PendingPage = again
        .request(ids::PENDING_REQUEST, "again", &pending_request())
        .await
        .unwrap();
    assert_eq!(page.pending_count, 2);
    eprintln!(
        "the hog was cut off after {sent} unread requests; the other asked {asked} times meanwhile"
    );
}

/// The rate tests' limits: a burst of 3, then one request a second.
const BURST_OF_3: ClientLimits = ClientLimits {
    requests_per_sec: 1.0,
    burst: 3.0,
    max_in_flight: 16,
};

/// What a client past its rate (a burst of 3) reads before its session ends.
#[derive(Default)]
struct Told {
    pages: usize,
    refused: usize,
}

impl Told {
    /// Counts one message; the error that ended the session passes through.
    fn take(&mut self, m: Result<Message, ClientError>) -> Result<(), ClientError> {
        match m? {
            Message::DocumentPutRaw(_) => self.pages += 1,
            Message::Error(e) => {
                assert!(e.error.contains("rate limit"), "{}", e.error);
                self.refused += 1;
            }
            other => panic!("unexpected {other:?}"),
        }
        Ok(())
    }

    /// A burst's worth served, then the refusals that told it.
    fn check(&self) {
        assert_eq!(self.pages, 3, "a burst's worth is served");
        assert!(self.refused >= 3, "refused {}", self.refused);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_past_its_rate_is_told_then_disconnected_with_the_reason() {
    let tmp = state_dir("rate");
    let dir = tmp.path();
    let key = SigningKey::from_bytes(&[21; 32]);
    let (addr, cert, _) = gateway_with(dir, &key, BURST_OF_3).await;
    let mut flooder = far(addr, &cert, &key).await.unwrap();
    // Many more than a burst's worth at once: answered, then refused, then cut off.
    for i in 0..20 {
        if flooder.send_raw(&raw_pending(i)).await.is_err() {
            break;
        }
    }
    let mut told = Told::default();
    let ended = loop {
        if let Err(e) = told.take(flooder.next_message().await) {
            break e;
        }
    };
    told.check();
    match ended {
        ClientError::Refused(why) => assert!(why.contains("limits exceeded"), "{why}"),
        other => panic!("the connection ended otherwise: {other:?}"),
    }
}

/// The same over RUDP (the service beside the QUIC side): the answers a client over its rate
/// was given, the refusals that told it, arrive before the Disconnect that gives the reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_rudp_client_past_its_rate_reads_its_answers_then_the_reason() {
    let tmp = state_dir("rate-rudp");
    let dir = tmp.path();
    let key = SigningKey::from_bytes(&[21; 32]);
    let (_, _, rudp) = gateway_with(dir, &key, BURST_OF_3).await;
    let mut flooder =
        gateway::client::Client::connect(rudp, "far-organ", &key, Duration::from_secs(10))
            .await
            .unwrap();
    // All at once, so the service takes them in one round and answers them together with the
    // Disconnect.
    for i in 0..20 {
        flooder.send_raw(raw_pending(i)).await.unwrap();
    }
    let mut told = Told::default();
    let ended = loop {
        if let Err(e) = told.take(flooder.next_message().await) {
            break e;
        }
    };
    told.check();
    match ended {
        ClientError::Closed(wire::error::CloseReason::Peer(why)) => {
            assert!(why.contains("rate limit"), "{why}");
        }
        other => panic!("the session ended otherwise: {other:?}"),
    }
}

#[test]
fn pem_files_are_read_and_a_bad_one_is_refused() {
    let tmp = state_dir("pem");
    let dir = tmp.path();
    let made = rcgen::generate_simple_self_signed(vec!["cultnet-gateway".to_owned()]).unwrap();
    std::fs::write(dir.join("c.pem"), made.cert.pem()).unwrap();
    std::fs::write(dir.join("k.pem"), made.key_pair.serialize_pem()).unwrap();
    let id = quic::identity(Some(&dir.join("c.pem")), Some(&dir.join("k.pem")), dir).unwrap();
    assert_eq!(id.certs[0].as_ref(), made.cert.der().as_ref());
    std::fs::write(dir.join("bad.pem"), "not a certificate").unwrap();
    assert!(quic::identity(Some(&dir.join("bad.pem")), Some(&dir.join("k.pem")), dir).is_err());
}

/// Stopping lets a verb in flight answer over QUIC, turns new connections away, and closes
/// each connection with the reason after its last answers (before, the endpoint closed at
/// once: the answer was lost and the reason was a bare "gateway stopping").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopping_gateway_answers_the_verb_in_flight_then_closes_with_the_reason() {
    use wire::docs::{ControlAction, ControlReceipt, ControlRequest, Status};
    let tmp = state_dir("drain");
    let key = SigningKey::from_bytes(&[23; 32]);
    let (controls, mut queued) = tokio::sync::mpsc::channel(1);
    let mut port = Port::new("@mira:l", 1000);
    port.controls = Some(controls);
    let g = start(tmp.path(), &key, ClientLimits::default(), port).await;
    let mut ops = far(g.addr, &g.cert, &key).await.unwrap();
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
    let wait = Duration::from_secs(10);
    let control = tokio::time::timeout(wait, queued.recv())
        .await
        .unwrap()
        .expect("the verb reached her turn loop");
    let stopped_at = std::time::Instant::now();
    g.stop.send(true).unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(
        far(g.addr, &g.cert, &key).await.is_err(),
        "a stopping gateway takes no new connection"
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
    let (receipt, after) = tokio::time::timeout(wait, verb).await.unwrap().unwrap();
    let receipt = receipt.expect("the verb in flight was answered");
    assert_eq!(receipt.status, Status::Ok, "{receipt:?}");
    match after {
        Err(ClientError::Refused(why)) => assert!(why.contains("shutting down"), "{why}"),
        other => panic!("the connection should end with the reason: {other:?}"),
    }
    tokio::time::timeout(wait, g.serving)
        .await
        .unwrap()
        .unwrap();
    tokio::time::timeout(wait, g.accepting)
        .await
        .unwrap()
        .unwrap();
    let took = stopped_at.elapsed();
    assert!(
        took < quic::DRAIN_WAIT + quic::GOODBYE_WAIT,
        "stopping took {took:?}"
    );
}
