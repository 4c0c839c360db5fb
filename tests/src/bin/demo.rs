//! `cargo run -p tests --bin demo`: the gateway's main job on embedded defaults.
//!
//! Installs (first run) and starts a local Synapse, registers a Persona (`@vera:localhost`)
//! and an operator (`@ann:localhost`), starts the mock Messages API (these machines cannot
//! reach the real one), writes a config with Vera's session live, and runs
//! `cultnet-gateway run`. The operator opens an encrypted DM, Vera joins it, the operator
//! writes, and Vera's live claude session answers in the encrypted room; then her heartbeat, a
//! CultNet client with a pinned key, reads the gateway's status over RUDP. Everything lives
//! under `target/demo/` and is stopped on exit; `--stay` keeps it running until Ctrl-C.

use std::time::{Duration, Instant};

use matrix_sdk::ruma::events::room::member::MembershipState;
use matrix_sdk::ruma::events::room::message::RoomMessageEventContent;
use matrix_sdk::ruma::OwnedUserId;
use tests::matrix::{
    room_bodies, sync, token_for, user_client, write_config, write_private, GatewayProcess,
};
use tests::mock_api::{MockApi, MockConfig};
use tests::synapse::{Limits, Synapse};

#[tokio::main]
async fn main() {
    let stay = std::env::args().any(|a| a == "--stay");
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/demo");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("creating target/demo");
    println!("1. Synapse (pinned, from deploy/synapse) on loopback ...");
    let hs = Synapse::start(&dir.join("hs"), Limits::Relaxed);
    hs.register("vera", "vera-pw");
    hs.register("ann", "ann-pw");
    let url = hs.url();
    println!("   {url}: @vera:localhost (the Persona), @ann:localhost (her operator)");
    println!("2. the claude CLI (pinned) and the mock Messages API ...");
    let claude = tests::claude_cli::executable();
    let mock = MockApi::start(MockConfig::default())
        .await
        .expect("mock API");
    let prompt = dir.join("vera.prompt.md");
    std::fs::write(
        &prompt,
        "You are Vera, a Persona of the cult. Answer operators kindly and briefly.\n".repeat(200),
    )
    .expect("prompt");
    let key = dir.join("api.key");
    write_private(&key, "mock-key");
    let session = format!(
        "\n[persona.session]\nmode = \"live\"\nclaude = \"{}\"\nmodel = \"claude-sonnet-4-6\"\nsystem_prompt_file = \"{}\"\napi_base_url = \"{}\"\napi_key_file = \"{}\"\ndebounce_ms = 300\n",
        claude.display(),
        prompt.display(),
        mock.url(),
        key.display()
    );
    // A CultNet client (her heartbeat), let in by its pinned key.
    let heartbeat = ed25519_dalek::SigningKey::from_bytes(&[0x5e; 32]);
    let public = gateway::config::hex(heartbeat.verifying_key().as_bytes());
    let session = format!(
        "{session}\n[[cultnet.client]]\nagent_id = \"heartbeat\"\npublic_key = \"{public}\"\npersonas = [\"vera\"]\nverbs = [\"status\", \"turn\"]\n"
    );
    let token = token_for(&url, "vera", "vera-pw", "GW-VERA").await;
    let config = write_config(&dir, &url, &token, &[], &["@ann:localhost"], &session);
    println!("3. cultnet-gateway run --config {}", config.display());
    let gw = GatewayProcess::start(&config);
    println!("4. the operator opens an encrypted DM with Vera ...");
    let ann = user_client(&url, "ann", "ann-pw", &dir.join("ann")).await;
    let vera: OwnedUserId = "@vera:localhost".try_into().expect("user id");
    let dm = ann.create_dm(&vera).await.expect("create DM");
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        sync(&ann).await;
        let member = dm.get_member_no_sync(&vera).await.ok().flatten();
        if member.is_some_and(|m| *m.membership() == MembershipState::Join) {
            break;
        }
        if Instant::now() > deadline {
            eprintln!("Vera did not join; gateway log:\n{}", gw.log());
            std::process::exit(1);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    mock.script(serde_json::json!({"say": [{"room": dm.room_id().to_string(),
        "text": "I hear you, Ann. The gateway carried your words to me and mine back, encrypted."}]}));
    let said = "Hello Vera, can you hear me?";
    dm.send(RoomMessageEventContent::text_plain(said))
        .await
        .expect("send");
    println!("   ann:  {said}");
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        sync(&ann).await;
        let bodies = room_bodies(&dm, 20).await;
        if let Some(reply) = bodies.iter().skip_while(|b| *b != said).nth(1) {
            println!("   vera: {reply}");
            break;
        }
        if Instant::now() > deadline {
            eprintln!("no answer within 90 s; gateway log:\n{}", gw.log());
            std::process::exit(1);
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let status =
        std::fs::read_to_string(dir.join("state/personas/vera/status.json")).unwrap_or_default();
    println!("5. her session's status (state/personas/vera/status.json):\n{status}");
    let addr = gw.cultnet_addr();
    println!("6. her heartbeat asks the gateway's status over CultNet ({addr}) ...");
    match gateway::client::Client::connect(addr, "heartbeat", &heartbeat, Duration::from_secs(10))
        .await
    {
        Ok(mut c) => {
            let status: Result<wire::docs::GatewayStatus, _> = c
                .request(
                    wire::docs::ids::STATUS_REQUEST,
                    "demo-status",
                    &wire::docs::StatusRequest::default(),
                )
                .await;
            match status {
                Ok(s) => println!(
                    "   {}",
                    serde_json::to_string_pretty(&s.personas).unwrap_or_default()
                ),
                Err(e) => eprintln!("   status request failed: {e}"),
            }
            c.close().await;
        }
        Err(e) => eprintln!("   CultNet connect failed: {e}"),
    }
    if stay {
        println!(
            "running; Ctrl-C stops (homeserver {url}, config {})",
            config.display()
        );
        let _ = tokio::signal::ctrl_c().await;
    }
    let code = gw.stop();
    println!("gateway stopped ({code}); demo done");
}
