//! The gateway's modules stay in layers: no module names one above it in the module map of
//! `docs/architecture.md`, so there is no import circle, and the map names every module.
//! Read from the sources (comments and test modules left out), as a reviewer would.

use std::path::{Path, PathBuf};

/// The gateway's modules, lowest first (the order of the map in `docs/architecture.md`).
const LAYERS: &[&str] = &[
    "clock",
    "config",
    "markdown",
    "event",
    "media",
    "metrics",
    "inbox",
    "matrix",
    "identity",
    "ear",
    "mouth",
    "processes",
    "turns",
    "endpoint",
    "answers",
    "service",
    "quic",
    "client",
    "exporter",
    "check",
    "report",
    "cli",
];

fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("gateway/src").flatten() {
        let path = entry.path();
        if path.is_dir() {
            sources(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The top-level module a source file belongs to (`ear` for `ear/context.rs`).
fn module_of(src: &Path, file: &Path) -> Option<String> {
    let rel = file.strip_prefix(src).ok()?;
    let first = rel.components().next()?.as_os_str().to_str()?;
    Some(first.trim_end_matches(".rs").to_owned())
}

/// The modules `text` names as `crate::NAME` or `gateway::NAME`, outside comments and
/// test modules.
fn named(text: &str) -> Vec<String> {
    let code = text
        .split("#[cfg(test)]\nmod tests")
        .next()
        .unwrap_or_default();
    let mut out = Vec::new();
    for line in code.lines() {
        let line = line.split("//").next().unwrap_or_default();
        for prefix in ["crate::", "gateway::"] {
            for (at, _) in line.match_indices(prefix) {
                let rest = &line[at + prefix.len()..];
                let name: String = rest
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect();
                out.push(name);
            }
        }
    }
    out
}

#[test]
fn no_module_names_one_above_it_and_the_map_names_them_all() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let src = root.join("src");
    let mut files = Vec::new();
    sources(&src, &mut files);
    let mut upward = Vec::new();
    let mut modules = std::collections::BTreeSet::new();
    for file in &files {
        let Some(module) = module_of(&src, file) else {
            continue;
        };
        if matches!(module.as_str(), "lib" | "main") || file.ends_with("tests.rs") {
            continue;
        }
        modules.insert(module.clone());
        let Some(level) = LAYERS.iter().position(|m| *m == module) else {
            continue;
        };
        let text = std::fs::read_to_string(file).expect("source");
        for other in named(&text) {
            if let Some(higher) = LAYERS.iter().position(|m| *m == other) {
                if higher > level {
                    upward.push(format!("{} names {other}", file.display()));
                }
            }
        }
    }
    assert!(
        upward.is_empty(),
        "modules naming one above them: {upward:#?}"
    );
    let unmapped: Vec<_> = modules
        .iter()
        .filter(|m| !LAYERS.contains(&m.as_str()))
        .collect();
    assert!(
        unmapped.is_empty(),
        "modules missing from LAYERS: {unmapped:?}"
    );
    let map = std::fs::read_to_string(root.join("../docs/architecture.md")).expect("the map");
    for m in LAYERS {
        assert!(
            map.contains(&format!("`gateway::{m}`")),
            "docs/architecture.md's map does not name gateway::{m}"
        );
    }
}

#[test]
fn the_reader_sees_through_comments_and_tests() {
    let text = "use crate::inbox::Inbox; // crate::turns\n/// [`crate::quic`]\nfn f() { gateway::ear::x(); }\n#[cfg(test)]\nmod tests { use crate::cli; }";
    assert_eq!(named(text), ["inbox", "ear"]);
}

/// The module paths of a crate's sources under `src` (`crate::a::b` for `a/b.rs` or
/// `a/b/mod.rs`), test modules left out.
fn module_paths(krate: &str, src: &Path) -> Vec<String> {
    let mut files = Vec::new();
    sources(src, &mut files);
    let mut out: Vec<String> = files
        .iter()
        .filter_map(|f| {
            let rel = f.strip_prefix(src).ok()?.with_extension("");
            let mut parts: Vec<&str> = rel.iter().filter_map(|p| p.to_str()).collect();
            if parts.last() == Some(&"mod") {
                parts.pop();
            }
            let test = parts.contains(&"tests");
            let root = matches!(parts.as_slice(), ["lib" | "main"]);
            (!test && !root && !parts.is_empty()).then(|| format!("{krate}::{}", parts.join("::")))
        })
        .collect();
    out.sort();
    out
}

#[test]
fn the_map_names_every_module_of_the_three_crates() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let map = std::fs::read_to_string(root.join("../docs/architecture.md")).expect("the map");
    let mut missing = Vec::new();
    let mut seen = 0;
    for (krate, dir) in [
        ("wire", "../wire/src"),
        ("session", "../session/src"),
        ("gateway", "src"),
    ] {
        for m in module_paths(krate, &root.join(dir)) {
            seen += 1;
            if !map.contains(&format!("`{m}`")) {
                missing.push(m);
            }
        }
    }
    assert!(seen > 40, "only {seen} modules found: the walk is wrong");
    assert!(
        missing.is_empty(),
        "docs/architecture.md's map does not name: {missing:#?}"
    );
}
