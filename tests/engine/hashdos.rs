//! Hash flooding: keys crafted so that, under a known zero seed, every one of them has
//! its home slot in the first 1/4096 of any table. oncedb hashes with a random
//! per-database secret, so against a real database the same keys spread out and probe
//! sequences stay short. Probes are counted (`Stats::table_probes`), never timed.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use oncedb::io::{MemStorage, Storage};
use oncedb::{Db, Durability, ManualClock, Options, Stats};
use xxhash_rust::xxh3::{xxh3_64, xxh3_128_with_seed};

/// Crafted keys inserted into the seeded database.
const CRAFTED_KEYS: usize = 5_000;
/// Crafted keys whose zero-seed tags have this many leading zero bits.
const ZERO_TOP_BITS: u32 = 12;
/// Table size used to show the clustering (any size would do).
const SHOWCASE_SLOTS: usize = 8_192;
/// Bound on table probes per inserted key with a secret seed. A fresh insert is an
/// unsuccessful search: with linear probing at the table's highest load (4/5) it costs
/// about 13 probes, and over a whole run of inserts random keys average 5 to 6.
const MAX_PROBES_PER_INSERT: f64 = 16.0;
/// Bound on probes per duplicate lookup (a successful search: 3 at load 4/5, under 2 on
/// average).
const MAX_PROBES_PER_LOOKUP: f64 = 8.0;

/// The 64-bit slot tag of `key`: the high half of its 128-bit hash.
fn tag(key: &[u8], seed: u64) -> u64 {
    (xxh3_128_with_seed(key, seed) >> 64) as u64
}

/// Home slot of `tag` in a table of `slots` slots (multiply-shift, as the table does).
fn home(tag: u64, slots: usize) -> usize {
    ((u128::from(tag) * slots as u128) >> 64) as usize
}

/// The first `CRAFTED_KEYS` 8-byte counters whose zero-seed tag starts with
/// `ZERO_TOP_BITS` zero bits: one candidate in 4096 qualifies. Found once per test binary.
fn crafted_keys() -> &'static [[u8; 8]] {
    static KEYS: OnceLock<Vec<[u8; 8]>> = OnceLock::new();
    KEYS.get_or_init(|| {
        let mut keys = Vec::with_capacity(CRAFTED_KEYS);
        let mut candidate = 0u64;
        while keys.len() < CRAFTED_KEYS {
            let key = candidate.to_le_bytes();
            if tag(&key, 0) >> (64 - ZERO_TOP_BITS) == 0 {
                keys.push(key);
            }
            candidate += 1;
        }
        keys
    })
}

fn clock() -> ManualClock {
    ManualClock::new(std::time::UNIX_EPOCH + Duration::from_secs(1_700_000_000))
}

/// Table probes per insert/lookup of the keys inserted since `before`.
fn probes_per_op(before: &Stats, after: &Stats, ops: usize) -> f64 {
    (after.table_probes - before.table_probes) as f64 / ops as f64
}

#[test]
fn crafted_keys_cluster_under_a_zero_seed() {
    let keys = crafted_keys();
    assert_eq!(keys.len(), CRAFTED_KEYS);
    let slots_hit = SHOWCASE_SLOTS >> ZERO_TOP_BITS;
    for key in keys {
        let home = home(tag(key, 0), SHOWCASE_SLOTS);
        assert!(
            home < slots_hit,
            "key {key:?} has home {home}, outside the first {slots_hit} slots"
        );
    }
    // Tables of up to 4096 slots get a single home slot for all of them.
    for slots in [16, 1_000, 4_096] {
        assert!(keys.iter().all(|key| home(tag(key, 0), slots) == 0));
    }
    // Another seed scatters them: no attack survives a secret the attacker cannot see.
    let spread = keys
        .iter()
        .filter(|key| home(tag(key.as_slice(), 0x5eed), SHOWCASE_SLOTS) < slots_hit)
        .count();
    assert!(
        spread < 20,
        "{spread} keys still cluster under another seed"
    );
}

fn seeded_db() -> Db {
    Db::open(
        Options::in_memory()
            .window(Duration::from_secs(3_600))
            .bucket_width(Duration::from_secs(60))
            .shards(1)
            .clock(clock()),
    )
    .unwrap()
}

/// Probes per key of: inserting `keys`, inserting them again, and a batch of them again.
fn probe_ratios(db: &Db, keys: &[[u8; 8]]) -> [f64; 3] {
    let start = db.stats();
    for key in keys {
        assert!(
            db.insert_if_absent(key).unwrap(),
            "fresh key must be admitted"
        );
    }
    let inserted = db.stats();
    for key in keys {
        assert!(
            !db.insert_if_absent(key).unwrap(),
            "second insert is a duplicate"
        );
    }
    let duplicated = db.stats();
    let answers = db.insert_many(keys).unwrap();
    assert!(answers.iter().all(|&admitted| !admitted));
    let batched = db.stats();
    assert_eq!(batched.admitted, keys.len() as u64);
    assert_eq!(batched.live_keys, keys.len() as u64);
    [
        probes_per_op(&start, &inserted, keys.len()),
        probes_per_op(&inserted, &duplicated, keys.len()),
        probes_per_op(&duplicated, &batched, keys.len()),
    ]
}

#[test]
fn a_secret_seed_keeps_probe_counts_bounded() {
    let crafted = probe_ratios(&seeded_db(), crafted_keys());
    // The same number of plain keys, for comparison.
    let plain: Vec<[u8; 8]> = (0..CRAFTED_KEYS as u64)
        .map(|n| (n | 1 << 40).to_le_bytes())
        .collect();
    let control = probe_ratios(&seeded_db(), &plain);
    eprintln!(
        "probes per key (insert, duplicate, batch duplicate): crafted {crafted:.3?}, plain {control:.3?}"
    );

    let [insert, duplicate, batch] = crafted;
    assert!(
        insert < MAX_PROBES_PER_INSERT,
        "{insert:.2} probes per insert of a crafted key (bound {MAX_PROBES_PER_INSERT})"
    );
    for (what, ratio) in [("duplicate", duplicate), ("batch duplicate", batch)] {
        assert!(
            ratio < MAX_PROBES_PER_LOOKUP,
            "{what}: {ratio:.2} probes per crafted key (bound {MAX_PROBES_PER_LOOKUP})"
        );
    }
    // Crafted keys cost no more than ordinary ones, up to chance.
    for (crafted, plain) in crafted.iter().zip(control) {
        assert!(
            *crafted < 2.0 * plain + 4.0,
            "crafted keys probe {crafted:.2} per key, plain keys {plain:.2}"
        );
    }
}

/// A manifest as the database writes it: magic | version u32 | flags u32 | secret u64 |
/// window_ms u64 | bucket_width_ms u64 | xxh3-64 of the 40 bytes before it.
fn manifest_with_secret(secret: u64, window_ms: u64, bucket_width_ms: u64) -> Vec<u8> {
    let mut bytes = Vec::with_capacity(48);
    bytes.extend_from_slice(b"ONCEMAN\0");
    bytes.extend_from_slice(&1u32.to_le_bytes());
    bytes.extend_from_slice(&0u32.to_le_bytes());
    bytes.extend_from_slice(&secret.to_le_bytes());
    bytes.extend_from_slice(&window_ms.to_le_bytes());
    bytes.extend_from_slice(&bucket_width_ms.to_le_bytes());
    let checksum = xxh3_64(&bytes);
    bytes.extend_from_slice(&checksum.to_le_bytes());
    bytes
}

/// The control experiment: a database whose secret is known to be zero (a hand-written
/// manifest) really does pile the crafted keys into one probe chain, so the bound above
/// is owed to the secret and not to keys that were harmless anyway.
#[test]
fn a_known_zero_secret_would_let_crafted_keys_pile_up() {
    const KEYS: usize = 400;
    let disk = MemStorage::new();
    let dir = std::path::Path::new("/db");
    disk.create_dir_all(dir).unwrap();
    disk.set_contents(
        &dir.join("MANIFEST"),
        manifest_with_secret(0, 3_600_000, 60_000),
    );
    let db = Db::open(
        Options::new(dir)
            .window(Duration::from_secs(3_600))
            .bucket_width(Duration::from_secs(60))
            .shards(1)
            .durability(Durability::Buffered)
            .clock(clock())
            .storage(Arc::new(disk.clone())),
    )
    .unwrap();
    let start = db.stats();
    for key in &crafted_keys()[..KEYS] {
        assert!(db.insert_if_absent(key).unwrap());
    }
    let ratio = probes_per_op(&start, &db.stats(), KEYS);
    eprintln!("zero secret: {ratio:.1} probes per insert");
    assert!(
        ratio > 50.0,
        "with a zero secret the crafted keys should share one probe chain, got {ratio:.2} probes per insert"
    );
}
