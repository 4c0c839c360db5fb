//! Her cryptographic identity on Matrix: her device signed by her own cross-signing identity
//! (clients that only read cross-signed devices read her), her room keys in a server-side key
//! backup, and the recovery key that opens both on a new device.
//!
//! - [`secure`] runs at every start, after her first sync: it bootstraps cross-signing once
//!   (asking her password file only when the homeserver asks for one), signs this device from
//!   her secret storage when her identity exists but this device does not hold its keys,
//!   turns key backup on, and writes a new recovery key once, to a 0600 file the operator is
//!   told to keep elsewhere. Each later start only checks.
//! - [`recover`] brings her back after her Matrix store is lost: her new device (a new token
//!   with a new device id) is signed from her secret storage with her recovery key, and her
//!   key backup is turned on for it, so the ear finds the keys of messages sent to the lost
//!   device. Her inbox, sync position and sends are not touched: nothing pending is lost or
//!   delivered twice.

use std::path::{Path, PathBuf};

use matrix_sdk::encryption::recovery::RecoveryState;
use matrix_sdk::ruma::api::client::uiaa;
use matrix_sdk::Client;

use crate::config::{ConfigError, Persona, Secret};
use crate::matrix::{MatrixError, Paths};

/// Why her identity could not be secured or recovered.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum IdentityError {
    /// The homeserver wants her password to accept her first cross-signing keys.
    #[error("persona {persona}: the homeserver asks for her password to accept her cross-signing keys; put it in a file (mode 0600) named by encryption.password_file, and restart")]
    PasswordNeeded {
        /// Persona id.
        persona: String,
    },
    /// Her identity exists, but this device cannot sign itself without her recovery key.
    #[error("persona {persona}: her cross-signing identity exists but this device does not hold its keys; put her recovery key in {path} (mode 0600), or sign this device from one of her other clients")]
    RecoveryKeyNeeded {
        /// Persona id.
        persona: String,
        /// Where the key is looked for.
        path: PathBuf,
    },
    /// The recovery key does not open her secret storage.
    #[error(
        "persona {persona}: the recovery key in {path} does not open her secret storage: {reason}"
    )]
    WrongRecoveryKey {
        /// Persona id.
        persona: String,
        /// The key's file.
        path: PathBuf,
        /// The SDK's reason.
        reason: String,
    },
    /// Her account has no secret storage, but a recovery key file is there.
    #[error("persona {persona}: {path} holds a recovery key but her account has no secret storage (it was reset elsewhere); move the file away and restart to make a new one")]
    StaleRecoveryKey {
        /// Persona id.
        persona: String,
        /// The key's file.
        path: PathBuf,
    },
    /// `recover` on a device whose store is the one recorded.
    #[error("persona {persona}: device {device_id} is the device her lost store belonged to; log in again to get a token for a NEW device id, put both in the config, then run recover")]
    SameDevice {
        /// Persona id.
        persona: String,
        /// The device id.
        device_id: String,
    },
    /// `recover` when nothing is lost.
    #[error("persona {persona}: her Matrix store {store} is present and of device {device_id}: there is nothing to recover")]
    NothingLost {
        /// Persona id.
        persona: String,
        /// The store.
        store: PathBuf,
        /// Its device.
        device_id: String,
    },
    /// Reading her key files.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// Her client, the SDK or the homeserver.
    #[error(transparent)]
    Matrix(#[from] MatrixError),
    /// A file of hers could not be written or moved.
    #[error("persona {persona}: {path}: {source}")]
    File {
        /// Persona id.
        persona: String,
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

/// A failure of the SDK or the homeserver while `context` was being done.
fn sdk<E: std::error::Error + Send + Sync + 'static>(
    persona: &str,
    context: &'static str,
) -> impl FnOnce(E) -> IdentityError {
    let wrap = crate::matrix::sdk(persona, context);
    move |e| IdentityError::Matrix(wrap(e))
}

/// What her identity looks like after [`secure`] or [`recover`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Standing {
    /// This device is signed by her self-signing key.
    pub cross_signed: bool,
    /// Her room keys go to a server-side key backup.
    pub backup: bool,
    /// Her recovery key's file exists.
    pub recovery_key_present: bool,
}

/// Makes sure her device is cross-signed and her keys are backed up; see the module doc.
/// Run after her first sync (her device keys must be on the homeserver).
pub async fn secure(
    client: &Client,
    persona: &Persona,
    state_dir: &Path,
) -> Result<Standing, IdentityError> {
    let id = persona.id.as_str();
    let enc = client.encryption();
    enc.wait_for_e2ee_initialization_tasks().await;
    let path = persona.recovery_key_path(state_dir);
    let key = persona.load_recovery_key(state_dir)?;
    let has_keys = enc
        .cross_signing_status()
        .await
        .is_some_and(|s| s.is_complete());
    if !has_keys {
        let user = client
            .user_id()
            .ok_or_else(|| {
                sdk(id, "reading her user id")(std::io::Error::other("the client is not logged in"))
            })?
            .to_owned();
        let identity = enc
            .request_user_identity(&user)
            .await
            .map_err(sdk(id, "querying her cross-signing identity"))?;
        if identity.is_some() {
            let Some(key) = &key else {
                return Err(IdentityError::RecoveryKeyNeeded {
                    persona: id.to_owned(),
                    path,
                });
            };
            open_secret_storage(client, persona, key, &path).await?;
        } else {
            bootstrap(client, persona).await?;
            tracing::info!(
                persona = id,
                "cross-signing set up: her device is signed by her own identity"
            );
        }
    }
    let recovery = enc.recovery();
    match recovery.state() {
        RecoveryState::Enabled => {}
        RecoveryState::Incomplete => match &key {
            Some(key) => open_secret_storage(client, persona, key, &path).await?,
            None => {
                return Err(IdentityError::RecoveryKeyNeeded {
                    persona: id.to_owned(),
                    path,
                })
            }
        },
        RecoveryState::Disabled | RecoveryState::Unknown => {
            if key.is_some() {
                return Err(IdentityError::StaleRecoveryKey {
                    persona: id.to_owned(),
                    path,
                });
            }
            let new_key = recovery
                .enable()
                .wait_for_backups_to_upload()
                .await
                .map_err(sdk(id, "turning on key backup and secret storage"))?;
            if let Some(dir) = path.parent() {
                std::fs::create_dir_all(dir).map_err(|e| IdentityError::File {
                    persona: id.to_owned(),
                    path: dir.to_owned(),
                    source: e,
                })?;
            }
            crate::config::write_private(&path, &new_key).map_err(|e| IdentityError::File {
                persona: id.to_owned(),
                path: path.clone(),
                source: e,
            })?;
            tracing::warn!(
                persona = id,
                file = %path.display(),
                "her recovery key was made and written; keep a copy away from this machine: with it, `recover` brings her back after a lost store"
            );
        }
    }
    standing(client, persona, &path).await
}

/// Signs this device from her secret storage and turns on her key backup.
async fn open_secret_storage(
    client: &Client,
    persona: &Persona,
    key: &Secret,
    path: &Path,
) -> Result<(), IdentityError> {
    client
        .encryption()
        .recovery()
        .recover(key.expose())
        .await
        .map_err(|e| IdentityError::WrongRecoveryKey {
            persona: persona.id.clone(),
            path: path.to_owned(),
            reason: e.to_string(),
        })?;
    tracing::info!(
        persona = %persona.id,
        "her device is signed from her secret storage; key backup on"
    );
    Ok(())
}

/// Uploads a new cross-signing identity, with her password when the homeserver asks for it.
async fn bootstrap(client: &Client, persona: &Persona) -> Result<(), IdentityError> {
    let id = persona.id.as_str();
    let enc = client.encryption();
    let Err(first) = enc.bootstrap_cross_signing(None).await else {
        return Ok(());
    };
    let Some(uiaa) = first.as_uiaa_response() else {
        return Err(sdk(id, "uploading her cross-signing keys")(first));
    };
    let Some(password) = persona.load_password()? else {
        return Err(IdentityError::PasswordNeeded {
            persona: id.to_owned(),
        });
    };
    enc.bootstrap_cross_signing(Some(password_auth(persona, &password, uiaa)))
        .await
        .map_err(sdk(
            id,
            "uploading her cross-signing keys with her password",
        ))
}

/// The answer to the homeserver's user-interactive auth `uiaa`: her password.
fn password_auth(persona: &Persona, password: &Secret, uiaa: &uiaa::UiaaInfo) -> uiaa::AuthData {
    let mut auth = uiaa::Password::new(
        uiaa::UserIdentifier::Matrix(uiaa::MatrixUserIdentifier::new(persona.user_id.clone())),
        password.expose().to_owned(),
    );
    auth.session = uiaa.session.clone();
    uiaa::AuthData::Password(auth)
}

/// Reads her standing back from the store and the homeserver.
async fn standing(
    client: &Client,
    persona: &Persona,
    path: &Path,
) -> Result<Standing, IdentityError> {
    let id = persona.id.as_str();
    let enc = client.encryption();
    let cross_signed = enc
        .get_own_device()
        .await
        .map_err(sdk(id, "reading her own device"))?
        .is_some_and(|d| d.is_cross_signed_by_owner());
    Ok(Standing {
        cross_signed,
        backup: enc.backups().are_enabled().await,
        recovery_key_present: path.exists(),
    })
}

/// What [`recover`] did.
#[derive(Debug, Clone)]
pub struct Recovered {
    /// The lost device (from her session record), if one was recorded.
    pub old_device: Option<String>,
    /// Whether the old device was deleted from her account (needs her password file).
    pub old_device_deleted: bool,
    /// Where the remains of the lost store were moved, if anything was there.
    pub moved: Vec<PathBuf>,
    /// Her identity afterwards.
    pub standing: Standing,
}

/// Brings her back on a new device after her store was lost; see the module doc. The caller
/// holds the inbox (so no gateway runs with this state directory) and passes her token.
pub async fn recover(
    persona: &Persona,
    state_dir: &Path,
    token: &Secret,
) -> Result<Recovered, IdentityError> {
    let id = persona.id.as_str();
    let paths = Paths::new(state_dir, id);
    let old_device = paths.recorded_device();
    if old_device.as_deref() == Some(persona.device_id.as_str()) {
        if paths.store_exists() {
            return Err(IdentityError::NothingLost {
                persona: id.to_owned(),
                store: paths.store.clone(),
                device_id: persona.device_id.clone(),
            });
        }
        return Err(IdentityError::SameDevice {
            persona: id.to_owned(),
            device_id: persona.device_id.clone(),
        });
    }
    let path = persona.recovery_key_path(state_dir);
    let Some(key) = persona.load_recovery_key(state_dir)? else {
        return Err(IdentityError::RecoveryKeyNeeded {
            persona: id.to_owned(),
            path,
        });
    };
    // Read before anything is moved: a password file that cannot be read stops here.
    let password = persona.load_password()?;
    // What is left of the lost store is kept aside, never deleted.
    let stamp = crate::clock::unix_ms();
    let mut moved = Vec::new();
    for from in [&paths.store, &paths.record] {
        if from.exists() {
            let mut to = from.clone().into_os_string();
            to.push(format!(".lost-{stamp}"));
            let to = PathBuf::from(to);
            std::fs::rename(from, &to).map_err(|e| IdentityError::File {
                persona: id.to_owned(),
                path: from.clone(),
                source: e,
            })?;
            moved.push(to);
        }
    }
    let client = crate::matrix::connect(persona, state_dir, token, None).await?;
    // Her new device's keys go up in a sync; no room is asked for: the ear reads them from
    // the inbox's position when the gateway starts.
    use matrix_sdk::ruma::api::client::filter::{Filter, FilterDefinition};
    use matrix_sdk::ruma::api::client::sync::sync_events::v3::Filter as SyncFilter;
    let mut filter = FilterDefinition::with_lazy_loading();
    filter.room.rooms = Some(Vec::new());
    filter.presence = Filter::ignore_all();
    client
        .sync_once(
            matrix_sdk::config::SyncSettings::default()
                .filter(SyncFilter::FilterDefinition(filter))
                .timeout(std::time::Duration::ZERO),
        )
        .await
        .map_err(sdk(id, "uploading her new device's keys (sync)"))?;
    client
        .encryption()
        .wait_for_e2ee_initialization_tasks()
        .await;
    open_secret_storage(&client, persona, &key, &path).await?;
    let mut deleted = false;
    if let (Some(old), Some(password)) = (&old_device, &password) {
        deleted = delete_device(&client, persona, old, password).await?;
    }
    let standing = standing(&client, persona, &path).await?;
    Ok(Recovered {
        old_device,
        old_device_deleted: deleted,
        moved,
        standing,
    })
}

/// Deletes her lost device from her account (others stop encrypting to it); `false` when the
/// homeserver no longer knows it.
async fn delete_device(
    client: &Client,
    persona: &Persona,
    device: &str,
    password: &Secret,
) -> Result<bool, IdentityError> {
    let id = persona.id.as_str();
    let devices = [matrix_sdk::ruma::OwnedDeviceId::from(device)];
    let Err(first) = client.delete_devices(&devices, None).await else {
        return Ok(true);
    };
    if first
        .as_client_api_error()
        .is_some_and(|e| e.status_code.as_u16() == 404)
    {
        return Ok(false);
    }
    let Some(uiaa) = first.as_uiaa_response() else {
        return Err(sdk(id, "deleting her lost device")(first));
    };
    client
        .delete_devices(&devices, Some(password_auth(persona, password, uiaa)))
        .await
        .map_err(sdk(id, "deleting her lost device with her password"))?;
    Ok(true)
}
