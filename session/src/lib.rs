//! The live Persona session (issue 4): spawning and driving the claude CLI over stream-json,
//! rendering batches, the reply schema, session identity and the refresh policy.
//!
//! Not built yet: this crate only holds its place in the workspace layout.
#![forbid(unsafe_code)]
#![warn(missing_docs, unreachable_pub)]
