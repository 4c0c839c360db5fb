//! Answers as documents: receipts, refusals with their status, errors, and their ids and
//! timestamps.

use super::*;

/// A receipt document in a `cultnet.document_put_raw.v0` message.
pub fn receipt_bytes<T: Serialize>(
    runtime_id: &str,
    schema: &str,
    key: &str,
    payload: &T,
) -> Bytes {
    let mut doc =
        RawDocument::from_payload(schema, key, &rfc3339(crate::clock::unix_ms()), payload);
    doc.source_runtime_id = Some(runtime_id.to_owned());
    doc.source_role = Some("matrix_gateway".to_owned());
    Bytes::from(
        Message::DocumentPutRaw(Put {
            message_id: message_id(),
            document: doc,
        })
        .encode(),
    )
}

pub(super) fn error(text: String) -> Answer {
    Answer::Reply(Bytes::from(
        Message::Error(ErrorMsg { error: text }).encode(),
    ))
}

/// A new message id (a v4 UUID, hyphenated), written without the formatting machinery.
pub fn message_id() -> String {
    uuid::Uuid::new_v4()
        .hyphenated()
        .encode_lower(&mut uuid::Uuid::encode_buffer())
        .to_owned()
}

/// `unix_ms` as RFC 3339 in UTC with milliseconds (`1970-01-01T00:00:00.000Z`).
pub fn rfc3339(unix_ms: i64) -> String {
    let secs = unix_ms.div_euclid(1000);
    let ms = unix_ms.rem_euclid(1000);
    let days = secs.div_euclid(86_400);
    let rem = secs.rem_euclid(86_400);
    // Civil from days (H. Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    // Digits by hand rather than `format!`: every answer carries a timestamp.
    if !(0..=9999).contains(&year) {
        // Outside RFC 3339's four digits (a clock far off): the general form.
        return format!(
            "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{ms:03}Z",
            rem / 3600,
            rem % 3600 / 60,
            rem % 60
        );
    }
    let mut out = String::with_capacity(24);
    let fields = [
        (year, 4, '-'),
        (month, 2, '-'),
        (day, 2, 'T'),
        (rem / 3600, 2, ':'),
        (rem % 3600 / 60, 2, ':'),
        (rem % 60, 2, '.'),
        (ms, 3, 'Z'),
    ];
    for (n, width, then) in fields {
        for k in (0..width).rev() {
            let d = n.unsigned_abs() / 10u64.pow(k) % 10;
            out.push(char::from(b'0' + d as u8));
        }
        out.push(then);
    }
    out
}

impl Service {
    pub(super) fn refusal(&self, req: &Request, key: &str, why: String) -> Answer {
        self.refusal_with(req, key, why, Status::Rejected)
    }

    /// The receipt of a request not carried out, with `status` (`rejected`: not allowed;
    /// `failed`: retry later), or an error for requests whose answers carry no status.
    pub(super) fn refusal_with(
        &self,
        req: &Request,
        key: &str,
        why: String,
        status: Status,
    ) -> Answer {
        match req {
            Request::Ack(r) => self.receipt(
                ids::ACK_RECEIPT,
                key,
                &AckReceipt {
                    persona: r.persona.clone(),
                    status,
                    through_seq: r.through_seq,
                    pending_count: 0,
                    error: Some(why),
                },
            ),
            Request::Send(r) => self.receipt(
                ids::SEND_RECEIPT,
                key,
                &SendReceipt {
                    request_id: r.request_id.clone(),
                    status,
                    error: Some(why),
                    ..SendReceipt::default()
                },
            ),
            Request::Turn(r) => self.receipt(
                ids::TURN_RECEIPT,
                key,
                &TurnReceipt {
                    persona: r.persona.clone(),
                    status,
                    error: Some(why),
                    ..TurnReceipt::default()
                },
            ),
            Request::Note(r) => self.receipt(
                ids::NOTE_RECEIPT,
                key,
                &NoteReceipt {
                    persona: r.persona.clone(),
                    note_id: r.note_id.clone(),
                    status,
                    error: Some(why),
                    ..NoteReceipt::default()
                },
            ),
            Request::Control(r) => self.receipt(
                ids::CONTROL_RECEIPT,
                key,
                &ControlReceipt {
                    persona: r.persona.clone(),
                    action: r.action,
                    status,
                    error: Some(why),
                    ..ControlReceipt::default()
                },
            ),
            Request::ExtensionAck(r) => self.receipt(
                ids::EXTENSION_ACK_RECEIPT,
                key,
                &ExtensionAckReceipt {
                    persona: r.persona.clone(),
                    status,
                    through_seq: r.through_seq,
                    error: Some(why),
                    ..ExtensionAckReceipt::default()
                },
            ),
            _ => error(format!("request {key:?}: {why}")),
        }
    }

    pub(super) fn receipt<T: Serialize>(&self, schema: &str, key: &str, payload: &T) -> Answer {
        Answer::Reply(receipt_bytes(&self.runtime_id, schema, key, payload))
    }
}
