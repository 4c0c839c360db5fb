//! The service loop: its own thread, driving the endpoint and the QUIC peers, group-committing
//! acks, running sends and verbs on tasks, reloading clients and Personas, and draining at stop.

use super::*;

/// Runs the service over an endpoint until `stop` turns true.
pub async fn serve(service: Service, endpoint: Endpoint, stop: watch::Receiver<bool>) {
    serve_with(service, endpoint, None, stop).await;
}

/// A new set of clients and Personas for a running service (a reloaded config).
#[derive(Debug)]
pub struct Update {
    /// The configured clients (their grants take effect at once; a peer whose agent is gone
    /// is refused from its next request on).
    pub clients: Vec<Client>,
    /// Every Persona as she runs now.
    pub ports: BTreeMap<String, Port>,
    /// Told once the service holds the new set (and no longer the old Personas' handles).
    pub applied: Option<tokio::sync::oneshot::Sender<()>>,
}

/// [`serve`], plus the peers of the QUIC side when `remote` is given.
pub async fn serve_with(
    service: Service,
    endpoint: Endpoint,
    remote: Option<mpsc::Receiver<Remote>>,
    stop: watch::Receiver<bool>,
) {
    serve_updating(service, endpoint, remote, None, stop).await;
}

/// What a client whose key a reload changed or removed is told as its session ends.
pub(super) const KEY_CHANGED: &str = "your key was changed or removed from the gateway's config";

/// QUIC events the loop takes in one batch at most (their acks share one flush).
pub(super) const BATCH: usize = 256;

/// [`serve_with`], taking [`Update`]s (a reloaded config) while it runs.
///
/// The loop drives the endpoint itself: each round takes every datagram waiting, answers what
/// can be answered at once, flushes the inbox once for all the acks among them (group commit),
/// then queues the answers and sends them, all without a hop to another task.
pub async fn serve_updating(
    mut service: Service,
    mut endpoint: Endpoint,
    mut remote: Option<mpsc::Receiver<Remote>>,
    mut updates: Option<mpsc::Receiver<Update>>,
    mut stop: watch::Receiver<bool>,
) {
    let tasks = Tasks {
        runtime: service
            .tasks
            .clone()
            .unwrap_or_else(tokio::runtime::Handle::current),
        sends: Arc::new(tokio::sync::Semaphore::new(MAX_SENDS_IN_FLIGHT)),
        running: Arc::new(()),
    };
    let mut quic: HashMap<SocketAddr, QuicPeer> = HashMap::new();
    let mut out: Vec<(Sink, Answer)> = Vec::new();
    let mut unread: Vec<SocketAddr> = Vec::new();
    loop {
        let from_quic = next_from(&mut remote);
        let update = next_from(&mut updates);
        tokio::select! {
            () = endpoint.ready() => {}
            u = update => {
                match u {
                    Some(u) => {
                        for peer in service.update(u) {
                            match quic.remove(&peer) {
                                Some(q) => {
                                    q.out.cut();
                                }
                                None => endpoint.finish(peer, KEY_CHANGED),
                            }
                        }
                    }
                    None => updates = None,
                }
                continue;
            }
            r = from_quic => {
                match r {
                    Some(r) => remote_event(&mut service, &mut quic, r, &mut out),
                    None => remote = None,
                }
            }
            _ = stop.changed() => break,
        };
        if !endpoint.pump() {
            break;
        }
        // Everything waiting joins this round: its acks share one flush.
        while let Some(e) = endpoint.poll_event() {
            endpoint_event(&mut service, &mut endpoint, e, &mut out);
        }
        if let Some(rx) = remote.as_mut() {
            for _ in 0..BATCH {
                let Ok(r) = rx.try_recv() else { break };
                remote_event(&mut service, &mut quic, r, &mut out);
            }
        }
        let flushed = service.commit();
        if let Err(e) = &flushed {
            tracing::error!("CultNet: the inbox could not flush acks: {e}");
        }
        for (sink, answer) in out.drain(..) {
            if let Err(Unread(peer)) = run_answer(
                &service.runtime_id,
                &tasks,
                &mut endpoint,
                &sink,
                answer,
                flushed.is_ok(),
            ) {
                unread.push(peer);
            }
        }
        for peer in unread.drain(..) {
            cut_off_quic(&mut service, &mut quic, peer);
        }
        endpoint.flush().await;
    }
    drain(&mut service, &mut endpoint, &mut remote, &quic, &tasks).await;
}

/// The next message of an optional channel; never, without one (a `select!` branch that
/// cannot fire).
pub(super) async fn next_from<T>(rx: &mut Option<mpsc::Receiver<T>>) -> Option<T> {
    match rx.as_mut() {
        Some(rx) => rx.recv().await,
        None => std::future::pending().await,
    }
}

/// Why a stopping service's clients are turned away, and its sessions end.
pub(super) const SHUTTING_DOWN: &str = "the gateway is shutting down";

/// How long a stopping service waits for the answers of the sends and verbs in flight.
pub(super) const DRAIN_TASKS: std::time::Duration = std::time::Duration::from_millis(2500);

/// How long it then drives its sessions' last answers (a session's own linger is shorter).
pub(super) const DRAIN_SESSIONS: std::time::Duration = std::time::Duration::from_millis(1500);

/// How long a stopping service takes at most, from `stop` to its loop's end.
pub const DRAIN: std::time::Duration = DRAIN_TASKS.saturating_add(DRAIN_SESSIONS);

/// Stops without losing the answers in flight, bounded in time: the sends and verbs running
/// on tasks answer (new requests are answered `failed`, retry later; new Connects refused),
/// then every RUDP session is finished (its queued answers delivered, then a Disconnect with
/// the reason) and driven until it ends. QUIC connections close with their own endpoint.
pub(super) async fn drain(
    service: &mut Service,
    endpoint: &mut Endpoint,
    remote: &mut Option<mpsc::Receiver<Remote>>,
    quic: &HashMap<SocketAddr, QuicPeer>,
    tasks: &Tasks,
) {
    let until = tokio::time::Instant::now() + DRAIN_TASKS;
    while tasks.answering() > 0 && tokio::time::Instant::now() < until {
        closing_round(service, endpoint, remote, quic).await;
    }
    if tasks.answering() > 0 {
        tracing::warn!(
            unanswered = tasks.answering(),
            "CultNet service stopping with sends or verbs still unanswered"
        );
    }
    let peers: Vec<SocketAddr> = service
        .peer_addrs()
        .into_iter()
        .filter(|p| endpoint.has_session(*p))
        .collect();
    for peer in &peers {
        endpoint.finish(*peer, SHUTTING_DOWN);
    }
    let until = tokio::time::Instant::now() + DRAIN_SESSIONS;
    while peers.iter().any(|p| endpoint.has_session(*p)) && tokio::time::Instant::now() < until {
        closing_round(service, endpoint, remote, quic).await;
    }
    for peer in peers {
        endpoint.disconnect(peer, SHUTTING_DOWN);
    }
    endpoint.flush().await;
}

/// One round of a stopping service: waits for work (or a short tick, so the caller can see
/// tasks end), turns new requests and Connects away, sends what tasks answered.
pub(super) async fn closing_round(
    service: &mut Service,
    endpoint: &mut Endpoint,
    remote: &mut Option<mpsc::Receiver<Remote>>,
    quic: &HashMap<SocketAddr, QuicPeer>,
) {
    let from_quic = next_from(remote);
    let mut turned_away = Vec::new();
    tokio::select! {
        () = endpoint.ready() => {}
        r = from_quic => match r {
            Some(Remote::Connect { verdict, .. }) => {
                let _ = verdict.send(Err(SHUTTING_DOWN.to_owned()));
            }
            Some(Remote::Frame { peer, id, payload }) => {
                if let Some(to) = quic.get(&peer).filter(|p| p.id == id) {
                    let frame = Frame { channel: Arc::from(CHANNEL), payload };
                    turned_away.push((Sink::Quic(peer, to.out.clone()), frame));
                }
            }
            Some(Remote::Gone { peer, .. }) => service.forget(peer),
            None => *remote = None,
        },
        () = tokio::time::sleep(std::time::Duration::from_millis(10)) => {}
    }
    endpoint.pump();
    while let Some(event) = endpoint.poll_event() {
        match event {
            EndpointEvent::Hub(HubEvent::ConnectRequest(req)) => {
                endpoint.refuse(req, SHUTTING_DOWN);
            }
            EndpointEvent::Hub(HubEvent::Frame { peer, frame })
                if service.peers.contains_key(&peer) =>
            {
                turned_away.push((Sink::Rudp(peer), frame));
            }
            EndpointEvent::Hub(HubEvent::Disconnected { peer, .. }) => service.forget(peer),
            EndpointEvent::SendFailed { peer, error } => {
                tracing::debug!(%peer, "answer not sent while stopping: {error}");
            }
            _ => {}
        }
    }
    for (sink, frame) in turned_away {
        for answer in service.retry_later(&frame, format!("{SHUTTING_DOWN}; retry later")) {
            if let Answer::Reply(bytes) = answer {
                let _ = sink.send(endpoint, bytes);
            }
        }
    }
    endpoint.flush().await;
}

/// Takes one endpoint event.
pub(super) fn endpoint_event(
    service: &mut Service,
    endpoint: &mut Endpoint,
    event: EndpointEvent,
    out: &mut Vec<(Sink, Answer)>,
) {
    let event = match event {
        EndpointEvent::Hub(e) => e,
        EndpointEvent::SendFailed { peer, error } => {
            if matches!(error, wire::error::SendError::QueueFull { .. })
                && service.peers.contains_key(&peer)
            {
                // A client that does not read its answers holds our memory: cut it off.
                service.count_cut_off("unread");
                tracing::warn!(%peer, "CultNet client cut off: it does not read its answers");
                service.forget(peer);
                endpoint.disconnect(peer, "too many answers unread (send queue full)");
                return;
            }
            tracing::warn!(%peer, "answer not sent: {error}");
            return;
        }
        EndpointEvent::AcceptNotApplied { peer, error } => {
            // The record it left was dealt with where the verdict was made (below).
            tracing::debug!(%peer, "CultNet Connect not accepted: {error}");
            return;
        }
    };
    match event {
        HubEvent::ConnectRequest(req) => {
            let now = u64::try_from(crate::clock::unix_ms()).unwrap_or(0);
            let peer = req.peer;
            match service.authenticate_local(peer, &req.payload, now, || owner::read(peer)) {
                Ok(_) => {
                    let proof = service.accept_payload(&req.payload);
                    endpoint.accept_with(req, proof);
                }
                Err(why) => endpoint.refuse(req, &why.to_client()),
            }
            // One rule for every verdict, since verdicts are applied as they are made: if no
            // session is open for the address now, no record of a peer stays. That covers an
            // accept that came too late (`Expired`) or found every slot taken (`Full`), one
            // superseded by a newer Connect waiting from the same address (whose own event
            // comes later and authenticates afresh), and a refusal after an earlier Connect's
            // record was left by a superseded accept. Otherwise the record would count as a
            // peer until a Connect from that address succeeded.
            if !endpoint.has_session(peer) {
                service.forget(peer);
            }
        }
        HubEvent::Frame { peer, frame } => {
            // Before a request is served, its session's address is still its owner's (looked
            // up afresh when the last finding is older than `owner::RECHECK`).
            if &*frame.channel == CHANNEL
                && service.owner_due(peer, std::time::Instant::now())
                && !still_owned(service, endpoint, peer)
            {
                return;
            }
            let sink = Sink::Rudp(peer);
            for answer in service.handle(peer, &frame) {
                out.push((sink.clone(), answer));
            }
        }
        HubEvent::Disconnected { peer, reason } => {
            tracing::debug!(%peer, ?reason, "CultNet session ended");
            service.forget(peer);
        }
        // What keeps a session alive is its owner's too.
        HubEvent::Pong { peer, .. } => {
            still_owned(service, endpoint, peer);
        }
        HubEvent::Connected { .. } => {}
    }
}

/// Whether `peer`'s session is still held by the local user who opened it, read afresh from
/// the socket table; if not it is ended here, unserved ([`Service::check_owner`]).
fn still_owned(service: &mut Service, endpoint: &mut Endpoint, peer: SocketAddr) -> bool {
    if !service.is_bound(peer) {
        return true;
    }
    match service.check_owner(peer, owner::read(peer)) {
        Ok(()) => true,
        Err(why) => {
            endpoint.disconnect(peer, &format!("session ended: {why}"));
            false
        }
    }
}

/// Where the loop runs the answers that wait (sends, verbs, read receipts), and what it knows
/// of them: a send takes one of [`MAX_SENDS_IN_FLIGHT`] permits; every send and verb holds a
/// clone of `running` until its answer is queued, so a stopping loop can wait for them.
pub(super) struct Tasks {
    runtime: tokio::runtime::Handle,
    sends: Arc<tokio::sync::Semaphore>,
    running: Arc<()>,
}

impl Tasks {
    /// Sends and verbs whose answers are not queued yet.
    pub(super) fn answering(&self) -> usize {
        Arc::strong_count(&self.running) - 1
    }
}

/// Carries out one answer: queued at once, or handed to a task of its own (a send, a verb).
pub(super) fn run_answer(
    runtime_id: &str,
    tasks: &Tasks,
    endpoint: &mut Endpoint,
    sink: &Sink,
    answer: Answer,
    flushed: bool,
) -> Result<(), Unread> {
    match answer {
        Answer::Reply(bytes) => return sink.send(endpoint, bytes),
        Answer::AfterFlush { ok, failed } => {
            return sink.send(endpoint, if flushed { ok } else { failed });
        }
        Answer::Disconnect(reason) => match sink {
            // Its last answers (the refusals that told it) go first.
            Sink::Rudp(peer) => endpoint.finish(*peer, &reason),
            Sink::Quic(..) => {} // Its sender was dropped with the peer.
        },
        Answer::Send {
            record_key,
            request,
            client_request_id,
            mouth,
            slot,
        } => {
            let Ok(permit) = tasks.sends.clone().try_acquire_owned() else {
                // Back-pressure instead of an unbounded pile of tasks; `failed` = retry later.
                let receipt = SendReceipt {
                    request_id: client_request_id,
                    status: Status::Failed,
                    error: Some(format!(
                        "{MAX_SENDS_IN_FLIGHT} sends are in flight; retry later"
                    )),
                    ..SendReceipt::default()
                };
                let bytes = receipt_bytes(runtime_id, ids::SEND_RECEIPT, &record_key, &receipt);
                return sink.send(endpoint, bytes);
            };
            let sink = sink.detach(endpoint);
            let runtime_id = runtime_id.to_owned();
            let running = tasks.running.clone();
            tasks.runtime.spawn(async move {
                let receipt = mouth.send_for_client(&request, &client_request_id).await;
                drop(permit);
                drop(slot);
                let bytes = receipt_bytes(&runtime_id, ids::SEND_RECEIPT, &record_key, &receipt);
                sink.send(bytes).await;
                // Held (and moved in) until the answer is queued: see `Tasks::answering`.
                drop(running);
            });
        }
        Answer::Control {
            record_key,
            request,
            receipt,
            slot,
        } => {
            let sink = sink.detach(endpoint);
            let runtime_id = runtime_id.to_owned();
            let running = tasks.running.clone();
            tasks.runtime.spawn(async move {
                let receipt = receipt.await.unwrap_or_else(|_| ControlReceipt {
                    persona: request.persona,
                    action: request.action,
                    status: Status::Failed,
                    error: Some("her turn loop stopped before applying it".into()),
                    ..ControlReceipt::default()
                });
                drop(slot);
                let bytes = receipt_bytes(&runtime_id, ids::CONTROL_RECEIPT, &record_key, &receipt);
                sink.send(bytes).await;
                drop(running);
            });
        }
        Answer::ReadReceipt {
            mouth,
            room_id,
            event_id,
        } => {
            tasks
                .runtime
                .spawn(async move { mouth.read_receipt(&room_id, &event_id).await });
        }
    }
    Ok(())
}

/// The settings of the hub under the service: the per-client memory a client can make the
/// gateway hold (its send queue, its half-received requests), kept well below the protocol's
/// defaults, which are sized for media peers.
pub fn hub_config() -> wire::hub::HubConfig {
    let mut cfg = wire::hub::HubConfig::default();
    // A page is at most MAX_REPLY_BYTES; requests are far smaller (a note is 16 KiB at most).
    cfg.session.max_payload = MAX_REPLY_BYTES as usize + 64 * 1024;
    cfg.session.max_reassembly_bytes = cfg.session.max_payload + 64 * 1024;
    cfg.session.max_held_bytes = 1024 * 1024;
    cfg.session.max_queued_bytes = 2 * MAX_REPLY_BYTES as usize;
    cfg
}

/// The running service: its endpoint's address, and a way to wait for its end.
#[derive(Debug)]
pub struct Started {
    /// The endpoint (its address; commands such as stats).
    pub endpoint: EndpointHandle,
    /// Told when the service thread ends.
    pub done: tokio::sync::oneshot::Receiver<()>,
}

/// Starts the endpoint on `bind` and the service loop on a thread of their own (see the module
/// docs); sends, verbs and read receipts run on the calling runtime. Stops when `stop` turns
/// true.
pub async fn start(
    bind: SocketAddr,
    seed: u64,
    service: Service,
    remote: Option<mpsc::Receiver<Remote>>,
    updates: Option<mpsc::Receiver<Update>>,
    stop: watch::Receiver<bool>,
) -> Result<Started, crate::endpoint::EndpointError> {
    let service = service.with_tasks(tokio::runtime::Handle::current());
    let (ready_tx, ready_rx) = tokio::sync::oneshot::channel();
    let (done_tx, done) = tokio::sync::oneshot::channel();
    let thread = std::thread::Builder::new()
        .name("cultnet-service".into())
        .spawn(move || {
            let rt = match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(rt) => rt,
                Err(e) => {
                    let _ = ready_tx.send(Err(crate::endpoint::EndpointError::Bind {
                        addr: bind,
                        source: e,
                    }));
                    return;
                }
            };
            rt.block_on(async move {
                let mut cfg = crate::endpoint::EndpointConfig::new(bind, seed);
                cfg.hub = hub_config();
                match Endpoint::bind(cfg).await {
                    Ok(endpoint) => {
                        let _ = ready_tx.send(Ok(endpoint.handle()));
                        // A task of its own, not the block_on future: a block_on future woken
                        // by I/O costs the runtime an extra non-blocking epoll_wait per round.
                        let serving =
                            tokio::spawn(serve_updating(service, endpoint, remote, updates, stop));
                        if let Err(e) = serving.await {
                            tracing::error!("CultNet service loop ended abnormally: {e}");
                        }
                    }
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                    }
                }
            });
            let _ = done_tx.send(());
        });
    if let Err(e) = thread {
        return Err(crate::endpoint::EndpointError::Bind {
            addr: bind,
            source: e,
        });
    }
    let endpoint = ready_rx
        .await
        .map_err(|_| crate::endpoint::EndpointError::Stopped)??;
    Ok(Started { endpoint, done })
}

impl Service {
    /// Takes a reloaded config's clients and the Personas as they now run. Returns the peers
    /// whose agent is gone or whose key changed: their sessions end (forgotten here; the loop
    /// closes them), since what let them in no longer would.
    pub fn update(&mut self, mut u: Update) -> Vec<SocketAddr> {
        let clients = pinned(&u.clients);
        let ended: Vec<SocketAddr> = self
            .peers
            .iter()
            .filter(|(_, p)| {
                let before = self.clients.get(&p.agent).map(|(k, _)| k.to_bytes());
                let now = clients.get(&p.agent).map(|(k, _)| k.to_bytes());
                now.is_none() || now != before
            })
            .map(|(peer, _)| *peer)
            .collect();
        for peer in &ended {
            if let Some(p) = self.peers.get(peer) {
                tracing::info!(%peer, agent = %p.agent, "CultNet session ended: its key was changed or removed");
            }
            self.forget(*peer);
        }
        self.clients = clients;
        let clients = &self.clients;
        self.agents.retain(|agent, _| clients.contains_key(agent));
        self.ports = std::mem::take(&mut u.ports);
        tracing::info!(
            clients = self.clients.len(),
            personas = self.ports.len(),
            "CultNet service reloaded"
        );
        if let Some(done) = u.applied.take() {
            let _ = done.send(());
        }
        ended
    }
}
