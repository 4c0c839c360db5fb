//! Her Minds' side: notes for her next batch, and her reply's extension fields paged and
//! acknowledged.

use super::*;

impl Service {
    /// A note for her next batch: checked, stored durably, and with `wake` her turn loop woken.
    pub(super) fn note(&mut self, key: &str, r: wire::docs::NoteRequest) -> Vec<Answer> {
        let trigger = self
            .ports
            .get(&r.persona)
            .and_then(|p| p.turn_requests.clone());
        let Some(trigger) = trigger else {
            let why = "her session is off (mouth-only): notes reach only a live session".to_owned();
            return vec![self.refusal(&Request::Note(r), key, why)];
        };
        if let Err(why) = r.check() {
            return vec![self.refusal(&Request::Note(r), key, why)];
        }
        let receipt = match self.inbox.put_note(&r, crate::clock::unix_ms()) {
            Ok(put) => {
                tracing::info!(persona = %r.persona, note = ?r.note_id, kind = ?r.kind, wake = r.wake, duplicate = put.duplicate, "note stored");
                if put.dropped > 0 {
                    tracing::warn!(persona = %r.persona, dropped = put.dropped, "older waiting notes dropped: her notes are capped in count and bytes until her next batch shows them");
                }
                if r.wake && !put.duplicate {
                    trigger.notify_one();
                }
                NoteReceipt {
                    persona: r.persona,
                    note_id: r.note_id,
                    status: Status::Ok,
                    duplicate: put.duplicate,
                    pending_notes: put.pending,
                    error: None,
                }
            }
            Err(e) => NoteReceipt {
                persona: r.persona,
                note_id: r.note_id,
                status: Status::Failed,
                error: Some(format!("inbox: {e}")),
                ..NoteReceipt::default()
            },
        };
        vec![self.receipt(ids::NOTE_RECEIPT, key, &receipt)]
    }

    pub(super) fn extension_page(
        &mut self,
        key: &str,
        r: wire::docs::ExtensionPendingRequest,
    ) -> Vec<Answer> {
        let limit = r.limit.unwrap_or(DEFAULT_PAGE).clamp(1, MAX_PAGE) as usize;
        match self
            .inbox
            .pending_extensions(&r.persona, r.after_seq, limit)
        {
            Ok(page) => vec![self.receipt(
                ids::EXTENSION_PAGE,
                key,
                &wire::docs::ExtensionPage {
                    persona: r.persona,
                    extensions: page.extensions,
                    through_seq: page.through_seq,
                    more: page.more,
                    pending_count: page.pending_count,
                },
            )],
            Err(e) => vec![error(format!("request {key:?}: inbox: {e}"))],
        }
    }

    pub(super) fn extension_ack(
        &mut self,
        key: &str,
        r: wire::docs::ExtensionAckRequest,
    ) -> Vec<Answer> {
        let receipt = match self.inbox.ack_extensions(&r.persona, r.through_seq) {
            Ok(pending_count) => ExtensionAckReceipt {
                persona: r.persona,
                status: Status::Ok,
                through_seq: r.through_seq,
                pending_count,
                error: None,
            },
            Err(e) => ExtensionAckReceipt {
                status: if matches!(e, crate::inbox::InboxError::AckBeyondHighest { .. }) {
                    Status::Rejected
                } else {
                    Status::Failed
                },
                persona: r.persona,
                through_seq: r.through_seq,
                pending_count: 0,
                error: Some(e.to_string()),
            },
        };
        vec![self.receipt(ids::EXTENSION_ACK_RECEIPT, key, &receipt)]
    }
}
