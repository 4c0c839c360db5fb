//! Matrix parts for end-to-end tests: password logins with a chosen device, a matrix-sdk
//! client standing in for an operator's Element (persistent store, so it speaks encrypted),
//! and a one-Persona gateway assembled from the `gateway` library (ear, mouth, inbox), which
//! a test can stop and start again on the same state directory.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use gateway::config::{Limits, Persona, Secret};
use gateway::ear::{Ear, EarStats, Signals};
use gateway::inbox::Inbox;
use gateway::mouth::Mouth;
use matrix_sdk::config::SyncSettings;
use matrix_sdk::Client;
use serde_json::{json, Value};

/// Logs `user` in with `password` on device `device` and returns the access token (raw
/// `/login`, so no client state or keys are made).
pub async fn token_for(hs: &str, user: &str, password: &str, device: &str) -> String {
    let body = json!({
        "type": "m.login.password",
        "identifier": {"type": "m.id.user", "user": user},
        "password": password,
        "device_id": device,
    });
    let text = matrix_sdk::reqwest::Client::new()
        .post(format!("{hs}/_matrix/client/v3/login"))
        .header("content-type", "application/json")
        .body(body.to_string())
        .send()
        .await
        .expect("login request")
        .text()
        .await
        .expect("login reply");
    let resp: Value = serde_json::from_str(&text).expect("login reply is JSON");
    resp["access_token"]
        .as_str()
        .unwrap_or_else(|| panic!("login of {user} failed: {resp}"))
        .to_owned()
}

/// A logged-in client with a persistent store in `dir`, synced once (keys uploaded).
pub async fn user_client(hs: &str, user: &str, password: &str, dir: &Path) -> Client {
    let client = Client::builder()
        .homeserver_url(hs)
        .sqlite_store(dir, None)
        .build()
        .await
        .expect("client");
    client
        .matrix_auth()
        .login_username(user, password)
        .device_id(&format!("{}-DEV", user.to_uppercase()))
        .send()
        .await
        .expect("login");
    sync(&client).await;
    client
}

/// One short sync of a test user's client (the SDK continues from its own token).
pub async fn sync(client: &Client) {
    client
        .sync_once(SyncSettings::default().timeout(Duration::from_millis(200)))
        .await
        .expect("sync");
}

/// A Persona's config for a test homeserver.
pub fn persona(hs: &str, id: &str, rooms: &[&str], operators: &[&str]) -> Persona {
    Persona {
        id: id.to_owned(),
        homeserver: hs.to_owned(),
        user_id: format!("@{id}:localhost"),
        device_id: format!("GW-{}", id.to_uppercase()),
        access_token_file: None,
        access_token_credential: None,
        rooms: rooms.iter().map(|s| s.to_string()).collect(),
        operators: operators.iter().map(|s| s.to_string()).collect(),
        limits: Limits::default(),
        session: Default::default(),
        budget: Default::default(),
        turns: Default::default(),
        encryption: Default::default(),
    }
}

/// A one-Persona gateway in this process: the inbox, her client, ear and mouth.
pub struct Gateway {
    /// Her config.
    pub persona: Persona,
    /// The state directory.
    pub state_dir: PathBuf,
    /// The inbox.
    pub inbox: Inbox,
    /// Her ear (rounds are driven by the test).
    pub ear: Ear,
    /// Her mouth.
    pub mouth: Mouth,
    /// Her client.
    pub client: Client,
    /// Ear counters.
    pub stats: Arc<EarStats>,
}

impl Gateway {
    /// Opens the state directory, connects her client, joins her rooms, and runs the first
    /// sync round when there is no stored position yet.
    pub async fn start(persona: &Persona, token: &str, state_dir: &Path) -> Self {
        let inbox = Inbox::open(&state_dir.join("inbox")).expect("inbox");
        let stored = inbox.sync_token(&persona.id).expect("token");
        let client = gateway::matrix::connect(
            persona,
            state_dir,
            &Secret::new(token.to_owned()),
            stored.as_deref(),
        )
        .await
        .expect("connect");
        let stats = Arc::new(EarStats::default());
        let mut ear = Ear::new(
            persona.clone(),
            client.clone(),
            inbox.clone(),
            Arc::new(Signals::default()),
            stats.clone(),
        )
        .await;
        let (rooms, failed) = gateway::ear::join_configured(&client, persona).await;
        assert!(failed.is_empty(), "rooms not joined: {failed:?}");
        if stored.is_none() {
            ear.round(Duration::ZERO).await.expect("first sync");
        }
        let mouth = Mouth::new(&persona.id, client.clone(), inbox.clone(), rooms);
        Self {
            persona: persona.clone(),
            state_dir: state_dir.to_path_buf(),
            inbox,
            ear,
            mouth,
            client,
            stats,
        }
    }

    /// Runs sync rounds until `want` deliveries are pending (or panics after `within`).
    pub async fn until_pending(&mut self, want: u64, within: Duration) {
        let deadline = Instant::now() + within;
        loop {
            let pending = self.inbox.counts(&self.persona.id).expect("counts").pending;
            if pending >= want {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "only {pending} of {want} deliveries arrived within {within:?}"
            );
            if let Err(e) = self.ear.round(Duration::from_millis(500)).await {
                eprintln!("round failed: {e}");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    }

    /// Stops (drops the client and the inbox; sled releases its lock shortly after).
    pub async fn stop(self) {
        drop(self);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The bodies of the last `limit` `m.room.message` events in a room (oldest first), read by
/// `/messages` (decrypted when the reader can).
pub async fn room_bodies(room: &matrix_sdk::Room, limit: u32) -> Vec<String> {
    let mut opts = matrix_sdk::room::MessagesOptions::backward();
    opts.limit = limit.into();
    let msgs = room.messages(opts).await.expect("messages");
    let mut out: Vec<String> = msgs
        .chunk
        .iter()
        .filter_map(|e| {
            let v: Value = serde_json::from_str(e.raw().json().get()).ok()?;
            (v["type"] == "m.room.message")
                .then(|| v["content"]["body"].as_str().map(str::to_owned))?
        })
        .collect();
    out.reverse();
    out
}

/// The `cultnet-gateway` binary of this workspace, of the same profile as the caller (built
/// by `cargo test --workspace`; built here when missing).
pub fn gateway_bin() -> PathBuf {
    let exe = std::env::current_exe().expect("own executable");
    // Tests run from target/debug/deps, binaries from target/debug.
    let find = || {
        exe.ancestors()
            .skip(1)
            .take(2)
            .map(|d| d.join("cultnet-gateway"))
            .find(|p| p.exists())
    };
    // `cargo test -p tests` alone does not rebuild another package's binary: rebuild it when
    // a source it is made of is newer.
    let fresh = |bin: &Path| {
        let built = std::fs::metadata(bin).and_then(|m| m.modified()).ok();
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let newest = ["gateway/src", "session/src", "wire/src"]
            .iter()
            .filter_map(|d| newest_mtime(&root.join(d)))
            .max();
        matches!((built, newest), (Some(b), Some(n)) if b >= n)
    };
    if let Some(bin) = find().filter(|b| fresh(b)) {
        return bin;
    }
    // Benchmarks run from target/release: build with their profile (`bench`, which writes
    // there too and shares their dependencies' builds).
    let release = exe.ancestors().any(|d| d.ends_with("release"));
    let ok = std::process::Command::new(env!("CARGO"))
        .args(["build", "-p", "gateway", "--bin", "cultnet-gateway"])
        .args(if release {
            &["--profile", "bench"][..]
        } else {
            &[][..]
        })
        .status()
        .expect("cargo build")
        .success();
    assert!(ok, "building cultnet-gateway failed");
    find().expect("cultnet-gateway after building it")
}

fn newest_mtime(dir: &Path) -> Option<std::time::SystemTime> {
    let mut newest = None;
    for e in std::fs::read_dir(dir).ok()?.flatten() {
        let t = if e.file_type().ok()?.is_dir() {
            newest_mtime(&e.path())
        } else {
            e.metadata().and_then(|m| m.modified()).ok()
        };
        newest = newest.max(t);
    }
    newest
}

/// Writes `text` to `path` with mode 0600 (token and key files).
pub fn write_private(path: &Path, text: &str) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::write(path, text).expect("write private file");
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).expect("chmod 600");
}

/// A `cultnet-gateway run` process whose log is collected; killed when dropped.
pub struct GatewayProcess {
    child: std::process::Child,
    log: Arc<std::sync::Mutex<String>>,
}

impl GatewayProcess {
    /// Starts `cultnet-gateway --log-format text run --config CONFIG` and waits (up to 60 s)
    /// until it logs that it is running.
    pub fn start(config: &Path) -> Self {
        Self::start_logging(config, "text")
    }

    /// [`GatewayProcess::start`] with logs in `format` (`text` or `json`).
    pub fn start_logging(config: &Path, format: &str) -> Self {
        use std::io::BufRead;
        let mut child = std::process::Command::new(gateway_bin())
            .args(["--log-format", format, "run", "--config"])
            .arg(config)
            .env(
                "RUST_LOG",
                std::env::var("CULTNET_TEST_LOG").unwrap_or_else(|_| {
                    "info,matrix_sdk=warn,matrix_sdk_crypto=error,matrix_sdk_base=warn,matrix_sdk::http_client=off".to_owned()
                }),
            )
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("starting cultnet-gateway");
        let log = Arc::new(std::sync::Mutex::new(String::new()));
        let stderr = child.stderr.take().expect("stderr");
        let sink = log.clone();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(stderr)
                .lines()
                .map_while(Result::ok)
            {
                let mut l = sink.lock().unwrap_or_else(|p| p.into_inner());
                l.push_str(&line);
                l.push('\n');
            }
        });
        let p = Self { child, log };
        p.wait_log("gateway running", Duration::from_secs(60));
        p
    }

    /// Waits until the log contains `needle`.
    pub fn wait_log(&self, needle: &str, within: Duration) {
        let deadline = Instant::now() + within;
        while !self.log().contains(needle) {
            assert!(
                Instant::now() < deadline,
                "gateway did not log {needle:?} within {within:?}; log:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The CultNet address it logged when it started (`cultnet=ADDR` in "gateway running").
    pub fn cultnet_addr(&self) -> std::net::SocketAddr {
        self.logged_addr("gateway running", "cultnet=")
    }

    /// The metrics address it logged (`addr=ADDR` in "metrics on").
    pub fn metrics_addr(&self) -> std::net::SocketAddr {
        self.logged_addr("metrics on", "addr=")
    }

    /// The QUIC address it logged (`addr=ADDR` in "CultNet over QUIC").
    pub fn quic_addr(&self) -> std::net::SocketAddr {
        self.logged_addr("CultNet over QUIC", "addr=")
    }

    fn logged_addr(&self, marker: &str, field: &str) -> std::net::SocketAddr {
        let log = self.log();
        let line = log
            .lines()
            .find(|l| l.contains(marker))
            .unwrap_or_else(|| panic!("the gateway did not log {marker:?}:\n{log}"));
        // A JSON line names the value in its fields.
        if let Ok(v) = serde_json::from_str::<serde_json::Value>(line) {
            let name = field.trim_end_matches('=');
            return v["fields"][name]
                .as_str()
                .and_then(|a| a.parse().ok())
                .unwrap_or_else(|| panic!("no address in {name} of {line}"));
        }
        // Strip ANSI styling, then read the value after `cultnet=`.
        let mut plain = String::new();
        let mut chars = line.chars();
        while let Some(c) = chars.next() {
            if c == '\u{1b}' {
                chars.by_ref().find(|c| c.is_ascii_alphabetic());
            } else {
                plain.push(c);
            }
        }
        let at = plain
            .find(field)
            .unwrap_or_else(|| panic!("no {field} in {plain:?}"))
            + field.len();
        plain[at..]
            .split_whitespace()
            .next()
            .and_then(|a| a.parse().ok())
            .unwrap_or_else(|| panic!("no address after {field} in {plain:?}"))
    }

    /// Everything it logged so far.
    pub fn log(&self) -> String {
        self.log.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends SIGHUP and waits (up to a minute) until the log says the config was reloaded or
    /// refused.
    pub fn reload(&self) {
        let done = |log: &str| {
            log.matches("SIGHUP: config reloaded").count() + log.matches("is refused").count()
        };
        let before = done(&self.log());
        std::process::Command::new("kill")
            .args(["-HUP", &self.pid().to_string()])
            .status()
            .expect("kill -HUP");
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        while done(&self.log()) == before {
            assert!(
                std::time::Instant::now() < deadline,
                "no reload; log:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// `kill -9`.
    pub fn kill9(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// SIGTERM and wait for a clean exit (up to 20 s).
    pub fn stop(mut self) -> std::process::ExitStatus {
        let _ = std::process::Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Ok(Some(s)) = self.child.try_wait() {
                return s;
            }
            if Instant::now() > deadline {
                let _ = self.child.kill();
                return self.child.wait().expect("wait");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for GatewayProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A config file for one Persona (session off unless `session` adds a `[persona.session]`).
pub fn write_config(
    dir: &Path,
    hs: &str,
    token: &str,
    rooms: &[&str],
    operators: &[&str],
    session: &str,
) -> PathBuf {
    let text = format!(
        "state_dir = \"{state}\"\n\n[cultnet]\nbind = \"127.0.0.1:0\"\n{persona}\n",
        state = dir.join("state").display(),
        persona = persona_block(dir, "vera", hs, token, rooms, operators, session),
    );
    let path = dir.join("gateway.toml");
    std::fs::write(&path, text).expect("write config");
    path
}

/// Adds `lines` (settings such as `max_in_flight = 128`) to the `[cultnet]` section of a config
/// written by [`write_config`], which has no parameter for them.
pub fn add_cultnet_lines(config: &Path, lines: &str) {
    let bind = "[cultnet]\nbind = \"127.0.0.1:0\"\n";
    let text = std::fs::read_to_string(config).expect("read config");
    assert!(text.contains(bind), "not a config of write_config:\n{text}");
    let text = text.replacen(bind, &format!("{bind}{lines}\n"), 1);
    std::fs::write(config, text).expect("write config");
}

/// Adds a `[metrics]` section binding `bind` (`127.0.0.1:0` for a port of the system's
/// choosing, read back with [`GatewayProcess::metrics_addr`]) to a config written by
/// [`write_config`]: it goes before the first `[[persona]]` table.
pub fn add_metrics(config: &Path, bind: &str) {
    let text = std::fs::read_to_string(config).expect("read config");
    assert!(text.contains("[[persona]]"), "no persona in:\n{text}");
    let text = text.replacen(
        "[[persona]]",
        &format!("[metrics]\nbind = \"{bind}\"\n\n[[persona]]"),
        1,
    );
    std::fs::write(config, text).expect("write config");
}

/// Every sample of a scrape of `addr`'s `/metrics` (the gateway `gw`'s), by name and labels
/// (`name{a="x",b="y"}` with sorted labels), parsed as Prometheus text.
pub fn scrape(
    addr: std::net::SocketAddr,
    gw: &GatewayProcess,
) -> std::collections::HashMap<String, f64> {
    let (code, body) = crate::synapse::get(addr.port(), "/metrics", None)
        .unwrap_or_else(|| panic!("no answer to a scrape; log:\n{}", gw.log()));
    assert_eq!(code, 200, "{body}");
    let lines = body.lines().map(|l| Ok(l.to_owned()));
    let parsed = prometheus_parse::Scrape::parse(lines).expect("Prometheus text");
    parsed
        .samples
        .into_iter()
        .filter_map(|s| {
            let v = match s.value {
                prometheus_parse::Value::Counter(v)
                | prometheus_parse::Value::Gauge(v)
                | prometheus_parse::Value::Untyped(v) => v,
                _ => return None,
            };
            let mut labels: Vec<String> = s
                .labels
                .iter()
                .map(|(k, v)| format!("{k}=\"{v}\""))
                .collect();
            labels.sort();
            Some((format!("{}{{{}}}", s.metric, labels.join(",")), v))
        })
        .collect()
}

/// The sample `key` of a [`scrape`]; panics, naming what there is, when it is missing.
pub fn value(m: &std::collections::HashMap<String, f64>, key: &str) -> f64 {
    *m.get(key)
        .unwrap_or_else(|| panic!("no {key} in the scrape: {:?}", m.keys().collect::<Vec<_>>()))
}

/// A `[[persona]]` block for `@ID:localhost` on device `GW-ID` (upper case), her token written
/// to `DIR/ID.token` (mode 0600), with her rooms and operators, and `extra` lines after it
/// (a `[persona.session]` or `[persona.limits]` section).
pub fn persona_block(
    dir: &Path,
    id: &str,
    hs: &str,
    token: &str,
    rooms: &[&str],
    operators: &[&str],
    extra: &str,
) -> String {
    let token_file = dir.join(format!("{id}.token"));
    write_private(&token_file, token);
    let list = |v: &[&str]| {
        v.iter()
            .map(|s| format!("{s:?}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    format!(
        "\n[[persona]]\nid = \"{id}\"\nhomeserver = \"{hs}\"\nuser_id = \"@{id}:localhost\"\ndevice_id = \"GW-{device}\"\naccess_token_file = \"{file}\"\nrooms = [{rooms}]\noperators = [{ops}]\n{extra}\n",
        device = id.to_uppercase(),
        file = token_file.display(),
        rooms = list(rooms),
        ops = list(operators),
    )
}

/// Runs `cultnet-gateway ARGS --config CONFIG` (text logs) to its end.
pub fn run_cli(args: &[&str], config: &Path) -> std::process::Output {
    std::process::Command::new(gateway_bin())
        .args(["--log-format", "text"])
        .args(args)
        .arg("--config")
        .arg(config)
        .output()
        .expect("running cultnet-gateway")
}

/// A public room with alias `#ALIAS:localhost`, created by `client`.
pub async fn public_room(client: &Client, alias: &str) -> matrix_sdk::Room {
    use matrix_sdk::ruma::api::client::room::create_room::v3::{Request, RoomPreset};
    let mut req = Request::new();
    req.room_alias_name = Some(alias.to_owned());
    req.preset = Some(RoomPreset::PublicChat);
    client.create_room(req).await.expect("create room")
}

/// Syncs `reader` and says whether `user` has joined `room`.
pub async fn has_joined(
    reader: &Client,
    room: &matrix_sdk::Room,
    user: &matrix_sdk::ruma::UserId,
) -> bool {
    use matrix_sdk::ruma::events::room::member::MembershipState;
    sync(reader).await;
    room.get_member_no_sync(user)
        .await
        .ok()
        .flatten()
        .is_some_and(|m| *m.membership() == MembershipState::Join)
}

/// The usual cast: a Synapse in `DIR/hs`, Persona `vera` (password login on device
/// `GW-VERA`, the device [`persona`] configures) and her operator `ann` with a client.
pub struct Scene {
    /// The test's directory (see `scratch` for its lifetime).
    pub dir: PathBuf,
    /// The homeserver.
    pub hs: crate::synapse::Synapse,
    /// Its URL.
    pub url: String,
    /// The operator's client.
    pub ann: Client,
    /// Vera's access token for device `GW-VERA`.
    pub vera_token: String,
    /// Owns `dir`; last, so the homeserver stops before its files go.
    _scratch: crate::ScratchDir,
}

impl Scene {
    /// Starts the homeserver and registers the cast.
    pub async fn new(name: &str, limits: crate::synapse::Limits) -> Self {
        let scratch = crate::ScratchDir::new(name);
        let dir = scratch.path().to_path_buf();
        let hs = crate::synapse::Synapse::start(&dir.join("hs"), limits);
        hs.register("vera", "vera-pw");
        hs.register("ann", "ann-pw");
        let url = hs.url();
        let ann = user_client(&url, "ann", "ann-pw", &dir.join("ann")).await;
        let vera_token = token_for(&url, "vera", "vera-pw", "GW-VERA").await;
        Self {
            dir,
            hs,
            url,
            ann,
            vera_token,
            _scratch: scratch,
        }
    }
}
