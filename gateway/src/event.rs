//! Matrix room events -> deliveries and context lines: pure functions over the event JSON, so
//! every rule is tested without a homeserver (the ear feeds them what the SDK decrypted).
//!
//! Only `m.room.message` events become mail. Rules:
//! - kind: `m.text`, `m.notice`, `m.emote`; images, files, audio and video are `media` with
//!   their description (body, or the file name) as text; an `m.replace` relation is an `edit`
//!   of the event it names, carrying the new text.
//! - `toYou`: any message in a DM; an `m.mentions` naming her (or `room: true`); her display
//!   name or localpart in the body as a word.
//! - thread root from an `m.thread` relation; reply-to from `m.in_reply_to` (a thread's
//!   fallback reply is not a reply); the quoted fallback of a reply is cut from the text.
//! - her own events and redacted (bodiless) events are not mail.
//! - a reaction is a context line (`reacted "KEY" to ^handle`); mail only when one of her
//!   operators reacts to a line of hers.

use serde_json::Value;
use wire::docs::{ContextLine, Delivery, DeliveryKind};

/// Who she is, for `toYou` and for skipping her own events.
#[derive(Debug, Clone)]
pub struct Me {
    /// Her user id.
    pub user_id: String,
    /// Her display name, when set (matched case-insensitively as a word).
    pub display_name: Option<String>,
}

impl Me {
    fn localpart(&self) -> &str {
        self.user_id
            .trim_start_matches('@')
            .split(':')
            .next()
            .unwrap_or_default()
    }
}

/// What the ear knows of the room an event came from.
#[derive(Debug, Clone, Default)]
pub struct RoomInfo {
    /// Room id.
    pub room_id: String,
    /// Canonical alias, when set.
    pub alias: Option<String>,
    /// A DM.
    pub is_direct: bool,
}

/// Placeholder text for an event that could not be decrypted (it is delivered, counted and
/// logged, never dropped silently).
pub const UNDECRYPTABLE: &str = "(this message could not be decrypted)";

/// Whether an event sent at `event_ts` (ms since the epoch, the homeserver's) was written
/// before her device was made at `device_created_ms`: its room key was then shared with no
/// device of hers, and waiting for it cannot help. (The event's time is the homeserver's clock,
/// the device's the gateway's: with clocks apart by more than a line's round trip, a line
/// written in her first seconds could be taken for an earlier one.)
pub fn predates(event_ts: i64, device_created_ms: i64) -> bool {
    event_ts > 0 && event_ts < device_created_ms
}

/// Cuts `text` to at most `max_bytes`, at a character boundary; returns its new length.
pub fn truncate_text(text: &mut String, max_bytes: usize) -> usize {
    let at = (0..=max_bytes.min(text.len()))
        .rev()
        .find(|&i| text.is_char_boundary(i))
        .unwrap_or(0);
    text.truncate(at);
    at
}

/// What stands in for a message deleted (redacted) before she read it: in her pending mail,
/// its context lines and her rooms' timelines, so a deleted line never reaches the model.
pub const DELETED: &str = "(this message was deleted)";

/// The event an `m.room.redaction` removes: `content.redacts` from room version 11,
/// top-level `redacts` before.
pub fn redacts(ev: &Value) -> Option<&str> {
    if str_at(ev, &["type"])? != "m.room.redaction" {
        return None;
    }
    str_at(ev, &["content", "redacts"]).or_else(|| str_at(ev, &["redacts"]))
}

/// Whether a redaction by `redacter` of a line by `author` (when known) counts: her own line's
/// author may delete it, anyone else only with the power to redact others' lines
/// (`may_redact_others`, from the room's power levels). A homeserver of another member could
/// hand her any redaction; one that does not count leaves the line as it was.
pub fn redaction_counts(redacter: &str, author: Option<&str>, may_redact_others: bool) -> bool {
    author == Some(redacter) || may_redact_others
}

/// Who invited her, from an invite's stripped state (`events`, raw JSON): the sender of the one
/// `m.room.member` event for her (`me`) with membership `invite`. None when there is none, or
/// when the stripped state (which the inviting server writes) holds several that disagree.
pub fn inviter<'a>(events: impl IntoIterator<Item = &'a Value>, me: &str) -> Option<&'a str> {
    let mut found: Option<&str> = None;
    for v in events {
        let mine = str_at(v, &["type"]) == Some("m.room.member")
            && str_at(v, &["state_key"]) == Some(me)
            && str_at(v, &["content", "membership"]) == Some("invite");
        if !mine {
            continue;
        }
        let sender = str_at(v, &["sender"])?;
        match found {
            Some(f) if f != sender => return None,
            _ => found = Some(sender),
        }
    }
    found
}

fn str_at<'a>(v: &'a Value, path: &[&str]) -> Option<&'a str> {
    let mut cur = v;
    for p in path {
        cur = cur.get(p)?;
    }
    cur.as_str()
}

/// Drops the `> ` quoted fallback lines a reply's body begins with.
fn strip_reply_fallback(body: &str) -> &str {
    if !body.starts_with("> ") {
        return body;
    }
    let mut rest = body;
    while rest.starts_with('>') {
        match rest.split_once('\n') {
            Some((_, tail)) => rest = tail,
            None => return "",
        }
    }
    rest.trim_start_matches('\n')
}

/// The text a message shows: for edits the new content, for replies without their fallback,
/// for media the description.
fn message_text(content: &Value) -> Option<(DeliveryKind, String)> {
    let (kind, shown) = match str_at(content, &["m.relates_to", "rel_type"]) {
        Some("m.replace") => (
            DeliveryKind::Edit,
            content.get("m.new_content").unwrap_or(content),
        ),
        _ => (DeliveryKind::Text, content),
    };
    let body = str_at(shown, &["body"])?;
    let msgtype = str_at(shown, &["msgtype"]).unwrap_or("m.text");
    let kind = match (kind, msgtype) {
        (DeliveryKind::Edit, _) => DeliveryKind::Edit,
        (_, "m.text") => DeliveryKind::Text,
        (_, "m.notice") => DeliveryKind::Notice,
        (_, "m.emote") => DeliveryKind::Emote,
        (_, "m.image" | "m.file" | "m.audio" | "m.video") => DeliveryKind::Media,
        _ => DeliveryKind::Unknown,
    };
    let text = if kind == DeliveryKind::Media {
        // A file name is a field, not a body: one line, escaped and capped
        // (`session::untrusted`), so it cannot close its brackets early or run on.
        let file = str_at(shown, &["filename"]).unwrap_or(body);
        let name = session::untrusted::field(file, session::untrusted::MAX_FILE_NAME_CHARS);
        let about = media_info(shown.get("info"));
        if file != body {
            format!("[{msgtype} {name}{about}] {body}")
        } else {
            format!("[{msgtype}{about}] {name}")
        }
    } else if content.pointer("/m.relates_to/m.in_reply_to").is_some() {
        strip_reply_fallback(body).to_owned()
    } else {
        body.to_owned()
    };
    Some((kind, text))
}

/// A media event's `info` as she reads it: `, TYPE, SIZE` and for audio and video `, M:SS`
/// (each part only when given); the type is a field (one line, escaped, capped).
fn media_info(info: Option<&Value>) -> String {
    let Some(info) = info else {
        return String::new();
    };
    let mut out = String::new();
    if let Some(t) = info.get("mimetype").and_then(Value::as_str) {
        out.push_str(", ");
        out.push_str(&session::untrusted::field(t, 64));
    }
    if let Some(size) = info.get("size").and_then(Value::as_u64) {
        out.push_str(", ");
        out.push_str(&human_size(size));
    }
    if let Some(ms) = info.get("duration").and_then(Value::as_u64) {
        let secs = ms / 1000;
        out.push_str(&format!(", {}:{:02}", secs / 60, secs % 60));
    }
    out
}

/// Bytes as people read them: `812 B`, `2.0 KB`, `50.0 MB` (powers of 1024).
pub fn human_size(bytes: u64) -> String {
    const UNITS: [&str; 4] = ["KB", "MB", "GB", "TB"];
    if bytes < 1024 {
        return format!("{bytes} B");
    }
    let mut v = bytes as f64 / 1024.0;
    let mut unit = 0;
    while v >= 1024.0 && unit < UNITS.len() - 1 {
        v /= 1024.0;
        unit += 1;
    }
    format!("{v:.1} {}", UNITS[unit])
}

/// The context line an event contributes to its room's recent timeline (her own lines
/// included), or `None` for events that are not messages.
pub fn context_line(ev: &Value, sender_name: Option<String>) -> Option<ContextLine> {
    if str_at(ev, &["type"]) != Some("m.room.message") {
        return None;
    }
    let (_, text) = message_text(ev.get("content")?)?;
    Some(ContextLine {
        event_id: str_at(ev, &["event_id"])?.to_owned(),
        sender: str_at(ev, &["sender"])?.to_owned(),
        sender_name,
        ts: ev.get("origin_server_ts").and_then(Value::as_i64)?,
        text,
    })
}

/// A reaction (`m.reaction` with an `m.annotation` relation): the event it annotates and its
/// key.
pub fn reaction(ev: &Value) -> Option<(&str, &str)> {
    if str_at(ev, &["type"])? != "m.reaction" {
        return None;
    }
    let rel = ev.get("content")?.get("m.relates_to")?;
    if str_at(rel, &["rel_type"])? != "m.annotation" {
        return None;
    }
    Some((str_at(rel, &["event_id"])?, str_at(rel, &["key"])?))
}

/// Characters of a reacted-to line quoted in the reaction's line.
const REACTED_QUOTE_CHARS: usize = 60;

/// The text a reaction shows: `reacted "KEY" to ^handle` and, when the line is known, a short
/// quote of it. The key is a field (one line, escaped, capped), the quote too.
fn reaction_text(key: &str, target: &str, line: Option<&ContextLine>) -> String {
    let key = session::untrusted::field(key, 32);
    let handle = session::handle::of(target);
    match line {
        Some(l) => format!(
            "reacted \"{key}\" to {handle} (\"{}\")",
            session::untrusted::field(&l.text, REACTED_QUOTE_CHARS)
        ),
        None => format!("reacted \"{key}\" to {handle}"),
    }
}

/// The context line a reaction makes in its room's timeline; `line` is the line it annotates
/// when the timeline holds it.
pub fn reaction_line(
    ev: &Value,
    sender_name: Option<String>,
    line: Option<&ContextLine>,
) -> Option<ContextLine> {
    let (target, key) = reaction(ev)?;
    Some(ContextLine {
        event_id: str_at(ev, &["event_id"])?.to_owned(),
        sender: str_at(ev, &["sender"])?.to_owned(),
        sender_name,
        ts: ev.get("origin_server_ts").and_then(Value::as_i64)?,
        text: reaction_text(key, target, line),
    })
}

/// A reaction is mail only when one of her `operators` reacts to a line of hers (`line`, the
/// line it annotates, from the timeline): it is addressed to her and starts a turn. Every
/// other reaction is a context line only.
pub fn reaction_delivery(
    ev: &Value,
    room: &RoomInfo,
    me: &Me,
    sender_name: Option<String>,
    line: Option<&ContextLine>,
    operators: &[String],
) -> Option<Delivery> {
    let line = line.filter(|l| l.sender == me.user_id)?;
    let said = reaction_line(ev, sender_name, Some(line))?;
    if !operators.contains(&said.sender) {
        return None;
    }
    Some(Delivery {
        room_id: room.room_id.clone(),
        room_alias: room.alias.clone(),
        is_direct: room.is_direct,
        event_id: said.event_id,
        sender: said.sender,
        sender_name: said.sender_name,
        ts: said.ts,
        kind: DeliveryKind::Text,
        text: said.text,
        to_you: true,
        ..Delivery::default()
    })
}

/// Whether `ev` is her own joining of the room (not a profile change while joined): what
/// comes before it in a timeline is history, context but not mail.
pub fn is_own_join(ev: &Value, me: &Me) -> bool {
    str_at(ev, &["type"]) == Some("m.room.member")
        && str_at(ev, &["state_key"]) == Some(me.user_id.as_str())
        && str_at(ev, &["content", "membership"]) == Some("join")
        && str_at(ev, &["unsigned", "prev_content", "membership"]) != Some("join")
}

/// Who invited her, when `ev` is her invite into the room.
pub fn invited_by<'a>(ev: &'a Value, me: &Me) -> Option<&'a str> {
    (str_at(ev, &["type"]) == Some("m.room.member")
        && str_at(ev, &["state_key"]) == Some(me.user_id.as_str())
        && str_at(ev, &["content", "membership"]) == Some("invite"))
    .then(|| str_at(ev, &["sender"]))
    .flatten()
}

/// Where history ends in a room's timeline of one sync response (indices into it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct History {
    /// Her own joining, when the response has it: what precedes it is history.
    pub joined_at: Option<usize>,
    /// The last event that is not mail: her join, or in a DM her operator invited her to, his
    /// invite (his lines since are mail, even written before she joined).
    pub mail_after: Option<usize>,
}

/// Where mail starts in `timeline` (one room's events of one sync response, oldest first).
pub fn history_before<'a>(
    timeline: impl Iterator<Item = &'a Value> + Clone,
    me: &Me,
    operators: &[String],
) -> History {
    let joined_at = timeline
        .clone()
        .enumerate()
        .filter(|(_, ev)| is_own_join(ev, me))
        .map(|(i, _)| i)
        .last();
    let invited_at = joined_at.and_then(|j| {
        timeline
            .take(j)
            .enumerate()
            .filter(|(_, ev)| {
                invited_by(ev, me).is_some_and(|by| operators.iter().any(|o| o == by))
            })
            .map(|(i, _)| i)
            .last()
    });
    History {
        joined_at,
        mail_after: invited_at.or(joined_at),
    }
}

/// The thread an event belongs to, if any.
pub fn thread_of(ev: &Value) -> Option<&str> {
    match str_at(ev, &["content", "m.relates_to", "rel_type"]) {
        Some("m.thread") => str_at(ev, &["content", "m.relates_to", "event_id"]),
        _ => None,
    }
}

/// The delivery an event makes for her, or `None` when it is not mail (not a message, her
/// own, redacted). `seq`, `persona` and `context` are filled in by the caller.
pub fn delivery(
    ev: &Value,
    room: &RoomInfo,
    me: &Me,
    sender_name: Option<String>,
) -> Option<Delivery> {
    let sender = str_at(ev, &["sender"])?;
    if sender == me.user_id {
        return None;
    }
    let event_id = str_at(ev, &["event_id"])?.to_owned();
    let ts = ev
        .get("origin_server_ts")
        .and_then(Value::as_i64)
        .unwrap_or(0);
    let base = Delivery {
        room_id: room.room_id.clone(),
        room_alias: room.alias.clone(),
        is_direct: room.is_direct,
        event_id,
        sender: sender.to_owned(),
        sender_name,
        ts,
        ..Delivery::default()
    };
    match str_at(ev, &["type"])? {
        "m.room.message" => {}
        "m.room.encrypted" => {
            return Some(Delivery {
                kind: DeliveryKind::Unknown,
                text: UNDECRYPTABLE.to_owned(),
                to_you: room.is_direct,
                ..base
            })
        }
        _ => return None,
    }
    let content = ev.get("content")?;
    let (kind, text) = message_text(content)?;
    let rel = content.get("m.relates_to");
    let rel_type = rel.and_then(|r| str_at(r, &["rel_type"]));
    let thread_root = (rel_type == Some("m.thread"))
        .then(|| {
            rel.and_then(|r| str_at(r, &["event_id"]))
                .map(str::to_owned)
        })
        .flatten();
    let falling_back = rel
        .and_then(|r| r.get("is_falling_back"))
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let reply_to = rel
        .and_then(|r| str_at(r, &["m.in_reply_to", "event_id"]))
        .filter(|_| !(thread_root.is_some() && falling_back))
        .map(str::to_owned);
    let edit_of = (rel_type == Some("m.replace"))
        .then(|| {
            rel.and_then(|r| str_at(r, &["event_id"]))
                .map(str::to_owned)
        })
        .flatten();
    let mentions_v = content.get("m.mentions");
    let mentions: Vec<String> = mentions_v
        .and_then(|m| m.get("user_ids"))
        .and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .filter_map(Value::as_str)
                .map(str::to_owned)
                .collect()
        })
        .unwrap_or_default();
    let room_mention = mentions_v
        .and_then(|m| m.get("room"))
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let named = session::render::has_word(&text, me.localpart())
        || me
            .display_name
            .as_deref()
            .is_some_and(|n| session::render::has_word(&text, n));
    let to_you = room.is_direct || room_mention || mentions.contains(&me.user_id) || named;
    Some(Delivery {
        kind,
        text,
        to_you,
        mentions,
        thread_root,
        reply_to,
        edit_of,
        ..base
    })
}

/// Up to `max_lines` / `max_bytes` of the lines before `event_id` (oldest first); for a
/// thread message, only that thread's root and replies.
pub fn context_for<'a>(
    timeline: impl DoubleEndedIterator<Item = &'a (Option<String>, ContextLine)>,
    event_id: &str,
    thread_root: Option<&str>,
    max_lines: usize,
    max_bytes: usize,
) -> Vec<ContextLine> {
    let mut out = Vec::new();
    let mut bytes = 0;
    let mut before = false;
    for (thread, line) in timeline.rev() {
        if !before {
            before = line.event_id == event_id;
            continue;
        }
        if let Some(root) = thread_root {
            if thread.as_deref() != Some(root) && line.event_id != root {
                continue;
            }
        }
        let size = line.text.len() + line.sender.len();
        if out.len() >= max_lines || bytes + size > max_bytes {
            break;
        }
        bytes += size;
        out.push(line.clone());
    }
    out.reverse();
    out
}

/// Which events of a room's history, read newest first, are older than the lines the ear
/// holds (the stored timeline and the sync response's events): a read back from the
/// response's start (`prev_batch`) returns only such events, bar those held; a read from the
/// room's newest event first returns what was said after the response, up to the first event
/// held.
#[derive(Debug, Clone, Copy)]
pub struct OlderThanHeld {
    reached: bool,
}

impl OlderThanHeld {
    /// For a read that starts at the response's start (`true`) or at the room's newest event.
    pub fn new(from_response_start: bool) -> Self {
        Self {
            reached: from_response_start,
        }
    }

    /// Whether the next event of the read (`held`: the ear holds it already) is an older line
    /// to take.
    pub fn take(&mut self, held: bool) -> bool {
        if held {
            self.reached = true;
            return false;
        }
        self.reached
    }
}

#[cfg(test)]
mod tests;
