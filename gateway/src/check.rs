//! `cultnet-gateway check`: everything a gateway needs before it starts, one line per check,
//! each failure with its fix. Read-only: it creates nothing (a state directory that does not
//! exist yet is only checked for being creatable) and changes no file.
//!
//! Checks: the config parses; per Persona her token file (present, private), her homeserver
//! (answers `/versions`), her token (`whoami`: valid, and hers), her rooms (aliases resolve,
//! joined), her identity (her device signed by her cross-signing identity as `/keys/query`
//! shows it, her key backup, her recovery key file), her Matrix store (present when she ran
//! before, same device; `recover` named when it is lost), and for a live
//! session the claude CLI (runs; the pinned version recommended), her model credential, her
//! doctrine, reply schema and state files; then the state directory (writable, not locked by a
//! running gateway), the QUIC certificate and the CultNet client keys.

use std::path::Path;
use std::time::Duration;

use matrix_sdk::authentication::matrix::MatrixSession;
use matrix_sdk::config::RequestConfig;
use matrix_sdk::ruma::api::client::membership::joined_rooms;
use matrix_sdk::{Client, SessionMeta, SessionTokens};

use crate::config::{Config, Persona, SessionMode};

/// The claude CLI version the tests pin (`deploy/install-claude-cli.sh`).
pub const PINNED_CLI: &str = "2.1.332";
/// How long one network check may take.
pub const NETWORK_TIMEOUT: Duration = Duration::from_secs(10);

/// How a check came out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Level {
    /// Fine.
    Ok,
    /// Works, but worth a look (the gateway still starts).
    Warn,
    /// The gateway (or this Persona) will not start, or not work, until it is fixed.
    Fail,
}

/// One check's line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Line {
    /// How it came out.
    pub level: Level,
    /// What was checked (`config`, `state`, `vera: token`, ...).
    pub subject: String,
    /// What was found.
    pub found: String,
    /// What to do about it (failures and warnings).
    pub fix: Option<String>,
}

impl std::fmt::Display for Line {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let tag = match self.level {
            Level::Ok => "ok  ",
            Level::Warn => "warn",
            Level::Fail => "FAIL",
        };
        write!(f, "{tag}  {}: {}", self.subject, self.found)?;
        if let Some(fix) = &self.fix {
            write!(f, " -> fix: {fix}")?;
        }
        Ok(())
    }
}

fn ok(subject: &str, found: impl Into<String>) -> Line {
    Line {
        level: Level::Ok,
        subject: subject.to_owned(),
        found: found.into(),
        fix: None,
    }
}

fn bad(level: Level, subject: &str, found: impl Into<String>, fix: impl Into<String>) -> Line {
    Line {
        level,
        subject: subject.to_owned(),
        found: found.into(),
        fix: Some(fix.into()),
    }
}

/// Runs every check of the config at `path`.
pub async fn check(path: &Path) -> Vec<Line> {
    let cfg = match Config::load(path) {
        Ok(c) => c,
        Err(e) => {
            return vec![bad(
                Level::Fail,
                "config",
                e.to_string(),
                format!(
                    "correct {} (every key is documented in deploy/gateway.example.toml)",
                    path.display()
                ),
            )]
        }
    };
    let mut out = vec![ok(
        "config",
        format!(
            "{} parses ({} Persona(s), {} CultNet client(s))",
            path.display(),
            cfg.personas.len(),
            cfg.cultnet.clients.len()
        ),
    )];
    out.push(state_dir(&cfg.state_dir));
    let mail = mail(&cfg);
    for p in &cfg.personas {
        out.extend(persona(&cfg, p).await);
        out.extend(
            mail.iter()
                .filter(|(id, _)| *id == p.id)
                .map(|(_, l)| l.clone()),
        );
    }
    out.extend(cultnet(&cfg));
    out
}

/// Whether any line failed.
pub fn failed(lines: &[Line]) -> bool {
    lines.iter().any(|l| l.level == Level::Fail)
}

fn state_dir(dir: &Path) -> Line {
    let subject = "state";
    if !dir.exists() {
        let parent = dir
            .ancestors()
            .skip(1)
            .find(|a| a.exists())
            .unwrap_or(Path::new("/"));
        return match writable(parent) {
            Ok(()) => ok(
                subject,
                format!("{} will be created at the first start", dir.display()),
            ),
            Err(e) => bad(
                Level::Fail,
                subject,
                format!(
                    "{} does not exist and {} is not writable: {e}",
                    dir.display(),
                    parent.display()
                ),
                format!("create {} for the gateway's user", dir.display()),
            ),
        };
    }
    if let Err(e) = writable(dir) {
        return bad(
            Level::Fail,
            subject,
            format!("{} is not writable: {e}", dir.display()),
            format!("give the gateway's user write access to {}", dir.display()),
        );
    }
    // It holds her decrypted DMs, her Matrix store's keys and the gateway's key.
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(dir)
            .map(|m| m.permissions().mode() & 0o777)
            .unwrap_or(0o700);
        if mode & 0o077 != 0 {
            return bad(
                Level::Fail,
                subject,
                format!(
                    "{} is open to others (mode {mode:o}): it holds her decrypted DMs and keys",
                    dir.display()
                ),
                format!(
                    "chmod 700 {} (the gateway also closes it at its next start)",
                    dir.display()
                ),
            );
        }
    }
    let inbox = dir.join("inbox");
    if !inbox.exists() {
        return ok(
            subject,
            format!("{} is writable (no inbox yet)", dir.display()),
        );
    }
    // The inbox's own open: its lock file is held by a running gateway (also while a
    // compaction swaps its files, when sled's own lock is not).
    match crate::inbox::Inbox::open(&inbox) {
        Ok(held) => {
            drop(held);
            ok(
                subject,
                format!("{} is writable and not in use", dir.display()),
            )
        }
        Err(e) if e.is_contention() => bad(
            Level::Fail,
            subject,
            format!("{} is locked: a gateway is running with it", dir.display()),
            "stop that gateway first (systemctl stop cultnet-gateway), or check a config with \
             its own state_dir",
        ),
        Err(e) => bad(
            Level::Fail,
            subject,
            format!("the inbox {} does not open: {e}", inbox.display()),
            "restore the state directory from a backup",
        ),
    }
}

/// What her inbox holds back, read when no gateway has it open: a full inbox (her rooms wait
/// on the homeserver until CultNet clients acknowledge), batches set aside (the model API kept
/// refusing them), and what her rules retired. Per Persona id.
fn mail(cfg: &Config) -> Vec<(String, Line)> {
    let path = cfg.state_dir.join("inbox");
    if !path.exists() {
        return Vec::new();
    }
    let Ok(inbox) = crate::inbox::Inbox::open(&path) else {
        // Locked by a running gateway, or broken: the state line says which.
        return Vec::new();
    };
    let mut out = Vec::new();
    for p in &cfg.personas {
        let subject = format!("{}: mail", p.id);
        let counts = inbox.counts(&p.id).unwrap_or_default();
        let max = p.limits.max_pending;
        if counts.pending >= max {
            out.push((
                p.id.clone(),
                bad(
                    Level::Warn,
                    &subject,
                    format!(
                        "her inbox is full ({} pending of limits.max_pending {max}): her rooms wait on the homeserver until her mail is acknowledged (her operators' DMs and invites still come)",
                        counts.pending
                    ),
                    "run the CultNet client that reads and acknowledges her mail, or raise limits.max_pending",
                ),
            ));
        } else {
            out.push((
                p.id.clone(),
                ok(
                    &subject,
                    format!("{} pending of at most {max}", counts.pending),
                ),
            ));
        }
        let aside = inbox.set_aside_list(&p.id).unwrap_or_default();
        if !aside.is_empty() {
            let ids: Vec<String> = aside.iter().map(|a| a.id.to_string()).collect();
            out.push((
                p.id.clone(),
                bad(
                    Level::Warn,
                    &format!("{}: set aside", p.id),
                    format!(
                        "{} batch(es) the model API kept refusing are set aside, unanswered (ids {})",
                        aside.len(),
                        ids.join(", ")
                    ),
                    format!(
                        "with the gateway running: cultnet-gateway client ... session --persona {} retry --batch ID (or drop --batch ID)",
                        p.id
                    ),
                ),
            ));
        }
    }
    out
}

fn writable(dir: &Path) -> std::io::Result<()> {
    let probe = dir.join(format!(".cultnet-check-{}", std::process::id()));
    std::fs::write(&probe, b"")?;
    std::fs::remove_file(&probe)
}

async fn persona(cfg: &Config, p: &Persona) -> Vec<Line> {
    let mut out = Vec::new();
    let s = |what: &str| format!("{}: {what}", p.id);
    let token = match p.load_token() {
        Ok(t) => {
            out.push(ok(&s("token"), "readable, owner only"));
            Some(t)
        }
        Err(e) => {
            let fix = match (&p.access_token_file, e.problem.contains("chmod")) {
                (Some(f), true) => format!("chmod 600 {}", f.display()),
                (Some(f), false) => format!(
                    "write her access token (from a login with device {}) to {} with mode 0600",
                    p.device_id,
                    f.display()
                ),
                (None, _) => "give the gateway the systemd credential it names".to_owned(),
            };
            out.push(bad(Level::Fail, &s("token"), e.problem.clone(), fix));
            None
        }
    };
    out.extend(matrix(cfg, p, token.as_ref().map(|t| t.expose())).await);
    out.push(store(cfg, p));
    if p.session.mode == SessionMode::Live {
        out.extend(live(p).await);
    }
    out
}

/// The homeserver, her token and her rooms.
async fn matrix(cfg: &Config, p: &Persona, token: Option<&str>) -> Vec<Line> {
    let s = |what: &str| format!("{}: {what}", p.id);
    let mut out = Vec::new();
    let versions = format!(
        "{}/_matrix/client/versions",
        p.homeserver.trim_end_matches('/')
    );
    let http = matrix_sdk::reqwest::Client::builder()
        .timeout(NETWORK_TIMEOUT)
        .build();
    let answered = match http {
        Ok(h) => h.get(&versions).send().await.map(|r| r.status()),
        Err(e) => {
            out.push(bad(
                Level::Fail,
                &s("homeserver"),
                e.to_string(),
                "report this bug",
            ));
            return out;
        }
    };
    match answered {
        Ok(status) if status.is_success() => {
            out.push(ok(&s("homeserver"), format!("{} answers", p.homeserver)))
        }
        Ok(status) => {
            out.push(bad(
                Level::Fail,
                &s("homeserver"),
                format!("{versions} answered HTTP {status}"),
                "check homeserver: it must be the client-server API's base URL",
            ));
            return out;
        }
        Err(e) => {
            out.push(bad(
                Level::Fail,
                &s("homeserver"),
                format!("{} does not answer: {e}", p.homeserver),
                "start the homeserver, or correct homeserver in her [[persona]] block",
            ));
            return out;
        }
    }
    let Some(token) = token else { return out };
    let client = match session_client(p, token).await {
        Ok(c) => c,
        Err(e) => {
            out.push(bad(
                Level::Fail,
                &s("token"),
                e,
                "correct user_id and device_id",
            ));
            return out;
        }
    };
    match client.whoami().await {
        Ok(who) if who.user_id.as_str() == p.user_id => {
            out.push(ok(&s("token"), format!("valid for {}", p.user_id)));
            if who
                .device_id
                .as_ref()
                .is_some_and(|d| d.as_str() != p.device_id)
            {
                out.push(bad(
                    Level::Fail,
                    &s("device"),
                    format!(
                        "the token is for device {}, the config names {}",
                        who.device_id.as_ref().map_or("?", |d| d.as_str()),
                        p.device_id
                    ),
                    "log in with the configured device_id, or set device_id to the token's",
                ));
            }
        }
        Ok(who) => {
            out.push(bad(
                Level::Fail,
                &s("token"),
                format!("the token belongs to {}, not {}", who.user_id, p.user_id),
                format!("put a token of {} in her token file", p.user_id),
            ));
            return out;
        }
        Err(e) => {
            let why = match crate::matrix::classify_http(&e) {
                crate::matrix::Failure::Unauthorized { errcode } => {
                    format!("the homeserver refuses it ({errcode})")
                }
                _ => e.to_string(),
            };
            out.push(bad(
                Level::Fail,
                &s("token"),
                why,
                format!(
                    "log in as {} with device {} and write the new token to her token file",
                    p.user_id, p.device_id
                ),
            ));
            return out;
        }
    }
    let joined = client
        .send(joined_rooms::v3::Request::new())
        .await
        .map(|r| r.joined_rooms)
        .unwrap_or_default();
    for room in &p.rooms {
        let subject = s(&format!("room {room}"));
        let id = if room.starts_with('#') {
            let Ok(alias) = matrix_sdk::ruma::OwnedRoomAliasId::try_from(room.as_str()) else {
                out.push(bad(
                    Level::Fail,
                    &subject,
                    "not a room alias",
                    "correct rooms",
                ));
                continue;
            };
            match client.resolve_room_alias(&alias).await {
                Ok(r) => r.room_id,
                Err(e) => {
                    out.push(bad(
                        Level::Fail,
                        &subject,
                        format!("the alias does not resolve: {e}"),
                        "create the room with this alias, or correct rooms",
                    ));
                    continue;
                }
            }
        } else {
            match matrix_sdk::ruma::OwnedRoomId::try_from(room.as_str()) {
                Ok(id) => id,
                Err(_) => {
                    out.push(bad(Level::Fail, &subject, "not a room id", "correct rooms"));
                    continue;
                }
            }
        };
        if joined.contains(&id) {
            out.push(ok(&subject, format!("joined ({id})")));
        } else {
            out.push(bad(
                Level::Warn,
                &subject,
                format!("not joined yet ({id})"),
                "the gateway joins it at start; invite her first if the room is not public",
            ));
        }
    }
    out.extend(identity(cfg, p, &client).await);
    out
}

/// Her cryptographic identity as other clients see it (`/keys/query`, the key backup's
/// version) and her recovery key file: each missing part a warning with its fix.
async fn identity(cfg: &Config, p: &Persona, client: &Client) -> Vec<Line> {
    use matrix_sdk::ruma::api::client::backup::get_latest_backup_info;
    use matrix_sdk::ruma::api::client::keys::get_keys;
    let s = |what: &str| format!("{}: {what}", p.id);
    let mut out = Vec::new();
    let started = crate::matrix::Paths::new(&cfg.state_dir, &p.id)
        .record
        .exists();
    let off = !p.encryption.cross_signing;
    let later = |what: &str| {
        if off {
            bad(
                Level::Warn,
                &s(what),
                "off (encryption.cross_signing = false)",
                "set encryption.cross_signing = true: clients that read only cross-signed devices do not read her",
            )
        } else {
            ok(&s(what), "not yet: set up at her first start")
        }
    };
    let Ok(user) = matrix_sdk::ruma::OwnedUserId::try_from(p.user_id.as_str()) else {
        return out;
    };
    let mut req = get_keys::v3::Request::new();
    req.device_keys.insert(user.clone(), Vec::new());
    match client.send(req).await {
        Ok(keys) => {
            let ssk = keys
                .self_signing_keys
                .get(&user)
                .and_then(|k| k.deserialize().ok())
                .and_then(|k| k.keys.keys().next().map(|id| id.to_string()));
            let signed = keys
                .device_keys
                .get(&user)
                .and_then(|d| {
                    d.iter()
                        .find(|(id, _)| id.as_str() == p.device_id)
                        .map(|(_, k)| k)
                })
                .and_then(|k| k.deserialize().ok())
                .zip(ssk.as_ref())
                .is_some_and(|(k, ssk)| {
                    k.signatures
                        .get(&user)
                        .is_some_and(|sigs| sigs.keys().any(|id| id.as_str() == ssk))
                });
            if signed {
                out.push(ok(
                    &s("cross-signing"),
                    format!("device {} is signed by her identity", p.device_id),
                ));
            } else if !started || off {
                out.push(later("cross-signing"));
            } else {
                let found = if ssk.is_some() {
                    format!("device {} is not signed by her identity", p.device_id)
                } else {
                    "she has no cross-signing identity".to_owned()
                };
                out.push(bad(
                    Level::Warn,
                    &s("cross-signing"),
                    found,
                    format!(
                        "read the gateway's log at her start (\"her identity is not secured\"): set encryption.password_file if the homeserver asks for her password, or put her recovery key in {}",
                        p.recovery_key_path(&cfg.state_dir).display()
                    ),
                ));
            }
        }
        Err(e) => out.push(bad(
            Level::Warn,
            &s("cross-signing"),
            format!("her device keys could not be read: {e}"),
            "check the homeserver",
        )),
    }
    match client
        .send(get_latest_backup_info::v3::Request::new())
        .await
    {
        Ok(info) => out.push(ok(
            &s("key backup"),
            format!("on (version {})", info.version),
        )),
        Err(e)
            if e.as_client_api_error()
                .is_some_and(|a| a.status_code.as_u16() == 404) =>
        {
            if !started || off {
                out.push(later("key backup"));
            } else {
                out.push(bad(
                    Level::Warn,
                    &s("key backup"),
                    "off: her room keys are kept on this machine only",
                    "read the gateway's log at her start (\"her identity is not secured\")",
                ));
            }
        }
        Err(e) => out.push(bad(
            Level::Warn,
            &s("key backup"),
            format!("could not be read: {e}"),
            "check the homeserver",
        )),
    }
    let path = p.recovery_key_path(&cfg.state_dir);
    match p.load_recovery_key(&cfg.state_dir) {
        Ok(Some(_)) => out.push(ok(
            &s("recovery key"),
            format!(
                "{} (keep a copy away from this machine: `recover` needs it after a lost store)",
                path.display()
            ),
        )),
        Ok(None) if !started || off => out.push(later("recovery key")),
        Ok(None) => out.push(bad(
            Level::Warn,
            &s("recovery key"),
            format!("{} is not there", path.display()),
            "keep her recovery key where you can find it: without it a lost store cannot be recovered",
        )),
        Err(e) => out.push(bad(
            Level::Fail,
            &s("recovery key"),
            e.problem.clone(),
            format!("chmod 600 {}", path.display()),
        )),
    }
    out
}

/// A client on her token with an in-memory store (her own store may be in use).
async fn session_client(p: &Persona, token: &str) -> Result<Client, String> {
    let user_id = matrix_sdk::ruma::OwnedUserId::try_from(p.user_id.as_str())
        .map_err(|e| format!("user_id {:?}: {e}", p.user_id))?;
    let client = Client::builder()
        .homeserver_url(&p.homeserver)
        .request_config(
            RequestConfig::new()
                .disable_retry()
                .timeout(NETWORK_TIMEOUT),
        )
        .build()
        .await
        .map_err(|e| e.to_string())?;
    client
        .matrix_auth()
        .restore_session(
            MatrixSession {
                meta: SessionMeta {
                    user_id,
                    device_id: p.device_id.as_str().into(),
                },
                tokens: SessionTokens {
                    access_token: token.to_owned(),
                    refresh_token: None,
                },
            },
            matrix_sdk::store::RoomLoadSettings::default(),
        )
        .await
        .map_err(|e| e.to_string())?;
    Ok(client)
}

/// Her Matrix store: present when she ran before, and of the configured device.
fn store(cfg: &Config, p: &Persona) -> Line {
    let subject = format!("{}: matrix store", p.id);
    let paths = crate::matrix::Paths::new(&cfg.state_dir, &p.id);
    let record = match std::fs::read(&paths.record) {
        Ok(b) => b,
        Err(_) => return ok(&subject, "none yet (made at her first start)"),
    };
    let device = serde_json::from_slice::<serde_json::Value>(&record)
        .ok()
        .and_then(|v| v["device_id"].as_str().map(str::to_owned));
    if !paths.store.join("matrix-sdk-crypto.sqlite3").exists() {
        return bad(
            Level::Fail,
            &subject,
            format!(
                "{} says she ran before, but her store {} is gone (her encrypted rooms would be lost)",
                paths.record.display(),
                paths.store.display()
            ),
            format!(
                "restore the state directory from a backup, or log in with a NEW device id and run `cultnet-gateway recover --persona {}` with her recovery key",
                p.id
            ),
        );
    }
    match device {
        Some(d) if d == p.device_id => ok(&subject, format!("present, device {d}")),
        Some(d) => bad(
            Level::Fail,
            &subject,
            format!(
                "the store is of device {d}, the config names {}",
                p.device_id
            ),
            "set device_id back, or start over with a new device (deploy/README.md)",
        ),
        None => bad(
            Level::Fail,
            &subject,
            format!("{} is unreadable", paths.record.display()),
            "restore the state directory from a backup",
        ),
    }
}

/// Her live session's parts: the CLI, her credential and files.
async fn live(p: &Persona) -> Vec<Line> {
    let s = |what: &str| format!("{}: {what}", p.id);
    let mut out = Vec::new();
    let sc = &p.session;
    let run = tokio::time::timeout(
        NETWORK_TIMEOUT,
        tokio::process::Command::new(&sc.claude)
            .arg("--version")
            .env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .output(),
    )
    .await;
    match run {
        Ok(Ok(o)) if o.status.success() => {
            let version = String::from_utf8_lossy(&o.stdout).trim().to_owned();
            if version.starts_with(PINNED_CLI) {
                out.push(ok(
                    &s("claude"),
                    format!("{} runs: {version}", sc.claude.display()),
                ));
            } else {
                out.push(bad(
                    Level::Warn,
                    &s("claude"),
                    format!("{} runs: {version}", sc.claude.display()),
                    format!("{PINNED_CLI} is the version tested (deploy/install-claude-cli.sh)"),
                ));
            }
        }
        Ok(Ok(o)) => out.push(bad(
            Level::Fail,
            &s("claude"),
            format!("{} --version exited with {}", sc.claude.display(), o.status),
            "reinstall it: deploy/install-claude-cli.sh",
        )),
        Ok(Err(e)) => out.push(bad(
            Level::Fail,
            &s("claude"),
            format!("{} does not run: {e}", sc.claude.display()),
            "install it (deploy/install-claude-cli.sh prints its path) and set session.claude",
        )),
        Err(_) => out.push(bad(
            Level::Fail,
            &s("claude"),
            format!(
                "{} --version did not answer within {NETWORK_TIMEOUT:?}",
                sc.claude.display()
            ),
            "reinstall it: deploy/install-claude-cli.sh",
        )),
    }
    match sc.load_credential(&p.id) {
        Ok(session::driver::Credential::ApiKey(_)) => {
            out.push(ok(&s("model credential"), "API key readable, owner only"))
        }
        Ok(session::driver::Credential::OAuth(_)) => out.push(ok(
            &s("model credential"),
            "OAuth token readable, owner only",
        )),
        Err(e) => out.push(bad(
            Level::Fail,
            &s("model credential"),
            e.problem.clone(),
            format!("fix {} (mode 0600, the key inside)", e.key),
        )),
    }
    if let Some(f) = &sc.system_prompt_file {
        match std::fs::metadata(f) {
            Ok(m) if m.len() > 0 => out.push(ok(
                &s("doctrine"),
                format!("{} ({} bytes)", f.display(), m.len()),
            )),
            _ => out.push(bad(
                Level::Fail,
                &s("doctrine"),
                format!("{} is missing or empty", f.display()),
                "write her doctrine there, or correct session.system_prompt_file",
            )),
        }
    }
    match p.budget.usd_per_day {
        Some(cap) => out.push(ok(
            &s("budget"),
            format!(
                "at most ${cap} in any 24 hours, {:.0}% of it kept for her operators",
                p.budget.operator_reserve * 100.0
            ),
        )),
        // The default is a cap: only a config built by code, not by TOML, has none.
        None => out.push(bad(
            Level::Warn,
            &s("budget"),
            "no daily cap: anyone in her rooms can make her spend without limit",
            "set [persona.budget] usd_per_day",
        )),
    }
    if sc.reply_schema_file.is_some() {
        match sc.reply_schema(&p.id) {
            Ok(_) => out.push(ok(&s("reply schema"), "valid")),
            Err(e) => out.push(bad(
                Level::Fail,
                &s("reply schema"),
                e.problem.clone(),
                "correct session.reply_schema_file",
            )),
        }
    }
    match (&sc.prices, session::cost::Prices::for_model(&sc.model)) {
        (Some(p), _) => out.push(ok(
            &s("prices"),
            format!(
                "{}: ${}/MTok input, cache reads {}x (configured)",
                sc.model, p.input, p.cache_read_ratio
            ),
        )),
        (None, Some(p)) => out.push(ok(
            &s("prices"),
            format!("{}: ${}/MTok input (published)", sc.model, p.input),
        )),
        (None, None) => out.push(bad(
            Level::Warn,
            &s("prices"),
            format!(
                "no published prices known for {}: costed as Sonnet",
                sc.model
            ),
            "set session.prices = { input = ..., cache_read_ratio = ... }",
        )),
    }
    if let Some(f) = &sc.state_file {
        if std::fs::read_to_string(f).is_err() {
            out.push(bad(
                Level::Fail,
                &s("state file"),
                format!("{} is not readable text", f.display()),
                "write her state there, or correct session.state_file",
            ));
        }
    }
    out
}

/// The QUIC certificate and the client keys.
fn cultnet(cfg: &Config) -> Vec<Line> {
    let mut out = Vec::new();
    if let Some(q) = &cfg.cultnet.quic {
        if let (Some(cert), Some(key)) = (&q.cert_file, &q.key_file) {
            match crate::quic::identity(Some(cert), Some(key), &cfg.state_dir) {
                Ok(id) => out.push(ok(
                    "quic",
                    format!("certificate sha256 {}", id.fingerprint()),
                )),
                Err(e) => out.push(bad(
                    Level::Fail,
                    "quic",
                    e.to_string(),
                    "point cert_file and key_file at a PEM certificate and its key",
                )),
            }
        } else {
            out.push(ok(
                "quic",
                "certificate made (or kept) under the state directory",
            ));
        }
    }
    for c in &cfg.cultnet.clients {
        let subject = format!("client {}", c.agent_id);
        let valid = c
            .key_bytes()
            .and_then(|k| ed25519_dalek::VerifyingKey::from_bytes(&k).ok())
            .is_some();
        if valid {
            out.push(ok(&subject, format!("ed25519 key, verbs {:?}", c.verbs)));
        } else {
            out.push(bad(
                Level::Fail,
                &subject,
                "public_key is not an ed25519 public key",
                "paste the key `cultnet-gateway keygen` printed",
            ));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_inbox_and_a_batch_set_aside_are_named_with_their_fix() {
        let dir = crate::scratch::Dir::new("check-mail");
        let cfg = Config::parse(&format!(
            "state_dir = \"{}\"\n[[persona]]\nid = \"mira\"\nhomeserver = \"http://127.0.0.1:8008\"\nuser_id = \"@mira:localhost\"\ndevice_id = \"CULTNET-MIRA\"\naccess_token_file = \"/tmp/mira.token\"\nrooms = []\noperators = []\n[persona.limits]\nmax_pending = 2\n",
            dir.display()
        ))
        .unwrap();
        let inbox = crate::inbox::Inbox::open(&dir.join("inbox")).unwrap();
        let d = |id: &str| wire::docs::Delivery {
            event_id: id.into(),
            room_id: "!r".into(),
            text: "x".into(),
            ..Default::default()
        };
        inbox.ingest("mira", "t", &[d("$1"), d("$2")]).unwrap();
        let text = |lines: Vec<(String, Line)>| {
            lines
                .iter()
                .map(|(_, l)| l.to_string())
                .collect::<Vec<_>>()
                .join("\n")
        };
        drop(inbox);
        let out = text(mail(&cfg));
        assert!(
            out.contains("warn  mira: mail: her inbox is full (2 pending"),
            "{out}"
        );
        let inbox = crate::inbox::Inbox::open(&dir.join("inbox")).unwrap();
        let first = inbox.pending("mira", 0, 1, None).unwrap().deliveries;
        inbox.set_aside("mira", &first, "HTTP 400", 1).unwrap();
        drop(inbox);
        let out = text(mail(&cfg));
        assert!(
            out.contains("ok    mira: mail: 1 pending of at most 2"),
            "{out}"
        );
        assert!(
            out.contains("set aside") && out.contains("retry --batch ID"),
            "{out}"
        );
    }
}
