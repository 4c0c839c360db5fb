//! An RUDP client that pinned the gateway's key knows it reached the gateway: the service's
//! Accept carries the proof of its key (`STATE/cultnet/server.key`), and whoever else holds the
//! port (here another service, with no key or another one) is refused before any request. Real
//! loopback sockets, the in-process service.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::Duration;

use ed25519_dalek::SigningKey;
use gateway::client::{Client, ClientError};
use gateway::config::{Client as ClientConfig, Verb};
use gateway::endpoint::{Endpoint, EndpointConfig};
use gateway::inbox::Inbox;
use gateway::service::{serve_with, server_key, Port, Service};
use wire::docs::{ids, GatewayStatus, StatusRequest};
use wire::session::GATEWAY_CONNECTION_ID;

fn state_dir(name: &str) -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix(&format!("cultnet-server-key-{name}-"))
        .tempdir()
        .unwrap()
}

/// A service for `organ` on a loopback port, signing its Accepts with `key` when given.
async fn start(
    dir: &std::path::Path,
    organ: &SigningKey,
    key: Option<SigningKey>,
) -> (SocketAddr, tokio::sync::watch::Sender<bool>) {
    let inbox = Inbox::open(&dir.join("inbox")).unwrap();
    let clients = [ClientConfig::for_key(
        "organ",
        &organ.verifying_key(),
        &["mira"],
        &Verb::ALL,
    )];
    let mut ports = BTreeMap::new();
    ports.insert("mira".to_owned(), Port::new("@mira:l", 1000));
    let mut service = Service::new("gw-key", GATEWAY_CONNECTION_ID, 120, inbox, &clients, ports);
    if let Some(k) = key {
        service = service.with_server_key(k);
    }
    let endpoint = Endpoint::bind(EndpointConfig::new("127.0.0.1:0".parse().unwrap(), 3))
        .await
        .unwrap();
    let addr = endpoint.local_addr();
    let (stop, stopped) = tokio::sync::watch::channel(false);
    tokio::spawn(serve_with(service, endpoint, None, stopped));
    (addr, stop)
}

#[tokio::test]
async fn a_pinned_client_reaches_only_the_gateway_whose_key_it_pinned() {
    let dir = state_dir("pinned");
    let organ = SigningKey::from_bytes(&[1; 32]);
    // The gateway's key, made once in its state directory and read back the same.
    let key = server_key(dir.path()).unwrap();
    assert_eq!(
        server_key(dir.path()).unwrap().to_bytes(),
        key.to_bytes(),
        "read back, not made again"
    );
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&dir.path().join("cultnet/server.key")), 0o600);
        assert_eq!(mode(&dir.path().join("cultnet")), 0o700);
    }
    let pinned = key.verifying_key();
    let (gateway, _stop) = start(dir.path(), &organ, Some(key)).await;
    let wait = Duration::from_secs(5);
    let mut c = Client::connect_pinned(gateway, "organ", &organ, &pinned, wait)
        .await
        .unwrap();
    let status: GatewayStatus = c
        .request(ids::STATUS_REQUEST, "s1", &StatusRequest::default())
        .await
        .unwrap();
    assert_eq!(status.personas.len(), 1);
    c.close().await;
    // A client that pinned nothing still gets in (the proof is only read by those who ask).
    Client::connect(gateway, "organ", &organ, wait)
        .await
        .unwrap()
        .close()
        .await;

    // Whoever else holds a port the client was told is the gateway's: with no key, or another.
    for (name, impostor_key) in [
        ("none", None),
        ("other", Some(SigningKey::from_bytes(&[9; 32]))),
    ] {
        let other = state_dir(name);
        let (impostor, _stop) = start(other.path(), &organ, impostor_key).await;
        match Client::connect_pinned(impostor, "organ", &organ, &pinned, wait).await {
            Err(ClientError::Refused(why)) => {
                assert!(why.contains("not the gateway pinned"), "{why}")
            }
            other => panic!("an impostor ({name}) was taken for the gateway: {other:?}"),
        }
    }
}
