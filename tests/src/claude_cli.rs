//! Where the pinned claude CLI is: installed on first use by the project's own script.

use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;

/// The executable of the pinned CLI, installing it if needed (`deploy/install-claude-cli.sh`).
/// Panics with the script's message when it cannot be installed: the tests need the real CLI.
pub fn executable() -> PathBuf {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| {
        let script = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../deploy/install-claude-cli.sh"
        );
        let out = Command::new("bash")
            .arg(script)
            .output()
            .expect("running install-claude-cli.sh");
        assert!(
            out.status.success(),
            "install-claude-cli.sh failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        PathBuf::from(String::from_utf8_lossy(&out.stdout).trim())
    })
    .clone()
}
