//! The texts a turn sends: her batch with its notes, a new session's recent lines, the retry
//! and checkpoint notes.

use super::*;

impl TurnLoop {
    /// The text `t` names: the batch as composed, a retry note, the last text again, the
    /// checkpoint note. `last` is the text of the current run (the composed batch, a retry
    /// note, the checkpoint note), which a text sent `Again` repeats.
    pub(super) fn text_for(&mut self, t: Text, batch: &[Delivery], last: &mut String) -> String {
        match t {
            Text::Composed => last.clone(),
            Text::Retry { why, restart } => {
                // The batch is in her transcript: it counts as shown.
                render::render(batch, &mut self.carry.seen, &[]);
                let restart = restart.map(|r| self.restart_note(r));
                tracing::info!(why = %why.describe(), "retrying without the batch: her session holds it");
                *last = self.carry.retry_text(restart, &why.describe());
                last.clone()
            }
            Text::Again { restart: None } => last.clone(),
            Text::Again { restart: Some(r) } => render::with_note(last, &self.restart_note(r)),
            Text::Checkpoint => {
                *last = self.carry.checkpoint_text();
                last.clone()
            }
        }
    }

    /// The note that tells her she was restarted: what, how long since her last turn, and
    /// whether her session was resumed.
    pub(super) fn restart_note(&self, what: Restarted) -> Note {
        let what = match what {
            Restarted::Gateway => "the gateway",
            Restarted::Process => "your claude process",
        };
        let last = self
            .inbox
            .session_value(&self.persona.id, "last_turn_ms")
            .ok()
            .flatten()
            .and_then(|v| v.parse::<i64>().ok());
        let ago = match last {
            Some(at) => format!(
                "your last turn was {} ago",
                human_duration(crate::clock::unix_ms().saturating_sub(at))
            ),
            None => "the time of your last turn is not known".to_owned(),
        };
        let session = if self.records.status.session_id.is_some() {
            "your session was resumed: the conversation above continues"
        } else {
            "this is a fresh session: your earlier conversation is not in it"
        };
        Note::new("restart", format!("{what} was restarted; {ago}; {session}"))
    }

    /// The user message of a turn: header, notes (the gateway's, then her Minds'), the batch,
    /// and for a new session what it is given to start from.
    pub(super) fn compose(&mut self, batch: &[Delivery], stored: &[crate::inbox::Note]) -> String {
        let mut notes = Vec::new();
        if self.carry.restarted {
            notes.push(self.restart_note(Restarted::Gateway));
        }
        if let Some(c) = &self.carry.note {
            notes.push(Note::new("correction", c.clone()));
        }
        self.carry.telling.clear();
        let aside = self
            .inbox
            .set_aside_list(&self.persona.id)
            .unwrap_or_default();
        // What was set aside is not shown again as context or recent lines either: the API
        // refused it, and would refuse the turn that carried it.
        for d in aside.iter().flat_map(|a| &a.deliveries) {
            self.carry.seen.insert(&d.event_id);
        }
        for a in aside.into_iter().filter(|a| !a.told) {
            let rooms: std::collections::BTreeSet<String> = a
                .deliveries
                .iter()
                .map(|d| {
                    let room = d.room_alias.as_deref().unwrap_or(&d.room_id);
                    format!("\"{}\"", session::untrusted::field(room, 128))
                })
                .collect();
            notes.push(Note::new(
                "set_aside",
                format!(
                    "{} message(s) from {} were set aside unanswered, and you have not seen them: {} Her operator may put them back or drop them.",
                    a.deliveries.len(),
                    rooms.into_iter().collect::<Vec<_>>().join(", "),
                    a.why
                ),
            ));
            self.carry.telling.push(a.id);
        }
        notes.extend(
            stored
                .iter()
                .map(|n| Note::from_minds(&n.kind, n.text.clone())),
        );
        let mut text = render::render(batch, &mut self.carry.seen, &notes);
        if self.records.status.session_id.is_none() {
            // A session after an earlier one (not her very first) is given the recent lines.
            let had_session =
                self.records.status.turns_total > 0 || self.records.status.generation > 0;
            let shown: Vec<&str> = stored.iter().map(|n| n.kind.as_str()).collect();
            // After the batch: its deliveries and context are not repeated.
            let rooms = if had_session {
                self.room_lines()
            } else {
                Vec::new()
            };
            text.push_str(&render::rehydration(
                &self.latest_notes(&shown),
                &rooms,
                self.persona.limits.context_lines,
                self.persona.limits.context_bytes / 2,
                &mut self.carry.seen,
            ));
        }
        text
    }

    /// The latest note of each replacing kind (or her `state_file` while no `state` note came)
    /// other than the kinds `skip` (shown in the batch itself): what a new session is given.
    pub(super) fn latest_notes(&self, skip: &[&str]) -> Vec<Note> {
        let mut latest: Vec<Note> = self
            .inbox
            .latest_notes(&self.persona.id)
            .unwrap_or_default()
            .into_iter()
            .map(|(kind, text)| Note::new(&kind, text))
            .collect();
        if !latest.iter().any(|n| n.kind == "state") {
            if let Some(path) = &self.persona.session.state_file {
                match std::fs::read_to_string(path) {
                    Ok(text) if !text.trim().is_empty() => {
                        latest.insert(0, Note::new("state", text));
                    }
                    Ok(_) => {}
                    Err(e) => {
                        tracing::warn!(path = %path.display(), error = %e, "state_file not read");
                    }
                }
            }
        }
        latest.retain(|n| !skip.contains(&n.kind.as_str()));
        latest
    }

    /// Her rooms' timelines as the inbox holds them, oldest line first.
    pub(super) fn room_lines(&self) -> Vec<(String, Vec<wire::docs::ContextLine>)> {
        let id = &self.persona.id;
        self.inbox
            .timeline_rooms(id)
            .unwrap_or_default()
            .into_iter()
            .map(|room| {
                let lines = self
                    .inbox
                    .timeline(id, &room)
                    .unwrap_or_default()
                    .into_iter()
                    .map(|l| l.line)
                    .collect();
                (room, lines)
            })
            .collect()
    }
}

impl Carry {
    /// The message of a retry whose batch her session holds already: the `restart` note if
    /// any, and a `[retry]` note saying `why` (the batch is "above").
    fn retry_text(&mut self, restart: Option<Note>, why: &str) -> String {
        let mut notes: Vec<Note> = restart.into_iter().collect();
        notes.push(Note::new(
            "retry",
            format!("{why}, which you have not answered yet: answer it now (it is not repeated)"),
        ));
        render::render(&[], &mut self.seen, &notes)
    }

    /// The text of a checkpoint turn (before a planned compaction, with
    /// `checkpoint_before_compact`): it asks her to put what she must keep into her reply's
    /// extension fields, which go to the outbox; her says in it are not sent.
    fn checkpoint_text(&mut self) -> String {
        let note = Note::new(
            "checkpoint",
            "your conversation is about to be compacted: only a summary of it will remain. Put \
             what you must keep into your reply's fields now. Say nothing: says in this reply \
             are not sent.",
        );
        render::render(&[], &mut self.seen, &[note])
    }
}
