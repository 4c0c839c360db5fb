//! Errors of the wire crate. All are comparable so tests can match them exactly.

/// Why a datagram is not a CNR0 packet.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DecodeError {
    /// Fewer than the 36 fixed header bytes.
    #[error("datagram is {len} bytes; a CNR0 packet has at least 36")]
    TooShort {
        /// Datagram length.
        len: usize,
    },
    /// The first four bytes are not `CNR0`.
    #[error("bad magic: not a CNR0 packet")]
    BadMagic,
    /// Byte 4 is not 0.
    #[error("unsupported CNR0 version {got} (only 0 is known)")]
    BadVersion {
        /// The version byte found.
        got: u8,
    },
    /// Byte 5 is not a known packet type.
    #[error("unknown packet type {got}")]
    UnknownType {
        /// The type byte found.
        got: u8,
    },
    /// Byte 7 is not 36 + byte 34.
    #[error("header length {header_len} does not equal 36 + channel length {channel_len}")]
    HeaderLength {
        /// Byte 7.
        header_len: u8,
        /// Byte 34.
        channel_len: u8,
    },
    /// The datagram is not exactly header + payload long.
    #[error(
        "datagram is {datagram} bytes but header {header} + payload {payload} declare otherwise"
    )]
    Length {
        /// Datagram length.
        datagram: usize,
        /// Declared header length.
        header: usize,
        /// Declared payload length.
        payload: usize,
    },
    /// The channel id is not UTF-8.
    #[error("channel id is not UTF-8")]
    ChannelNotUtf8,
}

/// Why a `cultnet.schema.v0` message (or a document inside one) could not be decoded.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum MsgError {
    /// The bytes are not one complete MessagePack value.
    #[error("not MessagePack: {0}")]
    NotMessagePack(String),
    /// The value is not a map with string keys.
    #[error("a message must be a MessagePack map with string keys")]
    NotAMap,
    /// There is no string `schemaVersion` key.
    #[error("message has no schemaVersion")]
    MissingSchemaVersion,
    /// `schemaVersion` names a message this codec does not know.
    #[error("unknown schemaVersion {0:?}")]
    UnknownSchemaVersion(String),
    /// A known message with missing or ill-typed fields.
    #[error("invalid {schema_version}: {reason}")]
    Invalid {
        /// The message type.
        schema_version: String,
        /// What is wrong, as serde reported it.
        reason: String,
    },
    /// A frame longer than the configured maximum.
    #[error("frame of {len} bytes exceeds the maximum of {max}")]
    FrameTooLarge {
        /// Declared length.
        len: usize,
        /// Configured maximum.
        max: usize,
    },
    /// A stream ended inside a frame.
    #[error("stream ended inside a frame ({have} of {need} bytes)")]
    Truncated {
        /// Bytes present.
        have: usize,
        /// Bytes the frame needs.
        need: usize,
    },
    /// A document payload whose encoding is not `messagepack`.
    #[error("unsupported payloadEncoding {0:?}")]
    PayloadEncoding(String),
}

/// Why a session refused a frame handed to it for sending.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SendError {
    /// The session is not (or no longer) connected.
    #[error("session is not connected")]
    NotConnected,
    /// The frame is larger than the maximum payload.
    #[error("payload of {len} bytes exceeds the maximum of {max}")]
    TooLarge {
        /// Payload length.
        len: usize,
        /// Configured maximum.
        max: usize,
    },
    /// Too large for one datagram and fragmentation is off.
    #[error("payload of {len} bytes needs fragmentation, which is not configured")]
    NeedsFragmentation {
        /// Payload length.
        len: usize,
    },
    /// The queue behind the send window is full: back off and retry once acks drain it.
    #[error("send queue is full ({queued_bytes} bytes queued)")]
    QueueFull {
        /// Bytes waiting behind the window.
        queued_bytes: usize,
    },
    /// The channel id is longer than 255 bytes.
    #[error("channel id is {len} bytes; at most 255 fit")]
    ChannelTooLong {
        /// Its length.
        len: usize,
    },
    /// No session exists for that peer.
    #[error("no such peer")]
    UnknownPeer,
}

/// Why a session ended.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CloseReason {
    /// This side closed it.
    #[error("closed locally: {0}")]
    Local(String),
    /// The peer sent Disconnect with this reason.
    #[error("peer disconnected: {0}")]
    Peer(String),
    /// Nothing arrived for longer than the silence timeout.
    #[error("peer silent for too long")]
    SilenceTimeout,
    /// The Connect was not accepted within the connect timeout.
    #[error("connect was not accepted in time")]
    ConnectTimeout,
    /// The peer broke a protocol rule this side cannot recover from.
    #[error("peer misbehaved: {0}")]
    PeerMisbehaved(String),
    /// A new Connect from the same address replaced this session.
    #[error("replaced by a new connect from the same address")]
    Replaced,
    /// The server refused the Connect.
    #[error("refused: {0}")]
    Refused(String),
}
