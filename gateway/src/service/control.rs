//! Steering her session: a turn requested at once, and an operator's verb queued for her turn
//! loop, answered once applied.

use super::*;

impl Service {
    /// Her turn, requested now (her Minds or a tool); refused when her session is off.
    pub(super) fn turn(
        &mut self,
        agent: &str,
        key: &str,
        r: wire::docs::TurnRequest,
    ) -> Vec<Answer> {
        let trigger = self
            .ports
            .get(&r.persona)
            .and_then(|p| p.turn_requests.clone());
        let receipt = match trigger {
            Some(t) => {
                tracing::info!(persona = %r.persona, reason = ?r.reason, %agent, "turn requested");
                t.notify_one();
                TurnReceipt {
                    persona: r.persona,
                    status: Status::Ok,
                    ..TurnReceipt::default()
                }
            }
            None => TurnReceipt {
                persona: r.persona,
                status: Status::Rejected,
                error: Some("her session is off (mouth-only): her Minds drive her turns".into()),
                ..TurnReceipt::default()
            },
        };
        vec![self.receipt(ids::TURN_RECEIPT, key, &receipt)]
    }

    /// A session verb: queued for her turn loop, answered once applied.
    pub(super) fn control(
        &mut self,
        key: &str,
        r: wire::docs::ControlRequest,
        in_flight: &Arc<std::sync::atomic::AtomicUsize>,
    ) -> Vec<Answer> {
        let Some(controls) = self.ports.get(&r.persona).and_then(|p| p.controls.clone()) else {
            let why = "her session is off (mouth-only): there is no session to act on".to_owned();
            return vec![self.refusal(&Request::Control(r), key, why)];
        };
        let (tx, rx) = tokio::sync::oneshot::channel();
        let failed = |why: &str| ControlReceipt {
            persona: r.persona.clone(),
            action: r.action,
            status: Status::Failed,
            error: Some(why.to_owned()),
            ..ControlReceipt::default()
        };
        match controls.try_send(crate::turns::Control {
            request: r.clone(),
            reply: tx,
        }) {
            Ok(()) => vec![Answer::Control {
                record_key: key.to_owned(),
                request: r,
                receipt: rx,
                slot: InFlight::take(in_flight),
            }],
            Err(mpsc::error::TrySendError::Full(_)) => {
                let receipt = failed("her session has too many verbs waiting; retry later");
                vec![self.receipt(ids::CONTROL_RECEIPT, key, &receipt)]
            }
            Err(mpsc::error::TrySendError::Closed(_)) => {
                let receipt = failed("her turn loop is not running");
                vec![self.receipt(ids::CONTROL_RECEIPT, key, &receipt)]
            }
        }
    }
}
