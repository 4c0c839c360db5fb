//! Her operators' verbs on her session (status, reset, compact, model, retry and drop of a
//! set-aside batch), applied between turns.

use super::*;

impl TurnLoop {
    /// Applies an operator's verb (between turns) and answers it.
    pub(super) async fn apply_control(&mut self, c: Control) {
        let action = c.request.action;
        tracing::info!(persona = %self.persona.id, ?action, model = ?c.request.model, "session verb");
        let mut previous = None;
        let result: Result<(), String> = match action {
            ControlAction::Status => Ok(()),
            ControlAction::Reset => {
                previous = self.status.session_id.clone();
                self.retire_session("operator reset").await
            }
            ControlAction::Compact => {
                if self.status.session_id.is_none() {
                    Err("she has no session to compact yet".to_owned())
                } else if self.over_budget() {
                    Err(self
                        .status
                        .over_budget
                        .map(|o| o.describe())
                        .unwrap_or_default())
                } else {
                    let before = self.telemetry.prefix_tokens;
                    match self.compact_on_request().await {
                        Ok(true) => {
                            tracing::info!(
                                before,
                                after = self.telemetry.prefix_tokens,
                                "compacted on request"
                            );
                            Ok(())
                        }
                        Ok(false) => {
                            Err("the CLI did not compact; she starts fresh instead".to_owned())
                        }
                        Err(e) => Err(e.to_string()),
                    }
                }
            }
            ControlAction::Model => match c.request.model.as_deref().map(str::trim) {
                Some(m) if !m.is_empty() && m.len() <= 128 => {
                    previous = self.status.session_id.clone();
                    let m = m.to_owned();
                    match self
                        .inbox
                        .set_session_value(&self.persona.id, "model", Some(&m))
                    {
                        Ok(()) => {
                            self.prices = prices_for(&self.persona, &m);
                            self.policy.prices = self.prices;
                            self.base.model = m.clone();
                            self.status.model = m;
                            self.retire_session("model switch").await
                        }
                        Err(e) => Err(e.to_string()),
                    }
                }
                _ => Err("a model switch needs a model name (1 to 128 bytes)".to_owned()),
            },
            ControlAction::Retry | ControlAction::Drop => match c.request.batch {
                None => Err("retry and drop name a set-aside batch (--batch ID)".to_owned()),
                Some(batch) => {
                    let id = &self.persona.id;
                    let done = if action == ControlAction::Retry {
                        self.inbox.retry_set_aside(id, batch).map(|s| s.is_some())
                    } else {
                        self.inbox.drop_set_aside(id, batch)
                    };
                    match done {
                        Ok(true) => {
                            tracing::info!(persona = %id, batch, ?action, "set-aside batch");
                            if action == ControlAction::Retry {
                                self.signals.mail.notify_one();
                            }
                            Ok(())
                        }
                        Ok(false) => Err(format!("she has no set-aside batch {batch}")),
                        Err(e) => Err(e.to_string()),
                    }
                }
            },
            ControlAction::Unknown => Err("unknown session action".to_owned()),
        };
        self.refresh_set_aside();
        let (status, error) = match result {
            Ok(()) => (Status::Ok, None),
            Err(e)
                if matches!(
                    action,
                    ControlAction::Unknown
                        | ControlAction::Model
                        | ControlAction::Retry
                        | ControlAction::Drop
                ) =>
            {
                (Status::Rejected, Some(e))
            }
            Err(e) => (Status::Failed, Some(e)),
        };
        self.save_status();
        let receipt = ControlReceipt {
            persona: self.persona.id.clone(),
            action,
            status,
            session_id: self.status.session_id.clone(),
            previous_session_id: previous,
            generation: self.status.generation,
            model: self.base.model.clone(),
            turns_total: self.status.turns_total,
            prefix_tokens: (self.telemetry.prefix_tokens > 0)
                .then_some(self.telemetry.prefix_tokens),
            set_aside: self.status.set_aside.clone(),
            error,
        };
        let _ = c.reply.send(receipt);
    }

    /// Ends her session for good (its transcript stays on disk, resumable by its id) and
    /// starts a fresh one at the next turn.
    pub(super) async fn retire_session(&mut self, why: &str) -> Result<(), String> {
        if let Some(old) = self.status.session_id.clone() {
            self.status.previous_sessions.push(old);
            let n = self.status.previous_sessions.len();
            if n > 20 {
                self.status.previous_sessions.drain(..n - 20);
            }
        }
        self.shutdown().await;
        self.fresh_start(why).map_err(|e| e.to_string())
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
