//! A local process that takes over a departed CultNet client's port, for the session-owner
//! test: it binds BIND (the client's address, retried for a few seconds while the old socket
//! goes), waits for the gateway's keepalive Ping, answers it, and sends REQUEST_HEX (one
//! `cultnet.document_put_raw.v0` message) as reliable Data numbered one past the sequence the
//! Ping acknowledges, as the client's next would be. For SECONDS it prints one line per packet
//! from the gateway:
//!
//! - `ping ack=N` (and `sent seq=N+1` after it);
//! - `acked seq=N` when the gateway acknowledges what it sent;
//! - `data SCHEMA key=KEY` for each whole message the gateway sends, fragments reassembled (a
//!   receipt under its own request's key, `taken-1` in the test: it was served; another key is
//!   a resend of what the departed client had not acknowledged);
//! - `disconnect REASON`.
//!
//! `port_probe BIND TARGET REQUEST_HEX SECONDS`

use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::{SocketAddr, UdpSocket};
use std::time::{Duration, Instant};

use wire::msg::Message;
use wire::packet::{Flags, Packet, PacketType, CONTROL_CHANNEL};

fn packet(ptype: PacketType, flags: u8, sequence: u32, ack: u32, ch: &str, p: &[u8]) -> Vec<u8> {
    match tests::legacy::datagram(ptype, flags, sequence, ack, ch, p) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("encode: {e}");
            std::process::exit(2);
        }
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let (Some(bind), Some(target), Some(hex), Some(secs)) =
        (args.get(1), args.get(2), args.get(3), args.get(4))
    else {
        eprintln!("usage: port_probe BIND TARGET REQUEST_HEX SECONDS");
        std::process::exit(2);
    };
    let (Ok(bind), Ok(target)) = (bind.parse::<SocketAddr>(), target.parse::<SocketAddr>()) else {
        eprintln!("BIND and TARGET are addresses");
        std::process::exit(2);
    };
    let request: Vec<u8> = (0..hex.len() / 2)
        .filter_map(|i| u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).ok())
        .collect();
    let secs: u64 = secs.parse().unwrap_or(20);
    let bound_by = Instant::now() + Duration::from_secs(5);
    let socket = loop {
        match UdpSocket::bind(bind) {
            Ok(s) => break s,
            Err(e) if Instant::now() < bound_by => {
                let _ = e;
                std::thread::sleep(Duration::from_millis(50));
            }
            Err(e) => {
                eprintln!("bind {bind}: {e}");
                std::process::exit(1);
            }
        }
    };
    println!("bound {bind}");
    if socket
        .set_read_timeout(Some(Duration::from_millis(100)))
        .is_err()
    {
        std::process::exit(1);
    }
    let end = Instant::now() + Duration::from_secs(secs);
    let mut sent: Option<(u32, Vec<u8>)> = None;
    let mut resend = Instant::now();
    let mut seen = HashSet::new();
    let mut parts: HashMap<u16, (u16, BTreeMap<u16, Vec<u8>>)> = HashMap::new();
    let mut buf = vec![0u8; 65_536];
    while Instant::now() < end {
        if let Some((_, d)) = &sent {
            if resend.elapsed() > Duration::from_millis(300) {
                let _ = socket.send_to(d, target);
                resend = Instant::now();
            }
        }
        let Ok((n, from)) = socket.recv_from(&mut buf) else {
            continue;
        };
        if from != target {
            continue;
        }
        let Ok(p) = Packet::decode(&buf[..n]) else {
            continue;
        };
        if let Some((seq, _)) = &sent {
            if p.ack == *seq {
                println!("acked seq={seq}");
                sent = None;
            }
        }
        match p.ptype {
            PacketType::Ping => {
                let pong = packet(PacketType::Pong, 0, 0, 0, CONTROL_CHANNEL, p.payload);
                let _ = socket.send_to(&pong, target);
                if seen.insert(("ping", 0)) {
                    println!("ping ack={}", p.ack);
                    let seq = p.ack.wrapping_add(1);
                    let data = packet(
                        PacketType::Data,
                        Flags::RELIABLE | Flags::ORDERED,
                        seq,
                        0,
                        "schema",
                        &request,
                    );
                    let _ = socket.send_to(&data, target);
                    resend = Instant::now();
                    println!("sent seq={seq}");
                    sent = Some((seq, data));
                }
            }
            PacketType::Data => {
                if p.flags.has(Flags::RELIABLE) {
                    let ack = packet(PacketType::Ack, 0, 0, p.sequence, CONTROL_CHANNEL, &[]);
                    let _ = socket.send_to(&ack, target);
                }
                if !seen.insert(("data", p.sequence)) {
                    continue;
                }
                let whole = if p.fragment.count == 0 {
                    Some(p.payload.to_vec())
                } else {
                    let (count, got) = parts
                        .entry(p.fragment.id)
                        .or_insert_with(|| (p.fragment.count, BTreeMap::new()));
                    got.insert(p.fragment.index, p.payload.to_vec());
                    if got.len() == usize::from(*count) {
                        parts
                            .remove(&p.fragment.id)
                            .map(|(_, got)| got.into_values().flatten().collect())
                    } else {
                        None
                    }
                };
                let Some(bytes) = whole else {
                    continue;
                };
                match Message::decode(&bytes) {
                    Ok(Message::DocumentPutRaw(put)) => println!(
                        "data {} key={}",
                        put.document.schema_id, put.document.record_key
                    ),
                    Ok(m) => println!("data {}", m.schema_version()),
                    Err(e) => println!("data undecodable {e}"),
                }
            }
            PacketType::Disconnect => {
                println!("disconnect {}", String::from_utf8_lossy(p.payload));
                break;
            }
            _ => {}
        }
    }
    println!("done");
}
