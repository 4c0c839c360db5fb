//! A simulated link between two hubs: virtual clock, per-direction queues with latency,
//! seeded loss, duplication, reordering (extra random delay) and a mangle hook. No sockets,
//! no sleeps: `step` jumps the clock to the next datagram or timer.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use bytes::Bytes;

use crate::hub::{Hub, HubConfig, HubEvent};

pub(crate) struct Rng(u64);

impl Rng {
    pub(crate) fn new(seed: u64) -> Self {
        Self(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    pub(crate) fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    pub(crate) fn chance(&mut self, p: f64) -> bool {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64 <= p && p > 0.0
    }
    pub(crate) fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            0
        } else {
            self.next() % n
        }
    }
}

/// Link impairments, one direction.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Impair {
    pub(crate) loss: f64,
    pub(crate) dup: f64,
    /// Probability a datagram gets an extra random delay of up to `jitter` (reordering).
    pub(crate) reorder: f64,
    pub(crate) latency: Duration,
    pub(crate) jitter: Duration,
}

impl Default for Impair {
    fn default() -> Self {
        Self {
            loss: 0.0,
            dup: 0.0,
            reorder: 0.0,
            latency: Duration::from_millis(1),
            jitter: Duration::from_millis(5),
        }
    }
}

pub(crate) struct Side {
    pub(crate) hub: Hub,
    pub(crate) addr: SocketAddr,
    pub(crate) events: Vec<HubEvent>,
    /// In flight towards this side: (deliver at, from, bytes).
    inbound: Vec<(Instant, SocketAddr, Vec<u8>)>,
    pub(crate) impair: Impair,
}

pub(crate) struct Pair {
    pub(crate) now: Instant,
    pub(crate) a: Side,
    pub(crate) b: Side,
    rng: Rng,
    pub(crate) sent_datagrams: u64,
    pub(crate) lost_datagrams: u64,
    /// Rewrites datagrams in flight (after loss/dup decisions).
    #[allow(clippy::type_complexity)]
    pub(crate) mangle: Option<Box<dyn FnMut(&mut Vec<u8>, &mut Rng)>>,
    /// Server side accepts every Connect when true.
    pub(crate) auto_accept: bool,
}

impl Pair {
    pub(crate) fn new(seed: u64, cfg: HubConfig) -> Self {
        let now = Instant::now();
        let side = |port: u16, seed: u64| Side {
            hub: Hub::new(cfg.clone(), seed),
            addr: SocketAddr::from(([127, 0, 0, 1], port)),
            events: Vec::new(),
            inbound: Vec::new(),
            impair: Impair::default(),
        };
        Self {
            now,
            a: side(1000, seed ^ 0xA),
            b: side(2000, seed ^ 0xB),
            rng: Rng::new(seed),
            sent_datagrams: 0,
            lost_datagrams: 0,
            mangle: None,
            auto_accept: true,
        }
    }

    /// A connects to B; returns once both report Connected (or panics after `limit` steps).
    pub(crate) fn connect(&mut self) {
        let b = self.b.addr;
        self.a.hub.connect(self.now, b, Bytes::from_static(b"join"));
        let ok = self.drive_until(20_000, |p| {
            p.a.events
                .iter()
                .any(|e| matches!(e, HubEvent::Connected { .. }))
                && p.b
                    .events
                    .iter()
                    .any(|e| matches!(e, HubEvent::Connected { .. }))
        });
        assert!(ok, "handshake did not complete");
    }

    /// Moves every pending datagram onto the links and every event into the sides.
    pub(crate) fn flush(&mut self) {
        for which in [0, 1] {
            let mut buf = Vec::new();
            loop {
                buf.clear();
                let (from, to_side) = if which == 0 {
                    (&mut self.a, &mut self.b)
                } else {
                    (&mut self.b, &mut self.a)
                };
                let Some(to) = from.hub.poll_transmit(self.now, &mut buf) else {
                    break;
                };
                self.sent_datagrams += 1;
                if to != to_side.addr {
                    continue;
                }
                let im = to_side.impair;
                if self.rng.chance(im.loss) {
                    self.lost_datagrams += 1;
                    continue;
                }
                let copies = if self.rng.chance(im.dup) { 2 } else { 1 };
                for _ in 0..copies {
                    let mut bytes = buf.clone();
                    if let Some(m) = self.mangle.as_mut() {
                        m(&mut bytes, &mut self.rng);
                    }
                    let mut at = self.now + im.latency;
                    if self.rng.chance(im.reorder) {
                        at +=
                            Duration::from_micros(self.rng.below(im.jitter.as_micros() as u64 + 1));
                    }
                    to_side.inbound.push((at, from.addr, bytes));
                }
            }
        }
        let mut accepted = false;
        for side in [&mut self.a, &mut self.b] {
            while let Some(ev) = side.hub.poll_event() {
                if self.auto_accept {
                    if let HubEvent::ConnectRequest(req) = &ev {
                        accepted |= side.hub.accept(self.now, req).is_ok();
                    }
                }
                side.events.push(ev);
            }
        }
        // An accept queues its Accept packet: move it too.
        if accepted {
            self.flush();
        }
    }

    /// One step: flush, then jump to the next datagram arrival or timer and process it.
    /// Returns false when nothing is left to happen.
    pub(crate) fn step(&mut self) -> bool {
        self.flush();
        let next_dgram = self
            .a
            .inbound
            .iter()
            .chain(self.b.inbound.iter())
            .map(|d| d.0)
            .min();
        let next_timer = [self.a.hub.poll_timeout(), self.b.hub.poll_timeout()]
            .into_iter()
            .flatten()
            .min();
        let Some(t) = [next_dgram, next_timer].into_iter().flatten().min() else {
            return false;
        };
        if t > self.now {
            self.now = t;
        }
        let now = self.now;
        for side in [&mut self.a, &mut self.b] {
            let mut due = Vec::new();
            side.inbound.retain(|d| {
                if d.0 <= now {
                    due.push((d.1, d.2.clone()));
                    false
                } else {
                    true
                }
            });
            for (from, bytes) in due {
                side.hub.handle(now, from, &bytes);
            }
            side.hub.handle_timeout(now);
        }
        self.flush();
        // A timer left at or before `now` after it ran and its output went out would spin
        // forever: it is a bug, not a slow test.
        for side in [&self.a, &self.b] {
            for peer in side.hub.peers() {
                if let Some(s) = side.hub.session(peer) {
                    if let Some(t) = s.poll_timeout() {
                        assert!(
                            t > now,
                            "session timer stuck at {:?} before now: {s:?}",
                            now - t
                        );
                    }
                }
            }
        }
        true
    }

    /// Steps until `done` holds; false if `limit` steps pass first (instead of hanging).
    pub(crate) fn drive_until(
        &mut self,
        limit: usize,
        mut done: impl FnMut(&Self) -> bool,
    ) -> bool {
        for _ in 0..limit {
            self.flush();
            if done(self) {
                return true;
            }
            if !self.step() {
                self.flush();
                return done(self);
            }
        }
        false
    }

    /// Frames B received, as (channel, payload).
    pub(crate) fn frames(events: &[HubEvent]) -> Vec<(String, Bytes)> {
        events
            .iter()
            .filter_map(|e| match e {
                HubEvent::Frame { frame, .. } => {
                    Some((frame.channel.to_string(), frame.payload.clone()))
                }
                _ => None,
            })
            .collect()
    }
}
