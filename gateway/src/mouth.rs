//! The mouth: sends a Persona's messages to Matrix exactly once.
//!
//! A send request's receipt is stored when the event exists; a repeated request id is
//! answered from the store without a request. The Matrix transaction id is derived from the
//! Persona and the request id, and her device id is stable, so even a crash between the PUT
//! and storing the receipt makes one event (Synapse answers the repeated PUT with the first
//! event id). Sends only to rooms she has joined; 429 and 5xx are retried with backoff, a
//! bounded number of times; permanent Matrix errors come back with their errcode.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use matrix_sdk::ruma::api::client::receipt::create_receipt::v3::ReceiptType;
use matrix_sdk::ruma::events::receipt::ReceiptThread;
use matrix_sdk::ruma::{OwnedEventId, OwnedRoomId, OwnedTransactionId, RoomAliasId};
use matrix_sdk::{Client, Room, RoomState};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use tokio::sync::Mutex;
use wire::docs::{SendReceipt, SendRequest, Status};

use crate::inbox::Inbox;
use crate::matrix::{classify, Backoff, Failure};

/// The largest text the mouth sends (bytes). Matrix events are capped at 64 KiB, and an
/// encrypted room's ciphertext is base64, a third larger than the plain event.
pub const MAX_TEXT_BYTES: usize = 32 * 1024;

// Her reply schema's limit (characters, at most four bytes each) fits the mouth's.
const _: () = assert!(session::render::MAX_SAY_CHARS * 4 <= MAX_TEXT_BYTES);

/// Attempts per send before it fails with [`MouthError::Exhausted`].
pub const MAX_ATTEMPTS: u32 = 6;

/// Why a send did not happen.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum MouthError {
    /// The text is empty or over [`MAX_TEXT_BYTES`].
    #[error("text of {bytes} bytes is outside 1..={max}")]
    BadSize {
        /// Its size.
        bytes: usize,
        /// The limit.
        max: usize,
    },
    /// The room does not resolve.
    #[error("unknown room {room}: {why}")]
    UnknownRoom {
        /// As asked.
        room: String,
        /// Why.
        why: String,
    },
    /// She is not joined there.
    #[error("she is not in room {room}")]
    NotHerRoom {
        /// As asked.
        room: String,
    },
    /// The homeserver refused for good.
    #[error("homeserver refused ({status} {errcode}): {message}")]
    Refused {
        /// HTTP status.
        status: u16,
        /// Matrix errcode.
        errcode: String,
        /// Message.
        message: String,
    },
    /// The token was rejected.
    #[error("homeserver rejected her token ({errcode})")]
    Unauthorized {
        /// Matrix errcode.
        errcode: String,
    },
    /// Retries ran out (homeserver down, rate limited for long).
    #[error("gave up after {attempts} attempts: {last}")]
    Exhausted {
        /// Attempts made.
        attempts: u32,
        /// The last error.
        last: String,
    },
    /// The receipt store failed.
    #[error("receipt store: {0}")]
    Store(String),
    /// The request id was used before (or is in use now) for another message: a repeat must
    /// carry the same room, text, thread and reply.
    #[error("request id {request_id:?} was already used for another message")]
    Reused {
        /// The request id.
        request_id: String,
    },
}

impl MouthError {
    /// Whether repeating the same request could succeed.
    pub fn is_permanent(&self) -> bool {
        matches!(
            self,
            Self::BadSize { .. }
                | Self::UnknownRoom { .. }
                | Self::NotHerRoom { .. }
                | Self::Refused { .. }
                | Self::Reused { .. }
        )
    }
}

/// What makes two sends under one request id the same message: its room, text, thread and
/// reply target (hex of a SHA-256 over them, each with its length).
pub fn content_digest(req: &SendRequest) -> String {
    let mut h = Sha256::new();
    for part in [
        Some(req.room.as_str()),
        Some(req.text.as_str()),
        req.thread_root.as_deref(),
        req.reply_to.as_deref(),
    ] {
        match part {
            Some(p) => {
                h.update([1]);
                h.update((p.len() as u64).to_be_bytes());
                h.update(p.as_bytes());
            }
            None => h.update([0]),
        }
    }
    crate::config::hex(&h.finalize()[..16])
}

/// Marks a request id as being sent with a content digest; unmarked when dropped.
struct Sending {
    ids: Arc<std::sync::Mutex<HashMap<String, String>>>,
    id: String,
}

impl Drop for Sending {
    fn drop(&mut self) {
        self.ids
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&self.id);
    }
}

/// The Matrix transaction id for a Persona's request: stable across retries, restarts and
/// crashes, distinct per Persona, and free of characters a URL path would need escaped.
pub fn txn_id(persona: &str, request_id: &str) -> String {
    let mut h = Sha256::new();
    h.update(persona.as_bytes());
    h.update([0]);
    h.update(request_id.as_bytes());
    let digest = h.finalize();
    format!("cg1-{}", crate::config::hex(&digest[..16]))
}

/// The most a send's `body` and `formatted_body` hold together (bytes): an event is capped at
/// 64 KiB, and an encrypted one carries its content as base64 (4/3 of it) in a JSON wrapper.
pub const MAX_FORMATTED_BYTES: usize = 40 * 1024;

/// How a say of hers is shaped beyond its text: whom it mentions, the names to show as pills,
/// the line of hers it corrects.
#[derive(Debug, Clone, Copy, Default)]
pub struct Shape<'a> {
    /// `m.mentions`' users; `None` leaves `m.mentions` out, as a CultNet client's send asks.
    pub mentions: Option<&'a [String]>,
    /// Names as written in the text and the users they are, linked as pills in the HTML.
    pub pills: &'a [(String, String)],
    /// Her own event this send edits (`m.replace`, with the new content in `m.new_content`).
    pub replaces: Option<&'a str>,
}

/// The `m.room.message` content for a send: text (with its Markdown rendered as HTML when it
/// has any, the names it mentions as pills), in a thread and/or replying, or as an edit of her
/// own event, and with the users it mentions (`m.mentions`: clients then ping exactly these,
/// instead of guessing from the text by the legacy push rules; `None` leaves it out, as a
/// CultNet client's send asks).
pub fn shaped(
    text: &str,
    thread_root: Option<&str>,
    reply_to: Option<&str>,
    shape: &Shape<'_>,
) -> Value {
    let mut c = json!({"msgtype": "m.text", "body": text});
    // Her replies are written in Markdown: clients show `formatted_body` (and sanitize it),
    // the plain `body` stays the source. Left out when the two would not fit an event.
    let linked = crate::markdown::with_pills(text, shape.pills);
    if let Some(html) = crate::markdown::to_html(&linked) {
        if text.len() + html.len() <= MAX_FORMATTED_BYTES {
            c["format"] = json!("org.matrix.custom.html");
            c["formatted_body"] = json!(html);
        }
    }
    if let Some(users) = shape.mentions {
        c["m.mentions"] = if users.is_empty() {
            json!({})
        } else {
            json!({ "user_ids": users })
        };
    }
    if let Some(original) = shape.replaces {
        // An edit: clients show `m.new_content`; the outer body is the fallback (`* text`).
        let mut outer = c.clone();
        outer["body"] = json!(format!("* {text}"));
        if let Some(html) = c["formatted_body"].as_str() {
            outer["formatted_body"] = json!(format!("* {html}"));
        }
        outer["m.new_content"] = c;
        outer["m.relates_to"] = json!({"rel_type": "m.replace", "event_id": original});
        return outer;
    }
    match (thread_root, reply_to) {
        (Some(root), reply) => {
            c["m.relates_to"] = json!({
                "rel_type": "m.thread",
                "event_id": root,
                "is_falling_back": reply.is_none(),
                "m.in_reply_to": {"event_id": reply.unwrap_or(root)},
            });
        }
        (None, Some(reply)) => {
            c["m.relates_to"] = json!({"m.in_reply_to": {"event_id": reply}});
        }
        (None, None) => {}
    }
    c
}

/// What a send puts in the room.
#[derive(Debug, Clone, Copy)]
enum Outgoing<'a> {
    /// An `m.room.message` of the request's text.
    Message(&'a Shape<'a>),
    /// An `m.reaction`: the request's text is its key, `reply_to` the event it annotates.
    Reaction,
}

/// How often [`Mouth::typing_while`] asks for her typing notice to be renewed.
const TYPING_RENEW: Duration = Duration::from_millis(500);

/// Her typing notice in some rooms, kept on while this lives (see [`Mouth::typing_while`]).
#[derive(Debug)]
pub struct Typing {
    task: tokio::task::JoinHandle<()>,
    mouth: Mouth,
    rooms: Vec<String>,
}

impl Typing {
    /// Stops renewing and takes the notice down at once.
    pub async fn stop(mut self) {
        self.task.abort();
        for r in std::mem::take(&mut self.rooms) {
            self.mouth.typing(&r, false).await;
        }
    }
}

impl Drop for Typing {
    /// Dropped without [`Typing::stop`] (an early return): no longer renewed, the notice
    /// lapses within its 4 s.
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// One Persona's mouth.
#[derive(Clone)]
pub struct Mouth {
    persona: String,
    client: Client,
    inbox: Inbox,
    rooms: Arc<Mutex<HashMap<String, OwnedRoomId>>>,
    retry_floor: Duration,
    retries: Arc<std::sync::atomic::AtomicU64>,
    metrics: Arc<crate::metrics::Metrics>,
    /// Request ids being sent now, with their content digests.
    sending: Arc<std::sync::Mutex<HashMap<String, String>>>,
}

impl std::fmt::Debug for Mouth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mouth")
            .field("persona", &self.persona)
            .finish()
    }
}

impl Mouth {
    /// A mouth for `persona`; `rooms` maps configured names (aliases) to room ids.
    pub fn new(
        persona: &str,
        client: Client,
        inbox: Inbox,
        rooms: HashMap<String, OwnedRoomId>,
    ) -> Self {
        Self {
            persona: persona.to_owned(),
            client,
            inbox,
            rooms: Arc::new(Mutex::new(rooms)),
            retry_floor: Duration::from_millis(500),
            retries: Arc::default(),
            metrics: crate::metrics::unserved(),
            sending: Arc::default(),
        }
    }

    /// Counts her sends in `metrics` (the gateway's, which its exporter serves).
    pub fn with_metrics(mut self, metrics: Arc<crate::metrics::Metrics>) -> Self {
        self.metrics = metrics;
        self
    }

    /// The room id a name resolved to (a configured alias, or an alias she sent to), from
    /// what the mouth has resolved so far; no homeserver request.
    pub async fn resolved(&self, name: &str) -> Option<String> {
        self.rooms.lock().await.get(name).map(ToString::to_string)
    }

    /// Send attempts repeated after a 429, a 5xx or a network error, since start.
    pub fn retries(&self) -> u64 {
        self.retries.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Sends (at most once per request id) and answers with the receipt.
    pub async fn send(&self, req: &SendRequest) -> SendReceipt {
        self.send_shaped(req, &Shape::default()).await
    }

    /// A CultNet client's send: `req` carries the id the client owns (its agent and its id),
    /// and the receipt names the id as the client gave it, `client_request_id`. A receipt kept
    /// under that bare id, from before ids were owned, answers its repeat.
    pub async fn send_for_client(&self, req: &SendRequest, client_request_id: &str) -> SendReceipt {
        let earlier = self
            .inbox
            .receipt_with_digest(&self.persona, client_request_id)
            .ok()
            .flatten()
            .filter(|(_, digest)| digest.is_none());
        let mut receipt = match earlier {
            Some((r, _)) => r,
            None => self.send(req).await,
        };
        receipt.request_id = client_request_id.to_owned();
        receipt
    }

    /// Her Matrix client (to read what her batch refers to, such as its media).
    pub fn client(&self) -> &Client {
        &self.client
    }

    /// [`Mouth::send`] shaped by her reply (see [`Shape`]): her own says name whom they
    /// mention, pill them, and may correct a line of hers.
    pub async fn send_shaped(&self, req: &SendRequest, shape: &Shape<'_>) -> SendReceipt {
        let started = std::time::Instant::now();
        let receipt = self.send_inner(req, Outgoing::Message(shape)).await;
        self.metrics.send(
            &self.persona,
            receipt.status,
            started.elapsed().as_secs_f64(),
        );
        receipt
    }

    /// Adds her reaction `key` to `event` in `room`, at most once per `request_id`.
    pub async fn react(&self, request_id: &str, room: &str, event: &str, key: &str) -> SendReceipt {
        let req = SendRequest {
            request_id: request_id.to_owned(),
            persona: self.persona.clone(),
            room: room.to_owned(),
            text: key.to_owned(),
            thread_root: None,
            reply_to: Some(event.to_owned()),
        };
        self.send_inner(&req, Outgoing::Reaction).await
    }

    async fn send_inner(&self, req: &SendRequest, out: Outgoing<'_>) -> SendReceipt {
        match self.try_send(req, out).await {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(persona = %self.persona, request = %req.request_id, error = %e, "send failed");
                SendReceipt {
                    request_id: req.request_id.clone(),
                    status: if e.is_permanent() {
                        Status::Rejected
                    } else {
                        Status::Failed
                    },
                    error: Some(e.to_string()),
                    ..SendReceipt::default()
                }
            }
        }
    }

    /// [`Mouth::send_inner`] with the failure typed.
    async fn try_send(
        &self,
        req: &SendRequest,
        out: Outgoing<'_>,
    ) -> Result<SendReceipt, MouthError> {
        let store = |e: crate::inbox::InboxError| MouthError::Store(e.to_string());
        let digest = content_digest(req);
        let reused = || MouthError::Reused {
            request_id: req.request_id.clone(),
        };
        if let Some((r, stored)) = self
            .inbox
            .receipt_with_digest(&self.persona, &req.request_id)
            .map_err(store)?
        {
            // A receipt from before digests were kept answers any repeat.
            if stored.is_some_and(|d| d != digest) {
                return Err(reused());
            }
            return Ok(r);
        }
        // One message per request id in flight too: the same id with other content while the
        // first is being sent would get the first's event (one transaction id) and be told ok.
        let _sending = {
            let mut ids = self.sending.lock().unwrap_or_else(|p| p.into_inner());
            match ids.get(&req.request_id) {
                Some(d) if *d != digest => return Err(reused()),
                _ => {
                    ids.insert(req.request_id.clone(), digest.clone());
                }
            }
            Sending {
                ids: self.sending.clone(),
                id: req.request_id.clone(),
            }
        };
        if req.text.is_empty() || req.text.len() > MAX_TEXT_BYTES {
            return Err(MouthError::BadSize {
                bytes: req.text.len(),
                max: MAX_TEXT_BYTES,
            });
        }
        let room = self.joined_room(&req.room).await?;
        let txn = OwnedTransactionId::from(txn_id(&self.persona, &req.request_id));
        let (event_type, body) = match out {
            Outgoing::Message(shape) => (
                "m.room.message",
                shaped(
                    &req.text,
                    req.thread_root.as_deref(),
                    req.reply_to.as_deref(),
                    shape,
                ),
            ),
            Outgoing::Reaction => (
                "m.reaction",
                json!({"m.relates_to": {
                    "rel_type": "m.annotation",
                    "event_id": req.reply_to.as_deref().unwrap_or_default(),
                    "key": req.text,
                }}),
            ),
        };
        let mut backoff = Backoff::new(self.retry_floor, Duration::from_secs(8));
        let mut attempt = 0;
        let event_id = loop {
            attempt += 1;
            match room
                .send_raw(event_type, &body)
                .with_transaction_id(&txn)
                .await
            {
                Ok(r) => break r.response.event_id,
                Err(e) => match classify(&e) {
                    Failure::Permanent {
                        status,
                        errcode,
                        message,
                    } => {
                        return Err(MouthError::Refused {
                            status,
                            errcode,
                            message,
                        })
                    }
                    Failure::Unauthorized { errcode } => {
                        return Err(MouthError::Unauthorized { errcode })
                    }
                    Failure::Transient { retry_after } => {
                        if attempt >= MAX_ATTEMPTS {
                            return Err(MouthError::Exhausted {
                                attempts: attempt,
                                last: e.to_string(),
                            });
                        }
                        let wait = backoff.next(retry_after);
                        self.retries
                            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        tracing::debug!(persona = %self.persona, error = %e, ?wait, "send retried");
                        tokio::time::sleep(wait).await;
                    }
                },
            }
        };
        let receipt = SendReceipt {
            request_id: req.request_id.clone(),
            status: Status::Ok,
            event_id: Some(event_id.to_string()),
            room_id: Some(room.room_id().to_string()),
            error: None,
        };
        // Its flush hands this worker's other tasks on first (the inbox's own rule).
        self.inbox
            .store_receipt_with_digest(&self.persona, &receipt, &digest)
            .map_err(store)?;
        tracing::info!(persona = %self.persona, request = %req.request_id, event = %event_id, "sent");
        Ok(receipt)
    }

    /// Resolves an alias or id to a room she has joined.
    pub async fn joined_room(&self, name: &str) -> Result<Room, MouthError> {
        let unknown = |why: String| MouthError::UnknownRoom {
            room: name.to_owned(),
            why,
        };
        let cached = self.rooms.lock().await.get(name).cloned();
        let id = match cached {
            Some(id) => id,
            None if name.starts_with('#') => {
                let alias = RoomAliasId::parse(name).map_err(|e| unknown(e.to_string()))?;
                let id = self
                    .client
                    .resolve_room_alias(&alias)
                    .await
                    .map_err(|e| unknown(e.to_string()))?
                    .room_id;
                self.rooms.lock().await.insert(name.to_owned(), id.clone());
                id
            }
            None => OwnedRoomId::try_from(name).map_err(|e| unknown(e.to_string()))?,
        };
        match self.client.get_room(&id) {
            Some(room) if room.state() == RoomState::Joined => Ok(room),
            _ => Err(MouthError::NotHerRoom {
                room: name.to_owned(),
            }),
        }
    }

    /// Shows her typing in `rooms` until [`Typing::stop`] (or the guard is dropped). A
    /// typing notice lasts 4 s (matrix-sdk's timeout) and a turn with a real model lasts
    /// longer, so the notice is renewed: asked every half second, sent by matrix-sdk once 3 s
    /// have passed since the last.
    pub fn typing_while(&self, rooms: Vec<String>) -> Typing {
        let (mouth, shown) = (self.clone(), rooms.clone());
        let task = tokio::spawn(async move {
            loop {
                for r in &shown {
                    mouth.typing(r, true).await;
                }
                tokio::time::sleep(TYPING_RENEW).await;
            }
        });
        Typing {
            task,
            mouth: self.clone(),
            rooms,
        }
    }

    /// Typing notice on or off (best effort: a failure is logged).
    pub async fn typing(&self, room_id: &str, on: bool) {
        if let Ok(room) = self.joined_room(room_id).await {
            if let Err(e) = room.typing_notice(on).await {
                tracing::debug!(persona = %self.persona, error = %e, "typing notice failed");
            }
        }
    }

    /// Read receipt on an event (best effort: a failure is logged).
    pub async fn read_receipt(&self, room_id: &str, event_id: &str) {
        let Ok(event) = OwnedEventId::try_from(event_id) else {
            return;
        };
        if let Ok(room) = self.joined_room(room_id).await {
            if let Err(e) = room
                .send_single_receipt(ReceiptType::Read, ReceiptThread::Unthreaded, event)
                .await
            {
                tracing::debug!(persona = %self.persona, error = %e, "read receipt failed");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A send's content with `mentions` only.
    fn content(
        text: &str,
        thread_root: Option<&str>,
        reply_to: Option<&str>,
        mentions: Option<&[String]>,
    ) -> Value {
        shaped(
            text,
            thread_root,
            reply_to,
            &Shape {
                mentions,
                ..Shape::default()
            },
        )
    }

    #[test]
    fn txn_ids_are_stable_distinct_and_path_safe() {
        let a = txn_id("vera", "batch-7-0");
        assert_eq!(a, txn_id("vera", "batch-7-0"));
        assert_ne!(a, txn_id("vera", "batch-7-1"));
        assert_ne!(a, txn_id("mira", "batch-7-0"));
        // The separator keeps ("ab", "c") and ("a", "bc") apart.
        assert_ne!(txn_id("ab", "c"), txn_id("a", "bc"));
        assert!(a.starts_with("cg1-") && a.len() == 36);
        assert!(a.chars().all(|c| c.is_ascii_alphanumeric() || c == '-'));
    }

    #[test]
    fn content_carries_threads_and_replies() {
        assert_eq!(
            content("hi", None, None, None),
            json!({"msgtype": "m.text", "body": "hi"})
        );
        let r = content("hi", None, Some("$q"), None);
        assert_eq!(
            r["m.relates_to"],
            json!({"m.in_reply_to": {"event_id": "$q"}})
        );
        let t = content("hi", Some("$root"), None, None);
        assert_eq!(t["m.relates_to"]["rel_type"], "m.thread");
        assert_eq!(t["m.relates_to"]["is_falling_back"], true);
        assert_eq!(t["m.relates_to"]["m.in_reply_to"]["event_id"], "$root");
        let tr = content("hi", Some("$root"), Some("$q"), None);
        assert_eq!(tr["m.relates_to"]["is_falling_back"], false);
        assert_eq!(tr["m.relates_to"]["m.in_reply_to"]["event_id"], "$q");
        // Her says name whom they mention, or that they mention no one.
        let who = ["@ann:l".to_owned()];
        assert_eq!(
            content("hi ann", None, None, Some(&who))["m.mentions"],
            json!({"user_ids": ["@ann:l"]})
        );
        assert_eq!(
            content("hi", None, None, Some(&[]))["m.mentions"],
            json!({})
        );
        assert!(r.get("m.mentions").is_none());
    }

    #[test]
    fn markdown_is_rendered_beside_its_source_when_it_fits() {
        let c = content("**bold** and `code`", None, Some("$q"), None);
        assert_eq!(c["body"], "**bold** and `code`");
        assert_eq!(c["format"], "org.matrix.custom.html");
        assert_eq!(
            c["formatted_body"],
            "<strong>bold</strong> and <code>code</code>"
        );
        assert_eq!(c["m.relates_to"]["m.in_reply_to"]["event_id"], "$q");
        let list = content("- one\n- two", None, None, None);
        assert_eq!(
            list["formatted_body"],
            "<ul>\n<li>one</li>\n<li>two</li>\n</ul>\n"
        );
        // Plain text stays plain; line breaks alone are no reason for HTML.
        assert_eq!(
            content("just words\non two lines", None, None, None),
            json!({"msgtype": "m.text", "body": "just words\non two lines"})
        );
        // The longest text the mouth sends, all Markdown: too big beside its HTML for one
        // event, so it goes as its source alone.
        let long = "*x* ".repeat(MAX_TEXT_BYTES / 4);
        let c = content(&long, None, None, None);
        assert!(c.get("formatted_body").is_none() && c.get("format").is_none());
        assert_eq!(c["body"], long.as_str());
    }

    #[test]
    fn permanence_decides_rejected_or_failed() {
        assert!(MouthError::NotHerRoom { room: "x".into() }.is_permanent());
        assert!(MouthError::BadSize { bytes: 0, max: 1 }.is_permanent());
        assert!(!MouthError::Exhausted {
            attempts: 6,
            last: String::new()
        }
        .is_permanent());
        assert!(!MouthError::Unauthorized {
            errcode: "M_UNKNOWN_TOKEN".into()
        }
        .is_permanent());
    }
}
