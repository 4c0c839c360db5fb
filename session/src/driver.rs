//! Drives one long-lived claude CLI process over stream-json.
//!
//! The process gets piped stdio, an environment built from an explicit allow-list (nothing of
//! the gateway's own environment leaks in: no Matrix tokens), its own config and working
//! directories, `--bare` (no injected reminders), the CLI's auto-compaction off (the policy
//! decides), tools off, and the reply schema. Readiness is the answer to an `initialize`
//! control request. One batch is sent at a time and its `result` awaited: lines sent during a
//! turn would be merged into one next turn.
//!
//! # Caveats
//! A turn that outlives its timeout is interrupted; if no result follows within the grace
//! period the process is killed and [`DriverError::TimedOut`] returned; the session can be
//! resumed with `--resume`. Dropping a [`Cli`] kills the process (`kill_on_drop`).

use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, Instant};

use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader, Lines};
use tokio::process::{Child, ChildStdin, ChildStdout, Command};
use tracing::{debug, warn};

use crate::cost::{Ttl, Usage};
use crate::proto::{self, Event, ResultEvent};

/// How to start the CLI. Its `Debug` leaves the API key out.
#[derive(Clone)]
pub struct CliConfig {
    /// The `claude` executable.
    pub exe: PathBuf,
    /// Model name.
    pub model: String,
    /// System prompt file (the doctrine).
    pub system_prompt_file: PathBuf,
    /// JSON Schema of the reply.
    pub json_schema: String,
    /// Private `CLAUDE_CONFIG_DIR` (and `HOME`) for this Persona.
    pub config_dir: PathBuf,
    /// Working directory for this Persona.
    pub work_dir: PathBuf,
    /// Messages API base URL (`ANTHROPIC_BASE_URL`).
    pub api_base_url: String,
    /// How the CLI authenticates to the model API (the model's, never a Matrix token).
    pub credential: Credential,
    /// Cache TTL the CLI asks for.
    pub cache_ttl: Ttl,
    /// Extended thinking on or off.
    pub thinking: bool,
    /// Start a new session with this id, or resume it when `resume` is set.
    pub session_id: Option<String>,
    /// Resume `session_id` instead of starting it.
    pub resume: bool,
    /// On resume, use the current system prompt file instead of the recorded one.
    pub system_prompt_changed: bool,
    /// Cap on the CLI's own API retries (`CLAUDE_CODE_MAX_RETRIES`; its default of 10 takes
    /// about 3 minutes of backoff).
    pub max_retries: Option<u32>,
    /// Longest a turn may run before it is interrupted.
    pub turn_timeout: Duration,
    /// Wait this long for the interrupted turn's result, or for readiness, before killing.
    pub grace: Duration,
}

impl std::fmt::Debug for CliConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CliConfig")
            .field("exe", &self.exe)
            .field("model", &self.model)
            .field("system_prompt_file", &self.system_prompt_file)
            .field("config_dir", &self.config_dir)
            .field("api_base_url", &self.api_base_url)
            .field("credential", &self.credential)
            .field("cache_ttl", &self.cache_ttl)
            .field("session_id", &self.session_id)
            .field("resume", &self.resume)
            .finish_non_exhaustive()
    }
}

/// How the CLI authenticates to the model API. Neither secret reaches a log or the CLI's argv;
/// an OAuth token does not reach its environment either.
#[derive(Clone)]
pub enum Credential {
    /// An API key, as `ANTHROPIC_API_KEY` in the child's environment (built from an explicit
    /// allow-list, never the gateway's own).
    ApiKey(String),
    /// A subscription OAuth token (the main conversation's 1-hour cache TTL depends on a
    /// subscription), handed over on file descriptor 3 through a pipe
    /// (`CLAUDE_CODE_OAUTH_TOKEN_FILE_DESCRIPTOR=3`; the CLI reads it and drops the variable).
    /// `--bare` accepts only API keys, so with this credential the CLI runs without it and adds
    /// its own reminder blocks (environment, model, date) to user messages.
    OAuth(String),
}

impl std::fmt::Debug for Credential {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::ApiKey(_) => f.write_str("ApiKey(<redacted>)"),
            Self::OAuth(_) => f.write_str("OAuth(<redacted>)"),
        }
    }
}

/// The file descriptor an OAuth token is handed over on.
pub const OAUTH_FD: i32 = 3;

/// What can go wrong driving the CLI.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DriverError {
    /// The process could not be started.
    #[error("starting the claude CLI {exe}: {source}")]
    Spawn {
        /// Executable.
        exe: PathBuf,
        /// OS error.
        source: std::io::Error,
    },
    /// It did not answer the `initialize` control request in time.
    #[error("the claude CLI did not become ready within {0:?}")]
    NotReady(Duration),
    /// It exited (or closed stdout) mid-conversation.
    #[error("the claude CLI exited: {0}")]
    Exited(String),
    /// Writing to its stdin failed.
    #[error("writing to the claude CLI: {0}")]
    Write(std::io::Error),
    /// A turn outlived its timeout and the interrupt did not end it; the process was killed.
    #[error("the turn did not finish within {0:?}; the CLI was killed")]
    TimedOut(Duration),
}

/// One finished turn.
#[derive(Debug, Clone)]
pub struct Turn {
    /// The `result` event.
    pub result: ResultEvent,
    /// `system/api_retry` events seen during the turn.
    pub retries: u32,
    /// The conversation was reset (a slash command ran): must never happen.
    pub reset: bool,
    /// The conversation was compacted during the turn: what the boundary reported.
    pub compacted: Option<proto::CompactMetadata>,
    /// When the turn's last request to the API began, as near as the driver can tell and
    /// never later: the turn's input written, or the tool result (or `api_retry`) after which
    /// the CLI sent it. The cache entry it read lives a TTL from its read, not from the turn's
    /// end (which comes after the whole reply has streamed).
    pub last_request_at: Instant,
    /// What the turn's last request reported when its answer began (its prompt as sent: the
    /// conversation's size). The result's `usage` adds up every request of the turn, so
    /// after a reply bounced by the schema it counts the conversation twice.
    pub last_request: Option<Usage>,
    /// The cache reads of each of the turn's requests before the last (a reply bounced by the
    /// schema is asked for again): each read the conversation, which ski rental's rent counts.
    pub earlier_reads: Vec<u64>,
}

/// Who compacts a conversation that outgrows the window.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Compaction {
    /// The gateway's policy (the CLI's auto-compaction off): every live process.
    Policy,
    /// The CLI by itself, its default: what a harness that runs it per turn gets.
    Cli,
}

/// The command line and environment every CLI run shares (see the module docs). An OAuth
/// token is written into a pipe whose read end becomes the child's fd [`OAUTH_FD`].
/// The CLI's temporary directory: `tmp` in her config directory.
fn tmp_dir(cfg: &CliConfig) -> PathBuf {
    cfg.config_dir.join("tmp")
}

/// Her private directories, made before a run (the CLI wants its temporary one 0700).
fn make_dirs(cfg: &CliConfig) -> std::io::Result<()> {
    std::fs::create_dir_all(&cfg.config_dir)?;
    std::fs::create_dir_all(&cfg.work_dir)?;
    let tmp = tmp_dir(cfg);
    std::fs::create_dir_all(&tmp)?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o700))?;
    }
    Ok(())
}

fn command(cfg: &CliConfig) -> Result<Command, DriverError> {
    command_with(cfg, Compaction::Policy)
}

fn command_with(cfg: &CliConfig, compaction: Compaction) -> Result<Command, DriverError> {
    let mut cmd = Command::new(&cfg.exe);
    cmd.args(["-p", "--output-format", "stream-json", "--verbose"]);
    if matches!(cfg.credential, Credential::ApiKey(_)) {
        cmd.arg("--bare");
    }
    cmd.arg("--model")
        .arg(&cfg.model)
        .arg("--system-prompt-file")
        .arg(&cfg.system_prompt_file)
        .arg("--json-schema")
        .arg(&cfg.json_schema)
        .args(["--tools", ""]);
    if compaction == Compaction::Policy {
        cmd.args(["--settings", r#"{"autoCompactEnabled":false}"#]);
    }
    cmd.env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("HOME", &cfg.config_dir)
        .env("CLAUDE_CONFIG_DIR", &cfg.config_dir)
        // Its temporary files (the images of her batches, decrypted, among them) in her own
        // private directory, not a shared /tmp/claude-UID.
        .env("CLAUDE_CODE_TMPDIR", tmp_dir(cfg))
        .env("ANTHROPIC_BASE_URL", &cfg.api_base_url)
        .env("CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC", "1")
        .env("DISABLE_TELEMETRY", "1")
        .env("DISABLE_ERROR_REPORTING", "1")
        .env("DISABLE_AUTOUPDATER", "1");
    if compaction == Compaction::Policy {
        cmd.env("DISABLE_AUTO_COMPACT", "1");
    }
    if cfg.cache_ttl == Ttl::OneHour {
        cmd.env("CLAUDE_CODE_PROMPT_CACHE_TTL", "1h");
    }
    if !cfg.thinking {
        cmd.env("MAX_THINKING_TOKENS", "0");
    }
    if let Some(n) = cfg.max_retries {
        cmd.env("CLAUDE_CODE_MAX_RETRIES", n.to_string());
    }
    match &cfg.credential {
        Credential::ApiKey(key) => {
            cmd.env("ANTHROPIC_API_KEY", key);
        }
        Credential::OAuth(token) => {
            use command_fds::{CommandFdExt, FdMapping};
            use std::io::Write;
            let spawn_err = |source| DriverError::Spawn {
                exe: cfg.exe.clone(),
                source,
            };
            let (reader, mut writer) = std::io::pipe().map_err(spawn_err)?;
            // A token is far smaller than a pipe's buffer: this never blocks.
            writeln!(writer, "{token}").map_err(spawn_err)?;
            drop(writer);
            cmd.fd_mappings(vec![FdMapping {
                parent_fd: reader.into(),
                child_fd: OAUTH_FD,
            }])
            .map_err(|e| spawn_err(std::io::Error::other(e.to_string())))?;
            cmd.env(
                "CLAUDE_CODE_OAUTH_TOKEN_FILE_DESCRIPTOR",
                OAUTH_FD.to_string(),
            );
        }
    }
    cmd.current_dir(&cfg.work_dir)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true);
    die_with_parent(&mut cmd);
    Ok(cmd)
}

/// Makes the child die with the process that spawns it, however that one ends. `kill_on_drop`
/// covers every end but `kill -9` (or a crash): then a claude process lived on, finished its
/// turn, wrote it into her session's transcript and stayed, so the restarted gateway's retry
/// of the same batch showed it to her twice (and two processes held one transcript).
///
/// Linux sends the parent-death signal when the *thread* that spawned the child exits, and a
/// tokio thread may exit long before the process (`block_in_place`, which the inbox's flushes
/// use, hands a worker's thread to the blocking pool, which ends it after 10 s idle: her idle
/// process was killed with it). So every child is spawned by [`spawn`] from one thread that
/// lives as long as the process.
#[cfg(target_os = "linux")]
#[allow(unsafe_code)]
fn die_with_parent(cmd: &mut Command) {
    let parent = std::process::id();
    // SAFETY: the closure runs in the forked child before exec; it only makes two
    // async-signal-safe system calls and builds an error without allocating.
    unsafe {
        cmd.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            // The parent died before the signal was asked for: nothing would send it now.
            if libc::getppid() as u32 != parent {
                return Err(std::io::Error::from_raw_os_error(libc::ESRCH));
            }
            Ok(())
        });
    }
}

/// Elsewhere only `kill_on_drop` holds.
#[cfg(not(target_os = "linux"))]
fn die_with_parent(_cmd: &mut Command) {}

/// Whether her session's transcript (`projects/*/SESSION.jsonl` under the CLI's config
/// directory) holds, in its last few MiB, a user message that starts with `header` (a
/// rendered batch's first line): what a process resuming the session will send the model. A
/// turn the CLI was killed in may or may not have reached it (its user message is written as
/// the turn starts, racing the kill), so the caller looks before it sends the turn's batch
/// again. Only the start of a user message counts: chat inside a batch may quote a header,
/// and must not make the gateway believe she was shown a batch she was not. An unreadable or
/// missing transcript holds nothing.
pub fn transcript_holds(cfg: &CliConfig, session_id: &str, header: &str) -> bool {
    transcript_tail(cfg, session_id)
        .is_some_and(|tail| opening_with(&tail, header).next().is_some())
}

/// The `uuid` of the last user message in her session's transcript (its last few MiB) that
/// starts with `header`: how a compaction's [`proto::Preserved`] names it, so the caller can
/// tell whether a compaction kept that message verbatim.
pub fn transcript_user_message(cfg: &CliConfig, session_id: &str, header: &str) -> Option<String> {
    let tail = transcript_tail(cfg, session_id)?;
    let uuid = opening_with(&tail, header)
        .filter_map(|v| v["uuid"].as_str().map(str::to_owned))
        .next();
    uuid
}

/// The user messages of a transcript's `tail` whose text starts with `header`, newest first.
fn opening_with<'a>(
    tail: &'a [u8],
    header: &'a str,
) -> impl Iterator<Item = serde_json::Value> + 'a {
    tail.rsplit(|&b| b == b'\n')
        // Most lines are not: only those holding the header are parsed.
        .filter(move |line| holds(line, header))
        .filter_map(|line| serde_json::from_slice::<serde_json::Value>(line).ok())
        .filter(|v| v["type"] == "user")
        .filter(move |v| user_text(v).is_some_and(|t| t.starts_with(header)))
}

/// The text a transcript's user line opens with: its content when that is a string, or its
/// first content block's text.
fn user_text(v: &serde_json::Value) -> Option<&str> {
    let content = &v["message"]["content"];
    content
        .as_str()
        .or_else(|| content.get(0)?.get("text")?.as_str())
}

/// Whether `bytes` hold `needle`.
fn holds(bytes: &[u8], needle: &str) -> bool {
    bytes
        .windows(needle.len().max(1))
        .any(|w| w == needle.as_bytes())
}

/// The last few MiB of her session's transcript, if it can be read.
fn transcript_tail(cfg: &CliConfig, session_id: &str) -> Option<Vec<u8>> {
    use std::io::{Read, Seek, SeekFrom};
    /// The tail read: a turn's batch is far smaller, and it is the last thing written.
    const TAIL: u64 = 4 << 20;
    let file = format!("{session_id}.jsonl");
    let projects = std::fs::read_dir(cfg.config_dir.join("projects")).ok()?;
    projects.flatten().find_map(|project| {
        let mut f = std::fs::File::open(project.path().join(&file)).ok()?;
        let len = f.metadata().map_or(0, |m| m.len());
        let mut tail = Vec::new();
        f.seek(SeekFrom::Start(len.saturating_sub(TAIL)))
            .and_then(|_| f.read_to_end(&mut tail))
            .ok()?;
        Some(tail)
    })
}

/// A spawn for the spawner thread: the command, the runtime the child belongs to (its reaper
/// and pipes), and where the child goes.
type SpawnJob = (
    Command,
    tokio::runtime::Handle,
    tokio::sync::oneshot::Sender<std::io::Result<Child>>,
);

/// Spawns `cmd` from the one thread that spawns every claude process (see
/// [`die_with_parent`]), which lives as long as the process; where that thread cannot be
/// started, from the calling thread.
async fn spawn(mut cmd: Command) -> std::io::Result<Child> {
    static SPAWNER: std::sync::OnceLock<Option<std::sync::mpsc::Sender<SpawnJob>>> =
        std::sync::OnceLock::new();
    let spawner = SPAWNER.get_or_init(|| {
        let (tx, rx) = std::sync::mpsc::channel::<SpawnJob>();
        std::thread::Builder::new()
            .name("claude-spawner".into())
            .spawn(move || {
                for (mut cmd, runtime, reply) in rx {
                    let _entered = runtime.enter();
                    // Never let one spawn end the thread every later spawn needs.
                    let spawned =
                        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| cmd.spawn()))
                            .unwrap_or_else(|_| Err(std::io::Error::other("spawning panicked")));
                    let _ = reply.send(spawned);
                }
            })
            .map_err(
                |e| warn!(error = %e, "no spawner thread; claude processes are spawned in place"),
            )
            .ok()
            .map(|_| tx)
    });
    let Some(spawner) = spawner else {
        return cmd.spawn();
    };
    let (reply, child) = tokio::sync::oneshot::channel();
    if let Err(std::sync::mpsc::SendError((mut cmd, _, _))) =
        spawner.send((cmd, tokio::runtime::Handle::current(), reply))
    {
        warn!("the spawner thread is gone; a claude process is spawned in place");
        return cmd.spawn();
    }
    child
        .await
        .map_err(|_| std::io::Error::other("the spawner thread is gone"))?
}

/// Keep-warm: one forked, unpersisted request on `session_id` (`--resume <id> --fork-session
/// --no-session-persistence`). It repeats the session's history byte for byte, so it reads and
/// refreshes the cache entry, and leaves the session's transcript untouched.
///
/// Each ping's text is new: a cache read refreshes only the entry it hits, the longest one,
/// and a repeated ping would hit the entry the previous refresh wrote (history + ping) and let
/// the conversation's own entry expire under it.
pub async fn refresh_fork(cfg: &CliConfig, session_id: &str) -> Result<ResultEvent, DriverError> {
    let mut cmd = command(cfg)?;
    let nonce = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    cmd.arg("--resume")
        .arg(session_id)
        .args(["--fork-session", "--no-session-persistence"])
        .arg(format!("keep-warm ping {nonce:x}"))
        .stdin(Stdio::null());
    run_once(cfg, cmd, None).await
}

/// One batch in a process of its own, the way a per-turn harness runs the CLI: `claude -p`
/// with `text` on stdin, starting `session_id` (or resuming it when `resume`), and with the
/// CLI's own auto-compaction as `compaction` says. The session benchmark's resume-per-turn
/// rival; the live session keeps one process instead.
pub async fn one_shot(
    cfg: &CliConfig,
    session_id: &str,
    resume: bool,
    text: &str,
    compaction: Compaction,
) -> Result<ResultEvent, DriverError> {
    let mut cmd = command_with(cfg, compaction)?;
    cmd.arg(if resume { "--resume" } else { "--session-id" })
        .arg(session_id);
    run_once(cfg, cmd, Some(text)).await
}

/// Runs a one-shot command to its end (feeding `stdin` if given) and returns its result.
async fn run_once(
    cfg: &CliConfig,
    mut cmd: Command,
    stdin: Option<&str>,
) -> Result<ResultEvent, DriverError> {
    let spawn_err = |source| DriverError::Spawn {
        exe: cfg.exe.clone(),
        source,
    };
    if stdin.is_some() {
        cmd.stdin(Stdio::piped());
    }
    make_dirs(cfg).map_err(spawn_err)?;
    let mut child = spawn(cmd).await.map_err(spawn_err)?;
    if let (Some(text), Some(mut pipe)) = (stdin, child.stdin.take()) {
        pipe.write_all(text.as_bytes()).await.map_err(spawn_err)?;
        drop(pipe);
    }
    let out = tokio::time::timeout(cfg.turn_timeout, child.wait_with_output())
        .await
        .map_err(|_| DriverError::TimedOut(cfg.turn_timeout))?
        .map_err(spawn_err)?;
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| proto::parse_line(l).ok().flatten())
        .find_map(|e| {
            if let Event::Result(r) = e {
                Some(r)
            } else {
                None
            }
        })
        .ok_or_else(|| {
            DriverError::Exited(format!(
                "one-shot run ended without a result ({})",
                out.status
            ))
        })
}

/// A running CLI process.
#[derive(Debug)]
pub struct Cli {
    child: Child,
    stdin: ChildStdin,
    lines: Lines<BufReader<ChildStdout>>,
    cfg: CliConfig,
    session_id: Option<String>,
    next_request: u64,
}

impl Cli {
    /// Spawns the CLI and waits until it answers `initialize`.
    pub async fn spawn(cfg: CliConfig) -> Result<Self, DriverError> {
        let mut cmd = command(&cfg)?;
        cmd.args(["--input-format", "stream-json"]);
        if let Some(id) = &cfg.session_id {
            if cfg.resume {
                cmd.arg("--resume").arg(id);
                if cfg.system_prompt_changed {
                    cmd.args(["--system-prompt-snapshot", "off"]);
                }
            } else {
                cmd.arg("--session-id").arg(id);
            }
        }
        let spawn_err = |source| DriverError::Spawn {
            exe: cfg.exe.clone(),
            source,
        };
        make_dirs(&cfg).map_err(spawn_err)?;
        let mut child = spawn(cmd).await.map_err(spawn_err)?;
        let (Some(stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else {
            return Err(DriverError::Exited("no stdio pipes".into()));
        };
        let mut cli = Self {
            child,
            stdin,
            lines: BufReader::new(stdout).lines(),
            session_id: cfg.session_id.clone(),
            cfg,
            next_request: 1,
        };
        let id = cli.control("initialize").await?;
        let grace = cli.cfg.grace.max(Duration::from_secs(10));
        let ready = tokio::time::timeout(grace, async {
            loop {
                match cli.next_event().await? {
                    // The answer names our request: {"response": {"request_id": id, ...}}.
                    Event::ControlResponse(v) if v["response"]["request_id"] == id.as_str() => {
                        return Ok(())
                    }
                    _ => {}
                }
            }
        })
        .await;
        match ready {
            Ok(r) => r.map(|()| cli),
            Err(_) => Err(DriverError::NotReady(grace)),
        }
    }

    /// The process id.
    pub fn pid(&self) -> Option<u32> {
        self.child.id()
    }

    /// The session id, once the CLI has reported it.
    pub fn session_id(&self) -> Option<&str> {
        self.session_id.as_deref()
    }

    /// Sends one user message and waits for its result.
    pub async fn turn(&mut self, text: &str) -> Result<Turn, DriverError> {
        self.turn_with(text, &[]).await
    }

    /// [`Cli::turn`] with images after the text (see [`proto::user_line_with`]).
    pub async fn turn_with(
        &mut self,
        text: &str,
        images: &[proto::Image],
    ) -> Result<Turn, DriverError> {
        let written = Instant::now();
        let line = if images.is_empty() {
            proto::user_line(text)
        } else {
            proto::user_line_with(text, images)
        };
        self.write(&line).await?;
        let timeout = self.cfg.turn_timeout;
        match tokio::time::timeout(timeout, self.until_result(written)).await {
            Ok(r) => r,
            Err(_) => {
                warn!(?timeout, "turn timed out; interrupting");
                self.control("interrupt").await?;
                match tokio::time::timeout(self.cfg.grace, self.until_result(written)).await {
                    // The interrupted turn ended with its (error) result; the process lives on.
                    Ok(Ok(turn)) => Ok(turn),
                    Ok(Err(_)) | Err(_) => {
                        let _ = self.child.kill().await;
                        Err(DriverError::TimedOut(timeout))
                    }
                }
            }
        }
    }

    /// Compacts the conversation with the CLI's own `/compact` (one summary request); the
    /// session id stays. This is the one user message the gateway ever starts with `/`: chat
    /// text always follows the batch header. Returns the turn; `compacted` is `None` when the
    /// CLI did not compact (then the caller starts fresh instead).
    pub async fn compact(&mut self) -> Result<Turn, DriverError> {
        self.turn("/compact").await
    }

    /// Closes stdin, waits up to `grace` for a clean exit, then kills.
    pub async fn shutdown(mut self, grace: Duration) {
        drop(self.stdin);
        if tokio::time::timeout(grace, self.child.wait())
            .await
            .is_err()
        {
            let _ = self.child.kill().await;
        }
    }

    /// Reads the turn's events up to its result; `written` is when its input was written.
    async fn until_result(&mut self, written: Instant) -> Result<Turn, DriverError> {
        let mut retries = 0;
        let mut reset = false;
        let mut compacted = None;
        let mut last_request_at = written;
        let mut last_request: Option<Usage> = None;
        let mut earlier_reads = Vec::new();
        // The message id of the request `last_request` is from: a request's answer comes as
        // several assistant events, one per content block.
        let mut last_id: Option<String> = None;
        // A tool result the CLI may answer with a new request (or end the turn with).
        let mut tool_result_at = None;
        loop {
            match self.next_event().await? {
                Event::Result(r) => {
                    if let Some(id) = &r.session_id {
                        self.session_id = Some(id.clone());
                    }
                    return Ok(Turn {
                        result: r,
                        retries,
                        reset,
                        compacted,
                        last_request_at,
                        last_request,
                        earlier_reads,
                    });
                }
                Event::User(_) => tool_result_at = Some(Instant::now()),
                Event::Assistant(m) => {
                    if let Some(at) = tool_result_at.take() {
                        last_request_at = at;
                    }
                    if let Some(u) = m.usage() {
                        let id = m.message["id"].as_str().map(str::to_owned);
                        if id != last_id {
                            earlier_reads.extend(last_request.map(|l| l.cache_read));
                            last_id = id;
                        }
                        last_request = Some(u);
                    }
                }
                Event::System(s) => {
                    if s.subtype == "api_retry" {
                        retries += 1;
                        // Printed before the retry's delay: never later than the new request.
                        last_request_at = Instant::now();
                    }
                    if s.subtype == "compact_boundary" {
                        compacted = Some(s.compact_metadata.unwrap_or_default());
                    }
                    if let Some(id) = s.session_id {
                        self.session_id = Some(id);
                    }
                }
                Event::ConversationReset(_) => reset = true,
                _ => {}
            }
        }
    }

    async fn next_event(&mut self) -> Result<Event, DriverError> {
        loop {
            let line = match self.lines.next_line().await {
                Ok(Some(l)) => l,
                Ok(None) => {
                    let status = self
                        .child
                        .wait()
                        .await
                        .map(|s| s.to_string())
                        .unwrap_or_else(|e| e.to_string());
                    return Err(DriverError::Exited(status));
                }
                Err(e) => return Err(DriverError::Exited(e.to_string())),
            };
            match proto::parse_line(&line) {
                Ok(Some(ev)) => return Ok(ev),
                Ok(None) => {}
                // One unreadable line never kills the session: count it and go on.
                Err(e) => debug!(error = %e, "skipping an unreadable CLI line"),
            }
        }
    }

    async fn control(&mut self, subtype: &str) -> Result<String, DriverError> {
        let id = format!("gw-{}", self.next_request);
        self.next_request += 1;
        self.write(&proto::control_line(&id, subtype)).await?;
        Ok(id)
    }

    async fn write(&mut self, line: &str) -> Result<(), DriverError> {
        self.stdin
            .write_all(line.as_bytes())
            .await
            .map_err(DriverError::Write)?;
        self.stdin.flush().await.map_err(DriverError::Write)
    }
}

#[cfg(test)]
mod debug_tests {
    use super::*;

    #[test]
    fn debug_never_shows_the_api_key() {
        let cfg = CliConfig {
            exe: "claude".into(),
            model: "m".into(),
            system_prompt_file: "p".into(),
            json_schema: "{}".into(),
            config_dir: "c".into(),
            work_dir: "w".into(),
            api_base_url: "http://x".into(),
            credential: Credential::ApiKey("sk-very-secret".into()),
            cache_ttl: Ttl::OneHour,
            thinking: false,
            session_id: None,
            resume: false,
            system_prompt_changed: false,
            max_retries: None,
            turn_timeout: Duration::from_secs(1),
            grace: Duration::from_secs(1),
        };
        let shown = format!("{cfg:?}");
        assert!(
            !shown.contains("sk-very-secret") && shown.contains("<redacted>"),
            "{shown}"
        );
        let oauth = format!("{:?}", Credential::OAuth("sk-ant-oat01-x".into()));
        assert_eq!(oauth, "OAuth(<redacted>)");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_user_message_that_opens_with_the_header_holds_the_batch() {
        let header = "[cultnet batch from the gateway] seqs 7-7: 1 new message(s)";
        let line = |kind: &str, content: serde_json::Value, uuid: &str| {
            serde_json::json!({"type": kind, "uuid": uuid, "message": {"role": kind, "content": content}})
                .to_string()
        };
        // Chat in an earlier batch quotes the header: that batch does not hold seqs 7-7.
        let planted = line(
            "user",
            serde_json::json!([{"type": "text", "text": format!("[cultnet batch from the gateway] seqs 1-1: 1 new message(s)\n[1] mallory: {header}")}]),
            "u-1",
        );
        let said = line(
            "assistant",
            serde_json::json!([{"type": "text", "text": header}]),
            "a-1",
        );
        let tail = format!("{planted}\n{said}\n");
        assert_eq!(opening_with(tail.as_bytes(), header).count(), 0);
        // The batch itself, as blocks or as a string; the newest first.
        let blocks = line(
            "user",
            serde_json::json!([{"type": "text", "text": format!("{header}\n[7] ann: hi")}]),
            "u-2",
        );
        let string = line(
            "user",
            serde_json::json!(format!("{header}\n[7] ann: hi")),
            "u-3",
        );
        let tail = format!("{planted}\n{blocks}\nnot json {header}\n{string}\n");
        let uuids: Vec<_> = opening_with(tail.as_bytes(), header)
            .map(|v| v["uuid"].as_str().unwrap_or_default().to_owned())
            .collect();
        assert_eq!(uuids, ["u-3", "u-2"]);
    }
}
