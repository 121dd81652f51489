//! Damaged files: every flipped byte and every truncation of real segment and manifest
//! files gives an error or a valid prefix, never a panic. A cleanly closed store's data
//! segments are all sealed, so any damage to them is an error; only the newest segment
//! of a crashed store may yield a prefix.

#![expect(
    clippy::cast_possible_truncation,
    reason = "test code: values are small and chosen by the test"
)]
#![expect(
    clippy::indexing_slicing,
    reason = "test code: a panic is the test failing"
)]
#![expect(clippy::unwrap_used, reason = "test code: a panic is the test failing")]

use oncedb_testkit::fixtures as common;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use common::{BUCKET, WINDOW, manual_clock};
use oncedb::io::{MemStorage, Storage};
use oncedb::{Db, Error, ManualClock, Options, Reservation, Scope};

const KEYS_PER_SEGMENT: u32 = 12;

fn options(disk: &MemStorage, clock: &ManualClock) -> Options {
    Options::new("/db")
        .window(WINDOW)
        .bucket_width(BUCKET)
        .clock(clock.clone())
        .storage(Arc::new(disk.clone()))
}

/// Writes two segments (two buckets): keys 0..12 then 100..112, plus one record each.
/// Closed cleanly, the store then has a third, empty segment; crashed, the second is the
/// newest and unsealed.
fn build(clock: &ManualClock, crash: bool) -> (MemStorage, Vec<PathBuf>) {
    let disk = MemStorage::new();
    let db = Db::open(options(&disk, clock)).unwrap();
    let scope = Scope::new("org", "op");
    for base in [0u32, 100] {
        for i in base..base + KEYS_PER_SEGMENT {
            db.insert_if_absent(&i.to_le_bytes()).unwrap();
        }
        let Reservation::Acquired(lease) = db.reserve(&scope, &base.to_le_bytes(), b"r").unwrap()
        else {
            panic!("acquire");
        };
        lease.complete(b"response").unwrap();
        clock.forward(BUCKET);
    }
    if crash {
        std::mem::forget(db);
        disk.process_crash();
    } else {
        drop(db);
    }
    let segments: Vec<PathBuf> = disk
        .list(Path::new("/db"))
        .unwrap()
        .into_iter()
        .filter(|p| p.file_name().unwrap().to_str().unwrap().starts_with("seg-"))
        .collect();
    assert_eq!(segments.len(), if crash { 2 } else { 3 });
    (disk, segments)
}

/// Keys of `base..base+12` that the database holds; they must form a prefix.
fn recovered_prefix(db: &Db, base: u32) -> u32 {
    let present: Vec<bool> = (base..base + KEYS_PER_SEGMENT)
        .map(|i| db.contains(&i.to_le_bytes()).unwrap())
        .collect();
    let prefix = present.iter().take_while(|&&p| p).count();
    assert!(
        present[prefix..].iter().all(|&p| !p),
        "recovered keys are not a prefix: {present:?}"
    );
    prefix as u32
}

fn damage_each_byte(
    path: &Path,
    crash: bool,
    check: impl Fn(&MemStorage, Result<Db, Error>, usize),
) {
    let clock = manual_clock();
    let (disk, _) = build(&clock, crash);
    let original = disk.contents(path).unwrap();
    for position in 0..original.len() {
        let mut damaged = original.clone();
        damaged[position] ^= 0x5a;
        disk.set_contents(path, damaged);
        let result = Db::open(options(&disk, &clock));
        check(&disk, result, position);
        // Recovery may have cut, sealed or added files: start each copy afresh.
        for file in disk.list(Path::new("/db")).unwrap() {
            disk.remove(&file).unwrap();
        }
        let (fresh, _) = build(&manual_clock(), crash);
        for file in fresh.list(Path::new("/db")).unwrap() {
            disk.set_contents(&file, fresh.contents(&file).unwrap());
        }
        disk.set_contents(path, original.clone());
    }
}

#[test]
fn a_flipped_byte_in_a_sealed_segment_is_reported_as_corruption() {
    let clock = manual_clock();
    let (_, segments) = build(&clock, false);
    for sealed in &segments[..2] {
        damage_each_byte(sealed, false, |_, result, position| match result {
            Err(Error::Corrupted { path, .. }) => assert_eq!(&path, sealed),
            Err(other) => panic!("byte {position}: expected Corrupted, got {other}"),
            Ok(_) => panic!("byte {position}: damage in a sealed segment went unnoticed"),
        });
    }
}

#[test]
fn every_truncation_of_a_sealed_segment_is_reported_as_corruption() {
    let clock = manual_clock();
    let (disk, segments) = build(&clock, false);
    for sealed in &segments[..2] {
        let original = disk.contents(sealed).unwrap();
        for len in 0..original.len() {
            disk.set_contents(sealed, original[..len].to_vec());
            match Db::open(options(&disk, &clock)) {
                Err(Error::Corrupted { path, .. }) => assert_eq!(&path, sealed),
                other => panic!("length {len}: expected Corrupted, got {:?}", other.err()),
            }
        }
        disk.set_contents(sealed, original);
    }
}

#[test]
fn damage_to_the_empty_newest_segment_of_a_closed_store_loses_nothing() {
    let clock = manual_clock();
    let (_, segments) = build(&clock, false);
    damage_each_byte(&segments[2], false, |_, result, position| {
        let db = result.unwrap_or_else(|err| panic!("byte {position}: {err}"));
        assert_eq!(recovered_prefix(&db, 0), KEYS_PER_SEGMENT);
        assert_eq!(recovered_prefix(&db, 100), KEYS_PER_SEGMENT);
    });
}

#[test]
fn a_flipped_byte_in_the_newest_segment_gives_an_error_or_a_valid_prefix() {
    let clock = manual_clock();
    let (_, segments) = build(&clock, true);
    damage_each_byte(&segments[1], true, |_, result, position| match result {
        Ok(db) => {
            assert_eq!(
                recovered_prefix(&db, 0),
                KEYS_PER_SEGMENT,
                "byte {position}: older segment intact"
            );
            recovered_prefix(&db, 100);
        }
        Err(Error::Corrupted { .. }) => {}
        Err(other) => panic!("byte {position}: unexpected error {other}"),
    });
}

#[test]
fn every_truncation_of_the_newest_segment_of_a_crashed_store_recovers_a_prefix() {
    let clock = manual_clock();
    let (disk, segments) = build(&clock, true);
    let original = disk.contents(&segments[1]).unwrap();
    let mut previous = 0;
    for len in (0..=original.len()).rev() {
        // Each open seals the newest and starts another: drop those from the last round.
        for file in disk.list(Path::new("/db")).unwrap() {
            if file.ends_with("LOCK") || file.ends_with("MANIFEST") || file == segments[0] {
                continue;
            }
            disk.remove(&file).unwrap();
        }
        disk.set_contents(&segments[1], original[..len].to_vec());
        let db =
            Db::open(options(&disk, &clock)).unwrap_or_else(|err| panic!("length {len}: {err}"));
        assert_eq!(recovered_prefix(&db, 0), KEYS_PER_SEGMENT);
        let prefix = recovered_prefix(&db, 100);
        if len < original.len() {
            assert!(prefix <= previous, "shorter files never recover more");
        }
        previous = prefix;
        drop(db);
        // The repair itself must leave a file that reopens to the same prefix.
        let db = Db::open(options(&disk, &clock)).unwrap();
        assert_eq!(recovered_prefix(&db, 100), prefix);
        drop(db);
    }
}

#[test]
fn a_damaged_manifest_is_reported() {
    let clock = manual_clock();
    let manifest = PathBuf::from("/db/MANIFEST");
    damage_each_byte(&manifest, false, |_, result, position| {
        assert!(
            matches!(result, Err(Error::Corrupted { .. })),
            "byte {position}: {:?}",
            result.err()
        );
    });
    let (disk, _) = build(&clock, false);
    let original = disk.contents(&manifest).unwrap();
    for len in 0..original.len() {
        disk.set_contents(&manifest, original[..len].to_vec());
        assert!(
            matches!(
                Db::open(options(&disk, &clock)),
                Err(Error::Corrupted { .. })
            ),
            "length {len}"
        );
    }
}
