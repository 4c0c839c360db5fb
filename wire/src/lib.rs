//! Sans-IO CultNet: the wire protocol of the gateway's local clients.
//!
//! ```text
//!  UDP datagrams ──▶ Packet::decode ──▶ Hub::handle(now, from, bytes) ──▶ Session (per peer)
//!                                              │                            │ frames
//!  UDP datagrams ◀── Hub::poll_transmit ◀──────┘      HubEvent ◀────────────┘
//!                                                        │ frame on `schema`
//!                                                        ▼
//!                                         msg::Message::decode (cultnet.schema.v0)
//!                                                        │ document_put_raw
//!                                                        ▼
//!                                         docs::Request / receipts (this service's documents)
//! ```
//!
//! Nothing here opens a socket or reads a clock: the caller passes `now` and moves bytes.
//! - [`packet`]: the CNR0 datagram codec ([`packet::Packet`]).
//! - [`session`]: one peer's reliable-UDP session ([`session::Session`]).
//! - [`hub`]: many peers on one socket ([`hub::Hub`]).
//! - [`msg`]: `cultnet.schema.v0` MessagePack messages and the 4-byte stream framing.
//! - [`docs`]: the gateway's request and receipt documents, and the signed Connect payload.
//! - [`contracts`]: the JSON Schemas of those documents, served through the schema catalog.
//!
//! ```
//! use std::time::Instant;
//! use wire::packet::Packet;
//! let bytes = include_bytes!("../../fixtures/cultnet/rudp-connect.bin");
//! let p = Packet::decode(bytes).unwrap();
//! assert_eq!(p.payload, b"join");
//! # let _ = Instant::now();
//! ```
#![forbid(unsafe_code)]
#![warn(missing_docs, unreachable_pub)]

pub mod contracts;
pub mod docs;
pub mod error;
pub mod hub;
pub mod msg;
pub mod packet;
pub mod session;

pub use error::{CloseReason, DecodeError, MsgError, SendError};

#[cfg(test)]
mod tests;
