//! Compaction: giving back the disk of what the inbox no longer holds.
//!
//! sled 0.34 does not return the space of removed records: with every delivery acknowledged
//! (its chunk removed) and the id index pruned, the files still grow by ~340 bytes per delivery
//! ever stored (README, inbox benchmark). So when the files are many times the live records,
//! [`Inbox::compact`] copies the live records into a fresh database and swaps it in, while the
//! gateway runs: it holds the inbox's write lock for the copy, so no operation is split by it
//! and none is lost (the copy reads what is in memory, flushed or not, and is flushed before it
//! counts).
//!
//! On disk, next to the inbox directory `I`:
//! 1. the copy is built in `I.compacting`, flushed, and its database closed;
//! 2. the marker file `I.compacted` says the copy is complete (synced);
//! 3. the old database is closed (and its lock seen released: sled finishes on a thread of its
//!    own, and still finds its blobs by path), `I` is renamed `I.old`, `I.compacting` is
//!    renamed `I`, the copy is opened there;
//! 4. the marker and `I.old` are removed.
//!
//! `recover` (run before every open, under the inbox's lock file) finishes or undoes a crash
//! at any of those points: a copy without the marker is removed; with the marker, a missing `I`
//! is the copy renamed in, and an `I.old` beside a present `I` and no copy is removed; without
//! it, an `I.old` beside `I` is removed (only its removal was left) and an `I.old` alone is
//! renamed back (a failed swap could not restore it). Tested for each.

use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::{Inbox, InboxError, Stores};

/// When [`Inbox::compact_if_wasteful`] compacts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CompactWhen {
    /// Files smaller than this are left alone (a copy costs more than it gives back).
    pub min_bytes: u64,
    /// Compact when the files are at least this many times the live records.
    pub ratio: u64,
    /// Not while more than this is live (a large backlog not yet acknowledged): the copy holds
    /// the inbox, and everyone waiting on it, for as long as it takes.
    pub max_live_bytes: u64,
}

impl From<&crate::config::RetentionConfig> for CompactWhen {
    /// When `[retention]` compacts the inbox.
    fn from(r: &crate::config::RetentionConfig) -> Self {
        Self {
            min_bytes: u64::from(r.compact_above_mib) << 20,
            ..Self::default()
        }
    }
}

impl Default for CompactWhen {
    fn default() -> Self {
        Self {
            min_bytes: 64 << 20,
            ratio: 4,
            max_live_bytes: 32 << 20,
        }
    }
}

/// What one compaction did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Compacted {
    /// Bytes of the inbox's files before.
    pub before: u64,
    /// Bytes after.
    pub after: u64,
    /// Bytes of keys and values copied.
    pub live: u64,
    /// Records copied.
    pub records: u64,
    /// How long the inbox was held (no operation ran meanwhile).
    pub held: Duration,
}

/// How long a compaction waits for the operations in progress to end.
const WRITE_WAIT: Duration = Duration::from_secs(30);

/// How long a compaction waits for sled to let go of a database it closed.
const RELEASE_WAIT: Duration = Duration::from_secs(10);

/// The paths a compaction uses beside the inbox directory (see the module's doc).
struct Siblings {
    copy: PathBuf,
    marker: PathBuf,
    old: PathBuf,
}

impl Siblings {
    fn of(path: &Path) -> Self {
        Self {
            copy: sibling(path, ".compacting"),
            marker: sibling(path, ".compacted"),
            old: sibling(path, ".old"),
        }
    }
}

fn sibling(path: &Path, suffix: &str) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(suffix);
    path.with_file_name(name)
}

fn io(what: &str, path: &Path) -> impl FnOnce(std::io::Error) -> InboxError {
    let what = format!("{what} {}", path.display());
    move |source| InboxError::Io { what, source }
}

/// Bytes of the files under `path` (0 if it cannot be read).
pub fn bytes_under(path: &Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(path) else {
        return 0;
    };
    entries
        .flatten()
        .map(|e| match e.file_type() {
            Ok(t) if t.is_dir() => bytes_under(&e.path()),
            _ => e.metadata().map_or(0, |m| m.len()),
        })
        .sum()
}

/// Takes the inbox's own lock file, `<inbox>.lock` (created with its directory if missing).
pub(super) fn lock(path: &Path) -> Result<std::fs::File, InboxError> {
    let lock = sibling(path, ".lock");
    if let Some(parent) = lock.parent() {
        std::fs::create_dir_all(parent).map_err(io("creating", parent))?;
    }
    let file = std::fs::File::options()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&lock)
        .map_err(io("opening", &lock))?;
    match file.try_lock() {
        Ok(()) => Ok(file),
        Err(std::fs::TryLockError::WouldBlock) => Err(InboxError::Locked {
            path: path.display().to_string(),
        }),
        Err(std::fs::TryLockError::Error(e)) => Err(io("locking", &lock)(e)),
    }
}

/// Finishes or undoes a compaction a crash interrupted (see the module's doc).
pub(super) fn recover(path: &Path) -> Result<(), InboxError> {
    let Siblings { copy, marker, old } = Siblings::of(path);
    if marker.exists() {
        if !path.exists() {
            let from = if copy.exists() { &copy } else { &old };
            std::fs::rename(from, path).map_err(io("restoring the inbox from", from))?;
            tracing::warn!(from = %from.display(), "inbox compaction finished after a crash");
        }
        if copy.exists() {
            // The swap had not begun: `path` is the original.
            remove_dir(&copy)?;
        } else if old.exists() {
            remove_dir(&old)?;
        }
        std::fs::remove_file(&marker).map_err(io("removing", &marker))?;
    } else {
        if copy.exists() {
            remove_dir(&copy)?;
            tracing::warn!("an interrupted inbox compaction was discarded");
        }
        if old.exists() {
            if path.exists() {
                // The swap was done; only the old files' removal was not.
                remove_dir(&old)?;
            } else {
                // A failed swap could not put the original back.
                std::fs::rename(&old, path).map_err(io("restoring the inbox from", &old))?;
                tracing::warn!("the inbox was restored after a failed compaction");
            }
        }
    }
    Ok(())
}

fn remove_dir(path: &Path) -> Result<(), InboxError> {
    std::fs::remove_dir_all(path).map_err(io("removing", path))
}

fn sync_dir(path: &Path) -> Result<(), InboxError> {
    std::fs::File::open(path)
        .and_then(|d| d.sync_all())
        .map_err(io("syncing", path))
}

/// Waits until no process (this one's closed sled included) holds the database lock of the
/// sled directory `path`: sled takes an exclusive `flock` on its `db` file.
fn wait_released(path: &Path) -> Result<(), InboxError> {
    let db = path.join("db");
    let deadline = Instant::now() + RELEASE_WAIT;
    loop {
        let file = std::fs::File::open(&db).map_err(io("opening", &db))?;
        match file.try_lock() {
            Ok(()) => return Ok(()),
            Err(std::fs::TryLockError::WouldBlock) if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(10));
            }
            Err(std::fs::TryLockError::WouldBlock) => {
                return Err(InboxError::Io {
                    what: format!("waiting for sled to release {}", db.display()),
                    source: std::io::ErrorKind::TimedOut.into(),
                })
            }
            Err(std::fs::TryLockError::Error(e)) => return Err(io("locking", &db)(e)),
        }
    }
}

/// Copies every tree of `from` into a new database at `to`; returns the bytes and records.
fn copy_into(from: &Stores, to: &Path) -> Result<(u64, u64), InboxError> {
    let fresh = Stores::open(to)?;
    let (mut bytes, mut records) = (0u64, 0u64);
    for name in from.db.tree_names() {
        let (src, dst) = (from.db.open_tree(&name)?, fresh.db.open_tree(&name)?);
        let mut batch = sled::Batch::default();
        for (n, item) in src.iter().enumerate() {
            let (k, v) = item?;
            bytes += (k.len() + v.len()) as u64;
            records += 1;
            batch.insert(k, v);
            if n % 1024 == 1023 {
                dst.apply_batch(std::mem::take(&mut batch))?;
            }
        }
        dst.apply_batch(batch)?;
    }
    fresh.db.flush()?;
    Ok((bytes, records))
}

/// Bytes of keys and values in every tree.
fn live_bytes(s: &Stores) -> Result<u64, InboxError> {
    let mut bytes = 0u64;
    for name in s.db.tree_names() {
        for item in s.db.open_tree(&name)?.iter() {
            let (k, v) = item?;
            bytes += (k.len() + v.len()) as u64;
        }
    }
    Ok(bytes)
}

impl Inbox {
    /// Bytes of the inbox's files on disk.
    pub fn disk_bytes(&self) -> u64 {
        bytes_under(&self.path)
    }

    /// Compacts when the files are at least `when.min_bytes` and `when.ratio` times the live
    /// records, and those are at most `when.max_live_bytes`. The live records are counted (a
    /// scan) only once the files have doubled since the last count or compaction, so a
    /// periodic call is cheap. `None`: nothing to do.
    pub fn compact_if_wasteful(&self, when: CompactWhen) -> Result<Option<Compacted>, InboxError> {
        let disk = self.disk_bytes();
        if disk < when.min_bytes || disk < self.baseline.load(Ordering::Relaxed).saturating_mul(2) {
            return Ok(None);
        }
        let live = live_bytes(&*self.stores()?)?;
        if disk < live.saturating_mul(when.ratio) || live > when.max_live_bytes {
            if live > when.max_live_bytes {
                tracing::info!(
                    live,
                    disk,
                    "inbox not compacted: too much is live (a backlog waiting for its ack)"
                );
            }
            self.baseline.store(disk, Ordering::Relaxed);
            return Ok(None);
        }
        self.compact().map(Some)
    }

    /// Copies the live records into a fresh database and swaps it in (see the module's doc).
    /// Every other operation waits meanwhile (one waiting on a runtime worker hands the worker's
    /// other tasks on first); the compaction itself blocks its thread for the copy, so the
    /// gateway runs it with `spawn_blocking`. On failure the inbox goes on with the store it
    /// had, except if the copy was swapped in and cannot be opened: then it reports
    /// [`InboxError::Closed`] until restarted, and the next open recovers the files.
    pub fn compact(&self) -> Result<Compacted, InboxError> {
        let path = self.path.as_path();
        let Siblings { copy, marker, old } = Siblings::of(path);
        let parent = path.parent().unwrap_or(Path::new("."));
        // Readers take the lock recursively and so may pass a waiting compaction: it gives up
        // (to try again at the next check) rather than wait without end.
        let mut guard = self
            .stores
            .try_write_for(WRITE_WAIT)
            .ok_or_else(|| InboxError::Io {
                what: "waiting for the inbox to be free for a compaction".into(),
                source: std::io::ErrorKind::TimedOut.into(),
            })?;
        let started = Instant::now();
        let Some(current) = guard.as_ref() else {
            return Err(InboxError::Closed);
        };
        current.db.flush()?;
        let before = bytes_under(path);
        // Left by an attempt that failed before its swap (the original was kept).
        if marker.exists() {
            std::fs::remove_file(&marker).map_err(io("removing", &marker))?;
        }
        if copy.exists() {
            remove_dir(&copy)?;
        }
        let copied = copy_into(current, &copy)
            .and_then(|n| {
                wait_released(&copy)?;
                Ok(n)
            })
            .and_then(|n| {
                std::fs::File::create(&marker)
                    .and_then(|f| f.sync_all())
                    .map_err(io("creating", &marker))?;
                sync_dir(parent)?;
                Ok(n)
            });
        let (live, records) = match copied {
            Ok(n) => n,
            Err(e) => {
                let _ = std::fs::remove_file(&marker);
                let _ = std::fs::remove_dir_all(&copy);
                return Err(e);
            }
        };
        // Closed from here on: nothing may write to the original once the copy is taken.
        drop(guard.take());
        let swapped = wait_released(path)
            .and_then(|()| std::fs::rename(path, &old).map_err(io("renaming", path)))
            .and_then(|()| {
                std::fs::rename(&copy, path)
                    .map_err(io("renaming", &copy))
                    .inspect_err(|_| {
                        let _ = std::fs::rename(&old, path);
                    })
            })
            .and_then(|()| sync_dir(parent));
        if let Err(e) = swapped {
            // The original is still (or again) at `path`, or (if even putting it back failed)
            // at `old`, where the next open finds it: drop the copy, open what is there.
            let _ = std::fs::remove_file(&marker);
            let _ = std::fs::remove_dir_all(&copy);
            if path.exists() {
                *guard = Some(Stores::open(path)?);
            } else {
                tracing::error!(
                    "an inbox compaction failed and could not put the inbox back ({e}); it is \
                     closed until a restart, whose open restores it"
                );
            }
            return Err(e);
        }
        match Stores::open(path) {
            Ok(s) => *guard = Some(s),
            Err(e) => {
                tracing::error!(
                    "the compacted inbox at {} does not open ({e}); the inbox is closed until a \
                     restart, whose open recovers the files",
                    path.display()
                );
                return Err(e.into());
            }
        }
        drop(guard);
        let held = started.elapsed();
        // The swap is done; what is left to remove, a crash or a failure here leaves for the
        // next open's recovery (marker and `old` beside the new `path`: `old` goes) or the next
        // compaction (a stale marker). Neither makes this compaction fail.
        if let Err(e) = std::fs::remove_file(&marker).map_err(io("removing", &marker)) {
            tracing::warn!("the inbox was compacted, but its marker stays: {e}");
        }
        if let Err(e) = remove_dir(&old) {
            tracing::warn!("the inbox was compacted, but its old files stay: {e}");
        }
        let after = bytes_under(path);
        self.baseline.store(after, Ordering::Relaxed);
        Ok(Compacted {
            before,
            after,
            live,
            records,
            held,
        })
    }
}

#[cfg(test)]
mod tests;
