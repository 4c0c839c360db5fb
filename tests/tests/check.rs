//! `cultnet-gateway check` against a real Synapse: a table of broken configs, each with the
//! line that names the problem and its fix, and a good config that passes.

use std::path::{Path, PathBuf};

use tests::live::live_section;
use tests::matrix::{public_room, token_for, write_config, write_private, GatewayProcess, Scene};
use tests::mock_api::{MockApi, MockConfig};
use tests::synapse::Limits;

/// Runs `check`; its exit code and what it printed.
fn check(config: &Path) -> (Option<i32>, String) {
    let out = tests::matrix::run_cli(&["check"], config);
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
    )
}

/// The FAIL line about `subject`.
fn fail_line<'a>(out: &'a str, subject: &str) -> &'a str {
    out.lines()
        .find(|l| l.starts_with("FAIL") && l.contains(subject))
        .unwrap_or_else(|| panic!("no FAIL line about {subject:?}:\n{out}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_names_each_problem_and_its_fix() {
    let scene = Scene::new("check", Limits::Relaxed).await;
    let (url, dir) = (scene.url.clone(), scene.dir.clone());
    public_room(&scene.ann, "ck-lobby").await;
    let mock = MockApi::start(MockConfig::default()).await.unwrap();
    let (session, _) = live_section(&dir, &mock, 10, "");
    let good = write_config(
        &dir,
        &url,
        &scene.vera_token,
        &["#ck-lobby:localhost"],
        &["@ann:localhost"],
        &session,
    );
    let text = std::fs::read_to_string(&good).unwrap();
    let token_file = dir.join("vera.token");
    let ann_token = token_for(&url, "ann", "ann-pw", "ANN-CHECK").await;

    // A good config passes: every line ok (her room is not joined yet: a warning).
    let (code, out) = check(&good);
    assert_eq!(code, Some(0), "{out}");
    assert!(!out.contains("FAIL"), "{out}");
    for want in [
        "ok    config:",
        "ok    state:",
        "ok    vera: token: valid for @vera:localhost",
        "ok    vera: homeserver:",
        "ok    vera: claude:",
        "ok    vera: model credential: API key",
        "ok    vera: prices: claude-sonnet-4-6: $3/MTok input (published)",
        "warn  vera: room #ck-lobby:localhost: not joined yet",
        "ok    vera: budget: at most $10 in any 24 hours, 25% of it kept for her operators",
    ] {
        assert!(out.contains(want), "{want:?} missing:\n{out}");
    }
    // A daily cap of her own is named.
    let capped = dir.join("capped.toml");
    std::fs::write(
        &capped,
        format!("{text}\n[persona.budget]\nusd_per_day = 5.0\n"),
    )
    .unwrap();
    let (code, out) = check(&capped);
    assert_eq!(code, Some(0), "{out}");
    assert!(
        out.contains("ok    vera: budget: at most $5 in any 24 hours"),
        "{out}"
    );
    // A model without published prices is a warning (costed as Sonnet) unless priced.
    let mystery = dir.join("mystery.toml");
    std::fs::write(
        &mystery,
        text.replace("claude-sonnet-4-6", "mystery-model-1"),
    )
    .unwrap();
    let (code, out) = check(&mystery);
    assert_eq!(code, Some(0), "{out}");
    assert!(
        out.contains("warn  vera: prices: no published prices known for mystery-model-1")
            && out.contains("set session.prices"),
        "{out}"
    );
    std::fs::write(
        &mystery,
        text.replace(
            "claude-sonnet-4-6\"",
            "mystery-model-1\"\nprices = { input = 2.0, cache_read_ratio = 0.05 }",
        ),
    )
    .unwrap();
    let (_, out) = check(&mystery);
    assert!(
        out.contains(
            "ok    vera: prices: mystery-model-1: $2/MTok input, cache reads 0.05x (configured)"
        ),
        "{out}"
    );

    // Each broken variant: the config, the subject of its FAIL line, and words of its line.
    let variant = |name: &str, text: &str| -> PathBuf {
        let p = dir.join(format!("{name}.toml"));
        std::fs::write(&p, text).unwrap();
        p
    };
    let missing_token = variant(
        "missing-token",
        &text.replace(&token_file.display().to_string(), "/nonexistent/vera.token"),
    );
    let loose = dir.join("loose.token");
    std::fs::write(&loose, &scene.vera_token).unwrap();
    let loose_token = variant(
        "loose-token",
        &text.replace(
            &token_file.display().to_string(),
            &loose.display().to_string(),
        ),
    );
    let down = variant("down", &text.replace(&url, "http://127.0.0.1:9"));
    let invalid_file = dir.join("invalid.token");
    write_private(&invalid_file, "syt_dmVyYQ_not_a_real_token_0000");
    let invalid = variant(
        "invalid-token",
        &text.replace(
            &token_file.display().to_string(),
            &invalid_file.display().to_string(),
        ),
    );
    let ann_file = dir.join("ann.token");
    write_private(&ann_file, &ann_token);
    let other_user = variant(
        "other-user",
        &text.replace(
            &token_file.display().to_string(),
            &ann_file.display().to_string(),
        ),
    );
    let no_room = variant(
        "no-room",
        &text.replace("#ck-lobby:localhost", "#nowhere:localhost"),
    );
    let claude = tests::claude_cli::executable().display().to_string();
    let no_claude = variant("no-claude", &text.replace(&claude, "/nonexistent/claude"));
    let cases: Vec<(&str, &Path, &str, &[&str])> = vec![
        (
            "missing token file",
            &missing_token,
            "vera: token",
            &["/nonexistent/vera.token", "fix: write her access token"],
        ),
        (
            "wrong permissions",
            &loose_token,
            "vera: token",
            &["fix: chmod 600"],
        ),
        (
            "unreachable homeserver",
            &down,
            "vera: homeserver",
            &["does not answer", "fix: start the homeserver"],
        ),
        (
            "invalid token",
            &invalid,
            "vera: token",
            &[
                "refuses it (M_UNKNOWN_TOKEN)",
                "fix: log in as @vera:localhost",
            ],
        ),
        (
            "token of another user",
            &other_user,
            "vera: token",
            &[
                "belongs to @ann:localhost",
                "fix: put a token of @vera:localhost",
            ],
        ),
        (
            "unknown room alias",
            &no_room,
            "vera: room #nowhere:localhost",
            &["does not resolve", "fix: create the room"],
        ),
        (
            "missing claude binary",
            &no_claude,
            "vera: claude",
            &["/nonexistent/claude does not run", "fix: install it"],
        ),
    ];
    for (name, config, subject, words) in cases {
        let (code, out) = check(config);
        assert_eq!(code, Some(1), "{name}: exit code:\n{out}");
        let line = fail_line(&out, subject);
        for w in words {
            assert!(line.contains(w), "{name}: {w:?} not in {line:?}");
        }
        // Only that problem fails.
        assert_eq!(
            out.lines().filter(|l| l.starts_with("FAIL")).count(),
            1,
            "{name}:\n{out}"
        );
    }

    // A running gateway holds the state directory.
    let gw = GatewayProcess::start(&good);
    let (code, out) = check(&good);
    assert_eq!(code, Some(1), "{out}");
    let line = fail_line(&out, "state");
    assert!(
        line.contains("is locked: a gateway is running with it")
            && line.contains("fix: stop that gateway"),
        "{line}"
    );
    assert!(gw.stop().success());
    // Stopped, it passes again, and now her store and room are there.
    let (code, out) = check(&good);
    assert_eq!(code, Some(0), "{out}");
    assert!(
        out.contains("ok    vera: matrix store: present, device GW-VERA"),
        "{out}"
    );
    assert!(
        out.contains("ok    vera: room #ck-lobby:localhost: joined"),
        "{out}"
    );
}

/// Every mode under `dir` (itself included) that others or its group could read or enter.
#[cfg(unix)]
fn open_to_others(dir: &Path) -> Vec<(PathBuf, u32)> {
    use std::os::unix::fs::PermissionsExt;
    let mut out = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(p) = todo.pop() {
        let Ok(meta) = std::fs::symlink_metadata(&p) else {
            continue;
        };
        let mode = meta.permissions().mode() & 0o777;
        if !meta.file_type().is_symlink() && mode & 0o077 != 0 {
            out.push((p.clone(), mode));
        }
        if meta.is_dir() {
            for e in std::fs::read_dir(&p).into_iter().flatten().flatten() {
                todo.push(e.path());
            }
        }
    }
    out
}

#[cfg(unix)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_state_directory_is_private_whatever_the_umask() {
    use std::os::unix::fs::PermissionsExt;
    let scene = Scene::new("private", Limits::Relaxed).await;
    public_room(&scene.ann, "pv-lobby").await;
    let config = write_config(
        &scene.dir,
        &scene.url,
        &scene.vera_token,
        &["#pv-lobby:localhost"],
        &[],
        "",
    );
    // Made before, open to others (as a umask of 022 leaves it).
    let state = scene.dir.join("state");
    std::fs::create_dir_all(&state).unwrap();
    std::fs::set_permissions(&state, std::fs::Permissions::from_mode(0o755)).unwrap();
    // `check` refuses it, naming the fix.
    let (code, out) = check(&config);
    assert_eq!(code, Some(1), "{out}");
    let line = fail_line(&out, "state");
    assert!(
        line.contains("is open to others (mode 755)") && line.contains("chmod 700"),
        "{line}"
    );
    let gw = GatewayProcess::start(&config);
    assert!(gw.stop().success());
    // The gateway closed it; `check` has nothing against it now.
    let (_, out) = check(&config);
    assert!(out.contains("ok    state:"), "{out}");
    let mode = std::fs::metadata(&state).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o700, "the state directory is {mode:o}");
    // Her inbox, her Matrix store, the gateway's key: all its user's alone.
    assert!(state.join("inbox").exists() && state.join("cultnet/server.key").exists());
    let open = open_to_others(&state);
    assert!(open.is_empty(), "open to others: {open:?}");
}
