//! `cultnet-gateway wire decode` run as a user would, on the reference vectors and on junk.

use std::io::Write;
use std::process::{Command, Output, Stdio};

fn fixture(name: &str) -> String {
    format!("{}/../fixtures/cultnet/{name}", env!("CARGO_MANIFEST_DIR"))
}

fn decode_file(path: &str) -> Output {
    Command::new(env!("CARGO_BIN_EXE_cultnet-gateway"))
        .args(["wire", "decode", path])
        .output()
        .unwrap()
}

fn decode_stdin(bytes: &[u8]) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_cultnet-gateway"))
        .args(["wire", "decode", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(bytes).unwrap();
    child.wait_with_output().unwrap()
}

fn json(out: &Output) -> serde_json::Value {
    assert!(
        out.status.success(),
        "stderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn packet_fields_by_name_and_payload_decoded() {
    let v = json(&decode_file(&fixture("rudp-data-hello.bin")));
    assert_eq!(v["kind"], "packet");
    assert_eq!(v["type"], "data");
    assert_eq!(v["connectionId"], 0xE91F_0003u32);
    assert_eq!(v["sequence"], 3);
    assert_eq!(v["ack"], 100);
    assert_eq!(v["flags"]["reliable"], true);
    assert_eq!(v["channel"], "schema");
    assert_eq!(v["payloadDecoded"]["schemaVersion"], "cultnet.hello.v0");
    assert_eq!(v["payloadDecoded"]["value"]["runtimeId"], "probe-client");
    let connect = json(&decode_file(&fixture("rudp-connect.bin")));
    assert_eq!(connect["type"], "connect");
    assert_eq!(connect["payloadHex"], "6a6f696e");
    assert_eq!(connect["payloadText"], "join");
}

#[test]
fn messages_and_stream_frames_say_what_they_are() {
    let v = json(&decode_file(&fixture("document_put_raw.msgpack")));
    assert_eq!(v["kind"], "message");
    assert_eq!(v["schemaVersion"], "cultnet.document_put_raw.v0");
    assert_eq!(v["documentPayload"]["text"], "hi");
    let s = json(&decode_stdin(
        &std::fs::read(fixture("hello.stream-frame")).unwrap(),
    ));
    assert_eq!(s["kind"], "stream");
    assert_eq!(s["frames"][0]["value"]["runtimeKind"], "probe");
    let note = json(&decode_file(&fixture("note-payload.msgpack")));
    assert_eq!(note["kind"], "msgpack");
    assert_eq!(note["value"]["text"], "hi");
}

#[test]
fn bad_bytes_exit_2_with_a_clear_error() {
    for (bytes, needle) in [
        (&b"CNR0\x00\x03"[..], "not a valid CNR0 packet"),
        (&b"garbage"[..], "neither a CNR0 packet"),
        (&b""[..], "input is empty"),
    ] {
        let out = decode_stdin(bytes);
        assert_eq!(out.status.code(), Some(2), "{bytes:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(needle), "{bytes:?}: {err}");
        assert!(out.stdout.is_empty());
    }
    // A corrupted vector: header length byte wrong.
    let mut b = std::fs::read(fixture("rudp-ack.bin")).unwrap();
    b[7] = 99;
    let out = decode_stdin(&b);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("header length"));
    // Unknown schemaVersion is a typed error too.
    let mut m = Vec::new();
    rmpv::encode::write_value(
        &mut m,
        &rmpv::Value::Map(vec![("schemaVersion".into(), "cultnet.nope.v1".into())]),
    )
    .unwrap();
    let out = decode_stdin(&m);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown schemaVersion"));
    let out = decode_file("/nonexistent/file");
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("/nonexistent/file"));
}
