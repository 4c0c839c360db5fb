//! What the gateway's benchmarks share: deliveries shaped like real ones, scratch directories.

use wire::docs::{ContextLine, Delivery};

/// Sync response `r` of 100 deliveries: ~200 bytes of text and 5 context lines each (~700
/// bytes encoded), event ids unique per response.
pub fn response(r: u64) -> Vec<Delivery> {
    let context: Vec<ContextLine> = (0..5)
        .map(|i| ContextLine {
            event_id: format!("$ctx{i}"),
            sender: "@bo:localhost".into(),
            sender_name: None,
            ts: i,
            text: "an earlier line of the room, about as long as chat usually is".into(),
        })
        .collect();
    (0..100)
        .map(|i| Delivery {
            event_id: format!("$ev{r}-{i}"),
            room_id: "!lobby:localhost".into(),
            sender: "@ada:localhost".into(),
            text: "x".repeat(200),
            context: context.clone(),
            ..Delivery::default()
        })
        .collect()
}

/// A count from the environment variable `name`, or `default` when unset or not a number.
pub fn env_count(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// A benchmark's inbox path inside a temporary directory that is removed, with the inbox's lock
/// file beside it, when this is dropped.
pub struct Scratch {
    _root: tempfile::TempDir,
    /// Where the inbox goes (not created yet).
    pub path: std::path::PathBuf,
}

/// A fresh [`Scratch`] named for the measurement.
pub fn scratch(name: &str) -> Scratch {
    let root = tempfile::Builder::new()
        .prefix(&format!("cultnet-bench-{name}-"))
        .tempdir()
        .expect("a temporary directory");
    let path = root.path().join(name);
    Scratch { _root: root, path }
}
