//! What Linux says of a process (`/proc`): its resident memory and its children, for the tests
//! and benchmarks that bound or measure them.

/// `pid`'s resident set (VmRSS) in KiB; 0 when it cannot be read.
pub fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// The processes whose parent is `parent` (a gateway's live claude processes), each with its
/// resident set in KiB.
pub fn children(parent: u32) -> Vec<(u32, u64)> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            // "pid (comm) state ppid ...": comm may hold spaces, so read after its ')'.
            std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .ok()
                .and_then(|stat| {
                    stat.rsplit_once(')')?
                        .1
                        .split_whitespace()
                        .nth(1)?
                        .parse::<u32>()
                        .ok()
                })
                == Some(parent)
        })
        .map(|pid| (pid, rss_kib(pid)))
        .collect()
}

/// Watches a process's children from a thread of its own, every 100 ms, until stopped: the
/// most seen at once and every child's resident set sampled (KiB).
#[derive(Debug)]
pub struct Watch {
    on: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: std::thread::JoinHandle<(usize, Vec<u64>)>,
}

impl Watch {
    /// Starts watching `parent`'s children.
    pub fn children_of(parent: u32) -> Self {
        let on = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
        let watching = on.clone();
        let thread = std::thread::spawn(move || {
            let (mut peak, mut rss) = (0usize, Vec::new());
            while watching.load(std::sync::atomic::Ordering::Relaxed) {
                let now = children(parent);
                peak = peak.max(now.len());
                rss.extend(now.iter().map(|(_, kib)| *kib).filter(|kib| *kib > 0));
                std::thread::sleep(std::time::Duration::from_millis(100));
            }
            (peak, rss)
        });
        Self { on, thread }
    }

    /// Stops: the most children seen at once, and their mean resident set in MiB.
    pub fn stop(self) -> (usize, f64) {
        self.on.store(false, std::sync::atomic::Ordering::Relaxed);
        let (peak, rss) = self.thread.join().unwrap_or_default();
        let mean = rss.iter().sum::<u64>() as f64 / rss.len().max(1) as f64 / 1024.0;
        (peak, mean)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_child_is_found_with_its_memory() {
        let mut child = std::process::Command::new("sleep")
            .arg("5")
            .spawn()
            .expect("sleep");
        let me = std::process::id();
        let watch = Watch::children_of(me);
        std::thread::sleep(std::time::Duration::from_millis(250));
        let found = children(me);
        let _ = child.kill();
        let _ = child.wait();
        let mine = found.iter().find(|(pid, _)| *pid == child.id());
        assert!(mine.is_some_and(|(_, kib)| *kib > 0), "{found:?}");
        let (peak, mib) = watch.stop();
        assert!(peak >= 1 && mib > 0.0, "{peak} children, {mib} MiB");
        assert!(rss_kib(me) > 0);
        assert_eq!(rss_kib(u32::MAX), 0);
    }
}
