//! The gateway's status, per Persona, as clients read it.

use super::*;

impl Service {
    /// The status of the Personas the asking agent may see (one, or all of them).
    pub(super) fn status_request(
        &self,
        agent: &str,
        key: &str,
        r: wire::docs::StatusRequest,
    ) -> Vec<Answer> {
        let allowed = self.clients.get(agent).map(|(_, c)| c);
        let personas = self
            .ports
            .keys()
            .filter(|p| r.persona.as_deref().is_none_or(|only| only == *p))
            .filter(|p| allowed.is_some_and(|c| c.allows_persona(p)))
            .cloned()
            .collect::<Vec<_>>();
        let status = self.status(&personas);
        vec![self.receipt(ids::STATUS, key, &status)]
    }

    /// The gateway's status for these Personas.
    pub fn status(&self, personas: &[String]) -> GatewayStatus {
        GatewayStatus {
            runtime_id: self.runtime_id.clone(),
            version: env!("CARGO_PKG_VERSION").to_owned(),
            started_at: self.started_at.clone(),
            peers: u32::try_from(self.peers.len()).unwrap_or(u32::MAX),
            personas: personas
                .iter()
                .filter_map(|id| Some((id, self.ports.get(id)?)))
                .map(|(id, port)| {
                    let c = self.inbox.counts(id).unwrap_or_default();
                    let sync_state = if port.failed.is_some() {
                        "stopped"
                    } else if c.pending >= port.max_pending {
                        "held"
                    } else if port
                        .ear
                        .as_ref()
                        .is_some_and(|e| e.errors.load(Ordering::Relaxed) > 0)
                    {
                        "syncing (after errors)"
                    } else {
                        "syncing"
                    };
                    PersonaStatus {
                        persona: id.clone(),
                        user_id: port.user_id.clone(),
                        sync_state: sync_state.to_owned(),
                        pending_count: c.pending,
                        highest_seq: c.highest,
                        acked_through: c.acked_through,
                        last_error: port
                            .failed
                            .clone()
                            .or_else(|| {
                                port.signals
                                    .session_error
                                    .lock()
                                    .unwrap_or_else(|p| p.into_inner())
                                    .clone()
                            })
                            .or_else(|| {
                                (c.pending >= port.max_pending).then(|| {
                                    format!(
                                        "held: her inbox is full ({} pending of limits.max_pending {}): her rooms wait on the homeserver until her mail is acknowledged; her operators' DMs and invites still come",
                                        c.pending, port.max_pending
                                    )
                                })
                            }),
                    }
                })
                .collect(),
        }
    }
}
