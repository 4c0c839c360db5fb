//! Her records: her history, her spend against her budget (and the notice to her operator),
//! her status file and the values her session keeps between runs.

use super::*;

/// What a history record is: one of her turns, or what her session cost between turns.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RecordKind {
    /// A turn: a batch (or notes) shown, her reply handled.
    #[default]
    Turn,
    /// The turn before a planned compaction that asks her what to keep (says not sent).
    Checkpoint,
    /// A `/compact`. The CLI reports no usage for it: its tokens are the step of the session's
    /// running totals, or, without an earlier result of the session in this run to step
    /// from, an estimate (the conversation sent uncached, the size it kept as output).
    Compaction,
    /// A keep-warm refresh (a one-token fork of her session that reads its prefix).
    Refresh,
}

/// One record of her history (`turns.jsonl`; her turns also in the status file).
#[derive(Debug, Clone, Default, Serialize, serde::Deserialize)]
#[serde(default)]
pub struct TurnRecord {
    /// A turn, or what her session cost between turns (older records: a turn).
    pub kind: RecordKind,
    /// Batch seqs.
    pub first_seq: u64,
    /// Batch seqs.
    pub last_seq: u64,
    /// Session generation.
    pub generation: u64,
    /// Wall time of the turn (ms), CLI included.
    pub duration_ms: u64,
    /// Input tokens not from cache.
    pub input_tokens: u64,
    /// Cache reads.
    pub cache_read_tokens: u64,
    /// Cache writes.
    pub cache_write_tokens: u64,
    /// Output tokens.
    pub output_tokens: u64,
    /// Share of the prompt read from cache.
    pub hit_ratio: f64,
    /// The CLI's own cumulative cost estimate.
    pub cli_cost_usd: f64,
    /// Says sent.
    pub says: usize,
    /// Notes shown.
    pub notes: usize,
    /// Extension fields queued.
    pub extensions: usize,
    /// The policy's decision before the turn.
    pub decision: String,
    /// Billed cost by the price table (dollars).
    pub cost_usd: f64,
    /// What became of the reply.
    pub outcome: String,
    /// When it ended (ms since the epoch).
    pub at_ms: i64,
    /// Its prompt in tokens (uncached + cache reads + cache writes).
    pub prefix_tokens: u64,
    /// Where the policy acts (tokens).
    pub watermark_tokens: u64,
    /// The model's context window (tokens).
    pub window_tokens: u64,
    /// What a rebuild (a new session given the rehydration, as the old design did every turn)
    /// would cost now, dollars.
    pub rebuild_usd: f64,
    /// What a fresh start of her session would cost now, dollars: the rebuild, and the recent
    /// lines of her rooms this session holds that the rehydration leaves out, which their next
    /// batches would show again (the price the ski-rental rule weighs).
    pub fresh_start_usd: f64,
}

/// Her status file (`STATE/personas/ID/status.json`): her session, her last turns, why she
/// cannot take turns now, what she holds back.
#[derive(Debug, Default, Serialize, serde::Deserialize)]
#[serde(default)]
pub(super) struct StatusFile {
    pub(super) persona: String,
    pub(super) session_id: Option<String>,
    pub(super) generation: u64,
    pub(super) turns_total: u64,
    /// Compactions carried out (by `/compact`).
    #[serde(default)]
    pub(super) compactions: u64,
    /// Keep-warm refreshes made.
    #[serde(default)]
    pub(super) refreshes: u64,
    /// What she cost outside her turns (refreshes, compactions, checkpoints), dollars; with
    /// her turns' costs, what the model API billed for her.
    #[serde(default)]
    pub(super) upkeep_usd: f64,
    pub(super) turns: VecDeque<TurnRecord>,
    /// Her model (the configured one, or the last operator's switch).
    #[serde(default)]
    pub(super) model: String,
    /// Sessions before a reset or model switch, newest last (each still resumable).
    #[serde(default)]
    pub(super) previous_sessions: Vec<String>,
    /// Why her session cannot take turns now (`unauthorized: ...`), until a turn succeeds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) last_error: Option<String>,
    /// Her spend has reached her daily cap: nothing that costs starts before it resumes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) over_budget: Option<OverBudget>,
    /// Waiting lines retired from her mail into her rooms' context, in all.
    #[serde(default)]
    pub(super) retired_lines: u64,
    /// Her batches set aside (the model API kept refusing them), oldest first.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub(super) set_aside: Vec<wire::docs::SetAsideBatch>,
    /// When her operator was told she stopped for her budget (until she is within it again).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) budget_notice_at_ms: Option<i64>,
}

/// Her records: her status file, her history beside it, and her spend in the last 24 hours
/// (read from the history at start, when she has a cap).
pub(super) struct Records {
    pub(super) status: StatusFile,
    /// Her status file.
    pub(super) path: PathBuf,
    /// Lines in her history file (counted on first use).
    history_lines: Option<usize>,
    /// History records kept (`session.history_turns`).
    history_turns: usize,
    /// What she was billed in the last 24 hours, against her daily cap (`None`: no cap).
    pub(super) spend: Option<session::budget::Spend>,
    /// Her session's running totals at its last result, so that each record bills what the
    /// API billed since ([`Records::billed`]); stored, so a restart of the gateway keeps
    /// them for the session it resumes.
    pub(super) billed_so_far: Option<KeptTotals>,
}

impl Records {
    /// Her records at `path`, her spend read from her history when she has a cap (a new cap
    /// comes with a restart of her loop).
    pub(super) fn new(
        status: StatusFile,
        path: PathBuf,
        persona: &Persona,
        billed_so_far: Option<KeptTotals>,
    ) -> Self {
        let spend = persona.budget.usd_per_day.map(|_| {
            let mut spend = session::budget::Spend::default();
            let since = crate::clock::unix_ms() - session::budget::WINDOW_MS;
            for r in read_history(&path.with_file_name(HISTORY_FILE)).unwrap_or_default() {
                if r.at_ms > since {
                    spend.add(r.at_ms, r.cost_usd);
                }
            }
            spend
        });
        Self {
            status,
            path,
            history_lines: None,
            history_turns: persona.session.history_turns,
            spend,
            billed_so_far,
        }
    }

    /// Writes her status file (through a rename; a failure is logged: the next write mends it).
    pub(super) fn save(&self) {
        let tmp = self.path.with_extension("json.tmp");
        let bytes = serde_json::to_vec_pretty(&self.status).unwrap_or_default();
        if let Err(e) = std::fs::write(&tmp, bytes).and_then(|()| std::fs::rename(&tmp, &self.path))
        {
            tracing::warn!(error = %e, path = %self.path.display(), "status file not written");
        }
    }

    /// Appends `record` to her history file and her spend (a failure is logged: the turn is
    /// done anyway).
    pub(super) fn append(&mut self, record: &TurnRecord) {
        if let Some(spend) = &mut self.spend {
            spend.add(record.at_ms, record.cost_usd);
        }
        if let Err(e) = append_history(
            &self.path.with_file_name(HISTORY_FILE),
            record,
            self.history_turns,
            &mut self.history_lines,
        ) {
            tracing::warn!(error = %e, "history not written");
        }
    }

    /// Records a turn: in her history, and among the last turns of her status file.
    pub(super) fn write_turn(&mut self, record: TurnRecord) {
        self.append(&record);
        self.status.turns_total += 1;
        self.status.turns.push_back(record);
        while self.status.turns.len() > TELEMETRY_KEPT {
            self.status.turns.pop_front();
        }
        self.save();
    }

    /// What her session billed since its last result, from the running totals of `result`
    /// (`None` when they cannot tell: another session, or none of this session's totals
    /// known); the totals are kept for the next result (and stored by
    /// [`TurnLoop::keep_session`] before its record is written).
    pub(super) fn billed(&mut self, result: &session::proto::ResultEvent) -> Option<Usage> {
        let (session, usage) = (result.session_id.clone()?, result.cumulative()?);
        let since = match &self.billed_so_far {
            Some(k) if k.session == session => usage.since(&k.usage),
            _ => None,
        };
        self.billed_so_far = Some(KeptTotals { session, usage });
        since
    }
}

impl Refresh {
    /// A record of what her session billed (`billed`) since the last, in her session `generation`, with the prompt of its
    /// last request (`last`: the prefix and its hit share) and its wall time since `started`.
    pub(super) fn record(
        &self,
        generation: u64,
        kind: RecordKind,
        billed: &Usage,
        last: &Usage,
        started: Instant,
        outcome: String,
    ) -> TurnRecord {
        TurnRecord {
            kind,
            generation,
            duration_ms: started.elapsed().as_millis() as u64,
            input_tokens: billed.input,
            cache_read_tokens: billed.cache_read,
            cache_write_tokens: billed.cache_write_5m + billed.cache_write_1h,
            output_tokens: billed.output,
            cost_usd: billed.cost(&self.prices),
            hit_ratio: last.hit_ratio(),
            prefix_tokens: last.prompt_tokens(),
            outcome,
            at_ms: crate::clock::unix_ms(),
            watermark_tokens: self.policy.watermark_tokens(),
            window_tokens: self.policy.context_window,
            ..TurnRecord::default()
        }
    }
}

impl TurnLoop {
    /// Whether her spend in the last 24 hours has reached her daily cap, so nothing that costs
    /// may start now (her operators' reserve aside: see [`TurnLoop::budget`]).
    pub(super) fn over_budget(&mut self) -> bool {
        self.budget().is_some_and(|o| !o.operators_only)
    }

    /// Where her spend stands against her cap and her operators' reserve (`None`: open). Keeps
    /// her status, her metrics and the log up to date as it changes.
    pub(super) fn budget(&mut self) -> Option<OverBudget> {
        let now = crate::clock::unix_ms();
        let b = &self.persona.budget;
        let over = self
            .records
            .spend
            .as_mut()
            .and_then(|s| OverBudget::of(s.share(now, b.usd_per_day, b.operator_reserve)));
        if over != self.records.status.over_budget {
            let label = crate::metrics::PersonaLabel {
                persona: self.persona.id.clone(),
            };
            let m = self.metrics.clone();
            m.over_budget
                .get_or_create(&label)
                .set(i64::from(over.is_some()));
            m.budget_resumes_at
                .get_or_create(&label)
                .set(over.map_or(0, |o| o.resumes_at_ms / 1000));
            match &over {
                Some(o) if o.operators_only => {
                    tracing::warn!(persona = %self.persona.id, spent_usd = o.spent_usd, cap_usd = o.cap_usd, resumes_at_ms = o.resumes_at_ms, "the public share of her budget is spent: only her operators' lines start turns, from the reserve")
                }
                Some(o) => {
                    tracing::warn!(persona = %self.persona.id, spent_usd = o.spent_usd, cap_usd = o.cap_usd, resumes_at_ms = o.resumes_at_ms, "over her budget: no turn starts until she resumes")
                }
                None => tracing::info!(persona = %self.persona.id, "within her budget again"),
            }
            if over.is_none() {
                self.records.status.budget_notice_at_ms = None;
            }
            self.records.status.over_budget = over;
            self.records.save();
            self.set_error(over.map(|o| o.describe()));
        }
        over
    }

    /// Tells her operator, once while she is held by her budget, in her DM with him, what she
    /// spent, when she resumes, and how to raise her budget (sent by the gateway in her name,
    /// at most once per episode: its request id is the episode's).
    pub(super) async fn tell_operator_of_budget(&mut self, over: OverBudget) {
        if self.records.status.budget_notice_at_ms.is_some() {
            return;
        }
        let now = crate::clock::unix_ms();
        let mut dm = None;
        for room in self.mouth.client().joined_rooms() {
            let operator = room.is_direct().await.unwrap_or(false)
                && room.direct_targets().iter().any(|t| {
                    t.as_user_id()
                        .is_some_and(|u| self.persona.operators.iter().any(|o| o == u.as_str()))
                });
            if operator {
                dm = Some(room.room_id().to_string());
                break;
            }
        }
        self.records.status.budget_notice_at_ms = Some(now);
        self.records.save();
        let Some(room) = dm else {
            tracing::warn!(persona = %self.persona.id, "no DM with an operator to tell of her budget; the log and her status say it");
            return;
        };
        let receipt = self
            .mouth
            .send(&SendRequest {
                request_id: format!("budget:{}:{now}", self.persona.id),
                persona: self.persona.id.clone(),
                room: room.clone(),
                text: over.notice(&self.persona.user_id),
                thread_root: None,
                reply_to: None,
            })
            .await;
        match receipt.status {
            Status::Ok => {
                tracing::info!(persona = %self.persona.id, room = %room, "her operator was told of her budget")
            }
            _ => {
                tracing::warn!(persona = %self.persona.id, room = %room, error = ?receipt.error, "her operator could not be told of her budget")
            }
        }
    }

    /// Records why her session cannot take turns (for her status file and CultNet status).
    pub(super) fn set_error(&mut self, error: Option<String>) {
        if self.records.status.last_error == error {
            return;
        }
        *self
            .signals
            .session_error
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = error.clone();
        self.records.status.last_error = error;
        self.records.save();
    }

    /// Stores something the turn loop keeps across restarts (JSON in her session values: what
    /// the policy learned, a failed turn); see [`TurnLoop::store_json`].
    pub(super) fn keep_learned<T: Serialize>(&self, name: &str, value: &T) {
        self.store_json(&[(name, serde_json::to_string(value))]);
    }

    /// Stores session values serialized as JSON, all with one flush; a `null` (an `Option`
    /// that is `None`) removes the value. A failure is logged: a restart would only start
    /// over what they held.
    pub(super) fn store_json(&self, values: &[(&str, serde_json::Result<String>)]) {
        let stored = values
            .iter()
            .map(|(name, v)| match v {
                Ok(v) => Ok((*name, (v != "null").then_some(v.as_str()))),
                Err(e) => Err(e.to_string()),
            })
            .collect::<Result<Vec<_>, _>>()
            .and_then(|vs| {
                self.inbox
                    .set_session_values(&self.persona.id, &vs)
                    .map_err(|e| e.to_string())
            });
        if let Err(e) = stored {
            let names: Vec<&str> = values.iter().map(|(n, _)| *n).collect();
            tracing::warn!(persona = %self.persona.id, ?names, error = %e, "session values not stored; a restart starts them over");
        }
    }

    /// Records what her session cost outside a turn (a refresh, a compaction, a checkpoint):
    /// in her history, her status file's upkeep and the cost metrics, so that what she is
    /// reported to cost is what the model API billed.
    pub(super) fn record_upkeep(
        &mut self,
        kind: RecordKind,
        usage: &Usage,
        started: Instant,
        outcome: &str,
    ) {
        self.keep_session();
        let record = self.refresh.record(
            self.records.status.generation,
            kind,
            usage,
            usage,
            started,
            outcome.to_owned(),
        );
        self.metrics.usage(&self.persona.id, usage, record.cost_usd);
        self.records.append(&record);
        self.records.status.upkeep_usd += record.cost_usd;
        self.records.save();
    }

    /// Stores, with one flush, what a restart of the gateway goes on from for the session it
    /// resumes: what the policy knows of it (its size, when her cache was last touched, ski
    /// rental's rent) and its running totals at its last result. Called before each record
    /// is written: a crash between the two loses that record rather than bills it twice.
    pub(super) fn keep_session(&self) {
        let Some(session) = self.records.status.session_id.clone() else {
            return;
        };
        let policy = KeptPolicy {
            session,
            telemetry: self
                .refresh
                .telemetry
                .keep(Instant::now(), crate::clock::unix_ms()),
        };
        self.store_json(&[
            (POLICY, serde_json::to_string(&policy)),
            (TOTALS, serde_json::to_string(&self.records.billed_so_far)),
        ]);
    }

    /// What her session has seen that can still be shown to her (`lines`: her rooms'
    /// timelines), as stored with her turn so that after a restart of the gateway the resumed
    /// session is not shown it again (JSON; `None` without a session).
    pub(super) fn seen_to_keep(
        &self,
        lines: &[(String, Vec<wire::docs::ContextLine>)],
    ) -> Option<String> {
        let session = self.records.status.session_id.clone()?;
        let shown: std::collections::HashSet<&str> = lines
            .iter()
            .flat_map(|(_, ls)| ls.iter().map(|l| l.event_id.as_str()))
            .collect();
        let ids = self
            .carry
            .seen
            .to_keep(SEEN_LATEST, |id| shown.contains(id))
            .into_iter()
            .map(str::to_owned)
            .collect();
        serde_json::to_string(&KeptSeen { session, ids }).ok()
    }

    /// Her set-aside batches as her status shows them, read again from the inbox.
    pub(super) fn refresh_set_aside(&mut self) {
        match self.inbox.set_aside_list(&self.persona.id) {
            Ok(list) => {
                self.records.status.set_aside = list
                    .iter()
                    .map(|a| wire::docs::SetAsideBatch {
                        batch: a.id,
                        messages: a.deliveries.len() as u64,
                        why: a.why.clone(),
                        at_ms: a.at_ms,
                    })
                    .collect();
                self.records.save();
            }
            Err(e) => {
                tracing::warn!(persona = %self.persona.id, error = %e, "her set-aside batches cannot be read")
            }
        }
    }
}

/// Appends `record` to the history at `path`; past `keep` records (by a quarter), the oldest
/// are dropped (the file is rewritten and renamed into place). `lines` is the file's line count
/// (counted when `None`), kept by the caller so a turn does not read the whole file.
pub fn append_history(
    path: &std::path::Path,
    record: &TurnRecord,
    keep: usize,
    lines: &mut Option<usize>,
) -> std::io::Result<()> {
    use std::io::Write;
    let line = serde_json::to_string(record).map_err(std::io::Error::other)?;
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)?;
    writeln!(f, "{line}")?;
    drop(f);
    let keep = keep.max(1);
    let n = match lines {
        Some(n) => *n + 1,
        None => std::fs::read_to_string(path)?.lines().count(),
    };
    *lines = Some(n);
    if n > keep + keep / 4 {
        let text = std::fs::read_to_string(path)?;
        let n = text.lines().count();
        let kept: String = text
            .lines()
            .skip(n - keep)
            .flat_map(|l| [l, "\n"])
            .collect();
        let tmp = path.with_extension("jsonl.tmp");
        std::fs::write(&tmp, kept)?;
        std::fs::rename(&tmp, path)?;
        *lines = Some(keep.min(n));
    }
    Ok(())
}

/// Reads a turn history (lines that do not parse are skipped).
pub fn read_history(path: &std::path::Path) -> std::io::Result<Vec<TurnRecord>> {
    Ok(std::fs::read_to_string(path)?
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect())
}

/// What the policy learned in earlier runs (`name`, JSON in her session values), or nothing
/// yet; a value that does not parse (another version wrote it) is logged and started over.
pub(super) fn learned<T: serde::de::DeserializeOwned + Default>(
    inbox: &Inbox,
    persona: &str,
    name: &str,
) -> Result<T, InboxError> {
    Ok(match inbox.session_value(persona, name)? {
        None => T::default(),
        Some(v) => serde_json::from_str(&v).unwrap_or_else(|e| {
            tracing::warn!(persona, name, error = %e, "a stored value of the policy is unreadable; learning it again");
            T::default()
        }),
    })
}

/// Her model's prices: the configured table, else the model's published one, else Sonnet's
/// (with a warning: the policy's choices and her reported cost assume them).
pub(super) fn prices_for(persona: &Persona, model: &str) -> Prices {
    if let Some(p) = &persona.session.prices {
        return p.table();
    }
    Prices::for_model(model).unwrap_or_else(|| {
        tracing::warn!(persona = %persona.id, model, "no published prices known for this model; costing it as Sonnet (set [persona.session.prices])");
        Prices::default()
    })
}

/// Her spend in the last 24 hours has reached her cap (`[persona.budget] usd_per_day`), or the
/// public share of it (the cap less her operators' reserve).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, serde::Deserialize)]
pub(super) struct OverBudget {
    /// Spent in the window, dollars.
    pub(super) spent_usd: f64,
    /// The cap, dollars.
    pub(super) cap_usd: f64,
    /// When enough spend has left the window, ms since the epoch: below the cap, or (with
    /// `operators_only`) below the public share.
    pub(super) resumes_at_ms: i64,
    /// Only the public share is spent: her operators' lines and DMs are answered from the
    /// reserve.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub(super) operators_only: bool,
}

impl OverBudget {
    /// From her share, `None` when it is open.
    pub(super) fn of(share: session::budget::Share) -> Option<Self> {
        use session::budget::Share;
        match share {
            Share::Open => None,
            Share::Operators {
                spent_usd,
                cap_usd,
                resumes_at_ms,
                ..
            }
            | Share::Over {
                spent_usd,
                cap_usd,
                resumes_at_ms,
            } => Some(Self {
                spent_usd,
                cap_usd,
                resumes_at_ms,
                operators_only: matches!(share, Share::Operators { .. }),
            }),
        }
    }

    /// What her status says of it.
    pub(super) fn describe(&self) -> String {
        let wait = human_duration(self.resumes_at_ms - crate::clock::unix_ms());
        if self.operators_only {
            format!(
                "over_budget: ${:.4} spent in the last 24 hours, past the public share of a ${:.4} cap; her operators' lines are answered from the reserve, others' wait {wait} more (or until a reload raises budget.usd_per_day)",
                self.spent_usd, self.cap_usd,
            )
        } else {
            format!(
                "over_budget: ${:.4} spent in the last 24 hours of a ${:.4} cap; her mail waits {wait} more (or until a reload raises budget.usd_per_day)",
                self.spent_usd, self.cap_usd,
            )
        }
    }

    /// What the gateway tells her operator, once, in her DM with him.
    pub(super) fn notice(&self, persona: &str) -> String {
        let wait = human_duration(self.resumes_at_ms - crate::clock::unix_ms());
        let what = if self.operators_only {
            "She answers only you (and her other operators) now, from the reserve; others' lines wait"
        } else {
            "She answers no one now; all her mail waits"
        };
        format!(
            "[cultnet-gateway] {persona} has spent ${:.2} in the last 24 hours of her ${:.2} daily budget. {what}, {wait} more. To raise it: set [persona.budget] usd_per_day in the gateway's config and reload it (SIGHUP, or systemctl reload cultnet-gateway).",
            self.spent_usd, self.cap_usd
        )
    }
}
