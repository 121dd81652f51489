//! The library's rooms depend one way: `api` → `engine` → `index`, `log` → `base`, `io`.
//! This test reads every `crate::` path in the source of each top-level module and fails
//! on any that names a room at the same level or above, so an import cycle between
//! top-level modules cannot be written.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Each room's level: a room may only name rooms of a lower level.
const LEVELS: &[(&str, u32)] = &[
    ("base", 0),
    ("io", 0),
    ("index", 1),
    ("log", 1),
    ("engine", 2),
    ("api", 3),
    ("store", 4),
    ("backend", 5),
    ("http", 5),
];

fn rust_files(path: &Path, out: &mut Vec<PathBuf>) {
    if path.is_dir() {
        let mut entries: Vec<PathBuf> = std::fs::read_dir(path)
            .map(|dir| dir.filter_map(|e| e.ok().map(|e| e.path())).collect())
            .unwrap_or_default();
        entries.sort();
        for entry in entries {
            rust_files(&entry, out);
        }
    } else if path.extension().is_some_and(|ext| ext == "rs") {
        out.push(path.to_path_buf());
    }
}

/// The top-level modules named by `crate::NAME` in code (comments skipped).
fn references(source: &str) -> Vec<String> {
    let mut found = Vec::new();
    for line in source.lines() {
        let code = line.split("//").next().unwrap_or_default();
        let mut rest = code;
        while let Some(at) = rest.find("crate::") {
            rest = &rest[at + "crate::".len()..];
            let name: String = rest
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect();
            found.push(name);
        }
    }
    found
}

fn violations(src: &Path) -> Vec<String> {
    let levels: BTreeMap<&str, u32> = LEVELS.iter().copied().collect();
    let mut bad = Vec::new();
    for &(room, level) in LEVELS {
        let mut files = Vec::new();
        rust_files(&src.join(room), &mut files);
        rust_files(&src.join(format!("{room}.rs")), &mut files);
        assert!(!files.is_empty(), "room {room} has no source");
        for file in files {
            let source = std::fs::read_to_string(&file).unwrap_or_default();
            for target in references(&source) {
                if target == room {
                    continue;
                }
                match levels.get(target.as_str()) {
                    Some(&other) if other < level => {}
                    Some(_) => bad.push(format!("{} names crate::{target}", file.display())),
                    // Items re-exported at the root (`crate::Error`) belong to the API.
                    None if level >= 3 => {}
                    None => bad.push(format!(
                        "{} names crate::{target}, a root item (the API's level)",
                        file.display()
                    )),
                }
            }
        }
    }
    bad
}

#[test]
fn every_room_names_only_lower_rooms() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let bad = violations(&src);
    assert!(
        bad.is_empty(),
        "upward or sideways references:\n{}",
        bad.join("\n")
    );
}

#[test]
fn the_check_catches_a_cycle() {
    let dir = tempfile::tempdir().unwrap_or_else(|err| panic!("tempdir: {err}"));
    for &(room, _) in LEVELS {
        std::fs::create_dir(dir.path().join(room)).unwrap_or_else(|err| panic!("{err}"));
        let body = if room == "index" {
            "use crate::engine::Engine;\n// crate::api in a comment is fine\n"
        } else {
            "use crate::base::error::Error;\n"
        };
        std::fs::write(dir.path().join(room).join("mod.rs"), body)
            .unwrap_or_else(|err| panic!("{err}"));
    }
    let bad = violations(dir.path());
    // index names engine (upwards) and io names base (sideways, same level).
    assert_eq!(bad.len(), 2, "{bad:?}");
}
