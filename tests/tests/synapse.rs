//! The Synapse launcher itself: a real homeserver from deploy/synapse, users registered with
//! the shared secret, a restart that keeps the data, and a stop that frees the port.

use tests::synapse::{get, Limits, Synapse};

#[test]
fn synapse_starts_registers_users_restarts_and_stops() {
    let scratch = tests::ScratchDir::new("synapse");
    let dir = scratch.path().join("hs");
    let mut hs = Synapse::start(&dir, Limits::Relaxed);
    let alice = hs.register("alice", "alice-password");
    assert_eq!(alice.user_id, "@alice:localhost");
    assert!(!alice.access_token.is_empty() && !alice.device_id.is_empty());
    let (status, body) = get(
        hs.port,
        "/_matrix/client/v3/account/whoami",
        Some(&alice.access_token),
    )
    .unwrap();
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("@alice:localhost"), "{body}");
    let (status, _) = get(
        hs.port,
        "/_matrix/client/v3/account/whoami",
        Some("wrong-token"),
    )
    .unwrap();
    assert_eq!(status, 401, "a wrong token must be refused");
    // A restart keeps users and tokens.
    hs.restart();
    let (status, _) = get(
        hs.port,
        "/_matrix/client/v3/account/whoami",
        Some(&alice.access_token),
    )
    .unwrap();
    assert_eq!(status, 200);
    let port = hs.port;
    drop(hs);
    assert!(
        get(port, "/_matrix/client/versions", None).is_none(),
        "Synapse still answers after stop"
    );
}
