//! Who may talk to the service: a Connect is checked (configured agent, pinned key, this
//! service's connection id, time, unused nonce) before a session is known as that agent, and
//! each request is checked against the Personas and verbs the agent is granted.

use super::*;

/// Connect nonces remembered per agent at most (older ones are beyond the skew window anyway):
/// an agent that connects more often within the window is refused, and only it.
pub const MAX_NONCES_PER_AGENT: usize = 10_000;

/// Why a Connect was refused: all of it in the log, [`Refusal::to_client`] to the client.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Refusal {
    /// The payload is not a signed Connect payload, or the signature or time is wrong.
    #[error("{0}")]
    Auth(#[from] AuthError),
    /// No client with this agent id is configured.
    #[error("agent {0:?} is not a configured client")]
    UnknownAgent(String),
    /// This nonce was used before.
    #[error("nonce already used by agent {0:?} (replayed connect)")]
    Replay(String),
    /// This address has spent its budget of signature checks.
    #[error("too many connects from this address; retry later")]
    AddressBudget,
    /// This agent connected more often than its quota within the skew window.
    #[error("agent {0:?} connected too often within the time window; retry later")]
    AgentQuota(String),
    /// The socket it connected from is not one its client block allows ([`owner`]).
    #[error("{0}")]
    Owner(#[from] owner::OwnerError),
}

/// What a client is told when its agent is unknown or its signature does not verify: the same
/// words for both, so a stranger cannot learn which agent ids are configured.
pub const NOT_ADMITTED: &str = "connect refused: unknown agent or bad signature";

impl Refusal {
    /// What the client is told: the reason, except that an unknown agent and a bad signature
    /// read the same ([`NOT_ADMITTED`]).
    pub fn to_client(&self) -> String {
        match self {
            Self::UnknownAgent(_) | Self::Auth(AuthError::BadSignature(_)) => {
                NOT_ADMITTED.to_owned()
            }
            other => other.to_string(),
        }
    }

    /// A short name for the reason (a metrics label).
    pub fn reason(&self) -> &'static str {
        match self {
            Self::Auth(AuthError::BadSignature(_)) => "bad_signature",
            Self::Auth(AuthError::Stale { .. }) => "stale",
            Self::Auth(_) => "malformed",
            Self::UnknownAgent(_) => "unknown_agent",
            Self::Replay(_) => "replay",
            Self::AddressBudget => "address_budget",
            Self::AgentQuota(_) => "agent_quota",
            Self::Owner(_) => "owner",
        }
    }
}

/// The configured clients by agent id with their pinned keys (a key that is not an ed25519 key
/// was refused by the config already; should one get here, it is left out and logged).
pub(super) fn pinned(clients: &[Client]) -> HashMap<String, (VerifyingKey, Client)> {
    clients
        .iter()
        .filter_map(|c| {
            let key = c
                .key_bytes()
                .and_then(|k| VerifyingKey::from_bytes(&k).ok());
            if key.is_none() {
                tracing::error!(agent = %c.agent_id, "client key is not an ed25519 key; left out");
            }
            Some((c.agent_id.clone(), (key?, c.clone())))
        })
        .collect()
}

impl Service {
    /// Checks a Connect payload from a remote `peer` (QUIC) at `now_ms`; on success the peer
    /// may send requests as that agent. A client whose block names `uids` is refused: it is
    /// for local users only.
    pub fn authenticate(
        &mut self,
        peer: SocketAddr,
        payload: &[u8],
        now_ms: u64,
    ) -> Result<String, Refusal> {
        self.admit(
            peer,
            payload,
            now_ms,
            None::<fn() -> Result<owner::Owner, String>>,
        )
    }

    /// Checks a Connect payload from a loopback `peer` (RUDP) at `now_ms`, and then (only
    /// then: the socket table is read for signed Connects alone) the local user that owns the
    /// peer's socket, by `owner` ([`owner::read`]): the session is that user's, and ends when
    /// its address passes to another ([`Service::check_owner`]).
    pub fn authenticate_local(
        &mut self,
        peer: SocketAddr,
        payload: &[u8],
        now_ms: u64,
        owner: impl FnOnce() -> Result<owner::Owner, String>,
    ) -> Result<String, Refusal> {
        self.admit(peer, payload, now_ms, Some(owner))
    }

    fn admit(
        &mut self,
        peer: SocketAddr,
        payload: &[u8],
        now_ms: u64,
        local: Option<impl FnOnce() -> Result<owner::Owner, String>>,
    ) -> Result<String, Refusal> {
        let out = self.check_connect(peer, payload, now_ms).and_then(|agent| {
            let allowed = self
                .clients
                .get(&agent)
                .and_then(|(_, c)| c.uids.as_deref());
            let uid = match local {
                Some(read) => owner::admit(read(), allowed)?,
                None if allowed.is_some() => return Err(owner::OwnerError::NotLocal.into()),
                None => None,
            };
            Ok((agent, uid))
        });
        match out {
            Ok((agent, uid)) => {
                self.stats.accepted += 1;
                self.peers.insert(
                    peer,
                    Peer {
                        agent: agent.clone(),
                        uid,
                        owner_checked: std::time::Instant::now(),
                    },
                );
                let m = &self.metrics;
                m.connects_accepted.inc();
                m.peers.set(self.peers.len() as i64);
                tracing::info!(%peer, %agent, uid, "CultNet client connected");
                Ok(agent)
            }
            Err(why) => {
                self.stats.refused += 1;
                self.metrics.refused(why.reason());
                if let Some(held_back) = self.refusals.admit(peer.ip(), std::time::Instant::now()) {
                    // What a client sent is written escaped (quoted, control characters
                    // spelled out): it cannot forge a line of the log.
                    tracing::warn!(%peer, held_back, reason = why.reason(), detail = ?why.to_string(), "CultNet connect refused");
                }
                Err(why)
            }
        }
    }

    pub(super) fn check_connect(
        &mut self,
        peer: SocketAddr,
        payload: &[u8],
        now_ms: u64,
    ) -> Result<String, Refusal> {
        let p = ConnectPayload::decode(payload)?;
        let (key, _) = self
            .clients
            .get(&p.agent_id)
            .ok_or_else(|| Refusal::UnknownAgent(p.agent_id.clone()))?;
        // A replayed payload is refused before its signature costs anything (only verified
        // nonces are remembered, so a forger cannot poison this). From the address that used
        // it first, it is that client resending its Connect (its first was dropped from a full
        // waiting room, or answered after it timed out): it is let through.
        let replayed = self
            .nonces
            .get(&(p.agent_id.clone(), p.nonce.clone()))
            .map(|(_, from)| *from);
        if replayed.is_some_and(|from| from != peer) {
            return Err(Refusal::Replay(p.agent_id));
        }
        // Every signature check is charged to the address asking for it, before it is made.
        if !self.verifies.take(peer, now_ms) {
            return Err(Refusal::AddressBudget);
        }
        p.verify(key, self.connection_id, now_ms, self.max_skew_ms)?;
        if replayed.is_some() {
            return Ok(p.agent_id);
        }
        // A nonce older than twice the skew cannot pass the time check again: forget those
        // once there are a few, or when this agent is at its quota.
        let horizon = now_ms.saturating_sub(self.max_skew_ms.saturating_mul(2));
        let at_quota =
            |s: &Self| s.nonce_counts.get(&p.agent_id).copied().unwrap_or(0) >= s.nonce_quota;
        if self.nonces.len() >= 1024 || at_quota(self) {
            self.nonces.retain(|_, (at, _)| *at >= horizon);
            let mut counts: HashMap<String, usize> = HashMap::new();
            for (agent, _) in self.nonces.keys() {
                *counts.entry(agent.clone()).or_default() += 1;
            }
            self.nonce_counts = counts;
        }
        if at_quota(self) {
            // Only a flood of valid, fresh connects of this agent gets here; forgetting its
            // oldest would reopen a replay window, so it is refused until they age out.
            return Err(Refusal::AgentQuota(p.agent_id));
        }
        let fresh = self
            .nonces
            .insert((p.agent_id.clone(), p.nonce.clone()), (p.issued_at, peer))
            .is_none();
        if !fresh {
            return Err(Refusal::Replay(p.agent_id));
        }
        *self.nonce_counts.entry(p.agent_id.clone()).or_default() += 1;
        // Kept on disk too: a payload captured while the gateway restarts (whoever held its
        // port then) cannot be replayed to it once it is back.
        if let Err(e) = self
            .inbox
            .remember_nonce(&p.agent_id, &p.nonce, p.issued_at, peer)
        {
            tracing::warn!(agent = %p.agent_id, error = %e, "connect nonce not kept on disk: a restart forgets it");
        }
        Ok(p.agent_id)
    }

    /// The authenticated peers.
    pub fn peer_addrs(&self) -> Vec<SocketAddr> {
        self.peers.keys().copied().collect()
    }

    /// Forgets a peer whose session ended.
    pub fn forget(&mut self, peer: SocketAddr) {
        self.greeted.remove(&peer);
        if let Some(Peer { agent, .. }) = self.peers.remove(&peer) {
            self.metrics.peers.set(self.peers.len() as i64);
            tracing::info!(%peer, %agent, "CultNet client gone");
        }
    }

    /// Whether `agent` may make `req`.
    pub(super) fn permit(&self, agent: &str, req: &Request) -> Result<(), String> {
        let Some((_, client)) = self.clients.get(agent) else {
            return Err(format!("agent {agent:?} is no longer configured"));
        };
        let verb = match req {
            Request::Pending(_) => Verb::Pending,
            Request::Ack(_) => Verb::Ack,
            Request::Send(_) => Verb::Send,
            Request::Turn(_) => Verb::Turn,
            Request::Status(_) => Verb::Status,
            Request::Note(_) => Verb::Note,
            Request::Control(_) => Verb::Session,
            Request::ExtensionPending(_) | Request::ExtensionAck(_) => Verb::Extensions,
            _ => return Err("unknown request".into()),
        };
        if !client.verbs.contains(&verb) {
            return Err(format!("agent {agent:?} may not make {verb:?} requests"));
        }
        if let Some(persona) = req.persona() {
            if !self.ports.contains_key(persona) {
                return Err(format!("no Persona {persona:?} here"));
            }
            if !client.allows_persona(persona) {
                return Err(format!("agent {agent:?} may not act for {persona:?}"));
            }
        }
        if let Request::Send(s) = req {
            if s.request_id.trim().is_empty() {
                return Err(
                    "a send request needs a requestId (it makes the send exactly-once)".into(),
                );
            }
        }
        Ok(())
    }
}

/// The gateway's own ed25519 key, kept in `state_dir/cultnet/server.key` (64 hex digits, 0600,
/// in a 0700 directory): read, or made once. Its public half is what clients pin to know they
/// reached the gateway (`--server-key`).
pub fn server_key(state_dir: &std::path::Path) -> std::io::Result<ed25519_dalek::SigningKey> {
    let dir = state_dir.join("cultnet");
    let path = dir.join("server.key");
    if let Ok(text) = std::fs::read_to_string(&path) {
        let seed = crate::config::hex32(text.trim());
        return seed
            .map(|s| ed25519_dalek::SigningKey::from_bytes(&s))
            .ok_or_else(|| {
                std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    format!("{} is not 64 hex digits", path.display()),
                )
            });
    }
    let mut builder = std::fs::DirBuilder::new();
    builder.recursive(true);
    #[cfg(unix)]
    std::os::unix::fs::DirBuilderExt::mode(&mut builder, 0o700);
    builder.create(&dir)?;
    let seed = crate::config::new_key_seed();
    crate::config::write_private(&path, &crate::config::hex(&seed))?;
    Ok(ed25519_dalek::SigningKey::from_bytes(&seed))
}
