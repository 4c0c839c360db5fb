//! In-crate tests that drive whole sessions over a simulated link.
mod sim;
mod props;
mod scenarios;
