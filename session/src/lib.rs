//! The live Persona session (issue 4), its pure parts first:
//!
//! - [`cost`]: token usage and what it costs under a price table (cache writes at 1.25x / 2x,
//!   reads at 0.1x of base input).
//! - [`policy`]: the refresh decision, a pure `decide(telemetry, now, config)`: continue,
//!   compact, start fresh, evict the idle process, or refresh the cache before it expires.
//!
//! Still to come (issue 4): the claude CLI driver over stream-json, batch rendering, the reply
//! schema, session identity and resume, and the gateway wiring.
#![forbid(unsafe_code)]
#![warn(missing_docs, unreachable_pub)]

pub mod cost;
pub mod policy;
