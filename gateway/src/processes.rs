//! The gateway-wide cap on live claude processes (`[sessions] max_live`).
//!
//! A live process holds about 160 MB while it lives, so a gateway with many Personas keeps at
//! most `max_live` of them alive. A Persona that needs her process takes a slot
//! ([`Processes::acquire`]); when none is free, the least recently used idle Persona is asked
//! to stop hers (her session stays on disk and is resumed at her next turn), never one that is
//! working. The choice is a pure function over the slots (`Slots::victim`); the waiting and
//! the asking are this module's thin edge.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::Notify;

/// One live process's slot.
#[derive(Debug)]
struct Slot {
    /// When she last went idle (a tick of [`Slots::clock`]).
    last_used: u64,
    /// In a turn (or between the turns of one drain): never stopped for another.
    busy: bool,
    /// Asked to stop already.
    asked: bool,
    /// How she is asked to stop her process.
    evict: Arc<Notify>,
}

/// The slots, and the clock that orders their use.
#[derive(Debug, Default)]
struct Slots {
    live: HashMap<String, Slot>,
    clock: u64,
}

impl Slots {
    /// The Persona to stop so another can start: the least recently used idle one not asked
    /// already. `None` when everyone is busy, or one asked is still stopping.
    fn victim(&self) -> Option<&str> {
        if self.live.values().any(|s| s.asked) {
            return None;
        }
        self.live
            .iter()
            .filter(|(_, s)| !s.busy)
            .min_by_key(|(_, s)| s.last_used)
            .map(|(id, _)| id.as_str())
    }
}

/// The cap and its slots, shared by every Persona's turn loop.
#[derive(Debug)]
pub struct Processes {
    max: usize,
    slots: Mutex<Slots>,
    /// A slot was freed.
    freed: Notify,
    evictions: std::sync::atomic::AtomicU64,
    metrics: Arc<crate::metrics::Metrics>,
}

/// A Persona's held slot ([`Processes::acquire`]): her process may live while she holds it;
/// dropped once it stopped, which frees the slot.
#[derive(Debug)]
pub struct LiveSlot {
    processes: Arc<Processes>,
    persona: String,
}

impl Processes {
    /// At most `max` live processes (at least one); evictions are counted in `metrics`.
    pub fn new(max: usize, metrics: Arc<crate::metrics::Metrics>) -> Arc<Self> {
        Arc::new(Self {
            max: max.max(1),
            slots: Mutex::new(Slots::default()),
            freed: Notify::new(),
            evictions: std::sync::atomic::AtomicU64::new(0),
            metrics,
        })
    }

    fn slots(&self) -> std::sync::MutexGuard<'_, Slots> {
        self.slots.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Processes stopped to make room since the start.
    pub fn evictions(&self) -> u64 {
        self.evictions.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Live processes now.
    pub fn live(&self) -> usize {
        self.slots().live.len()
    }

    /// Takes a slot for `persona`'s process (busy), waiting while the cap is reached: the
    /// least recently used idle Persona is asked (through her `evict`) to stop hers.
    pub async fn acquire(self: &Arc<Self>, persona: &str, evict: Arc<Notify>) -> LiveSlot {
        loop {
            let freed = self.freed.notified();
            {
                let mut s = self.slots();
                if s.live.len() < self.max || s.live.contains_key(persona) {
                    let clock = s.clock;
                    s.live
                        .entry(persona.to_owned())
                        .and_modify(|slot| slot.busy = true)
                        .or_insert(Slot {
                            last_used: clock,
                            busy: true,
                            asked: false,
                            evict: evict.clone(),
                        });
                    return LiveSlot {
                        processes: self.clone(),
                        persona: persona.to_owned(),
                    };
                }
                if let Some(v) = s.victim().map(str::to_owned) {
                    if let Some(slot) = s.live.get_mut(&v) {
                        slot.asked = true;
                        slot.evict.notify_one();
                        tracing::info!(persona = %v, for_persona = %persona, max_live = self.max, "stopping her idle process to make room");
                    }
                }
            }
            // Woken when a slot is freed; looked at again now and then all the same.
            let _ = tokio::time::timeout(Duration::from_millis(500), freed).await;
        }
    }

    /// `persona` is working (a drain began): her process is not stopped for another.
    pub fn busy(&self, persona: &str) {
        if let Some(s) = self.slots().live.get_mut(persona) {
            s.busy = true;
        }
    }

    /// `persona` is idle (her drain ended): her process may be stopped for another, the
    /// least recently idle first.
    pub fn idle(&self, persona: &str) {
        let mut s = self.slots();
        s.clock += 1;
        let clock = s.clock;
        if let Some(slot) = s.live.get_mut(persona) {
            slot.busy = false;
            slot.last_used = clock;
        }
    }

    fn release(&self, persona: &str) {
        let asked = self
            .slots()
            .live
            .remove(persona)
            .is_some_and(|slot| slot.asked);
        if asked {
            self.evictions
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            self.metrics.process_evictions.inc();
        }
        self.freed.notify_waiters();
    }
}

impl Drop for LiveSlot {
    fn drop(&mut self) {
        self.processes.release(&self.persona);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slots(entries: &[(&str, u64, bool, bool)]) -> Slots {
        Slots {
            live: entries
                .iter()
                .map(|(id, last_used, busy, asked)| {
                    (
                        (*id).to_owned(),
                        Slot {
                            last_used: *last_used,
                            busy: *busy,
                            asked: *asked,
                            evict: Arc::new(Notify::new()),
                        },
                    )
                })
                .collect(),
            clock: 10,
        }
    }

    #[test]
    fn the_least_recently_used_idle_one_makes_room_never_a_busy_one() {
        let s = slots(&[
            ("a", 5, false, false),
            ("b", 2, true, false),
            ("c", 3, false, false),
        ]);
        assert_eq!(s.victim(), Some("c"));
        assert_eq!(
            slots(&[("a", 1, true, false), ("b", 2, true, false)]).victim(),
            None
        );
        // One asked already is still stopping: no second is asked meanwhile.
        assert_eq!(
            slots(&[("a", 1, false, true), ("b", 2, false, false)]).victim(),
            None
        );
        assert_eq!(Slots::default().victim(), None);
    }

    #[tokio::test]
    async fn a_newcomer_waits_for_the_idle_one_to_stop() {
        let p = Processes::new(1, crate::metrics::unserved());
        let a_evict = Arc::new(Notify::new());
        let a = p.acquire("a", a_evict.clone()).await;
        assert_eq!(p.live(), 1);
        // "a" is working: "b" waits, and "a" is not asked.
        let p2 = p.clone();
        let b = tokio::spawn(async move { p2.acquire("b", Arc::new(Notify::new())).await });
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!b.is_finished());
        // Idle, "a" is asked; stopping it (dropping its slot) lets "b" in.
        p.idle("a");
        tokio::time::timeout(Duration::from_secs(2), a_evict.notified())
            .await
            .expect("a was asked to stop");
        drop(a);
        let b = tokio::time::timeout(Duration::from_secs(2), b)
            .await
            .expect("b got its slot")
            .unwrap();
        assert_eq!((p.live(), p.evictions()), (1, 1));
        drop(b);
        assert_eq!((p.live(), p.evictions()), (0, 1));
    }
}
