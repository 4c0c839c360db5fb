//! Her mail for clients: a page of what is pending, acknowledging what they have read
//! (group-committed, with her read receipt), and a say through her mouth.

use super::*;

impl Service {
    /// A page of her pending mail after `r.after_seq`, within the page and byte limits.
    pub(super) fn pending_page(&mut self, key: &str, r: wire::docs::PendingRequest) -> Vec<Answer> {
        let limit = r.limit.unwrap_or(DEFAULT_PAGE).clamp(1, MAX_PAGE) as usize;
        let bytes = r
            .reply_bytes
            .unwrap_or(DEFAULT_REPLY_BYTES)
            .clamp(1024, MAX_REPLY_BYTES) as usize;
        match self
            .inbox
            .pending(&r.persona, r.after_seq, limit, Some(bytes))
        {
            Ok(page) => vec![self.receipt(
                ids::PENDING_PAGE,
                key,
                &wire::docs::PendingPage {
                    persona: r.persona,
                    deliveries: page.deliveries,
                    through_seq: page.through_seq,
                    more: page.more,
                    pending_count: page.pending_count,
                },
            )],
            Err(e) => vec![error(format!("request {key:?}: inbox: {e}"))],
        }
    }

    /// A say through her mouth, run on a task of its own (it may wait for the homeserver).
    pub(super) fn send(
        &mut self,
        key: String,
        r: wire::docs::SendRequest,
        in_flight: &Arc<std::sync::atomic::AtomicUsize>,
    ) -> Vec<Answer> {
        let Some(mouth) = self.ports.get(&r.persona).and_then(|p| p.mouth.clone()) else {
            return vec![self.receipt(
                ids::SEND_RECEIPT,
                &key,
                &SendReceipt {
                    request_id: r.request_id,
                    status: Status::Failed,
                    error: Some(format!("{} is not running now", r.persona)),
                    ..SendReceipt::default()
                },
            )];
        };
        vec![Answer::Send {
            record_key: key,
            request: r,
            mouth,
            slot: InFlight::take(in_flight),
        }]
    }

    pub(super) fn ack(&mut self, key: &str, r: wire::docs::AckRequest) -> Vec<Answer> {
        // The event acknowledged last gets her read receipt.
        let last = self
            .inbox
            .pending(&r.persona, r.through_seq.saturating_sub(1), 1, None)
            .ok()
            .and_then(|p| p.deliveries.into_iter().next())
            .filter(|d| d.seq == r.through_seq);
        let port = self.ports.get(&r.persona);
        match self.inbox.ack_unflushed(&r.persona, r.through_seq) {
            Ok((c, changed)) => {
                // Group commit: the receipt waits for the loop's one flush for all acks.
                self.unflushed |= changed;
                let receipt = |status, error| {
                    let r = AckReceipt {
                        persona: r.persona.clone(),
                        status,
                        through_seq: c.acked_through,
                        pending_count: c.pending,
                        error,
                    };
                    receipt_bytes(&self.runtime_id, ids::ACK_RECEIPT, key, &r)
                };
                let mut out = vec![Answer::AfterFlush {
                    ok: receipt(Status::Ok, None),
                    failed: receipt(
                        Status::Failed,
                        Some("the inbox could not write the ack to disk (see the gateway's log); retry".into()),
                    ),
                }];
                if let Some(port) = port {
                    port.signals.acked.notify_one();
                    if let (Some(mouth), Some(d)) = (port.mouth.clone(), last) {
                        out.push(Answer::ReadReceipt {
                            mouth,
                            room_id: d.room_id,
                            event_id: d.event_id,
                        });
                    }
                }
                out
            }
            Err(e) => {
                let pending_count = self.inbox.counts(&r.persona).map_or(0, |c| c.pending);
                vec![self.receipt(
                    ids::ACK_RECEIPT,
                    key,
                    &AckReceipt {
                        persona: r.persona,
                        status: Status::Rejected,
                        through_seq: r.through_seq,
                        pending_count,
                        error: Some(e.to_string()),
                    },
                )]
            }
        }
    }
}
