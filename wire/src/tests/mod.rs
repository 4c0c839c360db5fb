//! In-crate tests that drive whole sessions over a simulated link.
mod props;
mod scenarios;
mod sim;
