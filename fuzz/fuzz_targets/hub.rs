//! A hub with one connected peer receiving an arbitrary sequence of datagrams (each prefixed by
//! a 2-byte length and a 1-byte time step) from three addresses, its owner answering Connects
//! late (after evictions, expiries and newer Connects), accepting or refusing as the input says:
//! no panic, memory and sessions stay within the configured caps, every output is a valid
//! packet.
#![no_main]

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use libfuzzer_sys::fuzz_target;
use wire::hub::{Hub, HubConfig, HubEvent};
use wire::packet::{Flags, Fragment, Packet, PacketType};

fuzz_target!(|data: &[u8]| {
    let mut cfg = HubConfig::default();
    cfg.max_peers = 4;
    cfg.max_pending = 2;
    cfg.session.max_reassembly_bytes = 64 * 1024;
    cfg.session.max_held_bytes = 64 * 1024;
    cfg.session.max_payload = 32 * 1024;
    let conn = cfg.session.connection_id;
    let mut hub = Hub::new(cfg.clone(), 7);
    let mut now = Instant::now();
    let a: SocketAddr = "127.0.0.1:1".parse().unwrap();
    let b: SocketAddr = "127.0.0.1:2".parse().unwrap();
    let c: SocketAddr = "127.0.0.1:3".parse().unwrap();
    // Connects reported and not yet answered: the owner lags.
    let mut held = VecDeque::new();
    let mut connect = Vec::new();
    Packet {
        ptype: PacketType::Connect,
        flags: Flags(Flags::RELIABLE | Flags::ORDERED),
        connection_id: conn,
        sequence: 1,
        ack: 0,
        ack_mask: 0,
        fragment: Fragment::default(),
        channel: "control",
        payload: b"fuzz",
    }
    .encode(&mut connect)
    .unwrap();
    hub.handle(now, a, &connect);
    let req = hub.waiting(a).cloned().unwrap();
    hub.accept(now, &req).unwrap();
    let mut rest = data;
    let mut buf = Vec::new();
    while rest.len() >= 3 {
        let len = u16::from_be_bytes([rest[0], rest[1]]) as usize;
        let t = rest[2];
        now += Duration::from_millis(t as u64 * 4);
        rest = &rest[3..];
        let take = len.min(rest.len());
        let (dgram, tail) = rest.split_at(take);
        rest = tail;
        let from = [a, b, c][len % 3];
        hub.handle(now, from, dgram);
        hub.handle_timeout(now);
        while let Some(ev) = hub.poll_event() {
            if let HubEvent::ConnectRequest(req) = ev {
                held.push_back(req);
            }
        }
        // The time step's low bits say whether the owner answers now, and how.
        while held.len() > usize::from(t & 3) {
            let Some(req) = held.pop_front() else { break };
            let _ = if t & 4 != 0 {
                hub.refuse(&req, "no")
            } else {
                hub.accept(now, &req)
            };
        }
        loop {
            buf.clear();
            if hub.poll_transmit(now, &mut buf).is_none() {
                break;
            }
            assert!(
                Packet::decode(&buf).is_ok(),
                "hub produced an undecodable packet"
            );
        }
        assert!(hub.peer_count() <= cfg.max_peers);
        assert!(hub.pending_count() <= cfg.max_pending);
        for p in hub.peers().collect::<Vec<_>>() {
            let s = hub.session(p).unwrap();
            assert!(
                s.receive_buffered_bytes()
                    <= cfg.session.max_held_bytes + cfg.session.max_reassembly_bytes + 64 * 1024
            );
        }
    }
});
