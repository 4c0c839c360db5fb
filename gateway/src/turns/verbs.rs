//! Her operators' verbs on her session (status, reset, compact, model, retry and drop of a
//! set-aside batch), applied between turns.

use session::verbs::{self, Perform, Performed};

use super::*;

impl TurnLoop {
    /// Applies an operator's verb (between turns) and answers it: what it does is decided by
    /// [`session::verbs::perform`], performed here, answered by [`session::verbs::answer`].
    pub(super) async fn apply_control(&mut self, c: Control) {
        let action = c.request.action;
        tracing::info!(persona = %self.persona.id, ?action, model = ?c.request.model, "session verb");
        let her = verbs::Her {
            has_session: self.records.status.session_id.is_some(),
            over_budget: self
                .over_budget()
                .then(|| self.records.status.over_budget.map(|o| o.describe()))
                .flatten(),
        };
        let mut previous = None;
        let performed = match verbs::perform(&c.request, &her) {
            Perform::Answer(status, why) => Err((status, why)),
            Perform::Report => Ok(Performed::Done),
            Perform::EndSession => {
                previous = self.records.status.session_id.clone();
                Ok(self.end_session("operator reset").await)
            }
            Perform::Compact => {
                let before = self.refresh.telemetry.prefix_tokens;
                Ok(match self.compact_on_request().await {
                    Ok(true) => {
                        tracing::info!(
                            before,
                            after = self.refresh.telemetry.prefix_tokens,
                            "compacted on request"
                        );
                        Performed::Done
                    }
                    Ok(false) => Performed::Failed(
                        "the CLI did not compact; she starts fresh instead".to_owned(),
                    ),
                    Err(e) => Performed::Failed(e.to_string()),
                })
            }
            Perform::SwitchModel(m) => {
                previous = self.records.status.session_id.clone();
                Ok(
                    match self
                        .inbox
                        .set_session_value(&self.persona.id, "model", Some(&m))
                    {
                        Ok(()) => {
                            self.refresh.prices = prices_for(&self.persona, &m);
                            self.refresh.policy.prices = self.refresh.prices;
                            self.claude.base.model = m.clone();
                            self.records.status.model = m;
                            self.end_session("model switch").await
                        }
                        Err(e) => Performed::Failed(e.to_string()),
                    },
                )
            }
            Perform::Retry(batch) => Ok(self.set_aside(batch, true)),
            Perform::Drop(batch) => Ok(self.set_aside(batch, false)),
        };
        self.refresh_set_aside();
        let (status, error) = match performed {
            Ok(p) => verbs::answer(p),
            Err((status, why)) => (status, Some(why)),
        };
        self.records.save();
        let receipt = ControlReceipt {
            persona: self.persona.id.clone(),
            action,
            status,
            session_id: self.records.status.session_id.clone(),
            previous_session_id: previous,
            generation: self.records.status.generation,
            model: self.claude.base.model.clone(),
            turns_total: self.records.status.turns_total,
            prefix_tokens: (self.refresh.telemetry.prefix_tokens > 0)
                .then_some(self.refresh.telemetry.prefix_tokens),
            set_aside: self.records.status.set_aside.clone(),
            error,
        };
        let _ = c.reply.send(receipt);
    }

    /// Puts a set-aside batch back into her mail (`retry`, and wakes her loop) or drops it.
    fn set_aside(&mut self, batch: u64, retry: bool) -> Performed {
        let id = &self.persona.id;
        let done = if retry {
            self.inbox.retry_set_aside(id, batch).map(|s| s.is_some())
        } else {
            self.inbox.drop_set_aside(id, batch)
        };
        match done {
            Ok(true) => {
                tracing::info!(persona = %id, batch, retry, "set-aside batch");
                if retry {
                    self.signals.mail.notify_one();
                }
                Performed::Done
            }
            Ok(false) => Performed::NoSuchBatch(batch),
            Err(e) => Performed::Failed(e.to_string()),
        }
    }

    /// Ends her session for good (its transcript stays on disk, resumable by its id) and
    /// starts a fresh one at the next turn.
    async fn end_session(&mut self, why: &str) -> Performed {
        verbs::keep_previous(
            &mut self.records.status.previous_sessions,
            self.records.status.session_id.clone(),
        );
        self.shutdown().await;
        match self.fresh_start(why) {
            Ok(()) => Performed::Done,
            Err(e) => Performed::Failed(e.to_string()),
        }
    }

    /// Her operator's compaction, performed as her attempt decides it ([`Attempt::compaction`]):
    /// a checkpoint turn first when configured; a failed compaction is a fresh start. Whether
    /// the CLI compacted.
    pub(super) async fn compact_on_request(&mut self) -> Result<bool, TurnError> {
        let (mut attempt, mut action) =
            Attempt::compaction(self.persona.session.checkpoint_before_compact);
        let mut text = String::new();
        let mut turn = None;
        let mut died = None;
        let started = Instant::now();
        loop {
            let event = match action {
                Action::Compacted { compacted } => return Ok(compacted),
                Action::Run(t) => {
                    let sent = self.text_for(t, &[], &mut text);
                    let (t, event) = self.run_text(&sent, &[], &mut died).await;
                    turn = t;
                    event
                }
                Action::KeepCheckpoint { answered } => {
                    if let Err(e) = self.keep_checkpoint(turn.as_ref(), answered, started) {
                        tracing::warn!(persona = %self.persona.id, error = %e, "checkpoint turn failed; compacting anyway");
                    }
                    Event::Done
                }
                Action::Compact(why) => match self.compact(&why.describe()).await {
                    Some(_) => Event::Compacted {
                        kept_refused: false,
                    },
                    None => Event::CompactFailed,
                },
                Action::FreshStart(why) => {
                    self.fresh_start(&why.describe())?;
                    Event::Done
                }
                Action::CheckTranscript => Event::Held(self.held_by_session(&text)),
                other => {
                    tracing::error!(?other, "an action an operator's compaction does not take");
                    return Ok(false);
                }
            };
            action = attempt.on(event);
            if event == Event::Died {
                respawning(&self.persona.id, &action, died.as_ref());
            }
        }
    }
}
