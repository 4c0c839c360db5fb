//! The real claude CLI (pinned, installed by deploy/install-claude-cli.sh) driven by
//! `session::driver` against the mock Messages API.

use std::path::PathBuf;
use std::time::Duration;

use serde_json::json;
use session::cost::Ttl;
use session::driver::{Cli, CliConfig};
use session::policy::Outcome;
use session::render::{render, reply_schema, validate, Seen};
use tests::claude_cli::new_session_id;
use tests::mock_api::{Fault, MockApi, MockConfig};
use wire::docs::Delivery;

/// ~24k tokens of doctrine (the mock counts a quarter token per byte).
fn doctrine(dir: &std::path::Path) -> PathBuf {
    let mut text = String::from(
        "You are Mira, a persona in the CultNet swarm. Reply with the StructuredOutput tool.\n",
    );
    for i in 0..1500 {
        text.push_str(&format!(
            "Doctrine clause {i}: be kind, be brief, and answer only in your rooms.\n"
        ));
    }
    let path = dir.join("doctrine.md");
    std::fs::write(&path, text).unwrap();
    path
}

fn config(mock: &MockApi, dir: &std::path::Path) -> CliConfig {
    CliConfig {
        exe: tests::claude_cli::executable(),
        model: "claude-sonnet-4-6".into(),
        system_prompt_file: doctrine(dir),
        json_schema: reply_schema(),
        config_dir: dir.join("config"),
        work_dir: dir.join("work"),
        api_base_url: mock.url(),
        credential: session::driver::Credential::ApiKey("mock-key".into()),
        cache_ttl: Ttl::OneHour,
        thinking: false,
        session_id: None,
        resume: false,
        system_prompt_changed: false,
        max_retries: Some(1),
        turn_timeout: Duration::from_secs(60),
        grace: Duration::from_secs(10),
    }
}

fn delivery(seq: u64, text: &str) -> Delivery {
    Delivery {
        seq,
        persona: "mira".into(),
        room_id: "!lobby:localhost".into(),
        event_id: format!("$e{seq}"),
        sender: "@alice:localhost".into(),
        sender_name: Some("alice".into()),
        ts: seq as i64,
        text: text.into(),
        to_you: true,
        ..Delivery::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_batches_are_fifty_turns_of_one_warm_process() {
    let mock = MockApi::start(MockConfig::default()).await.unwrap();
    let scratch = tests::ScratchDir::new("fifty");
    let dir = scratch.path().to_path_buf();
    let mut cli = Cli::spawn(config(&mock, &dir)).await.expect("CLI ready");
    let pid = cli.pid();
    let mut seen = Seen::default();
    for i in 1..=50u64 {
        mock.script(json!({"say": [{"room": "!lobby:localhost", "text": format!("reply {i}")}]}));
        let text = render(&[delivery(i, &format!("message {i}"))], &mut seen, &[]);
        let turn = cli.turn(&text).await.expect("turn");
        assert!(!turn.result.is_error, "turn {i}: {:?}", turn.result);
        let reply = validate(
            turn.result.structured_output.as_ref(),
            &["!lobby:localhost"],
        )
        .expect("reply");
        assert_eq!(reply.say[0].text, format!("reply {i}"));
    }
    assert_eq!(cli.pid(), pid, "one process for all turns");
    let ledger = mock.ledger();
    assert_eq!(ledger.len(), 50, "one API request per turn");
    for e in &ledger[1..] {
        let ratio = e.usage.cache_read as f64 / e.prompt_tokens as f64;
        assert!(
            ratio >= 0.95,
            "request {}: only {:.3} of input read from cache ({:?})",
            e.n,
            ratio,
            e.usage
        );
    }
    let total: f64 = ledger.iter().map(|e| e.cost).sum();
    eprintln!(
        "50 turns: ${total:.4} billed by the mock; turn 50 read {:.1}% from cache",
        100.0 * ledger[49].usage.cache_read as f64 / ledger[49].prompt_tokens as f64
    );
    cli.shutdown(Duration::from_secs(5)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slash_commands_in_chat_reach_the_model_as_text() {
    let mock = MockApi::start(MockConfig::default()).await.unwrap();
    let scratch = tests::ScratchDir::new("slash");
    let dir = scratch.path().to_path_buf();
    let mut cli = Cli::spawn(config(&mock, &dir)).await.expect("CLI ready");
    let mut seen = Seen::default();
    let first = cli
        .turn(&render(&[delivery(1, "hello")], &mut seen, &[]))
        .await
        .unwrap();
    let session = cli.session_id().map(str::to_owned);
    for (seq, evil) in [(2, "/clear"), (3, "/compact")] {
        let turn = cli
            .turn(&render(&[delivery(seq, evil)], &mut seen, &[]))
            .await
            .unwrap();
        assert!(!turn.reset, "{evil} reset the conversation");
        assert!(!turn.result.is_error, "{evil}: {:?}", turn.result);
        assert_eq!(
            cli.session_id().map(str::to_owned),
            session,
            "{evil} changed the session"
        );
        let sent = mock.ledger().last().unwrap().last_user_text.clone();
        assert!(
            sent.contains(evil) && sent.starts_with("[cultnet batch"),
            "{evil} not sent as text: {sent:?}"
        );
    }
    // Nothing was wiped: the history still holds the first turn, read from the cache.
    let last = mock.ledger().last().unwrap().clone();
    assert!(last.usage.cache_read > 20_000, "{:?}", last.usage);
    assert_eq!(mock.ledger().len(), 3);
    assert!(first.result.session_id.is_some());
    // Control: the same text sent raw, without the batch header, IS run as a command, and the
    // driver sees the reset. This is what the rendering protects against.
    let raw = cli.turn("/clear").await.unwrap();
    assert!(
        raw.reset,
        "a raw /clear did not reset: the check above could not fail"
    );
    assert_eq!(mock.ledger().len(), 3, "/clear makes no API call");
    cli.shutdown(Duration::from_secs(5)).await;
}

/// A say longer than her schema allows (`MAX_SAY_CHARS`, what the mouth can send) never
/// leaves the turn: the CLI bounces it back to her with the schema's reason, and her answer to
/// that (here, the text split in two) is the turn's reply.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_say_over_the_limit_is_bounced_back_to_her_within_the_turn() {
    use session::render::MAX_SAY_CHARS;
    let mock = MockApi::start(MockConfig::default()).await.unwrap();
    let scratch = tests::ScratchDir::new("long-say");
    let dir = scratch.path().to_path_buf();
    let mut cli = Cli::spawn(config(&mock, &dir)).await.expect("CLI ready");
    let room = "!lobby:localhost";
    let half = "y".repeat(MAX_SAY_CHARS / 2 + 1);
    mock.script(json!({"say": [{"room": room, "text": "x".repeat(MAX_SAY_CHARS + 1)}]}));
    mock.script(json!({"say": [{"room": room, "text": half}, {"room": room, "text": half}]}));
    let turn = cli
        .turn(&render(
            &[delivery(1, "paste the whole log")],
            &mut Seen::default(),
            &[],
        ))
        .await
        .expect("turn");
    assert!(!turn.result.is_error, "{:?}", turn.result);
    let reply = validate(turn.result.structured_output.as_ref(), &[room]).expect("reply");
    let sizes: Vec<usize> = reply.say.iter().map(|s| s.text.len()).collect();
    assert_eq!(sizes, [half.len(), half.len()]);
    let ledger = mock.ledger();
    assert_eq!(ledger.len(), 2, "the long say was asked for again");
    // The driver saw both requests: the first one's read as an earlier one, the second's
    // prompt as the turn's last.
    assert_eq!(turn.earlier_reads, [ledger[0].usage.cache_read]);
    assert_eq!(
        turn.last_request.map(|u| u.prompt_tokens()),
        Some(ledger[1].prompt_tokens)
    );
    // The CLI's own words (2.1.332): "Output does not match required schema: /say/0/text:
    // must NOT have more than 8192 characters (got 8193)".
    let why = format!("must NOT have more than {MAX_SAY_CHARS} characters");
    assert!(
        ledger[1].user_text.contains(&why) && !ledger[0].user_text.contains(&why),
        "the bounce does not say why: {}",
        ledger[1].user_text
    );
    cli.shutdown(Duration::from_secs(5)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_process_resumes_the_same_session_from_cache() {
    let mock = MockApi::start(MockConfig::default()).await.unwrap();
    let scratch = tests::ScratchDir::new("resume");
    let dir = scratch.path().to_path_buf();
    let id = new_session_id();
    let mut cfg = config(&mock, &dir);
    cfg.session_id = Some(id.clone());
    let mut cli = Cli::spawn(cfg.clone()).await.expect("CLI ready");
    let mut seen = Seen::default();
    for i in 1..=3 {
        cli.turn(&render(
            &[delivery(i, &format!("before restart {i}"))],
            &mut seen,
            &[],
        ))
        .await
        .unwrap();
    }
    assert_eq!(cli.session_id(), Some(id.as_str()));
    cli.shutdown(Duration::from_secs(5)).await;
    let before = mock.ledger().last().unwrap().clone();
    cfg.resume = true;
    let mut cli = Cli::spawn(cfg).await.expect("resumed CLI ready");
    let turn = cli
        .turn(&render(&[delivery(4, "after restart")], &mut seen, &[]))
        .await
        .unwrap();
    assert!(!turn.result.is_error, "{:?}", turn.result);
    assert_eq!(
        cli.session_id(),
        Some(id.as_str()),
        "resume kept the session id"
    );
    let after = mock.ledger().last().unwrap().clone();
    // The old conversation is the new request's prefix, and it is read from the cache.
    let shared = before
        .block_hashes
        .iter()
        .zip(&after.block_hashes)
        .take_while(|(a, b)| a == b)
        .count();
    assert!(
        shared + 1 >= before.block_hashes.len(),
        "only {shared} of {} blocks shared",
        before.block_hashes.len()
    );
    assert!(
        after.usage.cache_read as f64 >= 0.9 * before.prompt_tokens as f64,
        "{:?}",
        after.usage
    );
    cli.shutdown(Duration::from_secs(5)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cli_killed_mid_turn_is_resumed_and_the_batch_retried() {
    let mock = MockApi::start(MockConfig::default()).await.unwrap();
    let scratch = tests::ScratchDir::new("kill");
    let dir = scratch.path().to_path_buf();
    let id = new_session_id();
    let mut cfg = config(&mock, &dir);
    cfg.session_id = Some(id.clone());
    let mut cli = Cli::spawn(cfg.clone()).await.expect("CLI ready");
    let mut seen = Seen::default();
    cli.turn(&render(&[delivery(1, "first")], &mut seen, &[]))
        .await
        .unwrap();
    // The next request hangs in the mock; the process is killed while it waits.
    mock.inject(Fault::Delay(Duration::from_secs(30)));
    let pid = cli.pid().unwrap();
    let killer = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(800)).await;
        let _ = std::process::Command::new("kill")
            .args(["-9", &pid.to_string()])
            .status();
    });
    let batch = render(&[delivery(2, "second")], &mut Seen::default(), &[]);
    let err = cli
        .turn(&batch)
        .await
        .expect_err("the turn must fail when the CLI dies");
    assert!(
        matches!(err, session::driver::DriverError::Exited(_)),
        "{err}"
    );
    killer.await.unwrap();
    cfg.resume = true;
    let mut cli = Cli::spawn(cfg).await.expect("resumed after the kill");
    mock.script(json!({"say": [{"room": "!lobby:localhost", "text": "answer to second"}]}));
    let turn = cli.turn(&batch).await.unwrap();
    assert!(!turn.result.is_error, "{:?}", turn.result);
    assert_eq!(
        turn.result.structured_output.as_ref().unwrap()["say"][0]["text"],
        "answer to second"
    );
    assert_eq!(cli.session_id(), Some(id.as_str()));
    cli.shutdown(Duration::from_secs(5)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_errors_end_in_a_defined_state_and_the_process_survives() {
    let mock = MockApi::start(MockConfig::default()).await.unwrap();
    let scratch = tests::ScratchDir::new("errors");
    let dir = scratch.path().to_path_buf();
    let mut cli = Cli::spawn(config(&mock, &dir)).await.expect("CLI ready");
    let pid = cli.pid();
    let mut seen = Seen::default();
    cli.turn(&render(&[delivery(1, "warm up")], &mut seen, &[]))
        .await
        .unwrap();
    // With one retry allowed: a 400 is not retried (one request), 529 and 500 are (two).
    for (seq, fault, attempts, outcome) in [
        (2, Fault::PromptTooLong, 1, Outcome::PromptTooLong),
        (3, Fault::Overloaded, 2, Outcome::ApiError),
        (4, Fault::ServerError, 2, Outcome::ApiError),
    ] {
        let before = mock.ledger().len();
        for _ in 0..attempts {
            mock.inject(fault.clone());
        }
        let turn = cli
            .turn(&render(&[delivery(seq, "hello")], &mut seen, &[]))
            .await
            .unwrap();
        assert!(turn.result.is_error, "{fault:?}: {:?}", turn.result);
        assert_eq!(turn.result.outcome(), outcome, "{fault:?}");
        assert_eq!(
            mock.ledger().len() - before,
            attempts,
            "{fault:?}: requests made"
        );
        assert_eq!(
            turn.retries as usize,
            attempts - 1,
            "{fault:?}: api_retry events"
        );
        assert_eq!(cli.pid(), pid, "{fault:?} killed the process");
        // The session goes on: the next turn succeeds in the same process.
        let next = cli
            .turn(&render(&[delivery(seq + 10, "again")], &mut seen, &[]))
            .await
            .unwrap();
        assert!(!next.result.is_error, "after {fault:?}: {:?}", next.result);
    }
    cli.shutdown(Duration::from_secs(5)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_turn_past_its_timeout_is_interrupted_and_the_process_goes_on() {
    let mock = MockApi::start(MockConfig::default()).await.unwrap();
    let scratch = tests::ScratchDir::new("timeout");
    let dir = scratch.path().to_path_buf();
    let mut cfg = config(&mock, &dir);
    cfg.turn_timeout = Duration::from_secs(2);
    let mut cli = Cli::spawn(cfg).await.expect("CLI ready");
    let pid = cli.pid();
    let mut seen = Seen::default();
    mock.inject(Fault::Delay(Duration::from_secs(30)));
    let turn = cli
        .turn(&render(&[delivery(1, "slow")], &mut seen, &[]))
        .await
        .expect("the interrupted turn's result");
    assert!(turn.result.is_error, "{:?}", turn.result);
    assert_eq!(
        turn.result.terminal_reason.as_deref(),
        Some("aborted_streaming")
    );
    assert_eq!(cli.pid(), pid, "interrupted, not killed");
    let next = cli
        .turn(&render(&[delivery(2, "quick")], &mut seen, &[]))
        .await
        .unwrap();
    assert!(!next.result.is_error, "{:?}", next.result);
    cli.shutdown(Duration::from_secs(5)).await;
}

/// The gateway's compaction: the CLI's own `/compact` (one summary request), the same session
/// id afterwards, and a shorter conversation for the next turn.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compaction_summarises_and_the_session_goes_on_shorter() {
    let mock = MockApi::start(MockConfig::default()).await.unwrap();
    let scratch = tests::ScratchDir::new("compact");
    let dir = scratch.path().to_path_buf();
    let mut cli = Cli::spawn(config(&mock, &dir)).await.expect("CLI ready");
    let mut seen = Seen::default();
    let long = "a long line of chat that fills the conversation ".repeat(200);
    for seq in 1..=4 {
        let t = cli
            .turn(&render(&[delivery(seq, &long)], &mut seen, &[]))
            .await
            .unwrap();
        assert!(!t.result.is_error);
        assert!(t.compacted.is_none(), "compacted by itself");
    }
    let session = cli.session_id().map(str::to_owned);
    let before = mock.ledger().last().unwrap().prompt_tokens;
    let requests = mock.ledger().len();
    let c = cli.compact().await.unwrap();
    let m = c.compacted.expect("a compact boundary");
    assert_eq!(m.trigger, "manual");
    assert!(m.post_tokens < m.pre_tokens, "{m:?}");
    assert!(!c.reset && !c.result.is_error, "{:?}", c.result);
    assert_eq!(mock.ledger().len(), requests + 1, "one summary request");
    assert_eq!(cli.session_id().map(str::to_owned), session);
    let after = cli
        .turn(&render(&[delivery(5, "after the summary")], &mut seen, &[]))
        .await
        .unwrap();
    assert!(!after.result.is_error);
    let next = mock.ledger().last().unwrap().clone();
    assert!(
        next.prompt_tokens < before,
        "the conversation did not shrink: {} -> {}",
        before,
        next.prompt_tokens
    );
    assert!(next.last_user_text.contains("after the summary"));
    cli.shutdown(Duration::from_secs(5)).await;
}

/// What the CLI (2.1.332) does with a turn the API refused as too long, then `/compact`: the
/// refused message stays in its conversation; the summary request that includes it is too
/// long too, so the CLI summarizes the turns before it and keeps it verbatim after the
/// summary, where the next turn sends it again. (So the gateway's retry of a refused batch
/// after compacting would show her the batch twice: it reads the compaction's preserved
/// messages and retries with a note alone when the batch was kept.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_turn_is_kept_verbatim_past_the_compaction_after_it() {
    let mock = MockApi::start(MockConfig {
        context_window: 40_000,
        ..MockConfig::default()
    })
    .await
    .unwrap();
    let scratch = tests::ScratchDir::new("refused-compact");
    let dir = scratch.path().to_path_buf();
    let mut cli = Cli::spawn(config(&mock, &dir)).await.expect("CLI ready");
    let mut seen = Seen::default();
    let long = "a long line of chat that fills the conversation ".repeat(100);
    for seq in 1..=2 {
        let text = render(
            &[delivery(seq, &format!("earlier {seq} {long}"))],
            &mut seen,
            &[],
        );
        let t = cli.turn(&text).await.unwrap();
        assert!(!t.result.is_error, "{:?}", t.result);
    }
    // ~16k tokens: with the ~25k-token doctrine, past the 40k window.
    let huge = "the refused one ".repeat(4000);
    let text = render(&[delivery(3, &huge)], &mut seen, &[]);
    let refused = cli.turn(&text).await.unwrap();
    assert_eq!(refused.result.outcome(), Outcome::PromptTooLong);
    let sid = cli.session_id().unwrap().to_owned();
    let header = session::render::batch_header(&text).unwrap();
    let uuid = session::driver::transcript_user_message(&config(&mock, &dir), &sid, header)
        .expect("the refused message in her transcript");
    let from = mock.ledger().len();
    let c = cli.compact().await.unwrap();
    assert!(!c.result.is_error, "{:?}", c.result);
    let kept = c.compacted.expect("a boundary").preserved_messages.uuids;
    assert!(kept.contains(&uuid), "{uuid} not in {kept:?}");
    cli.turn("[note] go on").await.unwrap();
    let holds = |e: &tests::mock_api::LedgerEntry| e.user_text.contains(&huge);
    let requests: Vec<(u16, bool)> = mock.ledger()[from..]
        .iter()
        .map(|e| (e.status, holds(e)))
        .collect();
    // The summary request with it (too long), the one without it, then the next turn, which
    // carries it again (too long here as well).
    assert_eq!(requests, [(400, true), (200, false), (400, true)]);
    cli.shutdown(Duration::from_secs(5)).await;
}

/// Keep-warm over hours: every refresh reads the conversation's own entry (not the one the
/// previous refresh wrote), so after five refreshes spanning five hours the next turn, in a
/// resumed process, still reads the whole conversation from the cache.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refreshes_keep_the_conversation_itself_warm_for_hours() {
    let mock = MockApi::start(MockConfig::default()).await.unwrap();
    let scratch = tests::ScratchDir::new("keepwarm");
    let dir = scratch.path().to_path_buf();
    let cfg = config(&mock, &dir);
    let mut cli = Cli::spawn(cfg.clone()).await.expect("CLI ready");
    let mut seen = Seen::default();
    cli.turn(&render(&[delivery(1, "good morning")], &mut seen, &[]))
        .await
        .unwrap();
    let sid = cli.session_id().expect("a session").to_owned();
    cli.shutdown(Duration::from_secs(5)).await;
    let conversation = mock.ledger()[0].prompt_tokens;
    for i in 0..5 {
        // 59 minutes: the 1-hour entry is alive only if the last refresh re-armed it.
        mock.advance(Duration::from_secs(59 * 60));
        let r = session::driver::refresh_fork(&cfg, &sid).await.unwrap();
        assert!(!r.is_error, "refresh {i}: {r:?}");
        let e = mock.ledger().last().cloned().unwrap();
        assert!(
            e.usage.cache_read >= conversation,
            "refresh {i} read {} of the conversation's {conversation}: {e:?}",
            e.usage.cache_read
        );
    }
    mock.advance(Duration::from_secs(59 * 60));
    let mut resumed = cfg.clone();
    resumed.session_id = Some(sid.clone());
    resumed.resume = true;
    let mut cli = Cli::spawn(resumed).await.expect("CLI resumed");
    cli.turn(&render(&[delivery(2, "still there?")], &mut seen, &[]))
        .await
        .unwrap();
    let e = mock.ledger().last().cloned().unwrap();
    assert!(
        e.usage.cache_read >= conversation,
        "the turn after five hours of refreshes read {} of {conversation}",
        e.usage.cache_read
    );
    cli.shutdown(Duration::from_secs(5)).await;
}

/// The resume-per-turn rival of the session benchmark: a process per batch, resuming one
/// session, with the CLI's own auto-compaction on; each batch is a turn of the same session.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_shot_turns_resume_one_session() {
    use session::driver::{one_shot, Compaction};
    let mock = MockApi::start(MockConfig::default()).await.unwrap();
    let scratch = tests::ScratchDir::new("oneshot");
    let dir = scratch.path().to_path_buf();
    let cfg = config(&mock, &dir);
    let sid = new_session_id();
    let mut seen = Seen::default();
    for i in 1..=3u64 {
        mock.script(json!({"say": [{"room": "!lobby:localhost", "text": format!("reply {i}")}]}));
        let text = render(&[delivery(i, &format!("message {i}"))], &mut seen, &[]);
        let r = one_shot(&cfg, &sid, i > 1, &text, Compaction::Cli)
            .await
            .unwrap();
        assert!(!r.is_error, "turn {i}: {r:?}");
        assert_eq!(r.session_id.as_deref(), Some(sid.as_str()));
    }
    let ledger = mock.ledger();
    assert_eq!(ledger.len(), 3);
    // The third request carries the first two messages: one conversation.
    assert!(ledger[2].user_text.contains("message 1"), "{:?}", ledger[2]);
    assert!(ledger[2].usage.cache_read > 0);
}

/// The cache's touch is when the turn's last request began, not when its reply had streamed:
/// a reply that takes 1.5 s (the mock's delay) ends 1.5 s after the read, and a retried
/// request's read is the retry's, after the failed one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_turns_cache_touch_is_when_its_last_request_began() {
    let mock = MockApi::start(MockConfig::default()).await.unwrap();
    let scratch = tests::ScratchDir::new("touch");
    let dir = scratch.path().to_path_buf();
    let mut cli = Cli::spawn(config(&mock, &dir)).await.expect("CLI ready");
    let mut seen = Seen::default();
    let slow = Duration::from_millis(1500);
    for (seq, faults) in [
        (1, vec![Fault::Delay(slow)]),
        (2, vec![Fault::Overloaded, Fault::Delay(slow)]),
    ] {
        let retried = faults.len() - 1;
        for f in faults {
            mock.inject(f);
        }
        let before = std::time::Instant::now();
        let turn = cli
            .turn(&render(&[delivery(seq, "hello")], &mut seen, &[]))
            .await
            .unwrap();
        let ended = std::time::Instant::now();
        assert!(!turn.result.is_error, "{:?}", turn.result);
        assert_eq!(turn.retries as usize, retried);
        assert!(turn.last_request_at >= before, "turn {seq}");
        let streamed = ended.duration_since(turn.last_request_at);
        assert!(
            streamed >= slow,
            "turn {seq}: the touch is {streamed:?} before the end, less than the reply took"
        );
    }
    cli.shutdown(Duration::from_secs(5)).await;
}

/// What the gateway's retry of a failed turn relies on: a turn that ended with a result, an
/// API error's too, is in the session's transcript, so a new process resuming the session sends
/// its text again (the retry must not repeat it). A turn whose process was killed before its
/// result may be there or not (its text is written as the turn starts, racing the kill), and
/// `driver::transcript_holds` tells which, as the resumed process then sends it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_turn_outlives_its_process_and_the_transcript_says_what_a_killed_one_left() {
    let mock = MockApi::start(MockConfig::default()).await.unwrap();
    let scratch = tests::ScratchDir::new("failed-kept");
    let dir = scratch.path().to_path_buf();
    let mut cfg = config(&mock, &dir);
    let sid = new_session_id();
    cfg.session_id = Some(sid.clone());
    let mut cli = Cli::spawn(cfg.clone()).await.expect("CLI ready");
    cli.turn("first message ALPHA").await.unwrap();
    // One retry allowed: two 529s end the turn with an API error.
    mock.inject(Fault::Overloaded);
    mock.inject(Fault::Overloaded);
    let failed = cli.turn("second message BRAVO").await.unwrap();
    assert_eq!(
        failed.result.outcome(),
        Outcome::ApiError,
        "{:?}",
        failed.result
    );
    cli.shutdown(Duration::from_secs(5)).await;
    let holds = |needle: &str| session::driver::transcript_holds(&cfg, &sid, needle);
    assert!(holds("second message BRAVO"));
    assert!(!holds("a line never sent"));
    // A killed turn: its request reached the API, its answer never came back.
    let resumed = CliConfig {
        resume: true,
        ..cfg.clone()
    };
    let mut cli = Cli::spawn(resumed.clone()).await.expect("CLI ready");
    mock.inject(Fault::Delay(Duration::from_secs(10)));
    let before = mock.ledger().len();
    let pid = cli.pid().expect("pid");
    let killed = tokio::spawn(async move {
        let _ = cli.turn("third message CHARLIE").await;
    });
    while mock.ledger().len() == before {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let _ = std::process::Command::new("kill")
        .args(["-9", &pid.to_string()])
        .status();
    let _ = killed.await;
    let left = holds("third message CHARLIE");
    let mut cli = Cli::spawn(resumed).await.expect("CLI ready");
    let next = cli.turn("fourth message DELTA").await.unwrap();
    assert!(!next.result.is_error, "{:?}", next.result);
    let sent = mock.ledger().last().cloned().unwrap().user_text;
    assert_eq!(sent.matches("BRAVO").count(), 1, "{sent}");
    assert_eq!(
        sent.matches("CHARLIE").count(),
        usize::from(left),
        "the transcript said {left}: {sent}"
    );
    cli.shutdown(Duration::from_secs(5)).await;
}

/// Her process dies with the gateway (Linux's parent-death signal), which is sent when the
/// thread that spawned the child exits; tokio's threads come and go (a worker's thread after
/// `block_in_place` ends 10 s idle in the blocking pool), so a process asked for from a thread
/// that then exits must live on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_process_outlives_the_thread_that_asked_for_it() {
    let mock = MockApi::start(MockConfig::default()).await.unwrap();
    let scratch = tests::ScratchDir::new("thread-gone");
    let dir = scratch.path().to_path_buf();
    let cfg = config(&mock, &dir);
    let runtime = tokio::runtime::Handle::current();
    let mut cli = std::thread::spawn(move || runtime.block_on(Cli::spawn(cfg)))
        .join()
        .expect("the thread")
        .expect("CLI ready");
    let pid = cli.pid();
    tokio::time::sleep(Duration::from_secs(1)).await;
    let turn = cli
        .turn("are you still there?")
        .await
        .expect("the process lives on");
    assert!(!turn.result.is_error, "{:?}", turn.result);
    assert_eq!(cli.pid(), pid);
    cli.shutdown(Duration::from_secs(5)).await;
}
