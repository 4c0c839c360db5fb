//! Support code for the end-to-end tests (Synapse launcher, mock Messages API, CLI install
//! helpers arrive with issues 3 and 4). The tests themselves live in `tests/tests/`.
#![forbid(unsafe_code)]
#![warn(missing_docs, unreachable_pub)]
