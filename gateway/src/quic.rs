//! CultNet for remote peers over QUIC (DESIGN decision 7: RUDP binds loopback; remote peers use
//! QUIC). Off unless `[cultnet.quic]` is configured.
//!
//! A connection carries one bidirectional stream, opened by the client. On it travel the same
//! `cultnet.schema.v0` messages as on the RUDP `schema` channel, each framed by its 4-byte
//! big-endian length (the stream framing of `wire::msg`). The first frame is the client's
//! signed Connect payload, checked exactly as on RUDP (the same connection id is signed); a
//! refusal closes the connection with the reason. ALPN is [`ALPN`].
//!
//! Before a connection is authenticated it gets little: new connections must prove their
//! address (a Retry round trip), at most [`MAX_UNAUTHENTICATED`] are in their handshake or
//! waiting for their Connect frame at once, at most [`MAX_UNAUTHENTICATED_PER_ADDRESS`] of them
//! from one address (more from it are refused); when all are taken the oldest is closed to make
//! room ([`PreAuth`]), so a remote that opens handshakes and never sends a Connect cannot keep
//! everyone out. That first frame may be at most
//! [`PRE_AUTH_FRAME`] bytes and must arrive within [`CONNECT_WAIT`], and each connection may
//! open one stream whose receive window is [`RECEIVE_WINDOW`]. So a flood of connections
//! costs a bounded amount of memory, and authenticated clients keep being served.
//!
//! The server's certificate comes from PEM files, or is made once (self-signed, for the names
//! [`SERVER_NAMES`]) and kept in `STATE/quic/`. Clients pin it: they trust exactly that
//! certificate and connect with the server name `cultnet-gateway`. Its SHA-256 is logged at
//! start.

use std::collections::{BTreeMap, HashMap};
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use quinn::rustls;
use quinn::rustls::pki_types::pem::PemObject;
use quinn::rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use sha2::{Digest, Sha256};
use tokio::sync::{mpsc, oneshot, watch, Notify};
use wire::msg::FrameDecoder;

use crate::answers::{answer_queue, AnswerRx};
use crate::service::Remote;

/// The ALPN protocol id.
pub const ALPN: &[u8] = b"cultnet/0";
/// Names a made certificate is valid for; clients connect with the first.
pub const SERVER_NAMES: [&str; 2] = ["cultnet-gateway", "localhost"];
/// Largest frame accepted on a stream.
pub const MAX_FRAME: usize = 8 * 1024 * 1024;
/// Largest first frame (the Connect payload, a few hundred bytes) before authentication.
pub const PRE_AUTH_FRAME: usize = 4 * 1024;
/// How long a new connection may take to open its stream and send its Connect payload.
pub const CONNECT_WAIT: Duration = Duration::from_secs(3);
/// Connections in their handshake or not yet authenticated, at most; more are refused.
pub const MAX_UNAUTHENTICATED: usize = 64;
/// Unauthenticated connections from one address (its IP), at most; more from it are refused.
pub const MAX_UNAUTHENTICATED_PER_ADDRESS: usize = 8;
/// Authenticated connections, at most; more are refused.
pub const MAX_CONNECTIONS: usize = 256;
/// Answers queued for one connection while its stream is blocked (the client not reading);
/// past them, or past [`ANSWER_QUEUE_BYTES`], the client is cut off, as an RUDP client with a
/// full send queue is.
pub const ANSWER_QUEUE: usize = 256;
/// Bytes of answers queued for one connection, at most: an RUDP session's send queue.
pub const ANSWER_QUEUE_BYTES: usize = 2 * crate::service::MAX_REPLY_BYTES as usize;
/// How long a connection the service let go of gets to take in its last answers before it is
/// closed.
pub const GOODBYE_WAIT: Duration = Duration::from_secs(1);
/// Bytes a client may have in flight towards the gateway, per stream and per connection.
pub const RECEIVE_WINDOW: u32 = 256 * 1024;
/// How long a stopping gateway waits for its connections to end on their own: the service's
/// drain (its answers in flight), then each connection's last answers ([`GOODBYE_WAIT`]).
pub const DRAIN_WAIT: Duration = crate::service::DRAIN
    .saturating_add(GOODBYE_WAIT)
    .saturating_add(Duration::from_millis(500));
/// The reason a connection closed by a stopping gateway is given.
const SHUTTING_DOWN: &[u8] = b"the gateway is shutting down";

/// QUIC setup failures.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum QuicError {
    /// The certificate or key could not be read, made or used.
    #[error("QUIC certificate: {0}")]
    Cert(String),
    /// Binding the socket failed.
    #[error("binding QUIC on {addr}: {source}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// The OS error.
        source: std::io::Error,
    },
}

/// The server's certificate and key.
#[derive(Debug)]
pub struct Identity {
    /// The certificate (chain), leaf first.
    pub certs: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
}

impl Identity {
    /// SHA-256 of the leaf certificate, hex: what an operator compares when pinning it.
    pub fn fingerprint(&self) -> String {
        self.certs
            .first()
            .map(|c| crate::config::hex(&Sha256::digest(c.as_ref())))
            .unwrap_or_default()
    }
}

/// The configured certificate, or the one kept in `STATE/quic/` (made on first use).
pub fn identity(
    cert_file: Option<&Path>,
    key_file: Option<&Path>,
    state_dir: &Path,
) -> Result<Identity, QuicError> {
    let bad = |what: &Path, e: &dyn std::fmt::Display| {
        QuicError::Cert(format!("{}: {e}", what.display()))
    };
    if let (Some(cert), Some(key)) = (cert_file, key_file) {
        let certs = CertificateDer::pem_file_iter(cert)
            .map_err(|e| bad(cert, &e))?
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| bad(cert, &e))?;
        if certs.is_empty() {
            return Err(QuicError::Cert(format!(
                "{} holds no certificate",
                cert.display()
            )));
        }
        let key = PrivateKeyDer::from_pem_file(key).map_err(|e| bad(key, &e))?;
        return Ok(Identity { certs, key });
    }
    let dir = state_dir.join("quic");
    let (cert_path, key_path): (PathBuf, PathBuf) = (dir.join("cert.der"), dir.join("key.der"));
    if let (Ok(cert), Ok(key)) = (std::fs::read(&cert_path), std::fs::read(&key_path)) {
        return Ok(Identity {
            certs: vec![CertificateDer::from(cert)],
            key: PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key)),
        });
    }
    let made = rcgen::generate_simple_self_signed(
        SERVER_NAMES
            .iter()
            .map(|s| (*s).to_owned())
            .collect::<Vec<_>>(),
    )
    .map_err(|e| QuicError::Cert(format!("making a certificate: {e}")))?;
    let key = made.key_pair.serialize_der();
    std::fs::create_dir_all(&dir).map_err(|e| bad(&dir, &e))?;
    write_private(&key_path, &key).map_err(|e| bad(&key_path, &e))?;
    std::fs::write(&cert_path, made.cert.der()).map_err(|e| bad(&cert_path, &e))?;
    tracing::info!(cert = %cert_path.display(), "made the QUIC certificate");
    Ok(Identity {
        certs: vec![made.cert.der().clone()],
        key: PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key)),
    })
}

fn write_private(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    #[cfg(unix)]
    use std::os::unix::fs::OpenOptionsExt;
    let mut opts = std::fs::OpenOptions::new();
    opts.write(true).create(true).truncate(true);
    #[cfg(unix)]
    opts.mode(0o600);
    opts.open(path)?.write_all(bytes)
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::aws_lc_rs::default_provider())
}

/// A QUIC server endpoint on `bind` with `identity`.
pub fn server(bind: SocketAddr, identity: Identity) -> Result<quinn::Endpoint, QuicError> {
    let cert_err = |e: rustls::Error| QuicError::Cert(e.to_string());
    let mut tls = rustls::ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(cert_err)?
        .with_no_client_auth()
        .with_single_cert(identity.certs, identity.key)
        .map_err(cert_err)?;
    tls.alpn_protocols = vec![ALPN.to_vec()];
    let crypto = quinn::crypto::rustls::QuicServerConfig::try_from(tls)
        .map_err(|e| QuicError::Cert(e.to_string()))?;
    let mut config = quinn::ServerConfig::with_crypto(Arc::new(crypto));
    let mut transport = quinn::TransportConfig::default();
    transport
        .max_concurrent_bidi_streams(1u32.into())
        .max_concurrent_uni_streams(0u32.into())
        .stream_receive_window(RECEIVE_WINDOW.into())
        .receive_window(RECEIVE_WINDOW.into());
    config
        .transport_config(Arc::new(transport))
        .max_incoming(MAX_UNAUTHENTICATED * 4)
        .incoming_buffer_size(16 * 1024)
        .incoming_buffer_size_total(1024 * 1024);
    quinn::Endpoint::server(config, bind).map_err(|source| QuicError::Bind { addr: bind, source })
}

/// Client configuration that trusts exactly `pinned` (the server's certificate).
pub fn client_config(pinned: &CertificateDer<'static>) -> Result<quinn::ClientConfig, QuicError> {
    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(pinned.clone())
        .map_err(|e| QuicError::Cert(e.to_string()))?;
    let mut tls = rustls::ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|e| QuicError::Cert(e.to_string()))?
        .with_root_certificates(roots)
        .with_no_client_auth();
    tls.alpn_protocols = vec![ALPN.to_vec()];
    let crypto = quinn::crypto::rustls::QuicClientConfig::try_from(tls)
        .map_err(|e| QuicError::Cert(e.to_string()))?;
    Ok(quinn::ClientConfig::new(Arc::new(crypto)))
}

/// Accepts connections until `stop`, each bridged into the service loop through `remote`.
///
/// Then takes no new ones, and lets those open end on their own (the service answers what is
/// in flight and lets go of each; each gets its last answers, then the reason), for at most
/// [`DRAIN_WAIT`], before the endpoint is closed.
pub async fn accept(
    endpoint: quinn::Endpoint,
    remote: mpsc::Sender<Remote>,
    metrics: Arc<crate::metrics::Metrics>,
    mut stop: watch::Receiver<bool>,
) {
    let unauthenticated = Arc::new(Mutex::new(PreAuth::new(
        MAX_UNAUTHENTICATED,
        MAX_UNAUTHENTICATED_PER_ADDRESS,
    )));
    let connections = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    loop {
        let incoming = tokio::select! {
            i = endpoint.accept() => i,
            _ = stop.changed() => break,
        };
        let Some(incoming) = incoming else { break };
        // Address validation: a new peer first echoes a Retry token (spoofed sources cannot).
        if !incoming.remote_address_validated() && incoming.may_retry() {
            let _ = incoming.retry();
            continue;
        }
        let Ok(slot) = connections.clone().try_acquire_owned() else {
            metrics.refused("quic_busy");
            incoming.refuse();
            continue;
        };
        let admitted = unauthenticated
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .admit(incoming.remote_address().ip());
        let pre = match admitted {
            Admit::Refused => {
                metrics.refused("quic_busy_address");
                incoming.refuse();
                continue;
            }
            Admit::In {
                id,
                cancel,
                evicted,
            } => {
                if let Some(oldest) = evicted {
                    metrics.refused("quic_evicted");
                    oldest.notify_one();
                }
                Ticket {
                    id,
                    cancel,
                    table: unauthenticated.clone(),
                }
            }
        };
        let remote = remote.clone();
        let stop = stop.clone();
        tokio::spawn(async move {
            let _slot = slot;
            if let Err(e) = connection(incoming, remote, pre, stop).await {
                tracing::debug!("QUIC connection ended: {e}");
            }
        });
    }
    // Draining: new connections are refused at once (not left to time out) while the open
    // ones end on their own.
    let all = u32::try_from(MAX_CONNECTIONS).unwrap_or(u32::MAX);
    let refusing = async {
        while let Some(incoming) = endpoint.accept().await {
            incoming.refuse();
        }
    };
    let drained = async {
        tokio::select! {
            _ = connections.acquire_many(all) => {}
            () = refusing => {}
        }
    };
    if tokio::time::timeout(DRAIN_WAIT, drained).await.is_err() {
        tracing::warn!(
            open = MAX_CONNECTIONS - connections.available_permits(),
            "QUIC connections still open after {DRAIN_WAIT:?}: closed"
        );
    }
    endpoint.close(2u32.into(), SHUTTING_DOWN);
    // The close frames go out before the process ends.
    let _ = tokio::time::timeout(GOODBYE_WAIT, endpoint.wait_idle()).await;
}

/// What a connection closed to make room for a newer one is told.
const EVICTED: &[u8] = b"closed by the gateway: no Connect yet, and its place was needed";

/// The connections not yet authenticated: at most `max` in all and `per_address` from one
/// address. A newcomer from an address at its cap is refused; one that finds every place taken
/// gets the oldest's, which is told to close. Pure bookkeeping: the accept loop acts on it.
#[derive(Debug)]
pub struct PreAuth {
    max: usize,
    per_address: usize,
    next: u64,
    /// Oldest first: its address and how to tell it to close.
    waiting: BTreeMap<u64, (IpAddr, Arc<Notify>)>,
    per_ip: HashMap<IpAddr, usize>,
}

/// [`PreAuth::admit`]'s answer.
#[derive(Debug)]
pub enum Admit {
    /// Its address has all the places it may hold.
    Refused,
    /// In, as `id`; `cancel` tells it to close; `evicted` is the oldest, to be told so.
    In {
        /// Its place.
        id: u64,
        /// Notified when it must close to make room.
        cancel: Arc<Notify>,
        /// The connection that gave up its place, if one had to.
        evicted: Option<Arc<Notify>>,
    },
}

impl PreAuth {
    /// A table of `max` places, `per_address` for one address.
    pub fn new(max: usize, per_address: usize) -> Self {
        Self {
            max: max.max(1),
            per_address: per_address.max(1),
            next: 0,
            waiting: BTreeMap::new(),
            per_ip: HashMap::new(),
        }
    }

    /// A newcomer from `ip`.
    pub fn admit(&mut self, ip: IpAddr) -> Admit {
        if self.per_ip.get(&ip).copied().unwrap_or(0) >= self.per_address {
            return Admit::Refused;
        }
        let evicted = if self.waiting.len() >= self.max {
            self.waiting
                .keys()
                .next()
                .copied()
                .and_then(|oldest| self.remove(oldest))
        } else {
            None
        };
        let id = self.next;
        self.next += 1;
        let cancel = Arc::new(Notify::new());
        self.waiting.insert(id, (ip, cancel.clone()));
        *self.per_ip.entry(ip).or_default() += 1;
        Admit::In {
            id,
            cancel,
            evicted,
        }
    }

    /// Place `id` is free: authenticated, ended, or evicted. Its closer, if it still held it.
    pub fn remove(&mut self, id: u64) -> Option<Arc<Notify>> {
        let (ip, cancel) = self.waiting.remove(&id)?;
        if let Some(n) = self.per_ip.get_mut(&ip) {
            *n -= 1;
            if *n == 0 {
                self.per_ip.remove(&ip);
            }
        }
        Some(cancel)
    }

    /// Places taken.
    pub fn len(&self) -> usize {
        self.waiting.len()
    }

    /// No place taken.
    pub fn is_empty(&self) -> bool {
        self.waiting.is_empty()
    }
}

/// A connection's place in [`PreAuth`], given back when dropped (authenticated or gone).
struct Ticket {
    id: u64,
    cancel: Arc<Notify>,
    table: Arc<Mutex<PreAuth>>,
}

impl Drop for Ticket {
    fn drop(&mut self) {
        self.table
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(self.id);
    }
}

async fn connection(
    incoming: quinn::Incoming,
    remote: mpsc::Sender<Remote>,
    pre_auth: Ticket,
    stop: watch::Receiver<bool>,
) -> anyhow::Result<()> {
    let mut frames = FrameDecoder::new(PRE_AUTH_FRAME);
    // Handshake, stream and Connect frame, all within CONNECT_WAIT, read in small pieces;
    // given up at once when a newer connection needs its place.
    let cancel = pre_auth.cancel.clone();
    let opened = tokio::time::timeout(CONNECT_WAIT, async {
        let conn = incoming.await?;
        let (send, mut recv) = tokio::select! {
            s = conn.accept_bi() => s?,
            () = cancel.notified() => {
                conn.close(3u32.into(), EVICTED);
                anyhow::bail!("closed before its Connect to make room");
            }
        };
        let first = tokio::select! {
            f = next_frame(&mut recv, &mut frames, PRE_AUTH_FRAME) => f,
            () = cancel.notified() => {
                conn.close(3u32.into(), EVICTED);
                anyhow::bail!("closed before its Connect to make room");
            }
        };
        anyhow::Ok((conn, send, recv, first))
    })
    .await;
    let (conn, mut send, mut recv, first) = match opened {
        Ok(Ok(o)) => o,
        Ok(Err(e)) => return Err(e),
        Err(_) => anyhow::bail!("no Connect frame within {CONNECT_WAIT:?}"),
    };
    let peer = conn.remote_address();
    let payload = match first {
        Ok(Some(p)) => p,
        Ok(None) => return Ok(()),
        Err(e) => {
            conn.close(
                1u32.into(),
                b"the first frame must be a Connect payload of at most 4 KiB",
            );
            return Err(e);
        }
    };
    let (out, mut outgoing) = answer_queue(ANSWER_QUEUE, ANSWER_QUEUE_BYTES);
    let id = conn.stable_id();
    let (verdict, refused) = oneshot::channel();
    remote
        .send(Remote::Connect {
            peer,
            id,
            payload,
            out,
            verdict,
        })
        .await?;
    if let Err(why) = refused.await? {
        conn.close(1u32.into(), why.as_bytes());
        return Ok(());
    }
    drop(pre_auth);
    frames.set_max(MAX_FRAME);
    let closing = conn.clone();
    let bell = outgoing.bell();
    let writer = tokio::spawn(async move {
        let let_go = tokio::select! {
            let_go = write_answers(&mut send, &mut outgoing, peer) => let_go,
            // Its answers piled up unread (the writer is stuck on its flow control): nothing
            // more is worth delivering.
            () = bell.notified() => {
                closing.close(2u32.into(), b"closed by the gateway: too many answers unread");
                return;
            }
        };
        if !let_go {
            return; // The stream failed: the connection is going already.
        }
        // The service let go of this peer (it broke its limits). Its last answers (the
        // refusals that told it) are delivered first: closing at once would drop them.
        // A stopping service lets go of every peer.
        let why: &[u8] = if *stop.borrow() {
            SHUTTING_DOWN
        } else {
            b"closed by the gateway: limits exceeded"
        };
        if send.finish().is_ok() {
            let _ = tokio::time::timeout(GOODBYE_WAIT, send.stopped()).await;
        }
        closing.close(2u32.into(), why);
    });
    let (ended, service_gone) = loop {
        match next_frame(&mut recv, &mut frames, 64 * 1024).await {
            Ok(Some(payload)) => {
                if remote
                    .send(Remote::Frame { peer, id, payload })
                    .await
                    .is_err()
                {
                    break (Ok(()), true);
                }
            }
            Ok(None) => break (Ok(()), false),
            Err(e) => break (Err(e), false),
        }
    };
    if service_gone {
        // The service has stopped: the writer delivers what it queued, then closes.
        let _ = tokio::time::timeout(GOODBYE_WAIT * 2, writer).await;
    } else {
        let _ = remote.send(Remote::Gone { peer, id }).await;
        writer.abort();
    }
    ended
}

/// Writes the service's answers to the stream until the service lets go of the peer (every
/// sender dropped: `true`) or the stream fails (`false`).
async fn write_answers(
    send: &mut quinn::SendStream,
    outgoing: &mut AnswerRx,
    peer: SocketAddr,
) -> bool {
    while let Some(bytes) = outgoing.recv().await {
        let Ok(framed) = wire::msg::frame(&bytes, MAX_FRAME) else {
            tracing::warn!(%peer, len = bytes.len(), "answer too large for a QUIC frame");
            continue;
        };
        if send.write_all(&framed).await.is_err() {
            return false;
        }
    }
    true
}

/// The next whole frame, or `None` at the end of the stream; reads at most `chunk` bytes at a
/// time, so the decoder never holds more than its frame limit plus one chunk.
async fn next_frame(
    recv: &mut quinn::RecvStream,
    frames: &mut FrameDecoder,
    chunk: usize,
) -> anyhow::Result<Option<Bytes>> {
    loop {
        if let Some(frame) = frames.next_frame()? {
            return Ok(Some(frame));
        }
        match recv.read_chunk(chunk, true).await? {
            Some(chunk) => frames.push(&chunk.bytes),
            None => return Ok(None),
        }
    }
}

#[cfg(test)]
mod pre_auth_tests {
    use super::*;

    fn ip(n: u8) -> IpAddr {
        IpAddr::from([10, 0, 0, n])
    }

    fn id_of(a: &Admit) -> u64 {
        match a {
            Admit::In { id, .. } => *id,
            Admit::Refused => panic!("refused"),
        }
    }

    #[test]
    fn one_address_holds_at_most_its_share() {
        let mut t = PreAuth::new(64, 2);
        id_of(&t.admit(ip(1)));
        let second = id_of(&t.admit(ip(1)));
        assert!(matches!(t.admit(ip(1)), Admit::Refused));
        // Another address is not held up by it.
        id_of(&t.admit(ip(2)));
        // A place given back is the address's again.
        t.remove(second);
        id_of(&t.admit(ip(1)));
        assert_eq!(t.len(), 3);
    }

    #[test]
    fn when_every_place_is_taken_the_oldest_makes_room() {
        let mut t = PreAuth::new(3, 8);
        let first = t.admit(ip(1));
        let Admit::In {
            cancel: first_cancel,
            ..
        } = &first
        else {
            panic!()
        };
        id_of(&t.admit(ip(2)));
        id_of(&t.admit(ip(3)));
        match t.admit(ip(4)) {
            Admit::In {
                evicted: Some(e), ..
            } => assert!(Arc::ptr_eq(&e, first_cancel), "not the oldest"),
            other => panic!("{other:?}"),
        }
        assert_eq!(t.len(), 3);
        // The evicted one's own goodbye frees nothing more.
        assert!(t.remove(id_of(&first)).is_none());
        assert_eq!(t.len(), 3);
    }

    #[test]
    fn many_handshakes_from_one_address_cannot_keep_another_out() {
        let mut t = PreAuth::new(64, 8);
        let mut refused = 0;
        for _ in 0..500 {
            if matches!(t.admit(ip(9)), Admit::Refused) {
                refused += 1;
            }
        }
        assert_eq!(refused, 492);
        assert!(matches!(t.admit(ip(1)), Admit::In { evicted: None, .. }));
    }
}
