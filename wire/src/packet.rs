//! The CNR0 datagram: one UDP datagram is one packet (layout in `facts/cultnet-wire.md`).
//!
//! [`Packet`] borrows its channel and payload from the datagram, so decoding allocates nothing;
//! [`Packet::encode`] appends to a caller-owned buffer so one buffer serves a whole socket.

use crate::error::DecodeError;

/// The four magic bytes that open every packet: `CNR0`.
pub const MAGIC: [u8; 4] = *b"CNR0";
/// The only protocol version this codec speaks; any other is rejected.
pub const VERSION: u8 = 0;
/// Bytes before the channel id.
pub const FIXED_HEADER_LEN: usize = 36;
/// Largest payload plus channel id one datagram carries (a UDP/IPv4 datagram holds 65,507 bytes).
pub const MAX_SINGLE_PAYLOAD: usize = 65_507 - FIXED_HEADER_LEN;
/// The channel every control packet (Connect, Accept, Ack, Ping, Pong, Disconnect) uses.
pub const CONTROL_CHANNEL: &str = "control";

/// Packet type, byte 5.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PacketType {
    /// Client opens a session; the payload is its credentials.
    Connect = 1,
    /// Server accepts; `ack` names the Connect's sequence.
    Accept = 2,
    /// An application frame on a named channel.
    Data = 3,
    /// Acknowledges reliable packets through `ack` and `ack_mask`.
    Ack = 4,
    /// Liveness probe, answered by a Pong echoing its payload.
    Ping = 5,
    /// Answer to a Ping.
    Pong = 6,
    /// Ends the session; the payload is the reason.
    Disconnect = 7,
}

impl PacketType {
    fn from_u8(v: u8) -> Option<Self> {
        Some(match v {
            1 => Self::Connect,
            2 => Self::Accept,
            3 => Self::Data,
            4 => Self::Ack,
            5 => Self::Ping,
            6 => Self::Pong,
            7 => Self::Disconnect,
            _ => return None,
        })
    }

    /// Lower-case name, as printed by the `wire decode` tool.
    pub fn name(self) -> &'static str {
        match self {
            Self::Connect => "connect",
            Self::Accept => "accept",
            Self::Data => "data",
            Self::Ack => "ack",
            Self::Ping => "ping",
            Self::Pong => "pong",
            Self::Disconnect => "disconnect",
        }
    }
}

/// Flag bits, byte 6. Unknown bits are kept on decode and ignored by the session.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Flags(pub u8);

impl Flags {
    /// Resend until acknowledged.
    pub const RELIABLE: u8 = 0x01;
    /// Deliver in sequence order (only together with reliable).
    pub const ORDERED: u8 = 0x02;
    /// Drop anything older than the newest delivered on this channel.
    pub const SEQUENCED: u8 = 0x04;
    /// Set when fragment count > 0; informational, decoders ignore it.
    pub const FRAGMENTED: u8 = 0x08;
    /// On Ack: "abandon this sequence" (the sender gave up on it). On Connect/Accept: the
    /// sender understands abandon notices. Peers that do not know the bit ignore it.
    pub const ABANDON: u8 = 0x10;

    /// Whether every bit of `bits` is set.
    pub fn has(self, bits: u8) -> bool {
        self.0 & bits == bits
    }
}

/// Fragment header fields (bytes 24-29); `count == 0` means not fragmented.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Fragment {
    /// Non-zero id shared by all fragments of one frame; wraps back to 1.
    pub id: u16,
    /// Position of this fragment, `0..count`.
    pub index: u16,
    /// Number of fragments, 0 when the frame is whole.
    pub count: u16,
}

/// One decoded packet, borrowing channel and payload from the datagram.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Packet<'a> {
    /// Byte 5.
    pub ptype: PacketType,
    /// Byte 6.
    pub flags: Flags,
    /// Constant per service; checked by the hub before anything else.
    pub connection_id: u32,
    /// Sequence number; 0 for unsequenced packets under the newer rules.
    pub sequence: u32,
    /// Highest reliable sequence received (or the one being acknowledged).
    pub ack: u32,
    /// Bit `b` set: sequence `ack - b - 1` was received.
    pub ack_mask: u32,
    /// Fragment header.
    pub fragment: Fragment,
    /// Channel id, at most 255 bytes of UTF-8.
    pub channel: &'a str,
    /// Application bytes.
    pub payload: &'a [u8],
}

impl<'a> Packet<'a> {
    /// Decodes one datagram. Every malformed input is a typed error, never a panic.
    pub fn decode(buf: &'a [u8]) -> Result<Self, DecodeError> {
        if buf.len() < FIXED_HEADER_LEN {
            return Err(DecodeError::TooShort { len: buf.len() });
        }
        if buf[0..4] != MAGIC {
            return Err(DecodeError::BadMagic);
        }
        if buf[4] != VERSION {
            return Err(DecodeError::BadVersion { got: buf[4] });
        }
        let ptype = PacketType::from_u8(buf[5]).ok_or(DecodeError::UnknownType { got: buf[5] })?;
        let header_len = buf[7] as usize;
        let channel_len = buf[34] as usize;
        if header_len != FIXED_HEADER_LEN + channel_len {
            return Err(DecodeError::HeaderLength {
                header_len: buf[7],
                channel_len: buf[34],
            });
        }
        let payload_len = be32(buf, 30) as usize;
        if buf.len() < header_len || buf.len() - header_len != payload_len {
            return Err(DecodeError::Length {
                datagram: buf.len(),
                header: header_len,
                payload: payload_len,
            });
        }
        let channel = std::str::from_utf8(&buf[FIXED_HEADER_LEN..header_len])
            .map_err(|_| DecodeError::ChannelNotUtf8)?;
        Ok(Packet {
            ptype,
            flags: Flags(buf[6]),
            connection_id: be32(buf, 8),
            sequence: be32(buf, 12),
            ack: be32(buf, 16),
            ack_mask: be32(buf, 20),
            fragment: Fragment {
                id: be16(buf, 24),
                index: be16(buf, 26),
                count: be16(buf, 28),
            },
            channel,
            payload: &buf[header_len..],
        })
    }

    /// Size of the encoded packet.
    pub fn encoded_len(&self) -> usize {
        FIXED_HEADER_LEN + self.channel.len() + self.payload.len()
    }

    /// Appends the encoded packet to `out`. Fails only when the channel id is longer than 255
    /// bytes or the payload longer than `u32::MAX`.
    pub fn encode(&self, out: &mut Vec<u8>) -> Result<(), EncodeError> {
        encode_parts(
            out,
            Header {
                ptype: self.ptype,
                flags: self.flags,
                connection_id: self.connection_id,
                sequence: self.sequence,
                ack: self.ack,
                ack_mask: self.ack_mask,
                fragment: self.fragment,
            },
            self.channel,
            &[self.payload],
        )
    }
}

/// Everything in a packet but its channel and payload; used to encode without first gathering
/// the payload into one slice.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Header {
    pub(crate) ptype: PacketType,
    pub(crate) flags: Flags,
    pub(crate) connection_id: u32,
    pub(crate) sequence: u32,
    pub(crate) ack: u32,
    pub(crate) ack_mask: u32,
    pub(crate) fragment: Fragment,
}

/// Why a packet could not be encoded.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum EncodeError {
    /// The channel id does not fit its one length byte.
    #[error("channel id is {len} bytes; at most 255 fit")]
    ChannelTooLong {
        /// Its length in bytes.
        len: usize,
    },
    /// The payload does not fit the 32-bit length field.
    #[error("payload is {len} bytes; at most 4294967295 fit")]
    PayloadTooLong {
        /// Its length in bytes.
        len: usize,
    },
}

pub(crate) fn encode_parts(
    out: &mut Vec<u8>,
    h: Header,
    channel: &str,
    payload: &[&[u8]],
) -> Result<(), EncodeError> {
    let channel_len = u8::try_from(channel.len())
        .map_err(|_| EncodeError::ChannelTooLong { len: channel.len() })?;
    let payload_len: usize = payload.iter().map(|p| p.len()).sum();
    let payload_len32 =
        u32::try_from(payload_len).map_err(|_| EncodeError::PayloadTooLong { len: payload_len })?;
    let mut flags = h.flags.0;
    if h.fragment.count > 0 {
        flags |= Flags::FRAGMENTED;
    }
    out.reserve(FIXED_HEADER_LEN + channel.len() + payload_len);
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&[
        VERSION,
        h.ptype as u8,
        flags,
        FIXED_HEADER_LEN as u8 + channel_len,
    ]);
    out.extend_from_slice(&h.connection_id.to_be_bytes());
    out.extend_from_slice(&h.sequence.to_be_bytes());
    out.extend_from_slice(&h.ack.to_be_bytes());
    out.extend_from_slice(&h.ack_mask.to_be_bytes());
    out.extend_from_slice(&h.fragment.id.to_be_bytes());
    out.extend_from_slice(&h.fragment.index.to_be_bytes());
    out.extend_from_slice(&h.fragment.count.to_be_bytes());
    out.extend_from_slice(&payload_len32.to_be_bytes());
    out.extend_from_slice(&[channel_len, 0]);
    out.extend_from_slice(channel.as_bytes());
    for p in payload {
        out.extend_from_slice(p);
    }
    Ok(())
}

fn be32(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

fn be16(b: &[u8], at: usize) -> u16 {
    u16::from_be_bytes([b[at], b[at + 1]])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Vec<u8> {
        let mut out = Vec::new();
        Packet {
            ptype: PacketType::Data,
            flags: Flags(Flags::RELIABLE | Flags::ORDERED),
            connection_id: 7,
            sequence: 9,
            ack: 3,
            ack_mask: 1,
            fragment: Fragment::default(),
            channel: "schema",
            payload: b"abc",
        }
        .encode(&mut out)
        .unwrap();
        out
    }

    #[test]
    fn roundtrip() {
        let b = sample();
        let p = Packet::decode(&b).unwrap();
        assert_eq!(p.channel, "schema");
        assert_eq!(p.payload, b"abc");
        assert_eq!(p.sequence, 9);
        let mut again = Vec::new();
        p.encode(&mut again).unwrap();
        assert_eq!(again, b);
    }

    #[test]
    fn every_malformation_is_typed() {
        let good = sample();
        assert_eq!(
            Packet::decode(&good[..35]),
            Err(DecodeError::TooShort { len: 35 })
        );
        let mut b = good.clone();
        b[0] = b'X';
        assert_eq!(Packet::decode(&b), Err(DecodeError::BadMagic));
        let mut b = good.clone();
        b[4] = 1;
        assert_eq!(Packet::decode(&b), Err(DecodeError::BadVersion { got: 1 }));
        let mut b = good.clone();
        b[5] = 0;
        assert_eq!(Packet::decode(&b), Err(DecodeError::UnknownType { got: 0 }));
        let mut b = good.clone();
        b[7] = 40;
        assert!(matches!(
            Packet::decode(&b),
            Err(DecodeError::HeaderLength { .. })
        ));
        let mut b = good.clone();
        b.push(0);
        assert!(matches!(
            Packet::decode(&b),
            Err(DecodeError::Length { .. })
        ));
        let mut b = good.clone();
        b[36] = 0xff;
        assert_eq!(Packet::decode(&b), Err(DecodeError::ChannelNotUtf8));
        // Huge declared payload length must not overflow or panic.
        let mut b = good.clone();
        b[30..34].copy_from_slice(&u32::MAX.to_be_bytes());
        assert!(matches!(
            Packet::decode(&b),
            Err(DecodeError::Length { .. })
        ));
    }

    #[test]
    fn unknown_flags_are_kept_not_rejected() {
        let mut b = sample();
        b[6] |= 0x80 | Flags::ABANDON;
        let p = Packet::decode(&b).unwrap();
        assert!(p.flags.has(Flags::RELIABLE | Flags::ORDERED));
        assert!(p.flags.has(0x80));
    }

    #[test]
    fn channel_too_long_is_an_encode_error() {
        let long = "x".repeat(256);
        let p = Packet {
            ptype: PacketType::Data,
            flags: Flags(0),
            connection_id: 1,
            sequence: 0,
            ack: 0,
            ack_mask: 0,
            fragment: Fragment::default(),
            channel: &long,
            payload: b"",
        };
        assert_eq!(
            p.encode(&mut Vec::new()),
            Err(EncodeError::ChannelTooLong { len: 256 })
        );
    }
}
