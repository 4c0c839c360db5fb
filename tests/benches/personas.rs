//! Memory per additional idle Persona in one gateway (the target: under 10 MiB, SDK and
//! stores included): `cultnet-gateway run` with 1 and then with 6 Personas on a real Synapse,
//! each idle 10 s after start; VmRSS from /proc. `cargo bench -p tests --bench personas`.

use std::fmt::Write as _;
use std::time::Duration;

use tests::matrix::{token_for, write_private, GatewayProcess};
use tests::procfs::rss_kib;
use tests::synapse::{Limits, Synapse};

fn config(dir: &std::path::Path, hs: &str, tokens: &[String]) -> std::path::PathBuf {
    let state = dir.join(format!("state-{}", tokens.len()));
    let _ = std::fs::remove_dir_all(&state);
    let mut text = format!(
        "state_dir = \"{}\"\n[cultnet]\nbind = \"127.0.0.1:0\"\n",
        state.display()
    );
    for (i, t) in tokens.iter().enumerate() {
        let file = dir.join(format!("p{i}.token"));
        write_private(&file, t);
        let _ = write!(
            text,
            "\n[[persona]]\nid = \"p{i}\"\nhomeserver = \"{hs}\"\nuser_id = \"@p{i}:localhost\"\ndevice_id = \"GW-P{i}\"\naccess_token_file = \"{}\"\nrooms = [\"#hall:localhost\"]\n",
            file.display()
        );
    }
    let path = dir.join(format!("gateway-{}.toml", tokens.len()));
    std::fs::write(&path, text).expect("config");
    path
}

fn main() {
    if std::env::args().any(|a| a == "--list" || a == "--test") {
        return;
    }
    let scratch = tests::ScratchDir::new("bench-personas");
    let dir = scratch.path();
    let hs = Synapse::start(&dir.join("hs"), Limits::Relaxed);
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let url = hs.url();
    let admin = hs.register("host", "host-pw");
    // A public room every Persona joins, with some history.
    let room = rt.block_on(async {
        let client = tests::matrix::user_client(&url, "host", "host-pw", &dir.join("host")).await;
        let mut req = matrix_sdk::ruma::api::client::room::create_room::v3::Request::new();
        req.room_alias_name = Some("hall".into());
        req.preset =
            Some(matrix_sdk::ruma::api::client::room::create_room::v3::RoomPreset::PublicChat);
        let room = client.create_room(req).await.expect("room");
        for i in 0..50 {
            room.send(
                matrix_sdk::ruma::events::room::message::RoomMessageEventContent::text_plain(
                    format!("history line {i}"),
                ),
            )
            .await
            .expect("send");
        }
        room.room_id().to_string()
    });
    let _ = (admin, room);
    let tokens: Vec<String> = (0..6)
        .map(|i| {
            hs.register(&format!("p{i}"), "pw");
            rt.block_on(token_for(&url, &format!("p{i}"), "pw", &format!("GW-P{i}")))
        })
        .collect();
    let mut figures = Vec::new();
    for n in [1usize, 6] {
        let cfg = config(dir, &url, &tokens[..n]);
        let gw = GatewayProcess::start(&cfg);
        std::thread::sleep(Duration::from_secs(10));
        let rss = rss_kib(gw.pid());
        gw.stop();
        println!("{n} Persona(s): VmRSS {:.1} MiB", rss as f64 / 1024.0);
        figures.push(rss);
    }
    let per = (figures[1] as f64 - figures[0] as f64) / 5.0 / 1024.0;
    println!("memory per additional idle Persona: {per:.2} MiB (target < 10 MiB)");
}
