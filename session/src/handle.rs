//! Short handles for the lines she sees, so she can cite one: answer it (`replyTo`), correct
//! a line of her own (`replaces`), react to it (`react`), name a thread (`threadRoot`).
//!
//! A handle is `^` and six characters derived from the event id alone, so the same line has
//! the same handle in every batch, after a restart and in a fresh session, and the gateway
//! needs no table to resolve it: it looks the handle up among the lines she could have seen
//! (her batch, its context, her rooms' stored timelines). Six base-32 characters are 30 bits:
//! two lines of one Persona's recent timelines sharing a handle is about a one-in-a-million
//! event for a thousand lines, and resolution then takes the newest.
//!
//! Event ids never reach her prompt as handles' substitutes by accident: a handle is made only
//! here, from an id the gateway read, and a body that writes `^abc123` stays body text (its
//! lines are indented under the speaker), which she can cite only if a line has that handle.

use wire::docs::{ContextLine, Delivery};

/// What a handle starts with.
pub const PREFIX: char = '^';

const ALPHABET: &[u8; 32] = b"abcdefghijkmnpqrstuvwxyz23456789";

/// The handle of `event_id`: `^` and six characters of its FNV-1a hash.
pub fn of(event_id: &str) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in event_id.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    let mut out = String::with_capacity(7);
    out.push(PREFIX);
    for i in 0..6 {
        out.push(char::from(ALPHABET[((h >> (5 * i)) & 31) as usize]));
    }
    out
}

/// Whether `s` has a handle's shape.
pub fn is_handle(s: &str) -> bool {
    let mut chars = s.chars();
    chars.next() == Some(PREFIX)
        && s.len() == 7
        && chars.all(|c| c.is_ascii() && ALPHABET.contains(&(c as u8)))
}

/// A line a handle names: its room, event and sender, and its text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cited<'a> {
    /// Room id.
    pub room_id: &'a str,
    /// Event id.
    pub event_id: &'a str,
    /// Who said it.
    pub sender: &'a str,
    /// What it says.
    pub text: &'a str,
}

/// The line `handle` names among the lines she could have seen: `batch` (its lines and their
/// context) and `timelines` (room id, its stored lines oldest first); the newest when two
/// share it. A raw event id (from before handles, or a CultNet client) names its line too.
pub fn resolve<'a>(
    handle: &str,
    batch: &'a [Delivery],
    timelines: &'a [(String, Vec<ContextLine>)],
) -> Option<Cited<'a>> {
    let matches = |event_id: &str| {
        if is_handle(handle) {
            of(event_id) == handle
        } else {
            event_id == handle
        }
    };
    let line = |room_id: &'a str, c: &'a ContextLine| Cited {
        room_id,
        event_id: &c.event_id,
        sender: &c.sender,
        text: &c.text,
    };
    let from_batch = batch.iter().rev().find_map(|d| {
        if matches(&d.event_id) {
            return Some(Cited {
                room_id: &d.room_id,
                event_id: &d.event_id,
                sender: &d.sender,
                text: &d.text,
            });
        }
        let c = d.context.iter().rev().find(|c| matches(&c.event_id))?;
        Some(line(&d.room_id, c))
    });
    from_batch.or_else(|| {
        timelines.iter().find_map(|(room, lines)| {
            let c = lines.iter().rev().find(|c| matches(&c.event_id))?;
            Some(line(room, c))
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line(id: &str, sender: &str, text: &str) -> ContextLine {
        ContextLine {
            event_id: id.into(),
            sender: sender.into(),
            sender_name: None,
            ts: 0,
            text: text.into(),
        }
    }

    #[test]
    fn a_handle_is_stable_short_and_names_its_line_only() {
        let h = of("$abc:localhost");
        assert_eq!(h, of("$abc:localhost"), "the same in every batch");
        assert!(is_handle(&h), "{h}");
        assert_ne!(h, of("$abd:localhost"));
        for bad in [
            "", "^", "^abc", "^abcdefg", "$abc:x", "^ABCDEF", "^abcde1", "^abcdé",
        ] {
            assert!(!is_handle(bad), "{bad:?}");
        }
        // Handles of many ids rarely collide (30 bits): none among 10,000.
        let mut all: Vec<String> = (0..10_000).map(|i| of(&format!("$e{i}:hs"))).collect();
        all.sort();
        all.dedup();
        assert_eq!(all.len(), 10_000);
    }

    #[test]
    fn a_handle_resolves_in_the_batch_its_context_and_her_timelines() {
        let d = Delivery {
            room_id: "!r:hs".into(),
            event_id: "$new:hs".into(),
            sender: "@ann:hs".into(),
            text: "new".into(),
            context: vec![line("$ctx:hs", "@bob:hs", "before")],
            ..Delivery::default()
        };
        let timelines = vec![(
            "!other:hs".to_owned(),
            vec![line("$old:hs", "@vera:hs", "mine")],
        )];
        let batch = [d];
        let got = resolve(&of("$ctx:hs"), &batch, &timelines).unwrap();
        assert_eq!(
            (got.room_id, got.event_id, got.sender),
            ("!r:hs", "$ctx:hs", "@bob:hs")
        );
        let got = resolve(&of("$old:hs"), &batch, &timelines).unwrap();
        assert_eq!((got.room_id, got.text), ("!other:hs", "mine"));
        assert_eq!(
            resolve(&of("$new:hs"), &batch, &timelines).unwrap().text,
            "new"
        );
        assert_eq!(
            resolve("$old:hs", &batch, &timelines).unwrap().room_id,
            "!other:hs"
        );
        assert!(resolve(&of("$nowhere:hs"), &batch, &timelines).is_none());
        assert!(resolve("^zzzzzz", &batch, &timelines).is_none());
    }
}
