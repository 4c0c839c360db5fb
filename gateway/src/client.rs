//! A CultNet client of the gateway: connects with a signed Connect payload and makes requests,
//! waiting for the receipt under the request's record key. Used by `cultnet-gateway client` (an
//! operator's tool) and by the tests; Mind organs in other languages do the same over their own
//! CultNet runtimes.

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use ed25519_dalek::SigningKey;
use serde::{de::DeserializeOwned, Serialize};
use tokio::sync::mpsc;
use wire::docs::ConnectPayload;
use wire::error::CloseReason;
use wire::hub::HubEvent;
use wire::msg::{Message, Put, RawDocument};
use wire::session::GATEWAY_CONNECTION_ID;

use crate::endpoint::{self, EndpointConfig, EndpointError, EndpointEvent, EndpointHandle};
use crate::service::{message_id, rfc3339, CHANNEL};

/// Why a client call failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ClientError {
    /// The local endpoint failed.
    #[error(transparent)]
    Endpoint(#[from] EndpointError),
    /// The gateway refused the Connect (its reason).
    #[error("the gateway refused the connection: {0}")]
    Refused(String),
    /// The session ended.
    #[error("the gateway closed the session: {0:?}")]
    Closed(CloseReason),
    /// No answer in time.
    #[error("no answer from the gateway at {0} within {1:?}")]
    Timeout(SocketAddr, Duration),
    /// The gateway answered with `cultnet.error.v0`.
    #[error("the gateway answered with an error: {0}")]
    Gateway(String),
    /// QUIC failed (handshake, certificate, stream).
    #[error("QUIC: {0}")]
    Quic(String),
    /// The receipt did not decode.
    #[error("the receipt does not decode: {0}")]
    BadReceipt(String),
}

/// A connected client.
#[derive(Debug)]
pub struct Client {
    endpoint: EndpointHandle,
    events: mpsc::Receiver<EndpointEvent>,
    server: SocketAddr,
    timeout: Duration,
    agent_id: String,
}

impl Client {
    /// Connects to the gateway at `server` as `agent_id`, signing with `key`.
    pub async fn connect(
        server: SocketAddr,
        agent_id: &str,
        key: &SigningKey,
        timeout: Duration,
    ) -> Result<Self, ClientError> {
        Self::connect_signed(server, agent_id, connect_payload(key, agent_id), timeout).await
    }

    /// [`Client::connect`], knowing it reached the gateway: its Accept must carry the proof
    /// of `server_key`, the gateway's pinned public key (`STATE/cultnet/server.key`, logged at
    /// its start). Whoever else holds the gateway's port is refused before any request.
    pub async fn connect_pinned(
        server: SocketAddr,
        agent_id: &str,
        key: &SigningKey,
        server_key: &ed25519_dalek::VerifyingKey,
        timeout: Duration,
    ) -> Result<Self, ClientError> {
        let payload = connect_payload(key, agent_id);
        Self::connect_checked(server, agent_id, payload, Some(server_key), timeout).await
    }

    /// Connects with a Connect payload signed elsewhere (`payload` from
    /// [`wire::docs::ConnectPayload::encode`]).
    pub async fn connect_signed(
        server: SocketAddr,
        agent_id: &str,
        payload: Vec<u8>,
        timeout: Duration,
    ) -> Result<Self, ClientError> {
        Self::connect_checked(server, agent_id, payload, None, timeout).await
    }

    async fn connect_checked(
        server: SocketAddr,
        agent_id: &str,
        payload: Vec<u8>,
        server_key: Option<&ed25519_dalek::VerifyingKey>,
        timeout: Duration,
    ) -> Result<Self, ClientError> {
        let sent = payload.clone();
        let bind = if server.is_ipv4() {
            SocketAddr::from(([127, 0, 0, 1], 0))
        } else {
            SocketAddr::from((std::net::Ipv6Addr::LOCALHOST, 0))
        };
        let (endpoint, events, _task) =
            endpoint::spawn(EndpointConfig::new(bind, rand_seed())).await?;
        endpoint.connect(server, Bytes::from(payload)).await?;
        let mut me = Self {
            endpoint,
            events,
            server,
            timeout,
            agent_id: agent_id.to_owned(),
        };
        loop {
            match me.next_event().await? {
                HubEvent::Connected { accept, .. } => {
                    if let Some(pinned) = server_key {
                        if let Err(e) = wire::docs::ServerProof::verify(
                            &accept,
                            pinned,
                            GATEWAY_CONNECTION_ID,
                            &sent,
                        ) {
                            me.close().await;
                            return Err(ClientError::Refused(format!(
                                "not the gateway pinned: {e}"
                            )));
                        }
                    }
                    return Ok(me);
                }
                HubEvent::Disconnected { reason, .. } => return Err(refusal(reason)),
                _ => {}
            }
        }
    }

    /// How long later calls wait for an answer.
    pub fn set_timeout(&mut self, timeout: Duration) {
        self.timeout = timeout;
    }

    /// Sends raw bytes on the request channel (for tests of what the gateway does with them).
    pub async fn send_raw(&self, bytes: Vec<u8>) -> Result<(), ClientError> {
        Ok(self
            .endpoint
            .send(self.server, CHANNEL, Bytes::from(bytes))
            .await?)
    }

    /// Puts a request document `schema` under `record_key` and waits for the receipt with the
    /// same record key, decoded as `R`.
    pub async fn request<T: Serialize, R: DeserializeOwned>(
        &mut self,
        schema: &str,
        record_key: &str,
        payload: &T,
    ) -> Result<R, ClientError> {
        self.send_raw(put_request(&self.agent_id, schema, record_key, payload))
            .await?;
        loop {
            if let Some(answer) = answer_to(self.next_message().await?, record_key) {
                return answer;
            }
        }
    }

    /// The next message the gateway sends.
    pub async fn next_message(&mut self) -> Result<Message, ClientError> {
        loop {
            match self.next_event().await? {
                HubEvent::Frame { frame, .. } => {
                    if let Ok(m) = Message::decode(&frame.payload) {
                        return Ok(m);
                    }
                }
                HubEvent::Disconnected { reason, .. } => return Err(ClientError::Closed(reason)),
                _ => {}
            }
        }
    }

    async fn next_event(&mut self) -> Result<HubEvent, ClientError> {
        match tokio::time::timeout(self.timeout, self.events.recv()).await {
            Err(_) => Err(ClientError::Timeout(self.server, self.timeout)),
            Ok(None) => Err(ClientError::Endpoint(EndpointError::Stopped)),
            Ok(Some(EndpointEvent::Hub(e))) => Ok(e),
            Ok(Some(EndpointEvent::SendFailed { error, .. })) => {
                Err(ClientError::Gateway(format!("request not sent: {error}")))
            }
            // A client accepts no Connects; its endpoint cannot report this.
            Ok(Some(EndpointEvent::AcceptNotApplied { error, .. })) => {
                Err(ClientError::Gateway(format!("unexpected: {error}")))
            }
        }
    }

    /// Closes the session.
    pub async fn close(self) {
        let _ = self.endpoint.disconnect(self.server, "done").await;
        let _ = self.endpoint.shutdown().await;
    }

    /// The local address its session is bound to (the gateway's key for it).
    pub fn local_addr(&self) -> SocketAddr {
        self.endpoint.local_addr()
    }

    /// Closes its socket without telling the gateway, as a client that is killed does: the
    /// gateway keeps the session until its silence timeout.
    pub async fn abandon(self) {
        let _ = self.endpoint.shutdown().await;
    }
}

/// A Connect payload signed now by `agent_id`, with a fresh nonce (the same on both transports).
fn connect_payload(key: &SigningKey, agent_id: &str) -> Vec<u8> {
    let issued_at = u64::try_from(crate::clock::unix_ms()).unwrap_or(0);
    ConnectPayload::sign(
        key,
        GATEWAY_CONNECTION_ID,
        agent_id,
        issued_at,
        &uuid::Uuid::new_v4().to_string(),
    )
    .encode()
}

/// The message that puts request document `schema` under `record_key`, from `agent_id`.
fn put_request<T: Serialize>(
    agent_id: &str,
    schema: &str,
    record_key: &str,
    payload: &T,
) -> Vec<u8> {
    let mut doc = RawDocument::from_payload(
        schema,
        record_key,
        &rfc3339(crate::clock::unix_ms()),
        payload,
    );
    doc.source_agent_id = Some(agent_id.to_owned());
    Message::DocumentPutRaw(Put {
        message_id: message_id(),
        document: doc,
    })
    .encode()
}

/// What `message` means to a request waiting on `record_key`: its receipt, the gateway's error,
/// or nothing (another message).
fn answer_to<R: DeserializeOwned>(
    message: Message,
    record_key: &str,
) -> Option<Result<R, ClientError>> {
    match message {
        Message::DocumentPutRaw(p) if p.document.record_key == record_key => Some(
            p.document
                .payload_as()
                .map_err(|e| ClientError::BadReceipt(e.to_string())),
        ),
        Message::Error(e) => Some(Err(ClientError::Gateway(e.error))),
        _ => None,
    }
}

/// A session that ends before it was accepted was refused: the server's Disconnect says why.
/// A client of the gateway's QUIC side (a remote peer): the same requests over one stream.
#[derive(Debug)]
pub struct QuicClient {
    conn: quinn::Connection,
    send: quinn::SendStream,
    recv: quinn::RecvStream,
    frames: wire::msg::FrameDecoder,
    timeout: Duration,
    agent_id: String,
    _endpoint: quinn::Endpoint,
}

impl QuicClient {
    /// Connects to the gateway's QUIC address, trusting exactly `pinned` (its certificate,
    /// DER), and presents the signed Connect payload of `agent_id`.
    pub async fn connect(
        server: SocketAddr,
        pinned: &[u8],
        agent_id: &str,
        key: &SigningKey,
        timeout: Duration,
    ) -> Result<Self, ClientError> {
        let quic_err = |e: &dyn std::fmt::Display| ClientError::Quic(e.to_string());
        let bind = if server.is_ipv4() {
            SocketAddr::from(([0, 0, 0, 0], 0))
        } else {
            SocketAddr::from((std::net::Ipv6Addr::UNSPECIFIED, 0))
        };
        let mut endpoint = quinn::Endpoint::client(bind).map_err(|e| quic_err(&e))?;
        let cert = quinn::rustls::pki_types::CertificateDer::from(pinned.to_vec());
        endpoint.set_default_client_config(
            crate::quic::client_config(&cert).map_err(|e| quic_err(&e))?,
        );
        let connecting = endpoint
            .connect(server, crate::quic::SERVER_NAMES[0])
            .map_err(|e| quic_err(&e))?;
        let conn = tokio::time::timeout(timeout, connecting)
            .await
            .map_err(|_| ClientError::Timeout(server, timeout))?
            .map_err(|e| quic_err(&e))?;
        let (mut send, recv) = conn.open_bi().await.map_err(|e| quic_err(&e))?;
        let framed = wire::msg::frame(&connect_payload(key, agent_id), crate::quic::MAX_FRAME)
            .map_err(|e| quic_err(&e))?;
        send.write_all(&framed).await.map_err(|e| quic_err(&e))?;
        Ok(Self {
            conn,
            send,
            recv,
            frames: wire::msg::FrameDecoder::new(crate::quic::MAX_FRAME),
            timeout,
            agent_id: agent_id.to_owned(),
            _endpoint: endpoint,
        })
    }

    /// As [`Client::request`]. A refused Connect shows here, as [`ClientError::Refused`].
    pub async fn request<T: Serialize, R: DeserializeOwned>(
        &mut self,
        schema: &str,
        record_key: &str,
        payload: &T,
    ) -> Result<R, ClientError> {
        let put = put_request(&self.agent_id, schema, record_key, payload);
        self.send_raw(&put).await?;
        loop {
            if let Some(answer) = answer_to(self.next_message().await?, record_key) {
                return answer;
            }
        }
    }

    /// Sends raw bytes as one frame (for tests of what the gateway does with them).
    pub async fn send_raw(&mut self, bytes: &[u8]) -> Result<(), ClientError> {
        let framed = wire::msg::frame(bytes, crate::quic::MAX_FRAME)
            .map_err(|e| ClientError::Quic(e.to_string()))?;
        if self.send.write_all(&framed).await.is_err() {
            return Err(self.closed());
        }
        Ok(())
    }

    /// The next message the gateway sends.
    pub async fn next_message(&mut self) -> Result<Message, ClientError> {
        loop {
            match self.frames.next_frame() {
                Ok(Some(f)) => {
                    if let Ok(m) = Message::decode(&f) {
                        return Ok(m);
                    }
                    continue;
                }
                Ok(None) => {}
                Err(e) => return Err(ClientError::Quic(e.to_string())),
            }
            let chunk = tokio::time::timeout(self.timeout, self.recv.read_chunk(65_536, true))
                .await
                .map_err(|_| ClientError::Timeout(self.conn.remote_address(), self.timeout))?;
            match chunk {
                Ok(Some(c)) => self.frames.push(&c.bytes),
                Ok(None) => {
                    // The gateway finished its side: it is closing the connection, with its
                    // reason close behind.
                    let _ = tokio::time::timeout(self.timeout, self.conn.closed()).await;
                    return Err(self.closed());
                }
                Err(_) => return Err(self.closed()),
            }
        }
    }

    /// Why the connection is gone: the gateway's reason when it closed it.
    fn closed(&self) -> ClientError {
        match self.conn.close_reason() {
            Some(quinn::ConnectionError::ApplicationClosed(c)) => {
                ClientError::Refused(String::from_utf8_lossy(&c.reason).into_owned())
            }
            Some(other) => ClientError::Quic(other.to_string()),
            None => ClientError::Quic("the stream ended".into()),
        }
    }

    /// Closes the connection.
    pub async fn close(self) {
        self.conn.close(0u32.into(), b"done");
        self._endpoint.wait_idle().await;
    }
}

fn refusal(reason: CloseReason) -> ClientError {
    match reason {
        CloseReason::Refused(why) | CloseReason::Peer(why) => ClientError::Refused(why),
        other => ClientError::Closed(other),
    }
}

/// A seed for the endpoint's initial sequences.
pub fn rand_seed() -> u64 {
    let b = uuid::Uuid::new_v4().into_bytes();
    u64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]])
}

/// Reads an ed25519 signing key: a file holding its 32-byte seed as 64 hex digits, readable by
/// its owner only.
pub fn load_key(path: &std::path::Path) -> Result<SigningKey, crate::config::ConfigError> {
    let bad = |problem: String| crate::config::ConfigError {
        persona: None,
        key: "(client key)".into(),
        problem,
    };
    let text = crate::config::read_private(path).map_err(bad)?;
    let seed = crate::config::hex32(text.expose().trim())
        .ok_or_else(|| bad(format!("{} does not hold 64 hex digits", path.display())))?;
    Ok(SigningKey::from_bytes(&seed))
}
