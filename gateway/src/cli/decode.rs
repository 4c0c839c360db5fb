//! `cultnet-gateway wire decode FILE`: tell what a blob of bytes is and print it as JSON.
//!
//! Tried in order: a CNR0 packet (starts with the magic), length-prefixed stream frames (the
//! first four bytes are a length that fits, and the frames cover the input exactly), one
//! MessagePack value (a `cultnet.schema.v0` message when it has a `schemaVersion`).

use std::io::{Read, Write};
use std::path::Path;

use anyhow::{anyhow, Context};
use serde_json::{json, Map, Value as Json};
use wire::msg::{read_one, FrameDecoder, Message, DEFAULT_MAX_FRAME};
use wire::packet::{Flags, Packet, MAGIC};

use super::Failure;

pub(super) fn run(file: &Path) -> Result<(), Failure> {
    let bytes = read_input(file).map_err(Failure::input)?;
    let out = describe(&bytes).map_err(Failure::input)?;
    let mut stdout = std::io::stdout().lock();
    // Pretty JSON of a value built here cannot fail to serialize.
    let text = serde_json::to_string_pretty(&out).unwrap_or_default();
    writeln!(stdout, "{text}").context("writing to stdout")?;
    Ok(())
}

fn read_input(file: &Path) -> anyhow::Result<Vec<u8>> {
    if file == Path::new("-") {
        let mut buf = Vec::new();
        std::io::stdin()
            .read_to_end(&mut buf)
            .context("reading stdin")?;
        Ok(buf)
    } else {
        std::fs::read(file).with_context(|| format!("reading {}", file.display()))
    }
}

/// What the bytes are, as JSON; an error when they are none of the known forms.
pub(crate) fn describe(bytes: &[u8]) -> anyhow::Result<Json> {
    if bytes.is_empty() {
        return Err(anyhow!("input is empty"));
    }
    if bytes.starts_with(&MAGIC) {
        let p = Packet::decode(bytes).map_err(|e| anyhow!("not a valid CNR0 packet: {e}"))?;
        return Ok(packet_json(&p));
    }
    if let Some(frames) = stream_frames(bytes) {
        let frames: Vec<Json> = frames
            .iter()
            .map(|f| message_or_value(f))
            .collect::<anyhow::Result<_>>()?;
        return Ok(json!({ "kind": "stream", "frames": frames }));
    }
    message_or_value(bytes)
}

fn stream_frames(bytes: &[u8]) -> Option<Vec<bytes::Bytes>> {
    if bytes.len() < 4 {
        return None;
    }
    let mut d = FrameDecoder::new(DEFAULT_MAX_FRAME);
    d.push(bytes);
    let mut frames = Vec::new();
    while let Ok(Some(f)) = d.next_frame() {
        frames.push(f);
    }
    (d.finish().is_ok() && !frames.is_empty()).then_some(frames)
}

fn message_or_value(bytes: &[u8]) -> anyhow::Result<Json> {
    let value = read_one(bytes).map_err(|e| {
        anyhow!(
            "neither a CNR0 packet, length-prefixed stream frames, nor one MessagePack value: {e}"
        )
    })?;
    let is_message = matches!(&value, rmpv::Value::Map(m)
        if m.iter().any(|(k, _)| k.as_str() == Some("schemaVersion")));
    if !is_message {
        return Ok(json!({ "kind": "msgpack", "value": to_json(&value) }));
    }
    let msg =
        Message::decode(bytes).map_err(|e| anyhow!("invalid cultnet.schema.v0 message: {e}"))?;
    let mut out = Map::new();
    out.insert("kind".into(), "message".into());
    out.insert("schemaVersion".into(), msg.schema_version().into());
    out.insert("value".into(), to_json(&value));
    if let Message::DocumentPutRaw(put) = &msg {
        if let Ok(inner) = read_one(&put.document.payload) {
            out.insert("documentPayload".into(), to_json(&inner));
        }
    }
    Ok(Json::Object(out))
}

fn packet_json(p: &Packet<'_>) -> Json {
    let f = p.flags;
    let known =
        Flags::RELIABLE | Flags::ORDERED | Flags::SEQUENCED | Flags::FRAGMENTED | Flags::ABANDON;
    let mut out = json!({
        "kind": "packet",
        "type": p.ptype.name(),
        "flags": {
            "raw": f.0,
            "reliable": f.has(Flags::RELIABLE),
            "ordered": f.has(Flags::ORDERED),
            "sequenced": f.has(Flags::SEQUENCED),
            "fragmented": f.has(Flags::FRAGMENTED),
            "abandon": f.has(Flags::ABANDON),
            "unknown": f.0 & !known,
        },
        "connectionId": p.connection_id,
        "connectionIdHex": format!("0x{:08X}", p.connection_id),
        "sequence": p.sequence,
        "ack": p.ack,
        "ackMask": p.ack_mask,
        "fragment": { "id": p.fragment.id, "index": p.fragment.index, "count": p.fragment.count },
        "channel": p.channel,
        "payloadLength": p.payload.len(),
        "payloadHex": hex(p.payload),
    });
    if let Some(text) = std::str::from_utf8(p.payload)
        .ok()
        .filter(|t| !t.is_empty())
    {
        out["payloadText"] = text.into();
    }
    if !p.payload.is_empty() {
        if let Ok(decoded) = message_or_value(p.payload) {
            out["payloadDecoded"] = decoded;
        }
    }
    out
}

/// MessagePack -> JSON: maps keep their order, bin becomes `{"$bin": hex}`, ext
/// `{"$ext": type, "hex": ...}`, non-string keys are printed as their JSON text.
fn to_json(v: &rmpv::Value) -> Json {
    use rmpv::Value as V;
    match v {
        V::Nil => Json::Null,
        V::Boolean(b) => (*b).into(),
        V::Integer(i) => i
            .as_u64()
            .map(Json::from)
            .or_else(|| i.as_i64().map(Json::from))
            .unwrap_or(Json::Null),
        V::F32(x) => Json::from(*x as f64),
        V::F64(x) => Json::from(*x),
        V::String(s) => match s.as_str() {
            Some(s) => s.into(),
            None => json!({ "$invalidUtf8": hex(s.as_bytes()) }),
        },
        V::Binary(b) => json!({ "$bin": hex(b) }),
        V::Array(a) => Json::Array(a.iter().map(to_json).collect()),
        V::Map(m) => {
            let mut o = Map::new();
            for (k, val) in m {
                let key = match k.as_str() {
                    Some(s) => s.to_owned(),
                    None => to_json(k).to_string(),
                };
                o.insert(key, to_json(val));
            }
            Json::Object(o)
        }
        V::Ext(t, data) => json!({ "$ext": t, "hex": hex(data) }),
    }
}

fn hex(b: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(b.len() * 2);
    for x in b {
        s.push(DIGITS[(x >> 4) as usize] as char);
        s.push(DIGITS[(x & 15) as usize] as char);
    }
    s
}
