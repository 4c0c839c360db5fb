//! Receive side: duplicate detection, ordered hold-back and ack bookkeeping.
//!
//! Invariant: `ring[i]` describes sequence `through + 1 + i` (skipping 0); `ring.len()` never
//! exceeds [`DUPLICATE_WINDOW`]; every reliable sequence at or before `through` has been
//! received or deliberately skipped. `held_bytes` is the payload bytes inside `ring`.

use std::collections::VecDeque;
use std::time::Instant;

use super::config::DUPLICATE_WINDOW;
use super::seq;
use super::Frame;

/// Accounting overhead charged per held item, so empty payloads still cost something.
pub(crate) const ITEM_OVERHEAD: usize = 64;
/// Distinct sequences awaiting an explicit ack, at most; beyond it older ones are forgotten
/// (their sender resends and is acked again).
const MAX_PENDING_ACKS: usize = 1024;

#[derive(Debug)]
pub(crate) enum Slot {
    Empty,
    Got(Option<Frame>),
}

/// What a newly arrived reliable sequence is.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Class {
    /// Already received (or at/behind the watermark).
    Duplicate,
    /// More than the duplicate window ahead of the watermark.
    OutOfWindow,
    /// New, at ring index `0..DUPLICATE_WINDOW`.
    New(usize),
}

#[derive(Debug)]
pub(crate) struct Recv {
    /// `None` until the handshake fixes the peer's first sequence.
    pub(crate) through: Option<u32>,
    ring: VecDeque<Slot>,
    /// Highest reliable sequence received; 0 = none yet.
    pub(crate) highest: u32,
    pub(crate) held_bytes: usize,
    pending_acks: Vec<u32>,
    /// When the ring's front became a hole with later packets behind it.
    pub(crate) hole_since: Option<Instant>,
    /// Sequences skipped as holes (newest last), so a late arrival is delivered, not dropped.
    /// Invariant: at most `MAX_SKIPPED` entries.
    skipped: VecDeque<u32>,
}

/// Skipped sequences remembered for late delivery.
const MAX_SKIPPED: usize = 256;

impl Recv {
    pub(crate) fn new() -> Self {
        Self {
            through: None,
            ring: VecDeque::new(),
            highest: 0,
            held_bytes: 0,
            pending_acks: Vec::new(),
            hole_since: None,
            skipped: VecDeque::new(),
        }
    }

    /// Whether `s` was skipped as a hole (and forgets it: it is taken now).
    pub(crate) fn take_skipped(&mut self, s: u32) -> bool {
        match self.skipped.iter().position(|&x| x == s) {
            Some(i) => {
                self.skipped.remove(i);
                true
            }
            None => false,
        }
    }

    /// Fixes the watermark at `s` (the peer's Connect or Accept sequence, consumed by the
    /// handshake).
    pub(crate) fn start_at(&mut self, s: u32) {
        self.through = Some(s);
        self.highest = s;
    }

    pub(crate) fn classify(&self, s: u32) -> Class {
        let Some(through) = self.through else {
            return Class::OutOfWindow;
        };
        let d = seq::diff(s, through);
        if d <= 0 {
            return Class::Duplicate;
        }
        if d > DUPLICATE_WINDOW as i64 {
            return Class::OutOfWindow;
        }
        let idx = (d - 1) as usize;
        match self.ring.get(idx) {
            Some(Slot::Got(_)) => Class::Duplicate,
            _ => Class::New(idx),
        }
    }

    /// Marks ring index `idx` (from [`Class::New`]) as received, holding `frame` if given.
    pub(crate) fn mark(&mut self, idx: usize, s: u32, frame: Option<Frame>) {
        while self.ring.len() <= idx {
            self.ring.push_back(Slot::Empty);
        }
        if let Some(f) = &frame {
            self.held_bytes += f.payload.len() + ITEM_OVERHEAD;
        }
        self.ring[idx] = Slot::Got(frame);
        if self.highest == 0 || seq::after(s, self.highest) {
            self.highest = s;
        }
    }

    /// Puts a reassembled frame into the (already received) slot of sequence `s`.
    /// Returns false if that slot has already been passed.
    pub(crate) fn place(&mut self, s: u32, frame: Frame) -> bool {
        let Some(through) = self.through else {
            return false;
        };
        let d = seq::diff(s, through);
        if d <= 0 {
            return false;
        }
        match self.ring.get_mut((d - 1) as usize) {
            Some(slot @ Slot::Got(None)) => {
                self.held_bytes += frame.payload.len() + ITEM_OVERHEAD;
                *slot = Slot::Got(Some(frame));
                true
            }
            _ => false,
        }
    }

    /// Advances the watermark over received slots, handing held frames to `deliver` in order.
    pub(crate) fn advance(&mut self, now: Instant, mut deliver: impl FnMut(Frame)) {
        let Some(mut through) = self.through else {
            return;
        };
        let mut moved = false;
        while let Some(Slot::Got(_)) = self.ring.front() {
            if let Some(Slot::Got(Some(f))) = self.ring.pop_front() {
                self.held_bytes -= f.payload.len() + ITEM_OVERHEAD;
                deliver(f);
            }
            through = seq::next(through);
            moved = true;
        }
        self.through = Some(through);
        if self.ring.is_empty() {
            self.hole_since = None;
        } else if moved || self.hole_since.is_none() {
            // A new gap starts its clock now.
            self.hole_since = Some(now);
        }
    }

    /// Treats the hole at the ring's front as received (an older-rules peer's lost ack or
    /// ping, which no resend will ever fill), then advances.
    pub(crate) fn skip_hole(&mut self, now: Instant, deliver: impl FnMut(Frame)) -> bool {
        let Some(through) = self.through else {
            return false;
        };
        match self.ring.front_mut() {
            Some(slot @ Slot::Empty) => {
                *slot = Slot::Got(None);
                if self.skipped.len() >= MAX_SKIPPED {
                    self.skipped.pop_front();
                }
                self.skipped.push_back(seq::next(through));
                self.hole_since = None;
                self.advance(now, deliver);
                true
            }
            _ => false,
        }
    }

    /// Whether sequence `s` has been received.
    pub(crate) fn received(&self, s: u32) -> bool {
        let Some(through) = self.through else {
            return false;
        };
        if s == 0 {
            return false;
        }
        let d = seq::diff(s, through);
        d <= 0 || matches!(self.ring.get((d - 1) as usize), Some(Slot::Got(_)))
    }

    /// The ack mask for an ack naming `a`: bit b = `a - b - 1` received.
    pub(crate) fn mask_for(&self, a: u32) -> u32 {
        let mut mask = 0u32;
        for b in 0..32u32 {
            let s = a.wrapping_sub(b + 1);
            if self.received(s) {
                mask |= 1 << b;
            }
        }
        mask
    }

    pub(crate) fn want_ack(&mut self, s: u32) {
        if !self.pending_acks.contains(&s) {
            if self.pending_acks.len() >= MAX_PENDING_ACKS {
                self.pending_acks.remove(0);
            }
            self.pending_acks.push(s);
        }
    }

    pub(crate) fn has_pending_acks(&self) -> bool {
        !self.pending_acks.is_empty()
    }

    pub(crate) fn pending_ack_count(&self) -> usize {
        self.pending_acks.len()
    }

    /// Forgets pending acks that a packet carrying (`ack`, `mask`) covers.
    pub(crate) fn acked_by(&mut self, ack: u32, mask: u32) {
        self.pending_acks.retain(|&s| !seq::covered(ack, mask, s));
    }

    /// The next explicit ack to send: the highest pending sequence and its mask.
    pub(crate) fn next_ack(&mut self) -> Option<(u32, u32)> {
        let mut best = *self.pending_acks.first()?;
        for &s in &self.pending_acks {
            if seq::after(s, best) {
                best = s;
            }
        }
        let mask = self.mask_for(best);
        self.acked_by(best, mask);
        Some((best, mask))
    }

    /// Whether there is a gap with packets waiting behind it.
    pub(crate) fn has_hole(&self) -> bool {
        matches!(self.ring.front(), Some(Slot::Empty))
    }
}
