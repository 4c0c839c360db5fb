//! This service's own documents, carried in `cultnet.document_put_raw.v0` with MessagePack map
//! payloads. A client puts a request document whose recordKey is its request id; the gateway
//! answers with the matching receipt document under the same recordKey.
//!
//! | request | receipt |
//! |---|---|
//! | `bifrost.persona_matrix_pending_request.v0` | `bifrost.persona_matrix_pending_page.v0` |
//! | `bifrost.persona_matrix_ack_request.v0` | `bifrost.persona_matrix_ack_receipt.v0` |
//! | `bifrost.persona_matrix_send_request.v0` | `bifrost.persona_matrix_send_receipt.v0` |
//! | `bifrost.persona_session_turn_request.v0` | `bifrost.persona_session_turn_receipt.v0` |
//! | `bifrost.matrix_gateway_status_request.v0` | `bifrost.matrix_gateway_status.v0` |
//! | `bifrost.persona_session_note_request.v0` | `bifrost.persona_session_note_receipt.v0` |
//! | `bifrost.persona_session_control_request.v0` | `bifrost.persona_session_control_receipt.v0` |
//! | `bifrost.persona_reply_extension_pending_request.v0` | `bifrost.persona_reply_extension_page.v0` |
//! | `bifrost.persona_reply_extension_ack_request.v0` | `bifrost.persona_reply_extension_ack_receipt.v0` |
//!
//! The Connect payload of a CultNet client is a [`ConnectPayload`]
//! (`bifrost.matrix_gateway_connect.v0`), signed with the client's pinned ed25519 key.

use ed25519_dalek::{Signature, Signer, SigningKey, Verifier, VerifyingKey};
use serde::{Deserialize, Serialize};

use crate::error::MsgError;
use crate::msg::{self, MutationContract, RawDocument};

/// Schema ids of every document.
pub mod ids {
    /// Page through pending deliveries.
    pub const PENDING_REQUEST: &str = "bifrost.persona_matrix_pending_request.v0";
    /// A page of deliveries.
    pub const PENDING_PAGE: &str = "bifrost.persona_matrix_pending_page.v0";
    /// Acknowledge deliveries through a seq.
    pub const ACK_REQUEST: &str = "bifrost.persona_matrix_ack_request.v0";
    /// Answer to an ack.
    pub const ACK_RECEIPT: &str = "bifrost.persona_matrix_ack_receipt.v0";
    /// Say something in Matrix.
    pub const SEND_REQUEST: &str = "bifrost.persona_matrix_send_request.v0";
    /// Answer to a send.
    pub const SEND_RECEIPT: &str = "bifrost.persona_matrix_send_receipt.v0";
    /// Ask for a session turn now.
    pub const TURN_REQUEST: &str = "bifrost.persona_session_turn_request.v0";
    /// Answer to a turn request.
    pub const TURN_RECEIPT: &str = "bifrost.persona_session_turn_receipt.v0";
    /// Ask for the gateway's status.
    pub const STATUS_REQUEST: &str = "bifrost.matrix_gateway_status_request.v0";
    /// The gateway's status.
    pub const STATUS: &str = "bifrost.matrix_gateway_status.v0";
    /// The signed Connect payload.
    pub const CONNECT: &str = "bifrost.matrix_gateway_connect.v0";
    /// The delivery record shared by pages (a shared contract, not a document).
    pub const DELIVERY: &str = "bifrost.persona_matrix_delivery.v0";
    /// Append a note to her next batch.
    pub const NOTE_REQUEST: &str = "bifrost.persona_session_note_request.v0";
    /// Answer to a note.
    pub const NOTE_RECEIPT: &str = "bifrost.persona_session_note_receipt.v0";
    /// An operator's verb on her session (reset, compact, model, status).
    pub const CONTROL_REQUEST: &str = "bifrost.persona_session_control_request.v0";
    /// Answer to a session verb.
    pub const CONTROL_RECEIPT: &str = "bifrost.persona_session_control_receipt.v0";
    /// Page through her replies' extension fields.
    pub const EXTENSION_PENDING_REQUEST: &str =
        "bifrost.persona_reply_extension_pending_request.v0";
    /// A page of extension fields.
    pub const EXTENSION_PAGE: &str = "bifrost.persona_reply_extension_page.v0";
    /// Acknowledge extension fields through a seq.
    pub const EXTENSION_ACK_REQUEST: &str = "bifrost.persona_reply_extension_ack_request.v0";
    /// Answer to an extension ack.
    pub const EXTENSION_ACK_RECEIPT: &str = "bifrost.persona_reply_extension_ack_receipt.v0";
    /// One extension field of one reply (a shared contract, not a document).
    pub const EXTENSION: &str = "bifrost.persona_reply_extension.v0";
    /// Request -> receipt pairs.
    pub const PAIRS: [(&str, &str); 9] = [
        (PENDING_REQUEST, PENDING_PAGE),
        (ACK_REQUEST, ACK_RECEIPT),
        (SEND_REQUEST, SEND_RECEIPT),
        (TURN_REQUEST, TURN_RECEIPT),
        (STATUS_REQUEST, STATUS),
        (NOTE_REQUEST, NOTE_RECEIPT),
        (CONTROL_REQUEST, CONTROL_RECEIPT),
        (EXTENSION_PENDING_REQUEST, EXTENSION_PAGE),
        (EXTENSION_ACK_REQUEST, EXTENSION_ACK_RECEIPT),
    ];
}

/// `bifrost.persona_matrix_pending_request.v0`: deliveries after `after_seq`, not consumed.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PendingRequest {
    /// Persona id.
    pub persona: String,
    /// Only deliveries with seq greater than this.
    pub after_seq: u64,
    /// At most this many deliveries.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit: Option<u32>,
    /// Keep the page's encoded size near this many bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reply_bytes: Option<u32>,
}

/// One line of context before a delivery.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ContextLine {
    /// Matrix event id.
    pub event_id: String,
    /// Matrix user id.
    pub sender: String,
    /// Display name, when known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sender_name: Option<String>,
    /// Origin server timestamp, ms since the epoch.
    pub ts: i64,
    /// The line's text.
    pub text: String,
}

/// What kind of message a delivery is.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DeliveryKind {
    /// `m.text`.
    #[default]
    Text,
    /// `m.notice`.
    Notice,
    /// `m.emote`.
    Emote,
    /// An image, file, audio or video, with its description as text.
    Media,
    /// A replacement of an earlier event (`edit_of` names it).
    Edit,
    /// A kind a newer gateway knows and this one does not.
    #[serde(other)]
    Unknown,
}

/// A message said to a Persona, as kept in her inbox.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Delivery {
    /// Per-Persona, monotonic, never reused.
    pub seq: u64,
    /// Persona id.
    pub persona: String,
    /// Matrix room id.
    pub room_id: String,
    /// The room's canonical alias, when it has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub room_alias: Option<String>,
    /// Whether the room is a DM.
    pub is_direct: bool,
    /// Matrix event id.
    pub event_id: String,
    /// Matrix user id.
    pub sender: String,
    /// Display name, when known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sender_name: Option<String>,
    /// Origin server timestamp, ms since the epoch.
    pub ts: i64,
    /// Message kind.
    pub kind: DeliveryKind,
    /// The body (for media: its description).
    pub text: String,
    /// Whether she was addressed (mention, her name, or any DM).
    pub to_you: bool,
    /// User ids mentioned.
    #[serde(default)]
    pub mentions: Vec<String>,
    /// Thread root event id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub thread_root: Option<String>,
    /// Event replied to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reply_to: Option<String>,
    /// Event this one edits.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub edit_of: Option<String>,
    /// Set when `text` was cut to fit a page's byte budget.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub truncated: bool,
    /// Earlier lines of the room or thread, oldest first.
    #[serde(default)]
    pub context: Vec<ContextLine>,
}

/// `bifrost.persona_matrix_pending_page.v0`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PendingPage {
    /// Persona id.
    pub persona: String,
    /// In seq order.
    pub deliveries: Vec<Delivery>,
    /// The last seq this page covers (the request's `afterSeq` when empty).
    pub through_seq: u64,
    /// More pending deliveries follow.
    pub more: bool,
    /// Deliveries pending in all.
    pub pending_count: u64,
}

/// `bifrost.persona_matrix_ack_request.v0`: everything through `through_seq` is handled.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AckRequest {
    /// Persona id.
    pub persona: String,
    /// Acknowledge every delivery with seq <= this.
    pub through_seq: u64,
}

/// Outcome of a request.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    /// Done (for a send: the event exists in Matrix).
    #[default]
    Ok,
    /// Refused for good (bad input, not allowed); retrying the same request will not help.
    Rejected,
    /// Could not be done now (homeserver down, retries exhausted); may be retried.
    Failed,
    /// A status a newer gateway knows and this one does not.
    #[serde(other)]
    Unknown,
}

/// `bifrost.persona_matrix_ack_receipt.v0`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AckReceipt {
    /// Persona id.
    pub persona: String,
    /// Outcome.
    pub status: Status,
    /// Acknowledged through this seq.
    pub through_seq: u64,
    /// Deliveries still pending.
    pub pending_count: u64,
    /// Why, when not ok.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// `bifrost.persona_matrix_send_request.v0`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SendRequest {
    /// Caller's id; a repeat returns the first receipt and sends nothing.
    pub request_id: String,
    /// Persona id.
    pub persona: String,
    /// Room alias or id.
    pub room: String,
    /// Message body.
    pub text: String,
    /// Thread root event id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub thread_root: Option<String>,
    /// Event to reply to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reply_to: Option<String>,
}

/// `bifrost.persona_matrix_send_receipt.v0`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SendReceipt {
    /// The request's id.
    pub request_id: String,
    /// Outcome.
    pub status: Status,
    /// The Matrix event, when sent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub event_id: Option<String>,
    /// The resolved room id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub room_id: Option<String>,
    /// Why, when not ok (with the Matrix errcode when there is one).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// `bifrost.persona_session_turn_request.v0`: run a session turn for the Persona now.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TurnRequest {
    /// Persona id.
    pub persona: String,
    /// Why, for the log.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// `bifrost.persona_session_turn_receipt.v0`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TurnReceipt {
    /// Persona id.
    pub persona: String,
    /// Outcome (ok = a turn was started or queued).
    pub status: Status,
    /// Seqs the turn covers, when known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub through_seq: Option<u64>,
    /// Why, when not ok.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// `bifrost.matrix_gateway_status_request.v0`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct StatusRequest {
    /// Only this Persona (all allowed ones when absent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub persona: Option<String>,
}

/// One Persona's line in the status.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PersonaStatus {
    /// Persona id.
    pub persona: String,
    /// Her Matrix user id.
    pub user_id: String,
    /// `syncing`, `held` (max pending), `backoff`, `stopped`, `token_rejected`, ...
    pub sync_state: String,
    /// Deliveries pending.
    pub pending_count: u64,
    /// Highest seq assigned.
    pub highest_seq: u64,
    /// Acknowledged through.
    pub acked_through: u64,
    /// Last error, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
}

/// `bifrost.matrix_gateway_status.v0`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct GatewayStatus {
    /// This gateway's runtime id.
    pub runtime_id: String,
    /// Its version.
    pub version: String,
    /// RFC 3339.
    pub started_at: String,
    /// Connected CultNet peers.
    pub peers: u32,
    /// Per Persona.
    pub personas: Vec<PersonaStatus>,
}

/// Note kinds where a newer note replaces the older one: only the latest counts, and a fresh
/// session is given the latest of each.
pub const REPLACING_NOTE_KINDS: [&str; 4] = ["state", "campaigns", "spend", "runs"];
/// Note kinds the gateway writes itself (a restart, a correction after a bad reply, a retry,
/// a checkpoint before a compaction): a client's note may not use them, so no note from
/// CultNet can pass for the gateway's own.
pub const RESERVED_NOTE_KINDS: [&str; 5] =
    ["restart", "correction", "retry", "checkpoint", "set_aside"];
/// The most bytes of text one note may carry.
pub const MAX_NOTE_BYTES: usize = 16 * 1024;
/// The longest note id or kind.
pub const MAX_NOTE_ID: usize = 128;

/// `bifrost.persona_session_note_request.v0`: a note for her next batch (her state, campaigns,
/// spend, runs, or anything her Minds want her to know). Idempotent by `note_id`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NoteRequest {
    /// Persona id.
    pub persona: String,
    /// Caller's id; a repeat is answered `ok` with `duplicate` and shown once.
    pub note_id: String,
    /// `state`, `campaigns`, `spend`, `runs` (each replaces the previous of its kind), or any
    /// other short name (appended).
    pub kind: String,
    /// The note, at most [`MAX_NOTE_BYTES`].
    pub text: String,
    /// Give her a turn for this note alone (otherwise it waits for her next batch).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub wake: bool,
}

impl NoteRequest {
    /// Why the note is refused, when it is: an empty or overlong id or kind, a kind that is
    /// not a plain name or is one of the gateway's own, an empty or oversized text.
    pub fn check(&self) -> Result<(), String> {
        if self.note_id.trim().is_empty() || self.note_id.len() > MAX_NOTE_ID {
            return Err(format!(
                "noteId must be 1 to {MAX_NOTE_ID} bytes (it makes the note idempotent)"
            ));
        }
        let plain = |c: char| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_' || c == '-';
        if self.kind.is_empty() || self.kind.len() > 32 || !self.kind.chars().all(plain) {
            return Err(format!(
                "kind {:?} must be 1 to 32 of a-z, 0-9, _ and -",
                self.kind
            ));
        }
        if RESERVED_NOTE_KINDS.contains(&self.kind.as_str()) {
            return Err(format!(
                "kind {:?} is the gateway's own (reserved: {}); name the note another kind",
                self.kind,
                RESERVED_NOTE_KINDS.join(", ")
            ));
        }
        if self.text.trim().is_empty() {
            return Err("the note's text is empty".into());
        }
        if self.text.len() > MAX_NOTE_BYTES {
            return Err(format!(
                "the note is {} bytes; at most {MAX_NOTE_BYTES} are taken (send a summary, or \
                 split it into notes of other kinds)",
                self.text.len()
            ));
        }
        Ok(())
    }

    /// Whether a newer note of this kind replaces this one.
    pub fn replacing(&self) -> bool {
        REPLACING_NOTE_KINDS.contains(&self.kind.as_str())
    }
}

/// `bifrost.persona_session_note_receipt.v0`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NoteReceipt {
    /// Persona id.
    pub persona: String,
    /// The note's id.
    pub note_id: String,
    /// Outcome (ok = stored durably; she sees it with her next batch).
    pub status: Status,
    /// The note was stored before (this repeat changed nothing).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub duplicate: bool,
    /// Notes waiting for her next batch, this one included.
    pub pending_notes: u64,
    /// Why, when not ok.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// What an operator asks of her session.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ControlAction {
    /// Report her session (id, generation, model, turns).
    #[default]
    Status,
    /// Start a fresh session at the next turn boundary (the old one stays resumable on disk).
    Reset,
    /// Compact her conversation (the CLI's `/compact`) at the next turn boundary.
    Compact,
    /// Switch to `model` (a fresh session: the cache is per model); kept across restarts.
    Model,
    /// Put the batch set aside as `batch` back into her mail (after what is pending).
    Retry,
    /// Drop the batch set aside as `batch` for good.
    Drop,
    /// An action a newer gateway knows and this one does not.
    #[serde(other)]
    Unknown,
}

/// `bifrost.persona_session_control_request.v0`: applied at her next turn boundary, never
/// during a turn; the receipt comes once it is applied.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ControlRequest {
    /// Persona id.
    pub persona: String,
    /// What to do.
    pub action: ControlAction,
    /// The model, for `model`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// The set-aside batch (its id), for `retry` and `drop`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub batch: Option<u64>,
}

/// A batch set aside because the model API kept refusing it (or it kept failing): kept, out of
/// her mail, until her operator retries or drops it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SetAsideBatch {
    /// Its id (the first seq it had), for `retry` and `drop`.
    pub batch: u64,
    /// Its messages.
    pub messages: u64,
    /// Why it was set aside.
    pub why: String,
    /// When (ms since the epoch).
    pub at_ms: i64,
}

/// `bifrost.persona_session_control_receipt.v0`: her session after the action.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ControlReceipt {
    /// Persona id.
    pub persona: String,
    /// The action.
    pub action: ControlAction,
    /// Outcome.
    pub status: Status,
    /// Her session id (absent until the next turn after a reset or a model switch).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session_id: Option<String>,
    /// The session before a reset or model switch (still resumable by this id).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub previous_session_id: Option<String>,
    /// Session generation (one more per fresh start).
    pub generation: u64,
    /// Her model.
    pub model: String,
    /// Turns taken in all.
    pub turns_total: u64,
    /// Prompt tokens of her last turn (what a compaction shrinks).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefix_tokens: Option<u64>,
    /// Her batches set aside, oldest first.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub set_aside: Vec<SetAsideBatch>,
    /// Why, when not ok.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// `bifrost.persona_reply_extension.v0`: one extension field of one of her replies, kept in a
/// durable outbox until a client acknowledges it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ReplyExtension {
    /// Per-Persona outbox seq: monotonic, never reused.
    pub seq: u64,
    /// Persona id.
    pub persona: String,
    /// The turn that produced it (stable across retries of that turn).
    pub turn_id: String,
    /// The reply's top-level field (e.g. `start_self_run`, `remember`).
    pub field: String,
    /// Its value, as she gave it.
    pub value: serde_json::Value,
}

/// `bifrost.persona_reply_extension_pending_request.v0`: extension fields after `after_seq`,
/// not consumed.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ExtensionPendingRequest {
    /// Persona id.
    pub persona: String,
    /// Only fields with seq greater than this.
    pub after_seq: u64,
    /// At most this many.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit: Option<u32>,
}

/// `bifrost.persona_reply_extension_page.v0`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ExtensionPage {
    /// Persona id.
    pub persona: String,
    /// In seq order.
    pub extensions: Vec<ReplyExtension>,
    /// The last seq this page covers (the request's `afterSeq` when empty).
    pub through_seq: u64,
    /// More follow.
    pub more: bool,
    /// Extension fields pending in all.
    pub pending_count: u64,
}

/// `bifrost.persona_reply_extension_ack_request.v0`: everything through `through_seq` is
/// handled.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ExtensionAckRequest {
    /// Persona id.
    pub persona: String,
    /// Acknowledge every field with seq <= this.
    pub through_seq: u64,
}

/// `bifrost.persona_reply_extension_ack_receipt.v0`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ExtensionAckReceipt {
    /// Persona id.
    pub persona: String,
    /// Outcome.
    pub status: Status,
    /// Acknowledged through this seq.
    pub through_seq: u64,
    /// Fields still pending.
    pub pending_count: u64,
    /// Why, when not ok.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// A request document, decoded.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Request {
    /// Pending page.
    Pending(PendingRequest),
    /// Ack.
    Ack(AckRequest),
    /// Send.
    Send(SendRequest),
    /// Turn.
    Turn(TurnRequest),
    /// Status.
    Status(StatusRequest),
    /// A note for her next batch.
    Note(NoteRequest),
    /// A verb on her session.
    Control(ControlRequest),
    /// Page through her replies' extension fields.
    ExtensionPending(ExtensionPendingRequest),
    /// Acknowledge extension fields.
    ExtensionAck(ExtensionAckRequest),
}

impl Request {
    /// Decodes the request a raw document carries; an unknown schema id is
    /// [`MsgError::UnknownSchemaVersion`] naming it.
    pub fn from_document(doc: &RawDocument) -> Result<Self, MsgError> {
        Ok(match doc.schema_id.as_str() {
            ids::PENDING_REQUEST => Self::Pending(doc.payload_as()?),
            ids::ACK_REQUEST => Self::Ack(doc.payload_as()?),
            ids::SEND_REQUEST => Self::Send(doc.payload_as()?),
            ids::TURN_REQUEST => Self::Turn(doc.payload_as()?),
            ids::STATUS_REQUEST => Self::Status(doc.payload_as()?),
            ids::NOTE_REQUEST => Self::Note(doc.payload_as()?),
            ids::CONTROL_REQUEST => Self::Control(doc.payload_as()?),
            ids::EXTENSION_PENDING_REQUEST => Self::ExtensionPending(doc.payload_as()?),
            ids::EXTENSION_ACK_REQUEST => Self::ExtensionAck(doc.payload_as()?),
            other => return Err(MsgError::UnknownSchemaVersion(other.to_owned())),
        })
    }

    /// The schema id of the receipt that answers it.
    pub fn receipt_schema(&self) -> &'static str {
        match self {
            Self::Pending(_) => ids::PENDING_PAGE,
            Self::Ack(_) => ids::ACK_RECEIPT,
            Self::Send(_) => ids::SEND_RECEIPT,
            Self::Turn(_) => ids::TURN_RECEIPT,
            Self::Status(_) => ids::STATUS,
            Self::Note(_) => ids::NOTE_RECEIPT,
            Self::Control(_) => ids::CONTROL_RECEIPT,
            Self::ExtensionPending(_) => ids::EXTENSION_PAGE,
            Self::ExtensionAck(_) => ids::EXTENSION_ACK_RECEIPT,
        }
    }

    /// The Persona it concerns (`None` for a status request over all).
    pub fn persona(&self) -> Option<&str> {
        match self {
            Self::Pending(r) => Some(&r.persona),
            Self::Ack(r) => Some(&r.persona),
            Self::Send(r) => Some(&r.persona),
            Self::Turn(r) => Some(&r.persona),
            Self::Status(r) => r.persona.as_deref(),
            Self::Note(r) => Some(&r.persona),
            Self::Control(r) => Some(&r.persona),
            Self::ExtensionPending(r) => Some(&r.persona),
            Self::ExtensionAck(r) => Some(&r.persona),
        }
    }
}

/// The authority the gateway's mutation contracts name: the runtime itself decides.
pub const MUTATION_AUTHORITY: &str = "runtime";

/// The hello's `supportedMutationContracts`: every request this gateway accepts and the
/// receipt that answers it.
pub fn mutation_contracts() -> Vec<MutationContract> {
    ids::PAIRS
        .iter()
        .map(|(req, receipt)| MutationContract {
            document_type: (*req).to_owned(),
            payload_schema_version: Some("v0".to_owned()),
            operations: Some(vec!["documentPut".to_owned(), "receiptWatch".to_owned()]),
            // The published contracts allow `readOnly`, `localUser`, `coordinator`, `runtime`
            // and `denied`: the gateway is the runtime that decides each request and answers
            // it with its receipt.
            authority: Some(MUTATION_AUTHORITY.to_owned()),
            intent_document_types: Some(vec![(*req).to_owned()]),
            receipt_document_types: Some(vec![(*receipt).to_owned()]),
        })
        .collect()
}

/// The gateway's hello.
pub fn gateway_hello(runtime_id: &str) -> msg::Hello {
    let mut types: Vec<String> = ids::PAIRS
        .iter()
        .flat_map(|(a, b)| [(*a).to_owned(), (*b).to_owned()])
        .collect();
    types.push(ids::CONNECT.to_owned());
    msg::Hello {
        runtime_id: runtime_id.to_owned(),
        runtime_kind: "cultnet-matrix-gateway".to_owned(),
        role: Some("matrix_gateway".to_owned()),
        display_name: Some("CultNet Matrix gateway".to_owned()),
        supported_document_types: Some(types),
        supported_mutation_contracts: Some(mutation_contracts()),
        supported_message_versions: Some(
            msg::versions::ALL.iter().map(|s| (*s).to_owned()).collect(),
        ),
        supports_schema_catalog: Some(true),
        ..msg::Hello::default()
    }
}

/// Domain separator of the server's proof in its Accept.
pub const ACCEPT_DOMAIN: &[u8] = b"bifrost.matrix_gateway_accept.v0\0";

/// The server's proof in its Accept payload: its ed25519 public key and its signature over
/// [`ACCEPT_DOMAIN`], the connection id and the SHA-256 of the client's Connect payload as sent.
/// A client that pinned the gateway's key knows from it that the gateway answered, not
/// whoever held its port (a client that did not pin it may ignore the payload, as the public
/// runtimes do).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ServerProof {
    /// The server's public key.
    #[serde(with = "serde_bytes")]
    pub server_key: Vec<u8>,
    /// Its signature.
    #[serde(with = "serde_bytes")]
    pub signature: Vec<u8>,
}

impl ServerProof {
    fn signed_bytes(connection_id: u32, connect_payload: &[u8]) -> Vec<u8> {
        use sha2::Digest;
        let mut b = Vec::with_capacity(ACCEPT_DOMAIN.len() + 4 + 32);
        b.extend_from_slice(ACCEPT_DOMAIN);
        b.extend_from_slice(&connection_id.to_be_bytes());
        b.extend_from_slice(&sha2::Sha256::digest(connect_payload));
        b
    }

    /// The proof of `key` for the Connect payload `connect_payload`.
    pub fn sign(key: &SigningKey, connection_id: u32, connect_payload: &[u8]) -> Self {
        Self {
            server_key: key.verifying_key().as_bytes().to_vec(),
            signature: key
                .sign(&Self::signed_bytes(connection_id, connect_payload))
                .to_bytes()
                .to_vec(),
        }
    }

    /// Encodes it as the Accept payload.
    pub fn encode(&self) -> Vec<u8> {
        msg::encode_named(self)
    }

    /// Checks an Accept payload against the pinned server key, for the Connect payload sent.
    pub fn verify(
        accept_payload: &[u8],
        pinned: &VerifyingKey,
        connection_id: u32,
        connect_payload: &[u8],
    ) -> Result<(), AuthError> {
        let p: Self = rmp_serde::from_slice(accept_payload).map_err(|e| {
            AuthError::Malformed(format!("the Accept carries no server proof: {e}"))
        })?;
        if p.server_key.as_slice() != pinned.as_bytes() {
            return Err(AuthError::BadSignature(
                "the server's key is not the one pinned".into(),
            ));
        }
        let sig: [u8; 64] = p
            .signature
            .as_slice()
            .try_into()
            .map_err(|_| AuthError::Malformed("server signature is not 64 bytes".into()))?;
        pinned
            .verify(
                &Self::signed_bytes(connection_id, connect_payload),
                &Signature::from_bytes(&sig),
            )
            .map_err(|_| AuthError::BadSignature("the server's proof does not verify".into()))
    }
}

/// Domain separator of the Connect signature.
pub const CONNECT_DOMAIN: &[u8] = b"bifrost.matrix_gateway_connect.v0\0";
/// Longest agent id or nonce accepted in a Connect payload.
pub const MAX_CONNECT_FIELD: usize = 256;

/// `bifrost.matrix_gateway_connect.v0`: a CultNet client's credentials, sent as its Connect
/// payload (a MessagePack map). The signature is ed25519 over [`ConnectPayload::signed_bytes`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ConnectPayload {
    /// Who the client says it is; the gateway looks its pinned key up by this.
    pub agent_id: String,
    /// When it was signed, ms since the epoch.
    pub issued_at: u64,
    /// Random, unique per Connect (replay protection).
    pub nonce: String,
    /// 64-byte ed25519 signature.
    #[serde(with = "serde_bytes")]
    pub signature: Vec<u8>,
}

/// Why a Connect payload was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum AuthError {
    /// Not a connect payload.
    #[error("malformed connect payload: {0}")]
    Malformed(String),
    /// The signature does not verify under the pinned key.
    #[error("signature does not verify for agent {0:?}")]
    BadSignature(String),
    /// `issuedAt` is too far from now.
    #[error("connect payload issued {skew_ms} ms away from now (allowed {max_ms} ms)")]
    Stale {
        /// |now - issuedAt|.
        skew_ms: u64,
        /// Allowed skew.
        max_ms: u64,
    },
}

impl ConnectPayload {
    /// The bytes signed: the domain separator, the connection id, then each field with its
    /// length, so no two field values can produce the same string.
    pub fn signed_bytes(
        connection_id: u32,
        agent_id: &str,
        issued_at: u64,
        nonce: &str,
    ) -> Vec<u8> {
        let mut b = Vec::with_capacity(CONNECT_DOMAIN.len() + 24 + agent_id.len() + nonce.len());
        b.extend_from_slice(CONNECT_DOMAIN);
        b.extend_from_slice(&connection_id.to_be_bytes());
        b.extend_from_slice(&(agent_id.len() as u32).to_be_bytes());
        b.extend_from_slice(agent_id.as_bytes());
        b.extend_from_slice(&issued_at.to_be_bytes());
        b.extend_from_slice(&(nonce.len() as u32).to_be_bytes());
        b.extend_from_slice(nonce.as_bytes());
        b
    }

    /// Signs a new payload.
    pub fn sign(
        key: &SigningKey,
        connection_id: u32,
        agent_id: &str,
        issued_at: u64,
        nonce: &str,
    ) -> Self {
        let sig = key.sign(&Self::signed_bytes(
            connection_id,
            agent_id,
            issued_at,
            nonce,
        ));
        Self {
            agent_id: agent_id.to_owned(),
            issued_at,
            nonce: nonce.to_owned(),
            signature: sig.to_bytes().to_vec(),
        }
    }

    /// Encodes it as the Connect payload.
    pub fn encode(&self) -> Vec<u8> {
        msg::encode_named(self)
    }

    /// Decodes a Connect payload.
    pub fn decode(bytes: &[u8]) -> Result<Self, AuthError> {
        msg::read_one_ref(bytes).map_err(|e| AuthError::Malformed(e.to_string()))?;
        let p: Self =
            rmp_serde::from_slice(bytes).map_err(|e| AuthError::Malformed(e.to_string()))?;
        if p.agent_id.is_empty()
            || p.agent_id.len() > MAX_CONNECT_FIELD
            || p.nonce.len() > MAX_CONNECT_FIELD
        {
            return Err(AuthError::Malformed(
                "agentId or nonce empty or too long".into(),
            ));
        }
        if p.signature.len() != 64 {
            return Err(AuthError::Malformed(format!(
                "signature is {} bytes, not 64",
                p.signature.len()
            )));
        }
        Ok(p)
    }

    /// Verifies the signature under `key` and that `issuedAt` is within `max_skew_ms` of
    /// `now_ms`. Replay of a nonce is the caller's to track.
    pub fn verify(
        &self,
        key: &VerifyingKey,
        connection_id: u32,
        now_ms: u64,
        max_skew_ms: u64,
    ) -> Result<(), AuthError> {
        let sig_bytes: [u8; 64] = self
            .signature
            .as_slice()
            .try_into()
            .map_err(|_| AuthError::Malformed("signature is not 64 bytes".into()))?;
        let sig = Signature::from_bytes(&sig_bytes);
        key.verify(
            &Self::signed_bytes(connection_id, &self.agent_id, self.issued_at, &self.nonce),
            &sig,
        )
        .map_err(|_| AuthError::BadSignature(self.agent_id.clone()))?;
        let skew = now_ms.abs_diff(self.issued_at);
        if skew > max_skew_ms {
            return Err(AuthError::Stale {
                skew_ms: skew,
                max_ms: max_skew_ms,
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod server_proof_tests {
    use super::*;

    #[test]
    fn a_server_proof_verifies_only_under_its_key_and_for_its_connect() {
        let server = SigningKey::from_bytes(&[5; 32]);
        let connect = b"the client's connect payload";
        let proof = ServerProof::sign(&server, 7, connect).encode();
        assert_eq!(
            ServerProof::verify(&proof, &server.verifying_key(), 7, connect),
            Ok(())
        );
        let other = SigningKey::from_bytes(&[6; 32]).verifying_key();
        assert!(ServerProof::verify(&proof, &other, 7, connect).is_err());
        assert!(ServerProof::verify(&proof, &server.verifying_key(), 8, connect).is_err());
        assert!(ServerProof::verify(&proof, &server.verifying_key(), 7, b"another").is_err());
        assert!(ServerProof::verify(b"", &server.verifying_key(), 7, connect).is_err());
        // Whoever replays a captured proof to a new Connect is found out.
        let forged = ServerProof {
            server_key: server.verifying_key().as_bytes().to_vec(),
            signature: vec![0; 64],
        }
        .encode();
        assert!(ServerProof::verify(&forged, &server.verifying_key(), 7, connect).is_err());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::msg::{Message, Put};

    #[test]
    fn connect_sign_verify() {
        let key = SigningKey::from_bytes(&[7; 32]);
        let p = ConnectPayload::sign(&key, 0xE91F_0004, "organ-1", 1_000, "n1");
        let back = ConnectPayload::decode(&p.encode()).unwrap();
        assert_eq!(back, p);
        back.verify(&key.verifying_key(), 0xE91F_0004, 1_500, 1_000)
            .unwrap();
        // Another service's connection id, another key, a tampered field, a stale time.
        assert!(matches!(
            back.verify(&key.verifying_key(), 0xE91F_0003, 1_500, 1_000),
            Err(AuthError::BadSignature(_))
        ));
        let other = SigningKey::from_bytes(&[8; 32]).verifying_key();
        assert!(matches!(
            back.verify(&other, 0xE91F_0004, 1_500, 1_000),
            Err(AuthError::BadSignature(_))
        ));
        let mut t = back.clone();
        t.nonce = "n2".into();
        assert!(matches!(
            t.verify(&key.verifying_key(), 0xE91F_0004, 1_500, 1_000),
            Err(AuthError::BadSignature(_))
        ));
        assert_eq!(
            back.verify(&key.verifying_key(), 0xE91F_0004, 10_000, 1_000),
            Err(AuthError::Stale {
                skew_ms: 9_000,
                max_ms: 1_000
            })
        );
        assert!(matches!(
            ConnectPayload::decode(b"join"),
            Err(AuthError::Malformed(_))
        ));
    }

    #[test]
    fn field_boundaries_are_unambiguous() {
        assert_ne!(
            ConnectPayload::signed_bytes(1, "ab", 5, "c"),
            ConnectPayload::signed_bytes(1, "a", 5, "bc")
        );
    }

    #[test]
    fn request_documents_roundtrip_through_document_put_raw() {
        let send = SendRequest {
            request_id: "r-1".into(),
            persona: "ada".into(),
            room: "#lobby:localhost".into(),
            text: "/clear is just text".into(),
            thread_root: Some("$root".into()),
            reply_to: None,
        };
        let doc =
            RawDocument::from_payload(ids::SEND_REQUEST, "r-1", "2026-12-02T00:00:00Z", &send);
        let bytes = Message::DocumentPutRaw(Put {
            message_id: "m".into(),
            document: doc,
        })
        .encode();
        let Message::DocumentPutRaw(put) = Message::decode(&bytes).unwrap() else {
            panic!()
        };
        let req = Request::from_document(&put.document).unwrap();
        assert_eq!(req, Request::Send(send));
        assert_eq!(req.receipt_schema(), ids::SEND_RECEIPT);
        assert_eq!(req.persona(), Some("ada"));
        let mut unknown = put.document.clone();
        unknown.schema_id = "bifrost.nope.v0".into();
        assert_eq!(
            Request::from_document(&unknown),
            Err(MsgError::UnknownSchemaVersion("bifrost.nope.v0".into()))
        );
        let mut wrong = put.document;
        wrong.schema_id = ids::ACK_REQUEST.into();
        assert!(matches!(
            Request::from_document(&wrong),
            Err(MsgError::Invalid { .. })
        ));
    }

    #[test]
    fn unknown_status_and_kind_are_tolerated() {
        let v = rmpv::Value::Map(vec![
            ("requestId".into(), "r".into()),
            ("status".into(), "queued_for_later".into()),
        ]);
        let mut b = Vec::new();
        rmpv::encode::write_value(&mut b, &v).unwrap();
        let r: SendReceipt = rmp_serde::from_slice(&b).unwrap();
        assert_eq!(r.status, Status::Unknown);
    }

    #[test]
    fn hello_advertises_every_pair() {
        let h = gateway_hello("gw-1");
        let contracts = h.supported_mutation_contracts.clone().unwrap();
        assert_eq!(contracts.len(), ids::PAIRS.len());
        for (req, receipt) in ids::PAIRS {
            let c = contracts.iter().find(|c| c.document_type == req).unwrap();
            assert_eq!(c.receipt_document_types, Some(vec![receipt.to_owned()]));
        }
        let back = Message::decode(&Message::Hello(h.clone()).encode()).unwrap();
        assert_eq!(back, Message::Hello(h));
    }

    #[test]
    fn notes_are_checked_and_extensions_keep_any_json_value() {
        let ok = NoteRequest {
            persona: "ada".into(),
            note_id: "n-1".into(),
            kind: "state".into(),
            text: "mood: calm".into(),
            wake: false,
        };
        assert_eq!(ok.check(), Ok(()));
        assert!(ok.replacing());
        let other = NoteRequest {
            kind: "heads-up".into(),
            ..ok.clone()
        };
        assert_eq!(other.check(), Ok(()));
        assert!(!other.replacing());
        let big = NoteRequest {
            text: "x".repeat(MAX_NOTE_BYTES + 1),
            ..ok.clone()
        };
        assert!(big.check().unwrap_err().contains("16385 bytes"));
        assert!(NoteRequest {
            text: "x".repeat(MAX_NOTE_BYTES),
            ..ok.clone()
        }
        .check()
        .is_ok());
        for bad_kind in ["", "State", "a b", "## notes", &"k".repeat(33)] {
            let n = NoteRequest {
                kind: bad_kind.into(),
                ..ok.clone()
            };
            assert!(n.check().is_err(), "{bad_kind:?} passed");
        }
        // The gateway's own kinds are refused, with the reason.
        for reserved in RESERVED_NOTE_KINDS {
            let n = NoteRequest {
                kind: reserved.into(),
                ..ok.clone()
            };
            assert!(
                n.check().unwrap_err().contains("the gateway's own"),
                "{reserved}"
            );
        }
        for bad_id in ["", " ", &"i".repeat(MAX_NOTE_ID + 1)] {
            let n = NoteRequest {
                note_id: bad_id.into(),
                ..ok.clone()
            };
            assert!(n.check().unwrap_err().contains("noteId"));
        }
        assert!(NoteRequest {
            text: "  ".into(),
            ..ok.clone()
        }
        .check()
        .is_err());

        let ext = ReplyExtension {
            seq: 3,
            persona: "ada".into(),
            turn_id: "turn:ada:1-2".into(),
            field: "remember".into(),
            value: serde_json::json!([{"text": "x", "weight": 0.5, "n": -3, "ok": true, "z": null}]),
        };
        let bytes = rmp_serde::to_vec_named(&ext).unwrap();
        let back: ReplyExtension = rmp_serde::from_slice(&bytes).unwrap();
        assert_eq!(back, ext);
        let c: ControlRequest = rmp_serde::from_slice(
            &rmp_serde::to_vec_named(&serde_json::json!({"persona": "ada", "action": "explode"}))
                .unwrap(),
        )
        .unwrap();
        assert_eq!(c.action, ControlAction::Unknown);
    }
}
