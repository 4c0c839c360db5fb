//! The QUIC adapter's side of the loop: what `gateway::quic` reports of its connections, and
//! where each peer's answers go (the endpoint for RUDP, a connection's queue for QUIC).

use super::*;

/// What the QUIC side (`gateway::quic`, above this module) tells the service loop about its connections.
#[derive(Debug)]
pub enum Remote {
    /// A connection's first frame, its Connect payload; the verdict goes back on `verdict`.
    Connect {
        /// The peer.
        peer: SocketAddr,
        /// Its Connect payload.
        payload: Bytes,
        /// Its connection (unique among the QUIC endpoint's).
        id: usize,
        /// Where its answers go (and how it is cut off).
        out: AnswerTx,
        /// `Ok` to go on, `Err(reason)` to close the connection.
        verdict: tokio::sync::oneshot::Sender<Result<(), String>>,
    },
    /// A message from an accepted peer.
    Frame {
        /// The peer.
        peer: SocketAddr,
        /// Its connection (a frame of another connection than the session's is not taken).
        id: usize,
        /// The message.
        payload: Bytes,
    },
    /// The connection ended.
    Gone {
        /// The peer.
        peer: SocketAddr,
        /// Which connection from that address ended (a newer one from the same address may
        /// be accepted already; its record stays).
        id: usize,
    },
}

/// An accepted QUIC peer: its connection, and where its answers go.
#[derive(Debug)]
pub(super) struct QuicPeer {
    pub(super) id: usize,
    pub(super) out: AnswerTx,
}

/// A QUIC peer whose answer queue is full: it does not read what it asked for.
#[derive(Debug)]
pub(super) struct Unread(pub(super) SocketAddr);

/// Where a peer's answers go.
#[derive(Clone, Debug)]
pub(super) enum Sink {
    Rudp(SocketAddr),
    Quic(SocketAddr, AnswerTx),
}

impl Sink {
    /// Sends from the service loop, never waiting: an RUDP answer goes straight into the
    /// endpoint's queue (a full one is reported as an event), a QUIC answer into its
    /// connection's queue; a full one is [`Unread`], and the loop cuts that peer off, so a
    /// client that does not read cannot hold the loop (and everyone else) up.
    pub(super) fn send(&self, endpoint: &mut Endpoint, bytes: Bytes) -> Result<(), Unread> {
        match self {
            Sink::Rudp(peer) => endpoint.send(*peer, CHANNEL, bytes),
            Sink::Quic(peer, out) => {
                if out.try_send(bytes) == Err(Unqueued::Full) {
                    return Err(Unread(*peer));
                }
            }
        }
        Ok(())
    }

    /// The same sink for a task of its own (an RUDP answer goes through a handle).
    pub(super) fn detach(&self, endpoint: &Endpoint) -> TaskSink {
        match self {
            Sink::Rudp(peer) => TaskSink::Rudp(endpoint.handle(), *peer),
            Sink::Quic(peer, out) => TaskSink::Quic(*peer, out.clone()),
        }
    }
}

/// Where an answer computed on a task of its own (a send, a verb) goes.
#[derive(Debug)]
pub(super) enum TaskSink {
    Rudp(EndpointHandle, SocketAddr),
    Quic(SocketAddr, AnswerTx),
}

impl TaskSink {
    pub(super) async fn send(&self, bytes: Bytes) {
        match self {
            TaskSink::Rudp(endpoint, peer) => {
                let _ = endpoint.send(*peer, CHANNEL, bytes).await;
            }
            TaskSink::Quic(peer, out) => {
                // As in the loop: a full queue means a client that does not read; its
                // connection closes, and the loop forgets and counts it when the connection
                // reports its end.
                if out.try_send(bytes) == Err(Unqueued::Full) && out.cut() {
                    tracing::warn!(%peer, "CultNet QUIC client cut off: it does not read its answers");
                }
            }
        }
    }
}

/// Cuts off a QUIC peer that does not read its answers, as an RUDP one with a full send queue
/// is: forgotten, counted, and its connection closed with the reason.
pub(super) fn cut_off_quic(
    service: &mut Service,
    quic: &mut HashMap<SocketAddr, QuicPeer>,
    peer: SocketAddr,
) {
    // Later answers of the same round find it gone already.
    let Some(gone) = quic.remove(&peer) else {
        return;
    };
    service.count_cut_off("unread");
    service.forget(peer);
    if gone.out.cut() {
        tracing::warn!(%peer, "CultNet QUIC client cut off: it does not read its answers");
    }
}

pub(super) fn remote_event(
    service: &mut Service,
    quic: &mut HashMap<SocketAddr, QuicPeer>,
    event: Remote,
    out: &mut Vec<(Sink, Answer)>,
) {
    match event {
        Remote::Connect {
            peer,
            payload,
            id,
            out,
            verdict,
        } => {
            // One session per address: a second connection from the same address and port
            // would otherwise take over the first's session and its answers.
            if quic.get(&peer).is_some_and(|p| p.id != id) {
                let _ = verdict.send(Err(
                    "another connection from this address and port is open; close it first"
                        .to_owned(),
                ));
                return;
            }
            let now = u64::try_from(crate::clock::unix_ms()).unwrap_or(0);
            match service.authenticate(peer, &payload, now) {
                Ok(_) => {
                    quic.insert(peer, QuicPeer { id, out });
                    let _ = verdict.send(Ok(()));
                }
                Err(why) => {
                    let _ = verdict.send(Err(why.to_client()));
                }
            }
        }
        Remote::Frame { peer, id, payload } => {
            let Some(to) = quic.get(&peer).filter(|p| p.id == id) else {
                return;
            };
            let sink = Sink::Quic(peer, to.out.clone());
            let frame = Frame {
                channel: Arc::from(CHANNEL),
                payload,
            };
            for answer in service.handle(peer, &frame) {
                if matches!(answer, Answer::Disconnect(_)) {
                    // Dropping its sender ends its writer, which closes the connection.
                    quic.remove(&peer);
                }
                out.push((sink.clone(), answer));
            }
        }
        Remote::Gone { peer, id } => {
            if quic.get(&peer).is_some_and(|p| p.id == id) {
                if quic.remove(&peer).is_some_and(|p| p.out.was_cut()) {
                    // Cut off by a send's or verb's task, which cannot reach the stats: the
                    // loop's own cut-offs remove the record at once and never get here.
                    service.count_cut_off("unread");
                }
                service.forget(peer);
            }
        }
    }
}
