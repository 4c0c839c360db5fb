//! The seeded reference workload of the session benchmark, shaped like the old design's turns:
//! a ~24k-token doctrine, ~1.3k tokens of Persona state, batches of 1-5 deliveries (~40 tokens
//! each), replies of 100-200 tokens, and gaps of which 60% are under 2 minutes, 30% 2-30
//! minutes and 10% 30 minutes to 3 hours. `fixtures/workload/reference.json` is this function's
//! output for [`REFERENCE_SEED`] (a test keeps the two equal).

use serde_json::{json, Value};

/// Seed of the committed reference workload.
pub const REFERENCE_SEED: u64 = 0x5EED_2026;
/// Batches in the reference workload.
pub const REFERENCE_BATCHES: usize = 120;

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next() % (hi - lo + 1)
    }
}

const WORDS: &[&str] = &[
    "ritual", "signal", "harbor", "lantern", "orbit", "quiet", "meadow", "copper", "thread",
    "anchor", "ember", "vessel", "mirror", "summit", "willow", "cipher", "beacon", "river",
    "glacier", "compass", "ledger", "garden", "falcon", "prism",
];

fn words(r: &mut Rng, bytes: usize) -> String {
    let mut s = String::new();
    while s.len() < bytes {
        if !s.is_empty() {
            s.push(' ');
        }
        s.push_str(WORDS[r.next() as usize % WORDS.len()]);
    }
    s
}

/// A workload's doctrine (~24k tokens, 1,100 clauses) and state (~1.3k tokens), drawn first
/// from its generator.
fn doctrine_and_state(r: &mut Rng) -> (String, String) {
    let doctrine: Vec<String> = (0..1100)
        .map(|i| format!("Clause {i}: {}.", words(r, 70)))
        .collect();
    (doctrine.join("\n"), words(r, 5200))
}

/// Generates a workload.
pub fn generate(seed: u64, batches: usize) -> Value {
    let mut r = Rng(seed | 1);
    let (doctrine, state) = doctrine_and_state(&mut r);
    let rooms = ["!lobby:localhost", "!garden:localhost", "!forge:localhost"];
    let mut out = Vec::new();
    for b in 0..batches {
        let p = r.range(1, 100);
        let gap = if p <= 60 {
            r.range(5, 119)
        } else if p <= 90 {
            r.range(120, 1800)
        } else {
            r.range(1800, 10_800)
        };
        let direct = r.range(1, 10) == 1;
        let n = if direct { 1 } else { r.range(1, 5) };
        let room = rooms[r.next() as usize % rooms.len()];
        let deliveries: Vec<Value> = (0..n)
            .map(|_| {
                let (room, sender) = if direct {
                    ("!ops-dm:localhost", "@operator:localhost")
                } else {
                    (room, USERS[r.next() as usize % USERS.len()])
                };
                json!({"room": room, "direct": direct, "sender": sender, "text": words(&mut r, 160)})
            })
            .collect();
        let reply_room = deliveries[0]["room"].clone();
        let reply_bytes = r.range(400, 800) as usize;
        let reply = json!({"say": [{"room": reply_room, "text": words(&mut r, reply_bytes)}]});
        out.push(
            json!({"batch": b + 1, "gap_secs": gap, "deliveries": deliveries, "reply": reply}),
        );
    }
    json!({"seed": seed, "doctrine": doctrine, "state": state, "batches": out})
}

/// The committed workloads of the session benchmark, each a seeded shape of a Persona's day.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Shape {
    /// The reference: a mix of rooms and an operator's DMs (see the module docs).
    Reference,
    /// An operator DMs her now and then: one line, long silences, short follow-ups.
    QuietDms,
    /// One busy room: 2-5 lines a batch, most gaps under a minute and a half.
    BusyRoom,
    /// Bursts of chat in the day (gaps of seconds) and long pauses, one of them a night.
    BurstyDay,
    /// One long conversation in a DM, pasted documents of ~3.5k tokens a batch: it fills the
    /// 200k window twice over, so compaction is the policy's choice.
    LongConversation,
    /// Many short DMs across thirty rooms: one or two lines, gaps of minutes.
    ManyDms,
}

impl Shape {
    /// Every shape, in the benchmark's order.
    pub const ALL: [Shape; 6] = [
        Shape::Reference,
        Shape::QuietDms,
        Shape::BusyRoom,
        Shape::BurstyDay,
        Shape::LongConversation,
        Shape::ManyDms,
    ];

    /// The file name (without `.json`) under `fixtures/workload/`.
    pub fn name(self) -> &'static str {
        match self {
            Shape::Reference => "reference",
            Shape::QuietDms => "quiet-dms",
            Shape::BusyRoom => "busy-room",
            Shape::BurstyDay => "bursty-day",
            Shape::LongConversation => "long-conversation",
            Shape::ManyDms => "many-dms",
        }
    }

    /// The shape a name stands for.
    pub fn from_name(name: &str) -> Option<Shape> {
        Shape::ALL.into_iter().find(|s| s.name() == name)
    }

    /// Its seed.
    pub fn seed(self) -> u64 {
        match self {
            Shape::Reference => REFERENCE_SEED,
            other => REFERENCE_SEED ^ (0x1000 * other as u64),
        }
    }

    /// Its number of batches.
    pub fn batches(self) -> usize {
        match self {
            Shape::Reference => REFERENCE_BATCHES,
            Shape::QuietDms => 40,
            Shape::BusyRoom => 100,
            Shape::BurstyDay => 100,
            Shape::LongConversation => 110,
            Shape::ManyDms => 80,
        }
    }

    /// The committed workload's path.
    pub fn path(self) -> std::path::PathBuf {
        std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../fixtures/workload")
            .join(format!("{}.json", self.name()))
    }

    /// Generates it.
    pub fn generate(self) -> Value {
        self.generate_seeded(self.seed())
    }

    /// Another day of the same shape: drawn the same way from another seed (day 0 is the
    /// committed workload). The benchmark learns her gaps from the day before to measure a
    /// Persona whose habits the gateway already knows, as it does after a restart.
    pub fn another_day(self, day: u64) -> Value {
        self.generate_seeded(self.seed() ^ (day << 32))
    }

    fn generate_seeded(self, seed: u64) -> Value {
        match self {
            Shape::Reference => generate(seed, self.batches()),
            _ => generate_shape(self, seed),
        }
    }
}

/// One batch as a shape draws it.
struct Draw {
    gap: u64,
    room: String,
    direct: bool,
    senders: Vec<&'static str>,
    line_bytes: usize,
}

const USERS: [&str; 6] = [
    "@ada:localhost",
    "@bo:localhost",
    "@cy:localhost",
    "@di:localhost",
    "@eve:localhost",
    "@fay:localhost",
];

fn draw(shape: Shape, r: &mut Rng, b: usize) -> Draw {
    let user = |r: &mut Rng| USERS[r.next() as usize % USERS.len()];
    match shape {
        Shape::QuietDms => Draw {
            // Half the messages follow up within minutes; the rest come after 20 min - 8 h.
            gap: if r.range(1, 2) == 1 {
                r.range(20, 240)
            } else {
                r.range(1200, 28_800)
            },
            room: "!ops-dm:localhost".into(),
            direct: true,
            senders: vec!["@operator:localhost"],
            line_bytes: r.range(80, 400) as usize,
        },
        Shape::BusyRoom => {
            let n = r.range(2, 5) as usize;
            Draw {
                gap: if r.range(1, 10) <= 9 {
                    r.range(5, 90)
                } else {
                    r.range(120, 600)
                },
                room: "!lobby:localhost".into(),
                direct: false,
                senders: (0..n).map(|_| user(r)).collect(),
                line_bytes: r.range(60, 240) as usize,
            }
        }
        Shape::BurstyDay => {
            // Bursts of 10-25 batches; between bursts 1-5 h, and a night of 8-10 h midway.
            let pause = b > 0 && r.range(1, 15) == 1;
            let gap = if b == 50 {
                r.range(28_800, 36_000)
            } else if pause {
                r.range(3600, 18_000)
            } else {
                r.range(5, 60)
            };
            let n = r.range(1, 4) as usize;
            let rooms = ["!lobby:localhost", "!garden:localhost"];
            Draw {
                gap,
                room: rooms[r.next() as usize % 2].into(),
                direct: false,
                senders: (0..n).map(|_| user(r)).collect(),
                line_bytes: r.range(80, 240) as usize,
            }
        }
        Shape::LongConversation => Draw {
            gap: r.range(30, 240),
            room: "!study-dm:localhost".into(),
            direct: true,
            senders: vec!["@operator:localhost"],
            line_bytes: r.range(12_000, 16_000) as usize,
        },
        Shape::ManyDms => {
            let who = r.range(0, 29);
            let n = r.range(1, 2) as usize;
            Draw {
                gap: r.range(60, 1200),
                room: format!("!dm-{who}:localhost"),
                direct: true,
                senders: vec![USERS[who as usize % USERS.len()]; n],
                line_bytes: r.range(40, 200) as usize,
            }
        }
        Shape::Reference => unreachable!("the reference keeps its own generator"),
    }
}

fn generate_shape(shape: Shape, seed: u64) -> Value {
    let mut r = Rng(seed | 1);
    let (doctrine, state) = doctrine_and_state(&mut r);
    let mut out = Vec::new();
    for b in 0..shape.batches() {
        let d = draw(shape, &mut r, b);
        let deliveries: Vec<Value> = d
            .senders
            .iter()
            .map(|sender| {
                json!({"room": d.room, "direct": d.direct, "sender": sender, "text": words(&mut r, d.line_bytes)})
            })
            .collect();
        let reply_bytes = r.range(300, 800) as usize;
        let reply = json!({"say": [{"room": d.room, "text": words(&mut r, reply_bytes)}]});
        out.push(
            json!({"batch": b + 1, "gap_secs": d.gap, "deliveries": deliveries, "reply": reply}),
        );
    }
    json!({"name": shape.name(), "seed": seed, "doctrine": doctrine, "state": state, "batches": out})
}

/// The silence before a batch (its `gap_secs`; 0 if missing).
pub fn gap(batch: &Value) -> std::time::Duration {
    std::time::Duration::from_secs(batch["gap_secs"].as_u64().unwrap_or(0))
}

/// Loads a committed workload.
pub fn load(shape: Shape) -> Result<Value, String> {
    let path = shape.path();
    let text = std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn committed_workloads_match_their_seeds() {
        for shape in Shape::ALL {
            let committed = load(shape).unwrap();
            assert!(
                committed == shape.generate(),
                "{} differs from its seed: regenerate with `cargo run -p tests --example gen_workload`",
                shape.name()
            );
        }
        // The reference keeps the exact output it had before the other shapes came.
        assert_eq!(
            load(Shape::Reference).unwrap(),
            generate(REFERENCE_SEED, REFERENCE_BATCHES)
        );
    }

    fn gaps(w: &Value) -> Vec<u64> {
        w["batches"]
            .as_array()
            .unwrap()
            .iter()
            .map(|b| b["gap_secs"].as_u64().unwrap())
            .collect()
    }

    fn delivered_tokens(w: &Value) -> usize {
        w["batches"]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|b| b["deliveries"].as_array().unwrap())
            .map(|d| d["text"].as_str().unwrap().len() / 4)
            .sum()
    }

    #[test]
    fn shapes_differ_as_named() {
        let quiet = Shape::QuietDms.generate();
        let q = gaps(&quiet);
        assert!(q.iter().filter(|g| **g >= 1200).count() >= 12, "{q:?}");
        let busy = Shape::BusyRoom.generate();
        let b = gaps(&busy);
        assert!(
            b.iter().filter(|g| **g <= 90).count() * 10 >= b.len() * 8,
            "{b:?}"
        );
        let bursty = gaps(&Shape::BurstyDay.generate());
        assert!(bursty.iter().any(|g| *g >= 28_800), "a night");
        assert!(bursty.iter().filter(|g| **g >= 3600).count() >= 3, "pauses");
        let long = Shape::LongConversation.generate();
        // Fills the 177k blocking limit at least twice over.
        assert!(
            delivered_tokens(&long) > 2 * 177_000,
            "{}",
            delivered_tokens(&long)
        );
        let many = Shape::ManyDms.generate();
        let rooms: std::collections::BTreeSet<&str> = many["batches"]
            .as_array()
            .unwrap()
            .iter()
            .map(|b| b["deliveries"][0]["room"].as_str().unwrap())
            .collect();
        assert!(rooms.len() >= 20, "{}", rooms.len());
        for shape in Shape::ALL {
            assert_eq!(Shape::from_name(shape.name()), Some(shape));
            assert_eq!(
                gaps(&shape.generate()).len(),
                shape.batches(),
                "{}",
                shape.name()
            );
        }
    }

    #[test]
    fn another_day_is_drawn_anew_in_the_same_shape() {
        for shape in Shape::ALL {
            let (today, yesterday) = (gaps(&shape.generate()), gaps(&shape.another_day(1)));
            assert_eq!(yesterday.len(), today.len(), "{}", shape.name());
            assert_ne!(yesterday, today, "{}", shape.name());
            assert_ne!(gaps(&shape.another_day(2)), yesterday, "{}", shape.name());
            assert_eq!(shape.another_day(0), shape.generate(), "{}", shape.name());
        }
        // The same shape: quiet DMs still wait 20 min - 8 h about half the time.
        let q = gaps(&Shape::QuietDms.another_day(1));
        assert!(q.iter().filter(|g| **g >= 1200).count() >= 12, "{q:?}");
        assert!(q.iter().all(|g| (20..=28_800).contains(g)), "{q:?}");
    }

    #[test]
    fn shape() {
        let w = generate(REFERENCE_SEED, REFERENCE_BATCHES);
        let batches = w["batches"].as_array().unwrap();
        assert_eq!(batches.len(), REFERENCE_BATCHES);
        let doctrine_tokens = w["doctrine"].as_str().unwrap().len() / 4;
        assert!(
            (22_000..26_000).contains(&doctrine_tokens),
            "{doctrine_tokens}"
        );
        let state_tokens = w["state"].as_str().unwrap().len() / 4;
        assert!((1_200..1_400).contains(&state_tokens), "{state_tokens}");
        let short = batches
            .iter()
            .filter(|b| b["gap_secs"].as_u64().unwrap() < 120)
            .count();
        assert!(
            (50..=85).contains(&short),
            "{short} short gaps of {}",
            batches.len()
        );
        assert!(batches
            .iter()
            .all(|b| (1..=5).contains(&b["deliveries"].as_array().unwrap().len())));
    }
}
