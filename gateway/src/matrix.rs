//! A Persona's Matrix client: restored from her token with her own persistent store (state
//! and crypto, so encrypted rooms decrypt across restarts), checked before use, and the rules
//! for retrying failed requests.
//!
//! Start-up checks, each a typed [`MatrixError`] with what to do:
//! - a lost crypto store (a session was recorded here but the SDK store is gone) is refused:
//!   a new store for the old device id would make new identity keys, and every later
//!   encrypted message would be undecryptable;
//! - an own device key that differs from the one recorded at first start is refused for the
//!   same reason;
//! - a rejected token is reported for that Persona only.
//!
//! The SDK stores its own sync token before `sync_once` returns; after a crash it is ahead of
//! the gateway's, and the SDK would discard the replayed response as "the same sync response
//! twice" (facts/matrix-sdk.md). So before restoring the session the SDK's token is removed
//! whenever it differs from the inbox's.

use std::path::{Path, PathBuf};
use std::time::Duration;

use matrix_sdk::authentication::matrix::MatrixSession;
use matrix_sdk::config::RequestConfig;
use matrix_sdk::encryption::{BackupDownloadStrategy, EncryptionSettings};
use matrix_sdk::ruma::api::error::{ErrorKind, RetryAfter};
use matrix_sdk::store::{RoomLoadSettings, StateStoreDataKey};
use matrix_sdk::{Client, HttpError, SessionMeta, SessionTokens};
use serde::{Deserialize, Serialize};

use crate::config::{Persona, Secret};

/// Why a Persona's client could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum MatrixError {
    /// The homeserver refused her access token.
    #[error("persona {persona}: the homeserver rejected the access token ({errcode}); put a valid token for {user_id} (device {device_id}) in its file")]
    TokenRejected {
        /// Persona id.
        persona: String,
        /// Her user id.
        user_id: String,
        /// Her device id.
        device_id: String,
        /// Matrix errcode.
        errcode: String,
    },
    /// The SDK store is missing while a session was recorded.
    #[error("persona {persona}: the Matrix store {store} is missing but a session for device {device_id} was recorded in {record}. Restore the state directory from a backup, or log in again with a NEW device id (put it and the new token in the config) and run `cultnet-gateway recover --config FILE --persona {persona}` with her recovery key: her new device is signed and her room keys come back from her key backup; her inbox and sends are kept")]
    LostCryptoStore {
        /// Persona id.
        persona: String,
        /// Device id.
        device_id: String,
        /// The missing store.
        store: PathBuf,
        /// The session record.
        record: PathBuf,
    },
    /// Her device's identity key is not the one recorded at first start.
    #[error("persona {persona}: device {device_id} now has identity key {now}, but {recorded} was recorded at first start; the crypto store was replaced. Restore it from a backup or start over with a new device id (see the lost-store instructions in deploy/README.md)")]
    DeviceKeyChanged {
        /// Persona id.
        persona: String,
        /// Device id.
        device_id: String,
        /// Recorded key.
        recorded: String,
        /// Key now.
        now: String,
    },
    /// The config's user or device id is not valid Matrix syntax.
    #[error("persona {persona}: {what} {value:?} is not a valid Matrix id")]
    BadId {
        /// Persona id.
        persona: String,
        /// Which id.
        what: &'static str,
        /// The value.
        value: String,
    },
    /// The token belongs to another user or device than configured.
    #[error("persona {persona}: the token belongs to {actual}, but the config says {configured}")]
    WrongAccount {
        /// Persona id.
        persona: String,
        /// Configured user/device.
        configured: String,
        /// What the homeserver says.
        actual: String,
    },
    /// The SDK failed (store, homeserver unreachable, ...).
    #[error("persona {persona}: {context}: {source}")]
    Sdk {
        /// Persona id.
        persona: String,
        /// What was being done.
        context: &'static str,
        /// The SDK's error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// Her store passphrase could not be read.
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
    /// Reading or writing the session record.
    #[error("persona {persona}: session record {path}: {source}")]
    Record {
        /// Persona id.
        persona: String,
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

/// Wraps an SDK error as [`MatrixError::Sdk`], saying what was being done.
pub(crate) fn sdk<E: std::error::Error + Send + Sync + 'static>(
    persona: &str,
    context: &'static str,
) -> impl FnOnce(E) -> MatrixError {
    let persona = persona.to_owned();
    move |e| MatrixError::Sdk {
        persona,
        context,
        source: Box::new(e),
    }
}

/// What is recorded at a Persona's first start, to detect a replaced store later.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct SessionRecord {
    user_id: String,
    device_id: String,
    ed25519: Option<String>,
}

/// Where a Persona's Matrix files live under the state directory.
#[derive(Debug, Clone)]
pub struct Paths {
    /// `STATE/personas/ID/matrix`: the SDK's sqlite databases.
    pub store: PathBuf,
    /// `STATE/personas/ID/session.json`: user, device and identity key at first start.
    pub record: PathBuf,
}

impl Paths {
    /// The paths for Persona `id`.
    pub fn new(state_dir: &Path, id: &str) -> Self {
        let base = state_dir.join("personas").join(id);
        Self {
            store: base.join("matrix"),
            record: base.join("session.json"),
        }
    }

    /// The device her session record names, when the record is there and readable.
    pub fn recorded_device(&self) -> Option<String> {
        let bytes = std::fs::read(&self.record).ok()?;
        let record: SessionRecord = serde_json::from_slice(&bytes).ok()?;
        Some(record.device_id)
    }

    /// Whether her SDK store (its crypto database) is there.
    pub fn store_exists(&self) -> bool {
        self.store.join("matrix-sdk-crypto.sqlite3").exists()
    }
}

/// Requests give up after this; the ear and mouth do their own retrying with backoff.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(60);

/// Builds her client from the store, makes the SDK's sync token agree with `inbox_token`,
/// restores the session from her token and checks it with the homeserver. The caller must
/// run one `sync_once` right away: her device uploads its keys there, and a message encrypted
/// to her before that is lost to her.
pub async fn connect(
    persona: &Persona,
    state_dir: &Path,
    token: &Secret,
    inbox_token: Option<&str>,
) -> Result<Client, MatrixError> {
    let id = persona.id.as_str();
    let paths = Paths::new(state_dir, id);
    let record: Option<SessionRecord> = match std::fs::read(&paths.record) {
        // An unreadable record must not pass for a missing one: that would skip the checks.
        Ok(bytes) => Some(
            serde_json::from_slice(&bytes).map_err(|e| MatrixError::Record {
                persona: id.to_owned(),
                path: paths.record.clone(),
                source: std::io::Error::new(std::io::ErrorKind::InvalidData, e),
            })?,
        ),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => {
            return Err(MatrixError::Record {
                persona: id.to_owned(),
                path: paths.record.clone(),
                source: e,
            })
        }
    };
    if record.is_some() && !paths.store_exists() {
        return Err(MatrixError::LostCryptoStore {
            persona: id.to_owned(),
            device_id: persona.device_id.clone(),
            store: paths.store.clone(),
            record: paths.record.clone(),
        });
    }
    let user_id =
        matrix_sdk::ruma::OwnedUserId::try_from(persona.user_id.as_str()).map_err(|_| {
            MatrixError::BadId {
                persona: id.to_owned(),
                what: "user_id",
                value: persona.user_id.clone(),
            }
        })?;
    let device_id: matrix_sdk::ruma::OwnedDeviceId = persona.device_id.as_str().into();
    std::fs::create_dir_all(&paths.store).map_err(|e| MatrixError::Record {
        persona: id.to_owned(),
        path: paths.store.clone(),
        source: e,
    })?;
    let passphrase = persona.load_store_passphrase()?;
    let client = Client::builder()
        .homeserver_url(&persona.homeserver)
        .sqlite_store(&paths.store, passphrase.as_ref().map(Secret::expose))
        // Her identity is set up by `identity::secure` (with the operator's password when the
        // homeserver asks), not in the background where a failure would only be logged.
        .with_encryption_settings(EncryptionSettings {
            auto_enable_cross_signing: false,
            auto_enable_backups: false,
            backup_download_strategy: BackupDownloadStrategy::AfterDecryptionFailure,
        })
        .request_config(
            RequestConfig::new()
                .disable_retry()
                .timeout(REQUEST_TIMEOUT),
        )
        .build()
        .await
        .map_err(sdk(
            id,
            if passphrase.is_some() {
                "opening the Matrix store (a store made without this passphrase, or with another one, does not open)"
            } else {
                "opening the Matrix store (a store made with a passphrase needs encryption.store_passphrase_file)"
            },
        ))?;
    let store = client.state_store();
    let sdk_token = store
        .get_kv_data(StateStoreDataKey::SyncToken)
        .await
        .map_err(sdk(id, "reading the SDK's sync token"))?
        .and_then(|v| v.into_sync_token());
    if sdk_token.as_deref() != inbox_token {
        tracing::debug!(
            persona = id,
            "SDK sync token differs from the inbox's; removing it"
        );
        store
            .remove_kv_data(StateStoreDataKey::SyncToken)
            .await
            .map_err(sdk(id, "removing the SDK's sync token"))?;
    }
    client
        .matrix_auth()
        .restore_session(
            MatrixSession {
                meta: SessionMeta {
                    user_id: user_id.clone(),
                    device_id: device_id.clone(),
                },
                tokens: SessionTokens {
                    access_token: token.expose().to_owned(),
                    refresh_token: None,
                },
            },
            RoomLoadSettings::default(),
        )
        .await
        .map_err(sdk(id, "restoring the session"))?;
    let who = client.whoami().await.map_err(|e| match classify_http(&e) {
        Failure::Unauthorized { errcode } => MatrixError::TokenRejected {
            persona: id.to_owned(),
            user_id: persona.user_id.clone(),
            device_id: persona.device_id.clone(),
            errcode,
        },
        _ => sdk(id, "checking the token (whoami)")(e),
    })?;
    if who.user_id != user_id || who.device_id.as_ref().is_some_and(|d| *d != device_id) {
        return Err(MatrixError::WrongAccount {
            persona: id.to_owned(),
            configured: format!("{user_id} device {device_id}"),
            actual: format!(
                "{} device {}",
                who.user_id,
                who.device_id.as_ref().map_or("?", |d| d.as_str())
            ),
        });
    }
    let key = client.encryption().ed25519_key().await;
    match record {
        Some(r) if r.ed25519.is_some() && key.is_some() && r.ed25519 != key => {
            return Err(MatrixError::DeviceKeyChanged {
                persona: id.to_owned(),
                device_id: persona.device_id.clone(),
                recorded: r.ed25519.unwrap_or_default(),
                now: key.unwrap_or_default(),
            })
        }
        Some(r) if r.ed25519.is_some() || key.is_none() => {}
        _ => {
            let rec = SessionRecord {
                user_id: persona.user_id.clone(),
                device_id: persona.device_id.clone(),
                ed25519: key,
            };
            let bytes = serde_json::to_vec_pretty(&rec).unwrap_or_default();
            std::fs::write(&paths.record, bytes).map_err(|e| MatrixError::Record {
                persona: id.to_owned(),
                path: paths.record.clone(),
                source: e,
            })?;
        }
    }
    Ok(client)
}

/// How a failed request should be treated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Failure {
    /// Worth retrying: network errors, 5xx, 429 (with the server's wait when it gave one).
    Transient {
        /// The server's `Retry-After` / `retry_after_ms`.
        retry_after: Option<Duration>,
    },
    /// The token is not (or no longer) valid.
    Unauthorized {
        /// Matrix errcode.
        errcode: String,
    },
    /// Refused for good (4xx other than 429).
    Permanent {
        /// HTTP status.
        status: u16,
        /// Matrix errcode (or `M_UNKNOWN`).
        errcode: String,
        /// The server's message.
        message: String,
    },
}

/// Classifies an SDK error.
pub fn classify(e: &matrix_sdk::Error) -> Failure {
    match e {
        matrix_sdk::Error::Http(h) => classify_http(h),
        _ => Failure::Transient { retry_after: None },
    }
}

/// Classifies an HTTP error by status, errcode and the server's requested wait.
pub fn classify_http(e: &HttpError) -> Failure {
    let Some(api) = e.as_client_api_error() else {
        return Failure::Transient { retry_after: None };
    };
    let status = api.status_code.as_u16();
    let kind = api.error_kind();
    if let Some(ErrorKind::LimitExceeded(data)) = kind {
        let retry_after = data.retry_after.as_ref().map(|r| match r {
            RetryAfter::Delay(d) => *d,
            RetryAfter::DateTime(t) => t
                .duration_since(std::time::SystemTime::now())
                .unwrap_or_default(),
        });
        return Failure::Transient { retry_after };
    }
    let errcode = kind.map_or_else(|| "M_UNKNOWN".to_owned(), |k| k.errcode().to_string());
    match status {
        401 => Failure::Unauthorized { errcode },
        429 | 500.. => Failure::Transient { retry_after: None },
        _ => Failure::Permanent {
            status,
            errcode,
            message: api.to_string(),
        },
    }
}

/// Exponential backoff with a cap; a wait the server asked for is used as given.
#[derive(Debug, Clone)]
pub struct Backoff {
    next: Duration,
    min: Duration,
    max: Duration,
}

impl Backoff {
    /// Starts at `min`, doubles to `max`.
    pub fn new(min: Duration, max: Duration) -> Self {
        Self {
            next: min,
            min,
            max,
        }
    }

    /// The wait before the next attempt.
    pub fn next(&mut self, retry_after: Option<Duration>) -> Duration {
        let ours = self.next;
        self.next = (self.next * 2).min(self.max);
        retry_after.unwrap_or(ours)
    }

    /// After a success.
    pub fn reset(&mut self) {
        self.next = self.min;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_to_its_cap_honours_the_server_and_resets() {
        let mut b = Backoff::new(Duration::from_millis(100), Duration::from_millis(1000));
        let waits: Vec<_> = (0..6).map(|_| b.next(None).as_millis()).collect();
        assert_eq!(waits, [100, 200, 400, 800, 1000, 1000]);
        assert_eq!(b.next(Some(Duration::from_secs(4))), Duration::from_secs(4));
        b.reset();
        assert_eq!(b.next(None), Duration::from_millis(100));
        // A server wait shorter than ours is honoured as given (it knows its limits).
        assert_eq!(
            b.next(Some(Duration::from_millis(50))),
            Duration::from_millis(50)
        );
    }

    #[test]
    fn a_lost_store_is_refused_with_recovery_steps() {
        let dir = crate::scratch::Dir::new("lost");
        let paths = Paths::new(&dir, "vera");
        std::fs::create_dir_all(paths.record.parent().unwrap()).unwrap();
        std::fs::write(
            &paths.record,
            r#"{"user_id":"@vera:localhost","device_id":"VERA","ed25519":"k"}"#,
        )
        .unwrap();
        let persona: Persona = crate::config::Config::parse(&format!(
            r#"state_dir = "{}"
[[persona]]
id = "vera"
homeserver = "http://127.0.0.1:1"
user_id = "@vera:localhost"
device_id = "VERA"
access_token_file = "/nonexistent"
"#,
            dir.display()
        ))
        .unwrap()
        .personas
        .remove(0);
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let err = rt
            .block_on(connect(&persona, &dir, &Secret::new("t".into()), None))
            .unwrap_err();
        assert!(matches!(err, MatrixError::LostCryptoStore { .. }), "{err}");
        let text = err.to_string();
        assert!(
            text.contains("NEW device id")
                && text.contains("session.json")
                && text.contains("cultnet-gateway recover"),
            "{text}"
        );
        // An unreadable record is an error, not a missing record (which would skip the check).
        std::fs::write(&paths.record, "{not json").unwrap();
        let err = rt
            .block_on(connect(&persona, &dir, &Secret::new("t".into()), None))
            .unwrap_err();
        assert!(matches!(err, MatrixError::Record { .. }), "{err}");
    }
}
