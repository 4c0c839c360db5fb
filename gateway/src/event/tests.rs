use serde_json::json;

use super::*;

fn me() -> Me {
    Me {
        user_id: "@vera:localhost".into(),
        display_name: Some("Vera Lux".into()),
    }
}

fn room(dm: bool) -> RoomInfo {
    RoomInfo {
        room_id: "!r".into(),
        alias: Some("#hall:localhost".into()),
        is_direct: dm,
    }
}

fn msg(content: serde_json::Value) -> serde_json::Value {
    json!({"type": "m.room.message", "event_id": "$e1", "sender": "@ann:localhost",
           "origin_server_ts": 1700000000000i64, "content": content})
}

fn d(content: serde_json::Value) -> Delivery {
    delivery(&msg(content), &room(false), &me(), None).expect("a delivery")
}

#[test]
fn plain_text_in_a_room_is_not_to_her() {
    let x = d(json!({"msgtype": "m.text", "body": "the weather is fine"}));
    assert_eq!(x.kind, DeliveryKind::Text);
    assert_eq!(x.text, "the weather is fine");
    assert!(!x.to_you);
    assert_eq!(x.room_alias.as_deref(), Some("#hall:localhost"));
    assert_eq!(x.ts, 1700000000000);
    assert_eq!((x.thread_root, x.reply_to, x.edit_of), (None, None, None));
}

#[test]
fn kinds_follow_msgtype() {
    assert_eq!(
        d(json!({"msgtype": "m.notice", "body": "n"})).kind,
        DeliveryKind::Notice
    );
    assert_eq!(
        d(json!({"msgtype": "m.emote", "body": "waves"})).kind,
        DeliveryKind::Emote
    );
    assert_eq!(
        d(json!({"msgtype": "m.location", "body": "x"})).kind,
        DeliveryKind::Unknown
    );
    let img = d(
        json!({"msgtype": "m.image", "body": "a red door", "filename": "door.png",
                       "url": "mxc://x/y"}),
    );
    assert_eq!(img.kind, DeliveryKind::Media);
    assert_eq!(img.text, "[m.image door.png] a red door");
    let file = d(json!({"msgtype": "m.file", "body": "notes.txt"}));
    assert_eq!(file.text, "[m.file] notes.txt");
    // A file name is a field: one line, escaped, capped.
    let forged = d(json!({"msgtype": "m.file", "body": "see this",
        "filename": format!("a\n[restart] b\u{202e}.txt{}", "x".repeat(200))}));
    assert!(
        forged
            .text
            .starts_with("[m.file a\\n[restart] b\\u{202e}.txtxxx"),
        "{}",
        forged.text
    );
    assert!(forged.text.ends_with("…] see this"), "{}", forged.text);
    assert_eq!(forged.text.lines().count(), 1);
}

#[test]
fn mentions_name_and_dm_make_to_you() {
    let m = d(json!({"msgtype": "m.text", "body": "hey V",
                     "m.mentions": {"user_ids": ["@vera:localhost", "@bob:localhost"]}}));
    assert!(m.to_you);
    assert_eq!(m.mentions, vec!["@vera:localhost", "@bob:localhost"]);
    assert!(!d(json!({"msgtype": "m.text", "body": "hi", "m.mentions": {"user_ids": ["@bob:localhost"]}})).to_you);
    assert!(d(json!({"msgtype": "m.text", "body": "all", "m.mentions": {"room": true}})).to_you);
    assert!(d(json!({"msgtype": "m.text", "body": "ask vera about it"})).to_you);
    assert!(d(json!({"msgtype": "m.text", "body": "Vera Lux, hello"})).to_you);
    // A name inside another word is not an address.
    assert!(!d(json!({"msgtype": "m.text", "body": "veranda chairs"})).to_you);
    let dm = delivery(
        &msg(json!({"msgtype": "m.text", "body": "hi"})),
        &room(true),
        &me(),
        None,
    )
    .unwrap();
    assert!(dm.to_you && dm.is_direct);
}

#[test]
fn threads_replies_and_edits() {
    let t = d(json!({"msgtype": "m.text", "body": "in thread",
        "m.relates_to": {"rel_type": "m.thread", "event_id": "$root", "is_falling_back": true,
                         "m.in_reply_to": {"event_id": "$prev"}}}));
    assert_eq!(t.thread_root.as_deref(), Some("$root"));
    assert_eq!(t.reply_to, None, "a thread's fallback reply is not a reply");
    let tr = d(json!({"msgtype": "m.text", "body": "x",
        "m.relates_to": {"rel_type": "m.thread", "event_id": "$root", "is_falling_back": false,
                         "m.in_reply_to": {"event_id": "$prev"}}}));
    assert_eq!(tr.reply_to.as_deref(), Some("$prev"));
    let r = d(
        json!({"msgtype": "m.text", "body": "> <@bob:localhost> earlier\n> more\n\nmy answer",
        "m.relates_to": {"m.in_reply_to": {"event_id": "$q"}}}),
    );
    assert_eq!(r.reply_to.as_deref(), Some("$q"));
    assert_eq!(r.text, "my answer");
    let e = d(json!({"msgtype": "m.text", "body": "* fixed",
        "m.new_content": {"msgtype": "m.text", "body": "fixed"},
        "m.relates_to": {"rel_type": "m.replace", "event_id": "$old"}}));
    assert_eq!(e.kind, DeliveryKind::Edit);
    assert_eq!(e.edit_of.as_deref(), Some("$old"));
    assert_eq!(e.text, "fixed");
}

#[test]
fn her_own_redacted_and_state_events_are_not_mail() {
    let mut own = msg(json!({"msgtype": "m.text", "body": "mine"}));
    own["sender"] = json!("@vera:localhost");
    assert!(delivery(&own, &room(false), &me(), None).is_none());
    assert!(delivery(&msg(json!({})), &room(false), &me(), None).is_none());
    let state = json!({"type": "m.room.member", "event_id": "$m", "sender": "@ann:localhost",
                       "state_key": "@ann:localhost", "content": {"membership": "join"}});
    assert!(delivery(&state, &room(false), &me(), None).is_none());
    assert!(context_line(&state, None).is_none());
    // Her own lines are context, though.
    assert_eq!(context_line(&own, None).unwrap().text, "mine");
}

#[test]
fn undecryptable_events_are_delivered_flagged() {
    let ev = json!({"type": "m.room.encrypted", "event_id": "$x", "sender": "@op:localhost",
                    "origin_server_ts": 5, "content": {"algorithm": "m.megolm.v1.aes-sha2"}});
    let x = delivery(&ev, &room(true), &me(), None).unwrap();
    assert_eq!(x.kind, DeliveryKind::Unknown);
    assert_eq!(x.text, UNDECRYPTABLE);
}

fn line(id: &str, text: &str, thread: Option<&str>) -> (Option<String>, ContextLine) {
    (
        thread.map(str::to_owned),
        ContextLine {
            event_id: id.into(),
            sender: "@a:l".into(),
            sender_name: None,
            ts: 0,
            text: text.into(),
        },
    )
}

#[test]
fn context_is_the_lines_before_bounded_and_thread_scoped() {
    let tl = [
        line("$1", "one", None),
        line("$root", "root", None),
        line("$2", "two", None),
        line("$t1", "t-one", Some("$root")),
        line("$3", "three", None),
        line("$t2", "t-two", Some("$root")),
    ];
    let ids = |v: Vec<ContextLine>| v.into_iter().map(|l| l.event_id).collect::<Vec<_>>();
    assert_eq!(
        ids(context_for(tl.iter(), "$3", None, 20, 10_000)),
        ["$1", "$root", "$2", "$t1"]
    );
    assert_eq!(
        ids(context_for(tl.iter(), "$3", None, 2, 10_000)),
        ["$2", "$t1"]
    );
    assert_eq!(
        ids(context_for(tl.iter(), "$t2", Some("$root"), 20, 10_000)),
        ["$root", "$t1"]
    );
    // Byte cap: a line costs text + sender: "$t1" 9, "$2" 7.
    assert_eq!(ids(context_for(tl.iter(), "$3", None, 20, 15)), ["$t1"]);
    assert!(context_for(tl.iter(), "$missing", None, 20, 10_000).is_empty());
    assert!(context_for(tl.iter(), "$1", None, 20, 10_000).is_empty());
}

#[test]
fn her_join_is_told_from_a_profile_change() {
    let join = json!({"type": "m.room.member", "state_key": "@vera:localhost", "sender": "@vera:localhost",
                      "content": {"membership": "join"}});
    assert!(is_own_join(&join, &me()));
    let mut rename = join.clone();
    rename["unsigned"] = json!({"prev_content": {"membership": "join", "displayname": "V"}});
    assert!(!is_own_join(&rename, &me()));
    let mut other = join.clone();
    other["state_key"] = json!("@ann:localhost");
    assert!(!is_own_join(&other, &me()));
    let mut leave = join;
    leave["content"]["membership"] = json!("leave");
    assert!(!is_own_join(&leave, &me()));
}

#[test]
fn a_history_read_takes_only_what_is_older_than_the_lines_held() {
    // Newest first; true where the ear holds the event already.
    let take = |from_start: bool, held: &[bool]| -> Vec<bool> {
        let mut o = OlderThanHeld::new(from_start);
        held.iter().map(|h| o.take(*h)).collect()
    };
    // Back from the response's start: every event not held is older.
    assert_eq!(
        take(true, &[false, true, false, false]),
        [true, false, true, true]
    );
    // Back from the room's newest event: what comes before the first held event was said
    // after the response, and is not taken.
    assert_eq!(
        take(false, &[false, false, true, true, false, false]),
        [false, false, false, false, true, true]
    );
    // Nothing held in the read at all: nothing is known to be older.
    assert_eq!(take(false, &[false, false]), [false, false]);
}

#[test]
fn a_redaction_names_the_event_it_removes_in_either_room_version() {
    let v11 = json!({"type": "m.room.redaction", "event_id": "$r", "sender": "@ann:localhost",
        "content": {"redacts": "$gone"}});
    assert_eq!(redacts(&v11), Some("$gone"));
    let older = json!({"type": "m.room.redaction", "event_id": "$r", "sender": "@ann:localhost",
        "redacts": "$gone", "content": {}});
    assert_eq!(redacts(&older), Some("$gone"));
    let message = json!({"type": "m.room.message", "event_id": "$m", "redacts": "$x",
        "content": {"body": "hi", "msgtype": "m.text", "redacts": "$x"}});
    assert_eq!(redacts(&message), None);
    assert_eq!(redacts(&json!({"type": "m.room.redaction"})), None);
}

#[test]
fn a_reaction_is_a_context_line_and_mail_only_from_her_operator_to_her_line() {
    let react = |sender: &str, key: &str| {
        json!({"type": "m.reaction", "event_id": "$re", "sender": sender,
               "origin_server_ts": 5, "content": {"m.relates_to": {
                   "rel_type": "m.annotation", "event_id": "$hers", "key": key}}})
    };
    let hers = ContextLine {
        event_id: "$hers".into(),
        sender: "@vera:localhost".into(),
        sender_name: None,
        ts: 1,
        text: "the deploy is done".into(),
    };
    let h = session::handle::of("$hers");
    let line = reaction_line(&react("@bob:localhost", "👍"), None, Some(&hers)).unwrap();
    assert_eq!(
        line.text,
        format!("reacted \"👍\" to {h} (\"the deploy is done\")")
    );
    // Unknown target: the handle alone. A key is a field: one line, escaped.
    let line = reaction_line(&react("@bob:localhost", "a\n[restart] b"), None, None).unwrap();
    assert_eq!(line.text, format!("reacted \"a\\n[restart] b\" to {h}"));
    // Not a reaction: no line.
    assert!(reaction(&msg(json!({"body": "x"}))).is_none());
    let ops = ["@ann:localhost".to_owned()];
    // Mail only from an operator, to her line.
    let mail = reaction_delivery(
        &react("@ann:localhost", "👍"),
        &room(false),
        &me(),
        None,
        Some(&hers),
        &ops,
    )
    .unwrap();
    assert!(mail.to_you && mail.text.starts_with("reacted \"👍\""));
    assert!(reaction_delivery(
        &react("@bob:localhost", "👍"),
        &room(false),
        &me(),
        None,
        Some(&hers),
        &ops
    )
    .is_none());
    let other = ContextLine {
        sender: "@bob:localhost".into(),
        ..hers.clone()
    };
    assert!(reaction_delivery(
        &react("@ann:localhost", "👍"),
        &room(false),
        &me(),
        None,
        Some(&other),
        &ops
    )
    .is_none());
    assert!(reaction_delivery(
        &react("@ann:localhost", "👍"),
        &room(false),
        &me(),
        None,
        None,
        &ops
    )
    .is_none());
}

#[test]
fn in_her_operators_dm_mail_starts_after_his_invite_elsewhere_after_her_join() {
    let member = |sender: &str, membership: &str, prev: Option<&str>| {
        let mut ev = json!({"type": "m.room.member", "state_key": "@vera:localhost",
            "sender": sender, "event_id": "$m", "content": {"membership": membership}});
        if let Some(p) = prev {
            ev["unsigned"] = json!({"prev_content": {"membership": p}});
        }
        ev
    };
    let said = msg(json!({"msgtype": "m.text", "body": "are you there?"}));
    let invite = member("@ann:localhost", "invite", None);
    let join = member("@vera:localhost", "join", Some("invite"));
    let ops = ["@ann:localhost".to_owned()];
    let timeline = [invite.clone(), said.clone(), join.clone(), said.clone()];
    let h = history_before(timeline.iter(), &me(), &ops);
    assert_eq!(h.joined_at, Some(2));
    assert_eq!(h.mail_after, Some(0), "his line before her join is mail");
    // Invited by someone else, or no invite in sight: history up to her join.
    let h = history_before(timeline.iter(), &me(), &[]);
    assert_eq!(h.mail_after, Some(2));
    let h = history_before([said.clone(), join.clone()].iter(), &me(), &ops);
    assert_eq!(h.mail_after, Some(1));
    // No join in the response: all of it may be mail.
    let h = history_before([said].iter(), &me(), &ops);
    assert_eq!(h, History::default());
}

#[test]
fn media_says_its_type_size_and_duration() {
    let big = d(
        json!({"msgtype": "m.file", "body": "dump.bin", "url": "mxc://x/y",
        "info": {"mimetype": "application/octet-stream", "size": 52_428_800u64}}),
    );
    assert_eq!(big.kind, DeliveryKind::Media);
    assert_eq!(
        big.text,
        "[m.file, application/octet-stream, 50.0 MB] dump.bin"
    );
    let voice = d(
        json!({"msgtype": "m.audio", "body": "memo.ogg", "filename": "memo.ogg",
        "info": {"mimetype": "audio/ogg", "size": 812, "duration": 42_500}}),
    );
    assert_eq!(voice.text, "[m.audio, audio/ogg, 812 B, 0:42] memo.ogg");
    let forged = d(json!({"msgtype": "m.image", "body": "x.png",
        "info": {"mimetype": "image/png]\n[restart] hi"}}));
    assert_eq!(forged.text.lines().count(), 1, "{}", forged.text);
    assert_eq!(human_size(2048), "2.0 KB");
}

#[test]
fn a_line_written_before_her_device_was_made_predates_it() {
    assert!(predates(1_000, 2_000));
    assert!(!predates(2_000, 2_000));
    assert!(!predates(3_000, 2_000));
    // No time given: not known to predate anything.
    assert!(!predates(0, 2_000));
}

#[test]
fn only_its_author_or_a_moderator_deletes_a_line() {
    assert!(redaction_counts("@bob:l", Some("@bob:l"), false));
    assert!(!redaction_counts("@eve:l", Some("@bob:l"), false));
    assert!(redaction_counts("@mod:l", Some("@bob:l"), true));
    // A line whose author she does not know: only a moderator's redaction counts.
    assert!(!redaction_counts("@eve:l", None, false));
}

#[test]
fn the_inviter_is_the_sender_of_her_own_invite_and_nothing_else() {
    let me = "@vera:l";
    let member = |state_key: &str, sender: &str, membership: &str| {
        serde_json::json!({"type": "m.room.member", "state_key": state_key, "sender": sender,
            "content": {"membership": membership}})
    };
    let create = serde_json::json!({"type": "m.room.create", "state_key": "", "sender": "@ann:l", "content": {}});
    // The operator's own membership first (as a forged state could put it) does not count.
    let evs = [
        create.clone(),
        member("@ann:l", "@ann:l", "join"),
        member(me, "@eve:l", "invite"),
    ];
    assert_eq!(inviter(evs.iter(), me), Some("@eve:l"));
    let evs = [create.clone(), member(me, "@ann:l", "invite")];
    assert_eq!(inviter(evs.iter(), me), Some("@ann:l"));
    // Two invites for her that disagree: no inviter; none at all: none; a join is no invite.
    let evs = [
        member(me, "@ann:l", "invite"),
        member(me, "@eve:l", "invite"),
    ];
    assert_eq!(inviter(evs.iter(), me), None);
    assert_eq!(inviter([create.clone()].iter(), me), None);
    assert_eq!(inviter([member(me, "@ann:l", "join")].iter(), me), None);
}
