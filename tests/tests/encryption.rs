//! Encryption that Matrix clients trust, end to end (`cultnet-gateway run`, a real Synapse, the
//! real claude CLI against the mock Messages API), read by an operator's matrix-sdk client set
//! to decrypt only messages from cross-signed devices, as clients are moving to (MSC4153):
//! - her device is signed by her own cross-signing identity at her first start (her self-signing
//!   key's signature is on her device keys in `/keys/query`), her key backup is on, and her
//!   recovery key is written once, private; `check` says so, and warns when cross-signing is off;
//! - after her Matrix store is lost, `recover` with a new device's token and her recovery key
//!   signs the new device; a message sent to the lost device is decrypted with the key from her
//!   backup (not delivered as a placeholder), every pending line is answered once, and a new
//!   message is answered too.

use std::path::Path;
use std::time::{Duration, Instant};

use matrix_sdk::ruma::events::room::message::RoomMessageEventContent;
use matrix_sdk::Client;
use matrix_sdk_crypto::{DecryptionSettings, TrustRequirement};
use serde_json::{json, Value};
use tests::live::{from_vera, live_section, open_dm, wait_for_reply};
use tests::matrix::{run_cli, sync, token_for, write_config, write_private, GatewayProcess, Scene};
use tests::mock_api::{MockApi, MockConfig};
use tests::synapse::Limits;

/// Ann on a device of her own that decrypts only what cross-signed devices sent.
async fn strict_ann(url: &str, dir: &Path) -> Client {
    let client = Client::builder()
        .homeserver_url(url)
        .sqlite_store(dir, None)
        .with_decryption_settings(DecryptionSettings {
            sender_device_trust_requirement: TrustRequirement::CrossSigned,
        })
        .build()
        .await
        .expect("client");
    client
        .matrix_auth()
        .login_username("ann", "ann-pw")
        .device_id("ANN-STRICT")
        .send()
        .await
        .expect("login");
    sync(&client).await;
    client
}

/// Vera's config: live against `mock`, ann her operator, her password in a private file, and
/// `extra` lines in her `[persona.encryption]`.
fn config(scene: &Scene, mock: &MockApi, token: &str, extra: &str) -> std::path::PathBuf {
    let (session, _) = live_section(&scene.dir, mock, 200, "");
    let password = scene.dir.join("vera.password");
    write_private(&password, "vera-pw");
    let encryption = format!(
        "\n[persona.encryption]\npassword_file = \"{}\"\n{extra}\n",
        password.display()
    );
    write_config(
        &scene.dir,
        &scene.url,
        token,
        &[],
        &["@ann:localhost"],
        &format!("{session}{encryption}"),
    )
}

/// GET `path` of the client API with `token`; the JSON answer.
async fn get(url: &str, token: &str, path: &str) -> Value {
    let text = matrix_sdk::reqwest::Client::new()
        .get(format!("{url}/_matrix/client/v3/{path}"))
        .bearer_auth(token)
        .send()
        .await
        .expect("request")
        .text()
        .await
        .expect("answer");
    serde_json::from_str(&text).expect("JSON")
}

/// Whether `device` of vera carries her self-signing key's signature, as any client reads it.
async fn signed_by_her_identity(url: &str, token: &str, device: &str) -> bool {
    let body = json!({"device_keys": {"@vera:localhost": []}});
    let text = matrix_sdk::reqwest::Client::new()
        .post(format!("{url}/_matrix/client/v3/keys/query"))
        .bearer_auth(token)
        .body(body.to_string())
        .send()
        .await
        .expect("keys/query")
        .text()
        .await
        .expect("answer");
    let keys: Value = serde_json::from_str(&text).expect("JSON");
    let Some(ssk) = keys["self_signing_keys"]["@vera:localhost"]["keys"]
        .as_object()
        .and_then(|k| k.keys().next().cloned())
    else {
        return false;
    };
    keys["device_keys"]["@vera:localhost"][device]["signatures"]["@vera:localhost"]
        .get(&ssk)
        .is_some()
}

/// Waits until her key backup holds a room key of `room`.
async fn until_backed_up(url: &str, token: &str, room: &str, gw: &GatewayProcess) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let version = get(url, token, "room_keys/version").await;
        if let Some(v) = version["version"].as_str() {
            let keys = get(url, token, &format!("room_keys/keys?version={v}")).await;
            if keys["rooms"][room]["sessions"]
                .as_object()
                .is_some_and(|s| !s.is_empty())
            {
                return;
            }
        }
        assert!(
            Instant::now() < deadline,
            "her room key was not backed up; log:\n{}",
            gw.log()
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

fn check_lines(config: &Path) -> String {
    let out = run_cli(&["check"], config);
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn her_device_is_cross_signed_and_a_client_trusting_only_such_devices_reads_her() {
    let scene = Scene::new("enc-signed", Limits::Relaxed).await;
    let ann = strict_ann(&scene.url, &scene.dir.join("ann-strict")).await;
    let mock = MockApi::start(MockConfig::default()).await.unwrap();
    // Cross-signing off: she runs, and check warns.
    let config = config(&scene, &mock, &scene.vera_token, "cross_signing = false");
    let lines = check_lines(&config);
    assert!(
        lines.contains("warn  vera: cross-signing: off"),
        "check:\n{lines}"
    );

    // Her store encrypted at rest with a passphrase of her own.
    let passphrase = scene.dir.join("store.passphrase");
    write_private(&passphrase, "a passphrase for her store");
    let config = self::config(
        &scene,
        &mock,
        &scene.vera_token,
        &format!("store_passphrase_file = \"{}\"", passphrase.display()),
    );
    let gw = GatewayProcess::start(&config);
    let dm = open_dm(&ann, &gw).await;
    mock.script(json!({"say": [{"room": dm.room_id().to_string(), "text": "hello ann"}]}));
    dm.send(RoomMessageEventContent::text_plain("hello vera"))
        .await
        .unwrap();
    let got = wait_for_reply(&ann, &dm, "hello ann", Duration::from_secs(90)).await;
    assert_eq!(
        got,
        ["hello ann"],
        "a client reading only cross-signed devices did not read her; log:\n{}",
        gw.log()
    );
    assert!(signed_by_her_identity(&scene.url, &scene.vera_token, "GW-VERA").await);
    let key = scene.dir.join("state/personas/vera/recovery-key");
    let mode =
        std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(&key).unwrap().permissions());
    assert_eq!(mode & 0o777, 0o600, "her recovery key is not private");
    let written = std::fs::read_to_string(&key).unwrap();
    assert!(gw.log().contains("her recovery key was made and written"));
    let backup = get(&scene.url, &scene.vera_token, "room_keys/version").await;
    assert!(backup["version"].is_string(), "no key backup: {backup}");

    // A restart only checks: the same key, no new one.
    gw.stop();
    let gw = GatewayProcess::start(&config);
    gw.wait_log("her identity", Duration::from_secs(60));
    assert_eq!(std::fs::read_to_string(&key).unwrap(), written);
    assert!(
        !gw.log().contains("her recovery key was made"),
        "log:\n{}",
        gw.log()
    );
    let lines = check_lines(&config);
    for want in [
        "ok    vera: cross-signing: device GW-VERA is signed by her identity",
        "ok    vera: key backup: on",
        "ok    vera: recovery key:",
    ] {
        assert!(lines.contains(want), "{want:?} missing; check:\n{lines}");
    }
    gw.stop();

    // Her store does not open with another passphrase, and says why.
    write_private(&passphrase, "another passphrase");
    let out = run_cli(&["run"], &config);
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success()
            && log.contains("persona vera not started")
            && log.contains("does not open"),
        "log:\n{log}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_lost_store_recover_brings_her_back_and_nothing_pending_is_lost_or_doubled() {
    let scene = Scene::new("enc-recover", Limits::Relaxed).await;
    let ann = strict_ann(&scene.url, &scene.dir.join("ann-strict")).await;
    let mock = MockApi::start(MockConfig::default()).await.unwrap();
    let config = config(&scene, &mock, &scene.vera_token, "");
    let gw = GatewayProcess::start(&config);
    let dm = open_dm(&ann, &gw).await;
    let room = dm.room_id().to_string();
    mock.script(json!({"say": [{"room": room, "text": "answer one"}]}));
    dm.send(RoomMessageEventContent::text_plain("one"))
        .await
        .unwrap();
    wait_for_reply(&ann, &dm, "answer one", Duration::from_secs(90)).await;
    until_backed_up(&scene.url, &scene.vera_token, &room, &gw).await;
    gw.stop();

    // Sent to her lost device while she was down: its key is only in her backup.
    dm.send(RoomMessageEventContent::text_plain("two"))
        .await
        .unwrap();
    std::fs::remove_dir_all(scene.dir.join("state/personas/vera/matrix")).unwrap();
    let lines = check_lines(&config);
    assert!(
        lines.contains("FAIL  vera: matrix store") && lines.contains("recover --persona vera"),
        "check:\n{lines}"
    );

    // A new device, and recover.
    let token = token_for(&scene.url, "vera", "vera-pw", "GW-VERA2").await;
    let text = std::fs::read_to_string(&config)
        .unwrap()
        .replace("\"GW-VERA\"", "\"GW-VERA2\"");
    std::fs::write(&config, text).unwrap();
    write_private(&scene.dir.join("vera.token"), &token);
    let out = run_cli(&["recover", "--persona", "vera"], &config);
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "recover failed:\n{said}");
    assert!(
        said.contains("cross-signed: yes, key backup: on")
            && said.contains("lost device GW-VERA is deleted"),
        "recover:\n{said}"
    );
    assert!(signed_by_her_identity(&scene.url, &token, "GW-VERA2").await);

    mock.script(json!({"say": [{"room": room, "text": "answer two"}]}));
    let gw = GatewayProcess::start(&config);
    let got = wait_for_reply(&ann, &dm, "answer two", Duration::from_secs(120)).await;
    assert_eq!(got, ["answer one", "answer two"], "log:\n{}", gw.log());
    // Written before her new device existed: decrypted at once with the key from her backup.
    assert!(
        gw.log().contains(
            "written before her device existed: decrypted at once with the key from her backup"
        ),
        "log:\n{}",
        gw.log()
    );
    let asked: Vec<String> = mock.ledger().iter().map(|e| e.user_text.clone()).collect();
    let last = asked.last().cloned().unwrap_or_default();
    assert!(
        last.contains("two") && !last.contains("could not be decrypted"),
        "her batch: {last}"
    );

    // A new message, encrypted to her new device.
    mock.script(json!({"say": [{"room": room, "text": "answer three"}]}));
    dm.send(RoomMessageEventContent::text_plain("three"))
        .await
        .unwrap();
    let got = wait_for_reply(&ann, &dm, "answer three", Duration::from_secs(90)).await;
    assert_eq!(
        got,
        ["answer one", "answer two", "answer three"],
        "log:\n{}",
        gw.log()
    );
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        from_vera(&ann, &dm).await.len(),
        3,
        "an answer was sent twice"
    );
    gw.stop();
}
