//! The CultNet UDP endpoint: the socket and a [`Hub`], driven in one of two ways.
//!
//! - [`spawn`]: a tokio task of its own owns them; everyone else talks to it through an
//!   [`EndpointHandle`] (commands in) and an [`EndpointEvent`] receiver (events out).
//! - [`Endpoint`]: its owner drives it ([`Endpoint::ready`], [`Endpoint::pump`],
//!   [`Endpoint::poll_event`], [`Endpoint::flush`]) and answers events in the same task, as the
//!   CultNet service does: a request then costs no hop between tasks on its way in or out.
//!   Handles still work (their commands are taken at each pump).
//!
//! Each wake-up the task drains commands, reads every datagram waiting (`recvmmsg`, with GRO
//! segments split by their stride), runs due timers, then sends everything the hub has to
//! send, packing consecutive same-size datagrams for one peer into one GSO send. Batching is
//! what lets it beat the kernel's one-datagram-per-syscall ceiling on this machine.
//!
//! # Back-pressure and loss
//! Sends are fire-and-forget: a frame the hub refuses (queue full, too large, unknown peer)
//! comes back as [`EndpointEvent::SendFailed`]. When the event receiver is full the task waits
//! for room instead of dropping events; meanwhile the socket is not read, the kernel buffer
//! fills, and the peers' resends recover what the kernel dropped.
//!
//! # Caveats
//! Dropping every [`EndpointHandle`] stops the task (after it sends what it has); so does
//! [`EndpointHandle::shutdown`].

use std::io::{self, IoSliceMut};
use std::net::SocketAddr;
use std::pin::Pin;

use bytes::Bytes;
use quinn_udp::{RecvMeta, Transmit, UdpSocketState};
use std::collections::VecDeque;
use tokio::io::Interest;
use tokio::net::UdpSocket;
use tokio::sync::{mpsc, oneshot};
use tokio::time::{Instant, Sleep};
use tracing::{debug, warn};
use wire::error::SendError;

use wire::hub::{ConnectRequest, Hub, HubConfig, HubError, HubEvent, HubStats};

/// Largest GSO batch in bytes (the kernel's limit for one UDP send).
const MAX_GSO_BYTES: usize = 65_000;
/// Receive buffers per `recvmmsg` call; each holds one datagram or one GRO aggregate.
const RECV_BUFFERS: usize = 16;
/// Datagrams one read can return.
const RECV_BATCH: usize = if RECV_BUFFERS < quinn_udp::BATCH_SIZE {
    RECV_BUFFERS
} else {
    quinn_udp::BATCH_SIZE
};
/// Whether a read returning fewer than [`RECV_BATCH`] datagrams means the queue is empty:
/// `recvmmsg` reads until it is; elsewhere one read may return one datagram of many.
const SHORT_READ_DRAINS: bool = cfg!(target_os = "linux") && RECV_BATCH > 1;
/// Bytes per receive buffer: a GRO aggregate never exceeds 64 KiB.
const RECV_BUFFER_BYTES: usize = 65_536;
/// Commands handled per wake-up before the socket gets its turn.
const COMMANDS_PER_TURN: usize = 4096;

/// Endpoint settings.
#[derive(Clone, Debug)]
pub struct EndpointConfig {
    /// Address to bind (CultNet RUDP binds loopback).
    pub bind: SocketAddr,
    /// Protocol settings.
    pub hub: HubConfig,
    /// Seed for the random initial sequences.
    pub seed: u64,
    /// Commands waiting for the task, at most (senders wait beyond it).
    pub command_capacity: usize,
    /// Events waiting for the owner, at most (the task waits beyond it).
    pub event_capacity: usize,
    /// Fraction of outgoing datagrams dropped on purpose, for tests and benchmarks of loss
    /// recovery. Always 0 in production.
    pub inject_loss: f64,
}

impl EndpointConfig {
    /// Defaults around a bind address.
    pub fn new(bind: SocketAddr, seed: u64) -> Self {
        Self {
            bind,
            hub: HubConfig::default(),
            seed,
            command_capacity: 8192,
            event_capacity: 8192,
            inject_loss: 0.0,
        }
    }
}

/// What the endpoint reports.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EndpointEvent {
    /// Something the hub reported.
    Hub(HubEvent),
    /// A frame handed to [`EndpointHandle::send`] was refused.
    SendFailed {
        /// To whom.
        peer: SocketAddr,
        /// Why.
        error: SendError,
    },
    /// An [`EndpointHandle::accept`] opened no session (see [`Hub::accept`]): the owner's
    /// record of that peer may have to go.
    AcceptNotApplied {
        /// Whose Connect.
        peer: SocketAddr,
        /// Why.
        error: HubError,
    },
}

/// Endpoint counters: the hub's, plus what the socket layer saw.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EndpointStats {
    /// The hub's counters.
    pub hub: HubStats,
    /// Datagrams handed to the kernel.
    pub datagrams_sent: u64,
    /// Send calls (one GSO batch carries several datagrams).
    pub send_calls: u64,
    /// Datagrams read.
    pub datagrams_received: u64,
    /// Datagrams dropped by `inject_loss`.
    pub injected_drops: u64,
}

/// Why a command could not be delivered.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EndpointError {
    /// The endpoint task has stopped.
    #[error("the CultNet endpoint has stopped")]
    Stopped,
    /// Binding or configuring the socket failed.
    #[error("binding the CultNet socket on {addr}: {source}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// The OS error.
        source: io::Error,
    },
}

#[derive(Debug)]
enum Command {
    Send {
        peer: SocketAddr,
        channel: &'static str,
        payload: Bytes,
    },
    Accept(ConnectRequest, Bytes),
    Refuse(ConnectRequest, String),
    Connect(SocketAddr, Bytes),
    Disconnect(SocketAddr, String),
    Ping(SocketAddr, Bytes),
    Stats(oneshot::Sender<EndpointStats>),
    Shutdown,
}

/// A cheap, cloneable handle to the endpoint task.
#[derive(Clone, Debug)]
pub struct EndpointHandle {
    tx: mpsc::Sender<Command>,
    local: SocketAddr,
}

impl EndpointHandle {
    /// The bound address.
    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }

    /// Sends a frame on `channel` (one of the known channel names, chosen at compile time).
    pub async fn send(
        &self,
        peer: SocketAddr,
        channel: &'static str,
        payload: Bytes,
    ) -> Result<(), EndpointError> {
        self.cmd(Command::Send {
            peer,
            channel,
            payload,
        })
        .await
    }

    /// Accepts a Connect the hub reported (see [`Hub::accept`] for when it is not applied).
    pub async fn accept(&self, req: ConnectRequest) -> Result<(), EndpointError> {
        self.cmd(Command::Accept(req, Bytes::new())).await
    }

    /// Refuses a Connect the hub reported, with a reason the client will see.
    pub async fn refuse(&self, req: ConnectRequest, reason: &str) -> Result<(), EndpointError> {
        self.cmd(Command::Refuse(req, reason.to_owned())).await
    }

    /// Opens a client session to `peer`.
    pub async fn connect(&self, peer: SocketAddr, payload: Bytes) -> Result<(), EndpointError> {
        self.cmd(Command::Connect(peer, payload)).await
    }

    /// Closes a session.
    pub async fn disconnect(&self, peer: SocketAddr, reason: &str) -> Result<(), EndpointError> {
        self.cmd(Command::Disconnect(peer, reason.to_owned())).await
    }

    /// Pings a peer.
    pub async fn ping(&self, peer: SocketAddr, payload: Bytes) -> Result<(), EndpointError> {
        self.cmd(Command::Ping(peer, payload)).await
    }

    /// The endpoint's counters.
    pub async fn stats(&self) -> Result<EndpointStats, EndpointError> {
        let (tx, rx) = oneshot::channel();
        self.cmd(Command::Stats(tx)).await?;
        rx.await.map_err(|_| EndpointError::Stopped)
    }

    /// Stops the task after it has sent what it has.
    pub async fn shutdown(&self) -> Result<(), EndpointError> {
        self.cmd(Command::Shutdown).await
    }

    async fn cmd(&self, c: Command) -> Result<(), EndpointError> {
        self.tx.send(c).await.map_err(|_| EndpointError::Stopped)
    }
}

/// Binds the socket and spawns the endpoint task on the current tokio runtime.
pub async fn spawn(
    cfg: EndpointConfig,
) -> Result<
    (
        EndpointHandle,
        mpsc::Receiver<EndpointEvent>,
        tokio::task::JoinHandle<()>,
    ),
    EndpointError,
> {
    let (driver, cmd_tx) = Driver::bind(&cfg).await?;
    let (ev_tx, ev_rx) = mpsc::channel(cfg.event_capacity);
    let local = driver.local;
    let task = tokio::spawn(driver.run(ev_tx));
    Ok((EndpointHandle { tx: cmd_tx, local }, ev_rx, task))
}

/// An endpoint its owner drives, in the owner's task (see the module docs). Each round:
/// await [`ready`](Self::ready) (alongside whatever else the owner waits for), [`pump`](Self::pump),
/// take every [`poll_event`](Self::poll_event), answer through [`send`](Self::send) and the
/// other verbs, then [`flush`](Self::flush).
///
/// Unlike a spawned endpoint, dropping every [`EndpointHandle`] does not stop it; the owner
/// decides (and [`EndpointHandle::shutdown`] makes `pump` return false).
#[derive(Debug)]
pub struct Endpoint {
    driver: Driver,
    tx: mpsc::Sender<Command>,
}

impl Endpoint {
    /// Binds the socket.
    pub async fn bind(cfg: EndpointConfig) -> Result<Self, EndpointError> {
        let (driver, tx) = Driver::bind(&cfg).await?;
        Ok(Self { driver, tx })
    }

    /// A handle for other tasks (their commands are taken at the next [`pump`](Self::pump)).
    pub fn handle(&self) -> EndpointHandle {
        EndpointHandle {
            tx: self.tx.clone(),
            local: self.driver.local,
        }
    }

    /// The bound address.
    pub fn local_addr(&self) -> SocketAddr {
        self.driver.local
    }

    /// Waits until there is work: a datagram, a command, a due timer, or an event not yet
    /// taken. Cancel-safe (nothing is lost when another branch of a `select!` wins).
    pub async fn ready(&mut self) {
        self.driver.ready().await;
    }

    /// Takes the commands waiting, reads every datagram waiting and runs due timers; false
    /// once [`EndpointHandle::shutdown`] was called.
    pub fn pump(&mut self) -> bool {
        self.driver.pump();
        !self.driver.shutdown
    }

    /// The next event: refused sends and verdicts first, then the hub's.
    pub fn poll_event(&mut self) -> Option<EndpointEvent> {
        self.driver.poll_event()
    }

    /// Queues a frame on `channel`; a refusal comes back as [`EndpointEvent::SendFailed`].
    pub fn send(&mut self, peer: SocketAddr, channel: &'static str, payload: Bytes) {
        self.driver
            .send(Instant::now().into_std(), peer, channel, payload);
    }

    /// Accepts a Connect (see [`Hub::accept`]); one not applied comes back as
    /// [`EndpointEvent::AcceptNotApplied`].
    pub fn accept(&mut self, req: ConnectRequest) {
        self.driver
            .accept(Instant::now().into_std(), &req, Bytes::new());
    }

    /// [`Endpoint::accept`], the Accept carrying `payload` (the server's proof of its key).
    pub fn accept_with(&mut self, req: ConnectRequest, payload: Bytes) {
        self.driver.accept(Instant::now().into_std(), &req, payload);
    }

    /// Refuses a Connect, with a reason the client will see.
    pub fn refuse(&mut self, req: ConnectRequest, reason: &str) {
        self.driver.refuse(&req, reason);
    }

    /// Closes a session.
    pub fn disconnect(&mut self, peer: SocketAddr, reason: &str) {
        self.driver.hub.disconnect(peer, reason);
    }

    /// Closes a session once what is queued for it is delivered, or after the session's
    /// linger (see [`wire::session::Session::finish`]).
    pub fn finish(&mut self, peer: SocketAddr, reason: &str) {
        self.driver
            .hub
            .finish(Instant::now().into_std(), peer, reason);
    }

    /// Whether a session with `peer` is open.
    pub fn has_session(&self, peer: SocketAddr) -> bool {
        self.driver.hub.session(peer).is_some()
    }

    /// Sends everything queued.
    pub async fn flush(&mut self) {
        self.driver.flush(Instant::now().into_std()).await;
    }
}

struct Driver {
    hub: Hub,
    socket: UdpSocket,
    state: UdpSocketState,
    local: SocketAddr,
    max_segments: usize,
    cmd_rx: mpsc::Receiver<Command>,
    /// Wakes [`Driver::ready`] at the hub's next timer.
    sleep: Pin<Box<Sleep>>,
    /// The GSO batch being built.
    batch: Vec<u8>,
    /// One datagram polled from the hub that did not fit the previous batch.
    scratch: Vec<u8>,
    scratch_dest: Option<SocketAddr>,
    recv_buf: Vec<u8>,
    shutdown: bool,
    /// Send failures waiting to be reported (never dropped).
    failures: VecDeque<EndpointEvent>,
    stats: EndpointStats,
    inject_loss: f64,
    rng: u64,
}

impl std::fmt::Debug for Driver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Driver")
            .field("local", &self.local)
            .field("stats", &self.stats)
            .finish_non_exhaustive()
    }
}

impl Driver {
    async fn bind(cfg: &EndpointConfig) -> Result<(Self, mpsc::Sender<Command>), EndpointError> {
        let bind_err = |source| EndpointError::Bind {
            addr: cfg.bind,
            source,
        };
        let socket = UdpSocket::bind(cfg.bind).await.map_err(bind_err)?;
        let state = UdpSocketState::new((&socket).into()).map_err(bind_err)?;
        let local = socket.local_addr().map_err(bind_err)?;
        let (cmd_tx, cmd_rx) = mpsc::channel(cfg.command_capacity);
        let driver = Driver {
            hub: Hub::new(cfg.hub.clone(), cfg.seed),
            max_segments: state.max_gso_segments().max(1),
            socket,
            state,
            local,
            cmd_rx,
            sleep: Box::pin(tokio::time::sleep(std::time::Duration::from_secs(3600))),
            batch: Vec::with_capacity(MAX_GSO_BYTES),
            scratch: Vec::with_capacity(MAX_GSO_BYTES),
            scratch_dest: None,
            recv_buf: vec![0; RECV_BUFFERS * RECV_BUFFER_BYTES],
            shutdown: false,
            failures: VecDeque::new(),
            stats: EndpointStats::default(),
            inject_loss: cfg.inject_loss,
            rng: cfg.seed | 1,
        };
        debug!(%local, gso = driver.max_segments, gro = driver.state.gro_segments(), "CultNet endpoint bound");
        Ok((driver, cmd_tx))
    }

    /// The spawned endpoint's task.
    async fn run(mut self, ev_tx: mpsc::Sender<EndpointEvent>) {
        loop {
            self.pump();
            self.flush(Instant::now().into_std()).await;
            if !self.deliver_events(&ev_tx).await || self.shutdown {
                return;
            }
            self.ready().await;
        }
    }

    /// Commands waiting, datagrams waiting, due timers.
    fn pump(&mut self) {
        let now = Instant::now().into_std();
        for _ in 0..COMMANDS_PER_TURN {
            match self.cmd_rx.try_recv() {
                Ok(c) => self.command(now, c),
                Err(mpsc::error::TryRecvError::Empty) => break,
                Err(mpsc::error::TryRecvError::Disconnected) => {
                    self.shutdown = true;
                    break;
                }
            }
        }
        self.receive(now);
        let now = Instant::now().into_std();
        if self.hub.poll_timeout().is_some_and(|t| t <= now) {
            self.hub.handle_timeout(now);
        }
    }

    /// Waits for a command (taken at once), a readable socket or the next timer; returns at
    /// once while events wait (an owner's own calls, such as a refused send, make some).
    async fn ready(&mut self) {
        if !self.failures.is_empty() || self.hub.has_events() {
            return;
        }
        let deadline = self.hub.poll_timeout().map(Instant::from_std);
        if let Some(d) = deadline.filter(|&d| d != self.sleep.deadline()) {
            // Only when it moved: a reset takes the timer out of tokio's wheel and back in.
            self.sleep.as_mut().reset(d);
        }
        tokio::select! {
            biased;
            c = self.cmd_rx.recv() => match c {
                Some(c) => self.command(Instant::now().into_std(), c),
                None => self.shutdown = true,
            },
            r = self.socket.readable() => {
                if let Err(e) = r {
                    warn!(error = %e, "CultNet socket not readable");
                }
            }
            _ = &mut self.sleep, if deadline.is_some() => {}
        }
    }

    /// Refused sends and verdicts first (so an owner never sees a later Connect's events
    /// before them), then the hub's events.
    fn poll_event(&mut self) -> Option<EndpointEvent> {
        self.failures
            .pop_front()
            .or_else(|| self.hub.poll_event().map(EndpointEvent::Hub))
    }

    /// Queues a frame; a refusal is reported as an event.
    fn send(
        &mut self,
        now: std::time::Instant,
        peer: SocketAddr,
        channel: &'static str,
        payload: Bytes,
    ) {
        if let Err(error) = self.hub.send(now, peer, channel, payload) {
            self.failures
                .push_back(EndpointEvent::SendFailed { peer, error });
        }
    }

    /// Applies an accept; one not applied is reported as an event.
    fn accept(&mut self, now: std::time::Instant, req: &ConnectRequest, payload: Bytes) {
        if let Err(error) = self.hub.accept_with(now, req, payload) {
            debug!(peer = %req.peer, %error, "accept not applied");
            // Reported before any event of a later Connect from that peer (failures go out
            // first), so the owner never forgets a newer peer's record.
            self.failures.push_back(EndpointEvent::AcceptNotApplied {
                peer: req.peer,
                error,
            });
        }
    }

    fn refuse(&mut self, req: &ConnectRequest, reason: &str) {
        if let Err(e) = self.hub.refuse(req, reason) {
            debug!(peer = %req.peer, error = %e, "refusal not sent");
        }
    }

    fn command(&mut self, now: std::time::Instant, c: Command) {
        match c {
            Command::Send {
                peer,
                channel,
                payload,
            } => self.send(now, peer, channel, payload),
            Command::Accept(req, payload) => self.accept(now, &req, payload),
            Command::Refuse(req, reason) => self.refuse(&req, &reason),
            Command::Connect(peer, payload) => self.hub.connect(now, peer, payload),
            Command::Disconnect(peer, reason) => self.hub.disconnect(peer, &reason),
            Command::Ping(peer, payload) => {
                let _ = self.hub.ping(peer, &payload);
            }
            Command::Stats(reply) => {
                let _ = reply.send(EndpointStats {
                    hub: self.hub.stats(),
                    ..self.stats
                });
            }
            Command::Shutdown => self.shutdown = true,
        }
    }

    /// Reads every datagram waiting, without blocking.
    ///
    /// On Linux (`recvmmsg`) a read that fills fewer buffers than it offered found the
    /// socket's queue empty, so it clears the socket's readiness itself, as a read finding
    /// nothing would: one system call less per wake-up. Nothing is missed: the readiness
    /// cleared is the one seen before the read (tokio keeps a newer one, raised by a datagram
    /// that arrived meanwhile, even while another thread runs the driver).
    fn receive(&mut self, now: std::time::Instant) {
        let mut meta = [RecvMeta::default(); RECV_BUFFERS];
        loop {
            let mut drained = false;
            let n = {
                // On the stack: this runs once per wake-up, more under a flood.
                let mut chunks = self.recv_buf.chunks_mut(RECV_BUFFER_BYTES);
                let mut bufs: [IoSliceMut<'_>; RECV_BUFFERS] =
                    std::array::from_fn(|_| IoSliceMut::new(chunks.next().unwrap_or_default()));
                let state = &self.state;
                let socket = &self.socket;
                let mut read = 0;
                match socket.try_io(Interest::READABLE, || {
                    read = state.recv(socket.into(), &mut bufs, &mut meta)?;
                    if SHORT_READ_DRAINS && read < RECV_BATCH {
                        // Tells tokio to clear the readiness it saw before this read.
                        drained = true;
                        return Err(io::ErrorKind::WouldBlock.into());
                    }
                    Ok(read)
                }) {
                    Ok(n) => n,
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock && drained => read,
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                    Err(e) => {
                        // ICMP errors from a vanished peer surface here; nothing to do but go on.
                        debug!(error = %e, "CultNet recv error");
                        return;
                    }
                }
            };
            for (i, m) in meta.iter().take(n).enumerate() {
                let buf = &self.recv_buf[i * RECV_BUFFER_BYTES..i * RECV_BUFFER_BYTES + m.len];
                let stride = if m.stride == 0 {
                    m.len.max(1)
                } else {
                    m.stride
                };
                for datagram in buf.chunks(stride) {
                    self.stats.datagrams_received += 1;
                    self.hub.handle(now, m.addr, datagram);
                }
            }
            if drained {
                return;
            }
        }
    }

    /// Sends everything the hub has, batching same-size datagrams to one peer with GSO.
    async fn flush(&mut self, now: std::time::Instant) {
        loop {
            self.batch.clear();
            let dest = match self.scratch_dest.take() {
                Some(d) => {
                    self.batch.extend_from_slice(&self.scratch);
                    d
                }
                None => match self.next_datagram(now, true) {
                    Some(d) => d,
                    None => return,
                },
            };
            let seg = self.batch.len();
            let mut count = 1;
            while count < self.max_segments && self.batch.len() + seg <= MAX_GSO_BYTES {
                let Some(d) = self.next_datagram(now, false) else {
                    break;
                };
                if d != dest || self.scratch.len() > seg {
                    self.scratch_dest = Some(d);
                    break;
                }
                self.batch.extend_from_slice(&self.scratch);
                count += 1;
                if self.scratch.len() < seg {
                    break; // A shorter datagram can only end a GSO batch.
                }
            }
            let transmit = Transmit {
                destination: dest,
                ecn: None,
                contents: &self.batch,
                segment_size: (count > 1).then_some(seg),
                src_ip: None,
            };
            self.stats.send_calls += 1;
            self.stats.datagrams_sent += count as u64;
            loop {
                let state = &self.state;
                let socket = &self.socket;
                match socket.try_io(Interest::WRITABLE, || state.send(socket.into(), &transmit)) {
                    Ok(()) => break,
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                        if socket.writable().await.is_err() {
                            break;
                        }
                    }
                    Err(e) => {
                        debug!(error = %e, "CultNet send error");
                        break;
                    }
                }
            }
        }
    }

    /// The hub's next datagram into the batch (`into_batch`) or the scratch buffer, skipping
    /// the ones `inject_loss` drops.
    fn next_datagram(&mut self, now: std::time::Instant, into_batch: bool) -> Option<SocketAddr> {
        loop {
            let buf = if into_batch {
                &mut self.batch
            } else {
                &mut self.scratch
            };
            buf.clear();
            let dest = self.hub.poll_transmit(now, buf)?;
            if self.inject_loss > 0.0 && self.roll() < self.inject_loss {
                self.stats.injected_drops += 1;
                continue;
            }
            return Some(dest);
        }
    }

    /// A uniform number in [0, 1) (xorshift64).
    fn roll(&mut self) -> f64 {
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        (self.rng >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Moves events to the owner, waiting for room; false once the owner is gone.
    async fn deliver_events(&mut self, ev_tx: &mpsc::Sender<EndpointEvent>) -> bool {
        while let Some(ev) = self.poll_event() {
            if ev_tx.send(ev).await.is_err() {
                return false;
            }
        }
        true
    }
}
