//! The claude CLI's stream-json protocol: typed stdout events (tolerant of unknown fields and
//! event types) and the stdin lines the gateway writes.

use serde::Deserialize;
use serde_json::Value;

use crate::cost::Usage;
use crate::policy::Outcome;

/// One stdout line, decoded.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
#[non_exhaustive]
pub enum Event {
    /// `system/*`: init, status, api_retry, compact_boundary, ...
    System(SystemEvent),
    /// An assistant message (text, tool use), or an API error shown as one.
    Assistant(MessageEvent),
    /// A user-side event (tool results).
    User(MessageEvent),
    /// The end of a turn.
    Result(ResultEvent),
    /// The answer to a control request.
    ControlResponse(Value),
    /// The conversation was wiped (a `/clear` ran).
    ConversationReset(Value),
    /// A type this version does not know: ignored.
    #[serde(other)]
    Unknown,
}

/// `type: system`.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
pub struct SystemEvent {
    /// `init`, `status`, `api_retry`, `compact_boundary`, ...
    #[serde(default)]
    pub subtype: String,
    /// The session.
    #[serde(default)]
    pub session_id: Option<String>,
    /// `api_retry`: attempt number.
    #[serde(default)]
    pub attempt: Option<u32>,
    /// `api_retry`: retries allowed.
    #[serde(default)]
    pub max_retries: Option<u32>,
    /// `api_retry`: wait before the next try.
    #[serde(default)]
    pub retry_delay_ms: Option<u64>,
    /// `api_retry`: the HTTP status that failed.
    #[serde(default)]
    pub error_status: Option<u16>,
    /// `compact_boundary`: trigger (`manual`, `auto`) and sizes before and after.
    #[serde(default)]
    pub compact_metadata: Option<CompactMetadata>,
}

/// What a `compact_boundary` event reports.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
pub struct CompactMetadata {
    /// `manual` (a `/compact`) or `auto`.
    #[serde(default)]
    pub trigger: String,
    /// Tokens before.
    #[serde(default)]
    pub pre_tokens: u64,
    /// Tokens after (the summary and what was kept).
    #[serde(default)]
    pub post_tokens: u64,
    /// The messages kept verbatim past the summary (their transcript `uuid`s).
    #[serde(default)]
    pub preserved_messages: Preserved,
}

/// `compact_metadata.preserved_messages`: what a compaction kept verbatim.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
pub struct Preserved {
    /// The kept messages' `uuid`s, as the transcript names them.
    #[serde(default)]
    pub uuids: Vec<String>,
}

/// `type: assistant` / `type: user`.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
pub struct MessageEvent {
    /// The message as the API shaped it.
    #[serde(default)]
    pub message: Value,
    /// The session.
    #[serde(default)]
    pub session_id: Option<String>,
    /// Set when the API failed and the CLI shows the error as a message.
    #[serde(default)]
    pub is_api_error_message: bool,
}

impl MessageEvent {
    /// The usage its request reported (`message.usage`), if it carries one. Printed as the
    /// answer begins, so its prompt counts are final and its output count may not be.
    pub fn usage(&self) -> Option<Usage> {
        let u: ApiUsage = serde_json::from_value(self.message.get("usage")?.clone()).ok()?;
        Some(u.usage())
    }
}

/// Token counts as the API reports them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
pub struct ApiUsage {
    /// Uncached input.
    #[serde(default)]
    pub input_tokens: u64,
    /// All cache writes.
    #[serde(default)]
    pub cache_creation_input_tokens: u64,
    /// Cache reads.
    #[serde(default)]
    pub cache_read_input_tokens: u64,
    /// Output.
    #[serde(default)]
    pub output_tokens: u64,
    /// Writes by TTL.
    #[serde(default)]
    pub cache_creation: CacheCreation,
}

/// Cache writes split by TTL.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
pub struct CacheCreation {
    /// 1-hour writes.
    #[serde(default)]
    pub ephemeral_1h_input_tokens: u64,
    /// 5-minute writes.
    #[serde(default)]
    pub ephemeral_5m_input_tokens: u64,
}

impl ApiUsage {
    /// As a [`Usage`]. Writes the split does not account for count as 5-minute writes.
    pub fn usage(&self) -> Usage {
        let split = self.cache_creation.ephemeral_1h_input_tokens
            + self.cache_creation.ephemeral_5m_input_tokens;
        Usage {
            input: self.input_tokens,
            cache_read: self.cache_read_input_tokens,
            cache_write_1h: self.cache_creation.ephemeral_1h_input_tokens,
            cache_write_5m: self.cache_creation.ephemeral_5m_input_tokens
                + self.cache_creation_input_tokens.saturating_sub(split),
            output: self.output_tokens,
        }
    }
}

/// `type: result`: one per turn.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
pub struct ResultEvent {
    /// `success` or `error_during_execution` (check `is_error`, not this).
    #[serde(default)]
    pub subtype: String,
    /// Whether the turn failed.
    #[serde(default)]
    pub is_error: bool,
    /// `completed`, `prompt_too_long`, `blocking_limit`, `api_error`, `aborted_streaming`, ...
    #[serde(default)]
    pub terminal_reason: Option<String>,
    /// The final text.
    #[serde(default)]
    pub result: Option<String>,
    /// The reply under `--json-schema` (absent when the model never called the tool).
    #[serde(default)]
    pub structured_output: Option<Value>,
    /// The session.
    #[serde(default)]
    pub session_id: Option<String>,
    /// API requests in the turn.
    #[serde(default)]
    pub num_turns: u32,
    /// Wall time of the turn.
    #[serde(default)]
    pub duration_ms: u64,
    /// The CLI's own cumulative cost estimate for the session.
    #[serde(default)]
    pub total_cost_usd: f64,
    /// This turn's usage.
    #[serde(default)]
    pub usage: ApiUsage,
    /// The failed request's HTTP status.
    #[serde(default)]
    pub api_error_status: Option<u16>,
    /// Errors the CLI reports (e.g. a missing session on `--resume`).
    #[serde(default)]
    pub errors: Vec<String>,
    /// The session's running totals per model (they go on across `--resume`).
    #[serde(default, rename = "modelUsage")]
    pub model_usage: std::collections::BTreeMap<String, ModelUsage>,
}

/// A model's running totals in a session (`modelUsage` of a result).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ModelUsage {
    /// Uncached input tokens.
    #[serde(default)]
    pub input_tokens: u64,
    /// Output tokens.
    #[serde(default)]
    pub output_tokens: u64,
    /// Cache reads.
    #[serde(default)]
    pub cache_read_input_tokens: u64,
    /// All cache writes.
    #[serde(default)]
    pub cache_creation_input_tokens: u64,
    /// 5-minute writes.
    #[serde(default)]
    pub cache_creation_ephemeral5m_input_tokens: u64,
    /// 1-hour writes.
    #[serde(default)]
    pub cache_creation_ephemeral1h_input_tokens: u64,
}

impl ResultEvent {
    /// The session's running totals, all models together (`None` when the result has none).
    /// Two results' difference is everything billed between them, also what a result's
    /// `usage` leaves out: a compaction's summary request (the CLI's own, within a turn, or a
    /// `/compact`, whose result reports no `usage` at all).
    pub fn cumulative(&self) -> Option<Usage> {
        if self.model_usage.is_empty() {
            return None;
        }
        let mut total = Usage::default();
        for m in self.model_usage.values() {
            let split = m.cache_creation_ephemeral5m_input_tokens
                + m.cache_creation_ephemeral1h_input_tokens;
            total.add(&Usage {
                input: m.input_tokens,
                cache_read: m.cache_read_input_tokens,
                cache_write_1h: m.cache_creation_ephemeral1h_input_tokens,
                cache_write_5m: m.cache_creation_ephemeral5m_input_tokens
                    + m.cache_creation_input_tokens.saturating_sub(split),
                output: m.output_tokens,
            });
        }
        Some(total)
    }

    /// How the turn ended, for the refresh policy.
    pub fn outcome(&self) -> Outcome {
        match self.terminal_reason.as_deref() {
            Some("prompt_too_long") => Outcome::PromptTooLong,
            Some("blocking_limit") => Outcome::BlockingLimit,
            _ if self.is_error => Outcome::ApiError,
            _ => Outcome::Ok,
        }
    }
}

/// Why a stdout line could not be read.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ProtoError {
    /// Not JSON, or a known event with fields of the wrong type.
    #[error("unreadable CLI output line: {0}")]
    Unreadable(#[from] serde_json::Error),
}

/// Decodes one stdout line; `Ok(None)` for a blank line.
pub fn parse_line(line: &str) -> Result<Option<Event>, ProtoError> {
    let line = line.trim();
    if line.is_empty() {
        return Ok(None);
    }
    Ok(Some(serde_json::from_str(line)?))
}

/// The stdin line carrying one user message: one text block (so its start is the rendered
/// batch's fixed header, never chat text).
pub fn user_line(text: &str) -> String {
    let v = serde_json::json!({
        "type": "user",
        "message": {"role": "user", "content": [{"type": "text", "text": text}]}
    });
    format!("{v}\n")
}

/// An image given to her with a batch: its media type (`image/png`, `image/jpeg`,
/// `image/gif`, `image/webp`) and its bytes.
#[derive(Clone, PartialEq, Eq)]
pub struct Image {
    /// Its media type.
    pub media_type: String,
    /// Its bytes.
    pub data: Vec<u8>,
}

impl std::fmt::Debug for Image {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Image")
            .field("media_type", &self.media_type)
            .field("bytes", &self.data.len())
            .finish()
    }
}

/// [`user_line`] with `images` after the text block, as base64 image blocks: the text (the
/// rendered batch, its fixed header first) stays the message's first block.
pub fn user_line_with(text: &str, images: &[Image]) -> String {
    use base64::Engine as _;
    let mut content = vec![serde_json::json!({"type": "text", "text": text})];
    for i in images {
        content.push(serde_json::json!({
            "type": "image",
            "source": {
                "type": "base64",
                "media_type": i.media_type,
                "data": base64::engine::general_purpose::STANDARD.encode(&i.data),
            }
        }));
    }
    let v = serde_json::json!({
        "type": "user",
        "message": {"role": "user", "content": content}
    });
    format!("{v}\n")
}

/// The stdin line of a control request (`initialize`, `interrupt`).
pub fn control_line(request_id: &str, subtype: &str) -> String {
    let v = serde_json::json!({"type": "control_request", "request_id": request_id, "request": {"subtype": subtype}});
    format!("{v}\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn events(name: &str) -> Vec<Event> {
        let path = format!(
            "{}/../fixtures/claude-cli-2.1.332/{name}",
            env!("CARGO_MANIFEST_DIR")
        );
        std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("{path}: {e}"))
            .lines()
            .filter_map(|l| parse_line(l).unwrap_or_else(|e| panic!("{name}: {e}: {l}")))
            .collect()
    }

    fn results(ev: &[Event]) -> Vec<&ResultEvent> {
        ev.iter()
            .filter_map(|e| {
                if let Event::Result(r) = e {
                    Some(r)
                } else {
                    None
                }
            })
            .collect()
    }

    /// What each result adds to the running totals (the first: its own totals).
    fn billed_between(r: &[&ResultEvent]) -> Vec<Usage> {
        let mut before = Usage::default();
        r.iter()
            .map(|res| {
                let now = res.cumulative().expect("modelUsage");
                let d = now.since(&before).expect("a running total");
                before = now;
                d
            })
            .collect()
    }

    #[test]
    fn running_totals_bill_what_a_result_leaves_out() {
        // One request per turn: the totals' steps are the turns' own usage.
        let ev = events("q1_so3.stdout.jsonl");
        let r = results(&ev);
        let own: Vec<Usage> = r.iter().map(|res| res.usage.usage()).collect();
        assert_eq!(billed_between(&r), own);
        // Each request's own prompt is on its assistant message: one per turn here.
        let asked: Vec<u64> = ev
            .iter()
            .filter_map(|e| match e {
                Event::Assistant(m) => m.usage().map(|u| u.prompt_tokens()),
                _ => None,
            })
            .collect();
        let prompts: Vec<u64> = own.iter().map(Usage::prompt_tokens).collect();
        assert_eq!(asked, prompts);
        // A turn that compacted by itself and retried: its `usage` leaves out the summary.
        let ev = events("err400multi.stdout.jsonl");
        let r = results(&ev);
        assert_eq!(r[2].num_turns, 2);
        let steps = billed_between(&r);
        assert_eq!(r[2].usage.usage().prompt_tokens(), 711);
        assert_eq!(
            (steps[2].input, steps[2].cache_read, steps[2].output),
            (3452, 828, 36)
        );
        assert_eq!(steps[3], r[3].usage.usage());
        // `/compact` reports no usage; its summary request is in the totals' step.
        let ev = events("slash_compact.stdout.jsonl");
        let r = results(&ev);
        let compact = r
            .iter()
            .position(|res| res.num_turns == 0)
            .expect("compact");
        assert_eq!(r[compact].usage.usage(), Usage::default());
        let steps = billed_between(&r);
        let s = steps[compact];
        assert_eq!(
            (s.input, s.cache_read, s.cache_write_5m, s.output),
            (1767, 467, 18, 12)
        );
        // A result without totals (older CLIs) gives none.
        assert_eq!(ResultEvent::default().cumulative(), None);
        // Writes by TTL as the CLI names them; two models add up.
        let r: ResultEvent = serde_json::from_value(serde_json::json!({
            "type": "result",
            "modelUsage": {
                "claude-sonnet-4-5": {"inputTokens": 5, "outputTokens": 7,
                    "cacheReadInputTokens": 11, "cacheCreationInputTokens": 300,
                    "cacheCreationEphemeral5mInputTokens": 100,
                    "cacheCreationEphemeral1hInputTokens": 200},
                "claude-haiku-4-5": {"inputTokens": 1, "cacheCreationInputTokens": 4}
            }
        }))
        .unwrap();
        assert_eq!(
            r.cumulative(),
            Some(Usage {
                input: 6,
                cache_read: 11,
                cache_write_5m: 104,
                cache_write_1h: 200,
                output: 7,
            })
        );
    }

    #[test]
    fn structured_output_on_every_turn() {
        let ev = events("q1_so3.stdout.jsonl");
        let r = results(&ev);
        assert_eq!(r.len(), 3);
        for (i, res) in r.iter().enumerate() {
            assert_eq!(res.outcome(), Outcome::Ok);
            let so = res.structured_output.as_ref().expect("structured_output");
            assert_eq!(so["say"][0]["text"], format!("t{}", i + 1));
        }
        // Turn 2 reads what turn 1 wrote.
        assert!(r[1].usage.usage().cache_read > 0);
        assert_eq!(
            r[0].usage.usage().cache_write_5m,
            r[0].usage.cache_creation_input_tokens
        );
        assert!(ev
            .iter()
            .any(|e| matches!(e, Event::System(s) if s.subtype == "init")));
    }

    #[test]
    fn refusals_map_to_policy_outcomes() {
        let too_long = events("err400.stdout.jsonl");
        let r = results(&too_long);
        assert_eq!(r[0].outcome(), Outcome::PromptTooLong);
        assert_eq!(r[0].api_error_status, Some(400));
        assert_eq!(r[0].usage.usage(), Usage::default());
        assert_eq!(r[1].outcome(), Outcome::Ok);
        let blocked = events("q4_settings_off.stdout.jsonl");
        assert!(results(&blocked)
            .iter()
            .any(|r| r.outcome() == Outcome::BlockingLimit));
        let overloaded = events("err529.stdout.jsonl");
        assert!(overloaded.iter().any(|e| matches!(e, Event::System(s) if s.subtype == "api_retry" && s.error_status == Some(529))));
        assert!(results(&overloaded)
            .iter()
            .any(|r| r.outcome() == Outcome::ApiError));
    }

    #[test]
    fn interrupt_reset_and_control_events_are_typed() {
        let ev = events("interrupt.stdout.jsonl");
        assert!(results(&ev)
            .iter()
            .any(|r| r.is_error && r.terminal_reason.as_deref() == Some("aborted_streaming")));
        assert!(events("slash_clear.stdout.jsonl")
            .iter()
            .any(|e| matches!(e, Event::ConversationReset(_))));
        let boundary = events("slash_compact.stdout.jsonl")
            .into_iter()
            .find_map(|e| match e {
                Event::System(s) if s.subtype == "compact_boundary" => s.compact_metadata,
                _ => None,
            })
            .expect("a compact boundary");
        assert_eq!(
            (
                boundary.trigger.as_str(),
                boundary.pre_tokens,
                boundary.post_tokens
            ),
            ("manual", 480, 514)
        );
        assert_eq!(
            boundary.preserved_messages.uuids,
            ["049016ac-30b4-40ac-9f81-b866db2039cf"]
        );
        assert!(events("ctrlinit.stdout.jsonl")
            .iter()
            .any(|e| matches!(e, Event::ControlResponse(_))));
    }

    #[test]
    fn unknown_and_bad_lines() {
        assert_eq!(parse_line("").unwrap(), None);
        assert_eq!(
            parse_line(r#"{"type":"brand_new","x":1}"#).unwrap(),
            Some(Event::Unknown)
        );
        assert!(parse_line("not json").is_err());
        assert!(parse_line(r#"{"type":"result","is_error":"yes"}"#).is_err());
    }

    #[test]
    fn stdin_lines() {
        let l = user_line("[cultnet batch 1-1]\nalice: /clear");
        assert!(l.ends_with('\n') && !l[..l.len() - 1].contains('\n'));
        let v: Value = serde_json::from_str(&l).unwrap();
        assert_eq!(
            v["message"]["content"][0]["text"],
            "[cultnet batch 1-1]\nalice: /clear"
        );
        let c: Value = serde_json::from_str(&control_line("r1", "initialize")).unwrap();
        assert_eq!(c["request"]["subtype"], "initialize");
        // Images follow the text, which stays first; their bytes as standard base64.
        let png = Image {
            media_type: "image/png".into(),
            data: vec![0x89, b'P', b'N', b'G', 0, 255],
        };
        let l = user_line_with("[cultnet batch 1-1]", &[png]);
        assert!(l.ends_with('\n') && !l[..l.len() - 1].contains('\n'));
        let v: Value = serde_json::from_str(&l).unwrap();
        let content = &v["message"]["content"];
        assert_eq!(content[0]["text"], "[cultnet batch 1-1]");
        assert_eq!(
            content[1],
            serde_json::json!({"type": "image", "source": {"type": "base64",
                "media_type": "image/png", "data": "iVBORwD/"}})
        );
    }
}
