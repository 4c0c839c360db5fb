//! How one turn of hers runs, from the batch chosen to the reply in hand: a pure state machine
//! in the manner of quinn-proto's `Connection`. The edge (`gateway::turns`) tells it what it
//! knows at the start ([`Start`]), performs each [`Action`] it gets, and answers with the
//! [`Event`] that action produced; nothing here touches a process, a file or the clock.
//!
//! The rules, each unit-tested below:
//! - a reply already stored for this batch (a say of it failed) is sent again; she is not
//!   asked again;
//! - the refresh policy's decision comes first: a fresh start, or a compaction (after a
//!   checkpoint turn when her operator asked for one and there is a session to lose);
//! - a batch the model API failed on, in the session that will run it again, is not sent
//!   again: a retry note says it is above, unanswered;
//! - a batch that was in flight when the gateway stopped, run by a new process resuming her
//!   session, is looked for in her transcript first, and if there only the retry note goes;
//! - a CLI process that dies mid-turn is replaced, at most [`ATTEMPTS`] runs in all; the new
//!   one's text says her process was restarted, and is the retry note alone when the dead one
//!   had written the batch into her transcript already;
//! - a session that cannot be resumed is given up for a fresh one and the text sent again;
//! - a batch refused as too long by a session with history compacts it and is sent again
//!   (only the retry note when the compaction kept the refused message), then once more in a
//!   fresh session; a fresh session's refusal fails the turn ([`Failure::TooLong`]), and the
//!   drain takes less ([`crate::turn::after_too_long`]);
//! - a compaction that fails is a fresh start;
//! - an API error fails the turn: HTTP 401 as [`Failure::Unauthorized`] (the edge reads her
//!   credential again), any other as [`Failure::Api`], remembered for the retry above.

use crate::policy::{Decision, Outcome, Reason};

/// CLI runs per text in one turn (a process that dies, a resume that fails, is retried).
pub const ATTEMPTS: u32 = 3;

/// What the edge knows when the turn starts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Start {
    /// A reply of hers to this very batch is stored: a say of it was not sent.
    pub stored_reply: bool,
    /// Her session exists (a stored session id): a process for it resumes it.
    pub has_session: bool,
    /// Her process is running now.
    pub live: bool,
    /// This batch was in flight when the gateway or her process stopped before.
    pub retried: bool,
    /// The model API failed on this batch in the session that will run it: the status, if
    /// the API gave one.
    pub api_failed: Option<Option<u16>>,
    /// The refresh policy's decision for this turn.
    pub decision: Decision,
    /// Her operator asked for a checkpoint turn before a planned compaction.
    pub checkpoint: bool,
    /// The gateway was restarted since her last turn: her first text says so.
    pub restarted: bool,
}

/// What was restarted, for the note a text carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Restarted {
    /// The gateway, since her last turn.
    Gateway,
    /// Her claude process, during this turn.
    Process,
}

/// Why a retry note stands in for the batch: it is in her transcript already, unanswered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RetryWhy {
    /// The model API failed on it (the status, if any).
    ApiFailed(Option<u16>),
    /// The turn ended (the gateway or her process stopped) before she answered it.
    TurnEnded,
    /// Her process stopped during this turn, after writing it.
    ProcessStopped,
    /// It was refused as too long, and the compaction after kept it.
    RefusedThenCompacted,
}

impl RetryWhy {
    /// The retry note's reason, as she reads it ("..., which you have not answered yet").
    pub fn describe(self) -> String {
        match self {
            Self::ApiFailed(status) => {
                let status = status.map_or_else(|| "an error".to_owned(), |s| format!("HTTP {s}"));
                format!("the model API failed ({status}) on the batch above")
            }
            Self::TurnEnded => "your last turn ended before you answered the batch above".into(),
            Self::ProcessStopped => {
                "your claude process stopped before you answered the batch above".into()
            }
            Self::RefusedThenCompacted => "the batch above was refused as too long for your \
                 context window, and your conversation before it was compacted"
                .into(),
        }
    }
}

/// The text a run sends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Text {
    /// The batch as last composed ([`Action::Compose`]).
    Composed,
    /// The retry note alone (and a restart note): the batch is in her transcript. The batch
    /// counts as shown.
    Retry {
        /// Why.
        why: RetryWhy,
        /// What was restarted, for a note before it.
        restart: Option<Restarted>,
    },
    /// The text of the last run again, with a restart note when her process was replaced.
    Again {
        /// What was restarted.
        restart: Option<Restarted>,
    },
    /// The checkpoint note: keep what you must in your reply's fields; says are not sent.
    Checkpoint,
}

/// Why her session is given up for a fresh one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FreshWhy {
    /// The refresh policy chose it.
    Policy(Reason),
    /// The stored session could not be resumed.
    ResumeFailed,
    /// A compaction did not happen.
    CompactionFailed,
    /// The session refused the batch again after compacting.
    RefusedAgain,
}

impl FreshWhy {
    /// For the log and her history.
    pub fn describe(self) -> String {
        match self {
            Self::Policy(r) => format!("{r:?}"),
            Self::ResumeFailed => "resume failed".into(),
            Self::CompactionFailed => "the compaction did not happen".into(),
            Self::RefusedAgain => "the session refused the turn again after compacting".into(),
        }
    }
}

/// Why her session is compacted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CompactWhy {
    /// The refresh policy chose it.
    Policy(Reason),
    /// Her operator asked for it.
    Operator,
    /// The session refused the batch as too long: the edge also finds the refused message in
    /// her transcript, to tell whether the compaction kept it.
    Refused,
}

impl CompactWhy {
    /// For the log and her history.
    pub fn describe(self) -> String {
        match self {
            Self::Policy(r) => format!("{r:?}"),
            Self::Operator => "operator".into(),
            Self::Refused => "the session refused the turn (context full)".into(),
        }
    }
}

/// Why the turn ends without a reply (its batch stays pending).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Failure {
    /// A fresh session refused the batch as too long.
    TooLong,
    /// The model API refused her credential.
    Unauthorized,
    /// The model API failed; `remember`: the text is in the transcript of the session it ran
    /// in, and the retry says so instead of sending it again.
    Api {
        /// Its HTTP status, if any.
        status: Option<u16>,
    },
    /// The CLI failed [`ATTEMPTS`] times (the edge holds the last error).
    Cli,
}

/// What the edge does next.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    /// Send her stored reply to this batch, each say at most once; the turn is over.
    SendStored,
    /// Give up her session: the next process starts a fresh one. Answer [`Event::Done`].
    FreshStart(FreshWhy),
    /// Compact her session. Answer [`Event::Compacted`] or [`Event::CompactFailed`].
    Compact(CompactWhy),
    /// Compose the batch's user message (which marks what it shows as seen). Answer
    /// [`Event::Done`].
    Compose,
    /// Forget what composing the batch marked as seen: her session refused it. Answer
    /// [`Event::Done`].
    Unsee,
    /// Whether her session's transcript holds the text composed or last sent. Answer
    /// [`Event::Held`].
    CheckTranscript,
    /// Run this text in her process (spawned, resuming her session, if none lives). Answer
    /// [`Event::Ran`] or [`Event::Died`].
    Run(Text),
    /// The checkpoint run is over: keep its fields if `answered`. Answer [`Event::Done`].
    KeepCheckpoint {
        /// It ended without error.
        answered: bool,
    },
    /// Her reply is in hand: send its says and commit the turn. The turn is over.
    Deliver,
    /// The turn ends without a reply. The turn is over.
    Fail(Failure),
    /// The compaction her operator asked for is over: `compacted`, or she starts fresh
    /// instead.
    Compacted {
        /// The CLI compacted her session.
        compacted: bool,
    },
}

impl Action {
    /// The turn (or the compaction asked for) is over after this action.
    pub fn is_final(&self) -> bool {
        matches!(
            self,
            Self::SendStored | Self::Deliver | Self::Fail(_) | Self::Compacted { .. }
        )
    }
}

/// What a run's result says, as far as these rules care.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ran {
    /// Its outcome.
    pub outcome: Outcome,
    /// The result is an error that names errors: from a resumed session, that it could not be
    /// resumed (it no longer exists).
    pub errors: bool,
    /// The API's HTTP status, on an API error.
    pub status: Option<u16>,
}

/// What performing an action produced.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Event {
    /// The action was performed.
    Done,
    /// [`Action::CheckTranscript`]'s answer.
    Held(bool),
    /// The compaction happened; `kept_refused`: it kept the refused message verbatim.
    Compacted {
        /// The message refused as too long survives the compaction.
        kept_refused: bool,
    },
    /// The compaction did not happen.
    CompactFailed,
    /// The run ended with a result.
    Ran(Ran),
    /// Her process died (or could not start) before a result.
    Died,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stage {
    /// Waiting for the policy's fresh start.
    Deciding,
    /// Running the checkpoint turn.
    Checkpoint,
    /// The checkpoint's fields are being kept.
    CheckpointKept,
    /// The planned compaction.
    Compacting,
    /// Composed, looking for it in her transcript (a retried batch).
    LookingForBatch,
    /// Running the batch (or its retry note).
    Running,
    /// Her process died; looking for the text in her transcript.
    LookingAfterDeath,
    /// A resume failed: the fresh start before the same text again.
    Restarting,
    /// The batch was refused: forgetting it was shown.
    Unseeing,
    /// Compacting after the refusal.
    CompactingRefused,
    /// Composing the batch again after a compaction or fresh start.
    Recomposing,
    /// A fresh start after a refusal, before composing the batch again.
    Refreshed,
    /// Over.
    Over,
}

/// One turn's run, from its start to its final action (or an operator's compaction).
#[derive(Clone, Debug)]
pub struct Attempt {
    /// Her operator's compaction, not a turn.
    on_request: bool,
    start: Start,
    stage: Stage,
    /// Her session exists (changes with fresh starts).
    has_session: bool,
    /// Runs of the current text so far.
    runs: u32,
    /// Her process was replaced during the current text's runs.
    respawned: bool,
    /// Refusals as too long so far.
    refusals: u8,
    /// Her session was compacted or given up during this turn: it no longer holds a failed
    /// attempt's text.
    changed: bool,
}

impl Attempt {
    /// A turn with what the edge knows, and its first action.
    pub fn start(start: Start) -> (Self, Action) {
        let mut a = Self::new(start);
        let action = a.begin();
        (a, action)
    }

    /// The compaction her operator asked for, of the session she has (`checkpoint`: a
    /// checkpoint turn first), and its first action. A failed compaction is a fresh start.
    pub fn compaction(checkpoint: bool) -> (Self, Action) {
        let start = Start {
            stored_reply: false,
            has_session: true,
            live: false,
            retried: false,
            api_failed: None,
            decision: Decision::Continue,
            checkpoint,
            restarted: false,
        };
        let mut a = Self::new(start);
        a.on_request = true;
        a.changed = true;
        let action = a.checkpoint_or_compact();
        (a, action)
    }

    fn new(start: Start) -> Self {
        Self {
            on_request: false,
            start,
            stage: Stage::Deciding,
            has_session: start.has_session,
            runs: 0,
            respawned: false,
            refusals: 0,
            changed: false,
        }
    }

    /// Before a planned compaction, the checkpoint turn when her operator asked for one.
    fn checkpoint_or_compact(&mut self) -> Action {
        if self.start.checkpoint {
            self.stage = Stage::Checkpoint;
            self.run_new(Text::Checkpoint)
        } else {
            self.compact_planned()
        }
    }

    /// Her session is given up (it holds no failed attempt's text any more), going on at
    /// `next`.
    fn give_up_session(&mut self, why: FreshWhy, next: Stage) -> Action {
        self.has_session = false;
        self.changed = true;
        self.stage = next;
        Action::FreshStart(why)
    }

    /// The planned compaction (the policy's or her operator's).
    fn compact_planned(&mut self) -> Action {
        self.stage = Stage::Compacting;
        match self.start.decision {
            Decision::Compact(r) if !self.on_request => Action::Compact(CompactWhy::Policy(r)),
            _ => Action::Compact(CompactWhy::Operator),
        }
    }

    /// Whether her session exists as far as this turn knows.
    pub fn has_session(&self) -> bool {
        self.has_session
    }

    fn begin(&mut self) -> Action {
        if self.start.stored_reply {
            return self.finish(Action::SendStored);
        }
        match self.start.decision {
            // A session that does not exist yet has nothing to compact or start over.
            Decision::FreshStart(r) if self.has_session => {
                self.give_up_session(FreshWhy::Policy(r), Stage::Deciding)
            }
            Decision::Compact(_) if self.has_session => {
                self.changed = true;
                self.checkpoint_or_compact()
            }
            _ => self.choose_text(),
        }
    }

    fn restart(&self) -> Option<Restarted> {
        self.start.restarted.then_some(Restarted::Gateway)
    }

    fn choose_text(&mut self) -> Action {
        // Only the session the API failed in holds its text (the edge compares them): a fresh
        // start or a compaction during this turn has dropped it.
        match self.start.api_failed {
            Some(status) if !self.changed => {
                self.stage = Stage::Running;
                self.run_new(Text::Retry {
                    why: RetryWhy::ApiFailed(status),
                    restart: self.restart(),
                })
            }
            _ => {
                self.stage = if self.start.retried && !self.start.live && self.has_session {
                    Stage::LookingForBatch
                } else {
                    Stage::Running
                };
                Action::Compose
            }
        }
    }

    fn run(&mut self, text: Text) -> Action {
        self.runs += 1;
        Action::Run(text)
    }

    /// A new text: its runs counted afresh.
    fn run_new(&mut self, text: Text) -> Action {
        self.runs = 0;
        self.respawned = false;
        self.run(text)
    }

    fn finish(&mut self, action: Action) -> Action {
        self.stage = Stage::Over;
        action
    }

    /// The next action, given what the last one produced. An answer the last action did not
    /// ask for (or any after a final action) ends the turn as [`Failure::Cli`]: the edge
    /// performed something else.
    pub fn on(&mut self, event: Event) -> Action {
        match (self.stage, event) {
            (Stage::Over, _) => Action::Fail(Failure::Cli),
            (Stage::Deciding, _) if self.on_request => {
                self.finish(Action::Compacted { compacted: false })
            }
            (Stage::Deciding, _) => self.choose_text(),
            (Stage::Checkpoint, Event::Ran(r)) => {
                self.stage = Stage::CheckpointKept;
                Action::KeepCheckpoint {
                    answered: r.outcome == Outcome::Ok,
                }
            }
            (Stage::Checkpoint, Event::Died) => self.died(),
            (Stage::CheckpointKept, _) => self.compact_planned(),
            (Stage::Compacting, Event::CompactFailed) => {
                self.give_up_session(FreshWhy::CompactionFailed, Stage::Deciding)
            }
            (Stage::Compacting, _) if self.on_request => {
                self.finish(Action::Compacted { compacted: true })
            }
            (Stage::Compacting, _) => self.choose_text(),
            (Stage::LookingForBatch, Event::Done) => Action::CheckTranscript,
            (Stage::LookingForBatch, Event::Held(held)) => {
                self.stage = Stage::Running;
                if held {
                    self.run_new(Text::Retry {
                        why: RetryWhy::TurnEnded,
                        restart: self.restart(),
                    })
                } else {
                    self.run_new(Text::Composed)
                }
            }
            (Stage::Running, Event::Done) => self.run_new(Text::Composed),
            (Stage::Running | Stage::Recomposing, Event::Ran(r)) => self.ran(r),
            (Stage::Running | Stage::Recomposing, Event::Died) => self.died(),
            (Stage::LookingAfterDeath, Event::Held(true)) => {
                self.stage = Stage::Running;
                self.run(Text::Retry {
                    why: RetryWhy::ProcessStopped,
                    restart: Some(Restarted::Process),
                })
            }
            (Stage::LookingAfterDeath, _) => {
                self.stage = Stage::Running;
                self.run(Text::Again {
                    restart: Some(Restarted::Process),
                })
            }
            (Stage::Restarting, _) => {
                self.stage = Stage::Running;
                let restart = self.respawned.then_some(Restarted::Process);
                self.run(Text::Again { restart })
            }
            (Stage::Unseeing, _) => {
                self.stage = Stage::CompactingRefused;
                Action::Compact(CompactWhy::Refused)
            }
            (Stage::CompactingRefused, Event::Compacted { kept_refused: true }) => {
                self.stage = Stage::Recomposing;
                self.run_new(Text::Retry {
                    why: RetryWhy::RefusedThenCompacted,
                    restart: None,
                })
            }
            (Stage::CompactingRefused, Event::CompactFailed) => {
                self.give_up_session(FreshWhy::CompactionFailed, Stage::Refreshed)
            }
            (Stage::CompactingRefused, _) => {
                self.stage = Stage::Recomposing;
                Action::Compose
            }
            (Stage::Refreshed, _) => {
                self.stage = Stage::Recomposing;
                Action::Compose
            }
            (Stage::Recomposing, _) => self.run_new(Text::Composed),
            // An answer the stage did not ask for: the edge performed something else.
            (Stage::Checkpoint | Stage::Running | Stage::LookingForBatch, _) => {
                self.finish(Action::Fail(Failure::Cli))
            }
        }
    }

    fn died(&mut self) -> Action {
        if self.runs >= ATTEMPTS {
            // A checkpoint that could not run does not stop the compaction.
            if self.stage == Stage::Checkpoint {
                return self.compact_planned();
            }
            return self.finish(Action::Fail(Failure::Cli));
        }
        self.respawned = true;
        if self.stage == Stage::Checkpoint {
            // The checkpoint's note is sent again to the new process.
            return self.run(Text::Again {
                restart: Some(Restarted::Process),
            });
        }
        if self.has_session {
            self.stage = Stage::LookingAfterDeath;
            Action::CheckTranscript
        } else {
            self.run(Text::Again {
                restart: Some(Restarted::Process),
            })
        }
    }

    fn ran(&mut self, r: Ran) -> Action {
        if self.has_session && r.errors {
            // The recorded session could not be resumed (it no longer exists): start over.
            if self.runs >= ATTEMPTS {
                return self.finish(Action::Fail(Failure::Cli));
            }
            return self.give_up_session(FreshWhy::ResumeFailed, Stage::Restarting);
        }
        match r.outcome {
            Outcome::PromptTooLong | Outcome::BlockingLimit => self.refused(),
            Outcome::ApiError => self.finish(Action::Fail(match r.status {
                Some(401) => Failure::Unauthorized,
                status => Failure::Api { status },
            })),
            Outcome::Ok | Outcome::None => self.finish(Action::Deliver),
        }
    }

    fn refused(&mut self) -> Action {
        self.refusals += 1;
        match self.refusals {
            // A session with history: compact it and send the batch again.
            1 if self.has_session => {
                self.stage = Stage::Unseeing;
                Action::Unsee
            }
            // Refused after compacting: once more, in a fresh session.
            2 if self.has_session => self.give_up_session(FreshWhy::RefusedAgain, Stage::Refreshed),
            _ => self.finish(Action::Fail(Failure::TooLong)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn start() -> Start {
        Start {
            stored_reply: false,
            has_session: true,
            live: true,
            retried: false,
            api_failed: None,
            decision: Decision::Continue,
            checkpoint: false,
            restarted: false,
        }
    }

    fn ok() -> Event {
        Event::Ran(Ran {
            outcome: Outcome::Ok,
            errors: false,
            status: None,
        })
    }

    fn outcome(outcome: Outcome, status: Option<u16>) -> Event {
        Event::Ran(Ran {
            outcome,
            errors: false,
            status,
        })
    }

    /// Plays `events` (each the answer to the action before) and returns every action.
    fn play(s: Start, events: &[Event]) -> Vec<Action> {
        let (mut a, first) = Attempt::start(s);
        let mut actions = vec![first];
        for e in events {
            assert!(
                !actions.last().is_some_and(Action::is_final),
                "an event after the final action: {actions:?}"
            );
            actions.push(a.on(*e));
        }
        actions
    }

    #[test]
    fn a_plain_turn_composes_runs_and_delivers() {
        assert_eq!(
            play(start(), &[Event::Done, ok()]),
            [
                Action::Compose,
                Action::Run(Text::Composed),
                Action::Deliver
            ]
        );
    }

    #[test]
    fn a_stored_reply_is_sent_and_she_is_not_asked_again() {
        let s = Start {
            stored_reply: true,
            decision: Decision::Compact(Reason::Watermark),
            ..start()
        };
        assert_eq!(play(s, &[]), [Action::SendStored]);
    }

    #[test]
    fn the_policy_decides_first_and_a_new_session_has_nothing_to_give_up() {
        let fresh = Start {
            decision: Decision::FreshStart(Reason::ColdCache),
            ..start()
        };
        assert_eq!(
            play(fresh, &[Event::Done, Event::Done, ok()]),
            [
                Action::FreshStart(FreshWhy::Policy(Reason::ColdCache)),
                Action::Compose,
                Action::Run(Text::Composed),
                Action::Deliver
            ]
        );
        let compact = Start {
            decision: Decision::Compact(Reason::Watermark),
            ..start()
        };
        assert_eq!(
            play(
                compact,
                &[
                    Event::Compacted {
                        kept_refused: false
                    },
                    Event::Done,
                    ok()
                ]
            ),
            [
                Action::Compact(CompactWhy::Policy(Reason::Watermark)),
                Action::Compose,
                Action::Run(Text::Composed),
                Action::Deliver
            ]
        );
        let new = Start {
            has_session: false,
            decision: Decision::FreshStart(Reason::ColdCache),
            ..start()
        };
        assert_eq!(play(new, &[])[0], Action::Compose);
    }

    #[test]
    fn a_checkpoint_turn_comes_before_a_planned_compaction_and_a_failed_one_starts_fresh() {
        let s = Start {
            decision: Decision::Compact(Reason::Watermark),
            checkpoint: true,
            ..start()
        };
        let failed_checkpoint = outcome(Outcome::ApiError, Some(500));
        assert_eq!(
            play(
                s,
                &[
                    failed_checkpoint,
                    Event::Done,
                    Event::CompactFailed,
                    Event::Done,
                    Event::Done,
                    ok()
                ]
            ),
            [
                Action::Run(Text::Checkpoint),
                Action::KeepCheckpoint { answered: false },
                Action::Compact(CompactWhy::Policy(Reason::Watermark)),
                Action::FreshStart(FreshWhy::CompactionFailed),
                Action::Compose,
                Action::Run(Text::Composed),
                Action::Deliver
            ]
        );
        // Without a session there is nothing to checkpoint or compact.
        let new = Start {
            has_session: false,
            ..s
        };
        assert_eq!(play(new, &[])[0], Action::Compose);
    }

    #[test]
    fn her_operators_compaction_checkpoints_first_and_a_failure_is_a_fresh_start() {
        let (mut a, first) = Attempt::compaction(true);
        assert_eq!(first, Action::Run(Text::Checkpoint));
        assert_eq!(a.on(ok()), Action::KeepCheckpoint { answered: true });
        assert_eq!(a.on(Event::Done), Action::Compact(CompactWhy::Operator));
        assert_eq!(
            a.on(Event::Compacted {
                kept_refused: false
            }),
            Action::Compacted { compacted: true }
        );
        let (mut a, first) = Attempt::compaction(false);
        assert_eq!(first, Action::Compact(CompactWhy::Operator));
        assert_eq!(
            a.on(Event::CompactFailed),
            Action::FreshStart(FreshWhy::CompactionFailed)
        );
        assert_eq!(a.on(Event::Done), Action::Compacted { compacted: false });
        // A checkpoint whose process keeps dying does not stop the compaction.
        let (mut a, _) = Attempt::compaction(true);
        let mut action = a.on(Event::Died);
        while action != Action::Compact(CompactWhy::Operator) {
            assert!(
                matches!(action, Action::Run(Text::Again { .. })),
                "{action:?}"
            );
            action = a.on(Event::Died);
        }
    }

    #[test]
    fn a_batch_the_api_failed_on_is_not_sent_again_in_the_session_that_holds_it() {
        let s = Start {
            api_failed: Some(Some(529)),
            restarted: true,
            ..start()
        };
        assert_eq!(
            play(s, &[ok()]),
            [
                Action::Run(Text::Retry {
                    why: RetryWhy::ApiFailed(Some(529)),
                    restart: Some(Restarted::Gateway)
                }),
                Action::Deliver
            ]
        );
        // A compaction or fresh start since took its text out: the batch goes again.
        for decision in [
            Decision::Compact(Reason::Watermark),
            Decision::FreshStart(Reason::SkiRental),
        ] {
            let after = Start { decision, ..s };
            let actions = play(
                after,
                &[
                    Event::Compacted {
                        kept_refused: false,
                    },
                    Event::Done,
                ],
            );
            assert_eq!(actions[1], Action::Compose, "{decision:?}");
            assert_eq!(actions[2], Action::Run(Text::Composed), "{decision:?}");
        }
    }

    #[test]
    fn a_retried_batch_in_a_new_process_is_looked_for_in_her_transcript() {
        let s = Start {
            retried: true,
            live: false,
            ..start()
        };
        assert_eq!(
            play(s, &[Event::Done, Event::Held(true), ok()]),
            [
                Action::Compose,
                Action::CheckTranscript,
                Action::Run(Text::Retry {
                    why: RetryWhy::TurnEnded,
                    restart: None
                }),
                Action::Deliver
            ]
        );
        assert_eq!(
            play(s, &[Event::Done, Event::Held(false)])[2],
            Action::Run(Text::Composed)
        );
        // Her process still lives: it has not run the batch (it would have answered).
        let live = Start { live: true, ..s };
        assert_eq!(play(live, &[Event::Done])[1], Action::Run(Text::Composed));
    }

    #[test]
    fn a_dead_process_is_replaced_at_most_attempts_times_and_says_so() {
        let actions = play(
            start(),
            &[
                Event::Done,
                Event::Died,
                Event::Held(false),
                Event::Died,
                Event::Held(true),
                Event::Died,
            ],
        );
        assert_eq!(
            actions,
            [
                Action::Compose,
                Action::Run(Text::Composed),
                Action::CheckTranscript,
                Action::Run(Text::Again {
                    restart: Some(Restarted::Process)
                }),
                Action::CheckTranscript,
                Action::Run(Text::Retry {
                    why: RetryWhy::ProcessStopped,
                    restart: Some(Restarted::Process)
                }),
                Action::Fail(Failure::Cli)
            ]
        );
        assert_eq!(
            actions
                .iter()
                .filter(|a| matches!(a, Action::Run(_)))
                .count(),
            ATTEMPTS as usize
        );
        // Without a session there is no transcript to look in.
        let new = Start {
            has_session: false,
            ..start()
        };
        assert_eq!(
            play(new, &[Event::Done, Event::Died])[2],
            Action::Run(Text::Again {
                restart: Some(Restarted::Process)
            })
        );
    }

    #[test]
    fn a_session_that_cannot_be_resumed_is_given_up_for_a_fresh_one() {
        let gone = Event::Ran(Ran {
            outcome: Outcome::ApiError,
            errors: true,
            status: None,
        });
        let mut a = Attempt::start(start()).0;
        assert_eq!(a.on(Event::Done), Action::Run(Text::Composed));
        assert_eq!(a.on(gone), Action::FreshStart(FreshWhy::ResumeFailed));
        assert!(!a.has_session());
        assert_eq!(
            a.on(Event::Done),
            Action::Run(Text::Again { restart: None })
        );
        // In the fresh session the same error is the API's, not a resume's.
        assert_eq!(a.on(gone), Action::Fail(Failure::Api { status: None }));
    }

    #[test]
    fn a_refused_batch_compacts_then_starts_fresh_then_fails() {
        let long = outcome(Outcome::PromptTooLong, Some(400));
        let actions = play(
            start(),
            &[
                Event::Done,
                long,
                Event::Done,
                Event::Compacted {
                    kept_refused: false,
                },
                Event::Done,
                outcome(Outcome::BlockingLimit, None),
                Event::Done,
                Event::Done,
                long,
            ],
        );
        assert_eq!(
            actions,
            [
                Action::Compose,
                Action::Run(Text::Composed),
                Action::Unsee,
                Action::Compact(CompactWhy::Refused),
                Action::Compose,
                Action::Run(Text::Composed),
                Action::FreshStart(FreshWhy::RefusedAgain),
                Action::Compose,
                Action::Run(Text::Composed),
                Action::Fail(Failure::TooLong)
            ]
        );
    }

    #[test]
    fn a_refused_batch_the_compaction_kept_is_not_sent_again() {
        let long = outcome(Outcome::PromptTooLong, Some(400));
        let actions = play(
            start(),
            &[
                Event::Done,
                long,
                Event::Done,
                Event::Compacted { kept_refused: true },
                ok(),
            ],
        );
        assert_eq!(
            actions[4],
            Action::Run(Text::Retry {
                why: RetryWhy::RefusedThenCompacted,
                restart: None
            })
        );
        assert_eq!(actions[5], Action::Deliver);
        // A compaction that fails there is a fresh start, and the batch goes again.
        let failed = play(
            start(),
            &[
                Event::Done,
                long,
                Event::Done,
                Event::CompactFailed,
                Event::Done,
                Event::Done,
            ],
        );
        assert_eq!(
            &failed[4..],
            [
                Action::FreshStart(FreshWhy::CompactionFailed),
                Action::Compose,
                Action::Run(Text::Composed)
            ]
        );
    }

    #[test]
    fn a_fresh_session_refusing_the_batch_fails_at_once() {
        let new = Start {
            has_session: false,
            ..start()
        };
        assert_eq!(
            play(
                new,
                &[Event::Done, outcome(Outcome::PromptTooLong, Some(400))]
            )[2],
            Action::Fail(Failure::TooLong)
        );
    }

    #[test]
    fn api_errors_fail_the_turn_unauthorized_apart() {
        for (status, failure) in [
            (Some(401), Failure::Unauthorized),
            (Some(529), Failure::Api { status: Some(529) }),
            (None, Failure::Api { status: None }),
        ] {
            assert_eq!(
                play(start(), &[Event::Done, outcome(Outcome::ApiError, status)])[2],
                Action::Fail(failure)
            );
        }
    }

    #[test]
    fn every_path_ends_in_a_final_action_within_a_bounded_number_of_steps() {
        // Any answers at all: the machine never loops and never asks for nothing.
        let answers = [
            Event::Done,
            Event::Held(true),
            Event::Held(false),
            Event::Compacted { kept_refused: true },
            Event::Compacted {
                kept_refused: false,
            },
            Event::CompactFailed,
            ok(),
            outcome(Outcome::PromptTooLong, None),
            outcome(Outcome::ApiError, Some(500)),
            Event::Ran(Ran {
                outcome: Outcome::ApiError,
                errors: true,
                status: None,
            }),
            Event::Died,
        ];
        let mut seed = 0x9e37_79b9_7f4a_7c15_u64;
        for round in 0..20_000 {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            let s = Start {
                stored_reply: seed.is_multiple_of(17),
                has_session: seed & 2 == 0,
                live: seed & 4 == 0,
                retried: seed & 8 == 0,
                api_failed: (seed & 16 == 0).then_some(Some(500)),
                decision: match (seed >> 5) % 3 {
                    0 => Decision::Continue,
                    1 => Decision::Compact(Reason::Watermark),
                    _ => Decision::FreshStart(Reason::SkiRental),
                },
                checkpoint: seed & 256 == 0,
                restarted: seed & 512 == 0,
            };
            let (mut a, mut action) = if seed.is_multiple_of(13) {
                Attempt::compaction(seed & 1024 == 0)
            } else {
                Attempt::start(s)
            };
            let mut steps = 0;
            let mut x = seed;
            while !action.is_final() {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                action = a.on(answers[(x % answers.len() as u64) as usize]);
                steps += 1;
                assert!(steps < 40, "round {round}: {s:?} does not end");
            }
        }
    }
}
