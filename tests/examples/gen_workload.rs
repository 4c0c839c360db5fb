//! Writes the committed workloads of the session benchmark from their seeds:
//! `cargo run -p tests --example gen_workload` (all of them, into `fixtures/workload/`).
fn main() -> std::io::Result<()> {
    for shape in tests::workload::Shape::ALL {
        let w = shape.generate();
        // A committed file that already holds it stays byte for byte (key order may differ).
        if tests::workload::load(shape).is_ok_and(|c| c == w) {
            continue;
        }
        let text = serde_json::to_string_pretty(&w).map_err(std::io::Error::other)?;
        std::fs::write(shape.path(), text + "\n")?;
        println!("{}", shape.path().display());
    }
    Ok(())
}
