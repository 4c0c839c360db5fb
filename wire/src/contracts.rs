//! The JSON Schemas of this service's documents (`wire/contracts/*.schema.json`), compiled in
//! and served through `cultnet.schema_catalog_request.v0` with `sha256:` content hashes.

use sha2::{Digest, Sha256};

use crate::docs::ids;
use crate::msg::{CatalogEntry, SchemaCatalogRequest, SchemaCatalogResponse};

macro_rules! contract {
    ($id:expr) => {
        (
            $id,
            include_str!(concat!("../contracts/", $id, ".schema.json")),
        )
    };
}

/// Every contract: (schema id, JSON text). The ids are checked against `docs::ids` by tests.
pub const CONTRACTS: [(&str, &str); 21] = [
    contract!("bifrost.persona_matrix_pending_request.v0"),
    contract!("bifrost.persona_matrix_pending_page.v0"),
    contract!("bifrost.persona_matrix_ack_request.v0"),
    contract!("bifrost.persona_matrix_ack_receipt.v0"),
    contract!("bifrost.persona_matrix_send_request.v0"),
    contract!("bifrost.persona_matrix_send_receipt.v0"),
    contract!("bifrost.persona_session_turn_request.v0"),
    contract!("bifrost.persona_session_turn_receipt.v0"),
    contract!("bifrost.matrix_gateway_status_request.v0"),
    contract!("bifrost.matrix_gateway_status.v0"),
    contract!("bifrost.matrix_gateway_connect.v0"),
    contract!("bifrost.persona_matrix_delivery.v0"),
    contract!("bifrost.persona_session_note_request.v0"),
    contract!("bifrost.persona_session_note_receipt.v0"),
    contract!("bifrost.persona_session_control_request.v0"),
    contract!("bifrost.persona_session_control_receipt.v0"),
    contract!("bifrost.persona_reply_extension_pending_request.v0"),
    contract!("bifrost.persona_reply_extension_page.v0"),
    contract!("bifrost.persona_reply_extension_ack_request.v0"),
    contract!("bifrost.persona_reply_extension_ack_receipt.v0"),
    contract!("bifrost.persona_reply_extension.v0"),
];

/// `sha256:<hex>` of a schema's JSON text.
pub fn content_hash(json: &str) -> String {
    let digest = Sha256::digest(json.as_bytes());
    let mut s = String::with_capacity(7 + 64);
    s.push_str("sha256:");
    for b in digest {
        s.push_str(&format!("{b:02x}"));
    }
    s
}

/// The full catalog, schema JSON included.
pub fn catalog() -> Vec<CatalogEntry> {
    CONTRACTS
        .iter()
        .map(|(id, json)| {
            let shared = *id == ids::DELIVERY || *id == ids::EXTENSION;
            let title = serde_json::from_str::<serde_json::Value>(json)
                .ok()
                .and_then(|v| v.get("title").and_then(|t| t.as_str()).map(str::to_owned));
            CatalogEntry {
                schema_id: (*id).to_owned(),
                kind: if shared {
                    "shared_contract"
                } else {
                    "document_payload"
                }
                .to_owned(),
                schema_version: None,
                document_type: if shared { None } else { Some((*id).to_owned()) },
                title,
                // The wire contract the documents travel under: the published enum allows
                // `cultnet.schema.v0` and `gamecult.networking.v0`, and the Rust runtime's codec
                // refuses a descriptor naming none (even the Connect payload's, which travels in
                // the RUDP Connect packet).
                wire_contracts: vec![WIRE_CONTRACT.to_owned()],
                content_hash: content_hash(json),
                schema_json: Some((*json).to_owned()),
            }
        })
        .collect()
}

/// The wire contract this service's documents travel under.
pub const WIRE_CONTRACT: &str = "cultnet.schema.v0";

/// Answers a catalog request: filtered by `schemaIds` and `kinds`, JSON only when asked for.
pub fn answer(req: &SchemaCatalogRequest) -> SchemaCatalogResponse {
    let schemas = catalog()
        .into_iter()
        .filter(|e| {
            req.schema_ids
                .as_ref()
                .is_none_or(|ids| ids.contains(&e.schema_id))
        })
        .filter(|e| req.kinds.as_ref().is_none_or(|k| k.contains(&e.kind)))
        .map(|mut e| {
            if req.include_schema_json != Some(true) {
                e.schema_json = None;
            }
            e
        })
        .collect();
    SchemaCatalogResponse {
        message_id: req.message_id.clone(),
        schemas,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::docs::*;
    use serde_json::Value;

    fn schema(id: &str) -> Value {
        let json = CONTRACTS.iter().find(|(i, _)| *i == id).unwrap().1;
        serde_json::from_str(json).unwrap()
    }

    /// Every field the struct writes is declared, and every required field is written.
    fn agrees(id: &str, schema: &Value, sample: &Value) {
        let props = schema["properties"]
            .as_object()
            .unwrap_or_else(|| panic!("{id}: no properties"));
        let obj = sample.as_object().unwrap();
        for k in obj.keys() {
            assert!(
                props.contains_key(k),
                "{id}: {k} written but not in the schema"
            );
        }
        for r in schema["required"].as_array().into_iter().flatten() {
            assert!(
                obj.contains_key(r.as_str().unwrap()),
                "{id}: required {r} not written"
            );
        }
        for k in props.keys() {
            assert!(
                obj.contains_key(k),
                "{id}: {k} in the schema but the full sample lacks it"
            );
        }
    }

    fn full_delivery() -> Delivery {
        Delivery {
            seq: 1,
            persona: "p".into(),
            room_id: "!r".into(),
            room_alias: Some("#a".into()),
            is_direct: false,
            event_id: "$e".into(),
            sender: "@u".into(),
            sender_name: Some("U".into()),
            ts: 1,
            kind: DeliveryKind::Edit,
            text: "t".into(),
            to_you: true,
            mentions: vec!["@p".into()],
            thread_root: Some("$t".into()),
            reply_to: Some("$r".into()),
            edit_of: Some("$o".into()),
            truncated: true,
            context: vec![ContextLine {
                event_id: "$c".into(),
                sender: "@u".into(),
                sender_name: Some("U".into()),
                ts: 0,
                text: "c".into(),
            }],
        }
    }

    #[test]
    fn structs_and_schemas_agree() {
        let j = |v: serde_json::Result<Value>| v.unwrap();
        let d = full_delivery();
        agrees(
            ids::DELIVERY,
            &schema(ids::DELIVERY),
            &j(serde_json::to_value(&d)),
        );
        agrees(
            "contextLine",
            &schema(ids::DELIVERY)["$defs"]["contextLine"],
            &j(serde_json::to_value(&d.context[0])),
        );
        let page = PendingPage {
            persona: "p".into(),
            deliveries: vec![d],
            through_seq: 1,
            more: true,
            pending_count: 3,
        };
        agrees(
            ids::PENDING_PAGE,
            &schema(ids::PENDING_PAGE),
            &j(serde_json::to_value(&page)),
        );
        let cases: Vec<(&str, Value)> = vec![
            (
                ids::PENDING_REQUEST,
                j(serde_json::to_value(PendingRequest {
                    persona: "p".into(),
                    after_seq: 0,
                    limit: Some(1),
                    reply_bytes: Some(2),
                })),
            ),
            (
                ids::ACK_REQUEST,
                j(serde_json::to_value(AckRequest {
                    persona: "p".into(),
                    through_seq: 1,
                })),
            ),
            (
                ids::ACK_RECEIPT,
                j(serde_json::to_value(AckReceipt {
                    persona: "p".into(),
                    status: Status::Ok,
                    through_seq: 1,
                    pending_count: 0,
                    error: Some("e".into()),
                })),
            ),
            (
                ids::SEND_REQUEST,
                j(serde_json::to_value(SendRequest {
                    request_id: "r".into(),
                    persona: "p".into(),
                    room: "#a".into(),
                    text: "t".into(),
                    thread_root: Some("$t".into()),
                    reply_to: Some("$r".into()),
                })),
            ),
            (
                ids::SEND_RECEIPT,
                j(serde_json::to_value(SendReceipt {
                    request_id: "r".into(),
                    status: Status::Rejected,
                    event_id: Some("$e".into()),
                    room_id: Some("!r".into()),
                    error: Some("M_FORBIDDEN".into()),
                })),
            ),
            (
                ids::TURN_REQUEST,
                j(serde_json::to_value(TurnRequest {
                    persona: "p".into(),
                    reason: Some("x".into()),
                })),
            ),
            (
                ids::TURN_RECEIPT,
                j(serde_json::to_value(TurnReceipt {
                    persona: "p".into(),
                    status: Status::Failed,
                    through_seq: Some(1),
                    error: Some("e".into()),
                })),
            ),
            (
                ids::STATUS_REQUEST,
                j(serde_json::to_value(StatusRequest {
                    persona: Some("p".into()),
                })),
            ),
            (
                ids::NOTE_REQUEST,
                j(serde_json::to_value(NoteRequest {
                    persona: "p".into(),
                    note_id: "n".into(),
                    kind: "state".into(),
                    text: "t".into(),
                    wake: true,
                })),
            ),
            (
                ids::NOTE_RECEIPT,
                j(serde_json::to_value(NoteReceipt {
                    persona: "p".into(),
                    note_id: "n".into(),
                    status: Status::Ok,
                    duplicate: true,
                    pending_notes: 1,
                    error: Some("e".into()),
                })),
            ),
            (
                ids::CONTROL_REQUEST,
                j(serde_json::to_value(ControlRequest {
                    persona: "p".into(),
                    action: ControlAction::Retry,
                    model: Some("m".into()),
                    batch: Some(4),
                })),
            ),
            (
                ids::CONTROL_RECEIPT,
                j(serde_json::to_value(ControlReceipt {
                    persona: "p".into(),
                    action: ControlAction::Reset,
                    status: Status::Ok,
                    session_id: Some("s".into()),
                    previous_session_id: Some("o".into()),
                    generation: 1,
                    model: "m".into(),
                    turns_total: 2,
                    prefix_tokens: Some(3),
                    set_aside: vec![crate::docs::SetAsideBatch {
                        batch: 4,
                        messages: 2,
                        why: "HTTP 400".into(),
                        at_ms: 5,
                    }],
                    error: Some("e".into()),
                })),
            ),
            (
                ids::EXTENSION_PENDING_REQUEST,
                j(serde_json::to_value(ExtensionPendingRequest {
                    persona: "p".into(),
                    after_seq: 0,
                    limit: Some(1),
                })),
            ),
            (
                ids::EXTENSION_ACK_REQUEST,
                j(serde_json::to_value(ExtensionAckRequest {
                    persona: "p".into(),
                    through_seq: 1,
                })),
            ),
            (
                ids::EXTENSION_ACK_RECEIPT,
                j(serde_json::to_value(ExtensionAckReceipt {
                    persona: "p".into(),
                    status: Status::Ok,
                    through_seq: 1,
                    pending_count: 0,
                    error: Some("e".into()),
                })),
            ),
            (
                ids::CONNECT,
                j(serde_json::to_value(ConnectPayload {
                    agent_id: "a".into(),
                    issued_at: 1,
                    nonce: "n".into(),
                    signature: vec![0; 64],
                })),
            ),
        ];
        for (id, v) in cases {
            agrees(id, &schema(id), &v);
        }
        let status = GatewayStatus {
            runtime_id: "g".into(),
            version: "0".into(),
            started_at: "t".into(),
            peers: 1,
            personas: vec![PersonaStatus {
                persona: "p".into(),
                user_id: "@p".into(),
                sync_state: "syncing".into(),
                pending_count: 0,
                highest_seq: 0,
                acked_through: 0,
                last_error: Some("e".into()),
            }],
        };
        let ext = ReplyExtension {
            seq: 1,
            persona: "p".into(),
            turn_id: "t".into(),
            field: "start_self_run".into(),
            value: serde_json::json!({"brief": "b"}),
        };
        agrees(
            ids::EXTENSION,
            &schema(ids::EXTENSION),
            &j(serde_json::to_value(&ext)),
        );
        let page = ExtensionPage {
            persona: "p".into(),
            extensions: vec![ext],
            through_seq: 1,
            more: false,
            pending_count: 1,
        };
        let pv = j(serde_json::to_value(&page));
        agrees(ids::EXTENSION_PAGE, &schema(ids::EXTENSION_PAGE), &pv);
        agrees(
            "extension item",
            &schema(ids::EXTENSION_PAGE)["properties"]["extensions"]["items"],
            &pv["extensions"][0],
        );
        let sv = j(serde_json::to_value(&status));
        agrees(ids::STATUS, &schema(ids::STATUS), &sv);
        agrees(
            "personaStatus",
            &schema(ids::STATUS)["properties"]["personas"]["items"],
            &sv["personas"][0],
        );
    }

    #[test]
    fn every_document_id_has_a_contract() {
        let mut all: Vec<&str> = ids::PAIRS.iter().flat_map(|(a, b)| [*a, *b]).collect();
        all.extend([ids::CONNECT, ids::DELIVERY, ids::EXTENSION]);
        for id in all {
            assert!(
                CONTRACTS.iter().any(|(i, _)| *i == id),
                "{id} has no contract file"
            );
        }
        assert_eq!(CONTRACTS.len(), ids::PAIRS.len() * 2 + 3);
    }

    #[test]
    fn catalog_filters_and_hashes() {
        let all = answer(&SchemaCatalogRequest {
            message_id: "c".into(),
            ..Default::default()
        });
        assert_eq!(all.schemas.len(), CONTRACTS.len());
        assert!(all
            .schemas
            .iter()
            .all(|e| e.schema_json.is_none() && e.content_hash.len() == 71));
        let one = answer(&SchemaCatalogRequest {
            message_id: "c".into(),
            include_schema_json: Some(true),
            schema_ids: Some(vec![ids::SEND_REQUEST.into()]),
            kinds: None,
        });
        assert_eq!(one.schemas.len(), 1);
        let json = one.schemas[0].schema_json.as_deref().unwrap();
        assert_eq!(one.schemas[0].content_hash, content_hash(json));
        let shared = answer(&SchemaCatalogRequest {
            message_id: "c".into(),
            kinds: Some(vec!["shared_contract".into()]),
            ..Default::default()
        });
        let shared: Vec<&str> = shared
            .schemas
            .iter()
            .map(|e| e.schema_id.as_str())
            .collect();
        assert_eq!(shared, [ids::DELIVERY, ids::EXTENSION]);
    }
}
