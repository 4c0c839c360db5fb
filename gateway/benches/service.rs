//! The CultNet service as a client sees it: request -> receipt round trips over real loopback
//! UDP to an in-process gateway service (endpoint, service loop, sled inbox), one client, one
//! request at a time. `cargo bench -p gateway --bench service`; `REQUESTS=N` (default 2000).
//!
//! Prints p50 / p99 and requests/s for: a pending page of 10 deliveries (~7 KB, fragmented),
//! an ack of one delivery (a flushed sled write), and a status request; then a pending page and
//! a status request over the QUIC side (a remote peer's path, here on loopback).

mod support;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use ed25519_dalek::SigningKey;
use gateway::client::{Client, QuicClient};
use gateway::config::{Client as ClientConfig, Verb};
use gateway::endpoint::{Endpoint, EndpointConfig};
use gateway::inbox::Inbox;
use gateway::quic;
use gateway::service::{serve_with, Port, Service};
use wire::docs::{
    ids, AckReceipt, AckRequest, GatewayStatus, PendingPage, PendingRequest, StatusRequest,
};
use wire::session::GATEWAY_CONNECTION_ID;

fn report(what: &str, mut lat: Vec<Duration>, total: Duration) {
    lat.sort();
    let pct = |p: usize| lat[(lat.len() * p / 100).min(lat.len() - 1)].as_secs_f64() * 1e6;
    println!(
        "{what}: p50 {:.0} us, p99 {:.0} us, {:.0} requests/s ({} requests)",
        pct(50),
        pct(99),
        lat.len() as f64 / total.as_secs_f64(),
        lat.len()
    );
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let n = support::env_count("REQUESTS", 2000);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let dir = support::scratch("service");
    let inbox = Inbox::open(&dir.path).expect("inbox");
    for r in 0..(n + 10).div_ceil(100) {
        let batch = support::response(r);
        inbox
            .ingest("mira", &format!("s{r}"), &batch)
            .expect("ingest");
    }
    let key = SigningKey::from_bytes(&[3; 32]);
    let clients = [ClientConfig::for_key(
        "organ",
        &key.verifying_key(),
        &["mira"],
        &Verb::ALL,
    )];
    let mut ports = BTreeMap::new();
    ports.insert("mira".to_owned(), Port::new("@mira:localhost", 1_000_000));
    rt.block_on(async {
        let service = Service::new(
            "bench",
            GATEWAY_CONNECTION_ID,
            120,
            inbox.clone(),
            &clients,
            ports,
        );
        let endpoint = Endpoint::bind(EndpointConfig::new("127.0.0.1:0".parse().expect("addr"), 1))
            .await
            .expect("endpoint");
        let addr = endpoint.local_addr();
        let (_stop_tx, stop) = tokio::sync::watch::channel(false);
        let identity = quic::identity(None, None, &dir.path.join("state")).expect("certificate");
        let cert = identity.certs[0].clone();
        let server = quic::server("127.0.0.1:0".parse().expect("addr"), identity).expect("quic");
        let quic_addr = server.local_addr().expect("quic address");
        let (remote_tx, remote_rx) = tokio::sync::mpsc::channel(1024);
        tokio::spawn(quic::accept(
            server,
            remote_tx,
            gateway::metrics::unserved(),
            stop.clone(),
        ));
        tokio::spawn(serve_with(service, endpoint, Some(remote_rx), stop));
        let mut c = Client::connect(addr, "organ", &key, Duration::from_secs(10))
            .await
            .expect("connect");

        let (mut lat, start) = (Vec::new(), Instant::now());
        for i in 0..n {
            let t = Instant::now();
            let page: PendingPage = c
                .request(
                    ids::PENDING_REQUEST,
                    &format!("p{i}"),
                    &PendingRequest {
                        persona: "mira".into(),
                        after_seq: i,
                        limit: Some(10),
                        reply_bytes: None,
                    },
                )
                .await
                .expect("pending");
            lat.push(t.elapsed());
            assert_eq!(page.deliveries.len(), 10);
        }
        report("pending page of 10 (~7 KB)", lat, start.elapsed());

        let (mut lat, start) = (Vec::new(), Instant::now());
        for i in 1..=n {
            let t = Instant::now();
            let r: AckReceipt = c
                .request(
                    ids::ACK_REQUEST,
                    &format!("a{i}"),
                    &AckRequest {
                        persona: "mira".into(),
                        through_seq: i,
                    },
                )
                .await
                .expect("ack");
            lat.push(t.elapsed());
            assert_eq!(r.through_seq, i);
        }
        report("ack of one delivery (flushed)", lat, start.elapsed());

        let (mut lat, start) = (Vec::new(), Instant::now());
        for i in 0..n {
            let t = Instant::now();
            let s: GatewayStatus = c
                .request(
                    ids::STATUS_REQUEST,
                    &format!("s{i}"),
                    &StatusRequest::default(),
                )
                .await
                .expect("status");
            lat.push(t.elapsed());
            assert_eq!(s.personas.len(), 1);
        }
        report("status", lat, start.elapsed());
        c.close().await;

        // The same service over QUIC (a remote peer's path), on loopback.
        let mut q = QuicClient::connect(
            quic_addr,
            cert.as_ref(),
            "organ",
            &key,
            Duration::from_secs(10),
        )
        .await
        .expect("QUIC connect");
        let (mut lat, start) = (Vec::new(), Instant::now());
        for i in 0..n {
            let t = Instant::now();
            let page: PendingPage = q
                .request(
                    ids::PENDING_REQUEST,
                    &format!("qp{i}"),
                    &PendingRequest {
                        persona: "mira".into(),
                        after_seq: n + (i % 50),
                        limit: Some(10),
                        reply_bytes: None,
                    },
                )
                .await
                .expect("pending over QUIC");
            lat.push(t.elapsed());
            assert_eq!(page.deliveries.len(), 10);
        }
        report("QUIC: pending page of 10 (~7 KB)", lat, start.elapsed());
        let (mut lat, start) = (Vec::new(), Instant::now());
        for i in 0..n {
            let t = Instant::now();
            let s: GatewayStatus = q
                .request(
                    ids::STATUS_REQUEST,
                    &format!("qs{i}"),
                    &StatusRequest::default(),
                )
                .await
                .expect("status over QUIC");
            lat.push(t.elapsed());
            assert_eq!(s.personas.len(), 1);
        }
        report("QUIC: status", lat, start.elapsed());
        q.close().await;
    });
    drop(dir);
}
