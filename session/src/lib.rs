//! The live Persona session, its pure parts first:
//!
//! - [`admission`]: what starts a turn (addressed lines, an ambient interval, per-sender and
//!   bot-exchange limits), decided over her pending mail with time passed in.
//! - [`budget`]: her rolling 24-hour spend against her operator's daily cap, and when she resumes.
//! - [`cost`]: token usage and what it costs under a price table (cache writes at 1.25x / 2x,
//!   reads at 0.1x of base input).
//! - [`policy`]: the refresh decision, a pure `decide(telemetry, now, config)`: continue,
//!   compact, start fresh, evict the idle process, or refresh the cache before it expires.
//! - [`handle`]: the short handles her lines carry, which she cites to answer, correct or react
//!   to one, and their resolution to events.
//! - [`render`]: batch selection (one conversation at a time), the one-block user message with
//!   its fixed header, context sent once, the reply schema and its validation, say request ids.
//! - [`untrusted`]: the one rule for writing what comes from Matrix into her prompt as data:
//!   one-line, escaped, capped names and ids, event ids checked, every line break indented.
//! - [`turn`]: what her turn loop does next with her pending mail (a pure state machine: what it
//!   sees in, the step out), and what a batch refused as too long leaves for the next turn.
//! - [`waiting`]: what of her waiting mail stays mail: a bound per public room, and room for
//!   the line that starts a turn in its batch; the rest is retired into the rooms' context.
//! - [`attempt`]: how one turn runs once its batch is chosen (a pure state machine: what the
//!   edge knows and each action's result in, the next action out): the policy's fresh start
//!   or compaction, the text sent, a dead process replaced, a refusal as too long, an API error.
//! - [`correction`]: the note her next batch carries when her last reply went nowhere, whole
//!   or in part, and when it is cleared.
//! - [`verbs`]: what each of her operators' verbs does given her state, and how it is answered.
//! - [`proto`]: the CLI's stream-json events (typed, tolerant) and the stdin lines.
//!
//! And at the edge, [`driver`]: one claude process (spawn, readiness, a turn, its timeout,
//! interrupt and kill, `/compact`, the keep-warm fork), which dies with the gateway.
//!
//! No unsafe code but one audited block: the driver asks Linux to kill the child when the
//! gateway dies (`driver::die_with_parent`), which takes a `pre_exec` hook.
#![deny(unsafe_code)]
#![warn(missing_docs, unreachable_pub)]

pub mod admission;
pub mod attempt;
pub mod budget;
pub mod correction;
pub mod cost;
pub mod driver;
pub mod handle;
pub mod policy;
pub mod proto;
pub mod render;
pub mod turn;
pub mod untrusted;
pub mod verbs;
pub mod waiting;
