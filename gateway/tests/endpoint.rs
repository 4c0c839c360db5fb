//! The CultNet endpoint over real loopback UDP sockets.

use std::time::Duration;

use bytes::Bytes;
use gateway::endpoint::{spawn, Endpoint, EndpointConfig, EndpointEvent, EndpointHandle};
use tokio::sync::mpsc::Receiver;
use wire::error::{CloseReason, SendError};
use wire::hub::{HubError, HubEvent};

async fn endpoint(seed: u64, loss: f64) -> (EndpointHandle, Receiver<EndpointEvent>) {
    let mut cfg = EndpointConfig::new("127.0.0.1:0".parse().unwrap(), seed);
    cfg.inject_loss = loss;
    let (h, rx, _) = spawn(cfg).await.unwrap();
    (h, rx)
}

async fn next_hub(rx: &mut Receiver<EndpointEvent>) -> HubEvent {
    loop {
        match tokio::time::timeout(Duration::from_secs(10), rx.recv()).await {
            Ok(Some(EndpointEvent::Hub(HubEvent::Pong { .. }))) => {}
            Ok(Some(EndpointEvent::Hub(e))) => return e,
            Ok(Some(other)) => panic!("unexpected {other:?}"),
            Ok(None) => panic!("endpoint stopped"),
            Err(_) => panic!("no event within 10 s"),
        }
    }
}

#[tokio::test]
async fn frames_flow_both_ways_in_order_even_with_loss() {
    let (server, mut srx) = endpoint(1, 0.1).await;
    let (client, mut crx) = endpoint(2, 0.1).await;
    let saddr = server.local_addr();
    client
        .connect(saddr, Bytes::from_static(b"creds"))
        .await
        .unwrap();
    let HubEvent::ConnectRequest(req) = next_hub(&mut srx).await else {
        panic!()
    };
    assert_eq!(&req.payload[..], b"creds");
    let peer = req.peer;
    server.accept(req).await.unwrap();
    assert!(matches!(
        next_hub(&mut crx).await,
        HubEvent::Connected { .. }
    ));
    assert!(matches!(
        next_hub(&mut srx).await,
        HubEvent::Connected { .. }
    ));
    for i in 0..2000u32 {
        client
            .send(saddr, "schema", Bytes::from(i.to_be_bytes().to_vec()))
            .await
            .unwrap();
    }
    // One big frame needs fragmentation (default 1200-byte fragments).
    let big = Bytes::from((0..100_000u32).map(|i| i as u8).collect::<Vec<_>>());
    client.send(saddr, "schema", big.clone()).await.unwrap();
    for i in 0..2000u32 {
        let HubEvent::Frame { frame, .. } = next_hub(&mut srx).await else {
            panic!()
        };
        assert_eq!(&frame.payload[..], &i.to_be_bytes());
    }
    let HubEvent::Frame { frame, .. } = next_hub(&mut srx).await else {
        panic!()
    };
    assert_eq!(frame.payload, big);
    server
        .send(peer, "schema", Bytes::from_static(b"answer"))
        .await
        .unwrap();
    let HubEvent::Frame { frame, .. } = next_hub(&mut crx).await else {
        panic!()
    };
    assert_eq!(&frame.payload[..], b"answer");
    let stats = client.stats().await.unwrap();
    assert!(stats.injected_drops > 0, "loss injection did nothing");
    assert!(stats.hub.sessions.resends > 0);
    assert!(
        stats.send_calls < stats.datagrams_sent,
        "no batching happened"
    );
}

#[tokio::test]
async fn refusal_and_send_failures_are_reported() {
    let (server, mut srx) = endpoint(3, 0.0).await;
    let (client, mut crx) = endpoint(4, 0.0).await;
    let saddr = server.local_addr();
    client
        .connect(saddr, Bytes::from_static(b"who"))
        .await
        .unwrap();
    let HubEvent::ConnectRequest(req) = next_hub(&mut srx).await else {
        panic!()
    };
    server.refuse(req, "unknown agent").await.unwrap();
    assert_eq!(
        next_hub(&mut crx).await,
        HubEvent::Disconnected {
            peer: saddr,
            reason: CloseReason::Peer("unknown agent".into())
        }
    );
    let nobody = "127.0.0.1:9".parse().unwrap();
    server
        .send(nobody, "schema", Bytes::from_static(b"x"))
        .await
        .unwrap();
    match tokio::time::timeout(Duration::from_secs(5), srx.recv()).await {
        Ok(Some(EndpointEvent::SendFailed { peer, error })) => {
            assert_eq!(peer, nobody);
            assert_eq!(error, SendError::UnknownPeer);
        }
        other => panic!("expected SendFailed, got {other:?}"),
    }
    // Junk datagrams are counted, not fatal.
    let junk = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
    junk.send_to(b"not a packet", saddr).await.unwrap();
    let mut tries = 0;
    while server.stats().await.unwrap().hub.malformed == 0 {
        tries += 1;
        assert!(tries < 100, "junk datagram not counted");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    server.shutdown().await.unwrap();
}

/// A verdict given after the Connect's waiting time opens nothing, and the owner is told so.
#[tokio::test]
async fn an_accept_that_comes_too_late_is_reported() {
    let mut cfg = EndpointConfig::new("127.0.0.1:0".parse().unwrap(), 5);
    cfg.hub.pending_timeout = Duration::from_millis(100);
    let (server, mut srx, _) = spawn(cfg).await.unwrap();
    let (client, _crx) = endpoint(6, 0.0).await;
    client
        .connect(server.local_addr(), Bytes::from_static(b"late"))
        .await
        .unwrap();
    let HubEvent::ConnectRequest(req) = next_hub(&mut srx).await else {
        panic!()
    };
    let peer = req.peer;
    tokio::time::sleep(Duration::from_millis(200)).await;
    server.accept(req).await.unwrap();
    loop {
        match tokio::time::timeout(Duration::from_secs(5), srx.recv()).await {
            Ok(Some(EndpointEvent::AcceptNotApplied { peer: p, error })) => {
                assert_eq!((p, error), (peer, HubError::Expired(peer)));
                break;
            }
            // The client's resent Connect, if the machine was slow enough for one.
            Ok(Some(EndpointEvent::Hub(HubEvent::ConnectRequest(_)))) => {}
            other => panic!("expected AcceptNotApplied, got {other:?}"),
        }
    }
    assert_eq!(server.stats().await.unwrap().hub.peers_full, 0);
    assert!(
        server.stats().await.unwrap().hub.sessions.packets_out == 0,
        "a session was opened"
    );
}

/// An endpoint its owner drives answers in the owner's own task (accept, echo, a refused
/// send reported as an event), takes commands from its handles at each pump, and says when a
/// handle asked it to shut down. Under 10% injected loss, so its timers (resends) must run.
#[tokio::test]
async fn an_owned_endpoint_answers_in_its_owners_task() {
    let mut cfg = EndpointConfig::new("127.0.0.1:0".parse().unwrap(), 7);
    cfg.inject_loss = 0.1;
    let mut server = Endpoint::bind(cfg).await.unwrap();
    let handle = server.handle();
    assert_eq!(handle.local_addr(), server.local_addr());
    let saddr = server.local_addr();
    let owner = tokio::spawn(async move {
        let mut echoed = 0u32;
        let mut refused = None;
        loop {
            tokio::time::timeout(Duration::from_secs(10), server.ready())
                .await
                .expect("the owned endpoint woke within 10 s");
            let running = server.pump();
            while let Some(e) = server.poll_event() {
                match e {
                    EndpointEvent::Hub(HubEvent::ConnectRequest(req)) => server.accept(req),
                    EndpointEvent::Hub(HubEvent::Frame { peer, frame }) => {
                        echoed += 1;
                        server.send(peer, "schema", frame.payload);
                    }
                    EndpointEvent::SendFailed { peer, error } => refused = Some((peer, error)),
                    _ => {}
                }
            }
            server.flush().await;
            if !running {
                return (echoed, refused);
            }
        }
    });
    let (client, mut crx) = endpoint(8, 0.1).await;
    client
        .connect(saddr, Bytes::from_static(b"creds"))
        .await
        .unwrap();
    assert!(matches!(
        next_hub(&mut crx).await,
        HubEvent::Connected { .. }
    ));
    for i in 0..500u32 {
        client
            .send(saddr, "schema", Bytes::from(i.to_be_bytes().to_vec()))
            .await
            .unwrap();
    }
    for i in 0..500u32 {
        let HubEvent::Frame { frame, .. } = next_hub(&mut crx).await else {
            panic!("a frame")
        };
        assert_eq!(&frame.payload[..], &i.to_be_bytes(), "echo {i}");
    }
    // A handle's command is taken at the next pump: a send to nobody comes back refused.
    let nobody: std::net::SocketAddr = "127.0.0.1:9".parse().unwrap();
    handle
        .send(nobody, "schema", Bytes::from_static(b"x"))
        .await
        .unwrap();
    handle.shutdown().await.unwrap();
    let (echoed, refused) = tokio::time::timeout(Duration::from_secs(10), owner)
        .await
        .expect("the owner saw the shutdown")
        .unwrap();
    assert_eq!(echoed, 500);
    let (peer, error) = refused.expect("the send to nobody was reported");
    assert_eq!(peer, nobody);
    assert!(matches!(error, SendError::UnknownPeer), "{error:?}");
}

/// An event its owner's own call made (a send to no session) wakes `ready` at once: the owner
/// sees it without waiting for the next datagram or timer.
#[tokio::test]
async fn an_owned_endpoint_is_ready_while_an_event_waits() {
    let mut ep = Endpoint::bind(EndpointConfig::new("127.0.0.1:0".parse().unwrap(), 9))
        .await
        .unwrap();
    let nobody: std::net::SocketAddr = "127.0.0.1:9".parse().unwrap();
    ep.send(nobody, "schema", Bytes::from_static(b"x"));
    tokio::time::timeout(Duration::from_secs(2), ep.ready())
        .await
        .expect("ready returned while the refused send waited");
    assert!(ep.pump());
    assert!(matches!(
        ep.poll_event(),
        Some(EndpointEvent::SendFailed { peer, error: SendError::UnknownPeer }) if peer == nobody
    ));
    assert!(ep.poll_event().is_none());
    assert!(!ep.has_session(nobody));
}
