//! Delivering her reply through the mouth: each say once (receipts, relations, mentions,
//! pills), her reactions, and the correction when a say could not be sent.

use super::*;

impl TurnLoop {
    /// Sends her reply's says, each at most once (request id `TURN:i`), and commits the turn:
    /// the ack, the notes shown and her extension fields. A reply with says is stored before
    /// the first, so the retry after a say failed (or after a crash between says) sends this
    /// reply again instead of asking her again: she would see the batch twice, and a new reply
    /// could drop or change a say not sent yet. Returns her says, her extension fields and
    /// the outcome.
    pub(super) async fn deliver(
        &mut self,
        turn_id: &str,
        batch: &[Delivery],
        stored: &[crate::inbox::Note],
        output: Option<&serde_json::Value>,
        lines: &[(String, Vec<wire::docs::ContextLine>)],
    ) -> Result<(usize, usize, String), TurnError> {
        let id = self.persona.id.clone();
        let allowed = self.rooms_allowed(batch).await;
        let allowed_refs: Vec<&str> = allowed.iter().map(String::as_str).collect();
        // Her replies, edits and reactions name lines of this batch's conversation only: a
        // public turn does not quote or react in a DM, nor a DM's turn in a room.
        let lines = self.conversation_lines(batch, lines).await;
        let lines = lines.as_slice();
        let mut kept = false;
        let (says, extensions, outcome) = match self.claude.schema.validate(output, &allowed_refs) {
            Ok(reply) => {
                if let (Some(output), false) = (output, reply.say.is_empty()) {
                    let value = serde_json::json!({ "turn": turn_id, "output": output });
                    self.inbox
                        .set_session_value(&id, REPLY, Some(&value.to_string()))?;
                    kept = true;
                }
                let mut refused: Vec<(&str, &str, String)> = Vec::new();
                for (i, say) in reply.say.iter().enumerate() {
                    let request_id = format!("{turn_id}:{i}");
                    let me = self.persona.user_id.as_str();
                    let targets = match render::targets(say, batch, lines, me) {
                        Ok(t) => t,
                        Err(e) => {
                            tracing::warn!(request = %request_id, error = %e, "say refused; not sent");
                            refused.push((&say.room, &say.text, e.to_string()));
                            continue;
                        }
                    };
                    if !targets.unresolved.is_empty() {
                        tracing::warn!(request = %request_id, handles = ?targets.unresolved, "say sent without the lines it named: she never saw them");
                    }
                    let mentions = render::mentioned(say, batch, lines, me);
                    let pills = render::pills(say, batch, &mentions);
                    let receipt = self
                        .mouth
                        .send_shaped(
                            &SendRequest {
                                request_id: request_id.clone(),
                                persona: id.clone(),
                                room: say.room.clone(),
                                text: say.text.clone(),
                                thread_root: targets.thread_root.clone(),
                                reply_to: targets.reply_to.clone(),
                            },
                            &Shape {
                                mentions: Some(&mentions),
                                pills: &pills,
                                replaces: targets.replaces.as_deref(),
                            },
                        )
                        .await;
                    match receipt.status {
                        // Her own line comes back in her rooms' timelines: she said it, so it
                        // is never shown to her again as context.
                        Status::Ok => {
                            if let Some(event) = &receipt.event_id {
                                self.carry.seen.insert(event);
                            }
                        }
                        Status::Failed | Status::Unknown => {
                            return Err(TurnError::Send {
                                request_id,
                                error: receipt.error.unwrap_or_default(),
                            })
                        }
                        // Refused for good (too long, a room she may not post in): not
                        // retried, and her next batch tells her it went nowhere.
                        Status::Rejected => {
                            tracing::warn!(request = %request_id, error = ?receipt.error, "say refused; not retried");
                            refused.push((&say.room, &say.text, receipt.error.unwrap_or_default()));
                        }
                    }
                }
                // Her reactions, each once (request id `TURN:react:i`); one that names no
                // line she saw, or that the homeserver refuses, is logged and left.
                for (i, r) in reply.react.iter().enumerate() {
                    let request_id = format!("{turn_id}:react:{i}");
                    let Some(line) = session::handle::resolve(&r.to, batch, lines) else {
                        tracing::warn!(request = %request_id, to = %r.to, "reaction to a line she never saw; not sent");
                        continue;
                    };
                    let receipt = self
                        .mouth
                        .react(&request_id, line.room_id, line.event_id, &r.key)
                        .await;
                    match receipt.status {
                        Status::Ok => {}
                        Status::Rejected => {
                            tracing::warn!(request = %request_id, error = ?receipt.error, "reaction refused");
                        }
                        Status::Failed | Status::Unknown => {
                            return Err(TurnError::Send {
                                request_id,
                                error: receipt.error.unwrap_or_default(),
                            })
                        }
                    }
                }
                let sent = reply.say.len() - refused.len();
                self.carry.note = session::correction::after(session::correction::Handled::Read {
                    says: reply.say.len(),
                    refused: &refused,
                });
                let outcome = match &self.carry.note {
                    None => "sent".to_owned(),
                    Some(note) => format!("sent {sent} of {}: {note}", reply.say.len()),
                };
                (sent, reply.extensions, outcome)
            }
            Err(e) => {
                tracing::warn!(error = %e, "reply not sent");
                self.carry.note =
                    session::correction::after::<&str>(session::correction::Handled::Unread(&e));
                (0, Vec::new(), e.to_string())
            }
        };
        let shown: Vec<u64> = stored.iter().map(|n| n.seq).collect();
        let acked = batch.last().map(|d| d.seq);
        // With the turn: what her session has seen, the correction her next batch carries
        // (both outlive a restart), and her stored reply gone (a stale one could not match a
        // later turn, seqs are not reused, but it has no use left).
        let seen = self.seen_to_keep(lines);
        let mut values = vec![
            (CORRECTION, self.carry.note.as_deref()),
            (FAILED, None),
            (crate::inbox::retention::KEEP_RECEIPTS, None),
        ];
        if seen.is_some() {
            values.push((SEEN, seen.as_deref()));
        }
        if kept {
            values.push((REPLY, None));
        }
        self.inbox.commit_turn(
            &id,
            &TurnCommit {
                ack_through: acked,
                notes_shown: &shown,
                turn_id,
                extensions: &extensions,
                at_ms: crate::clock::unix_ms(),
                values: &values,
            },
        )?;
        self.carry.restarted = false;
        // She can take turns again.
        self.set_error(None);
        if acked.is_some() {
            self.signals.acked.notify_one();
        }
        let mut last_per_room: BTreeMap<&str, &str> = BTreeMap::new();
        for d in batch {
            last_per_room.insert(&d.room_id, &d.event_id);
        }
        for (room, event) in last_per_room {
            self.mouth.read_receipt(room, event).await;
        }
        Ok((says, extensions.len(), outcome))
    }

    /// Her reply to `turn_id` stored by [`TurnLoop::deliver`], if a say of it failed.
    pub(super) fn stored_reply(&self, turn_id: &str) -> Option<serde_json::Value> {
        let v = self
            .inbox
            .session_value(&self.persona.id, REPLY)
            .ok()
            .flatten()?;
        let mut v: serde_json::Value = serde_json::from_str(&v).ok()?;
        (v["turn"] == turn_id).then(|| v["output"].take())
    }

    /// Of `lines` (her rooms' timelines), those of `batch`'s conversation: its one DM room, or
    /// her rooms that are not DMs.
    pub(super) async fn conversation_lines(
        &self,
        batch: &[Delivery],
        lines: &[(String, Vec<wire::docs::ContextLine>)],
    ) -> Vec<(String, Vec<wire::docs::ContextLine>)> {
        let dm = batch
            .first()
            .filter(|d| d.is_direct)
            .map(|d| d.room_id.as_str());
        let mut out = Vec::new();
        for (room, l) in lines {
            let keep = match dm {
                Some(dm) => room == dm,
                None => {
                    let direct = match matrix_sdk::ruma::OwnedRoomId::try_from(room.as_str())
                        .ok()
                        .and_then(|r| self.mouth.client().get_room(&r))
                    {
                        Some(r) => r.is_direct().await.unwrap_or(true),
                        // A room she no longer knows: its lines are not this conversation's.
                        None => true,
                    };
                    !direct
                }
            };
            if keep {
                out.push((room.clone(), l.clone()));
            }
        }
        out
    }

    /// The rooms her reply may name: her configured rooms, by name and by the id each
    /// resolved to, and the batch's rooms.
    pub(super) async fn rooms_allowed(&self, batch: &[Delivery]) -> Vec<String> {
        let mut rooms: Vec<String> = self.persona.rooms.clone();
        // A configured room by its id too: batches show rooms as "#alias (!id)".
        for name in &self.persona.rooms {
            rooms.extend(self.mouth.resolved(name).await);
        }
        for d in batch {
            rooms.push(d.room_id.clone());
            rooms.extend(d.room_alias.clone());
        }
        rooms
    }
}
