//! A CultNet client on the older session rules, as deployed Node peers speak them: one counter
//! numbers EVERY packet it sends (reliable data, acks, pings), so its acks leave holes in its
//! reliable sequence that the gateway must fill. Hand-rolled on `wire::packet` and a blocking
//! UDP socket (not on `wire::session`, which speaks the newer rules), with just what a Mind
//! organ needs: connect, one request at a time, whole or fragmented answers, resends.

use std::collections::{BTreeMap, HashSet};
use std::net::{SocketAddr, UdpSocket};
use std::time::{Duration, Instant};

use wire::msg::Message;
use wire::packet::{Flags, Fragment, Packet, PacketType, CONTROL_CHANNEL};
use wire::session::GATEWAY_CONNECTION_ID;

/// The schema channel requests travel on.
const CHANNEL: &str = "schema";

/// A connected older-rules client.
#[derive(Debug)]
pub struct LegacyClient {
    socket: UdpSocket,
    server: SocketAddr,
    next_seq: u32,
    /// Reliable sequences of the server's packets already taken (duplicates are re-acked only).
    seen: HashSet<u32>,
    /// Fragment sets being reassembled: id -> (count, index -> bytes).
    parts: BTreeMap<u16, (u16, BTreeMap<u16, Vec<u8>>)>,
    /// Our reliable packets not yet acknowledged: sequence -> datagram.
    unacked: BTreeMap<u32, Vec<u8>>,
}

/// One whole (unfragmented) packet to the gateway's connection id, as a datagram: what a
/// hand-rolled peer sends (this client, and the test probes).
pub fn datagram(
    ptype: PacketType,
    flags: u8,
    sequence: u32,
    ack: u32,
    channel: &str,
    payload: &[u8],
) -> std::io::Result<Vec<u8>> {
    let mut out = Vec::new();
    Packet {
        ptype,
        flags: Flags(flags),
        connection_id: GATEWAY_CONNECTION_ID,
        sequence,
        ack,
        ack_mask: 0,
        fragment: Fragment::default(),
        channel,
        payload,
    }
    .encode(&mut out)
    .map_err(io)?;
    Ok(out)
}

fn io(e: impl std::fmt::Display) -> std::io::Error {
    std::io::Error::other(e.to_string())
}

impl LegacyClient {
    /// Connects with `payload` (a signed Connect payload) and waits for the Accept.
    pub fn connect(server: SocketAddr, payload: &[u8], within: Duration) -> std::io::Result<Self> {
        let socket = UdpSocket::bind("127.0.0.1:0")?;
        socket.set_read_timeout(Some(Duration::from_millis(100)))?;
        let mut me = Self {
            socket,
            server,
            next_seq: 1000 + (std::process::id() % 1000),
            seen: HashSet::new(),
            parts: BTreeMap::new(),
            unacked: BTreeMap::new(),
        };
        let connect = me.packet(
            PacketType::Connect,
            Flags::RELIABLE | Flags::ORDERED,
            0,
            CONTROL_CHANNEL,
            payload,
        )?;
        me.socket.send_to(&connect, server)?;
        let deadline = Instant::now() + within;
        let mut last = Instant::now();
        let mut buf = vec![0u8; 65_536];
        loop {
            if Instant::now() > deadline {
                return Err(io("no Accept"));
            }
            if last.elapsed() > Duration::from_millis(250) {
                me.socket.send_to(&connect, server)?;
                last = Instant::now();
            }
            let Ok((n, _)) = me.socket.recv_from(&mut buf) else {
                continue;
            };
            let Ok(p) = Packet::decode(&buf[..n]) else {
                continue;
            };
            match p.ptype {
                PacketType::Accept => {
                    let seq = p.sequence;
                    me.seen.insert(seq);
                    me.ack(seq)?;
                    return Ok(me);
                }
                PacketType::Disconnect => {
                    return Err(io(format!(
                        "refused: {}",
                        String::from_utf8_lossy(p.payload)
                    )))
                }
                _ => {}
            }
        }
    }

    /// The sequence for the next packet, whatever its kind (the older rules).
    fn take_seq(&mut self) -> u32 {
        let s = self.next_seq;
        self.next_seq = self.next_seq.wrapping_add(1);
        s
    }

    fn packet(
        &mut self,
        ptype: PacketType,
        flags: u8,
        ack: u32,
        channel: &str,
        payload: &[u8],
    ) -> std::io::Result<Vec<u8>> {
        let sequence = self.take_seq();
        let out = datagram(ptype, flags, sequence, ack, channel, payload)?;
        if flags & Flags::RELIABLE != 0 {
            self.unacked.insert(sequence, out.clone());
        }
        Ok(out)
    }

    /// An Ack naming `seq`, numbered from the one counter.
    fn ack(&mut self, seq: u32) -> std::io::Result<()> {
        let ack = self.packet(PacketType::Ack, 0, seq, CONTROL_CHANNEL, &[])?;
        self.socket.send_to(&ack, self.server)?;
        Ok(())
    }

    /// Sends `message` (one reliable, ordered Data packet on `schema`) and returns the first
    /// message the gateway sends back on `schema`.
    pub fn request(&mut self, message: &[u8], within: Duration) -> std::io::Result<Message> {
        let data = self.packet(
            PacketType::Data,
            Flags::RELIABLE | Flags::ORDERED,
            0,
            CHANNEL,
            message,
        )?;
        self.socket.send_to(&data, self.server)?;
        let deadline = Instant::now() + within;
        let mut resend = Instant::now();
        let mut buf = vec![0u8; 65_536];
        loop {
            if Instant::now() > deadline {
                return Err(io("no answer"));
            }
            if resend.elapsed() > Duration::from_millis(250) {
                for d in self.unacked.values() {
                    self.socket.send_to(d, self.server)?;
                }
                resend = Instant::now();
            }
            let Ok((n, _)) = self.socket.recv_from(&mut buf) else {
                continue;
            };
            let Ok(p) = Packet::decode(&buf[..n]) else {
                continue;
            };
            // Whatever it carries, it acknowledges: its ack field and mask.
            let acked: Vec<u32> = self
                .unacked
                .keys()
                .copied()
                .filter(|s| {
                    *s == p.ack
                        || (p.ack.wrapping_sub(*s) >= 1
                            && p.ack.wrapping_sub(*s) <= 32
                            && p.ack_mask & (1 << (p.ack.wrapping_sub(*s) - 1)) != 0)
                })
                .collect();
            for s in acked {
                self.unacked.remove(&s);
            }
            match p.ptype {
                PacketType::Data if p.flags.has(Flags::RELIABLE) => {
                    let seq = p.sequence;
                    self.ack(seq)?;
                    if !self.seen.insert(seq) || p.channel != CHANNEL {
                        continue;
                    }
                    let whole = if p.fragment.count == 0 {
                        Some(p.payload.to_vec())
                    } else {
                        let (count, parts) = self
                            .parts
                            .entry(p.fragment.id)
                            .or_insert_with(|| (p.fragment.count, BTreeMap::new()));
                        parts.insert(p.fragment.index, p.payload.to_vec());
                        if parts.len() == usize::from(*count) {
                            let (_, parts) = self.parts.remove(&p.fragment.id).unwrap_or_default();
                            Some(parts.into_values().flatten().collect())
                        } else {
                            None
                        }
                    };
                    if let Some(bytes) = whole {
                        return Message::decode(&bytes).map_err(io);
                    }
                }
                PacketType::Ping => {
                    let pong = self.packet(PacketType::Pong, 0, 0, CONTROL_CHANNEL, p.payload)?;
                    self.socket.send_to(&pong, self.server)?;
                }
                PacketType::Disconnect => {
                    return Err(io(format!(
                        "disconnected: {}",
                        String::from_utf8_lossy(p.payload)
                    )))
                }
                _ => {}
            }
        }
    }

    /// Whether the gateway has acknowledged everything this client sent.
    pub fn all_acked(&self) -> bool {
        self.unacked.is_empty()
    }
}
