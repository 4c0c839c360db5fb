//! What starts a turn: her operator's rules, decided over her pending mail before any model
//! call. Pure: the caller passes the time in (ms since the epoch) and performs the verdict.
//!
//! - `start`: with [`Start::Addressed`] (the default) a line starts a turn when it is her
//!   operator's, a DM, or addressed to her (a mention, her name, a reply to her, a thread she
//!   has spoken in); other public lines wait as mail and ride with her next turn, so she still
//!   sees the room. [`Start::All`]: every line. [`Start::Minds`]: none; only her Minds' turn
//!   requests start turns.
//! - `ambient_every_ms`: unaddressed mail may start at most one turn this often (0: never).
//! - `per_sender_per_hour`: the turns one non-operator's lines can start in an hour; past it
//!   their lines wait and ride with the next turn.
//! - `bot_exchanges`: consecutive turns in one room started by other Personas or listed bots,
//!   with no human line to her between; past it such lines start no turn until a human speaks
//!   to her there (a human's "lol" meant for no one does not renew the count).
//!
//! Batches are prefixes of her pending mail (acks are cumulative), so a turn started by a line
//! may first take the older mail ahead of it; a start is booked against the line that made it
//! only when that line is in the batch taken, and against every other member whose lines to
//! her the batch carries, once each ([`Admission::started`]): a turn answers them all.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// An hour, in ms.
const HOUR_MS: i64 = 60 * 60 * 1000;

/// Which lines may start a turn.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Start {
    /// Her operator's lines, DMs, and lines addressed to her.
    #[default]
    Addressed,
    /// Every line.
    All,
    /// None: only her Minds' turn requests.
    Minds,
}

/// Her operator's rules for what starts a turn.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rules {
    /// Which lines may start a turn.
    pub start: Start,
    /// Unaddressed mail starts at most one turn this often (0: never).
    pub ambient_every_ms: i64,
    /// Turns one non-operator's lines may start in an hour.
    pub per_sender_per_hour: u32,
    /// Consecutive bot-started turns in one room with no human line between.
    pub bot_exchanges: u32,
}

impl Default for Rules {
    fn default() -> Self {
        Self {
            start: Start::Addressed,
            ambient_every_ms: 0,
            per_sender_per_hour: 10,
            bot_exchanges: 3,
        }
    }
}

/// A pending line as the rules see it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Line<'a> {
    /// Its room.
    pub room: &'a str,
    /// Its sender.
    pub sender: &'a str,
    /// A DM, or addressed to her (a mention, her name, a reply to her, her thread).
    pub addressed: bool,
    /// From one of her operators.
    pub operator: bool,
    /// From another Persona of this gateway, or a listed bot.
    pub bot: bool,
}

/// What to do with her pending mail now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Start a turn: the line at `trigger` (an index into the pending lines) may start one.
    Start {
        /// The line that starts it.
        trigger: usize,
        /// Started by unaddressed mail under `ambient_every_ms`.
        ambient: bool,
    },
    /// Start none; look again at `recheck_at_ms` (a per-sender hour or the ambient interval
    /// running out), or when new mail comes.
    Wait {
        /// When the verdict may change without new mail.
        recheck_at_ms: Option<i64>,
    },
}

/// What the rules remember between turns: who started turns in the last hour, each room's
/// run of bot-started turns, the last ambient turn. Kept by the caller across restarts.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Admission {
    /// Per non-operator sender, when their lines started turns (the last hour's).
    #[serde(default)]
    starts: BTreeMap<String, Vec<i64>>,
    /// Per room, consecutive turns started by bots with no human line between.
    #[serde(default)]
    bot_runs: BTreeMap<String, u32>,
    /// When unaddressed mail last started a turn.
    #[serde(default)]
    last_ambient_ms: Option<i64>,
}

impl Admission {
    /// Turns `sender`'s lines started in the hour before `now_ms`, and when the oldest of
    /// them leaves the hour.
    fn recent(&self, sender: &str, now_ms: i64) -> (u32, Option<i64>) {
        let times = self.starts.get(sender).map(Vec::as_slice).unwrap_or(&[]);
        let within = times.iter().filter(|t| **t > now_ms - HOUR_MS);
        (
            within.clone().count() as u32,
            within.min().map(|t| t + HOUR_MS),
        )
    }

    /// Whether a line in `pending` (in seq order) may start a turn at `now_ms`.
    pub fn decide(&self, rules: &Rules, pending: &[Line<'_>], now_ms: i64) -> Verdict {
        if rules.start == Start::Minds || pending.is_empty() {
            return Verdict::Wait {
                recheck_at_ms: None,
            };
        }
        let mut recheck: Option<i64> = None;
        let mut soonest = |t: i64| recheck = Some(recheck.map_or(t, |r: i64| r.min(t)));
        // A human line to her ahead of a bot's ends the room's run when the batch takes it.
        let mut human_in: Vec<&str> = Vec::new();
        let mut unaddressed = false;
        for (i, l) in pending.iter().enumerate() {
            let candidate = rules.start == Start::All || l.operator || l.addressed;
            if !l.bot && (l.addressed || l.operator) {
                human_in.push(l.room);
            }
            if !candidate {
                unaddressed |= !l.bot;
                continue;
            }
            if l.operator {
                return Verdict::Start {
                    trigger: i,
                    ambient: false,
                };
            }
            if l.bot
                && !human_in.contains(&l.room)
                && self.bot_runs.get(l.room).copied().unwrap_or(0) >= rules.bot_exchanges
            {
                continue;
            }
            let (n, frees_at) = self.recent(l.sender, now_ms);
            if n >= rules.per_sender_per_hour {
                if let Some(t) = frees_at {
                    soonest(t);
                }
                continue;
            }
            return Verdict::Start {
                trigger: i,
                ambient: false,
            };
        }
        if unaddressed && rules.ambient_every_ms > 0 {
            let due = self
                .last_ambient_ms
                .map_or(now_ms, |t| t + rules.ambient_every_ms);
            if due <= now_ms {
                let trigger = pending.iter().position(|l| !l.bot).unwrap_or_default();
                return Verdict::Start {
                    trigger,
                    ambient: true,
                };
            }
            soonest(due);
        }
        Verdict::Wait {
            recheck_at_ms: recheck,
        }
    }

    /// Books a turn started at `now_ms` on `batch` (the lines it takes, in seq order) by
    /// `trigger` (the line the verdict named, when the batch holds it; `ambient` as the
    /// verdict said): against the trigger's sender and every other member whose lines to her
    /// the batch carries, once each (her operators never). A forced turn (her Minds asked)
    /// books the batch's lines to her alone. A human's line to her ends the room's bot run.
    pub fn started(
        &mut self,
        rules: &Rules,
        batch: &[Line<'_>],
        trigger: Option<&Line<'_>>,
        ambient: bool,
        now_ms: i64,
    ) {
        for l in batch
            .iter()
            .filter(|l| !l.bot && (l.addressed || l.operator))
        {
            self.bot_runs.remove(l.room);
        }
        let mut booked: Vec<&str> = Vec::new();
        if let Some(t) = trigger {
            if ambient {
                self.last_ambient_ms = Some(now_ms);
            } else if t.bot {
                *self.bot_runs.entry(t.room.to_owned()).or_default() += 1;
            }
            if !t.operator && !ambient {
                booked.push(t.sender);
            }
        }
        for l in batch.iter().filter(|l| l.addressed && !l.operator) {
            if !booked.contains(&l.sender) {
                booked.push(l.sender);
            }
        }
        for sender in booked {
            self.starts
                .entry(sender.to_owned())
                .or_default()
                .push(now_ms);
        }
        // Forget what left the hour; a sender with nothing left is forgotten.
        let cap = rules.per_sender_per_hour as usize;
        self.starts.retain(|_, times| {
            times.retain(|t| *t > now_ms - HOUR_MS);
            if times.len() > cap.max(1) {
                times.drain(..times.len() - cap.max(1));
            }
            !times.is_empty()
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line<'a>(room: &'a str, sender: &'a str, addressed: bool) -> Line<'a> {
        Line {
            room,
            sender,
            addressed,
            operator: false,
            bot: false,
        }
    }

    fn wait(v: Verdict) -> Option<i64> {
        match v {
            Verdict::Wait { recheck_at_ms } => recheck_at_ms,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn by_default_only_what_is_addressed_to_her_starts_a_turn() {
        let a = Admission::default();
        let r = Rules::default();
        let lunch = [line("!a", "@bob:l", false), line("!a", "@eve:l", false)];
        assert_eq!(wait(a.decide(&r, &lunch, 0)), None);
        let mut asked = lunch.to_vec();
        asked.push(line("!a", "@eve:l", true));
        assert_eq!(
            a.decide(&r, &asked, 0),
            Verdict::Start {
                trigger: 2,
                ambient: false
            }
        );
        let op = Line {
            operator: true,
            ..line("!a", "@op:l", false)
        };
        assert!(matches!(
            a.decide(&r, &[op], 0),
            Verdict::Start { trigger: 0, .. }
        ));
        // "all": any line; "minds": none, not even her operator's.
        let all = Rules {
            start: Start::All,
            ..Rules::default()
        };
        assert!(matches!(
            a.decide(&all, &lunch, 0),
            Verdict::Start { trigger: 0, .. }
        ));
        let minds = Rules {
            start: Start::Minds,
            ..Rules::default()
        };
        assert_eq!(wait(a.decide(&minds, &[op], 0)), None);
        assert_eq!(wait(a.decide(&r, &[], 0)), None);
    }

    #[test]
    fn ambient_mail_starts_one_turn_an_interval() {
        let mut a = Admission::default();
        let r = Rules {
            ambient_every_ms: 60_000,
            ..Rules::default()
        };
        let lunch = [line("!a", "@bob:l", false)];
        assert_eq!(
            a.decide(&r, &lunch, 1_000),
            Verdict::Start {
                trigger: 0,
                ambient: true
            }
        );
        a.started(&r, &lunch, Some(&lunch[0]), true, 1_000);
        assert_eq!(wait(a.decide(&r, &lunch, 30_000)), Some(61_000));
        assert!(matches!(
            a.decide(&r, &lunch, 61_000),
            Verdict::Start { ambient: true, .. }
        ));
        // An ambient turn counts against no sender.
        assert_eq!(a.recent("@bob:l", 2_000).0, 0);
    }

    #[test]
    fn one_member_starts_at_most_her_hourly_turns() {
        let mut a = Admission::default();
        let r = Rules {
            per_sender_per_hour: 3,
            ..Rules::default()
        };
        let mention = [line("!a", "@mallory:l", true)];
        let mut started = 0;
        // Thirty mentions in a minute.
        for i in 0..30 {
            let now = i * 2_000;
            if let Verdict::Start { trigger, ambient } = a.decide(&r, &mention, now) {
                a.started(&r, &mention, Some(&mention[trigger]), ambient, now);
                started += 1;
            }
        }
        assert_eq!(started, 3);
        // She waits until the first of them leaves the hour; another member is not held.
        assert_eq!(wait(a.decide(&r, &mention, 60_000)), Some(HOUR_MS));
        let ann = [mention[0], line("!a", "@ann:l", true)];
        assert!(matches!(
            a.decide(&r, &ann, 60_000),
            Verdict::Start { trigger: 1, .. }
        ));
        assert!(matches!(
            a.decide(&r, &mention, HOUR_MS),
            Verdict::Start { .. }
        ));
        // Her operator is never held.
        let op = Line {
            operator: true,
            ..mention[0]
        };
        for i in 0..20 {
            a.started(&r, &[op], Some(&op), false, i);
        }
        assert!(matches!(a.decide(&r, &[op], 30), Verdict::Start { .. }));
    }

    #[test]
    fn bots_answering_each_other_stop_until_a_human_speaks() {
        let mut a = Admission::default();
        let r = Rules {
            bot_exchanges: 3,
            per_sender_per_hour: 100,
            ..Rules::default()
        };
        let bot = Line {
            bot: true,
            ..line("!a", "@mira:l", true)
        };
        let mut turns = 0;
        for i in 0..10 {
            if let Verdict::Start { trigger, ambient } = a.decide(&r, &[bot], i) {
                a.started(&r, &[bot], Some(&[bot][trigger]), ambient, i);
                turns += 1;
            }
        }
        assert_eq!(turns, 3);
        // In another room the run is its own.
        let elsewhere = Line { room: "!b", ..bot };
        assert!(matches!(
            a.decide(&r, &[elsewhere], 20),
            Verdict::Start { .. }
        ));
        // A human's "lol" meant for no one does not renew the count.
        let lol = line("!a", "@ann:l", false);
        assert!(matches!(
            a.decide(&r, &[lol, bot], 20),
            Verdict::Wait { .. }
        ));
        a.started(&r, &[lol], None, false, 20);
        assert!(matches!(a.decide(&r, &[bot], 20), Verdict::Wait { .. }));
        // A human line to her ahead of it lets it start again.
        let human = line("!a", "@ann:l", true);
        assert!(matches!(
            a.decide(&r, &[human, bot], 20),
            Verdict::Start { trigger: 0, .. }
        ));
        a.started(&r, &[human, bot], Some(&human), false, 20);
        assert!(matches!(a.decide(&r, &[bot], 21), Verdict::Start { .. }));
    }

    #[test]
    fn a_turn_is_booked_once_against_every_member_whose_lines_to_her_it_carries() {
        let mut a = Admission::default();
        let r = Rules {
            per_sender_per_hour: 1,
            ..Rules::default()
        };
        let bob = line("!a", "@bob:l", true);
        let eve = line("!a", "@eve:l", true);
        let quiet = line("!a", "@cat:l", false);
        let op = Line {
            operator: true,
            ..line("!a", "@ann:l", true)
        };
        // Bob's line started it; eve's rode along: both spent their hour, once each.
        a.started(&r, &[bob, eve, bob, quiet, op], Some(&bob), false, 10);
        assert_eq!(a.recent("@bob:l", 11).0, 1);
        assert_eq!(a.recent("@eve:l", 11).0, 1);
        assert_eq!(
            a.recent("@cat:l", 11).0,
            0,
            "a line not to her books nothing"
        );
        assert_eq!(a.recent("@ann:l", 11).0, 0, "her operator is never booked");
        // So eve's next line waits for her hour like bob's.
        assert!(matches!(a.decide(&r, &[eve], 12), Verdict::Wait { .. }));
    }

    #[test]
    fn what_it_remembers_survives_a_restart_and_stays_bounded() {
        let mut a = Admission::default();
        let r = Rules {
            per_sender_per_hour: 2,
            ..Rules::default()
        };
        for i in 0..50 {
            let who = format!("@m{i}:l");
            let l = line("!a", &who, true);
            a.started(&r, &[l], Some(&l), false, i * 100_000);
        }
        // Only the last hour's senders are kept.
        assert!(a.starts.len() <= 37, "{}", a.starts.len());
        let json = serde_json::to_string(&a).unwrap();
        let back: Admission = serde_json::from_str(&json).unwrap();
        assert_eq!(back, a);
        assert_eq!(
            serde_json::from_str::<Admission>("{}").unwrap(),
            Admission::default()
        );
    }
}
