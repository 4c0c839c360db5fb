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

/// A new session id in UUID form (the CLI insists on one for `--session-id`), unique per call
/// within and across processes.
pub fn new_session_id() -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    let n = N.fetch_add(1, Ordering::Relaxed) as u128;
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or_default();
    let x = t ^ ((std::process::id() as u128) << 64) ^ (n << 96);
    let h = format!("{x:032x}");
    format!(
        "{}-{}-4{}-8{}-{}",
        &h[0..8],
        &h[8..12],
        &h[13..16],
        &h[17..20],
        &h[20..32]
    )
}
