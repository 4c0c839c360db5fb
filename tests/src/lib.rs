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
//! - [`procfs`]: a process's resident memory and its children, from `/proc`.
//! - [`ScratchDir`]: a test's directory, removed when the test passes, kept when it fails.
#![forbid(unsafe_code)]
#![warn(missing_docs, unreachable_pub)]

pub mod claude_cli;
pub mod fault_proxy;
pub mod legacy;
pub mod live;
pub mod matrix;
pub mod mock_api;
pub mod procfs;
pub mod synapse;
pub mod workload;

/// A test's (or benchmark's) scratch directory, `cultnet-NAME-XXXX` under the system's
/// temporary directory. Dropped after a passing test it is removed with everything in it (a
/// homeserver's database, a gateway's state); dropped while the test panics it is kept, and
/// its path printed, for the post-mortem.
#[derive(Debug)]
pub struct ScratchDir(Option<tempfile::TempDir>);

impl ScratchDir {
    /// A new, empty directory named for the test.
    pub fn new(name: &str) -> Self {
        let dir = tempfile::Builder::new()
            .prefix(&format!("cultnet-{name}-"))
            .tempdir()
            .expect("a temporary directory");
        Self(Some(dir))
    }

    /// Its path.
    pub fn path(&self) -> &std::path::Path {
        self.0
            .as_ref()
            .map_or(std::path::Path::new(""), |d| d.path())
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        if let (true, Some(dir)) = (std::thread::panicking(), self.0.take()) {
            eprintln!(
                "test failed: its files are kept in {}",
                dir.keep().display()
            );
        }
    }
}

#[cfg(test)]
mod scratch_tests {
    use super::ScratchDir;

    #[test]
    fn a_passing_test_leaves_nothing_and_a_failing_one_keeps_its_files() {
        let passed = ScratchDir::new("scratch-pass");
        let path = passed.path().to_path_buf();
        std::fs::write(path.join("f"), "x").unwrap();
        drop(passed);
        assert!(!path.exists(), "{} is left behind", path.display());

        let kept = std::thread::spawn(|| {
            let failing = ScratchDir::new("scratch-fail");
            let path = failing.path().to_path_buf();
            std::fs::write(path.join("f"), "x").unwrap();
            std::panic::panic_any(path);
        })
        .join()
        .expect_err("the thread panics");
        let path = kept
            .downcast_ref::<std::path::PathBuf>()
            .expect("the panic carries the path")
            .clone();
        assert!(path.join("f").exists(), "a failing test's files are gone");
        std::fs::remove_dir_all(&path).unwrap();
    }
}
