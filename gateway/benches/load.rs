//! The CultNet service under load: 1, 10 and 50 concurrent clients, each on its own socket with
//! a pinned key, each asking for its own Persona, closed loop (a client sends its next request
//! when the last one is answered). Status, pending (a page of 10, ~7 KB) and ack (one more
//! delivery each time, so every ack writes and the service's group commit is measured).
//!
//! The service runs as `cultnet-gateway run` runs it ([`gateway::service::start`]: the endpoint
//! and the service loop on their own thread, the rest on a 2-worker runtime); the clients run
//! on one current-thread runtime on another thread. The floor is bare UDP ping-pong through the
//! same layout: an echo task on a thread of its own, the same number of client sockets.
//!
//! `cargo bench -p gateway --bench load`; `REQUESTS=N` requests per client per kind (default
//! 10,000 / clients, at least 400); `CLIENTS=1,10` and `KINDS=status,pending,ack` for part of
//! it (to profile one).

mod support;

use std::alloc::{GlobalAlloc, Layout, System};
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use ed25519_dalek::SigningKey;
use gateway::client::Client;
use gateway::config::{Client as ClientConfig, Verb};
use gateway::inbox::Inbox;
use gateway::service::{self, ClientLimits, Port, Service};
use wire::docs::{
    ids, AckReceipt, AckRequest, GatewayStatus, PendingPage, PendingRequest, StatusRequest,
};
use wire::session::GATEWAY_CONNECTION_ID;

const CLIENTS: [usize; 3] = [1, 10, 50];

/// The gateway's own key (its Accepts prove it; the clients pin it, as the binary's do).
const SERVER_SEED: [u8; 32] = [42; 32];

/// Counts heap allocations and reallocations: client and service live in this process, so
/// "allocs / request" is what one round trip allocates on both sides (the floor allocates none).
struct Counting;

static ALLOCS: AtomicU64 = AtomicU64::new(0);

// SAFETY: every call is passed unchanged to the system allocator; counting has no other effect.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: the caller's contract is System's.
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: as above.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: as above.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: as above.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

#[derive(Clone, Copy)]
enum Kind {
    Status,
    Pending,
    Ack,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Status => "status",
            Kind::Pending => "pending (page of 10)",
            Kind::Ack => "ack (one more each)",
        }
    }
}

struct Figures {
    per_sec: f64,
    p50: Duration,
    p99: Duration,
    allocs: f64,
}

/// Figures of a run that started at `start` with `allocs_before` allocations counted.
fn figures(mut lat: Vec<Duration>, start: Instant, allocs_before: u64) -> Figures {
    let elapsed = start.elapsed();
    let allocs = ALLOCS.load(Ordering::Relaxed) - allocs_before;
    lat.sort();
    let pct = |p: usize| lat[(lat.len() * p / 100).min(lat.len() - 1)];
    Figures {
        per_sec: lat.len() as f64 / elapsed.as_secs_f64(),
        p50: pct(50),
        p99: pct(99),
        allocs: allocs as f64 / lat.len() as f64,
    }
}

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

/// Bare UDP ping-pong: `n` client sockets, `per` round trips each, against an echo task on a
/// thread of its own.
async fn floor(n: usize, per: usize) -> Figures {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("echo runtime");
        rt.block_on(async move {
            let socket = tokio::net::UdpSocket::bind("127.0.0.1:0")
                .await
                .expect("echo socket");
            tx.send(socket.local_addr().expect("echo address"))
                .expect("echo address sent");
            let mut buf = [0u8; 2048];
            loop {
                let Ok((len, from)) = socket.recv_from(&mut buf).await else {
                    return;
                };
                if &buf[..len] == b"stop" {
                    return;
                }
                let _ = socket.send_to(&buf[..len], from).await;
            }
        });
    });
    let echo: SocketAddr = rx.recv().expect("echo address");
    let start = Instant::now();
    let allocs = ALLOCS.load(Ordering::Relaxed);
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..n {
        tasks.spawn(async move {
            let socket = tokio::net::UdpSocket::bind("127.0.0.1:0")
                .await
                .expect("client socket");
            socket.connect(echo).await.expect("connect");
            let mut buf = [0u8; 2048];
            let mut lat = Vec::with_capacity(per);
            for _ in 0..per {
                let t = Instant::now();
                socket.send(&[7u8; 64]).await.expect("send");
                socket.recv(&mut buf).await.expect("recv");
                lat.push(t.elapsed());
            }
            lat
        });
    }
    let mut lat = Vec::new();
    while let Some(l) = tasks.join_next().await {
        lat.extend(l.expect("client task"));
    }
    let f = figures(lat, start, allocs);
    let stop = tokio::net::UdpSocket::bind("127.0.0.1:0")
        .await
        .expect("stop socket");
    let _ = stop.send_to(b"stop", echo).await;
    f
}

/// `n` clients making `per` requests of `kind` each; acks go on from `acked` (what earlier
/// runs acknowledged of each Persona).
async fn load(
    server: SocketAddr,
    key: &SigningKey,
    n: usize,
    per: usize,
    kind: Kind,
    acked: &[usize],
) -> Figures {
    let mut clients = Vec::new();
    for _ in 0..n {
        clients.push(
            // As an operator's tool connects: pinning the gateway's key.
            Client::connect_pinned(
                server,
                "organ",
                key,
                &SigningKey::from_bytes(&SERVER_SEED).verifying_key(),
                Duration::from_secs(10),
            )
            .await
            .expect("connect"),
        );
    }
    let start = Instant::now();
    let allocs = ALLOCS.load(Ordering::Relaxed);
    let mut tasks = tokio::task::JoinSet::new();
    for (i, mut c) in clients.into_iter().enumerate() {
        let persona = format!("p{i}");
        let base = acked[i];
        tasks.spawn(async move {
            let mut lat = Vec::with_capacity(per);
            for j in 0..per {
                let record = format!("r{j}");
                let t = Instant::now();
                match kind {
                    Kind::Status => {
                        let s: GatewayStatus = c
                            .request(
                                ids::STATUS_REQUEST,
                                &record,
                                &StatusRequest {
                                    persona: Some(persona.clone()),
                                },
                            )
                            .await
                            .expect("status");
                        assert!(!s.personas.is_empty());
                    }
                    Kind::Pending => {
                        let page: PendingPage = c
                            .request(
                                ids::PENDING_REQUEST,
                                &record,
                                &PendingRequest {
                                    persona: persona.clone(),
                                    after_seq: j as u64,
                                    limit: Some(10),
                                    reply_bytes: None,
                                },
                            )
                            .await
                            .expect("pending");
                        assert_eq!(page.deliveries.len(), 10);
                    }
                    Kind::Ack => {
                        let through = (base + j + 1) as u64;
                        let r: AckReceipt = c
                            .request(
                                ids::ACK_REQUEST,
                                &record,
                                &AckRequest {
                                    persona: persona.clone(),
                                    through_seq: through,
                                },
                            )
                            .await
                            .expect("ack");
                        assert_eq!(r.through_seq, through);
                    }
                }
                lat.push(t.elapsed());
            }
            c.close().await;
            lat
        });
    }
    let mut lat = Vec::new();
    while let Some(l) = tasks.join_next().await {
        lat.extend(l.expect("client task"));
    }
    figures(lat, start, allocs)
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let requests = support::env_count("REQUESTS", 0) as usize;
    let per = |n: usize| {
        if requests > 0 {
            requests
        } else {
            (10_000 / n).max(400)
        }
    };
    let dir = support::scratch("load");
    let inbox = Inbox::open(&dir.path).expect("inbox");
    let list = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty());
    let sizes: Vec<usize> = match list("CLIENTS") {
        Some(v) => v
            .split(',')
            .map(|n| {
                n.trim()
                    .parse()
                    .unwrap_or_else(|_| panic!("CLIENTS: {n:?} is not a number of clients"))
            })
            .collect(),
        None => CLIENTS.to_vec(),
    };
    let all = [Kind::Status, Kind::Pending, Kind::Ack];
    let kinds: Vec<Kind> = match list("KINDS") {
        Some(v) => v
            .split(',')
            .map(|n| {
                all.into_iter()
                    .find(|k| k.name().starts_with(n.trim()))
                    .unwrap_or_else(|| panic!("KINDS: {n:?} is not status, pending or ack"))
            })
            .collect(),
        None => all.to_vec(),
    };
    let max_clients = sizes.iter().copied().max().unwrap_or(1);
    // Every client has its own Persona with mail for every run's pages and acks.
    let mut ports = BTreeMap::new();
    for p in 0..max_clients {
        let id = format!("p{p}");
        let needed: usize = sizes.iter().filter(|n| p < **n).map(|n| per(*n)).sum();
        for r in 0..(needed + 20).div_ceil(100) as u64 {
            inbox
                .ingest(&id, &format!("s{r}"), &support::response(r))
                .expect("ingest");
        }
        ports.insert(id.clone(), Port::new(&format!("@{id}:localhost"), u64::MAX));
    }
    let key = SigningKey::from_bytes(&[3; 32]);
    let clients = [ClientConfig::for_key(
        "organ",
        &key.verifying_key(),
        &["*"],
        &Verb::ALL,
    )];
    let server_rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let (_stop_tx, stop) = tokio::sync::watch::channel(false);
    let service = Service::new(
        "bench",
        GATEWAY_CONNECTION_ID,
        120,
        inbox.clone(),
        &clients,
        ports,
    )
    .with_limits(ClientLimits {
        requests_per_sec: 1e9,
        burst: 1e9,
        max_in_flight: 16,
    })
    .with_server_key(SigningKey::from_bytes(&SERVER_SEED));
    let started = server_rt
        .block_on(service::start(
            "127.0.0.1:0".parse().expect("addr"),
            1,
            service,
            None,
            None,
            stop,
        ))
        .expect("service");
    let server = started.endpoint.local_addr();
    let client_rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("client runtime");
    println!(
        "| request | clients | requests/s | p50 | p99 | p50 / floor | p99 / floor | allocs / request |\n|---|---|---|---|---|---|---|---|"
    );
    client_rt.block_on(async {
        let mut acked = vec![0usize; max_clients];
        for &n in &sizes {
            let f = floor(n, per(n)).await;
            println!(
                "| bare UDP ping-pong (floor) | {n} | {:.0} | {:.0} µs | {:.0} µs | 1.00 | 1.00 | {:.1} |",
                f.per_sec,
                us(f.p50),
                us(f.p99),
                f.allocs
            );
            for &kind in &kinds {
                let g = load(server, &key, n, per(n), kind, &acked).await;
                println!(
                    "| {} | {n} | {:.0} | {:.0} µs | {:.0} µs | {:.2} | {:.2} | {:.1} |",
                    kind.name(),
                    g.per_sec,
                    us(g.p50),
                    us(g.p99),
                    us(g.p50) / us(f.p50),
                    us(g.p99) / us(f.p99),
                    g.allocs
                );
            }
            for a in acked.iter_mut().take(n) {
                *a += per(n);
            }
        }
    });
    drop(dir);
}
