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
        let found = children(me);
        let _ = child.kill();
        let _ = child.wait();
        let mine = found.iter().find(|(pid, _)| *pid == child.id());
        assert!(mine.is_some_and(|(_, kib)| *kib > 0), "{found:?}");
        assert!(rss_kib(me) > 0);
        assert_eq!(rss_kib(u32::MAX), 0);
    }
}
