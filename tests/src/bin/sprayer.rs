//! A hostile local process for the CultNet attack test: for SECONDS it sprays the gateway at
//! TARGET with random datagrams, malformed CultNet packets, Data for sessions that do not
//! exist, a replayed Connect payload (REPLAY_HEX, already used by a real client) and Connects
//! with junk credentials, from 500 loopback source addresses (127.2.x.y). Paced at about
//! RATE datagrams a second (default 20,000). Prints what it sent.
//!
//! `sprayer TARGET SECONDS REPLAY_HEX [RATE]`

use std::net::{SocketAddr, UdpSocket};
use std::time::{Duration, Instant};

use wire::packet::{Flags, Fragment, Packet, PacketType};
use wire::session::GATEWAY_CONNECTION_ID;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let (Some(target), Some(secs), Some(replay)) = (args.get(1), args.get(2), args.get(3)) else {
        eprintln!("usage: sprayer TARGET SECONDS REPLAY_HEX [RATE]");
        std::process::exit(2);
    };
    let Ok(target) = target.parse::<SocketAddr>() else {
        eprintln!("TARGET is not an address");
        std::process::exit(2);
    };
    let secs: u64 = secs.parse().unwrap_or(5);
    let rate: u64 = args.get(4).and_then(|r| r.parse().ok()).unwrap_or(20_000);
    let replay: Vec<u8> = (0..replay.len() / 2)
        .filter_map(|i| u8::from_str_radix(&replay[2 * i..2 * i + 2], 16).ok())
        .collect();
    let sockets: Vec<UdpSocket> = (0..500u32)
        .filter_map(|i| {
            let ip = std::net::Ipv4Addr::new(127, 2, (i / 200) as u8, (i % 200) as u8 + 1);
            UdpSocket::bind(SocketAddr::from((ip, 0))).ok()
        })
        .collect();
    let mut rng: u64 = 0x9E37_79B9_7F4A_7C15 ^ u64::from(std::process::id());
    let mut next = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let packet = |ptype, seq: u32, payload: &[u8]| {
        let mut out = Vec::new();
        let _ = Packet {
            ptype,
            flags: Flags(Flags::RELIABLE | Flags::ORDERED),
            connection_id: GATEWAY_CONNECTION_ID,
            sequence: seq,
            ack: 0,
            ack_mask: 0,
            fragment: Fragment::default(),
            channel: "control",
            payload,
        }
        .encode(&mut out);
        out
    };
    let start = Instant::now();
    let mut sent = [0u64; 5];
    let batch = (rate / 1000).max(1);
    while start.elapsed() < Duration::from_secs(secs) {
        for _ in 0..batch {
            let s = &sockets[(next() % sockets.len() as u64) as usize];
            let kind = (next() % 5) as usize;
            let seq = next() as u32;
            let datagram = match kind {
                // Random bytes.
                0 => (0..(next() % 1400) as usize)
                    .map(|_| next() as u8)
                    .collect(),
                // A CultNet header cut short, or with a bad version.
                1 => {
                    let mut p = packet(PacketType::Data, seq, b"x");
                    if next() % 2 == 0 {
                        p.truncate((next() % p.len() as u64) as usize);
                    } else if p.len() > 4 {
                        p[4] = 9;
                    }
                    p
                }
                // Data for a session that does not exist.
                2 => packet(PacketType::Data, seq, &[0xAB; 200]),
                // The replayed Connect payload.
                3 => packet(PacketType::Connect, seq, &replay),
                // A Connect with junk credentials.
                _ => {
                    let junk: Vec<u8> =
                        (0..(next() % 300) as usize).map(|_| next() as u8).collect();
                    packet(PacketType::Connect, seq, &junk)
                }
            };
            if s.send_to(&datagram, target).is_ok() {
                sent[kind] += 1;
            }
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    println!(
        "sprayer: {} sockets, random {}, malformed {}, unknown-session data {}, replayed connects {}, junk connects {}",
        sockets.len(),
        sent[0],
        sent[1],
        sent[2],
        sent[3],
        sent[4]
    );
}
