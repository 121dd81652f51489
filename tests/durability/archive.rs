//! `Options::archive_dir`: expired segments are moved into the archive instead of being
//! unlinked, by the segment worker and at open alike; the archive reads with `verify`
//! like a store, and is never opened as one.

use std::path::Path;

use crate::support::{BUCKET, WINDOW, durable_options, manual_clock, real_files};
use oncedb::{Db, Error, Options, Reservation, Scope};

fn names(dir: &Path, prefix: &str) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.starts_with(prefix))
        .collect();
    names.sort();
    names
}

#[test]
fn expired_segments_move_into_the_archive_whole_and_read_back() {
    let _files = real_files();
    let (dir, archive) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let archive = archive.path().join("audit");
    let clock = manual_clock();
    let options = || durable_options(dir.path(), &clock).archive_dir(&archive);
    let db = Db::open(options()).unwrap();
    let scope = Scope::new("org", "pay");
    for i in 0..5u32 {
        db.insert_if_absent(&i.to_le_bytes()).unwrap();
        let Reservation::Acquired(lease) = db.reserve(&scope, &i.to_le_bytes(), b"r").unwrap()
        else {
            panic!("a fresh key is acquired");
        };
        lease.complete(b"charged").unwrap();
        clock.forward(BUCKET);
    }
    let before = names(dir.path(), "seg-");
    assert_eq!(before.len(), 5);
    clock.forward(WINDOW);
    db.insert_if_absent(b"now").unwrap();
    db.flush().unwrap();
    let kept = names(dir.path(), "seg-");
    assert_eq!(kept.len(), 1, "{kept:?}");
    assert_eq!(
        names(&archive, "seg-"),
        before,
        "every expired segment, under its name"
    );
    assert_eq!(db.stats().segments_deleted, 5);
    // The archive reads like a store: every frame verifies against the copied manifest.
    let report = oncedb::verify(&archive).unwrap();
    assert!(report.is_clean(), "{report:?}");
    assert_eq!(report.segments.iter().map(|s| s.keys).sum::<u64>(), 5);
    assert_eq!(report.segments.iter().map(|s| s.records).sum::<u64>(), 5);
    assert_eq!(report.segments.iter().map(|s| s.finishes).sum::<u64>(), 5);
    // Expired at open: archived too.
    drop(db);
    clock.forward(WINDOW + BUCKET);
    let db = Db::open(options()).unwrap();
    assert!(names(dir.path(), "seg-").is_empty());
    assert_eq!(
        names(&archive, "seg-").len(),
        7,
        "the last live one and the close's"
    );
    assert!(oncedb::verify(&archive).unwrap().is_clean());
    assert!(db.insert_if_absent(b"now").unwrap(), "the window moved on");
}

#[test]
fn an_archive_is_refused_as_a_store_and_as_another_stores_archive() {
    let _files = real_files();
    let (dir, other, archive) = (
        tempfile::tempdir().unwrap(),
        tempfile::tempdir().unwrap(),
        tempfile::tempdir().unwrap(),
    );
    let clock = manual_clock();
    let db = Db::open(durable_options(dir.path(), &clock).archive_dir(archive.path())).unwrap();
    db.insert_if_absent(b"k").unwrap();
    drop(db);
    let listed = names(archive.path(), "");
    // Opened as a store it would expire everything in it: refused, nothing changed.
    let opened = Db::open(durable_options(archive.path(), &clock));
    assert!(matches!(opened, Err(Error::InvalidOptions(why)) if why.contains("archive")));
    assert_eq!(names(archive.path(), ""), listed);
    // Another store's archive is refused.
    let shared = Db::open(durable_options(other.path(), &clock).archive_dir(archive.path()));
    assert!(matches!(shared, Err(Error::InvalidOptions(why)) if why.contains("another store")));
    // The store's own directory, or an in-memory store, cannot have one.
    let own = Db::open(durable_options(dir.path(), &clock).archive_dir(dir.path()));
    assert!(matches!(own, Err(Error::InvalidOptions(_))));
    let memory = Db::open(Options::in_memory().archive_dir(archive.path()));
    assert!(matches!(memory, Err(Error::InvalidOptions(why)) if why.contains("durable")));
}
