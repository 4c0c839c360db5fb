//! Batches and how they reach the model.
//!
//! A batch is the oldest run of pending deliveries that share a conversation: every public room
//! together, or one DM room alone. It becomes ONE user message: one text block that begins with
//! a fixed header. The CLI runs the last content block of a user message as a command when it
//! starts with `/` (facts/claude-cli.md), so chat text must never start it: `/clear` typed in a
//! room arrives as text inside the block. Context lines the session has already seen are left
//! out, and so are deliveries it has seen as context.

use std::collections::{HashSet, VecDeque};
use std::fmt::Write as _;

use serde::{Deserialize, Serialize};
use wire::docs::{ContextLine, Delivery, DeliveryKind};

/// Event ids the live session has already been shown, at most this many (oldest forgotten).
pub const SEEN_CAPACITY: usize = 8192;
/// The start of every rendered batch.
pub const HEADER_PREFIX: &str = "[cultnet batch ";

/// Which conversation a delivery belongs to.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Conversation {
    /// Every public room, together.
    Public,
    /// One DM room.
    Direct(String),
}

impl Conversation {
    /// The conversation of `d`.
    pub fn of(d: &Delivery) -> Self {
        if d.is_direct {
            Self::Direct(d.room_id.clone())
        } else {
            Self::Public
        }
    }
}

/// The next batch: the longest run from the oldest pending delivery that shares its
/// conversation, at most `max` long. `pending` must be in seq order.
pub fn next_batch(pending: &[Delivery], max: usize) -> &[Delivery] {
    let Some(first) = pending.first() else {
        return &[];
    };
    let conv = Conversation::of(first);
    let n = pending
        .iter()
        .take(max.max(1))
        .take_while(|d| Conversation::of(d) == conv)
        .count();
    &pending[..n]
}

/// Event ids the session has seen (deliveries and context lines), bounded.
/// Invariant: `set` and `order` hold the same ids; `order.len() <= SEEN_CAPACITY`.
#[derive(Debug, Default, Clone)]
pub struct Seen {
    set: HashSet<String>,
    order: VecDeque<String>,
}

impl Seen {
    /// Whether the session has seen `event_id`.
    pub fn contains(&self, event_id: &str) -> bool {
        self.set.contains(event_id)
    }

    /// Records `event_id` as seen.
    pub fn insert(&mut self, event_id: &str) {
        if self.set.contains(event_id) {
            return;
        }
        if self.order.len() >= SEEN_CAPACITY {
            if let Some(old) = self.order.pop_front() {
                self.set.remove(&old);
            }
        }
        self.set.insert(event_id.to_owned());
        self.order.push_back(event_id.to_owned());
    }

    /// Forgets everything (a fresh session has seen nothing).
    pub fn clear(&mut self) {
        self.set.clear();
        self.order.clear();
    }
}

/// Renders `batch` as the text of one user message, leaving out context the session has seen,
/// and records what it showed in `seen`. `note` (a correction after a bad reply) goes right
/// after the header.
pub fn render(batch: &[Delivery], seen: &mut Seen, note: Option<&str>) -> String {
    let mut out = String::new();
    let (first, last) = match (batch.first(), batch.last()) {
        (Some(f), Some(l)) => (f.seq, l.seq),
        _ => (0, 0),
    };
    // The header is fixed text: the block can never start with chat text.
    let _ = writeln!(
        out,
        "{HEADER_PREFIX}{first}-{last}: {} new message(s)]",
        batch.len()
    );
    if let Some(note) = note {
        let _ = writeln!(out, "note: {}", one_line(note));
    }
    let mut room: Option<&str> = None;
    for d in batch {
        if room != Some(d.room_id.as_str()) {
            room = Some(d.room_id.as_str());
            let kind = if d.is_direct {
                "direct message"
            } else {
                "room"
            };
            let _ = match &d.room_alias {
                Some(alias) => writeln!(out, "\n## {kind} {alias} ({})", d.room_id),
                None => writeln!(out, "\n## {kind} {}", d.room_id),
            };
        }
        let fresh: Vec<_> = d
            .context
            .iter()
            .filter(|c| !seen.contains(&c.event_id))
            .collect();
        if !fresh.is_empty() {
            let _ = writeln!(out, "context:");
            for c in fresh {
                let who = c.sender_name.as_deref().unwrap_or(&c.sender);
                let _ = writeln!(out, "  {who}: {}", indent(&c.text));
                seen.insert(&c.event_id);
            }
        }
        let who = d.sender_name.as_deref().unwrap_or(&d.sender);
        let _ = write!(out, "[{}] {who} ({})", d.seq, d.sender);
        for flag in flags(d) {
            let _ = write!(out, " [{flag}]");
        }
        let _ = writeln!(out, ": {}", indent(&d.text));
        seen.insert(&d.event_id);
    }
    out
}

fn flags(d: &Delivery) -> Vec<String> {
    let mut f = Vec::new();
    if d.to_you {
        f.push("to you".to_owned());
    }
    match d.kind {
        DeliveryKind::Notice => f.push("notice".to_owned()),
        DeliveryKind::Emote => f.push("emote".to_owned()),
        DeliveryKind::Media => f.push("media".to_owned()),
        _ => {}
    }
    if let Some(t) = &d.thread_root {
        f.push(format!("thread {t}"));
    }
    if let Some(r) = &d.reply_to {
        f.push(format!("reply to {r}"));
    }
    if let Some(e) = &d.edit_of {
        f.push(format!("edit of {e}"));
    }
    if d.truncated {
        f.push("truncated".to_owned());
    }
    f
}

/// Continuation lines are indented so every line of the message keeps its structure.
fn indent(text: &str) -> String {
    text.replace('\n', "\n    ")
}

fn one_line(text: &str) -> String {
    text.replace('\n', " ")
}

/// One message the Persona wants to say.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Say {
    /// Room alias or id (one of hers).
    pub room: String,
    /// The text.
    pub text: String,
    /// Thread root to answer in.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub thread_root: Option<String>,
    /// Event to reply to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reply_to: Option<String>,
}

/// The structured reply of a turn (`--json-schema`, read from `structured_output`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Reply {
    /// What to say; empty when she stays silent.
    #[serde(default)]
    pub say: Vec<Say>,
}

/// The JSON Schema handed to `--json-schema`.
pub fn reply_schema() -> String {
    serde_json::json!({
        "type": "object",
        "additionalProperties": false,
        "required": ["say"],
        "properties": {
            "say": {
                "type": "array",
                "description": "Messages to send; empty to stay silent.",
                "items": {
                    "type": "object",
                    "additionalProperties": false,
                    "required": ["room", "text"],
                    "properties": {
                        "room": {"type": "string", "description": "room id or alias from the batch"},
                        "text": {"type": "string", "minLength": 1},
                        "threadRoot": {"type": "string"},
                        "replyTo": {"type": "string"}
                    }
                }
            }
        }
    })
    .to_string()
}

/// Why a reply sends nothing.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ReplyError {
    /// The result carried no `structured_output`.
    #[error("the turn ended without a structured reply")]
    Missing,
    /// `structured_output` does not match the reply schema.
    #[error("the structured reply does not match the schema: {0}")]
    Malformed(String),
    /// A say names a room that is not one of hers.
    #[error("the reply names room {0:?}, which is not one of hers")]
    UnknownRoom(String),
}

impl ReplyError {
    /// The short correction note the next batch carries.
    pub fn correction_note(&self) -> String {
        match self {
            Self::Missing | Self::Malformed(_) => {
                "your last reply was not sent: answer with the StructuredOutput tool, {say: [...]}"
                    .to_owned()
            }
            Self::UnknownRoom(r) => {
                format!("your last reply was not sent: {r:?} is not one of your rooms; use a room id or alias from the batch")
            }
        }
    }
}

/// Reads and checks a turn's `structured_output` against her rooms (ids and aliases). All or
/// nothing: one bad say sends none, so a half-sent reply never happens.
pub fn validate(
    structured: Option<&serde_json::Value>,
    rooms: &[&str],
) -> Result<Reply, ReplyError> {
    let v = structured.ok_or(ReplyError::Missing)?;
    let reply: Reply =
        serde_json::from_value(v.clone()).map_err(|e| ReplyError::Malformed(e.to_string()))?;
    if let Some(bad) = reply.say.iter().find(|s| !rooms.contains(&s.room.as_str())) {
        return Err(ReplyError::UnknownRoom(bad.room.clone()));
    }
    Ok(reply)
}

/// What a fresh session is given after the batch that starts it: the Persona's state (when
/// there is one) and the last `per_room` lines of each room, at most `max_bytes` of lines (the
/// newest kept), so she picks up where the old session left off without its whole history.
pub fn rehydration(
    state: Option<&str>,
    rooms: &[(&str, Vec<ContextLine>)],
    per_room: usize,
    max_bytes: usize,
) -> String {
    let mut s = String::new();
    if let Some(state) = state {
        let _ = write!(s, "\n## your state\n{state}\n");
    }
    s.push_str("\n## recent lines (before this session)\n");
    let mut kept: Vec<String> = Vec::new();
    let mut bytes = 0;
    'rooms: for (room, lines) in rooms {
        for l in lines.iter().rev().take(per_room) {
            let line = format!("{room} {}: {}\n", l.sender, l.text);
            if bytes + line.len() > max_bytes {
                break 'rooms;
            }
            bytes += line.len();
            kept.push(line);
        }
    }
    // Rooms in their given order, each room's lines oldest first.
    let mut out_rooms: Vec<Vec<String>> = Vec::new();
    let mut current = String::new();
    for line in kept {
        let room = line.split(' ').next().unwrap_or_default().to_owned();
        if room != current || out_rooms.is_empty() {
            out_rooms.push(Vec::new());
            current = room;
        }
        if let Some(r) = out_rooms.last_mut() {
            r.push(line);
        }
    }
    for mut r in out_rooms {
        r.reverse();
        s.extend(r);
    }
    s
}

/// The request id of say `index` of the batch covering seqs `first..=last`: stable across
/// retries and restarts, so the mouth sends each say once.
pub fn say_request_id(persona: &str, first: u64, last: u64, index: usize) -> String {
    format!("turn:{persona}:{first}-{last}:{index}")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn d(seq: u64, room: &str, direct: bool, text: &str) -> Delivery {
        Delivery {
            seq,
            persona: "mira".into(),
            room_id: room.into(),
            is_direct: direct,
            event_id: format!("$e{seq}"),
            sender: "@alice:localhost".into(),
            sender_name: Some("alice".into()),
            ts: seq as i64,
            text: text.into(),
            ..Delivery::default()
        }
    }

    #[test]
    fn batches_are_runs_of_one_conversation() {
        let p = vec![
            d(1, "!a", false, "x"),
            d(2, "!b", false, "y"),
            d(3, "!dm1", true, "z"),
            d(4, "!dm1", true, "w"),
            d(5, "!dm2", true, "v"),
            d(6, "!a", false, "u"),
        ];
        assert_eq!(
            next_batch(&p, 100)
                .iter()
                .map(|d| d.seq)
                .collect::<Vec<_>>(),
            vec![1, 2]
        );
        assert_eq!(
            next_batch(&p[2..], 100)
                .iter()
                .map(|d| d.seq)
                .collect::<Vec<_>>(),
            vec![3, 4]
        );
        assert_eq!(
            next_batch(&p[4..], 100)
                .iter()
                .map(|d| d.seq)
                .collect::<Vec<_>>(),
            vec![5]
        );
        assert_eq!(next_batch(&p, 1).len(), 1);
        assert!(next_batch(&[], 10).is_empty());
    }

    #[test]
    fn slash_commands_in_chat_are_text() {
        let mut seen = Seen::default();
        for evil in [
            "/clear",
            "/compact",
            "\n/clear",
            " /clear",
            "/clear\n/compact",
        ] {
            let msg = render(&[d(7, "!a", false, evil)], &mut seen, None);
            assert!(msg.starts_with(HEADER_PREFIX), "{msg:?}");
            assert!(!msg.starts_with('/'));
            assert!(msg.contains(evil.trim_start_matches('\n').lines().next().unwrap()));
        }
    }

    #[test]
    fn context_is_sent_once() {
        let mut seen = Seen::default();
        let mut a = d(1, "!a", false, "hello");
        a.context = vec![ContextLine {
            event_id: "$c1".into(),
            sender: "@bob:l".into(),
            sender_name: None,
            ts: 0,
            text: "earlier".into(),
        }];
        let mut b = d(2, "!a", false, "again");
        b.context = vec![
            ContextLine {
                event_id: "$c1".into(),
                sender: "@bob:l".into(),
                sender_name: None,
                ts: 0,
                text: "earlier".into(),
            },
            ContextLine {
                event_id: "$e1".into(),
                sender: "@alice:localhost".into(),
                sender_name: None,
                ts: 1,
                text: "hello".into(),
            },
            ContextLine {
                event_id: "$c2".into(),
                sender: "@bob:l".into(),
                sender_name: None,
                ts: 1,
                text: "newer".into(),
            },
        ];
        let first = render(&[a], &mut seen, None);
        assert!(first.contains("earlier"));
        let second = render(&[b], &mut seen, None);
        assert!(!second.contains("earlier"), "{second}");
        assert!(
            !second.contains("  @alice:localhost: hello"),
            "a delivery already shown came back as context"
        );
        assert!(second.contains("newer"));
        seen.clear();
        assert!(!seen.contains("$c1"));
    }

    #[test]
    fn lines_carry_room_sender_and_flags() {
        let mut x = d(9, "!dm", true, "line one\nline two");
        x.room_alias = Some("#ops:l".into());
        x.to_you = true;
        x.thread_root = Some("$root".into());
        x.reply_to = Some("$r".into());
        x.edit_of = Some("$old".into());
        x.kind = DeliveryKind::Edit;
        let msg = render(&[x], &mut Seen::default(), Some("fix it\nplease"));
        assert!(
            msg.starts_with("[cultnet batch 9-9: 1 new message(s)]\nnote: fix it please\n"),
            "{msg}"
        );
        assert!(msg.contains("## direct message #ops:l (!dm)"));
        assert!(msg.contains("[9] alice (@alice:localhost) [to you] [thread $root] [reply to $r] [edit of $old]: line one\n    line two"), "{msg}");
    }

    #[test]
    fn replies_are_checked_against_her_rooms() {
        let rooms = ["!a", "#lobby:l"];
        let ok =
            serde_json::json!({"say": [{"room": "#lobby:l", "text": "hi", "threadRoot": "$t"}]});
        let r = validate(Some(&ok), &rooms).unwrap();
        assert_eq!(r.say[0].thread_root.as_deref(), Some("$t"));
        let bad = serde_json::json!({"say": [{"room": "!a", "text": "ok"}, {"room": "!elsewhere", "text": "no"}]});
        assert_eq!(
            validate(Some(&bad), &rooms),
            Err(ReplyError::UnknownRoom("!elsewhere".into()))
        );
        assert_eq!(validate(None, &rooms), Err(ReplyError::Missing));
        assert!(matches!(
            validate(Some(&serde_json::json!({"say": "x"})), &rooms),
            Err(ReplyError::Malformed(_))
        ));
        assert!(ReplyError::UnknownRoom("!x".into())
            .correction_note()
            .contains("!x"));
        let schema: serde_json::Value = serde_json::from_str(&reply_schema()).unwrap();
        assert_eq!(schema["required"][0], "say");
        assert_eq!(say_request_id("mira", 3, 5, 1), "turn:mira:3-5:1");
    }

    #[test]
    fn rehydration_keeps_the_last_lines_of_each_room_and_the_state() {
        let line = |t: &str| ContextLine {
            event_id: format!("${t}"),
            sender: "@a:l".into(),
            sender_name: None,
            ts: 0,
            text: t.into(),
        };
        let rooms = vec![
            ("!a", vec![line("a1"), line("a2"), line("a3")]),
            ("!b", vec![line("b1")]),
        ];
        let r = rehydration(Some("calm"), &rooms, 2, 10_000);
        assert!(r.contains("## your state\ncalm"));
        assert!(!r.contains("a1") && r.contains("!a @a:l: a2\n!a @a:l: a3\n!b @a:l: b1"));
        assert!(!rehydration(None, &rooms, 2, 10_000).contains("your state"));
        // A byte cap keeps the newest lines of the first rooms ("!a @a:l: a3\n" is 12 bytes).
        let capped = rehydration(None, &rooms, 2, 24);
        assert!(capped.ends_with("!a @a:l: a2\n!a @a:l: a3\n"), "{capped}");
        assert!(!rehydration(None, &rooms, 2, 11).contains("!a"));
    }
}
