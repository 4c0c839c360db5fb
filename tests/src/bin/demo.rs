//! `cargo run -p tests --bin demo`: the gateway's whole job on embedded defaults.
//!
//! Installs (first run) and starts a local Synapse, registers two Personas (`@vera:localhost`,
//! live; `@mira:localhost`, mouth-only) and their operator (`@ann:localhost`), and runs
//! `cultnet-gateway run` with both. Then:
//! 1. the operator opens an encrypted DM with Vera and writes; Vera's live claude session
//!    answers, encrypted;
//! 2. in the public room `#commons` the operator addresses Vera and also says a line meant for
//!    nobody in particular: Vera answers the first there, and not the second;
//! 3. Mira's organ, a CultNet client with a pinned key, reads her pending mail (the same room
//!    lines) and acknowledges it;
//! 4. it prints Vera's cache telemetry and writes the report picture.
//!
//! The model: with `ANTHROPIC_API_KEY` set and the API reachable, the real one; otherwise the
//! local mock of the Messages API with its deterministic responder, which answers whatever a
//! batch addressed to her, in the room it came from (nothing here scripts what she says). It
//! says which it used. Files live under `target/demo/`, stopped on exit; `--stay` keeps it up.

use std::path::Path;
use std::time::{Duration, Instant};

use matrix_sdk::ruma::events::room::member::MembershipState;
use matrix_sdk::ruma::events::room::message::RoomMessageEventContent;
use matrix_sdk::ruma::OwnedUserId;
use tests::matrix::{public_room, sync, token_for, user_client, write_private, GatewayProcess};
use tests::mock_api::{MockApi, MockConfig};
use tests::synapse::{Limits, Synapse};
use wire::docs::{ids, AckReceipt, AckRequest, PendingPage, PendingRequest};

fn fail(what: &str, gw: &GatewayProcess) -> ! {
    eprintln!("{what}; gateway log:\n{}", gw.log());
    std::process::exit(1);
}

/// What `user` said in `room` after the line `after`, waiting up to 120 s for the first.
async fn answer_after(
    reader: &matrix_sdk::Client,
    room: &matrix_sdk::Room,
    user: &str,
    after: &str,
    gw: &GatewayProcess,
) -> String {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        sync(reader).await;
        let mut opts = matrix_sdk::room::MessagesOptions::backward();
        opts.limit = 50u32.into();
        if let Ok(msgs) = room.messages(opts).await {
            let mut lines: Vec<(String, String)> = msgs
                .chunk
                .iter()
                .filter_map(|e| {
                    let v: serde_json::Value = serde_json::from_str(e.raw().json().get()).ok()?;
                    let body = v["content"]["body"].as_str()?.to_owned();
                    Some((v["sender"].as_str()?.to_owned(), body))
                })
                .collect();
            lines.reverse();
            if let Some(a) = lines
                .iter()
                .skip_while(|(_, b)| b != after)
                .find(|(s, _)| s == user)
            {
                return a.1.clone();
            }
        }
        if Instant::now() > deadline {
            fail(&format!("no answer from {user} within 120 s"), gw);
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

/// Whether the real Messages API is usable: a key in the environment and the host reachable.
fn real_model() -> Option<String> {
    let key = std::env::var("ANTHROPIC_API_KEY")
        .ok()
        .filter(|k| !k.trim().is_empty())?;
    let addr = std::net::ToSocketAddrs::to_socket_addrs(&("api.anthropic.com", 443))
        .ok()?
        .next()?;
    std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(3)).ok()?;
    Some(key)
}

fn gateway_cli(args: &[&str], config: &Path) -> String {
    String::from_utf8_lossy(&tests::matrix::run_cli(args, config).stdout).into_owned()
}

#[tokio::main]
async fn main() {
    let stay = std::env::args().any(|a| a == "--stay");
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/demo");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("creating target/demo");
    println!("1. Synapse (pinned, from deploy/synapse) on loopback ...");
    let hs = Synapse::start(&dir.join("hs"), Limits::Relaxed);
    for who in ["vera", "mira", "ann", "bob"] {
        hs.register(who, &format!("{who}-pw"));
    }
    let url = hs.url();
    println!("   {url}: @vera:localhost (live), @mira:localhost (mouth-only), @ann:localhost (their operator), @bob:localhost");
    let ann = user_client(&url, "ann", "ann-pw", &dir.join("ann")).await;
    let commons = public_room(&ann, "commons").await;
    // Bob: a member of #commons, not her operator.
    let bob = user_client(&url, "bob", "bob-pw", &dir.join("bob")).await;
    let bob_commons = bob
        .join_room_by_id_or_alias(
            &matrix_sdk::ruma::OwnedRoomOrAliasId::try_from("#commons:localhost").expect("alias"),
            &[],
        )
        .await
        .expect("bob joins #commons");

    println!("2. the model ...");
    let claude = tests::claude_cli::executable();
    let mock = MockApi::start(MockConfig {
        responder: true,
        ..MockConfig::default()
    })
    .await
    .expect("mock API");
    let (api, key) = match real_model() {
        Some(k) => {
            println!(
                "   the real Messages API (ANTHROPIC_API_KEY is set and api.anthropic.com answers)"
            );
            ("https://api.anthropic.com".to_owned(), k)
        }
        None => {
            println!(
                "   the local mock of the Messages API ({}), with its deterministic responder: no \
                 ANTHROPIC_API_KEY, or the API is not reachable from here",
                mock.url()
            );
            (mock.url(), "mock-key".to_owned())
        }
    };
    let key_file = dir.join("api.key");
    write_private(&key_file, &key);
    let prompt = dir.join("vera.prompt.md");
    std::fs::write(
        &prompt,
        "You are Vera, a Persona of the cult. Answer whoever speaks to you, briefly, in the room \
         they spoke in; stay silent when a line is not for you.\n"
            .repeat(120),
    )
    .expect("prompt");
    let session = format!(
        "\n[persona.session]\nmode = \"live\"\nclaude = \"{}\"\nmodel = \"claude-sonnet-4-6\"\nsystem_prompt_file = \"{}\"\napi_base_url = \"{api}\"\napi_key_file = \"{}\"\ndebounce_ms = 300\nmax_wait_ms = 2000\n",
        claude.display(),
        prompt.display(),
        key_file.display()
    );
    let organ = ed25519_dalek::SigningKey::from_bytes(&[0x4f; 32]);
    let organ_public = gateway::config::hex(organ.verifying_key().as_bytes());
    let persona = |id: &str, token: &str, extra: &str| {
        tests::matrix::persona_block(
            &dir,
            id,
            &url,
            token,
            &["#commons:localhost"],
            &["@ann:localhost"],
            extra,
        )
    };
    let vera_token = token_for(&url, "vera", "vera-pw", "GW-VERA").await;
    let mira_token = token_for(&url, "mira", "mira-pw", "GW-MIRA").await;
    let config = dir.join("gateway.toml");
    std::fs::write(
        &config,
        format!(
            "state_dir = \"{}\"\n\n[cultnet]\nbind = \"127.0.0.1:0\"\n\n[[cultnet.client]]\nagent_id = \"mira-organ\"\npublic_key = \"{organ_public}\"\npersonas = [\"mira\"]\nverbs = [\"pending\", \"ack\"]\n{}{}",
            dir.join("state").display(),
            persona("vera", &vera_token, &session),
            persona("mira", &mira_token, ""),
        ),
    )
    .expect("config");
    println!("3. cultnet-gateway run --config {}", config.display());
    let gw = GatewayProcess::start(&config);

    println!("4. the operator opens an encrypted DM with Vera ...");
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
            fail("Vera did not join the DM", &gw);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let said = "Hello Vera, can you hear me?";
    dm.send(RoomMessageEventContent::text_plain(said))
        .await
        .expect("send");
    println!("   ann  (DM, encrypted): {said}");
    let reply = answer_after(&ann, &dm, "@vera:localhost", said, &gw).await;
    println!("   vera (DM, encrypted): {reply}");

    println!(
        "5. in #commons the operator speaks to Vera, and a member says a line meant for no one ..."
    );
    let to_her = "Vera, what is on today's agenda?";
    let not_for_her = "lunch is at noon, everyone";
    for (who, room, line) in [
        ("ann", &commons, to_her),
        ("bob", &bob_commons, not_for_her),
    ] {
        room.send(RoomMessageEventContent::text_plain(line))
            .await
            .expect("send");
        println!("   {who}  (#commons): {line}");
    }
    let reply = answer_after(&ann, &commons, "@vera:localhost", to_her, &gw).await;
    println!("   vera (#commons): {reply}");
    tokio::time::sleep(Duration::from_secs(2)).await;
    let answers = tests::live::said_by(&ann, &commons, "@vera:localhost").await;
    println!(
        "   {} answer(s) from Vera in #commons: the line not meant for her got none",
        answers.len()
    );

    println!(
        "6. Mira is mouth-only: her organ reads her mail over CultNet and acknowledges it ..."
    );
    let addr = gw.cultnet_addr();
    match gateway::client::Client::connect(addr, "mira-organ", &organ, Duration::from_secs(10))
        .await
    {
        Ok(mut c) => {
            let page: Result<PendingPage, _> = c
                .request(
                    ids::PENDING_REQUEST,
                    "demo-pending",
                    &PendingRequest {
                        persona: "mira".into(),
                        ..PendingRequest::default()
                    },
                )
                .await;
            match page {
                Ok(page) => {
                    for d in &page.deliveries {
                        println!("   [{}] {}: {}", d.seq, d.sender, d.text);
                    }
                    let ack: Result<AckReceipt, _> = c
                        .request(
                            ids::ACK_REQUEST,
                            "demo-ack",
                            &AckRequest {
                                persona: "mira".into(),
                                through_seq: page.through_seq,
                            },
                        )
                        .await;
                    match ack {
                        Ok(a) => println!(
                            "   acknowledged through {}: {} pending now",
                            a.through_seq, a.pending_count
                        ),
                        Err(e) => eprintln!("   ack failed: {e}"),
                    }
                }
                Err(e) => eprintln!("   pending request failed: {e}"),
            }
            c.close().await;
        }
        Err(e) => eprintln!("   CultNet connect failed: {e}"),
    }

    println!("7. Vera's cache telemetry (cultnet-gateway status):");
    print!("{}", gateway_cli(&["status"], &config));
    let status: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.join("state/personas/vera/status.json")).unwrap_or_default(),
    )
    .unwrap_or_default();
    for t in status["turns"].as_array().into_iter().flatten() {
        println!(
            "   turn {}-{}: prompt {} tokens, {} read from cache ({:.0}%), {} written, ${:.5}",
            t["first_seq"],
            t["last_seq"],
            t["input_tokens"].as_u64().unwrap_or(0)
                + t["cache_read_tokens"].as_u64().unwrap_or(0)
                + t["cache_write_tokens"].as_u64().unwrap_or(0),
            t["cache_read_tokens"],
            t["hit_ratio"].as_f64().unwrap_or(0.0) * 100.0,
            t["cache_write_tokens"],
            t["cost_usd"].as_f64().unwrap_or(0.0),
        );
    }
    let svg = dir.join("report.svg");
    print!(
        "8. the report picture: {}",
        gateway_cli(
            &[
                "report",
                "--persona",
                "vera",
                "--out",
                &svg.display().to_string()
            ],
            &config
        )
    );
    if stay {
        println!(
            "running; Ctrl-C or SIGTERM stops (homeserver {url}, config {})",
            config.display()
        );
        // A script or systemd stops it with SIGTERM: its homeserver and gateway stop too.
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = term.recv() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    let code = gw.stop();
    println!("gateway stopped ({code}); demo done");
}
