//! The CultNet Matrix gateway: the I/O edges around the sans-IO `wire` and `session` crates.
//!
//! - [`endpoint`]: the one owner of the loopback CultNet UDP socket, driving a [`wire::hub::Hub`]
//!   with real datagrams (batched with GSO/GRO where the kernel offers them) and tokio's clock.
//!
//! - [`config`]: the TOML configuration; errors name the Persona and the key; tokens are
//!   [`config::Secret`]s read from private files or systemd credentials.
//! - [`inbox`]: the durable sled inbox (one transaction per sync response, seqs, acks, receipts).
//!
//! The Matrix ear and mouth and the per-Persona tasks arrive with issues 3 and 4.
#![forbid(unsafe_code)]
#![warn(missing_docs, unreachable_pub)]

pub mod config;
pub mod ear;
pub mod endpoint;
pub mod event;
pub mod inbox;
pub mod matrix;
pub mod mouth;
pub mod turns;
