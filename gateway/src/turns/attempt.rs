//! Performing `session::attempt`: one turn's runs of her claude process, the policy's fresh
//! start or compaction, checkpoints, and the bookkeeping of her session between turns.

use super::*;

impl TurnLoop {
    pub(super) async fn ensure_cli(&mut self) -> Result<&mut Cli, DriverError> {
        if self.claude.cli.is_none() {
            // A live process takes one of the gateway's slots, waiting for an idle Persona
            // to stop hers when none is free.
            if let (Some(p), None) = (&self.claude.processes, &self.claude.slot) {
                self.claude.slot =
                    Some(p.acquire(&self.persona.id, self.claude.evict.clone()).await);
            }
            let id = &self.persona.id;
            let mut cfg = self.claude.base.clone();
            match self.inbox.session_value(id, "session_id").ok().flatten() {
                Some(sid) => {
                    let stored = self.inbox.session_value(id, "prompt_hash").ok().flatten();
                    cfg.system_prompt_changed = stored.as_deref() != Some(&self.claude.prompt_hash);
                    cfg.session_id = Some(sid);
                    cfg.resume = true;
                }
                // A new session: `fresh_start` forgot what the old one saw. Not here: the
                // batch it starts with was composed (and marked seen) before the process.
                None => {
                    let sid = uuid::Uuid::new_v4().to_string();
                    // A new session has billed nothing yet.
                    self.records.billed_so_far = Some(KeptTotals {
                        session: sid.clone(),
                        usage: Usage::default(),
                    });
                    cfg.session_id = Some(sid);
                    cfg.resume = false;
                }
            }
            tracing::info!(persona = %id, session = ?cfg.session_id, resume = cfg.resume, "starting the claude CLI");
            self.claude.cli = Some(Cli::spawn(cfg).await?);
        }
        self.claude
            .cli
            .as_mut()
            .ok_or_else(|| DriverError::Exited("no process".into()))
    }

    /// Forgets the session: the next turn starts a fresh one (a new generation).
    pub(super) fn fresh_start(&mut self, why: &str) -> Result<(), InboxError> {
        let id = self.persona.id.clone();
        tracing::info!(persona = %id, why, "fresh session");
        self.claude.cli = None;
        self.carry.seen.clear();
        self.inbox.set_session_value(&id, "session_id", None)?;
        self.records.status.generation += 1;
        self.inbox.set_session_value(
            &id,
            "generation",
            Some(&self.records.status.generation.to_string()),
        )?;
        self.records.status.session_id = None;
        self.refresh.telemetry.after_fresh_start();
        // The new session holds no failed attempt.
        self.set_failed(None);
        Ok(())
    }

    /// Sets (and stores) the turn the model API failed on; a failure to store only means a
    /// restart of the gateway would send its batch again.
    pub(super) fn set_failed(&mut self, failed: Option<ApiFailure>) {
        self.keep_learned(FAILED, &failed);
        self.carry.failed = failed;
    }

    /// Books the gap since her last turn for predictive keep-warm, up to when the batch's first
    /// message was said (`said_ms`, the homeserver's clock), and stores her gaps so a restart
    /// keeps what was learned.
    pub(super) fn book_gap(&mut self, now: Instant, said_ms: i64) {
        let last = self.refresh.telemetry.last_turn_at;
        let said = said_at(now, crate::clock::unix_ms(), said_ms, last);
        if self.refresh.telemetry.batch_arrived(said) {
            self.keep_learned(GAPS, &self.refresh.telemetry.gaps);
        }
    }

    /// Compacts her conversation with the CLI's `/compact` and returns its boundary, `None`
    /// when the CLI did not compact (an error, no boundary): the caller starts fresh then.
    /// The summary is her memory of the lines she saw, so they are not sent again as context:
    /// with a large `context_bytes` that would write back much of what the compaction took out
    /// (the session benchmark's long conversation compacted five times instead of three and
    /// cost 1.12x resume-per-turn).
    pub(super) async fn compact(&mut self, why: &str) -> Option<CompactMetadata> {
        let started = Instant::now();
        // A failed turn's text is summarized with the rest: its retry sends the batch again.
        self.set_failed(None);
        let done = match self.ensure_cli().await {
            Ok(cli) => cli.compact().await,
            Err(e) => Err(e),
        };
        match done {
            Ok(Turn {
                compacted: Some(m),
                result,
                last_request_at,
                ..
            }) if !result.is_error => {
                tracing::info!(persona = %self.persona.id, why, pre = m.pre_tokens, post = m.post_tokens, "session compacted");
                // The CLI reports no usage for `/compact`; its running totals have the summary
                // request. Without them (none of this session's kept) it is estimated: the
                // conversation sent uncached, the kept size as output.
                let (usage, how) = match self.records.billed(&result) {
                    Some(u) => (u, "billed"),
                    None => (
                        Usage {
                            input: m.pre_tokens,
                            output: m.post_tokens,
                            ..Usage::default()
                        },
                        "tokens estimated",
                    ),
                };
                // The CLI bills a `/compact` as a local command (no usage); its boundary's
                // post_tokens (the summary and what was kept) is what the compaction wrote.
                self.refresh
                    .telemetry
                    .after_compact(m.post_tokens, m.post_tokens, last_request_at);
                self.record_upkeep(
                    RecordKind::Compaction,
                    &usage,
                    started,
                    &format!("compacted ({why}); {how}"),
                );
                self.records.status.compactions += 1;
                self.keep_learned(SUMMARIES, &self.refresh.telemetry.summaries);
                Some(m)
            }
            Ok(t) => {
                tracing::warn!(persona = %self.persona.id, why, errors = ?t.result.errors, "compaction did not happen; starting fresh instead");
                // Its summary request may have been billed all the same.
                if let Some(u) = self
                    .records
                    .billed(&t.result)
                    .filter(|u| *u != Usage::default())
                {
                    self.record_upkeep(
                        RecordKind::Compaction,
                        &u,
                        started,
                        &format!("compaction failed ({why}); she starts fresh"),
                    );
                }
                None
            }
            Err(e) => {
                tracing::warn!(persona = %self.persona.id, why, error = %e, "compaction failed; starting fresh instead");
                self.claude.cli = None;
                None
            }
        }
    }

    /// Runs `text` in her process (spawned, resuming her session, if none lives): the turn,
    /// or the event that tells her attempt the process died (its error kept in `died`).
    pub(super) async fn run_text(
        &mut self,
        text: &str,
        images: &[session::proto::Image],
        died: &mut Option<DriverError>,
    ) -> (Option<Turn>, Event) {
        let result = match self.ensure_cli().await {
            Ok(cli) => cli.turn_with(text, images).await,
            Err(e) => Err(e),
        };
        match result {
            Ok(t) => {
                let ran = Ran {
                    outcome: t.result.outcome(),
                    errors: t.result.is_error && !t.result.errors.is_empty(),
                    status: t.result.api_error_status,
                };
                if ran.errors {
                    tracing::warn!(persona = %self.persona.id, errors = ?t.result.errors, "the turn ended in errors");
                }
                (Some(t), Event::Ran(ran))
            }
            Err(e) => {
                self.claude.cli = None;
                *died = Some(e);
                (None, Event::Died)
            }
        }
    }

    /// Whether her stored session's transcript already holds the batch `text` (its header
    /// line): a process that resumes the session will send the model that text again.
    pub(super) fn held_by_session(&self, text: &str) -> bool {
        match (&self.records.status.session_id, render::batch_header(text)) {
            (Some(session), Some(header)) => {
                session::driver::transcript_holds(&self.claude.base, session, header)
            }
            _ => false,
        }
    }

    /// Records the checkpoint turn and commits her reply's fields if she `answered`.
    pub(super) fn keep_checkpoint(
        &mut self,
        turn: Option<&Turn>,
        answered: bool,
        started: Instant,
    ) -> Result<(), TurnError> {
        let Some(turn) = turn else {
            return Ok(());
        };
        let id = self.persona.id.clone();
        let turn_id = format!(
            "checkpoint:{id}:{}:{}",
            self.records.status.generation,
            self.records.status.compactions + 1
        );
        let billed = self
            .records
            .billed(&turn.result)
            .unwrap_or_else(|| turn.result.usage.usage());
        self.record_upkeep(
            RecordKind::Checkpoint,
            &billed,
            started,
            &format!("{:?}", turn.result.outcome()),
        );
        match self
            .claude
            .schema
            .check(turn.result.structured_output.as_ref())
        {
            Ok(reply) if answered => {
                tracing::info!(%turn_id, fields = reply.extensions.len(), unsent_says = reply.say.len(), "checkpoint turn");
                self.inbox.commit_turn(
                    &id,
                    &TurnCommit {
                        turn_id: &turn_id,
                        extensions: &reply.extensions,
                        at_ms: crate::clock::unix_ms(),
                        ..TurnCommit::default()
                    },
                )?;
            }
            Ok(_) => {
                tracing::warn!(%turn_id, outcome = ?turn.result.outcome(), "checkpoint turn failed")
            }
            Err(e) => tracing::warn!(%turn_id, error = %e, "checkpoint reply not kept"),
        }
        Ok(())
    }

    #[tracing::instrument(skip_all, fields(persona = %self.persona.id, turn = tracing::field::Empty))]
    pub(super) async fn turn(&mut self, batch: &[Delivery]) -> Result<(), TurnError> {
        let id = self.persona.id.clone();
        let span = batch.first().zip(batch.last()).map(|(f, l)| (f.seq, l.seq));
        // The notes it shows: those waiting; a retried batch shows the same ones, no newer.
        let mut stored = self.inbox.pending_notes(&id)?;
        if let Some(through) = self
            .inbox
            .session_value(&id, "inflight_notes")?
            .and_then(|v| v.parse::<u64>().ok())
            .filter(|_| span.is_some())
        {
            stored.retain(|n| n.seq <= through);
        }
        let note_span = stored
            .first()
            .zip(stored.last())
            .map(|(f, l)| (f.seq, l.seq));
        let turn_id = match (span, note_span) {
            (Some((a, b)), _) => format!("turn:{id}:{a}-{b}"),
            (None, Some((a, b))) => format!("turn:{id}:n{a}-{b}"),
            (None, None) => return Ok(()),
        };
        tracing::Span::current().record("turn", turn_id.as_str());
        // A batch already in flight is a retry: a turn before may have left it in her
        // transcript.
        let inflight = span.map(|(first, last)| format!("{first}-{last}"));
        let retried = inflight.is_some()
            && self.inbox.session_value(&id, "inflight")?.as_deref() == inflight.as_deref();
        // Stored together (one flush): the batch and the notes in flight, and its says'
        // receipts (`TURN:i`) kept whatever their age until the turn is committed, so a reply
        // sent again after a long outage sends each say at most once.
        let keep = format!("{turn_id}:");
        let through = note_span.map(|(_, through)| through.to_string());
        let mut values = vec![(crate::inbox::retention::KEEP_RECEIPTS, Some(keep.as_str()))];
        if inflight.is_some() {
            values.push(("inflight", inflight.as_deref()));
        }
        if through.is_some() {
            values.push(("inflight_notes", through.as_deref()));
        }
        self.inbox.set_session_values(&id, &values)?;
        let stored_output = self.stored_reply(&turn_id);
        let started = Instant::now();
        // What a fresh start would write: its rehydration, then the lines this session holds
        // that the rehydration leaves out, which her rooms' next batches show again.
        let lines = self.room_lines();
        let decision = if stored_output.is_some() {
            Decision::Continue
        } else {
            if let Some(first) = batch.first() {
                self.book_gap(started, first.ts);
            }
            self.refresh.telemetry.batch_waiting = true;
            self.refresh.telemetry.process = if self.claude.cli.is_some() {
                Process::Running
            } else {
                Process::Stopped
            };
            self.refresh.telemetry.base_tokens = self.claude.prompt_tokens;
            let (rehydrated, resent) = render::fresh_start_bytes(
                &self.latest_notes(&[]),
                &lines,
                self.persona.limits.context_lines,
                self.persona.limits.context_bytes,
                &self.carry.seen,
            );
            self.refresh.telemetry.rehydration_tokens =
                self.claude.prompt_tokens + rehydrated as u64 / 4;
            self.refresh.telemetry.resend_tokens = resent as u64 / 4;
            let decision = if self.records.status.session_id.is_none() {
                Decision::Continue
            } else {
                policy::decide(&self.refresh.telemetry, started, &self.refresh.policy)
            };
            tracing::info!(?decision, telemetry = ?self.refresh.telemetry, "turn decision");
            self.metrics.decision(&id, decision_name(&decision));
            decision
        };
        // The session that will run this batch: the live process's, else the stored one.
        let next_session = self
            .claude
            .cli
            .as_ref()
            .and_then(Cli::session_id)
            .or(self.records.status.session_id.as_deref())
            .map(str::to_owned);
        let api_failed = self
            .carry
            .failed
            .as_ref()
            .filter(|f| f.turn_id == turn_id && Some(&f.session) == next_session.as_ref())
            .map(|f| f.status);
        let (mut attempt, mut action) = Attempt::start(Start {
            stored_reply: stored_output.is_some(),
            has_session: self.records.status.session_id.is_some(),
            live: self.claude.cli.is_some(),
            retried,
            api_failed,
            decision,
            checkpoint: self.persona.session.checkpoint_before_compact,
            restarted: self.carry.restarted,
        });
        let rooms: Vec<String> = batch
            .iter()
            .map(|d| d.room_id.clone())
            .collect::<std::collections::BTreeSet<_>>()
            .into_iter()
            .collect();
        let typing = (stored_output.is_none()).then(|| self.mouth.typing_while(rooms));
        // What the session had seen before the batch's text: if it refuses the batch, it saw
        // none of it.
        let mut seen_before = None;
        // The text of the current run, and the last run's turn and the error its process died
        // of.
        let mut text = String::new();
        let mut turn = None;
        let mut died = None;
        // The batch's images, sent with the text while it carries the batch.
        let mut images: Vec<session::proto::Image> = Vec::new();
        let mut carries_batch = false;
        let checkpoint_started = Instant::now();
        loop {
            tracing::debug!(?action, "turn action");
            let event = match action {
                Action::SendStored => {
                    // She answered this batch and a say failed (or the gateway stopped between
                    // says): the same reply is sent, each say at most once; she is not asked
                    // again.
                    tracing::info!("sending her stored reply to this batch");
                    self.deliver(&turn_id, batch, &stored, stored_output.as_ref(), &lines)
                        .await?;
                    // Counted as a turn that went out, after the one whose say failed (counted
                    // by the turn loop as `send_failed`); nothing was billed for it.
                    self.metrics
                        .turn(&id, "sent", started.elapsed().as_secs_f64());
                    return Ok(());
                }
                Action::FreshStart(why) => {
                    self.fresh_start(&why.describe())?;
                    Event::Done
                }
                Action::Compact(why) => {
                    // The refused message, as her transcript names it: a refused turn stays in
                    // the CLI's conversation, and when it did not fit the summary request
                    // either the compaction keeps it verbatim past the summary
                    // (`live_session::a_refused_turn_is_kept_verbatim_past_the_compaction_after_it`):
                    // sent again, she would see the batch twice.
                    let refused = match (
                        why,
                        &self.records.status.session_id,
                        render::batch_header(&text),
                    ) {
                        (CompactWhy::Refused, Some(session), Some(header)) => {
                            session::driver::transcript_user_message(
                                &self.claude.base,
                                session,
                                header,
                            )
                        }
                        _ => None,
                    };
                    match self.compact(&why.describe()).await {
                        Some(m) => Event::Compacted {
                            kept_refused: refused
                                .is_some_and(|id| m.preserved_messages.uuids.contains(&id)),
                        },
                        None => Event::CompactFailed,
                    }
                }
                Action::Compose => {
                    seen_before.get_or_insert_with(|| self.carry.seen.clone());
                    // Her batch's images and text files, fetched (and decrypted) now; a
                    // degraded batch keeps their descriptions.
                    if self.carry.degrade {
                        text = self.compose(batch, &stored);
                        images = Vec::new();
                    } else {
                        let media = crate::media::prepare(
                            self.mouth.client(),
                            &id,
                            batch,
                            &self.persona.limits,
                        )
                        .await;
                        text = self.compose(&media.apply(batch), &stored);
                        images = media.images;
                    }
                    carries_batch = true;
                    Event::Done
                }
                Action::Unsee => {
                    if let Some(seen) = &seen_before {
                        self.carry.seen = seen.clone();
                    }
                    Event::Done
                }
                Action::CheckTranscript => Event::Held(self.held_by_session(&text)),
                Action::Run(t) => {
                    if matches!(t, Text::Retry { .. }) {
                        seen_before.get_or_insert_with(|| self.carry.seen.clone());
                    }
                    // The batch's images go with its text, not with a note that replaces it.
                    if matches!(t, Text::Retry { .. } | Text::Checkpoint) {
                        carries_batch = false;
                    }
                    let sent = self.text_for(t, batch, &mut text);
                    let with: &[session::proto::Image] = if carries_batch { &images } else { &[] };
                    let (t, event) = self.run_text(&sent, with, &mut died).await;
                    turn = t;
                    event
                }
                Action::KeepCheckpoint { answered } => {
                    self.keep_checkpoint(turn.as_ref(), answered, checkpoint_started)?;
                    Event::Done
                }
                Action::Deliver | Action::Fail(_) | Action::Compacted { .. } => break,
            };
            action = attempt.on(event);
            if event == Event::Died {
                respawning(&self.persona.id, &action, died.as_ref());
            }
        }
        if let Some(typing) = typing {
            typing.stop().await;
        }
        let turn = match (action, turn) {
            (Action::Deliver, Some(turn)) => turn,
            (Action::Fail(Failure::TooLong), _) => {
                return Err(TurnError::TooLong {
                    deliveries: batch.len(),
                    bytes: batch.iter().map(|d| d.text.len()).sum(),
                })
            }
            (Action::Fail(Failure::Unauthorized), _) => return Err(TurnError::Unauthorized),
            (Action::Fail(Failure::Api { status }), turn) => {
                // Its text is in the transcript of the session it ran in.
                let failed = turn
                    .and_then(|t| t.result.session_id)
                    .map(|session| ApiFailure {
                        turn_id,
                        session,
                        status,
                    });
                self.set_failed(failed);
                return Err(TurnError::Api(status));
            }
            _ => {
                return Err(TurnError::Cli(died.unwrap_or_else(|| {
                    DriverError::Exited("resume kept failing".into())
                })))
            }
        };
        let res = &turn.result;
        if let Some(sid) = &res.session_id {
            if self.records.status.session_id.as_deref() != Some(sid) {
                self.inbox.set_session_value(&id, "session_id", Some(sid))?;
                self.inbox
                    .set_session_value(&id, "prompt_hash", Some(&self.claude.prompt_hash))?;
                self.records.status.session_id = Some(sid.clone());
            }
        }
        // A turn whose say failed was billed all the same: it is recorded, then fails.
        let delivered = self
            .deliver(
                &turn_id,
                batch,
                &stored,
                res.structured_output.as_ref(),
                &lines,
            )
            .await;
        let (says, extensions, outcome) = match &delivered {
            Ok((says, extensions, outcome)) => (*says, *extensions, outcome.clone()),
            Err(e) => (0, 0, e.to_string()),
        };
        let shown = stored.len();
        // What it billed: every request of the turn (a reply bounced by the schema is asked
        // for again), and anything since the last result the result leaves out.
        let own = res.usage.usage();
        let billed = self.records.billed(res).unwrap_or(own);
        // The prefix the policy watches: the last request's prompt, with the turn's output.
        let last = turn.last_request.map_or(own, |last| Usage {
            output: own.output,
            ..last
        });
        self.refresh
            .telemetry
            .book_earlier_reads(&turn.earlier_reads, &self.refresh.prices);
        self.refresh.telemetry.after_turn(
            &last,
            res.outcome(),
            turn.last_request_at,
            Instant::now(),
            &self.refresh.prices,
        );
        // Before the record: a crash between the two loses the record, not bills it twice.
        self.keep_session();
        let (first_seq, last_seq) = span.unwrap_or_default();
        let record = TurnRecord {
            first_seq,
            last_seq,
            notes: shown,
            extensions,
            cli_cost_usd: res.total_cost_usd,
            says,
            decision: format!("{decision:?}"),
            // A rebuild's (the old design's) price, not a fresh start's: that also counts
            // what her rooms would send again, which a rebuild per turn never held.
            rebuild_usd: Prices::dollars(
                self.refresh.telemetry.rehydration_tokens,
                self.refresh.policy.prices.write(self.refresh.policy.ttl),
            ),
            fresh_start_usd: policy::rebuild_cost(&self.refresh.telemetry, &self.refresh.policy),
            ..self.refresh.record(
                self.records.status.generation,
                RecordKind::Turn,
                &billed,
                &last,
                started,
                outcome,
            )
        };
        let m = self.metrics.clone();
        // A say that failed fails the turn, which the turn loop counts by its error.
        if delivered.is_ok() {
            m.turn(
                &id,
                if record.outcome == "sent" {
                    "sent"
                } else {
                    "not_sent"
                },
                started.elapsed().as_secs_f64(),
            );
        }
        m.usage(&id, &billed, record.cost_usd);
        tracing::info!(?record, "turn done");
        self.records.write_turn(record);
        delivered.map(drop)
    }

    pub(super) async fn shutdown(&mut self) {
        if let Some(cli) = self.claude.cli.take() {
            cli.shutdown(Duration::from_secs(5)).await;
        }
    }
}

/// The name of a refresh decision, without its reason (a metrics label).
/// Logs what her attempt does after her process died of `error`: respawn it, or give up
/// the round (its runs are spent).
pub(super) fn respawning(persona: &str, next: &Action, error: Option<&DriverError>) {
    let error = error.map(ToString::to_string).unwrap_or_default();
    if next.is_final() {
        tracing::warn!(
            persona,
            error,
            "claude CLI failed; its runs are spent, the round fails"
        );
    } else {
        tracing::warn!(persona, error, "claude CLI failed; respawning");
    }
}
