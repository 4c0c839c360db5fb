//! Her turn loop itself: the loop and its timers (idle checks, keep-warm and eviction, the
//! debounce), her process's start and stop.

use super::*;

impl TurnLoop {
    /// Runs until `stop` turns true; the CLI is shut down on the way out.
    pub async fn run(mut self, mut stop: watch::Receiver<bool>) {
        // Her budget's metrics start from "within" (a reload restarts her turn loop); her
        // first check publishes what holds.
        let label = crate::metrics::PersonaLabel {
            persona: self.persona.id.clone(),
        };
        self.metrics.over_budget.get_or_create(&label).set(0);
        self.metrics.budget_resumes_at.get_or_create(&label).set(0);
        let mut backoff = Backoff::new(Duration::from_secs(1), Duration::from_secs(60));
        let grace = Duration::from_secs(self.persona.session.shutdown_grace_secs);
        let stopping = stop.clone();
        // Her Minds asked for a turn: the next drain takes one whatever the rules say.
        let mut forced = false;
        loop {
            let drained = {
                let drain = self.drain(&stopping, forced);
                tokio::pin!(drain);
                tokio::select! {
                    r = &mut drain => Some(r),
                    _ = stop.changed() => {
                        // Stop taking turns; a turn in flight may end within the grace.
                        match tokio::time::timeout(grace, &mut drain).await {
                            Ok(r) => tracing::info!(result = ?r.err().map(|e| e.to_string()), "turn in flight ended at shutdown"),
                            Err(_) => tracing::warn!(?grace, "turn in flight given up at shutdown; its batch is retried after the restart"),
                        }
                        None
                    }
                }
            };
            let Some(drained) = drained else { break };
            match drained {
                Ok(()) => {
                    backoff.reset();
                    let over = self.records.status.over_budget.map(|o| o.describe());
                    self.set_error(over);
                }
                Err(e) => {
                    let wait = backoff.next(None);
                    tracing::warn!(persona = %self.persona.id, error = %e, ?wait, "turn round failed; retrying");
                    let credential =
                        matches!(e, TurnError::Unauthorized | TurnError::Credential(_));
                    self.metrics
                        .turns
                        .get_or_create(&crate::metrics::OutcomeLabels {
                            persona: self.persona.id.clone(),
                            outcome: e.kind().to_owned(),
                        })
                        .inc();
                    self.set_error(Some(e.to_string()));
                    tokio::select! {
                        _ = tokio::time::sleep(wait) => {}
                        _ = stop.changed() => break,
                    }
                    if credential {
                        self.reload_credential().await;
                    }
                    continue;
                }
            }
            let turn_requested = loop {
                self.refresh.telemetry.batch_waiting = false;
                // Idle: her process, if it lives, may be stopped for another Persona's; a
                // process that stopped frees its slot.
                if self.claude.cli.is_none() {
                    self.claude.slot = None;
                }
                if let Some(p) = &self.claude.processes {
                    p.idle(&self.persona.id);
                }
                self.refresh.telemetry.process = if self.claude.cli.is_some() {
                    Process::Running
                } else {
                    Process::Stopped
                };
                // A check that already fired and changed nothing is not repeated.
                let at = policy::next_check(
                    &self.refresh.telemetry,
                    &self.refresh.policy,
                    self.refresh.fired,
                );
                let timer = at.map(tokio::time::Instant::from_std);
                let sleep = async {
                    match timer {
                        Some(at) => tokio::time::sleep_until(at).await,
                        None => std::future::pending().await,
                    }
                };
                // Waiting mail is looked at again when she resumes from her budget, or when it
                // may start a turn without new mail (a sender's hour or the ambient interval).
                let look_again = [
                    self.records.status.over_budget.map(|o| o.resumes_at_ms),
                    self.gate.recheck_at_ms,
                ]
                .into_iter()
                .flatten()
                .min()
                .map(|at| {
                    let wait = (at - crate::clock::unix_ms()).max(0) as u64;
                    tokio::time::sleep(Duration::from_millis(wait))
                });
                let looked_again = async {
                    match look_again {
                        Some(sleep) => sleep.await,
                        None => std::future::pending().await,
                    }
                };
                tokio::select! {
                    _ = self.claude.evict.notified() => {
                        if self.claude.cli.is_some() {
                            tracing::info!(persona = %self.persona.id, "stopping her idle process to make room for another Persona's (her session is resumed at her next turn)");
                            self.shutdown().await;
                            self.refresh.telemetry.process = Process::Stopped;
                        }
                        self.claude.slot = None;
                    }
                    _ = looked_again => break false,
                    _ = self.signals.mail.notified() => break false,
                    _ = self.turn_requests.notified() => break true,
                    Some(c) = self.control_rx.recv() => self.apply_control(c).await,
                    _ = stop.changed() => return self.shutdown().await,
                    _ = sleep => {
                        self.refresh.fired = at;
                        self.idle_check().await;
                    }
                }
            };
            forced = turn_requested;
            // Working from here (the debounce too): her process is not stopped for another's
            // while her turn is about to start.
            if let Some(p) = &self.claude.processes {
                p.busy(&self.persona.id);
            }
            if !forced && !self.debounce(&mut stop).await {
                break;
            }
        }
        self.shutdown().await;
    }

    /// Reads her credential file again and restarts her process with it (the credential
    /// lives in the process's start-up).
    pub(super) async fn reload_credential(&mut self) {
        match self.persona.session.load_credential(&self.persona.id) {
            Ok(c) => {
                tracing::info!(persona = %self.persona.id, "model credential read again");
                self.claude.base.credential = c;
                self.shutdown().await;
            }
            Err(e) => {
                tracing::error!(persona = %self.persona.id, "model credential: {e}");
                self.set_error(Some(TurnError::Credential(e.to_string()).to_string()));
            }
        }
    }

    /// While idle, at the time the policy asked for: keep the cache warm or evict.
    pub(super) async fn idle_check(&mut self) {
        let now = Instant::now();
        let decision = policy::decide(&self.refresh.telemetry, now, &self.refresh.policy);
        tracing::info!(persona = %self.persona.id, ?decision, telemetry = ?self.refresh.telemetry, "idle decision");
        self.metrics
            .decision(&self.persona.id, decision_name(&decision));
        let open = self.budget().is_none();
        match policy::idle(decision, self.records.status.session_id.is_some(), open) {
            policy::Idle::SkipForBudget => {
                tracing::info!(persona = %self.persona.id, "keep-warm skipped: her budget is kept for her operators' turns, or spent");
                // Not again before her next turn.
                self.refresh.telemetry.last_cache_touch = None;
            }
            policy::Idle::KeepWarm => {
                let Some(sid) = self.records.status.session_id.clone() else {
                    return;
                };
                match session::driver::refresh_fork(&self.claude.base, &sid).await {
                    Ok(r) => {
                        let usage = r.usage.usage();
                        let cost = usage.cost(&self.refresh.prices);
                        // Its touch is its start: the expiry reckoned from it is never late.
                        let missed = self.refresh.telemetry.after_keep_warm(
                            &usage,
                            cost,
                            now,
                            now.elapsed(),
                            &self.refresh.policy,
                        );
                        self.records.status.refreshes += 1;
                        let outcome = if missed {
                            "refreshed; the cache entry had expired"
                        } else {
                            "refreshed"
                        };
                        self.record_upkeep(RecordKind::Refresh, &usage, now, outcome);
                        tracing::info!(
                            persona = %self.persona.id,
                            cost,
                            missed,
                            read = usage.cache_read,
                            next_lead_ms = self.refresh.telemetry.keep_warm_lead(&self.refresh.policy).as_millis() as u64,
                            "kept warm"
                        );
                    }
                    Err(e) => {
                        tracing::warn!(persona = %self.persona.id, error = %e, "keep-warm failed");
                        // Do not try again before the next turn.
                        self.refresh.telemetry.last_cache_touch = None;
                        self.keep_session();
                    }
                }
            }
            policy::Idle::Evict => {
                self.shutdown().await;
                self.refresh.telemetry.process = Process::Stopped;
            }
            policy::Idle::Nothing => {}
        }
    }
}
