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

/// Generates a workload.
pub fn generate(seed: u64, batches: usize) -> Value {
    let mut r = Rng(seed | 1);
    let doctrine: Vec<String> = (0..1100)
        .map(|i| format!("Clause {i}: {}.", words(&mut r, 70)))
        .collect();
    let state = words(&mut r, 5200);
    let rooms = ["!lobby:localhost", "!garden:localhost", "!forge:localhost"];
    let users = [
        "@ada:localhost",
        "@bo:localhost",
        "@cy:localhost",
        "@di:localhost",
        "@eve:localhost",
        "@fay:localhost",
    ];
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
                    (room, users[r.next() as usize % users.len()])
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
    json!({"seed": seed, "doctrine": doctrine.join("\n"), "state": state, "batches": out})
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn committed_reference_matches_its_seed() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../fixtures/workload/reference.json"
        );
        let committed: Value =
            serde_json::from_str(&std::fs::read_to_string(path).expect("reference workload"))
                .unwrap();
        assert_eq!(committed, generate(REFERENCE_SEED, REFERENCE_BATCHES));
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
