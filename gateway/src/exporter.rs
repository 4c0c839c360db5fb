//! The metrics listener: on each scrape it reads the gateway's state (pending mail, sync
//! progress, CultNet datagrams) into a [`Snapshot`], and serves `/metrics`, `/healthz` and
//! `/readyz` on loopback. The metric families themselves are [`crate::metrics`]'s.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::watch;

use crate::endpoint::EndpointHandle;
use crate::inbox::Inbox;
use crate::metrics::{registry, Metrics, PersonaSnapshot, Snapshot};
use crate::service::Port;

/// Reads the state of the configured Personas `ids` (those not in `ports` have not
/// started yet) and of `endpoint` now.
pub async fn snapshot(
    inbox: &Inbox,
    ids: &[String],
    ports: &BTreeMap<String, Port>,
    endpoint: &EndpointHandle,
) -> Snapshot {
    // In-memory sled reads; a compaction holding the inbox is waited for off this worker
    // (the inbox's own rule).
    let counts: Vec<_> = ids
        .iter()
        .map(|id| inbox.counts(id).unwrap_or_default())
        .collect();
    let now = u64::try_from(crate::clock::unix_ms()).unwrap_or(0);
    let starting = Port::new("", 0);
    let personas = ids
        .iter()
        .enumerate()
        .map(|(i, id)| (i, id, ports.get(id).unwrap_or(&starting)))
        .map(|(i, id, port)| {
            let c = counts.get(i).copied().unwrap_or_default();
            let ear = port.ear.as_ref();
            let load = |f: fn(&crate::ear::EarStats) -> &std::sync::atomic::AtomicU64| {
                ear.map_or(0, |e| f(e).load(Ordering::Relaxed))
            };
            let last = load(|e| &e.last_sync_ms);
            (
                id.clone(),
                PersonaSnapshot {
                    pending: c.pending,
                    sync_lag: (last > 0).then(|| now.saturating_sub(last) as f64 / 1000.0),
                    syncs: load(|e| &e.syncs),
                    sync_errors: load(|e| &e.errors),
                    rate_limited: load(|e| &e.rate_limited),
                    held_back: load(|e| &e.held_back),
                    delivered: load(|e| &e.delivered),
                    failed: port.failed.is_some(),
                },
            )
        })
        .collect();
    let mut s = Snapshot {
        personas,
        ..Snapshot::default()
    };
    if let Ok(e) = endpoint.stats().await {
        s.datagrams_in = e.datagrams_received;
        s.datagrams_out = e.datagrams_sent;
        s.dropped = vec![
            ("malformed", e.hub.malformed),
            ("wrong_connection_id", e.hub.wrong_connection_id),
            ("unknown_peer", e.hub.unknown_peer),
            ("peers_full", e.hub.peers_full),
            ("queue_full", e.hub.raw_dropped),
            ("connect_too_large", e.hub.oversized_connects),
            ("waiting_room_full", e.hub.pending_evicted),
        ];
    }
    s
}

/// The Personas as they start (shared with the metrics listener, which starts first).
pub type Ports = Arc<Mutex<BTreeMap<String, Port>>>;

/// Serves `/metrics`, `/healthz` and `/readyz` on `bind` until `stop` turns true. `ids` are
/// the configured Personas; `ports` fills as they start (until then they are not ready).
pub async fn serve(
    bind: SocketAddr,
    inbox: Inbox,
    ids: Vec<String>,
    ports: Ports,
    endpoint: EndpointHandle,
    metrics: &Metrics,
    mut stop: watch::Receiver<bool>,
) -> std::io::Result<SocketAddr> {
    let listener = tokio::net::TcpListener::bind(bind).await?;
    let addr = listener.local_addr()?;
    let state = Arc::new(Mutex::new(Snapshot::default()));
    let registry = Arc::new(registry(state.clone(), metrics));
    tokio::spawn(async move {
        loop {
            let (mut stream, _) = tokio::select! {
                a = listener.accept() => match a {
                    Ok(a) => a,
                    Err(e) => {
                        tracing::warn!("metrics listener: {e}");
                        continue;
                    }
                },
                _ = stop.changed() => break,
            };
            let registry = registry.clone();
            let (inbox, ids, ports, endpoint, state) = (
                inbox.clone(),
                ids.clone(),
                ports.clone(),
                endpoint.clone(),
                state.clone(),
            );
            tokio::spawn(async move {
                // The whole request head (at most 8 KiB, 5 s): answering before it is all read
                // would reset the connection under a client still writing it.
                let mut buf = Vec::with_capacity(1024);
                let read = tokio::time::timeout(std::time::Duration::from_secs(5), async {
                    let mut chunk = [0u8; 1024];
                    while !buf.windows(4).any(|w| w == b"\r\n\r\n") && buf.len() < 8192 {
                        match stream.read(&mut chunk).await {
                            Ok(0) | Err(_) => return false,
                            Ok(n) => buf.extend_from_slice(&chunk[..n]),
                        }
                    }
                    true
                })
                .await;
                if !matches!(read, Ok(true)) {
                    return;
                }
                let head = String::from_utf8_lossy(&buf);
                let path = head.split_whitespace().nth(1).unwrap_or("/");
                // The state is read for the requests that show it, in their own task.
                let mut not_ready = Vec::new();
                if matches!(path, "/metrics" | "/readyz") {
                    let now = ports.lock().unwrap_or_else(|p| p.into_inner()).clone();
                    let snapshot = snapshot(&inbox, &ids, &now, &endpoint).await;
                    not_ready = snapshot
                        .not_ready()
                        .into_iter()
                        .map(str::to_owned)
                        .collect();
                    *state.lock().unwrap_or_else(|p| p.into_inner()) = snapshot;
                }
                let (status, kind, body) = match path {
                    "/metrics" => {
                        let mut text = String::new();
                        match prometheus_client::encoding::text::encode(&mut text, &registry) {
                            Ok(()) => (
                                "200 OK",
                                "application/openmetrics-text; version=1.0.0; charset=utf-8",
                                text,
                            ),
                            Err(e) => ("500 Internal Server Error", "text/plain", e.to_string()),
                        }
                    }
                    "/healthz" => ("200 OK", "text/plain", "ok\n".to_owned()),
                    "/readyz" if not_ready.is_empty() => {
                        ("200 OK", "text/plain", "ready\n".to_owned())
                    }
                    "/readyz" => (
                        "503 Service Unavailable",
                        "text/plain",
                        format!("not ready: {} not synced yet\n", not_ready.join(", ")),
                    ),
                    _ => ("404 Not Found", "text/plain", "not found\n".to_owned()),
                };
                let reply = format!(
                    "HTTP/1.1 {status}\r\ncontent-type: {kind}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = stream.write_all(reply.as_bytes()).await;
                let _ = stream.shutdown().await;
            });
        }
    });
    Ok(addr)
}
