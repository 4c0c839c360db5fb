//! Support code for the end-to-end tests; the tests themselves live in `tests/tests/`.
//!
//! - [`mock_api`]: a local stand-in for the model's Messages API (the only mock in the project:
//!   these machines cannot reach the real one).
//! - [`claude_cli`]: the pinned claude CLI, installed by `deploy/install-claude-cli.sh`.
//! - [`synapse`]: a real Synapse homeserver on loopback, from `deploy/synapse/`.
//! - [`matrix`]: Matrix users for tests (logins with chosen devices, an operator client that
//!   speaks encrypted) and an in-process gateway for one Persona.
//! - [`live`]: helpers for tests of the gateway binary with a live session.
//! - [`workload`]: the seeded reference workload of the session benchmark.
//! - [`fault_proxy`]: an HTTP proxy in front of Synapse that answers `/sync` with 429 on demand.
//! - [`legacy`]: a CultNet client on the older session rules (every packet sequenced).
#![forbid(unsafe_code)]
#![warn(missing_docs, unreachable_pub)]

pub mod claude_cli;
pub mod fault_proxy;
pub mod legacy;
pub mod live;
pub mod matrix;
pub mod mock_api;
pub mod synapse;
pub mod workload;
