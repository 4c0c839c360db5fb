//! Helpers for the tests of `cultnet-gateway run` with a live session: her config section, her
//! operator's DM, what she said.

use std::time::{Duration, Instant};

use matrix_sdk::ruma::OwnedUserId;

use crate::matrix::{has_joined, sync, write_private, GatewayProcess};
use crate::mock_api::MockApi;

/// A client's public key as the config wants it (64 hex digits).
pub fn public_hex(key: &ed25519_dalek::SigningKey) -> String {
    gateway::config::hex(key.verifying_key().as_bytes())
}

/// A `[[cultnet.client]]` table for the config: `agent` with `key`'s public half, allowed
/// `personas` (`"*"` for all) and `verbs`.
pub fn client_block(
    agent: &str,
    key: &ed25519_dalek::SigningKey,
    personas: &[&str],
    verbs: &[&str],
) -> String {
    let list = |items: &[&str]| {
        items
            .iter()
            .map(|i| format!("\"{i}\""))
            .collect::<Vec<_>>()
            .join(", ")
    };
    format!(
        "\n[[cultnet.client]]\nagent_id = \"{agent}\"\npublic_key = \"{}\"\npersonas = [{}]\nverbs = [{}]\n",
        public_hex(key),
        list(personas),
        list(verbs)
    )
}

/// Bodies vera sent in `room`, as `reader` sees them.
pub async fn from_vera(reader: &matrix_sdk::Client, room: &matrix_sdk::Room) -> Vec<String> {
    said_by(reader, room, "@vera:localhost").await
}

/// Bodies `user` sent in `room`, as `reader` sees them.
pub async fn said_by(
    reader: &matrix_sdk::Client,
    room: &matrix_sdk::Room,
    user: &str,
) -> Vec<String> {
    contents_by(reader, room, user)
        .await
        .iter()
        .filter_map(|c| c["body"].as_str().map(str::to_owned))
        .collect()
}

/// The contents of the messages `user` sent in `room` (the last 100), oldest first, as
/// `reader` sees them.
pub async fn contents_by(
    reader: &matrix_sdk::Client,
    room: &matrix_sdk::Room,
    user: &str,
) -> Vec<serde_json::Value> {
    messages_by(reader, room, user)
        .await
        .into_iter()
        .map(|v| v["content"].clone())
        .collect()
}

/// The messages (whole events) `user` sent in `room` (the last 100), oldest first, as
/// `reader` sees them.
pub async fn messages_by(
    reader: &matrix_sdk::Client,
    room: &matrix_sdk::Room,
    user: &str,
) -> Vec<serde_json::Value> {
    sync(reader).await;
    let mut opts = matrix_sdk::room::MessagesOptions::backward();
    opts.limit = 100u32.into();
    let msgs = room.messages(opts).await.unwrap();
    let mut events: Vec<serde_json::Value> = msgs
        .chunk
        .iter()
        .filter_map(|e| {
            let v: serde_json::Value = serde_json::from_str(e.raw().json().get()).ok()?;
            (v["sender"] == user && v["type"] == "m.room.message").then_some(v)
        })
        .collect();
    events.reverse();
    events
}

/// Waits (up to `within`) until vera has said `text` in `room`; her bodies there.
pub async fn wait_for_reply(
    reader: &matrix_sdk::Client,
    room: &matrix_sdk::Room,
    text: &str,
    within: Duration,
) -> Vec<String> {
    let deadline = Instant::now() + within;
    loop {
        let got = from_vera(reader, room).await;
        if got.iter().any(|b| b == text) || Instant::now() > deadline {
            return got;
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

/// Writes her doctrine (`repeat` sentences) and API key, and returns the live
/// `[persona.session]` section (plus `extra` lines) and the doctrine's path.
pub fn live_section(
    dir: &std::path::Path,
    mock: &MockApi,
    repeat: usize,
    extra: &str,
) -> (String, std::path::PathBuf) {
    let prompt = dir.join("doctrine.md");
    std::fs::write(&prompt, "You are Vera. ".repeat(repeat)).unwrap();
    let key = dir.join("api.key");
    write_private(&key, "mock-key");
    let credential = format!("api_key_file = \"{}\"", key.display());
    (session_section(&prompt, mock, &credential, extra), prompt)
}

/// `session` (from [`live_section`]) with turns that start only when asked for (a CultNet turn
/// request, an operator's mail): the debounce and its cap are ten minutes.
pub fn turns_on_request(session: &str) -> String {
    session
        .replace("debounce_ms = 200", "debounce_ms = 600000")
        .replace("max_wait_ms = 1000", "max_wait_ms = 600000")
}

/// A live `[persona.session]` section with her doctrine at `prompt`, the mock's URL, a
/// `credential` line (`api_key_file = ...` or `oauth_token_file = ...`) and `extra` lines:
/// turns start 200 ms after the last mail (1 s at most) and may take 60 s. Her turn rules are
/// the defaults users get; a test that needs others says so with [`with_turns`] or
/// [`every_line`].
pub fn session_section(
    prompt: &std::path::Path,
    mock: &MockApi,
    credential: &str,
    extra: &str,
) -> String {
    format!(
        r#"
[persona.session]
mode = "live"
claude = "{claude}"
model = "claude-sonnet-4-6"
system_prompt_file = "{prompt}"
api_base_url = "{api}"
{credential}
debounce_ms = 200
max_wait_ms = 1000
turn_timeout_secs = 60
{extra}"#,
        claude = crate::claude_cli::executable().display(),
        prompt = prompt.display(),
        api = mock.url(),
    )
}

/// `[persona.turns]` lines under which every line starts a turn, with no per-sender or
/// bot-exchange limit to speak of: not what users get, so only a test that says why uses them
/// ([`every_line`]).
pub const EVERY_LINE_STARTS_A_TURN: &str =
    "start = \"all\"\nper_sender_per_hour = 1000000\nbot_exchanges = 1000000";

/// `session` (from [`session_section`]) with `[persona.turns]` lines `turns` before it.
pub fn with_turns(session: &str, turns: &str) -> String {
    assert!(!session.contains("[persona.turns]"), "{session}");
    format!("\n[persona.turns]\n{turns}\n{session}")
}

/// `session` with every line starting a turn ([`EVERY_LINE_STARTS_A_TURN`]): for a test of
/// something else (sessions, sends, restarts) that counts one turn per line it sends.
pub fn every_line(session: &str) -> String {
    with_turns(session, EVERY_LINE_STARTS_A_TURN)
}

/// The operator opens an encrypted DM with vera and waits until she has joined.
pub async fn open_dm(ann: &matrix_sdk::Client, gw: &GatewayProcess) -> matrix_sdk::Room {
    let vera: OwnedUserId = "@vera:localhost".try_into().unwrap();
    let dm = ann.create_dm(&vera).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while !has_joined(ann, &dm, &vera).await {
        assert!(
            Instant::now() < deadline,
            "she did not join the DM; log:\n{}",
            gw.log()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    dm
}

/// Asserts that her history's records (turns and what came between them) together cost
/// what the mock billed (`ledger`), within 1%.
pub fn assert_history_is_the_bill(
    history: &[gateway::turns::TurnRecord],
    ledger: &[crate::mock_api::LedgerEntry],
) {
    let recorded: f64 = history.iter().map(|r| r.cost_usd).sum();
    let bill: f64 = ledger.iter().map(|e| e.cost).sum();
    assert!(
        (recorded - bill).abs() <= 0.01 * bill,
        "recorded ${recorded}, billed ${bill}"
    );
}

/// Live Personas `names` (vera first: the [`Scene`]'s), each registered (but vera) with a
/// doctrine of her own, all in a new public room `#ALIAS:localhost` that ann makes, against the
/// mock's deterministic responder (it answers every line addressed to her), with
/// `[persona.turns]` lines `turns` and top-level sections `head` (`[sessions]` ...): the room,
/// the mock, and the running gateway, once every one has joined.
///
/// [`Scene`]: crate::matrix::Scene
pub async fn live_cast(
    scene: &crate::matrix::Scene,
    names: &[&str],
    alias: &str,
    head: &str,
    turns: &str,
) -> (matrix_sdk::Room, MockApi, GatewayProcess) {
    let room = crate::matrix::public_room(&scene.ann, alias).await;
    let mock = MockApi::start(crate::mock_api::MockConfig {
        responder: true,
        ..crate::mock_api::MockConfig::default()
    })
    .await
    .expect("the mock");
    let dir = &scene.dir;
    let key = dir.join("api.key");
    write_private(&key, "mock-key");
    let mut blocks = String::new();
    for name in names {
        let token = if *name == "vera" {
            scene.vera_token.clone()
        } else {
            scene.hs.register(name, &format!("{name}-pw"));
            crate::matrix::token_for(
                &scene.url,
                name,
                &format!("{name}-pw"),
                &format!("GW-{}", name.to_uppercase()),
            )
            .await
        };
        let prompt = dir.join(format!("{name}.md"));
        std::fs::write(&prompt, format!("You are {name}. ").repeat(2000)).expect("doctrine");
        let session = session_section(
            &prompt,
            &mock,
            &format!("api_key_file = \"{}\"", key.display()),
            "",
        );
        let session = with_turns(&session, turns);
        blocks.push_str(&crate::matrix::persona_block(
            dir,
            name,
            &scene.url,
            &token,
            &[&format!("#{alias}:localhost")],
            &[],
            &session,
        ));
    }
    let config = dir.join("gateway.toml");
    std::fs::write(
        &config,
        format!(
            "state_dir = \"{}\"\n\n{head}\n[cultnet]\nbind = \"127.0.0.1:0\"\n{blocks}",
            dir.join("state").display(),
        ),
    )
    .expect("config");
    let gw = GatewayProcess::start(&config);
    for name in names {
        until_joined(&scene.ann, &room, &format!("@{name}:localhost"), &gw).await;
    }
    (room, mock, gw)
}

/// Vera live in a new public room `#ALIAS:localhost` that the scene's ann makes, with her
/// `[persona.session]` (and `[persona.turns]`) section `session` and `extra` config text after
/// it (a client block): the room, her config, and the running gateway, once she has joined.
pub async fn vera_live_in(
    scene: &crate::matrix::Scene,
    alias: &str,
    session: &str,
    operators: &[&str],
    extra: &str,
) -> (matrix_sdk::Room, std::path::PathBuf, GatewayProcess) {
    let room = crate::matrix::public_room(&scene.ann, alias).await;
    let config = crate::matrix::write_config(
        &scene.dir,
        &scene.url,
        &scene.vera_token,
        &[&format!("#{alias}:localhost")],
        operators,
        &format!("{session}{extra}"),
    );
    let gw = GatewayProcess::start(&config);
    until_joined(&scene.ann, &room, "@vera:localhost", &gw).await;
    (room, config, gw)
}

/// Vera's config with her `[persona.session]` section (and what follows it) `session`, in no
/// room, ann her operator (who opens a DM with her).
pub fn operated(scene: &crate::matrix::Scene, session: &str) -> std::path::PathBuf {
    crate::matrix::write_config(
        &scene.dir,
        &scene.url,
        &scene.vera_token,
        &[],
        &["@ann:localhost"],
        session,
    )
}

/// Waits (up to a minute) until `user` has joined `room` as `reader` sees it; panics with the
/// gateway's log when she does not.
pub async fn until_joined(
    reader: &matrix_sdk::Client,
    room: &matrix_sdk::Room,
    user: &str,
    gw: &GatewayProcess,
) {
    let user: OwnedUserId = user.try_into().expect("user id");
    let deadline = Instant::now() + Duration::from_secs(60);
    while !has_joined(reader, room, &user).await {
        assert!(
            Instant::now() < deadline,
            "{user} did not join; log:\n{}",
            gw.log()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// A CultNet turn request for `persona` under request id `key`, and its receipt.
pub async fn request_turn(
    c: &mut gateway::client::Client,
    persona: &str,
    key: &str,
    reason: Option<&str>,
) -> wire::docs::TurnReceipt {
    c.request(
        wire::docs::ids::TURN_REQUEST,
        key,
        &wire::docs::TurnRequest {
            persona: persona.to_owned(),
            reason: reason.map(str::to_owned),
        },
    )
    .await
    .expect("a turn receipt")
}

/// Her turns since ledger entry `from`: the mock's answered requests that are not a
/// compaction's summary.
pub fn turns_since(mock: &MockApi, from: usize) -> Vec<crate::mock_api::LedgerEntry> {
    mock.ledger()[from..]
        .iter()
        .filter(|e| e.status == 200 && !e.is_summary())
        .cloned()
        .collect()
}

/// `name`, registered and joined to the room `alias`: that room as they see it.
pub async fn member(scene: &crate::matrix::Scene, name: &str, alias: &str) -> matrix_sdk::Room {
    scene.hs.register(name, &format!("{name}-pw"));
    let c = crate::matrix::user_client(
        &scene.url,
        name,
        &format!("{name}-pw"),
        &scene.dir.join(name),
    )
    .await;
    let alias = matrix_sdk::ruma::OwnedRoomOrAliasId::try_from(alias).expect("a room alias");
    c.join_room_by_id_or_alias(&alias, &[])
        .await
        .expect("joined")
}

/// An operator's verb on vera's session (`batch` for `retry` and `drop`, `model` for `model`)
/// under request id `key`, and its receipt.
pub async fn control(
    c: &mut gateway::client::Client,
    key: &str,
    action: wire::docs::ControlAction,
    model: Option<&str>,
    batch: Option<u64>,
) -> wire::docs::ControlReceipt {
    c.request(
        wire::docs::ids::CONTROL_REQUEST,
        key,
        &wire::docs::ControlRequest {
            persona: "vera".into(),
            action,
            model: model.map(str::to_owned),
            batch,
        },
    )
    .await
    .expect("a control receipt")
}
