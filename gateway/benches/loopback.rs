//! Two CultNet endpoints over real loopback UDP sockets (kernel default buffers), on a tokio
//! runtime with two worker threads, measured as the gateway runs them.
//!
//! `cargo bench -p gateway --bench loopback` prints:
//! - the kernel's ceiling without batching: bare `send_to` -> `recv` of 100-byte datagrams;
//! - one-way reliable ordered throughput of 64-byte frames on `schema`;
//! - the same with 5% of datagrams dropped on purpose in both directions (resends vs. drops);
//! - request -> response round trips on ONE connection (p50, p99).
//!
//! Environment: `FRAMES` (default 200000), `ROUND_TRIPS` (default 20000), `ROUND_TRIP_RUNS`
//! (default 5; the median p50 is reported with its spread).

use std::net::{SocketAddr, UdpSocket};

use std::thread;
use std::time::{Duration, Instant};

use bytes::Bytes;
use gateway::endpoint::{spawn, EndpointConfig, EndpointEvent, EndpointHandle, EndpointStats};
use tokio::sync::mpsc::Receiver;
use wire::hub::HubEvent;

fn raw_udp(n: u64) -> f64 {
    let rx = UdpSocket::bind("127.0.0.1:0").unwrap();
    rx.set_read_timeout(Some(Duration::from_millis(200)))
        .unwrap();
    let to = rx.local_addr().unwrap();
    let h = thread::spawn(move || {
        let mut buf = [0u8; 2048];
        let (mut got, mut first, mut last) = (0u64, None, Instant::now());
        while rx.recv(&mut buf).is_ok() {
            first.get_or_insert_with(Instant::now);
            last = Instant::now();
            got += 1;
        }
        (got, first.map(|f| last - f))
    });
    let tx = UdpSocket::bind("127.0.0.1:0").unwrap();
    for _ in 0..n {
        let _ = tx.send_to(&[0u8; 100], to);
    }
    let (got, span) = h.join().unwrap();
    got as f64 / span.unwrap_or(Duration::from_secs(1)).as_secs_f64()
}

async fn endpoint(seed: u64, loss: f64) -> (EndpointHandle, Receiver<EndpointEvent>) {
    let mut cfg = EndpointConfig::new("127.0.0.1:0".parse().unwrap(), seed);
    cfg.inject_loss = loss;
    let (h, rx, _task) = spawn(cfg).await.unwrap();
    (h, rx)
}

/// A server that accepts everyone; `on_frame` sees each frame and may answer it.
fn serve(
    h: EndpointHandle,
    mut rx: Receiver<EndpointEvent>,
    mut on_frame: impl FnMut(Bytes) -> (bool, Option<Bytes>) + Send + 'static,
) {
    tokio::spawn(async move {
        while let Some(ev) = rx.recv().await {
            match ev {
                EndpointEvent::Hub(HubEvent::ConnectRequest(req)) => h.accept(req).await.unwrap(),
                EndpointEvent::Hub(HubEvent::Frame { peer, frame }) => {
                    let (go_on, answer) = on_frame(frame.payload);
                    if let Some(a) = answer {
                        h.send(peer, "schema", a).await.unwrap();
                    }
                    if !go_on {
                        return;
                    }
                }
                _ => {}
            }
        }
    });
}

async fn connected(client: &EndpointHandle, rx: &mut Receiver<EndpointEvent>, server: SocketAddr) {
    client
        .connect(server, Bytes::from_static(b"bench"))
        .await
        .unwrap();
    loop {
        match tokio::time::timeout(Duration::from_secs(10), rx.recv()).await {
            Ok(Some(EndpointEvent::Hub(HubEvent::Connected { .. }))) => return,
            Ok(Some(_)) => {}
            _ => panic!("handshake failed"),
        }
    }
}

struct OneWay {
    rate: f64,
    client: EndpointStats,
    server: EndpointStats,
}

async fn one_way(n: u64, loss: f64) -> OneWay {
    let (server, srx) = endpoint(0xB, loss).await;
    let (client, mut crx) = endpoint(0xA, loss).await;
    let (done_tx, done_rx) = tokio::sync::oneshot::channel();
    let mut done_tx = Some(done_tx);
    let mut expect = 0u64;
    serve(server.clone(), srx, move |p| {
        let i = u64::from_be_bytes(p[..8].try_into().unwrap());
        assert_eq!(i, expect, "out of order");
        expect += 1;
        if expect == n {
            let _ = done_tx.take().unwrap().send(Instant::now());
            return (false, None);
        }
        (true, None)
    });
    let saddr = server.local_addr();
    connected(&client, &mut crx, saddr).await;
    tokio::spawn(async move { while crx.recv().await.is_some() {} });
    let start = Instant::now();
    for i in 0..n {
        let mut p = i.to_be_bytes().to_vec();
        p.resize(64, 0);
        client.send(saddr, "schema", Bytes::from(p)).await.unwrap();
    }
    let end = tokio::time::timeout(Duration::from_secs(300), done_rx)
        .await
        .expect("stalled")
        .unwrap();
    let out = OneWay {
        rate: n as f64 / (end - start).as_secs_f64(),
        client: client.stats().await.unwrap(),
        server: server.stats().await.unwrap(),
    };
    client.shutdown().await.unwrap();
    server.shutdown().await.unwrap();
    out
}

/// Each side runs on its own OS thread with a current-thread runtime holding its endpoint and
/// its application task (the shape the gateway gives its CultNet endpoint): wake-ups between
/// the app and the endpoint stay on one thread.
fn round_trips(n: usize) -> (Duration, Duration, f64) {
    let (addr_tx, addr_rx) = std::sync::mpsc::channel();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let server = thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let (server, srx) = endpoint(0xB, 0.0).await;
            serve(server.clone(), srx, |p| (true, Some(p)));
            addr_tx.send(server.local_addr()).unwrap();
            let _ = stop_rx.await;
            server.shutdown().await.unwrap();
        });
    });
    let saddr = addr_rx.recv().unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let out = rt.block_on(async move {
        let (client, mut crx) = endpoint(0xA, 0.0).await;
        connected(&client, &mut crx, saddr).await;
        let payload = Bytes::from(vec![1u8; 64]);
        let mut times = Vec::with_capacity(n);
        let start = Instant::now();
        for _ in 0..n {
            let t0 = Instant::now();
            client.send(saddr, "schema", payload.clone()).await.unwrap();
            loop {
                if let Some(EndpointEvent::Hub(HubEvent::Frame { .. })) = crx.recv().await {
                    break;
                }
            }
            times.push(t0.elapsed());
        }
        let total = start.elapsed();
        client.shutdown().await.unwrap();
        times.sort();
        (
            times[n / 2],
            times[n * 99 / 100],
            n as f64 / total.as_secs_f64(),
        )
    });
    let _ = stop_tx.send(());
    server.join().unwrap();
    out
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let env = |k: &str, d: u64| {
        std::env::var(k)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(d)
    };
    let frames = env("FRAMES", 200_000);
    let rts = env("ROUND_TRIPS", 20_000) as usize;
    println!(
        "raw UDP ceiling (no protocol, no batching, 100 B send_to -> recv): {:.0} datagrams/s",
        raw_udp(frames)
    );
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let clean = one_way(frames, 0.0).await;
        let per_call = clean.client.datagrams_sent as f64 / clean.client.send_calls.max(1) as f64;
        println!(
            "one-way reliable ordered, 64 B frames: {:.0} frames/s ({frames} frames; resends {}; {:.1} datagrams per send call; receiver sent {:.2} datagrams per frame)",
            clean.rate,
            clean.client.hub.sessions.resends,
            per_call,
            clean.server.datagrams_sent as f64 / frames as f64
        );
        let lossy = one_way(frames, 0.05).await;
        let lost = lossy.client.injected_drops + lossy.server.injected_drops;
        let resends = lossy.client.hub.sessions.resends + lossy.server.hub.sessions.resends;
        println!(
            "one-way with 5% of datagrams dropped both ways: {:.0} frames/s ({:.2}x lossless); dropped {lost}, resends {resends} ({:.2}x dropped)",
            lossy.rate,
            lossy.rate / clean.rate,
            resends as f64 / lost.max(1) as f64
        );
    });
    let runs = env("ROUND_TRIP_RUNS", 5) as usize;
    let mut p50s = Vec::new();
    for run in 1..=runs {
        let (p50, p99, rate) = round_trips(rts);
        println!(
            "request -> response on one connection, 64 B, run {run}: p50 {:.1} us, p99 {:.1} us, {:.0} round trips/s",
            p50.as_secs_f64() * 1e6,
            p99.as_secs_f64() * 1e6,
            rate
        );
        p50s.push(p50);
    }
    p50s.sort();
    println!(
        "request -> response p50, median of {runs} runs: {:.1} us (min {:.1}, max {:.1})",
        p50s[runs / 2].as_secs_f64() * 1e6,
        p50s[0].as_secs_f64() * 1e6,
        p50s[runs - 1].as_secs_f64() * 1e6
    );
}
