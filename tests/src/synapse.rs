//! A real Synapse homeserver on loopback for a test: installed by `deploy/synapse/install.sh`,
//! configured by `deploy/synapse/configure.sh`, started in the foreground (the test owns the
//! process), stopped with SIGTERM when the handle is dropped.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use serde_json::Value;

fn deploy(file: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../deploy/synapse")
        .join(file)
}

/// The venv holding the pinned Synapse, installing it on first use.
pub fn venv() -> PathBuf {
    static VENV: OnceLock<PathBuf> = OnceLock::new();
    VENV.get_or_init(|| {
        let out = Command::new("bash")
            .arg(deploy("install.sh"))
            .output()
            .expect("running install.sh");
        assert!(
            out.status.success(),
            "install.sh failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        PathBuf::from(String::from_utf8_lossy(&out.stdout).trim())
    })
    .clone()
}

/// Rate limits: Synapse's defaults (429s come quickly) or lifted for load tests.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Limits {
    /// Synapse's defaults.
    Default,
    /// Effectively none.
    Relaxed,
}

/// A registered user.
#[derive(Clone, Debug)]
pub struct User {
    /// `@name:localhost`.
    pub user_id: String,
    /// Its access token.
    pub access_token: String,
    /// Its device.
    pub device_id: String,
}

/// A running homeserver.
#[derive(Debug)]
pub struct Synapse {
    child: Option<Child>,
    /// Its data directory.
    pub dir: PathBuf,
    /// Its port on 127.0.0.1.
    pub port: u16,
    secret: String,
}

impl Synapse {
    /// Configures a fresh server in `dir` and starts it; returns once it answers.
    pub fn start(dir: &Path, limits: Limits) -> Self {
        let port = free_port();
        let venv = venv();
        let mode = if limits == Limits::Relaxed {
            "relaxed"
        } else {
            "default"
        };
        let out = Command::new("bash")
            .arg(deploy("configure.sh"))
            .arg(&venv)
            .arg(dir)
            .arg(port.to_string())
            .arg(mode)
            .output()
            .expect("running configure.sh");
        assert!(
            out.status.success(),
            "configure.sh failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let secret = String::from_utf8_lossy(&out.stdout).trim().to_owned();
        let mut s = Self {
            child: None,
            dir: dir.to_path_buf(),
            port,
            secret,
        };
        s.launch();
        s
    }

    /// `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Registers a (non-admin) user with the shared secret.
    pub fn register(&self, name: &str, password: &str) -> User {
        let out = Command::new(venv().join("bin/python"))
            .arg(deploy("register.py"))
            .args([&self.url(), &self.secret, name, password])
            .output()
            .expect("running register.py");
        assert!(
            out.status.success(),
            "register {name}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let v: Value = serde_json::from_slice(&out.stdout).expect("register reply");
        User {
            user_id: v["user_id"].as_str().unwrap_or_default().to_owned(),
            access_token: v["access_token"].as_str().unwrap_or_default().to_owned(),
            device_id: v["device_id"].as_str().unwrap_or_default().to_owned(),
        }
    }

    /// Stops the server (SIGTERM, then kill after 10 s); its data stays for [`Synapse::restart`].
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = Command::new("kill")
                .args(["-TERM", &child.id().to_string()])
                .status();
            let deadline = Instant::now() + Duration::from_secs(10);
            while Instant::now() < deadline {
                if let Ok(Some(_)) = child.try_wait() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts a stopped server again on the same port and data.
    pub fn restart(&mut self) {
        self.stop();
        self.launch();
    }

    /// Whether the server answers `/versions` right now.
    pub fn is_up(&self) -> bool {
        matches!(
            get(self.port, "/_matrix/client/versions", None),
            Some((200, _))
        )
    }

    fn launch(&mut self) {
        let child = Command::new(venv().join("bin/python"))
            .args(["-m", "synapse.app.homeserver", "-c"])
            .arg(self.dir.join("homeserver.yaml"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("starting Synapse");
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(60);
        while !self.is_up() {
            assert!(
                Instant::now() < deadline,
                "Synapse did not answer within 60 s (log: {})",
                self.dir.join("homeserver.log").display()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for Synapse {
    fn drop(&mut self) {
        self.stop();
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

/// A minimal HTTP/1.1 GET on loopback (status, body), for readiness checks and smoke tests.
pub fn get(port: u16, path: &str, token: Option<&str>) -> Option<(u16, String)> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    let auth = token
        .map(|t| format!("Authorization: Bearer {t}\r\n"))
        .unwrap_or_default();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n{auth}Connection: close\r\n\r\n"
    )
    .ok()?;
    let mut resp = String::new();
    s.read_to_string(&mut resp).ok()?;
    let status = resp.split_whitespace().nth(1)?.parse().ok()?;
    let body = resp
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    Some((status, body))
}
