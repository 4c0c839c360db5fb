//! A fault-injecting HTTP proxy in front of a real homeserver: it forwards every request to
//! Synapse unchanged (one request per connection), except that it answers the next `n` `/sync`
//! requests itself with `429 M_LIMIT_EXCEEDED` and a requested wait, can hold message sends
//! for a while, can answer the next `n` message sends itself with `502 Bad Gateway` (a
//! homeserver down behind its proxy), and can hold history reads (`/messages`) until released.
//! Synapse does not rate-limit `/sync` and is never slow or down on demand, so this is how a
//! test makes the ear meet a 429 it must wait out or a room that moves on while it reads
//! history, and the mouth a slow or failing homeserver.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// How a 429 says how long to wait.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hint {
    /// `retry_after_ms` in the JSON body (older servers).
    Body(Duration),
    /// The `Retry-After` header, in whole seconds (current spec).
    Header(u64),
}

impl Hint {
    /// The wait it asks for.
    pub fn wait(self) -> Duration {
        match self {
            Hint::Body(d) => d,
            Hint::Header(s) => Duration::from_secs(s),
        }
    }
}

#[derive(Debug)]
struct Plan {
    left: AtomicU32,
    hint: std::sync::Mutex<Hint>,
    answered: AtomicU32,
    first_at: std::sync::Mutex<Option<std::time::Instant>>,
    /// Sends (`PUT .../send/...`) are held this long (ms) before they are forwarded.
    send_delay_ms: std::sync::atomic::AtomicU64,
    /// Message sends still to be answered 502 instead of forwarded.
    sends_failing: AtomicU32,
    /// History reads (`/messages`) wait while this is set.
    hold_history: std::sync::atomic::AtomicBool,
    /// History reads received so far (held or not).
    history_reads: AtomicU32,
}

/// The proxy; stopped when dropped.
#[derive(Debug)]
pub struct FaultProxy {
    addr: SocketAddr,
    plan: Arc<Plan>,
    task: tokio::task::JoinHandle<()>,
}

impl FaultProxy {
    /// Listens on a free loopback port and forwards to `upstream` (`http://host:port`).
    pub async fn start(upstream: &str) -> Self {
        let upstream: SocketAddr = upstream
            .trim_start_matches("http://")
            .trim_end_matches('/')
            .parse()
            .expect("upstream host:port");
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind proxy");
        let addr = listener.local_addr().expect("proxy address");
        let plan = Arc::new(Plan {
            left: AtomicU32::new(0),
            hint: std::sync::Mutex::new(Hint::Header(1)),
            answered: AtomicU32::new(0),
            first_at: std::sync::Mutex::new(None),
            send_delay_ms: std::sync::atomic::AtomicU64::new(0),
            sends_failing: AtomicU32::new(0),
            hold_history: std::sync::atomic::AtomicBool::new(false),
            history_reads: AtomicU32::new(0),
        });
        let shared = plan.clone();
        let task = tokio::spawn(async move {
            while let Ok((conn, _)) = listener.accept().await {
                let plan = shared.clone();
                tokio::spawn(async move {
                    let _ = serve(conn, upstream, &plan).await;
                });
            }
        });
        Self { addr, plan, task }
    }

    /// Its URL, to give the client instead of the homeserver's.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Answers the next `n` `/sync` requests with 429, asking for a wait as `hint` says.
    pub fn rate_limit_syncs(&self, n: u32, hint: Hint) {
        *self.plan.hint.lock().unwrap_or_else(|e| e.into_inner()) = hint;
        *self.plan.first_at.lock().unwrap_or_else(|e| e.into_inner()) = None;
        self.plan.left.store(n, Ordering::SeqCst);
    }

    /// Holds every message send (`PUT .../send/...`) this long before forwarding it: a slow
    /// homeserver, as far as senders can tell.
    pub fn delay_sends(&self, by: Duration) {
        self.plan
            .send_delay_ms
            .store(by.as_millis() as u64, Ordering::SeqCst);
    }

    /// Answers the next `n` message sends (`PUT .../send/...`) with `502 Bad Gateway` without
    /// forwarding them.
    pub fn fail_sends(&self, n: u32) {
        self.plan.sends_failing.store(n, Ordering::SeqCst);
    }

    /// Holds every history read (`/messages`) until [`FaultProxy::release_history`]: a slow
    /// homeserver, as far as the ear's reads of a room's past can tell.
    pub fn hold_history(&self) {
        self.plan.hold_history.store(true, Ordering::SeqCst);
    }

    /// Lets the held history reads (and later ones) through.
    pub fn release_history(&self) {
        self.plan.hold_history.store(false, Ordering::SeqCst);
    }

    /// History reads (`/messages`) received so far, held ones included.
    pub fn history_reads(&self) -> u32 {
        self.plan.history_reads.load(Ordering::SeqCst)
    }

    /// Message sends still to be failed.
    pub fn sends_failing(&self) -> u32 {
        self.plan.sends_failing.load(Ordering::SeqCst)
    }

    /// When the first 429 of the last [`FaultProxy::rate_limit_syncs`] went out.
    pub fn first_429_at(&self) -> Option<std::time::Instant> {
        *self.plan.first_at.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// 429s answered so far.
    pub fn answered(&self) -> u32 {
        self.plan.answered.load(Ordering::SeqCst)
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn serve(mut conn: TcpStream, upstream: SocketAddr, plan: &Plan) -> std::io::Result<()> {
    // The request head, then its body by Content-Length (clients here send no chunked bodies).
    let mut buf = Vec::new();
    let head_end = loop {
        let mut chunk = [0u8; 8192];
        let n = conn.read(&mut chunk).await?;
        if n == 0 {
            return Ok(());
        }
        buf.extend_from_slice(&chunk[..n]);
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        if buf.len() > 1 << 20 {
            return Ok(());
        }
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).into_owned();
    let length: usize = head
        .lines()
        .find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.eq_ignore_ascii_case("content-length")
                .then(|| v.trim().parse().ok())?
        })
        .unwrap_or(0);
    while buf.len() < head_end + length {
        let mut chunk = [0u8; 8192];
        let n = conn.read(&mut chunk).await?;
        if n == 0 {
            break;
        }
        buf.extend_from_slice(&chunk[..n]);
    }
    let path = head.split_whitespace().nth(1).unwrap_or_default();
    let is_sync = path.contains("/_matrix/client/v3/sync") || path.contains("/r0/sync");
    if is_sync
        && plan
            .left
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok()
    {
        plan.answered.fetch_add(1, Ordering::SeqCst);
        plan.first_at
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get_or_insert_with(std::time::Instant::now);
        let hint = *plan.hint.lock().unwrap_or_else(|e| e.into_inner());
        let (body, header) = match hint {
            Hint::Body(d) => (
                format!(
                    r#"{{"errcode":"M_LIMIT_EXCEEDED","error":"Too Many Requests","retry_after_ms":{}}}"#,
                    d.as_millis()
                ),
                String::new(),
            ),
            Hint::Header(s) => (
                r#"{"errcode":"M_LIMIT_EXCEEDED","error":"Too Many Requests"}"#.to_owned(),
                format!("Retry-After: {s}\r\n"),
            ),
        };
        let response = format!(
            "HTTP/1.1 429 Too Many Requests\r\nContent-Type: application/json\r\n{header}Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        );
        conn.write_all(response.as_bytes()).await?;
        return conn.shutdown().await;
    }
    if path.contains("/send/")
        && plan
            .sends_failing
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok()
    {
        let body = r#"{"errcode":"M_UNKNOWN","error":"upstream down"}"#;
        let response = format!(
            "HTTP/1.1 502 Bad Gateway\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        );
        conn.write_all(response.as_bytes()).await?;
        return conn.shutdown().await;
    }
    if path.contains("/messages") {
        plan.history_reads.fetch_add(1, Ordering::SeqCst);
        while plan.hold_history.load(Ordering::SeqCst) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    let delay = plan.send_delay_ms.load(Ordering::SeqCst);
    if delay > 0 && path.contains("/send/") {
        tokio::time::sleep(Duration::from_millis(delay)).await;
    }
    // Forward with `Connection: close`, so that every request comes through here on its own.
    let mut rewritten = String::new();
    for line in head[..head_end - 4].split("\r\n") {
        if line
            .split_once(':')
            .is_some_and(|(k, _)| k.eq_ignore_ascii_case("connection"))
        {
            continue;
        }
        rewritten.push_str(line);
        rewritten.push_str("\r\n");
    }
    rewritten.push_str("Connection: close\r\n\r\n");
    let mut up = TcpStream::connect(upstream).await?;
    up.write_all(rewritten.as_bytes()).await?;
    up.write_all(&buf[head_end..]).await?;
    tokio::io::copy(&mut up, &mut conn).await?;
    conn.shutdown().await
}
