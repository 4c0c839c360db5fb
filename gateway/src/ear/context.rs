//! Context the stored timeline cannot give: a cold room's history (`/messages`) and a thread
//! older than the timeline (`/event` for its root, `/relations` for its replies). A failed read
//! leaves the context to the stored lines, with a warning; a delivery never fails for it.

use std::collections::{HashMap, VecDeque};

use matrix_sdk::room::MessagesOptions;
use matrix_sdk::ruma::UInt;
use matrix_sdk::Room;
use serde_json::Value;

use super::{Ear, Timeline};
use crate::event;
use crate::inbox::{TimelineLine, TIMELINE_CAP};

impl Ear {
    /// When a room's stored timeline is shorter than a delivery's context (a cold start: the
    /// first sync or a join seeded fewer lines than `context_lines`), reads the room's latest
    /// events once per process with `/messages` and puts the lines older than the stored ones in
    /// front of them. Returns those lines, to be stored with the response. A failed read leaves
    /// the context to the stored lines, with a warning.
    ///
    /// The read goes back from `before`, the response's `prev_batch` (where its timeline
    /// starts): read from the room's newest event instead, it would also return what was
    /// said after the response, and put it in front of the stored lines as if it were old. The
    /// next response's delivery of it would then have no context, and the timeline would hold
    /// it out of order. Without the token, the events newer than the response's are skipped.
    pub(super) async fn backfill(
        &mut self,
        room: &Room,
        room_id: &str,
        events: &[(bool, Value)],
        before: Option<&str>,
    ) -> Vec<TimelineLine> {
        let want = self.persona.limits.context_lines;
        let have = self.timelines.get(room_id).map_or(0, VecDeque::len);
        if have >= want || !self.backfilled.insert(room_id.to_owned()) {
            return Vec::new();
        }
        let fresh: std::collections::HashSet<&str> = events
            .iter()
            .filter_map(|(_, v)| v.get("event_id")?.as_str())
            .collect();
        // Newest first: each line not stored yet and not in this response is older than the
        // stored ones (a gap since the last response was filled into `events`). State events
        // take room in a page too, so read on until enough lines (at most three pages).
        let mut older = Vec::new();
        let mut from: Option<String> = before.map(str::to_owned);
        let mut older_than_held = event::OlderThanHeld::new(from.is_some());
        for _ in 0..3 {
            let mut opts = MessagesOptions::backward();
            opts.from = from.take();
            opts.limit = UInt::new((want + events.len()).min(1000) as u64).unwrap_or_default();
            let page = match room.messages(opts).await {
                Ok(page) => page,
                Err(e) => {
                    tracing::warn!(persona = %self.persona.id, room = %room_id, "context not fetched; the stored lines only: {e}");
                    break;
                }
            };
            let n = page.chunk.len();
            for ev in page.chunk {
                let Ok(v) = serde_json::from_str::<Value>(ev.raw().json().get()) else {
                    continue;
                };
                let id = v
                    .get("event_id")
                    .and_then(Value::as_str)
                    .unwrap_or_default();
                let known = self
                    .timelines
                    .get(room_id)
                    .is_some_and(|tl| tl.iter().any(|(_, l)| l.event_id == id));
                if !older_than_held.take(fresh.contains(id) || known) {
                    continue;
                }
                let name = self.sender_name(room, &v).await;
                if let Some(line) = event::context_line(&v, name) {
                    older.push((event::thread_of(&v).map(str::to_owned), line));
                }
            }
            match page.end {
                Some(end) if n > 0 && have + older.len() < want => from = Some(end),
                _ => break,
            }
        }
        let tl = self.timelines.entry(room_id.to_owned()).or_default();
        let mut stored = Vec::new();
        for (thread, line) in older {
            if tl.len() >= TIMELINE_CAP {
                break;
            }
            tl.push_front((thread.clone(), line.clone()));
            stored.push(TimelineLine {
                room_id: room_id.to_owned(),
                thread,
                line,
            });
        }
        stored.reverse();
        tracing::debug!(persona = %self.persona.id, room = %room_id, lines = stored.len(), "context read with /messages");
        stored
    }

    /// A thread message's context starts with its root. When the root is older than the
    /// stored timeline it is fetched (`/event`); a failed fetch leaves the context as it is,
    /// with a warning, and never fails the delivery.
    pub(super) async fn thread_roots<'d>(
        &self,
        deliveries: impl Iterator<Item = &'d mut wire::docs::Delivery>,
    ) {
        let limits = &self.persona.limits;
        let mut fetched: HashMap<String, Timeline> = HashMap::new();
        for d in deliveries {
            let Some(root) = d.thread_root.clone() else {
                continue;
            };
            if d.context.iter().any(|c| c.event_id == root) {
                continue;
            }
            // The thread began before the stored timeline: read it from the homeserver.
            if !fetched.contains_key(&root) {
                let lines = self.fetch_thread(&d.room_id, &root).await;
                fetched.insert(root.clone(), lines);
            }
            let Some(thread) = fetched.get(&root) else {
                continue;
            };
            let mut merged: Vec<(Option<String>, wire::docs::ContextLine)> = thread
                .iter()
                .filter(|(_, l)| l.event_id != d.event_id && l.ts <= d.ts)
                .cloned()
                .collect();
            for c in &d.context {
                if !merged.iter().any(|(_, l)| l.event_id == c.event_id) {
                    merged.push((Some(root.clone()), c.clone()));
                }
            }
            merged.sort_by_key(|(_, l)| l.ts);
            merged.push((
                Some(root.clone()),
                wire::docs::ContextLine {
                    event_id: d.event_id.clone(),
                    ..Default::default()
                },
            ));
            let mut context = event::context_for(
                merged.iter(),
                &d.event_id,
                Some(&root),
                limits.context_lines,
                limits.context_bytes,
            );
            // The root leads a thread's context even when the cap would cut it.
            if let Some((_, line)) = thread.iter().find(|(_, l)| l.event_id == root) {
                if !context.iter().any(|c| c.event_id == root) {
                    context.insert(0, line.clone());
                    if context.len() > limits.context_lines {
                        context.remove(1);
                    }
                }
            }
            d.context = context;
        }
    }

    /// Puts the line each reply answers at the head of its context when it is not there (from
    /// the stored timeline, or read with `/event`), so her batch can quote it even when she saw
    /// it long ago. A read that fails leaves the reply without its quote, with a warning.
    pub(super) async fn reply_targets<'d>(
        &self,
        deliveries: impl Iterator<Item = &'d mut wire::docs::Delivery>,
    ) {
        for d in deliveries {
            let Some(target) = d.reply_to.clone() else {
                continue;
            };
            if d.context.iter().any(|c| c.event_id == target) {
                continue;
            }
            let stored = self
                .timelines
                .get(&d.room_id)
                .and_then(|tl| tl.iter().find(|(_, l)| l.event_id == target))
                .map(|(_, l)| l.clone());
            let line = match stored {
                Some(l) => Some(l),
                None => self.fetch_line(&d.room_id, &target).await,
            };
            match line {
                Some(l) => d.context.insert(0, l),
                None => {
                    tracing::warn!(persona = %self.persona.id, room = %d.room_id, event = %target, "the line a reply answers was not found; shown without it");
                }
            }
        }
    }

    /// A thread older than the stored timeline: its root (`/event`) and its latest replies
    /// (`/relations`, `m.thread`), oldest first. What fails to arrive is left out, with a
    /// warning; the delivery never fails for it.
    async fn fetch_thread(&self, room_id: &str, root: &str) -> Timeline {
        let mut out = Timeline::new();
        match self.fetch_line(room_id, root).await {
            Some(line) => out.push_back((None, line)),
            None => {
                tracing::warn!(persona = %self.persona.id, room = %room_id, root = %root, "thread root not fetched; context without it");
            }
        }
        let ids = (
            matrix_sdk::ruma::OwnedRoomId::try_from(room_id).ok(),
            matrix_sdk::ruma::OwnedEventId::try_from(root).ok(),
        );
        let (Some(room_id), Some(root_id)) = ids else {
            return out;
        };
        let Some(room) = self.client.get_room(&room_id) else {
            return out;
        };
        let opts = matrix_sdk::room::RelationsOptions {
            include_relations: matrix_sdk::room::IncludeRelations::RelationsOfType(
                matrix_sdk::ruma::events::relation::RelationType::Thread,
            ),
            limit: UInt::new(self.persona.limits.context_lines as u64),
            ..Default::default()
        };
        match room.relations(root_id, opts).await {
            Ok(rel) => {
                // Newest first as they come.
                for ev in rel.chunk.into_iter().rev() {
                    let Ok(v) = serde_json::from_str::<Value>(ev.raw().json().get()) else {
                        continue;
                    };
                    let name = self.sender_name(&room, &v).await;
                    if let Some(line) = event::context_line(&v, name) {
                        out.push_back((event::thread_of(&v).map(str::to_owned), line));
                    }
                }
            }
            Err(e) => {
                tracing::warn!(persona = %self.persona.id, room = %room_id, root = %root, "thread replies not fetched: {e}");
            }
        }
        out
    }

    async fn fetch_line(&self, room_id: &str, event_id: &str) -> Option<wire::docs::ContextLine> {
        let room = self
            .client
            .get_room(&matrix_sdk::ruma::OwnedRoomId::try_from(room_id).ok()?)?;
        let id = matrix_sdk::ruma::OwnedEventId::try_from(event_id).ok()?;
        let ev = room.event(&id, None).await.ok()?;
        let v: Value = serde_json::from_str(ev.raw().json().get()).ok()?;
        let name = self.sender_name(&room, &v).await;
        event::context_line(&v, name)
    }
}
