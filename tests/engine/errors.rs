//! Bad input gets a clear error and changes nothing.

use std::time::Duration;

use crate::support::{manual_clock, memory_db};
use oncedb::{Db, Error, Options, Reservation, Scope};

#[test]
fn invalid_options_are_refused_with_a_reason() {
    let secs = Duration::from_secs;
    let cases = [
        (Options::in_memory().window(Duration::ZERO), "window"),
        (
            Options::in_memory().bucket_width(Duration::ZERO),
            "bucket_width",
        ),
        (
            Options::in_memory().window(secs(60)).bucket_width(secs(61)),
            "larger",
        ),
        (
            Options::in_memory().window(secs(90)).bucket_width(secs(60)),
            "multiple",
        ),
        (Options::in_memory().shards(6), "power of two"),
    ];
    for (options, needle) in cases {
        match Db::open(options) {
            Err(err @ Error::InvalidOptions(_)) => {
                assert!(err.to_string().contains(needle), "{err}");
            }
            Err(other) => panic!("expected InvalidOptions({needle}), got {other}"),
            Ok(_) => panic!("expected InvalidOptions({needle}), got a database"),
        }
    }
}

#[test]
fn oversized_and_empty_keys_are_refused() {
    let clock = manual_clock();
    let db = Db::open(Options::in_memory().clock(clock.clone()).max_key_bytes(8)).unwrap();
    assert!(matches!(
        db.insert_if_absent(&[1; 9]),
        Err(Error::KeyTooLong { len: 9, max: 8 })
    ));
    assert!(matches!(db.insert_if_absent(b""), Err(Error::EmptyKey)));
    assert!(matches!(
        db.contains(&[1; 9]),
        Err(Error::KeyTooLong { .. })
    ));
    let scope = Scope::new("t", "o");
    assert!(matches!(
        db.reserve(&scope, &[1; 9], b"r"),
        Err(Error::KeyTooLong { .. })
    ));
    assert_eq!(db.stats().admitted, 0);
}

#[test]
fn a_bad_key_in_a_batch_inserts_nothing() {
    let clock = manual_clock();
    let db = memory_db(&clock);
    let keys: Vec<&[u8]> = vec![b"a", b"b", b""];
    assert!(matches!(db.insert_many(&keys), Err(Error::EmptyKey)));
    assert!(
        db.insert_if_absent(b"a").unwrap(),
        "the batch left nothing behind"
    );
}

#[test]
fn oversized_batches_are_refused() {
    let clock = manual_clock();
    let db = memory_db(&clock);
    let keys: Vec<[u8; 4]> = (0..oncedb::MAX_BATCH_KEYS as u32 + 1)
        .map(u32::to_le_bytes)
        .collect();
    assert!(matches!(
        db.insert_many(&keys),
        Err(Error::BatchTooLarge { .. })
    ));
    assert_eq!(db.stats().live_keys, 0);
}

#[test]
fn oversized_responses_are_refused_and_the_lease_survives_the_record() {
    let clock = manual_clock();
    let db = Db::open(
        Options::in_memory()
            .clock(clock.clone())
            .max_response_bytes(16),
    )
    .unwrap();
    let scope = Scope::new("t", "o");
    let Reservation::Acquired(lease) = db.reserve(&scope, b"k", b"r").unwrap() else {
        panic!("acquire");
    };
    let err = lease.complete(&[0; 17]).unwrap_err();
    assert!(matches!(
        err.error(),
        Error::ResponseTooLarge { len: 17, max: 16 }
    ));
    assert!(err.to_string().contains("17 bytes"));
    // The record is still in flight: nothing was lost or silently completed.
    assert!(matches!(
        db.reserve(&scope, b"k", b"r").unwrap(),
        Reservation::InFlight { .. }
    ));
    // The refused call handed the lease back, still usable: fail is refused the same
    // way, and a smaller response then completes the record.
    let lease = err.into_lease();
    let lease = lease.fail(&[1; 17]).unwrap_err().into_lease();
    lease.complete(b"small").unwrap();
    let Reservation::Completed(record) = db.reserve(&scope, b"k", b"r").unwrap() else {
        panic!("the record must be completed by the returned lease");
    };
    assert_eq!(record.response(), Some(&b"small"[..]));
}

#[test]
fn oversized_scopes_are_refused() {
    let clock = manual_clock();
    let db = memory_db(&clock);
    let scope = Scope::new(vec![b'x'; oncedb::MAX_SCOPE_PART_BYTES + 1], "op");
    assert!(matches!(
        db.reserve(&scope, b"k", b"r"),
        Err(Error::ScopeTooLong { .. })
    ));
}

#[test]
fn errors_display_readably() {
    let err = Error::Corrupted {
        path: "/db/seg".into(),
        offset: 42,
        reason: "frame checksum mismatch".into(),
    };
    assert_eq!(
        err.to_string(),
        "/db/seg is corrupted at byte 42: frame checksum mismatch"
    );
    let source: &dyn std::error::Error = &Error::Io(std::io::Error::other("disk"));
    assert!(source.source().is_some());
}

#[test]
fn an_expected_keys_too_large_to_allocate_is_an_error_not_an_abort() {
    for keys in [oncedb::MAX_EXPECTED_KEYS, oncedb::MAX_EXPECTED_KEYS + 1] {
        assert!(
            matches!(
                Db::open(Options::in_memory().expected_keys(keys)),
                Err(Error::InvalidOptions(_))
            ),
            "{keys}"
        );
    }
}

#[test]
fn stray_segment_like_names_are_ignored() {
    let dir = tempfile::tempdir().unwrap();
    {
        let db = Db::open(Options::new(dir.path())).unwrap();
        assert!(db.insert_if_absent(b"kept").unwrap());
    }
    std::fs::write(
        dir.path().join("seg-+0000000000000000001-0000000000.log"),
        b"not a segment",
    )
    .unwrap();
    let db = Db::open(Options::new(dir.path())).unwrap();
    assert!(db.contains(b"kept").unwrap());
}
