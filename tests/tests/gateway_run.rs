//! `cultnet-gateway run` as a user runs it, against a real Synapse (and, for live sessions,
//! the real claude CLI against the mock Messages API):
//! - an operator's encrypted DM is answered by her live session, exactly once, also when the
//!   CLI is killed with `kill -9` mid-turn; after a restart of the gateway the resumed session
//!   is not shown again the lines it holds; a batch the model API failed on is not sent again
//!   to her session, whose transcript holds it, also by a gateway restarted before the retry;
//!   a turn of two requests (a reply bounced by
//!   the schema) is recorded at what both billed, its prefix the last one's prompt;
//! - `kill -9` of the gateway at random moments during a burst of 500 messages, ten times:
//!   every message delivered exactly once, with contiguous seqs in send order; `kill -9` of
//!   the gateway mid-turn takes her claude process with it, and she sees the batch once;
//! - her typing notice lasts as long as her turn, renewed past its 4 s;
//! - each turn's record prices a fresh start with the lines her rooms would send again;
//! - a reply whose send failed is sent as she gave it, once, without asking her again;
//! - a compaction and a keep-warm refresh are in her history at what the mock billed, and a
//!   refresh keeps her cache through a silence longer than the 5-minute TTL (real time), with
//!   a restart of the gateway in the silence.

use std::time::{Duration, Instant};

use gateway::inbox::Inbox;
use matrix_sdk::ruma::events::room::message::RoomMessageEventContent;
use tests::live::{live_section, open_dm, public_hex, wait_for_reply};
use tests::matrix::{public_room, write_config, write_private, GatewayProcess, Scene};
use tests::mock_api::{Fault, MockApi, MockConfig};
use tests::synapse::Limits;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operators_encrypted_dm_is_answered_once_even_when_the_cli_is_killed() {
    let scene = Scene::new("run-live", Limits::Relaxed).await;
    let (ann, dir) = (&scene.ann, scene.dir.clone());
    let mock = MockApi::start(MockConfig::default()).await.unwrap();
    let (config, prompt) = vera_live(&scene, &mock, 800, "");
    let gw = GatewayProcess::start(&config);

    let dm = open_dm(ann, &gw).await;
    let room = dm.room_id().to_string();
    mock.script(serde_json::json!({"say": [{"room": room, "text": "hello ann"}]}));
    dm.send(RoomMessageEventContent::text_plain("hello vera"))
        .await
        .unwrap();
    let got = wait_for_reply(ann, &dm, "hello ann", Duration::from_secs(90)).await;
    assert_eq!(got, ["hello ann"], "log:\n{}", gw.log());
    let status: serde_json::Value = serde_json::from_slice(
        &std::fs::read(dir.join("state/personas/vera/status.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(status["turns_total"], 1);
    assert_eq!(status["turns"][0]["says"], 1);
    assert!(status["session_id"].is_string());

    // The CLI killed mid-turn: the turn is retried in the resumed session, one reply.
    let hold = Duration::from_secs(4);
    asked_and_held(&mock, &dm, "are you there?", "second answer", hold).await;
    let pids = claude_pids(&prompt);
    assert!(!pids.is_empty(), "no claude process found");
    for pid in pids.split_whitespace() {
        let _ = std::process::Command::new("kill")
            .args(["-9", pid])
            .status();
    }
    let got = wait_for_reply(ann, &dm, "second answer", Duration::from_secs(90)).await;
    assert_eq!(got, ["hello ann", "second answer"], "log:\n{}", gw.log());
    assert!(
        gw.log().contains("respawning"),
        "the CLI was not respawned; log:\n{}",
        gw.log()
    );
    // The retried batch tells her that her process was restarted, and she sees the batch
    // once: sent again, or, when the killed process had written it into her transcript
    // already, only named by a `[retry]` note.
    assert!(
        mock.ledger().iter().any(|e| e
            .last_user_text
            .contains("[restart] your claude process was restarted")),
        "no restart note after the CLI was killed"
    );
    let answered = mock
        .ledger()
        .into_iter()
        .rfind(|e| e.status == 200)
        .unwrap();
    assert_eq!(
        answered.user_text.matches("are you there?").count(),
        1,
        "{}",
        answered.user_text
    );
    assert_eq!(gw.stop().code(), Some(0));
    let inbox = Inbox::open(&dir.join("state/inbox")).unwrap();
    let c = inbox.counts("vera").unwrap();
    assert_eq!((c.highest, c.acked_through, c.pending), (2, 2, 0));
    drop(inbox);
    let before_restart = mock
        .ledger()
        .into_iter()
        .rfind(|e| e.status == 200)
        .unwrap();

    // After a gateway restart the same session continues (the old history is the prefix the
    // mock sees), and an overloaded API (the CLI's own retries exhausted: three requests a
    // turn) is retried later, also by the next gateway when it is restarted in between.
    let gw = GatewayProcess::start(&config);
    for _ in 0..6 {
        mock.inject(Fault::Overloaded);
    }
    mock.script(serde_json::json!({"say": [{"room": room, "text": "third answer"}]}));
    let from = mock.ledger().len();
    dm.send(RoomMessageEventContent::text_plain(
        "still there after a restart?",
    ))
    .await
    .unwrap();
    // Her turn failed (it is in her status); the gateway restarts before its retry went
    // through (the next three requests fail too, whichever gateway makes them).
    let deadline = Instant::now() + Duration::from_secs(60);
    while !std::fs::read(dir.join("state/personas/vera/status.json"))
        .ok()
        .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
        .and_then(|s| s["last_error"].as_str().map(|e| e.contains("API error")))
        .unwrap_or(false)
    {
        assert!(
            Instant::now() < deadline,
            "her turn never failed; log:\n{}",
            gw.log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(gw.stop().code(), Some(0));
    let gw = GatewayProcess::start(&config);
    let got = wait_for_reply(ann, &dm, "third answer", Duration::from_secs(90)).await;
    assert_eq!(
        got,
        ["hello ann", "second answer", "third answer"],
        "log:\n{}",
        gw.log()
    );
    let after: Vec<_> = mock.ledger()[from..].to_vec();
    assert_eq!(
        after.iter().filter(|e| e.status == 529).count(),
        6,
        "{after:?}"
    );
    let resumed = after.iter().find(|e| e.status == 200).unwrap();
    let old = &before_restart.block_hashes;
    assert!(
        resumed.block_hashes.len() > old.len()
            && resumed.block_hashes[..old.len() - 1] == old[..old.len() - 1],
        "the resumed request does not continue the old conversation"
    );
    assert!(
        resumed.usage.cache_read > 0,
        "the old history was not read from cache"
    );
    // The resumed session holds the earlier lines: the first request after the restart does
    // not show them to her again as context, neither ann's nor her own replies.
    let first = &after[0].last_user_text;
    assert!(first.contains("still there after a restart?"), "{first}");
    for held in ["hello vera", "hello ann", "are you there?", "second answer"] {
        assert!(
            !first.contains(held),
            "{held:?} shown again after the restart:\n{first}"
        );
    }
    // The CLI keeps the failed attempt's text in her session's transcript: the retry, by the
    // restarted gateway in a new process, says so and does not repeat the batch.
    assert_eq!(
        resumed
            .user_text
            .matches("still there after a restart?")
            .count(),
        1,
        "the batch the API failed on was sent again:\n{}",
        resumed.user_text
    );
    assert!(
        resumed
            .last_user_text
            .contains("[retry] the model API failed (HTTP 529)")
            && resumed
                .last_user_text
                .contains("[restart] the gateway was restarted"),
        "{}",
        resumed.last_user_text
    );
    let status2: serde_json::Value = serde_json::from_slice(
        &std::fs::read(dir.join("state/personas/vera/status.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(status2["session_id"], status["session_id"]);
    assert_eq!(status2["turns_total"], 3, "{status2}");
    // `cultnet-gateway status` shows the same.
    let run = |args: &[&str]| {
        let out = tests::matrix::run_cli(args, &config);
        assert!(
            out.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let shown: serde_json::Value = serde_json::from_str(&run(&["status", "--json"])).unwrap();
    assert_eq!(shown["vera"]["session_id"], status["session_id"]);
    assert_eq!(shown["vera"]["turns"].as_array().map(Vec::len), Some(3));
    // The table for people: her row with mode, session and turns.
    let table = run(&["status"]);
    let row = table
        .lines()
        .find(|l| l.starts_with("vera "))
        .unwrap_or_default();
    let sid = status["session_id"].as_str().unwrap_or_default();
    assert!(
        row.contains("live") && row.contains(sid) && row.contains(" 3 "),
        "{table}"
    );
    // The report of her three turns.
    let svg = dir.join("report.svg");
    let said = run(&["report", "--out", svg.to_str().unwrap()]);
    assert!(said.contains("vera: 3 turns"), "{said}");
    let svg = std::fs::read_to_string(&svg).unwrap();
    assert!(
        svg.starts_with("<svg") && svg.contains("vera: 3 turns") && svg.contains("live session")
    );
    assert_eq!(gw.stop().code(), Some(0));

    // Her next turn's reply breaks the schema (a say without text) and the CLI asks again:
    // two requests in one result, whose `usage` adds them up. Her record bills both, and
    // shows her prefix as the last request's prompt, not their sum.
    let gw = GatewayProcess::start(&config);
    let from = mock.ledger().len();
    mock.script(serde_json::json!({"say": [{"room": room}]}));
    mock.script(serde_json::json!({"say": [{"room": room, "text": "fourth answer"}]}));
    dm.send(RoomMessageEventContent::text_plain("one more?"))
        .await
        .unwrap();
    let got = wait_for_reply(ann, &dm, "fourth answer", Duration::from_secs(90)).await;
    assert_eq!(
        got.last().map(String::as_str),
        Some("fourth answer"),
        "{got:?}"
    );
    let history = dir.join("state/personas/vera/turns.jsonl");
    let deadline = Instant::now() + Duration::from_secs(30);
    let last = loop {
        let h = gateway::turns::read_history(&history).unwrap_or_default();
        if let Some(r) = h.last().filter(|r| r.last_seq == 4) {
            break r.clone();
        }
        assert!(Instant::now() < deadline, "no record of her fourth turn");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(gw.stop().code(), Some(0));
    let asked: Vec<_> = mock.ledger()[from..]
        .iter()
        .filter(|e| e.status == 200)
        .cloned()
        .collect();
    let prompts: Vec<u64> = asked.iter().map(|e| e.usage.prompt_tokens()).collect();
    assert_eq!(prompts.len(), 2, "the CLI did not ask again: {prompts:?}");
    assert_eq!(
        last.prefix_tokens, prompts[1],
        "her prefix is not her last request's prompt (the requests' prompts: {prompts:?})"
    );
    let billed: f64 = asked.iter().map(|e| e.cost).sum();
    assert!(
        (last.cost_usd - billed).abs() <= 0.01 * billed,
        "her turn recorded ${}, billed ${billed} (its last request ${})",
        last.cost_usd,
        asked[1].cost
    );
}

/// Ann says `text` in `dm`, and her turn's request reaches the API, which holds its answer
/// back `hold` (`answer`, scripted for it and for a retry).
async fn asked_and_held(
    mock: &MockApi,
    dm: &matrix_sdk::Room,
    text: &str,
    answer: &str,
    hold: Duration,
) {
    mock.inject(Fault::Delay(hold));
    let say = serde_json::json!({"say": [{"room": dm.room_id().to_string(), "text": answer}]});
    mock.script(say.clone());
    mock.script(say);
    let before = mock.ledger().len();
    dm.send(RoomMessageEventContent::text_plain(text))
        .await
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    // The request is in the ledger as soon as it arrives.
    while mock.ledger().len() == before {
        assert!(Instant::now() < deadline, "the turn never reached the API");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Her claude processes, found by her doctrine's path on their command line.
fn claude_pids(prompt: &std::path::Path) -> String {
    let out = std::process::Command::new("pgrep")
        .args(["-f", &prompt.display().to_string()])
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

/// `kill -9` of the gateway mid-turn takes her claude process with it: left alive, it finished
/// the turn into her session's transcript, so the restarted gateway's retry showed her the
/// batch twice (and two processes held one transcript). The killed turn's text is in her
/// transcript already, so the retry names it in a `[retry]` note instead of sending it again:
/// she sees the batch once and answers once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_of_the_gateway_mid_turn_leaves_no_claude_behind() {
    let scene = Scene::new("run-orphan", Limits::Relaxed).await;
    let ann = &scene.ann;
    let mock = MockApi::start(MockConfig::default()).await.unwrap();
    let (config, prompt) = vera_live(&scene, &mock, 800, "");
    let gw = GatewayProcess::start(&config);
    let dm = open_dm(ann, &gw).await;
    let room = dm.room_id().to_string();
    let say = |text: &str| serde_json::json!({"say": [{"room": room, "text": text}]});
    mock.script(say("hello ann"));
    dm.send(RoomMessageEventContent::text_plain("hello vera"))
        .await
        .unwrap();
    wait_for_reply(ann, &dm, "hello ann", Duration::from_secs(90)).await;

    // Her next turn's request reaches the API, whose answer takes 4 s; the gateway dies.
    let hold = Duration::from_secs(4);
    asked_and_held(&mock, &dm, "are you there?", "second answer", hold).await;
    assert!(!claude_pids(&prompt).is_empty(), "no claude process found");
    // Long enough for the CLI to have written the turn's text into her transcript.
    tokio::time::sleep(Duration::from_secs(1)).await;
    gw.kill9();
    let deadline = Instant::now() + Duration::from_secs(5);
    while !claude_pids(&prompt).is_empty() {
        assert!(
            Instant::now() < deadline,
            "her claude process outlived the gateway: {}",
            claude_pids(&prompt)
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Past the answer the killed process would have had.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let from = mock.ledger().len();
    let gw = GatewayProcess::start(&config);
    let got = wait_for_reply(ann, &dm, "second answer", Duration::from_secs(90)).await;
    assert_eq!(got, ["hello ann", "second answer"], "log:\n{}", gw.log());
    let retried = mock.ledger()[from..]
        .iter()
        .find(|e| e.status == 200)
        .cloned()
        .expect("the retried turn billed");
    assert_eq!(
        retried.user_text.matches("are you there?").count(),
        1,
        "she was shown the batch twice:\n{}",
        retried.user_text
    );
    // Her transcript held it: the retry names it instead of sending it again.
    assert!(
        retried
            .last_user_text
            .contains("[retry] your last turn ended before you answered the batch above"),
        "{}",
        retried.last_user_text
    );
    assert_eq!(gw.stop().code(), Some(0));
    assert!(
        claude_pids(&prompt).is_empty(),
        "a claude process outlived a clean stop"
    );
}

/// She shows as typing for as long as her turn lasts: a typing notice lasts 4 s and a turn
/// with a real model longer (here the API holds its answer 20 s), so the gateway renews it;
/// it is taken down when the turn ends. Before, it lapsed 4 s into the turn.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn her_typing_notice_lasts_as_long_as_her_turn() {
    use matrix_sdk::ruma::events::typing::SyncTypingEvent;
    let scene = Scene::new("run-typing", Limits::Relaxed).await;
    let ann = &scene.ann;
    let mock = MockApi::start(MockConfig::default()).await.unwrap();
    let (config, _) = vera_live(&scene, &mock, 800, "");
    let gw = GatewayProcess::start(&config);
    let dm = open_dm(ann, &gw).await;
    // Who ann's client last saw typing in the DM, from every sync the test makes.
    let typing: std::sync::Arc<std::sync::Mutex<Vec<String>>> = Default::default();
    let seen = typing.clone();
    ann.add_room_event_handler(dm.room_id(), move |ev: SyncTypingEvent| {
        let seen = seen.clone();
        async move {
            *seen.lock().unwrap() = ev.content.user_ids.iter().map(|u| u.to_string()).collect();
        }
    });
    let now_typing = || typing.lock().unwrap().clone();
    // Synapse drops a lapsed notice on a 5 s timer: 4 s may show as up to 9 s.
    let hold = Duration::from_secs(20);
    asked_and_held(&mock, &dm, "think it over", "thought over", hold).await;
    for i in [4, 8, 12, 16] {
        tokio::time::sleep(Duration::from_secs(4)).await;
        tests::matrix::sync(ann).await;
        assert_eq!(now_typing(), ["@vera:localhost"], "{i} s into her turn");
    }
    let got = wait_for_reply(ann, &dm, "thought over", Duration::from_secs(60)).await;
    assert_eq!(got, ["thought over"]);
    tests::matrix::sync(ann).await;
    assert!(now_typing().is_empty(), "{:?}", now_typing());
    assert_eq!(gw.stop().code(), Some(0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_during_a_burst_loses_and_doubles_nothing() {
    let scene = Scene::new("run-kill9", Limits::Relaxed).await;
    let (url, ann, dir) = (scene.url.clone(), &scene.ann, scene.dir.clone());
    let hall = public_room(ann, "hall").await;
    let token = scene.vera_token.clone();
    let config = write_config(&dir, &url, &token, &["#hall:localhost"], &[], "");
    GatewayProcess::start(&config).stop();

    const N: usize = 500;
    let sender = tokio::spawn(async move {
        for i in 0..N {
            hall.send(RoomMessageEventContent::text_plain(format!("burst {i:03}")))
                .await
                .unwrap();
        }
    });
    let mut kills = 0;
    let mut seed: u64 = 0x9E37_79B9_7F4A_7C15;
    while !sender.is_finished() || kills < 10 {
        let gw = tokio::task::spawn_blocking({
            let config = config.clone();
            move || GatewayProcess::start(&config)
        })
        .await
        .unwrap();
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        tokio::time::sleep(Duration::from_millis(200 + seed % 1800)).await;
        gw.kill9();
        kills += 1;
    }
    sender.await.unwrap();
    // A last run catches up; then the inbox is read with the gateway stopped.
    let deadline = Instant::now() + Duration::from_secs(120);
    let deliveries = loop {
        let gw = GatewayProcess::start(&config);
        tokio::time::sleep(Duration::from_secs(3)).await;
        gw.stop();
        let inbox = Inbox::open(&dir.join("state/inbox")).unwrap();
        let page = inbox.pending("vera", 0, 10_000, None).unwrap();
        if page.deliveries.len() >= N || Instant::now() > deadline {
            break page.deliveries;
        }
    };
    let texts: Vec<String> = deliveries.iter().map(|d| d.text.clone()).collect();
    let want: Vec<String> = (0..N).map(|i| format!("burst {i:03}")).collect();
    assert_eq!(texts, want, "after {kills} kills");
    let seqs: Vec<u64> = deliveries.iter().map(|d| d.seq).collect();
    assert_eq!(seqs, (1..=N as u64).collect::<Vec<_>>());
    assert!(kills >= 10);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rejected_token_stops_only_that_persona() {
    let scene = Scene::new("run-badtoken", Limits::Relaxed).await;
    let (url, ann, dir) = (scene.url.clone(), &scene.ann, scene.dir.clone());
    let hall = public_room(ann, "hall").await;
    let token = scene.vera_token.clone();
    let bad = dir.join("mira.token");
    write_private(&bad, "syt_not_a_valid_token");
    let extra = format!(
        "\n[[persona]]\nid = \"mira\"\nhomeserver = \"{url}\"\nuser_id = \"@mira:localhost\"\ndevice_id = \"GW-MIRA\"\naccess_token_file = \"{}\"\n",
        bad.display()
    );
    let config = write_config(&dir, &url, &token, &["#hall:localhost"], &[], &extra);
    let gw = GatewayProcess::start(&config);
    let log = gw.log();
    assert!(
        log.contains("persona mira not started") && log.contains("rejected the access token"),
        "{log}"
    );
    assert!(
        !log.contains("syt_not_a_valid_token"),
        "a token reached the log"
    );
    hall.send(RoomMessageEventContent::text_plain("still heard"))
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(gw.stop().code(), Some(0));
    let inbox = Inbox::open(&dir.join("state/inbox")).unwrap();
    let page = inbox.pending("vera", 0, 10, None).unwrap();
    assert_eq!(
        page.deliveries
            .iter()
            .map(|d| d.text.as_str())
            .collect::<Vec<_>>(),
        ["still heard"]
    );
}

/// Writes the config of vera's live session against `mock` (a doctrine of `sentences`, `extra`
/// session lines) with ann as her operator: the config's path and the doctrine's.
fn vera_live(
    scene: &Scene,
    mock: &MockApi,
    sentences: usize,
    extra: &str,
) -> (std::path::PathBuf, std::path::PathBuf) {
    let (session, prompt) = live_section(&scene.dir, mock, sentences, extra);
    // One turn per line this test sends: not the rules users get.
    let session = tests::live::every_line(&session);
    (tests::live::operated(scene, &session), prompt)
}

/// Starts vera's gateway with her live session against `mock` (a 100-sentence doctrine),
/// `limits` as her `[persona.limits]` and ann as her operator.
fn start_live(scene: &Scene, mock: &MockApi, limits: &str) -> GatewayProcess {
    let extra = format!("\n[persona.limits]\n{limits}");
    GatewayProcess::start(&vera_live(scene, mock, 100, &extra).0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_conversation_outgrowing_the_window_is_compacted_and_goes_on() {
    let scene = Scene::new("run-fresh", Limits::Relaxed).await;
    let (ann, dir) = (&scene.ann, scene.dir.clone());
    // A small model window, so the conversation outgrows it within a few turns.
    let mock = MockApi::start(MockConfig {
        context_window: 3_000,
        ..MockConfig::default()
    })
    .await
    .unwrap();
    let gw = start_live(&scene, &mock, "context_bytes = 2048\n");
    let dm = open_dm(ann, &gw).await;
    let room = dm.room_id().to_string();
    let mut want = Vec::new();
    for i in 0..8 {
        let answer = format!("answer {i}");
        mock.script(serde_json::json!({"say": [{"room": room, "text": answer}]}));
        // The refused request takes no script (it never reaches the reply), so one suffices.
        let long = format!("message {i}: {}", "words of some length ".repeat(75));
        dm.send(RoomMessageEventContent::text_plain(long))
            .await
            .unwrap();
        want.push(answer.clone());
        let got = wait_for_reply(ann, &dm, &answer, Duration::from_secs(90)).await;
        assert_eq!(got, want, "log:\n{}", gw.log());
    }
    let ledger = mock.ledger();
    assert!(
        ledger.iter().any(|e| e.status == 400),
        "the window was never exceeded: the test proves nothing"
    );
    // A refused turn is compacted first (a fresh start only if it is refused again: see
    // tests/minds.rs), and the conversation goes on in the same session.
    let status: serde_json::Value = serde_json::from_slice(
        &std::fs::read(dir.join("state/personas/vera/status.json")).unwrap(),
    )
    .unwrap();
    let compactions = status["compactions"].as_u64().unwrap_or(0);
    assert!(compactions >= 1, "{status}");
    assert_eq!(gw.stop().code(), Some(0));
    // Each compaction's size (the CLI's count of the summary and the messages it kept) is kept
    // for the next one's price: it holds the summary the mock billed, and fits the window.
    let inbox = Inbox::open(&dir.join("state/inbox")).unwrap();
    let summaries: Vec<u64> = serde_json::from_str(
        &inbox
            .session_value("vera", "summaries")
            .unwrap()
            .expect("summary sizes stored"),
    )
    .unwrap();
    let billed: Vec<u64> = ledger
        .iter()
        .filter(|e| e.status == 200 && e.is_summary())
        .map(|e| e.usage.output)
        .collect();
    let kept = billed.len().min(session::policy::Telemetry::SUMMARIES_KEPT);
    assert_eq!(summaries.len(), kept, "{summaries:?} billed {billed:?}");
    for (s, b) in summaries.iter().zip(&billed[billed.len() - kept..]) {
        assert!(
            *s >= *b && *s < 3_000,
            "kept {summaries:?}, billed {billed:?}"
        );
    }
    // Her history has each compaction beside her turns, each billed as the mock billed it
    // (the CLI reports no usage for `/compact`: its running totals do), and all together
    // cost what the mock billed for her.
    let history =
        gateway::turns::read_history(&dir.join("state/personas/vera/turns.jsonl")).unwrap();
    use gateway::turns::RecordKind;
    let cost_of = |k: RecordKind| -> (usize, f64) {
        let of: Vec<_> = history.iter().filter(|r| r.kind == k).collect();
        (of.len(), of.iter().map(|r| r.cost_usd).sum())
    };
    let (compacted, compaction_cost) = cost_of(RecordKind::Compaction);
    assert_eq!(compacted as u64, compactions);
    assert_eq!(cost_of(RecordKind::Turn).0, 8);
    let summary_bill: f64 = ledger
        .iter()
        .filter(|e| e.is_summary())
        .map(|e| e.cost)
        .sum();
    assert!(
        summary_bill > 0.0 && (compaction_cost - summary_bill).abs() <= 0.01 * summary_bill,
        "compactions recorded ${compaction_cost}, billed ${summary_bill}"
    );
    tests::live::assert_history_is_the_bill(&history, &ledger);
}

/// A fresh start is priced with what her rooms would send again: once her session holds lines
/// of a room that a fresh start's rehydration (half of `context_bytes`) leaves out, each turn's
/// record prices a fresh start above a rebuild by them; before her first turn it holds nothing,
/// and the two are equal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fresh_start_is_priced_with_the_lines_her_rooms_would_send_again() {
    let scene = Scene::new("run-resend", Limits::Relaxed).await;
    let (ann, dir) = (&scene.ann, scene.dir.clone());
    let mock = MockApi::start(MockConfig::default()).await.unwrap();
    let gw = start_live(&scene, &mock, "context_bytes = 512\n");
    let (m, g) = (&mock, &gw);
    let talk = |dm: matrix_sdk::Room, i: usize| async move {
        let answer = format!("answer {i}");
        let room = dm.room_id().to_string();
        m.script(serde_json::json!({"say": [{"room": room, "text": answer}]}));
        let line = format!("line {i}: {}", "a sentence of plain chat. ".repeat(4));
        dm.send(RoomMessageEventContent::text_plain(line))
            .await
            .unwrap();
        let got = wait_for_reply(ann, &dm, &answer, Duration::from_secs(90)).await;
        assert!(got.contains(&answer), "{got:?}; log:\n{}", g.log());
    };
    let first = open_dm(ann, &gw).await;
    for i in 0..3 {
        talk(first.clone(), i).await;
    }
    let second = open_dm(ann, &gw).await;
    talk(second, 3).await;
    let status: serde_json::Value = serde_json::from_slice(
        &std::fs::read(dir.join("state/personas/vera/status.json")).unwrap(),
    )
    .unwrap();
    let turns = status["turns"].as_array().cloned().unwrap_or_default();
    assert_eq!(turns.len(), 4, "{status}");
    let price = |t: &serde_json::Value, k: &str| t[k].as_f64().unwrap_or(f64::NAN);
    let (rebuild, fresh) = (
        price(&turns[0], "rebuild_usd"),
        price(&turns[0], "fresh_start_usd"),
    );
    assert!(rebuild > 0.0 && fresh == rebuild, "{status}");
    // The first room's ~110-byte lines and her answers do not fit in 256 bytes of rehydration.
    let last = &turns[3];
    let (rebuild, fresh) = (price(last, "rebuild_usd"), price(last, "fresh_start_usd"));
    assert!(fresh > rebuild && fresh < 2.0 * rebuild, "{status}");
    assert_eq!(gw.stop().code(), Some(0));
}

/// A CultNet client (signed Connect with a pinned key) reads vera's mail, acknowledges it and
/// speaks through her, exactly once, against the running binary; a wrong key is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cultnet_client_reads_acks_and_speaks_through_her() {
    use ed25519_dalek::SigningKey;
    use gateway::client::{Client, ClientError};
    use wire::docs::{
        ids, AckReceipt, AckRequest, GatewayStatus, PendingPage, PendingRequest, SendReceipt,
        SendRequest, Status, StatusRequest,
    };

    let scene = Scene::new("run-cultnet", Limits::Relaxed).await;
    let (url, ann, dir) = (scene.url.clone(), &scene.ann, scene.dir.clone());
    let lobby = public_room(ann, "cn-lobby").await;
    let organ = SigningKey::from_bytes(&[7; 32]);
    let public = public_hex(&organ);
    // An operator's tool key, made the way the README says: `cultnet-gateway keygen`.
    let tool_key = dir.join("tool.key");
    let keygen = std::process::Command::new(tests::matrix::gateway_bin())
        .args(["keygen", "--agent", "ops", "--persona", "vera", "--out"])
        .arg(&tool_key)
        .output()
        .unwrap();
    assert!(keygen.status.success());
    let tool_block = String::from_utf8(keygen.stdout).unwrap();
    let clients = format!(
        "\n[cultnet.quic]\nbind = \"127.0.0.1:0\"\n\n[[cultnet.client]]\nagent_id = \"organ\"\npublic_key = \"{public}\"\npersonas = [\"vera\"]\n{tool_block}"
    );
    let config = write_config(
        &dir,
        &url,
        &scene.vera_token,
        &["#cn-lobby:localhost"],
        &[],
        &clients,
    );
    let gw = GatewayProcess::start(&config);
    let addr = gw.cultnet_addr();
    let wait = Duration::from_secs(20);

    // A key that is not the pinned one is refused, with the reason.
    let wrong = SigningKey::from_bytes(&[8; 32]);
    match Client::connect(addr, "organ", &wrong, wait).await {
        Err(ClientError::Refused(why)) => assert!(why.contains("signature"), "{why}"),
        other => panic!("a wrong key was not refused: {other:?}"),
    }

    let mut c = Client::connect(addr, "organ", &organ, wait).await.unwrap();
    lobby
        .send(RoomMessageEventContent::text_plain("hi vera, from ann"))
        .await
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    let page = loop {
        let page: PendingPage = c
            .request(
                ids::PENDING_REQUEST,
                &format!("p{}", deadline.elapsed().as_millis()),
                &PendingRequest {
                    persona: "vera".into(),
                    after_seq: 0,
                    limit: None,
                    reply_bytes: None,
                },
            )
            .await
            .unwrap();
        if !page.deliveries.is_empty() {
            break page;
        }
        assert!(Instant::now() < deadline, "no mail; log:\n{}", gw.log());
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(page.deliveries[0].text, "hi vera, from ann");
    let seq = page.deliveries[0].seq;
    let ack: AckReceipt = c
        .request(
            ids::ACK_REQUEST,
            "a1",
            &AckRequest {
                persona: "vera".into(),
                through_seq: seq,
            },
        )
        .await
        .unwrap();
    assert_eq!((ack.status, ack.pending_count), (Status::Ok, 0));

    // The same send request twice (the second as a client retry): one Matrix event.
    let send = SendRequest {
        request_id: "organ-say-1".into(),
        persona: "vera".into(),
        room: "#cn-lobby:localhost".into(),
        text: "hello from vera's organ".into(),
        ..SendRequest::default()
    };
    let first: SendReceipt = c.request(ids::SEND_REQUEST, "s1", &send).await.unwrap();
    assert_eq!(first.status, Status::Ok, "{first:?}");
    let again: SendReceipt = c.request(ids::SEND_REQUEST, "s2", &send).await.unwrap();
    assert_eq!(again.event_id, first.event_id);
    let got = wait_for_reply(ann, &lobby, "hello from vera's organ", wait).await;
    assert_eq!(got, ["hello from vera's organ"]);

    // Her session is off: a turn request is refused with the reason; status shows her.
    let turn = tests::live::request_turn(&mut c, "vera", "t1", None).await;
    assert_eq!(turn.status, Status::Rejected);
    let status: GatewayStatus = c
        .request(ids::STATUS_REQUEST, "st", &StatusRequest::default())
        .await
        .unwrap();
    assert_eq!(status.personas.len(), 1);
    assert_eq!(
        (
            status.personas[0].acked_through,
            status.personas[0].pending_count
        ),
        (seq, 0)
    );
    // Garbage on the request channel is answered with an error, and the session survives.
    c.send_raw(b"\xc1\xc1".to_vec()).await.unwrap();
    assert!(matches!(
        c.next_message().await.unwrap(),
        wire::msg::Message::Error(_)
    ));
    let status: GatewayStatus = c
        .request(ids::STATUS_REQUEST, "st2", &StatusRequest::default())
        .await
        .unwrap();
    assert_eq!(status.peers, 1);
    c.close().await;
    let out = std::process::Command::new(tests::matrix::gateway_bin())
        .args([
            "client",
            "--agent",
            "ops",
            "--gateway",
            &addr.to_string(),
            "--key",
        ])
        .arg(&tool_key)
        .args(["pending", "--persona", "vera"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let page: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(page["throughSeq"], 0, "{page}");
    assert_eq!(page["pendingCount"], 0);
    // The same tool as a remote peer: QUIC, pinning the certificate the gateway made.
    let out = std::process::Command::new(tests::matrix::gateway_bin())
        .args([
            "client",
            "--agent",
            "ops",
            "--gateway",
            &gw.quic_addr().to_string(),
        ])
        .arg("--quic-cert")
        .arg(dir.join("state/quic/cert.der"))
        .arg("--key")
        .arg(&tool_key)
        .args(["status"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let status: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(status["personas"][0]["persona"], "vera", "{status}");
    assert_eq!(status["personas"][0]["ackedThrough"], seq, "{status}");
    assert!(gw.stop().success());
}

/// Her session is live but slow to start a turn by itself (a long debounce): a CultNet turn
/// request starts it at once, and her answer arrives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cultnet_turn_request_starts_her_turn_at_once() {
    use ed25519_dalek::SigningKey;
    use gateway::client::Client;
    use wire::docs::{ids, PendingPage, PendingRequest, Status};

    let scene = Scene::new("run-turn", Limits::Relaxed).await;
    let (url, ann, dir) = (scene.url.clone(), &scene.ann, scene.dir.clone());
    let lobby = public_room(ann, "tr-lobby").await;
    let mock = MockApi::start(MockConfig::default()).await.unwrap();
    let (session, _) = live_section(&dir, &mock, 200, "");
    // One turn per line this test sends: not the rules users get.
    let session = tests::live::every_line(&session);
    let session = tests::live::turns_on_request(&session);
    let heart = SigningKey::from_bytes(&[9; 32]);
    let public = public_hex(&heart);
    let config = write_config(
        &dir,
        &url,
        &scene.vera_token,
        &["#tr-lobby:localhost"],
        &[],
        &format!("{session}\n[[cultnet.client]]\nagent_id = \"heartbeat\"\npublic_key = \"{public}\"\npersonas = [\"*\"]\nverbs = [\"pending\", \"turn\"]\n"),
    );
    let gw = GatewayProcess::start(&config);
    let mut c = Client::connect(
        gw.cultnet_addr(),
        "heartbeat",
        &heart,
        Duration::from_secs(20),
    )
    .await
    .unwrap();
    lobby
        .send(RoomMessageEventContent::text_plain("anyone awake?"))
        .await
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut n = 0;
    loop {
        n += 1;
        let page: PendingPage = c
            .request(
                ids::PENDING_REQUEST,
                &format!("p{n}"),
                &PendingRequest {
                    persona: "vera".into(),
                    ..PendingRequest::default()
                },
            )
            .await
            .unwrap();
        if page.pending_count > 0 {
            break;
        }
        assert!(Instant::now() < deadline, "no mail; log:\n{}", gw.log());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // The mail waits: the debounce is ten minutes.
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(mock.ledger().is_empty(), "a turn ran by itself");
    let room = lobby.room_id().to_string();
    mock.script(serde_json::json!({"say": [{"room": room, "text": "awake now"}]}));
    let r = tests::live::request_turn(&mut c, "vera", "t1", Some("heartbeat")).await;
    assert_eq!(r.status, Status::Ok, "{r:?}");
    let got = wait_for_reply(ann, &lobby, "awake now", Duration::from_secs(60)).await;
    assert_eq!(got, ["awake now"], "log:\n{}", gw.log());
    c.close().await;
    assert!(gw.stop().success());
}

/// A slow homeserver (a proxy holds each send 4 s) and 70 send requests at once: 64 go out, the
/// other 6 are answered `failed` at once instead of piling up; repeated later they go out, a
/// repeat of a sent one makes nothing new, and Matrix has each text exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sends_beyond_the_in_flight_limit_are_refused_at_once_and_go_out_once_later() {
    use ed25519_dalek::SigningKey;
    use gateway::client::Client;
    use gateway::service::MAX_SENDS_IN_FLIGHT;
    use std::collections::BTreeMap;
    use tests::fault_proxy::FaultProxy;
    use wire::docs::{ids, SendReceipt, SendRequest, Status};
    use wire::msg::{Message, Put, RawDocument};

    let scene = Scene::new("run-busy", Limits::Relaxed).await;
    let (url, ann, dir) = (scene.url.clone(), &scene.ann, scene.dir.clone());
    let lobby = public_room(ann, "busy-lobby").await;
    let proxy = FaultProxy::start(&url).await;
    let organ = SigningKey::from_bytes(&[11; 32]);
    let clients = format!(
        "\n[[cultnet.client]]\nagent_id = \"organ\"\npublic_key = \"{}\"\npersonas = [\"vera\"]\n",
        public_hex(&organ)
    );
    let config = write_config(
        &dir,
        &proxy.url(),
        &scene.vera_token,
        &["#busy-lobby:localhost"],
        &[],
        &clients,
    );
    // One client sends them all, so its own in-flight limit must sit above the service's.
    tests::matrix::add_cultnet_lines(
        &config,
        &format!("max_in_flight = {}", MAX_SENDS_IN_FLIGHT * 2),
    );
    let gw = GatewayProcess::start(&config);
    let mut c = Client::connect(gw.cultnet_addr(), "organ", &organ, Duration::from_secs(30))
        .await
        .unwrap();
    let total = MAX_SENDS_IN_FLIGHT + 6;
    let send = |i: usize| SendRequest {
        request_id: format!("busy-{i}"),
        persona: "vera".into(),
        room: "#busy-lobby:localhost".into(),
        text: format!("busy {i}"),
        ..SendRequest::default()
    };
    proxy.delay_sends(Duration::from_secs(4));
    for i in 0..total {
        let put = Message::DocumentPutRaw(Put {
            message_id: format!("m{i}"),
            document: RawDocument::from_payload(
                ids::SEND_REQUEST,
                &format!("busy-{i}"),
                "2026-12-02T00:00:00Z",
                &send(i),
            ),
        });
        c.send_raw(put.encode()).await.unwrap();
    }
    let mut receipts: BTreeMap<String, SendReceipt> = BTreeMap::new();
    while receipts.len() < total {
        if let Message::DocumentPutRaw(p) = c.next_message().await.unwrap() {
            assert_eq!(p.document.schema_id, ids::SEND_RECEIPT);
            receipts.insert(
                p.document.record_key.clone(),
                p.document.payload_as().unwrap(),
            );
        }
    }
    let busy: Vec<usize> = (0..total)
        .filter(|i| receipts[&format!("busy-{i}")].status == Status::Failed)
        .collect();
    assert_eq!(busy.len(), 6, "{receipts:?}");
    for i in &busy {
        let r = &receipts[&format!("busy-{i}")];
        assert!(
            r.error
                .as_deref()
                .unwrap_or_default()
                .contains("sends are in flight"),
            "{r:?}"
        );
    }
    assert_eq!(
        receipts.values().filter(|r| r.status == Status::Ok).count(),
        MAX_SENDS_IN_FLIGHT
    );
    proxy.delay_sends(Duration::ZERO);
    for i in &busy {
        let r: SendReceipt = c
            .request(ids::SEND_REQUEST, &format!("again-{i}"), &send(*i))
            .await
            .unwrap();
        assert_eq!(r.status, Status::Ok, "{r:?}");
    }
    let sent_ok = (0..total)
        .find(|i| !busy.contains(i))
        .expect("one that went out");
    let r: SendReceipt = c
        .request(ids::SEND_REQUEST, "repeat", &send(sent_ok))
        .await
        .unwrap();
    assert_eq!(r.event_id, receipts[&format!("busy-{sent_ok}")].event_id);
    let mut got = wait_for_reply(ann, &lobby, "never said", Duration::from_secs(2)).await;
    got.sort();
    let mut want: Vec<String> = (0..total).map(|i| format!("busy {i}")).collect();
    want.sort();
    assert_eq!(got, want, "each text exactly once");
    c.close().await;
    assert!(gw.stop().success());
}

/// A homeserver that fails her reply's send every time the mouth tries (a proxy answers 502):
/// the turn fails and its batch stays unacked; the retry sends the reply she gave, once, and
/// does not ask her again (the second scripted reply is never used, the model billed once).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reply_whose_send_failed_is_sent_as_given_once_the_homeserver_takes_it() {
    use tests::fault_proxy::FaultProxy;

    let scene = Scene::new("run-unsent", Limits::Relaxed).await;
    let (url, ann, dir) = (scene.url.clone(), &scene.ann, scene.dir.clone());
    let lobby = public_room(ann, "unsent-lobby").await;
    let proxy = FaultProxy::start(&url).await;
    let mock = MockApi::start(MockConfig::default()).await.unwrap();
    let (session, _) = live_section(&dir, &mock, 100, "");
    // One turn per line this test sends: not the rules users get.
    let session = tests::live::every_line(&session);
    let config = write_config(
        &dir,
        &proxy.url(),
        &scene.vera_token,
        &["#unsent-lobby:localhost"],
        &[],
        &session,
    );
    // Her metrics, on a port of the system's choosing.
    tests::matrix::add_metrics(&config, "127.0.0.1:0");
    let gw = GatewayProcess::start(&config);
    let room = lobby.room_id().to_string();
    // Every attempt of the mouth's first send fails; the retry's first attempt goes through.
    proxy.fail_sends(gateway::mouth::MAX_ATTEMPTS);
    mock.script(serde_json::json!({"say": [{"room": room, "text": "said as given"}]}));
    mock.script(serde_json::json!({"say": [{"room": room, "text": "asked again"}]}));
    lobby
        .send(RoomMessageEventContent::text_plain("hello vera"))
        .await
        .unwrap();
    let got = wait_for_reply(ann, &lobby, "said as given", Duration::from_secs(120)).await;
    assert_eq!(got, ["said as given"], "log:\n{}", gw.log());
    assert_eq!(proxy.sends_failing(), 0, "the send never failed");
    assert!(
        gw.log().contains("sending her stored reply"),
        "log:\n{}",
        gw.log()
    );
    // She was asked once: one billed request carries the batch.
    let asked = mock
        .ledger()
        .iter()
        .filter(|e| e.status == 200 && e.last_user_text.contains("hello vera"))
        .count();
    assert_eq!(asked, 1, "{:?}", mock.ledger());
    // The metrics count the turn whose say failed by its failure, the one that sent her stored
    // reply as sent, and bill what the mock billed.
    let turns = |m: &std::collections::HashMap<String, f64>, outcome: &str| {
        let key = format!("cultnet_gateway_turns_total{{outcome=\"{outcome}\",persona=\"vera\"}}");
        m.get(&key).copied().unwrap_or(0.0)
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    let m = loop {
        let m = tests::matrix::scrape(gw.metrics_addr(), &gw);
        if turns(&m, "sent") >= 1.0 || Instant::now() > deadline {
            break m;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let counted: Vec<f64> = ["send_failed", "sent", "not_sent"]
        .iter()
        .map(|o| turns(&m, o))
        .collect();
    assert_eq!(counted, [1.0, 1.0, 0.0], "{m:?}");
    let reported = tests::matrix::value(&m, "cultnet_gateway_cost_usd_total{persona=\"vera\"}");
    let billed: f64 = mock.ledger().iter().map(|e| e.cost).sum();
    assert!(
        billed > 0.0 && (reported - billed).abs() <= 0.01 * billed,
        "reported ${reported}, billed ${billed}"
    );
    // Nothing more comes, and the batch is acked.
    assert_eq!(
        wait_for_reply(ann, &lobby, "asked again", Duration::from_secs(3)).await,
        ["said as given"]
    );
    assert_eq!(gw.stop().code(), Some(0));
    let inbox = Inbox::open(&dir.join("state/inbox")).unwrap();
    let c = inbox.counts("vera").unwrap();
    assert_eq!((c.highest, c.acked_through, c.pending), (1, 1, 0));
    // The one billed turn is in her record, with its cost and why its say did not go out.
    let status: serde_json::Value = serde_json::from_slice(
        &std::fs::read(dir.join("state/personas/vera/status.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(status["turns_total"], 1, "{status}");
    let turn = &status["turns"][0];
    assert!(
        turn["outcome"]
            .as_str()
            .is_some_and(|o| o.contains("not sent yet")),
        "{turn}"
    );
    assert!(turn["cost_usd"].as_f64().is_some_and(|c| c > 0.0), "{turn}");
}

/// Keep-warm with the 5-minute TTL, through the binary in real time (about six minutes): after
/// her turn the gateway restarts, and the policy, which kept what it knew of her session,
/// refreshes her cache just before it expires; the refresh reads her
/// conversation from cache and is in her history at what the mock billed for it; her next turn,
/// after the five minutes, still reads the conversation instead of writing it again; and all
/// her records together cost what the mock billed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn her_cache_is_kept_warm_through_a_silence_longer_than_its_ttl() {
    use gateway::turns::{read_history, RecordKind};

    let scene = Scene::new("run-warm", Limits::Relaxed).await;
    let (ann, dir) = (&scene.ann, scene.dir.clone());
    let mock = MockApi::start(MockConfig::default()).await.unwrap();
    let (config, _) = vera_live(&scene, &mock, 800, "cache_ttl = \"5m\"\n");
    let gw = GatewayProcess::start(&config);
    let dm = open_dm(ann, &gw).await;
    let room = dm.room_id().to_string();
    let say = |text: &str| serde_json::json!({"say": [{"room": room, "text": text}]});
    mock.script(say("first answer"));
    let asked = Instant::now();
    dm.send(RoomMessageEventContent::text_plain("hello vera"))
        .await
        .unwrap();
    let got = wait_for_reply(ann, &dm, "first answer", Duration::from_secs(90)).await;
    assert_eq!(got, ["first answer"], "log:\n{}", gw.log());
    let ledger = mock.ledger();
    let first = ledger
        .iter()
        .rposition(|e| e.status == 200 && e.last_user_text.contains("hello vera"))
        .expect("her first turn billed");
    let first_prompt = ledger[first].usage.prompt_tokens();
    // The gateway restarts in her silence (once her turn is recorded): what the policy knew
    // of her session is kept, so the refresh still comes.
    let history = dir.join("state/personas/vera/turns.jsonl");
    let deadline = Instant::now() + Duration::from_secs(30);
    while read_history(&history).unwrap_or_default().is_empty() {
        assert!(Instant::now() < deadline, "her turn was never recorded");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(gw.stop().code(), Some(0));
    let gw = GatewayProcess::start(&config);

    // The refresh, when the entry her turn wrote is about to expire.
    let refreshes = loop {
        let h = read_history(&history).unwrap_or_default();
        let r: Vec<_> = h
            .into_iter()
            .filter(|r| r.kind == RecordKind::Refresh)
            .collect();
        if !r.is_empty() {
            break r;
        }
        assert!(
            asked.elapsed() < Duration::from_secs(330),
            "no refresh within the TTL; log:\n{}",
            gw.log()
        );
        tokio::time::sleep(Duration::from_secs(1)).await;
    };
    // Each refresh read her conversation from cache: it came before the entry expired (the
    // mock's clock decides, not this test's).
    let billed: Vec<_> = mock.ledger()[first + 1..].to_vec();
    assert_eq!(billed.len(), refreshes.len(), "{billed:?}");
    for (r, e) in refreshes.iter().zip(&billed) {
        assert!(
            e.usage.cache_read >= first_prompt * 9 / 10,
            "the refresh did not read her conversation: {e:?}"
        );
        assert!(
            (r.cost_usd - e.cost).abs() <= 0.01 * e.cost,
            "refresh recorded ${}, billed ${}",
            r.cost_usd,
            e.cost
        );
    }

    // Past the five minutes since her turn: without the refresh her entry would be gone.
    let ttl = Duration::from_secs(300);
    tokio::time::sleep((ttl + Duration::from_secs(5)).saturating_sub(asked.elapsed())).await;
    mock.script(say("second answer"));
    dm.send(RoomMessageEventContent::text_plain("still there?"))
        .await
        .unwrap();
    let got = wait_for_reply(ann, &dm, "second answer", Duration::from_secs(90)).await;
    assert_eq!(got, ["first answer", "second answer"], "log:\n{}", gw.log());
    let ledger = mock.ledger();
    let second = ledger
        .iter()
        .rfind(|e| e.status == 200 && e.last_user_text.contains("still there?"))
        .expect("her second turn billed");
    assert!(
        second.usage.cache_read >= first_prompt * 9 / 10,
        "her conversation was written again after the silence: {second:?}"
    );
    assert_eq!(gw.stop().code(), Some(0));

    // Her status counts the refreshes and what they cost; her records cost the bill.
    let status: serde_json::Value = serde_json::from_slice(
        &std::fs::read(dir.join("state/personas/vera/status.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(status["refreshes"].as_u64(), Some(refreshes.len() as u64));
    let upkeep: f64 = refreshes.iter().map(|r| r.cost_usd).sum();
    assert!(
        (status["upkeep_usd"].as_f64().unwrap_or(0.0) - upkeep).abs() < 1e-9,
        "{status}"
    );
    tests::live::assert_history_is_the_bill(&read_history(&history).unwrap(), &ledger);
}
