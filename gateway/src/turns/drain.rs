//! Performing `session::turn` (the drain): what her pending mail asks for next (retire, wait,
//! coalesce, a turn), what a batch that fits takes, and what a failed turn leaves (retry,
//! degrade, set aside).

use super::*;

impl Gate {
    /// Her pending mail as her `[persona.turns]` rules see it (`operators`: her operators).
    pub(super) fn lines<'d>(&self, operators: &[String], pending: &'d [Delivery]) -> Vec<Line<'d>> {
        pending
            .iter()
            .map(|d| Line {
                room: &d.room_id,
                sender: &d.sender,
                addressed: d.is_direct || d.to_you,
                operator: operators.contains(&d.sender),
                bot: self.bots.contains(&d.sender),
            })
            .collect()
    }

    /// Books a turn on `batch` started by `trigger` (its seq, and whether ambient mail started
    /// it; `None` for her Minds' request) at `now_ms`.
    fn book(
        &mut self,
        operators: &[String],
        batch: &[Delivery],
        trigger: Option<(u64, bool)>,
        now_ms: i64,
    ) {
        let lines = self.lines(operators, batch);
        let hit = trigger.and_then(|(seq, ambient)| {
            let at = batch.iter().position(|d| d.seq == seq)?;
            Some((lines[at], ambient))
        });
        self.admission.started(
            &self.rules,
            &lines,
            hit.as_ref().map(|(l, _)| l),
            hit.is_some_and(|(_, ambient)| ambient),
            now_ms,
        );
    }
}

impl Refresh {
    /// How much of `batch` fits what is left of her window after her prompt so far (at least
    /// `prompt_tokens`, her system prompt) and a margin for her answer, by an estimate that
    /// errs long ([`session::turn::BYTES_PER_TOKEN`]); with the room (bytes) and her prompt
    /// (tokens) it was weighed against.
    fn fit(&self, prompt_tokens: u64, batch: &[Delivery]) -> (session::turn::Fit, usize, u64) {
        // Kept free for the turn's own growth and her answer: an eighth of her window, at most
        // 16k tokens.
        let margin = (self.policy.context_window / 8).min(16_000);
        let prefix = self.telemetry.prefix_tokens.max(prompt_tokens);
        let room_tokens = self
            .policy
            .blocking_limit()
            .saturating_sub(prefix)
            .saturating_sub(margin);
        let mut context = std::collections::HashSet::new();
        let context_bytes: usize = batch
            .iter()
            .flat_map(|d| &d.context)
            .filter(|c| context.insert(c.event_id.as_str()))
            .map(|c| c.text.len())
            .sum();
        let room = usize::try_from(room_tokens)
            .unwrap_or(usize::MAX)
            .saturating_mul(session::turn::BYTES_PER_TOKEN)
            .saturating_sub(context_bytes);
        let sizes: Vec<usize> = batch.iter().map(|d| d.text.len()).collect();
        (session::turn::fit(&sizes, room), room, prefix)
    }
}

impl TurnLoop {
    /// Books a turn on `batch` started by `trigger` ([`Gate::book`]), and stores what the
    /// rules remember.
    fn book_start(&mut self, batch: &[Delivery], trigger: Option<(u64, bool)>) {
        let now = crate::clock::unix_ms();
        self.gate.book(&self.persona.operators, batch, trigger, now);
        self.keep_learned(ADMISSION, &self.gate.admission);
    }

    /// Runs turns while her mail may start them (by her `[persona.turns]` rules; `forced`: the
    /// first turn is her Minds' request and needs none), or a note asks for a turn; mail that
    /// starts none waits and rides with her next turn. Between turns new mail is coalesced
    /// (`debounce_ms` after the last, `max_wait_ms` at most). Operators' verbs waiting are
    /// applied before each turn, never during one.
    pub async fn drain(
        &mut self,
        stop: &watch::Receiver<bool>,
        forced: bool,
    ) -> Result<(), TurnError> {
        let mut drain = Drain::new(forced);
        self.gate.recheck_at_ms = None;
        loop {
            if *stop.borrow() {
                return Ok(());
            }
            while let Ok(c) = self.control_rx.try_recv() {
                self.apply_control(c).await;
            }
            let id = self.persona.id.clone();
            let page = self.inbox.pending(&id, 0, 1000, None)?;
            let inflight = self.inbox.session_value(&id, "inflight")?.and_then(|v| {
                let (a, b) = v.split_once('-')?;
                Some((a.parse::<u64>().ok()?, b.parse::<u64>().ok()?))
            });
            // A waiting line its author (or a moderator) deleted is dropped from her mail (a
            // batch in flight keeps its lines: it was shown, or is about to be, as it was).
            let deleted: Vec<u64> = page
                .deliveries
                .iter()
                .filter(|d| d.text == crate::event::DELETED)
                .filter(|d| inflight.is_none_or(|(a, b)| d.seq < a || d.seq > b))
                .map(|d| d.seq)
                .collect();
            if !deleted.is_empty() {
                tracing::info!(persona = %id, lines = deleted.len(), "deleted lines dropped from her mail");
                self.inbox.retire(&id, &deleted)?;
                continue;
            }
            let wake_note =
                page.deliveries.is_empty() && self.inbox.pending_notes(&id)?.iter().any(|n| n.wake);
            let budget = self.budget();
            if let Some(o) = budget {
                self.tell_operator_of_budget(o).await;
            }
            let over_budget = budget.is_some_and(|o| !o.operators_only);
            let operators_only = budget.is_some_and(|o| o.operators_only);
            let mut lines = self.gate.lines(&self.persona.operators, &page.deliveries);
            // Past the public share only her operators' lines start turns (the reserve).
            if operators_only {
                for l in lines.iter_mut().filter(|l| !l.operator) {
                    l.addressed = false;
                }
            }
            let rules = if operators_only {
                Rules {
                    start: match self.gate.rules.start {
                        session::admission::Start::All => session::admission::Start::Addressed,
                        s => s,
                    },
                    ambient_every_ms: 0,
                    ..self.gate.rules.clone()
                }
            } else {
                self.gate.rules.clone()
            };
            let look = Look {
                pending: &page.deliveries,
                lines: &lines,
                inflight,
                wake_note,
                over_budget,
                now_ms: crate::clock::unix_ms(),
            };
            let step = drain.next(
                &look,
                &self.gate.admission,
                &rules,
                self.gate.shrink,
                self.persona.session.max_batch,
                self.persona.turns.bound(),
            );
            match step {
                Step::Idle { recheck_at_ms } => {
                    if !page.deliveries.is_empty() {
                        tracing::debug!(persona = %id, pending = page.deliveries.len(), ?recheck_at_ms, "mail waits: nothing in it starts a turn");
                    }
                    self.gate.recheck_at_ms = recheck_at_ms;
                    return Ok(());
                }
                Step::OverBudget => return Ok(()),
                Step::Retire { seqs } => self.retire(&seqs)?,
                Step::Coalesce => {
                    // What came while the last turn ran, and comes just after, joins the next.
                    let mut stop = stop.clone();
                    if !self.debounce(&mut stop).await {
                        return Ok(());
                    }
                    drain.coalesced();
                }
                Step::Notes => {
                    self.carry.degrade = false;
                    self.turn(&[]).await?;
                    self.told();
                }
                Step::Turn {
                    take,
                    retry,
                    trigger,
                    cut: to,
                } => {
                    // Before any model call: a batch her session could not hold whole is
                    // split (or its one message cut), as a refused one would be, rather than
                    // refused, compacted or started fresh.
                    let (fit, room, prefix) = self
                        .refresh
                        .fit(self.claude.prompt_tokens, &page.deliveries[..take]);
                    if fit != session::turn::Fit::Whole {
                        tracing::info!(persona = %self.persona.id, ?fit, room, prefix, "her batch would not fit her window whole: split before any model call");
                    }
                    let take = match fit {
                        session::turn::Fit::Whole => take,
                        session::turn::Fit::Take(n) => n,
                        session::turn::Fit::Cut(_) => 1,
                    };
                    let whole = &page.deliveries[..take];
                    let mut batch: Vec<Delivery> = whole.to_vec();
                    if let (session::turn::Fit::Cut(bytes), Some(d)) = (fit, batch.first_mut()) {
                        cut(d, bytes);
                    }
                    if !retry {
                        self.book_start(&batch, trigger);
                    }
                    if let (Some(bytes), Some(d)) = (to, batch.first_mut()) {
                        cut(d, bytes);
                    }
                    let bound = self.persona.turns.bound();
                    let cuts = if self.gate.rules.start == session::admission::Start::All {
                        Vec::new()
                    } else {
                        session::waiting::to_cut(
                            &batch,
                            &self.gate.lines(&self.persona.operators, whole),
                            bound,
                        )
                    };
                    for i in cuts {
                        if let Some(d) = batch.get_mut(i) {
                            cut_for(d, bound.line_bytes, "it was not meant for you");
                        }
                    }
                    let first = batch.first().map_or(0, |d| d.seq);
                    self.carry.degrade = session::turn::Trouble::degraded(self.gate.trouble, first);
                    if self.carry.degrade {
                        batch.iter_mut().for_each(degrade);
                    }
                    match self.turn(&batch).await {
                        // Nothing of it was shown to her: take less, in a new session (the
                        // refused text may be in the old one's transcript).
                        Err(e @ TurnError::TooLong { .. }) => {
                            let shrink = session::turn::after_too_long(&batch, self.gate.shrink);
                            tracing::warn!(persona = %id, error = %e, ?shrink, "batch too long for a fresh session; taking less");
                            self.fresh_start("the batch does not fit her context window")?;
                            if shrink.is_none() {
                                self.gate.shrink = None;
                                self.after_failure(whole, e)?;
                            } else {
                                self.gate.shrink = shrink;
                            }
                        }
                        Ok(()) => {
                            self.gate.shrink = None;
                            self.set_trouble(None);
                            self.told();
                        }
                        Err(e) => self.after_failure(whole, e)?,
                    }
                }
            }
        }
    }

    /// After a turn on `batch` (as stored) failed with `e`, by [`session::turn::Trouble`]:
    /// retried (the error goes up, for the loop's backoff), tried degraded in a fresh session,
    /// or set aside (and the drain goes on with later mail).
    pub(super) fn after_failure(
        &mut self,
        batch: &[Delivery],
        e: TurnError,
    ) -> Result<(), TurnError> {
        use session::turn::{Fault, Next, Trouble};
        let first = batch.first().map_or(0, |d| d.seq);
        let fault = fault_of(&e);
        let (trouble, next) = Trouble::after(self.gate.trouble, first, fault);
        self.set_trouble(trouble);
        match next {
            Next::Retry => Err(e),
            Next::Degrade => {
                tracing::warn!(persona = %self.persona.id, error = %e, first, "the model API refused her batch: it is tried once more degraded (media as descriptions, long messages cut) in a fresh session");
                // The refused message sits in her session's transcript: a resume sends it again.
                self.fresh_start("the model API refused her batch")?;
                Err(e)
            }
            Next::SetAside => {
                let why = e.to_string();
                let counts =
                    self.inbox
                        .set_aside(&self.persona.id, batch, &why, crate::clock::unix_ms())?;
                tracing::error!(persona = %self.persona.id, first, messages = batch.len(), why = %why, pending = counts.pending, "batch set aside: later mail flows; `client session retry|drop --batch {first}` puts it back or drops it");
                self.metrics
                    .turns
                    .get_or_create(&crate::metrics::OutcomeLabels {
                        persona: self.persona.id.clone(),
                        outcome: "set_aside".to_owned(),
                    })
                    .inc();
                if fault == Fault::Refused {
                    // What was refused is in her transcript still.
                    self.fresh_start("her batch was set aside after a refusal")?;
                }
                self.set_failed(None);
                self.carry.degrade = false;
                self.refresh_set_aside();
                Ok(())
            }
        }
    }

    /// Sets (and stores, when it changed) what failed turns on her oldest batch left.
    pub(super) fn set_trouble(&mut self, trouble: Option<session::turn::Trouble>) {
        if self.gate.trouble != trouble {
            self.gate.trouble = trouble;
            self.keep_learned(TROUBLE, &self.gate.trouble);
        }
    }

    /// A turn went through: the set-aside batches it told her of are told.
    pub(super) fn told(&mut self) {
        let ids = std::mem::take(&mut self.carry.telling);
        if ids.is_empty() {
            return;
        }
        if let Err(e) = self.inbox.set_aside_told(&self.persona.id, &ids) {
            tracing::warn!(persona = %self.persona.id, error = %e, "set-aside batches not marked told; she is told again");
        }
    }

    /// Takes `seqs` out of her mail into her rooms' context (they stay in the timelines she
    /// reads recent lines from), counted in her status and the metrics.
    pub(super) fn retire(&mut self, seqs: &[u64]) -> Result<(), TurnError> {
        let r = self.inbox.retire(&self.persona.id, seqs)?;
        if r.lines > 0 {
            tracing::info!(persona = %self.persona.id, lines = r.lines, pending = r.pending, "waiting lines retired into her rooms' context (turns.waiting_lines / waiting_bytes)");
            self.metrics
                .mail_retired
                .get_or_create(&crate::metrics::PersonaLabel {
                    persona: self.persona.id.clone(),
                })
                .inc_by(r.lines);
            self.records.status.retired_lines += r.lines;
            self.records.save();
        }
        Ok(())
    }

    /// Waits out the quiet period; `false` when stopped.
    pub(super) async fn debounce(&self, stop: &mut watch::Receiver<bool>) -> bool {
        let s = &self.persona.session;
        let first = Instant::now();
        let max_wait = Duration::from_millis(s.max_wait_ms);
        let quiet = Duration::from_millis(s.debounce_ms);
        loop {
            if self.operator_waiting() {
                return true;
            }
            let left = max_wait.saturating_sub(first.elapsed());
            if left.is_zero() {
                return true;
            }
            tokio::select! {
                _ = self.signals.mail.notified() => {}
                _ = self.turn_requests.notified() => return true,
                _ = tokio::time::sleep(quiet.min(left)) => return true,
                _ = stop.changed() => return false,
            }
        }
    }

    pub(super) fn operator_waiting(&self) -> bool {
        self.inbox
            .pending(&self.persona.id, 0, 1000, None)
            .map(|p| {
                p.deliveries
                    .iter()
                    .any(|d| self.persona.operators.contains(&d.sender))
            })
            .unwrap_or(false)
    }
}

/// `d`'s text cut to `bytes` (at a character boundary), saying so.
pub(super) fn cut(d: &mut Delivery, bytes: usize) {
    cut_for(
        d,
        bytes,
        "the whole message does not fit your context window",
    );
}

/// `d`'s text cut to `bytes` (whole characters), saying how much it shows and `why`.
pub(super) fn cut_for(d: &mut Delivery, bytes: usize, why: &str) {
    let whole = d.text.len();
    if whole <= bytes {
        return;
    }
    let at = crate::event::truncate_text(&mut d.text, bytes);
    d.text.push_str(&format!(
        "\n[cut by the gateway: the first {at} of its {whole} bytes; {why}]"
    ));
    d.truncated = true;
}

/// `d` as a degraded batch shows it: its text cut to [`DEGRADED_BYTES`], saying so.
pub(super) fn degrade(d: &mut Delivery) {
    cut_for(d, DEGRADED_BYTES, "the model API refused this batch whole");
}

/// How a failed turn bears on its batch ([`session::turn::Trouble`]).
pub(super) fn fault_of(e: &TurnError) -> session::turn::Fault {
    use session::turn::Fault;
    match e {
        TurnError::Api(Some(s)) if (400..500).contains(s) && *s != 401 && *s != 429 => {
            Fault::Refused
        }
        TurnError::TooLong { .. } => Fault::Refused,
        TurnError::Api(_) | TurnError::Cli(_) => Fault::Failed,
        TurnError::Unauthorized
        | TurnError::Credential(_)
        | TurnError::Inbox(_)
        | TurnError::Send { .. } => Fault::Elsewhere,
    }
}
