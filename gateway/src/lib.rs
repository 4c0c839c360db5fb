//! The CultNet Matrix gateway: the I/O edges around the sans-IO `wire` and `session` crates.
//!
//! - [`endpoint`]: the one owner of the loopback CultNet UDP socket, driving a [`wire::hub::Hub`]
//!   with real datagrams (batched with GSO/GRO where the kernel offers them) and tokio's clock.
//!
//! - [`clock`]: the one wall clock (ms since the epoch).
//! - [`config`]: the TOML configuration; errors name the Persona and the key; tokens are
//!   [`config::Secret`]s read from private files or systemd credentials.
//! - [`inbox`]: the durable sled inbox (one batch per sync response, seqs, acks, receipts).
//! - [`matrix`]: a Persona's matrix-sdk client, its store checks and the retry rules;
//!   [`identity`]: her cross-signing, key backup and recovery key, and `recover`.
//! - [`ear`]: her sync loop; [`event`]: events -> deliveries (pure); [`mouth`]: her sends;
//!   [`media`]: images and text files in her batches, fetched when her turn is composed.
//! - [`turns`]: her live session's turn loop; [`processes`]: the gateway-wide cap on live
//!   claude processes (the least recently used idle one makes room).
//! - [`service`]: what CultNet clients ask of the gateway, and its answers; [`client`]: the
//!   other side, for tools and tests; [`quic`]: the same service for remote peers over QUIC;
//!   [`answers`]: a remote connection's bounded queue of answers, between the two.
#![forbid(unsafe_code)]
#![warn(missing_docs, unreachable_pub)]

pub mod answers;
pub mod check;
pub mod client;
pub mod clock;
pub mod config;
pub mod ear;
pub mod endpoint;
pub mod event;
pub mod exporter;
pub mod identity;
pub mod inbox;
pub mod markdown;
pub mod matrix;
pub mod media;
pub mod metrics;
pub mod mouth;
pub mod processes;
pub mod quic;
pub mod report;
pub mod service;
pub mod turns;

/// Scratch directories for the library's tests: everything a test writes (an inbox and the
/// lock file beside it) lives in one temporary directory, removed when the test ends.
#[cfg(test)]
pub(crate) mod scratch {
    use std::path::{Path, PathBuf};

    /// A temporary directory, and the path inside it a test works at.
    #[derive(Debug)]
    pub(crate) struct Dir {
        _root: tempfile::TempDir,
        path: PathBuf,
    }

    impl Dir {
        /// `cultnet-NAME-XXXX/NAME` under the system's temporary directory; the inner path
        /// does not exist yet.
        pub(crate) fn new(name: &str) -> Self {
            let root = tempfile::Builder::new()
                .prefix(&format!("cultnet-{name}-"))
                .tempdir()
                .expect("a temporary directory");
            let path = root.path().join(name);
            Self { _root: root, path }
        }
    }

    impl std::ops::Deref for Dir {
        type Target = Path;
        fn deref(&self) -> &Path {
            &self.path
        }
    }

    impl AsRef<Path> for Dir {
        fn as_ref(&self) -> &Path {
            &self.path
        }
    }
}
