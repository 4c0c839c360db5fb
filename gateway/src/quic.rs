//! CultNet for remote peers over QUIC (DESIGN decision 7: RUDP binds loopback; remote peers use
//! QUIC). Off unless `[cultnet.quic]` is configured.
//!
//! A connection carries one bidirectional stream, opened by the client. On it travel the same
//! `cultnet.schema.v0` messages as on the RUDP `schema` channel, each framed by its 4-byte
//! big-endian length (the stream framing of `wire::msg`). The first frame is the client's
//! signed Connect payload, checked exactly as on RUDP (the same connection id is signed); a
//! refusal closes the connection with the reason. ALPN is [`ALPN`].
//!
//! The server's certificate comes from PEM files, or is made once (self-signed, for the names
//! [`SERVER_NAMES`]) and kept in `STATE/quic/`. Clients pin it: they trust exactly that
//! certificate and connect with the server name `cultnet-gateway`. Its SHA-256 is logged at
//! start.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use quinn::rustls;
use quinn::rustls::pki_types::pem::PemObject;
use quinn::rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use sha2::{Digest, Sha256};
use tokio::sync::{mpsc, oneshot, watch};
use wire::msg::FrameDecoder;

use crate::service::Remote;

/// The ALPN protocol id.
pub const ALPN: &[u8] = b"cultnet/0";
/// Names a made certificate is valid for; clients connect with the first.
pub const SERVER_NAMES: [&str; 2] = ["cultnet-gateway", "localhost"];
/// Largest frame accepted on a stream.
pub const MAX_FRAME: usize = 8 * 1024 * 1024;
/// How long a new connection may take to open its stream and send its Connect payload.
pub const CONNECT_WAIT: Duration = Duration::from_secs(10);

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
    let config = quinn::ServerConfig::with_crypto(Arc::new(crypto));
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
pub async fn accept(
    endpoint: quinn::Endpoint,
    remote: mpsc::Sender<Remote>,
    mut stop: watch::Receiver<bool>,
) {
    loop {
        let incoming = tokio::select! {
            i = endpoint.accept() => i,
            _ = stop.changed() => break,
        };
        let Some(incoming) = incoming else { break };
        let remote = remote.clone();
        tokio::spawn(async move {
            if let Err(e) = connection(incoming, remote).await {
                tracing::debug!("QUIC connection ended: {e}");
            }
        });
    }
    endpoint.close(0u32.into(), b"gateway stopping");
}

async fn connection(incoming: quinn::Incoming, remote: mpsc::Sender<Remote>) -> anyhow::Result<()> {
    let conn = incoming.await?;
    let peer = conn.remote_address();
    let (mut send, mut recv) = tokio::time::timeout(CONNECT_WAIT, conn.accept_bi()).await??;
    let mut frames = FrameDecoder::new(MAX_FRAME);
    let Some(payload) =
        tokio::time::timeout(CONNECT_WAIT, next_frame(&mut recv, &mut frames)).await??
    else {
        return Ok(());
    };
    let (out, mut outgoing) = mpsc::channel::<Bytes>(256);
    let (verdict, refused) = oneshot::channel();
    remote
        .send(Remote::Connect {
            peer,
            payload,
            out,
            verdict,
        })
        .await?;
    if let Err(why) = refused.await? {
        conn.close(1u32.into(), why.as_bytes());
        return Ok(());
    }
    let writer = tokio::spawn(async move {
        while let Some(bytes) = outgoing.recv().await {
            let Ok(framed) = wire::msg::frame(&bytes, MAX_FRAME) else {
                tracing::warn!(%peer, len = bytes.len(), "answer too large for a QUIC frame");
                continue;
            };
            if send.write_all(&framed).await.is_err() {
                break;
            }
        }
    });
    let ended = loop {
        match next_frame(&mut recv, &mut frames).await {
            Ok(Some(payload)) => {
                if remote.send(Remote::Frame { peer, payload }).await.is_err() {
                    break Ok(());
                }
            }
            Ok(None) => break Ok(()),
            Err(e) => break Err(e),
        }
    };
    let _ = remote.send(Remote::Gone { peer }).await;
    writer.abort();
    ended
}

/// The next whole frame, or `None` at the end of the stream.
async fn next_frame(
    recv: &mut quinn::RecvStream,
    frames: &mut FrameDecoder,
) -> anyhow::Result<Option<Bytes>> {
    loop {
        if let Some(frame) = frames.next_frame()? {
            return Ok(Some(frame));
        }
        match recv.read_chunk(64 * 1024, true).await? {
            Some(chunk) => frames.push(&chunk.bytes),
            None => return Ok(None),
        }
    }
}
