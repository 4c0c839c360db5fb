//! Every message the gateway emits, read as the public CultNet runtimes read it: decoded from
//! MessagePack and checked against their published JSON Schemas (`cultnet.schema.v0`), with
//! their enums. The schemas are the runtimes' own files, copied with their commits into
//! `fixtures/cultnet-contracts/` (see its README); a message outside them is refused whole by
//! their codecs, so a peer would never learn what the gateway offers.

use std::path::{Path, PathBuf};

use serde_json::{Map, Value};
use wire::docs::{gateway_hello, ids, AckReceipt, Status};
use wire::msg::{ErrorMsg, Message, Put, RawDocument, SchemaCatalogRequest};

/// The runtimes whose contracts are checked: cultnet-rs at the commit with the older session
/// rules, and cultnet-ts.
const RUNTIMES: &[&str] = &["cultnet-rs-402f6e7", "cultnet-ts-902f966"];

fn contracts(runtime: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../fixtures/cultnet-contracts")
        .join(runtime)
}

/// The schema `file` of `runtime`, its relative `$ref`s replaced by the schemas they name.
fn schema(runtime: &str, file: &str) -> Value {
    let text = std::fs::read_to_string(contracts(runtime).join(file))
        .unwrap_or_else(|e| panic!("{runtime}/{file}: {e}"));
    let mut value: Value = serde_json::from_str(&text).expect("a JSON schema");
    inline(runtime, &mut value);
    value
}

fn inline(runtime: &str, value: &mut Value) {
    match value {
        Value::Object(map) => {
            if let Some(Value::String(target)) = map.get("$ref").cloned() {
                let file = target.trim_start_matches("./");
                let mut inner = schema(runtime, file);
                if let Value::Object(m) = &mut inner {
                    m.remove("$id");
                    m.remove("$schema");
                }
                *value = inner;
                return;
            }
            for v in map.values_mut() {
                inline(runtime, v);
            }
        }
        Value::Array(items) => items.iter_mut().for_each(|v| inline(runtime, v)),
        _ => {}
    }
}

/// A MessagePack value as the TypeScript runtime sees it after decoding: maps with string
/// keys, nil as null, bytes as a (base16) string where the schema wants bytes as a string.
fn json(v: &rmpv::Value) -> Value {
    use rmpv::Value as M;
    match v {
        M::Nil => Value::Null,
        M::Boolean(b) => Value::Bool(*b),
        M::Integer(i) => i
            .as_i64()
            .map(Value::from)
            .or_else(|| i.as_u64().map(Value::from))
            .unwrap_or(Value::Null),
        M::F32(f) => Value::from(f64::from(*f)),
        M::F64(f) => Value::from(*f),
        M::String(s) => Value::String(s.as_str().unwrap_or_default().to_owned()),
        M::Binary(b) => Value::String(b.iter().map(|x| format!("{x:02x}")).collect()),
        M::Array(items) => Value::Array(items.iter().map(json).collect()),
        M::Map(pairs) => {
            let mut m = Map::new();
            for (k, v) in pairs {
                m.insert(k.as_str().unwrap_or_default().to_owned(), json(v));
            }
            Value::Object(m)
        }
        M::Ext(..) => Value::Null,
    }
}

fn decoded(bytes: &[u8]) -> Value {
    let v = rmpv::decode::read_value(&mut &bytes[..]).expect("MessagePack");
    json(&v)
}

/// The schema errors of `message` against `file` of `runtime`.
fn errors(runtime: &str, file: &str, message: &Value) -> Vec<String> {
    let validator = jsonschema::validator_for(&schema(runtime, file)).expect("a valid schema");
    validator
        .iter_errors(message)
        .map(|e| format!("{} at {}", e, e.instance_path()))
        .collect()
}

fn assert_conforms(file: &str, bytes: &[u8]) {
    let message = decoded(bytes);
    for runtime in RUNTIMES {
        let errors = errors(runtime, file, &message);
        assert!(
            errors.is_empty(),
            "{runtime} refuses the gateway's {file}: {errors:#?}\n{message:#}"
        );
    }
}

#[test]
fn the_gateways_hello_conforms() {
    let hello = Message::Hello(gateway_hello("cultnet-gateway-test")).encode();
    assert_conforms("cultnet.hello.schema.json", &hello);
}

#[test]
fn the_gateways_schema_catalog_conforms_with_and_without_the_json() {
    for include in [None, Some(true)] {
        let req = SchemaCatalogRequest {
            message_id: "m-1".into(),
            include_schema_json: include,
            ..SchemaCatalogRequest::default()
        };
        let answer = Message::SchemaCatalogResponse(wire::contracts::answer(&req)).encode();
        assert_conforms("cultnet.schema-catalog-response.schema.json", &answer);
        // Beyond the schema, cultnet-rs's codec (run against the gateway) refuses a catalog
        // whose descriptor names no wire contract: "wireContracts must contain at least one
        // supported contract".
        for d in decoded(&answer)["schemas"].as_array().into_iter().flatten() {
            assert!(
                d["wireContracts"].as_array().is_some_and(|c| !c.is_empty()),
                "{} names no wire contract",
                d["schemaId"]
            );
        }
    }
}

#[test]
fn the_gateways_receipts_and_errors_conform() {
    let receipt = AckReceipt {
        persona: "vera".into(),
        status: Status::Ok,
        through_seq: 3,
        pending_count: 0,
        error: None,
    };
    let mut doc = RawDocument::from_payload(
        ids::ACK_RECEIPT,
        "ack-1",
        "2026-12-07T10:00:00.000Z",
        &receipt,
    );
    doc.source_runtime_id = Some("cultnet-gateway-test".into());
    doc.source_role = Some("matrix_gateway".into());
    let put = Message::DocumentPutRaw(Put {
        message_id: "m-2".into(),
        document: doc,
    })
    .encode();
    assert_conforms("cultnet.document-put-raw.schema.json", &put);
    let error = Message::Error(ErrorMsg {
        error: "request \"k\": not supported".into(),
    })
    .encode();
    assert_conforms("cultnet.error.schema.json", &error);
}

#[test]
fn the_check_refuses_what_the_runtimes_refuse() {
    // The schemas as loaded here do refuse a value outside their enums: an authority of the
    // gateway's own naming, a wire contract that is a message version.
    let mut hello = decoded(&Message::Hello(gateway_hello("gw")).encode());
    hello["supportedMutationContracts"][0]["authority"] = "bifrost.matrix_gateway".into();
    for runtime in RUNTIMES {
        assert!(!errors(runtime, "cultnet.hello.schema.json", &hello).is_empty());
    }
    let req = SchemaCatalogRequest {
        message_id: "m".into(),
        ..SchemaCatalogRequest::default()
    };
    let mut catalog =
        decoded(&Message::SchemaCatalogResponse(wire::contracts::answer(&req)).encode());
    catalog["schemas"][0]["wireContracts"] = serde_json::json!(["cultnet.document_put_raw.v0"]);
    for runtime in RUNTIMES {
        assert!(!errors(
            runtime,
            "cultnet.schema-catalog-response.schema.json",
            &catalog
        )
        .is_empty());
    }
}
