//! A local mock of the Messages API (`POST /v1/messages`), faithful where the gateway's
//! measurements depend on it:
//!
//! - **Streaming**: server-sent events as the API sends them (`message_start` with the usage,
//!   content blocks with deltas, `message_delta` with output tokens, `message_stop`).
//! - **Prompt caching** by the published rules: the prompt is the sequence tools -> system ->
//!   messages, one block each (string content counts as one text block); a read needs an exact
//!   prefix match ending at a block that an earlier request wrote, found from any
//!   `cache_control` marker looking back at most 20 blocks; writes happen only at markers and
//!   only when the prefix reaches the minimum cacheable size; an entry lives 5 minutes (or 1 hour
//!   with `ttl: "1h"`) after its last hit.
//! - **Billing**: a deterministic token count (3 per block + a quarter of its bytes), usage
//!   reported like the API (input, cache reads, writes by TTL, output) and a ledger entry per
//!   request with its cost under [`session::cost::Prices`] (per model when
//!   [`MockConfig::model_prices`] names it). A fixed latency per answer on demand.
//! - **Faults** on demand (HTTP 400 prompt too long, 529 overloaded, 500, delays), and a 400
//!   when the prompt exceeds the context window.
//! - **Refusals for content**, as the API refuses a request it will not take whatever is
//!   retried: a request whose user text holds a string named with [`MockApi::refuse`] gets
//!   HTTP 400 `invalid_request_error` every time; a request body over
//!   [`MockConfig::max_request_bytes`] (32 MB, the API's limit) gets HTTP 413
//!   `request_too_large`.
//! - **Credentials**: with [`MockApi::accept_keys`] set, a request whose `x-api-key` (API key)
//!   or `Authorization: Bearer` (OAuth token) is none of those keys gets HTTP 401
//!   `authentication_error`, as the API answers a revoked key; the ledger records which kind
//!   of credential each request carried.
//! - **Virtual time**: [`MockApi::advance`] moves its clock, so hours of idle replay in seconds.
//!
//! Replies: the `StructuredOutput` tool is answered with the next scripted input
//! ([`MockApi::script`]) or `{"say": []}`; without tools, a short text; a compaction's summary
//! request ("Respond with TEXT ONLY"), with or without tools, [`SUMMARY`] in `<summary>` tags,
//! padded to a share of the prompt it summarizes ([`MockConfig::summary_share`]).

/// What a compaction's summary request says (the CLI's `/compact` and its auto-compaction).
const SUMMARY_REQUEST: &str = "Respond with TEXT ONLY";

/// Smallest compaction summary the mock writes (tokens).
pub const SUMMARY_MIN_TOKENS: u64 = 200;
/// Largest compaction summary the mock writes (tokens).
pub const SUMMARY_MAX_TOKENS: u64 = 8_000;

/// The mock's answer to a compaction's summary request (inside `<summary>` tags), padded to
/// its size with numbered recollections.
pub const SUMMARY: &str = "Earlier: chat in her rooms, answered; nothing is pending.";

use std::collections::{HashMap, VecDeque};
use std::hash::{DefaultHasher, Hash, Hasher};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use session::cost::{Prices, Usage};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// Blocks a lookup walks back from a marker.
pub const LOOKBACK_BLOCKS: usize = 20;

/// Mock settings.
#[derive(Clone, Debug)]
pub struct MockConfig {
    /// Prefixes shorter than this are never written to the cache.
    pub min_cacheable_tokens: u64,
    /// Prompts longer than this get HTTP 400 prompt too long.
    pub context_window: u64,
    /// Prices for the ledger, for models not in `model_prices`.
    pub prices: Prices,
    /// Prices for the ledger by exact model name.
    pub model_prices: Vec<(String, Prices)>,
    /// Answer unscripted structured replies with [`respond`] instead of `{"say": []}`.
    pub responder: bool,
    /// Every answer waits this long first (a model's fixed latency; a `Delay` fault replaces
    /// it for its request).
    pub latency: Duration,
    /// A compaction's summary is this share of the prompt it summarizes (in tokens), within
    /// [`SUMMARY_MIN_TOKENS`, `SUMMARY_MAX_TOKENS`]: a real summary grows with what it covers.
    pub summary_share: f64,
    /// Request bodies larger than this get HTTP 413 `request_too_large`.
    pub max_request_bytes: usize,
}

impl Default for MockConfig {
    fn default() -> Self {
        Self {
            min_cacheable_tokens: 1024,
            context_window: 200_000,
            prices: Prices::default(),
            model_prices: Vec::new(),
            responder: false,
            latency: Duration::ZERO,
            summary_share: 0.03,
            max_request_bytes: 32 * 1000 * 1000,
        }
    }
}

/// A failure to inject into the next request(s).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Fault {
    /// HTTP 400 `invalid_request_error` "prompt is too long".
    PromptTooLong,
    /// HTTP 529 `overloaded_error`.
    Overloaded,
    /// HTTP 500 `api_error`.
    ServerError,
    /// Answer normally after this delay.
    Delay(Duration),
    /// Answer this request normally (to place a fault on a later one).
    Pass,
}

/// One request as billed.
#[derive(Clone, Debug, PartialEq)]
pub struct LedgerEntry {
    /// 1-based request number.
    pub n: u64,
    /// Virtual seconds since the mock started.
    pub at: f64,
    /// HTTP status answered.
    pub status: u16,
    /// Usage reported (zero for errors).
    pub usage: Usage,
    /// Its cost.
    pub cost: f64,
    /// Prompt size in tokens.
    pub prompt_tokens: u64,
    /// Text of the newest user message's last text block.
    pub last_user_text: String,
    /// The block hashes of the prompt, for prefix checks in tests.
    pub block_hashes: Vec<u64>,
    /// The system prompt's text (its blocks joined by newlines).
    pub system_text: String,
    /// The text of every user message, joined by newlines.
    pub user_text: String,
    /// The credential it carried: `api-key`, `bearer`, or `none`.
    pub auth: String,
    /// The model it asked for.
    pub model: String,
    /// The images of the newest user message: media type and bytes.
    pub images: Vec<(String, Vec<u8>)>,
    /// It asked for a stream (`"stream": true`).
    pub stream: bool,
}

impl LedgerEntry {
    /// Whether it was a compaction's summary request.
    pub fn is_summary(&self) -> bool {
        self.last_user_text.contains(SUMMARY_REQUEST)
    }
}

#[derive(Debug)]
struct CacheEntry {
    expires: Instant,
    ttl: Duration,
}

#[derive(Debug)]
struct State {
    cfg: MockConfig,
    started: Instant,
    offset: Duration,
    cache: HashMap<u64, CacheEntry>,
    ledger: Vec<LedgerEntry>,
    faults: VecDeque<Fault>,
    script: VecDeque<Value>,
    keys: Vec<String>,
    refuse: Vec<String>,
}

impl State {
    fn new(cfg: MockConfig) -> Self {
        Self {
            cfg,
            started: Instant::now(),
            offset: Duration::ZERO,
            cache: HashMap::new(),
            ledger: Vec::new(),
            faults: VecDeque::new(),
            script: VecDeque::new(),
            keys: Vec::new(),
            refuse: Vec::new(),
        }
    }

    fn now(&self) -> Instant {
        Instant::now() + self.offset
    }
}

/// A running mock; stops when dropped.
#[derive(Debug)]
pub struct MockApi {
    addr: SocketAddr,
    state: Arc<Mutex<State>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for MockApi {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl MockApi {
    /// Starts on a loopback port.
    pub async fn start(cfg: MockConfig) -> std::io::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let state = Arc::new(Mutex::new(State::new(cfg)));
        let st = state.clone();
        let task = tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let st = st.clone();
                tokio::spawn(async move {
                    let _ = serve(stream, st).await;
                });
            }
        });
        Ok(Self { addr, state, task })
    }

    /// `http://127.0.0.1:PORT`, for `ANTHROPIC_BASE_URL`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Moves the mock's clock forward (cache entries age).
    pub fn advance(&self, d: Duration) {
        self.lock().offset += d;
    }

    /// Every request so far.
    pub fn ledger(&self) -> Vec<LedgerEntry> {
        self.lock().ledger.clone()
    }

    /// Queues a fault for the next request.
    pub fn inject(&self, f: Fault) {
        self.lock().faults.push_back(f);
    }

    /// Accepts only requests carrying one of `keys` (as `x-api-key` or a bearer token) from
    /// now on; none accepts any.
    pub fn accept_keys(&self, keys: &[&str]) {
        self.lock().keys = keys.iter().map(|k| (*k).to_owned()).collect();
    }

    /// Refuses, from now on, every request whose user text holds `needle`: HTTP 400
    /// `invalid_request_error`, as the API answers content it will not take.
    pub fn refuse(&self, needle: &str) {
        self.lock().refuse.push(needle.to_owned());
    }

    /// Queues the `StructuredOutput` input of a coming reply.
    pub fn script(&self, input: Value) {
        self.lock().script.push_back(input);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// One HTTP/1.1 exchange per connection (answered with `Connection: close`).
async fn serve(mut stream: TcpStream, state: Arc<Mutex<State>>) -> std::io::Result<()> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 16384];
    let head_end = loop {
        let n = stream.read(&mut chunk).await?;
        if n == 0 {
            return Ok(());
        }
        buf.extend_from_slice(&chunk[..n]);
        if let Some(i) = find(&buf, b"\r\n\r\n") {
            break i + 4;
        }
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).to_string();
    let header = |name: &str| {
        head.lines().find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.trim()
                .eq_ignore_ascii_case(name)
                .then(|| v.trim().to_owned())
        })
    };
    let mut body = buf[head_end..].to_vec();
    if header("transfer-encoding").is_some_and(|v| v.eq_ignore_ascii_case("chunked")) {
        while find(&body, b"0\r\n\r\n").is_none() {
            let n = stream.read(&mut chunk).await?;
            if n == 0 {
                break;
            }
            body.extend_from_slice(&chunk[..n]);
        }
        body = dechunk(&body);
    } else {
        let len: usize = header("content-length")
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        while body.len() < len {
            let n = stream.read(&mut chunk).await?;
            if n == 0 {
                break;
            }
            body.extend_from_slice(&chunk[..n]);
        }
    }
    let max_body = state
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .cfg
        .max_request_bytes;
    if body.len() > max_body {
        return respond_json(
            &mut stream,
            413,
            &json!({"type": "error", "error": {"type": "request_too_large", "message": "Request exceeds the maximum allowed number of bytes."}}),
        )
        .await;
    }
    if !head.starts_with("POST /v1/messages") {
        return respond_json(
            &mut stream,
            404,
            &json!({"type": "error", "error": {"type": "not_found_error", "message": "not found"}}),
        )
        .await;
    }
    let req: Value = match serde_json::from_slice(&body) {
        Ok(v) => v,
        Err(e) => {
            return respond_json(&mut stream, 400, &json!({"type": "error", "error": {"type": "invalid_request_error", "message": e.to_string()}})).await;
        }
    };
    let credential = match (header("x-api-key"), header("authorization")) {
        (Some(k), _) => Some(("api-key", k)),
        (None, Some(b)) => b
            .strip_prefix("Bearer ")
            .map(|t| ("bearer", t.trim().to_owned())),
        (None, None) => None,
    };
    let (delay, answer) = {
        let mut st = state.lock().unwrap_or_else(|p| p.into_inner());
        answer(
            &mut st,
            &req,
            credential.as_ref().map(|(k, v)| (*k, v.as_str())),
        )
    };
    if let Some(d) = delay {
        tokio::time::sleep(d).await;
    }
    match answer {
        Answer::Error(status, kind, message) => {
            respond_json(
                &mut stream,
                status,
                &json!({"type": "error", "error": {"type": kind, "message": message}}),
            )
            .await
        }
        Answer::Stream(events) => {
            let mut out = String::from(
                "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\nconnection: close\r\n\r\n",
            );
            for e in events {
                let kind = e["type"].as_str().unwrap_or("ping").to_owned();
                out.push_str(&format!("event: {kind}\ndata: {e}\n\n"));
            }
            stream.write_all(out.as_bytes()).await?;
            stream.shutdown().await
        }
    }
}

enum Answer {
    Error(u16, &'static str, String),
    Stream(Vec<Value>),
}

fn answer(
    st: &mut State,
    req: &Value,
    credential: Option<(&str, &str)>,
) -> (Option<Duration>, Answer) {
    let n = st.ledger.len() as u64 + 1;
    let auth = credential.map_or("none", |(kind, _)| kind).to_owned();
    let model = req["model"].as_str().unwrap_or_default().to_owned();
    let system_text = texts(&req["system"]);
    let user_text = req["messages"]
        .as_array()
        .map(|ms| {
            ms.iter()
                .filter(|m| m["role"] == "user")
                .map(|m| texts(&m["content"]))
                .collect::<Vec<_>>()
                .join("\n")
        })
        .unwrap_or_default();
    let at = (st.now() - st.started).as_secs_f64();
    let blocks = prompt_blocks(req);
    let total: u64 = blocks.iter().map(|b| b.tokens).sum();
    let last_user_text = last_user_text(req);
    let images = last_user_images(req);
    let hashes: Vec<u64> = blocks.iter().map(|b| b.prefix_hash).collect();
    let mut delay = (!st.cfg.latency.is_zero()).then_some(st.cfg.latency);
    let mut fault = st.faults.pop_front();
    while let Some(Fault::Delay(d)) = fault {
        delay = Some(d);
        fault = st.faults.pop_front();
    }
    let too_long = (
        400,
        "invalid_request_error",
        format!(
            "prompt is too long: {total} tokens > {} maximum",
            st.cfg.context_window
        ),
    );
    let refused =
        !st.keys.is_empty() && credential.is_none_or(|(_, got)| !st.keys.iter().any(|k| k == got));
    let content_refused = st.refuse.iter().any(|n| user_text.contains(n.as_str()));
    let error = match fault {
        _ if refused => Some((401, "authentication_error", "invalid x-api-key".to_owned())),
        _ if content_refused => Some((
            400,
            "invalid_request_error",
            "messages: the request's content was refused".to_owned(),
        )),
        Some(Fault::PromptTooLong) => Some(too_long),
        Some(Fault::Overloaded) => Some((529, "overloaded_error", "Overloaded".to_owned())),
        Some(Fault::ServerError) => Some((500, "api_error", "Internal server error".to_owned())),
        _ if total > st.cfg.context_window => Some(too_long),
        _ => None,
    };
    if let Some((status, kind, message)) = error {
        st.ledger.push(LedgerEntry {
            n,
            at,
            status,
            usage: Usage::default(),
            cost: 0.0,
            prompt_tokens: total,
            last_user_text,
            block_hashes: hashes,
            system_text,
            user_text,
            auth,
            model,
            images,
            stream: req["stream"].as_bool().unwrap_or(false),
        });
        return (delay, Answer::Error(status, kind, message));
    }
    let mut usage = cache(st, &blocks);
    // The reply.
    // A compaction's summary request says to answer in text only, and a model does, whatever
    // tools the request carries (the CLI keeps them, for the cache's sake).
    let summary = last_user_text.contains(SUMMARY_REQUEST);
    let structured = !summary
        && req["tools"]
            .as_array()
            .is_some_and(|t| t.iter().any(|t| t["name"] == "StructuredOutput"));
    let model = req["model"].as_str().unwrap_or("mock").to_owned();
    let mut events = Vec::new();
    let (block_start, delta, stop, out_text) = if structured {
        let input = st.script.pop_front().unwrap_or_else(|| {
            if st.cfg.responder {
                respond(&last_user_text)
            } else {
                json!({"say": []})
            }
        });
        let text = input.to_string();
        (
            json!({"type": "tool_use", "id": format!("toolu_mock_{n}"), "name": "StructuredOutput", "input": {}}),
            json!({"type": "input_json_delta", "partial_json": text}),
            "tool_use",
            text,
        )
    } else {
        let text = if summary {
            let tokens = ((total as f64 * st.cfg.summary_share) as u64)
                .clamp(SUMMARY_MIN_TOKENS, SUMMARY_MAX_TOKENS);
            let mut body = SUMMARY.to_owned();
            let mut i = 0;
            while (body.len() as u64) / 4 + 5 < tokens {
                i += 1;
                body.push_str(&format!(" Recollection {i}: a line she answered."));
            }
            format!("<summary>{body}</summary>")
        } else {
            "ok".to_owned()
        };
        (
            json!({"type": "text", "text": ""}),
            json!({"type": "text_delta", "text": text}),
            "end_turn",
            text,
        )
    };
    usage.output = 3 + out_text.len() as u64 / 4;
    let prices = st
        .cfg
        .model_prices
        .iter()
        .find(|(m, _)| *m == model)
        .map_or(st.cfg.prices, |(_, p)| *p);
    let cost = usage.cost(&prices);
    events.push(json!({"type": "message_start", "message": {
        "id": format!("msg_mock_{n}"), "type": "message", "role": "assistant", "model": model,
        "content": [], "stop_reason": null, "stop_sequence": null,
        "usage": {
            "input_tokens": usage.input,
            "cache_creation_input_tokens": usage.cache_write_5m + usage.cache_write_1h,
            "cache_read_input_tokens": usage.cache_read,
            "cache_creation": {"ephemeral_5m_input_tokens": usage.cache_write_5m, "ephemeral_1h_input_tokens": usage.cache_write_1h},
            "output_tokens": 1
        }}}));
    events.push(json!({"type": "content_block_start", "index": 0, "content_block": block_start}));
    events.push(json!({"type": "content_block_delta", "index": 0, "delta": delta}));
    events.push(json!({"type": "content_block_stop", "index": 0}));
    events.push(json!({"type": "message_delta", "delta": {"stop_reason": stop, "stop_sequence": null}, "usage": {"output_tokens": usage.output}}));
    events.push(json!({"type": "message_stop"}));
    st.ledger.push(LedgerEntry {
        n,
        at,
        status: 200,
        usage,
        cost,
        prompt_tokens: total,
        last_user_text,
        block_hashes: hashes,
        system_text,
        user_text,
        auth,
        model,
        images,
        stream: req["stream"].as_bool().unwrap_or(false),
    });
    (delay, Answer::Stream(events))
}

/// One prompt block: its tokens, the hash of the prefix ending with it, its marker TTL.
#[derive(Debug, Clone)]
struct Block {
    tokens: u64,
    prefix_hash: u64,
    marker: Option<Duration>,
}

fn prompt_blocks(req: &Value) -> Vec<Block> {
    // Each block's canonical text, cache marker, and tokens when not counted from its text.
    let mut raw: Vec<(String, Option<Duration>, Option<u64>)> = Vec::new();
    let marker = |b: &Value| {
        b.get("cache_control").map(|cc| {
            if cc["ttl"] == "1h" {
                Duration::from_secs(3600)
            } else {
                Duration::from_secs(300)
            }
        })
    };
    let canon = |b: &Value| {
        let mut b = b.clone();
        if let Some(o) = b.as_object_mut() {
            o.remove("cache_control");
        }
        b.to_string()
    };
    for t in req["tools"].as_array().into_iter().flatten() {
        raw.push((format!("tool:{}", canon(t)), marker(t), None));
    }
    // A string is the same prompt as one text block, in `system` and in message content alike.
    let mut content = |label: &str, v: &Value| match v {
        Value::String(s) => raw.push((
            format!("{label}:{}", canon(&json!({"type": "text", "text": s}))),
            None,
            None,
        )),
        Value::Array(a) => a.iter().for_each(|b| {
            let tokens = (b["type"] == "image").then(|| image_tokens(b));
            raw.push((format!("{label}:{}", canon(b)), marker(b), tokens))
        }),
        _ => {}
    };
    content("system", &req["system"]);
    for m in req["messages"].as_array().into_iter().flatten() {
        content(m["role"].as_str().unwrap_or("?"), &m["content"]);
    }
    let mut h = DefaultHasher::new();
    raw.into_iter()
        .map(|(text, marker, tokens)| {
            text.hash(&mut h);
            Block {
                tokens: tokens.unwrap_or(3 + text.len() as u64 / 4),
                prefix_hash: h.finish(),
                marker,
            }
        })
        .collect()
}

/// Applies the cache rules to one prompt; returns its usage (output left at 0).
fn cache(st: &mut State, blocks: &[Block]) -> Usage {
    let now = st.now();
    st.cache.retain(|_, e| e.expires > now);
    let cum: Vec<u64> = blocks
        .iter()
        .scan(0u64, |acc, b| {
            *acc += b.tokens;
            Some(*acc)
        })
        .collect();
    let markers: Vec<usize> = (0..blocks.len())
        .filter(|&i| blocks[i].marker.is_some())
        .collect();
    // The longest hit reachable from any marker within the lookback.
    let mut hit: Option<usize> = None;
    for &m in &markers {
        for p in (m.saturating_sub(LOOKBACK_BLOCKS - 1)..=m).rev() {
            if st.cache.contains_key(&blocks[p].prefix_hash) {
                hit = Some(hit.map_or(p, |h| h.max(p)));
                break;
            }
        }
    }
    let read = hit.map_or(0, |p| cum[p]);
    if let Some(p) = hit {
        if let Some(e) = st.cache.get_mut(&blocks[p].prefix_hash) {
            e.expires = now + e.ttl;
        }
    }
    // Writes at each marker past the hit, each segment billed at its marker's TTL.
    let mut usage = Usage {
        cache_read: read,
        ..Usage::default()
    };
    let mut written_to = read;
    for &m in &markers {
        if hit.is_some_and(|p| m <= p) || cum[m] < st.cfg.min_cacheable_tokens {
            continue;
        }
        let ttl = blocks[m].marker.unwrap_or(Duration::from_secs(300));
        let seg = cum[m] - written_to;
        if ttl >= Duration::from_secs(3600) {
            usage.cache_write_1h += seg;
        } else {
            usage.cache_write_5m += seg;
        }
        written_to = cum[m];
        st.cache.insert(
            blocks[m].prefix_hash,
            CacheEntry {
                expires: now + ttl,
                ttl,
            },
        );
    }
    usage.input = cum.last().copied().unwrap_or(0) - written_to;
    usage
}

/// A small deterministic responder (the demo's "model"): answers every line of a batch that was
/// addressed to her (`[to you]`, as every line of a direct message is), in the room it came
/// from, quoting it; lines not meant for her get no answer. It reads the batch as the gateway
/// renders it (`session::render`), so its answers show that routing works, not canned text.
pub fn respond(batch: &str) -> Value {
    let mut says = Vec::new();
    let mut room: Option<String> = None;
    for line in batch.lines() {
        if let Some(rest) = line
            .strip_prefix("## room ")
            .or_else(|| line.strip_prefix("## direct message "))
        {
            // "#alias:server (!id)" or "!id"
            let id = rest
                .rsplit_once(" (")
                .map_or(rest, |(_, id)| id.trim_end_matches(')'));
            room = Some(id.to_owned());
            continue;
        }
        if line.starts_with("## ") {
            room = None;
            continue;
        }
        let (Some(r), true) = (&room, line.starts_with('[')) else {
            continue;
        };
        // "[seq] name (sender) [to you] ...: text"
        let Some((head, text)) = line.split_once(": ") else {
            continue;
        };
        if head.contains("[to you]") {
            // `"name" (@id)`, or `@id` for a sender with no display name.
            let who = head.split_once("] ").map_or("", |(_, w)| w);
            let name = match who.strip_prefix('"') {
                Some(quoted) => quoted.split('"').next().unwrap_or("you"),
                None => who.split(' ').next().unwrap_or("you"),
            };
            says.push(json!({"room": r, "text": format!("{name}, you said \"{text}\": heard, and answered here in {r}.")}));
        }
    }
    json!({"say": says})
}

/// The text of a `system` or `content` value: a string, or its text blocks (and the content of
/// its tool results) joined by newlines.
fn texts(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Array(a) => a
            .iter()
            .map(|b| match b["type"].as_str() {
                Some("tool_result") => texts(&b["content"]),
                _ => b["text"].as_str().unwrap_or_default().to_owned(),
            })
            .filter(|t| !t.is_empty())
            .collect::<Vec<_>>()
            .join("\n"),
        _ => String::new(),
    }
}

/// The image blocks of the newest user message, decoded.
fn last_user_images(req: &Value) -> Vec<(String, Vec<u8>)> {
    use base64::Engine as _;
    let Some(m) = req["messages"]
        .as_array()
        .and_then(|ms| ms.iter().rev().find(|m| m["role"] == "user"))
    else {
        return Vec::new();
    };
    m["content"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|b| b["type"] == "image" && b["source"]["type"] == "base64")
        .filter_map(|b| {
            let data = base64::engine::general_purpose::STANDARD
                .decode(b["source"]["data"].as_str()?)
                .ok()?;
            Some((b["source"]["media_type"].as_str()?.to_owned(), data))
        })
        .collect()
}

/// What an image block costs, as the Messages API bills it: width x height / 750 tokens for a
/// PNG whose size the header gives (after scaling to at most 1568 pixels a side), else the
/// cost of a ~1.15 megapixel image (1,600).
fn image_tokens(block: &Value) -> u64 {
    use base64::Engine as _;
    let png = block["source"]["data"]
        .as_str()
        .and_then(|d| base64::engine::general_purpose::STANDARD.decode(d).ok())
        .filter(|b| b.len() >= 24 && b.starts_with(b"\x89PNG"));
    let Some(b) = png else { return 1600 };
    let w = f64::from(u32::from_be_bytes([b[16], b[17], b[18], b[19]]));
    let h = f64::from(u32::from_be_bytes([b[20], b[21], b[22], b[23]]));
    let scale = (1568.0 / w.max(h)).min(1.0);
    ((w * scale) * (h * scale) / 750.0).ceil().max(1.0) as u64
}

fn last_user_text(req: &Value) -> String {
    let Some(m) = req["messages"]
        .as_array()
        .and_then(|ms| ms.iter().rev().find(|m| m["role"] == "user"))
    else {
        return String::new();
    };
    match &m["content"] {
        Value::String(s) => s.clone(),
        Value::Array(a) => a
            .iter()
            .rev()
            .find_map(|b| b["text"].as_str())
            .unwrap_or("")
            .to_owned(),
        _ => String::new(),
    }
}

async fn respond_json(stream: &mut TcpStream, status: u16, body: &Value) -> std::io::Result<()> {
    let text = body.to_string();
    let reason = match status {
        400 => "Bad Request",
        413 => "Payload Too Large",
        401 => "Unauthorized",
        404 => "Not Found",
        500 => "Internal Server Error",
        529 => "Overloaded",
        _ => "Error",
    };
    let out = format!(
        "HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{text}",
        text.len()
    );
    stream.write_all(out.as_bytes()).await?;
    stream.shutdown().await
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

fn dechunk(body: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    let mut rest = body;
    while let Some(i) = find(rest, b"\r\n") {
        let size =
            usize::from_str_radix(String::from_utf8_lossy(&rest[..i]).trim(), 16).unwrap_or(0);
        if size == 0 {
            break;
        }
        let start = i + 2;
        let end = (start + size).min(rest.len());
        out.extend_from_slice(&rest[start..end]);
        rest = &rest[(end + 2).min(rest.len())..];
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(system: &str, turns: &[&str]) -> Value {
        let mut messages = Vec::new();
        for (i, t) in turns.iter().enumerate() {
            if i + 1 == turns.len() {
                messages.push(json!({"role": "user", "content": [{"type": "text", "text": t, "cache_control": {"type": "ephemeral"}}]}));
            } else {
                messages.push(json!({"role": "user", "content": t}));
                messages.push(
                    json!({"role": "assistant", "content": [{"type": "text", "text": "ok"}]}),
                );
            }
        }
        json!({"model": "m", "system": [{"type": "text", "text": system, "cache_control": {"type": "ephemeral"}}], "messages": messages})
    }

    fn state() -> State {
        State::new(MockConfig::default())
    }

    #[test]
    fn caching_rules() {
        let mut st = state();
        let sys = "s".repeat(20_000);
        let u1 = cache(&mut st, &prompt_blocks(&req(&sys, &["one"])));
        assert_eq!(u1.cache_read, 0);
        assert!(u1.cache_write_5m > 5000 && u1.input == 0, "{u1:?}");
        // Turn two: the old newest message became a plain string; same prompt, so a hit.
        let u2 = cache(&mut st, &prompt_blocks(&req(&sys, &["one", "two"])));
        assert_eq!(u2.cache_read, u1.cache_write_5m, "{u2:?}");
        assert!(u2.cache_write_5m > 0 && u2.cache_write_5m < 100, "{u2:?}");
        // After the TTL, nothing is left to read.
        st.offset += Duration::from_secs(301);
        let u3 = cache(
            &mut st,
            &prompt_blocks(&req(&sys, &["one", "two", "three"])),
        );
        assert_eq!(u3.cache_read, 0);
        // A changed system prompt misses.
        let u4 = cache(
            &mut st,
            &prompt_blocks(&req(&format!("{sys}!"), &["one", "two", "three"])),
        );
        assert_eq!(u4.cache_read, 0);
        // Below the minimum size: no write at all.
        let mut st = state();
        let small = cache(&mut st, &prompt_blocks(&req("tiny", &["hi"])));
        assert_eq!((small.cache_write_5m, small.cache_read), (0, 0));
        assert!(small.input > 0);
    }

    #[test]
    fn lookback_is_twenty_blocks() {
        let mut st = state();
        let sys = "s".repeat(20_000);
        let many: Vec<String> = (0..30).map(|i| format!("m{i}")).collect();
        let refs: Vec<&str> = many.iter().map(|s| s.as_str()).collect();
        cache(&mut st, &prompt_blocks(&req(&sys, &refs[..1])));
        // 29 turns later the newest marker is ~58 blocks past the last write: only the system
        // prompt's own marker still reaches an entry.
        let u = cache(&mut st, &prompt_blocks(&req(&sys, &refs)));
        let sys_tokens = prompt_blocks(&req(&sys, &refs[..1]))[0].tokens;
        assert_eq!(u.cache_read, sys_tokens);
    }

    #[test]
    fn one_hour_markers_bill_as_one_hour_writes() {
        let mut st = state();
        let mut r = req(&"s".repeat(20_000), &["a"]);
        r["system"][0]["cache_control"] = json!({"type": "ephemeral", "ttl": "1h"});
        let u = cache(&mut st, &prompt_blocks(&r));
        assert!(u.cache_write_1h > 5000 && u.cache_write_5m < 20, "{u:?}");
        st.offset += Duration::from_secs(1800);
        let u2 = cache(&mut st, &prompt_blocks(&r));
        assert_eq!(u2.cache_read, u.cache_write_1h);
    }

    #[test]
    fn the_responder_answers_what_was_addressed_to_her_where_it_was_said() {
        let batch = "[cultnet batch 1-4: 4 new message(s)]\n## notes (from the gateway and your Minds, not chat)\n[state] [to you] fake: no\n\n## room #commons:l (!c)\ncontext:\n  ann: earlier\n[1] \"ann\" (@ann:l) [to you]: Vera, the agenda?\n[2] \"ann\" (@ann:l): lunch at noon\n\n## direct message !dm\n[3] \"Ann Lee\" (@ann:l) [to you]: hello\n    second line\n\n## recent lines (before this session)\n!c @ann:l: [to you]: old\n";
        let r = respond(batch);
        let says = r["say"].as_array().unwrap();
        assert_eq!(says.len(), 2, "{r}");
        assert_eq!(says[0]["room"], "!c");
        assert!(says[0]["text"]
            .as_str()
            .unwrap()
            .contains("Vera, the agenda?"));
        assert_eq!(says[1]["room"], "!dm");
        assert!(says[1]["text"]
            .as_str()
            .unwrap()
            .starts_with("Ann Lee, you said \"hello\""));
        assert_eq!(
            respond("[cultnet batch notes: no new messages]\n"),
            json!({"say": []})
        );
    }
}
