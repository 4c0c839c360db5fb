//! Her operators' verbs on her session: what each does given her state, and how its outcome
//! is answered. Pure: the edge says what it knows of her (a session, her budget), this says
//! what to perform; the edge performs it and says how that went, this says the receipt's
//! status.
//!
//! The rules, each unit-tested below:
//! - `status` only reports;
//! - `reset` ends her session (a fresh one starts at her next turn);
//! - `compact` needs a session, and a budget that is not spent (compacting costs); otherwise
//!   it fails, and may be asked again later;
//! - `model` needs a model name of 1 to 128 bytes (trimmed), else it is rejected; it ends her
//!   session (the prompt cache is per model);
//! - `retry` and `drop` need the id of a set-aside batch, else they are rejected; a batch she
//!   does not have is rejected; a `retry` wakes her turn loop (the batch is mail again);
//! - an action this gateway does not know is rejected;
//! - a verb that was right to ask but could not be performed (the store failed, the CLI did
//!   not compact) fails: asking again may help. Rejected is for good: the same request will
//!   not help.

use wire::docs::{ControlAction, ControlRequest, Status};

/// The longest model name a switch takes, bytes.
pub const MODEL_NAME_BYTES: usize = 128;
/// The sessions before a reset or model switch that her status keeps (newest last).
pub const PREVIOUS_SESSIONS_KEPT: usize = 20;

/// What the edge knows of her when a verb arrives (between turns).
#[derive(Clone, Debug, Default)]
pub struct Her {
    /// She has a session (a turn has run since the last reset).
    pub has_session: bool,
    /// Her spend has reached her daily cap: why, in words, until she resumes.
    pub over_budget: Option<String>,
}

/// What the edge performs for a verb.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Perform {
    /// Nothing: the receipt reports her session.
    Report,
    /// End her session (its transcript stays resumable by its id).
    EndSession,
    /// Compact her conversation (a checkpoint turn first when configured).
    Compact,
    /// Store `0` as her model and end her session.
    SwitchModel(String),
    /// Put the set-aside batch back into her mail, then wake her turn loop.
    Retry(u64),
    /// Drop the set-aside batch for good.
    Drop(u64),
    /// Nothing: the verb is answered at once with this status and error.
    Answer(Status, String),
}

/// What `request` asks of her, given `her`.
pub fn perform(request: &ControlRequest, her: &Her) -> Perform {
    use ControlAction as A;
    match request.action {
        A::Status => Perform::Report,
        A::Reset => Perform::EndSession,
        A::Compact if !her.has_session => Perform::Answer(
            Status::Failed,
            "she has no session to compact yet".to_owned(),
        ),
        A::Compact => match &her.over_budget {
            Some(why) => Perform::Answer(Status::Failed, why.clone()),
            None => Perform::Compact,
        },
        A::Model => match request.model.as_deref().map(str::trim) {
            Some(m) if !m.is_empty() && m.len() <= MODEL_NAME_BYTES => {
                Perform::SwitchModel(m.to_owned())
            }
            _ => Perform::Answer(
                Status::Rejected,
                format!("a model switch needs a model name (1 to {MODEL_NAME_BYTES} bytes)"),
            ),
        },
        A::Retry | A::Drop => match request.batch {
            None => Perform::Answer(
                Status::Rejected,
                "retry and drop name a set-aside batch (--batch ID)".to_owned(),
            ),
            Some(b) if request.action == A::Retry => Perform::Retry(b),
            Some(b) => Perform::Drop(b),
        },
        A::Unknown => Perform::Answer(Status::Rejected, "unknown session action".to_owned()),
    }
}

/// How performing went, as the edge saw it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Performed {
    /// Done.
    Done,
    /// `retry` or `drop` named a batch she does not have set aside.
    NoSuchBatch(u64),
    /// It could not be done (the store, the CLI): why.
    Failed(String),
}

/// The receipt's status and error for a verb performed as `performed`.
pub fn answer(performed: Performed) -> (Status, Option<String>) {
    match performed {
        Performed::Done => (Status::Ok, None),
        Performed::NoSuchBatch(b) => (
            Status::Rejected,
            Some(format!("she has no set-aside batch {b}")),
        ),
        Performed::Failed(why) => (Status::Failed, Some(why)),
    }
}

/// Her earlier sessions after `ended` ends: it is kept (newest last), at most
/// [`PREVIOUS_SESSIONS_KEPT`].
pub fn keep_previous(previous: &mut Vec<String>, ended: Option<String>) {
    previous.extend(ended);
    let n = previous.len();
    if n > PREVIOUS_SESSIONS_KEPT {
        previous.drain(..n - PREVIOUS_SESSIONS_KEPT);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ask(action: ControlAction) -> ControlRequest {
        ControlRequest {
            persona: "vera".into(),
            action,
            ..ControlRequest::default()
        }
    }

    fn live() -> Her {
        Her {
            has_session: true,
            over_budget: None,
        }
    }

    #[test]
    fn status_reports_and_reset_ends_her_session_whatever_her_state() {
        for her in [Her::default(), live()] {
            assert_eq!(perform(&ask(ControlAction::Status), &her), Perform::Report);
            assert_eq!(
                perform(&ask(ControlAction::Reset), &her),
                Perform::EndSession
            );
        }
    }

    #[test]
    fn compact_needs_a_session_and_an_open_budget_and_fails_for_now_without() {
        let c = ask(ControlAction::Compact);
        assert_eq!(perform(&c, &live()), Perform::Compact);
        assert!(matches!(
            perform(&c, &Her::default()),
            Perform::Answer(Status::Failed, why) if why.contains("no session")
        ));
        let spent = Her {
            over_budget: Some("spent $10.00 of $10.00".into()),
            ..live()
        };
        assert_eq!(
            perform(&c, &spent),
            Perform::Answer(Status::Failed, "spent $10.00 of $10.00".into())
        );
    }

    #[test]
    fn a_model_switch_takes_a_trimmed_name_of_1_to_128_bytes_or_is_rejected() {
        let with = |m: Option<&str>| ControlRequest {
            model: m.map(str::to_owned),
            ..ask(ControlAction::Model)
        };
        assert_eq!(
            perform(&with(Some("  claude-opus-4-6 ")), &live()),
            Perform::SwitchModel("claude-opus-4-6".into())
        );
        let longest = "m".repeat(MODEL_NAME_BYTES);
        assert_eq!(
            perform(&with(Some(&longest)), &Her::default()),
            Perform::SwitchModel(longest.clone())
        );
        for bad in [None, Some(""), Some("   "), Some(&*format!("{longest}m"))] {
            assert!(
                matches!(
                    perform(&with(bad), &live()),
                    Perform::Answer(Status::Rejected, _)
                ),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn retry_and_drop_name_a_batch_or_are_rejected_and_unknown_verbs_are_rejected() {
        let on = |action, batch| ControlRequest {
            batch,
            ..ask(action)
        };
        assert_eq!(
            perform(&on(ControlAction::Retry, Some(7)), &live()),
            Perform::Retry(7)
        );
        assert_eq!(
            perform(&on(ControlAction::Drop, Some(7)), &Her::default()),
            Perform::Drop(7)
        );
        for action in [ControlAction::Retry, ControlAction::Drop] {
            assert!(matches!(
                perform(&on(action, None), &live()),
                Perform::Answer(Status::Rejected, why) if why.contains("--batch")
            ));
        }
        assert!(matches!(
            perform(&ask(ControlAction::Unknown), &live()),
            Perform::Answer(Status::Rejected, _)
        ));
    }

    #[test]
    fn a_batch_she_lacks_is_rejected_for_good_and_a_failure_to_perform_may_be_asked_again() {
        assert_eq!(answer(Performed::Done), (Status::Ok, None));
        let (status, why) = answer(Performed::NoSuchBatch(3));
        assert_eq!(status, Status::Rejected);
        assert!(why.is_some_and(|w| w.contains("batch 3")));
        assert_eq!(
            answer(Performed::Failed("sled: io".into())),
            (Status::Failed, Some("sled: io".into()))
        );
    }

    #[test]
    fn an_ended_session_is_kept_newest_last_and_only_the_last_twenty() {
        let mut previous = Vec::new();
        keep_previous(&mut previous, None);
        assert!(previous.is_empty());
        for i in 0..25 {
            keep_previous(&mut previous, Some(format!("s{i}")));
        }
        assert_eq!(previous.len(), PREVIOUS_SESSIONS_KEPT);
        assert_eq!(previous.first().map(String::as_str), Some("s5"));
        assert_eq!(previous.last().map(String::as_str), Some("s24"));
    }
}
