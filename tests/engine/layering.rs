//! The library's rooms depend one way: `http`, `backend` → `store` → `api` → `engine` →
//! `replica` → `index`, `wal` → `base`, `io`. This test reads every path of each top-level module
//! (`crate::` paths, `crate::{…}` groups and `super::` paths that leave the room) and
//! fails on any that
//! - names a room at the same level or above, so an import cycle between top-level
//!   modules cannot be written;
//! - reaches into another room's submodule instead of its front (`mod.rs`);
//! - from `api`, names `index`, `wal` or `io`, which the API reaches only through
//!   `engine`;
//!
//! and fails on a room whose `mod.rs` makes a submodule visible outside the room.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Each room's level: a room may only name rooms of a lower level.
const LEVELS: &[(&str, u32)] = &[
    ("base", 0),
    ("io", 0),
    ("index", 1),
    ("wal", 1),
    ("replica", 2),
    ("engine", 3),
    ("api", 4),
    ("store", 5),
    ("backend", 6),
    ("http", 6),
];

/// Rooms whose submodules are private: the rest of the crate sees only their `mod.rs`.
/// (`backend` publishes `postgres` as the public module `oncedb::postgres`.)
const FRONTED: &[&str] = &[
    "base", "io", "index", "wal", "replica", "engine", "api", "store", "http",
];

/// Rooms `api` may not name: it reaches them through `engine`.
const BELOW_ENGINE: &[&str] = &["index", "wal", "io", "replica"];

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

/// A reference to a room: its name and the next path segment, if any (`crate::wal::scan`
/// is `("wal", Some("scan"))`).
type Reference = (String, Option<String>);

fn identifier(text: &str) -> String {
    text.chars()
        .take_while(|c| c.is_alphanumeric() || *c == '_')
        .collect()
}

/// The paths that follow a crate-root prefix: `a::b`, or each part of a `{a::b, c}` group.
fn rooted_paths(after: &str, out: &mut Vec<Reference>) {
    let after = after.trim_start();
    if let Some(group) = after.strip_prefix('{') {
        let mut depth = 0usize;
        let mut part = String::new();
        for c in group.chars() {
            match c {
                '{' => depth += 1,
                '}' if depth == 0 => break,
                '}' => depth -= 1,
                ',' if depth == 0 => {
                    rooted_paths(&part, out);
                    part.clear();
                    continue;
                }
                _ => {}
            }
            part.push(c);
        }
        rooted_paths(&part, out);
        return;
    }
    let room = identifier(after);
    if room.is_empty() || room == "self" {
        return;
    }
    let next = after[room.len()..]
        .strip_prefix("::")
        .map(identifier)
        .filter(|next| !next.is_empty());
    out.push((room, next));
}

/// How many `super::` lead from `file` (in room `room`) to the crate root.
fn depth_below_root(src: &Path, file: &Path) -> usize {
    let relative = file.strip_prefix(src).unwrap_or(file);
    let parts = relative.components().count();
    let is_mod = file.file_name().is_some_and(|name| name == "mod.rs");
    // src/room/mod.rs is room (depth 1); src/room/a.rs is room::a (depth 2).
    if is_mod { parts - 1 } else { parts }
}

/// Every reference of `source` (a file of the room, `depth` modules below the root) to a
/// top-level module, with comments and string literals of whole lines skipped.
fn references(source: &str, depth: usize) -> Vec<Reference> {
    let mut found = Vec::new();
    // Join statements so that groups spanning lines are read whole.
    let code: String = source
        .lines()
        .map(|line| line.split("//").next().unwrap_or_default())
        .collect::<Vec<_>>()
        .join(" ");
    let mut rest = code.as_str();
    while let Some(at) = rest.find("crate::") {
        let before = rest[..at].chars().next_back();
        rest = &rest[at + "crate::".len()..];
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == '$') {
            continue; // `oncedb_crate::`, `$crate::`
        }
        rooted_paths(rest, &mut found);
    }
    let prefix = "super::".repeat(depth);
    let mut rest = code.as_str();
    while let Some(at) = rest.find(prefix.as_str()) {
        let before = rest[..at].chars().next_back();
        rest = &rest[at + prefix.len()..];
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == ':') {
            continue; // part of a longer path
        }
        if rest.starts_with("super::") {
            continue; // leaves the crate: not a path of this crate
        }
        rooted_paths(rest, &mut found);
    }
    found
}

/// Whether `name` is a submodule of room `room` in `src`.
fn is_submodule(src: &Path, room: &str, name: &str) -> bool {
    src.join(room).join(format!("{name}.rs")).is_file()
        || src.join(room).join(name).join("mod.rs").is_file()
}

fn check_reference(
    src: &Path,
    file: &Path,
    (room, level): (&str, u32),
    (target, next): &Reference,
    bad: &mut Vec<String>,
) {
    let levels: BTreeMap<&str, u32> = LEVELS.iter().copied().collect();
    if target == room {
        return;
    }
    let at = file.display();
    match levels.get(target.as_str()) {
        Some(&other) if other < level => {}
        Some(_) => bad.push(format!("{at} names crate::{target}")),
        // Items re-exported at the root (`crate::Error`) sit above every room: a room
        // names them through the room that defines them.
        None => bad.push(format!(
            "{at} names crate::{target}, a root item (above every room)"
        )),
    }
    if room == "api" && BELOW_ENGINE.contains(&target.as_str()) {
        bad.push(format!(
            "{at} names crate::{target}: the API goes through engine"
        ));
    }
    if let Some(next) = next
        && FRONTED.contains(&target.as_str())
        && is_submodule(src, target, next)
    {
        bad.push(format!(
            "{at} reaches into crate::{target}::{next} instead of {target}'s front"
        ));
    }
}

/// `pub mod` or `pub(crate) mod` in a fronted room's `mod.rs`.
fn open_submodules(src: &Path, room: &str, bad: &mut Vec<String>) {
    let front = src.join(room).join("mod.rs");
    let Ok(source) = std::fs::read_to_string(&front) else {
        return;
    };
    for line in source.lines() {
        let line = line.trim_start();
        if line.starts_with("pub mod ") || line.starts_with("pub(crate) mod ") {
            bad.push(format!("{}: `{line}` opens a submodule", front.display()));
        }
    }
}

fn violations(src: &Path) -> Vec<String> {
    let mut bad = Vec::new();
    for &(room, level) in LEVELS {
        let mut files = Vec::new();
        rust_files(&src.join(room), &mut files);
        rust_files(&src.join(format!("{room}.rs")), &mut files);
        assert!(!files.is_empty(), "room {room} has no source");
        for file in files {
            let source = std::fs::read_to_string(&file).unwrap_or_default();
            for reference in references(&source, depth_below_root(src, &file)) {
                check_reference(src, &file, (room, level), &reference, &mut bad);
            }
        }
        if FRONTED.contains(&room) {
            open_submodules(src, room, &mut bad);
        }
    }
    bad
}

#[test]
fn every_room_names_only_lower_rooms_through_their_fronts() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let bad = violations(&src);
    assert!(
        bad.is_empty(),
        "upward, sideways or front-skipping references:\n{}",
        bad.join("\n")
    );
}

/// A fixture tree where every room is clean but for the lines given.
fn fixture(dirty: &[(&str, &str)]) -> Vec<String> {
    let dir = tempfile::tempdir().unwrap_or_else(|err| panic!("tempdir: {err}"));
    for &(room, _) in LEVELS {
        let room_dir = dir.path().join(room);
        std::fs::create_dir(&room_dir).unwrap_or_else(|err| panic!("{err}"));
        std::fs::write(room_dir.join("inner.rs"), "use super::Thing;\n")
            .unwrap_or_else(|err| panic!("{err}"));
        let body = dirty
            .iter()
            .find(|(name, _)| *name == room)
            .map_or("mod inner;\n", |(_, body)| body);
        std::fs::write(room_dir.join("mod.rs"), body).unwrap_or_else(|err| panic!("{err}"));
    }
    violations(dir.path())
}

#[test]
fn the_check_catches_every_kind_of_violation() {
    assert_eq!(fixture(&[]), Vec::<String>::new(), "a clean tree passes");
    let cases: &[(&str, &str, &str)] = &[
        (
            "index",
            "use crate::engine::Engine;\n// crate::api in a comment\n",
            "names crate::engine",
        ),
        ("io", "use crate::base::Error;\n", "names crate::base"),
        (
            "index",
            "use crate::{base::Error,\n    engine::Engine};\n",
            "names crate::engine",
        ),
        (
            "index",
            "use super::engine::Engine;\n",
            "names crate::engine",
        ),
        (
            "engine",
            "use crate::wal::inner::Thing;\n",
            "reaches into crate::wal::inner",
        ),
        (
            "api",
            "use crate::index::Thing;\n",
            "the API goes through engine",
        ),
        ("wal", "pub(crate) mod inner;\n", "opens a submodule"),
    ];
    for &(room, body, expected) in cases {
        let bad = fixture(&[(room, body)]);
        assert!(
            bad.iter().any(|line| line.contains(expected)),
            "{room}: {body:?} should give {expected:?}, got {bad:?}"
        );
    }
}
