//! Her mail for clients: a page of what is pending, acknowledging what they have read
//! (group-committed, with her read receipt), and a say through her mouth.
//!
//! A send's request id belongs to the client that chose it: her mouth keys its receipt and the
//! Matrix transaction by the agent and the id ([`owned_request_id`]), so two clients using the
//! same ids each get their own message, and no client can take an id of the gateway's own (her
//! turn loop's `turn:...`, refused here).

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
        agent: &str,
        key: String,
        r: wire::docs::SendRequest,
        in_flight: &Arc<std::sync::atomic::AtomicUsize>,
    ) -> Vec<Answer> {
        if let Some(prefix) = reserved_prefix(&r.request_id) {
            let why =
                format!("request ids beginning {prefix:?} are the gateway's own; choose another");
            return vec![self.refusal(&Request::Send(r), &key, why)];
        }
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
        let client_request_id = r.request_id.clone();
        let request = wire::docs::SendRequest {
            request_id: owned_request_id(agent, &r.request_id),
            ..r
        };
        vec![Answer::Send {
            record_key: key,
            request,
            client_request_id,
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

/// Request ids the gateway gives its own sends (her turn loop's says, `turn:PERSONA:A-B:I`) and
/// the prefix client ids are kept under: a client's id may begin with none of them.
pub const RESERVED_PREFIXES: &[&str] = &["turn:", "checkpoint:", "client:"];

/// The reserved prefix `request_id` begins with, if any.
pub fn reserved_prefix(request_id: &str) -> Option<&'static str> {
    RESERVED_PREFIXES
        .iter()
        .find(|p| request_id.starts_with(*p))
        .copied()
}

/// The id her mouth keeps a client's send under: the agent's name and its request id, each
/// with its length, so no two (agent, id) pairs meet and none meets the gateway's own ids.
pub fn owned_request_id(agent: &str, request_id: &str) -> String {
    format!("client:{}:{agent}:{request_id}", agent.len())
}
