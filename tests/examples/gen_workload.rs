//! Writes the reference workload: `cargo run -p tests --example gen_workload > fixtures/workload/reference.json`.
fn main() {
    let w = tests::workload::generate(
        tests::workload::REFERENCE_SEED,
        tests::workload::REFERENCE_BATCHES,
    );
    println!("{}", serde_json::to_string_pretty(&w).unwrap_or_default());
}
