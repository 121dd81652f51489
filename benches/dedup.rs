//! Side-by-side throughput of reserve-if-absent on one key stream: oncedb (in memory,
//! `Interval`, `Sync`) against dashmap, moka, redb, fjall and a bare open-addressing table.
//! Every system sees the same 16-byte ids with 20% duplicates.
//!
//! `cargo bench --bench dedup` (all groups) or `cargo bench --bench dedup -- memory`.

#![expect(
    clippy::cast_possible_truncation,
    reason = "benchmark tool: sizes and rates fit their types on any machine it runs on"
)]
#![expect(
    clippy::indexing_slicing,
    reason = "benchmark tool: indices come from the workload it generates"
)]
#![expect(clippy::unwrap_used, reason = "benchmark: a failure aborts the run")]

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{
    BenchmarkId, Criterion, SamplingMode, Throughput, criterion_group, criterion_main,
};
use dashmap::DashMap;
use oncedb::{Db, Durability, ManualClock, Options, Reservation, Scope};
use oncedb_testkit::workload::{id_stream, idempotency_keys, response_body};
use redb::ReadableTable;

/// Operations in the large in-memory stream: 12.5 M ops with 20% duplicates leave 10 M
/// live keys.
const LARGE_OPS: usize = 12_500_000;
/// Operations in the medium stream: 4 M ops leave 3.2 M live keys.
const MEDIUM_OPS: usize = 4_000_000;
/// Distinct keys in the large stream.
const LIVE_KEYS: u64 = 10_000_000;
/// Operations for the slower (durable, TTL-cache) systems.
const SMALL_OPS: usize = 1_000_000;
const BATCH: usize = 1024;
const DUP_RATE: f64 = 0.2;

fn memory_db() -> Db {
    Db::open(Options::in_memory()).unwrap()
}

fn run_oncedb_batches(db: &Db, ids: &[[u8; 16]]) -> u64 {
    let mut admitted = Vec::with_capacity(BATCH);
    let mut count = 0;
    for batch in ids.chunks(BATCH) {
        db.insert_many_into(batch, &mut admitted).unwrap();
        count += admitted.iter().filter(|&&a| a).count() as u64;
    }
    count
}

fn run_oncedb_single(db: &Db, ids: &[[u8; 16]]) -> u64 {
    ids.iter()
        .filter(|id| db.insert_if_absent(&id[..]).unwrap())
        .count() as u64
}

fn run_dashmap(ids: &[[u8; 16]]) -> u64 {
    let map: DashMap<[u8; 16], ()> = DashMap::new();
    let mut count = 0;
    for id in ids {
        if let dashmap::Entry::Vacant(slot) = map.entry(*id) {
            slot.insert(());
            count += 1;
        }
    }
    count
}

/// The ceiling: one bare linear-probing table of 64-bit hashes, sized for the stream up
/// front, no locks, no expiry, no prefetch.
fn run_bare_probe(ids: &[[u8; 16]]) -> u64 {
    let capacity = (ids.len() * 8 / 7).next_power_of_two();
    let mut slots = vec![0u64; capacity];
    let mask = capacity - 1;
    let mut count = 0;
    for id in ids {
        count += u64::from(probe_insert(
            &mut slots,
            mask,
            xxhash_rust::xxh3::xxh3_64(id).max(1),
        ));
    }
    count
}

/// The bare table growing from empty: it doubles (every hash moved once, in order) when
/// an insert would take it past a load of 7/8. The ceiling for a single-key path whose
/// tables grow, as oncedb's do without `expected_keys`.
fn run_bare_probe_growing(ids: &[[u8; 16]]) -> u64 {
    let mut slots = vec![0u64; 1024];
    let mut count = 0;
    for id in ids {
        if (count as usize + 1) * 8 > slots.len() * 7 {
            let mut grown = vec![0u64; slots.len() * 2];
            let mask = grown.len() - 1;
            for &hash in slots.iter().filter(|&&hash| hash != 0) {
                probe_insert(&mut grown, mask, hash);
            }
            slots = grown;
        }
        let mask = slots.len() - 1;
        count += u64::from(probe_insert(
            &mut slots,
            mask,
            xxhash_rust::xxh3::xxh3_64(id).max(1),
        ));
    }
    count
}

/// Linear probing for `hash` in the bare table: inserts it if absent; true if it was.
#[inline]
fn probe_insert(slots: &mut [u64], mask: usize, hash: u64) -> bool {
    let mut index = hash as usize & mask;
    loop {
        let slot = slots[index];
        if slot == 0 {
            slots[index] = hash;
            return true;
        }
        if slot == hash {
            return false;
        }
        index = (index + 1) & mask;
    }
}

/// The bare table again, probing in batches of 1024 with the home slot of the key 8
/// places ahead prefetched: the ceiling for a batch path that prefetches.
fn run_bare_probe_prefetch(ids: &[[u8; 16]]) -> u64 {
    const AHEAD: usize = 8;
    let capacity = (ids.len() * 8 / 7).next_power_of_two();
    let mut slots = vec![0u64; capacity];
    let mask = capacity - 1;
    let mut hashes = Vec::with_capacity(BATCH);
    let mut count = 0;
    for batch in ids.chunks(BATCH) {
        hashes.clear();
        hashes.extend(batch.iter().map(|id| xxhash_rust::xxh3::xxh3_64(id).max(1)));
        for n in 0..hashes.len() {
            if let Some(&ahead) = hashes.get(n + AHEAD) {
                prefetch(&slots[ahead as usize & mask]);
            }
            count += u64::from(probe_insert(&mut slots, mask, hashes[n]));
        }
    }
    count
}

/// A cache prefetch hint for the bare baseline (the engine's own is in
/// `src/base/prefetch.rs`).
#[inline(always)]
fn prefetch<T>(value: &T) {
    #[cfg(target_arch = "x86_64")]
    #[expect(
        unsafe_code,
        reason = "baseline: the bare probe prefetches the way the engine's batch path does"
    )]
    // SAFETY: `prefetcht0` is a hint that never faults and writes nothing; the pointer
    // comes from a live reference.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
            std::ptr::from_ref(value).cast::<i8>(),
        );
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = value;
}

fn run_moka(ids: &[[u8; 16]]) -> u64 {
    let cache: moka::sync::Cache<[u8; 16], ()> = moka::sync::Cache::builder()
        .time_to_live(Duration::from_secs(24 * 3600))
        .build();
    ids.iter()
        .filter(|id| cache.entry(**id).or_insert(()).is_fresh())
        .count() as u64
}

fn run_redb(ids: &[[u8; 16]], durability: redb::Durability) -> u64 {
    const TABLE: redb::TableDefinition<&[u8], ()> = redb::TableDefinition::new("ids");
    let dir = tempfile::tempdir().unwrap();
    let db = redb::Database::create(dir.path().join("redb")).unwrap();
    let mut count = 0;
    for batch in ids.chunks(BATCH) {
        let mut txn = db.begin_write().unwrap();
        txn.set_durability(durability).unwrap();
        {
            let mut table = txn.open_table(TABLE).unwrap();
            for id in batch {
                if table.get(&id[..]).unwrap().is_none() {
                    table.insert(&id[..], ()).unwrap();
                    count += 1;
                }
            }
        }
        txn.commit().unwrap();
    }
    count
}

fn run_fjall(ids: &[[u8; 16]], persist: Option<fjall::PersistMode>) -> u64 {
    let dir = tempfile::tempdir().unwrap();
    let db = fjall::Database::builder(dir.path()).open().unwrap();
    let keyspace = db
        .keyspace("ids", fjall::KeyspaceCreateOptions::default)
        .unwrap();
    let mut count = 0;
    for batch in ids.chunks(BATCH) {
        for id in batch {
            if !keyspace.contains_key(id).unwrap() {
                keyspace.insert(id, []).unwrap();
                count += 1;
            }
        }
        if let Some(mode) = persist {
            db.persist(mode).unwrap();
        }
    }
    count
}

fn durable_db(dir: &std::path::Path, durability: Durability) -> Db {
    Db::open(Options::new(dir).durability(durability)).unwrap()
}

/// Times `routine` once per iteration on a fresh structure.
fn timed(iters: u64, mut routine: impl FnMut() -> u64) -> Duration {
    let mut total = Duration::ZERO;
    for _ in 0..iters {
        let started = Instant::now();
        black_box(routine());
        total += started.elapsed();
    }
    total
}

type Group<'a> = criterion::BenchmarkGroup<'a, criterion::measurement::WallTime>;

/// A group over `ids` with one sample per fresh structure.
fn group<'a>(c: &'a mut Criterion, name: &str, elements: usize) -> Group<'a> {
    let mut group = c.benchmark_group(name);
    group.sampling_mode(SamplingMode::Flat).sample_size(10);
    group.throughput(Throughput::Elements(elements as u64));
    group
}

/// Benchmarks `run` on a fresh value of `setup` per iteration.
fn bench<T>(group: &mut Group<'_>, name: &str, setup: impl Fn() -> T, run: impl Fn(&T) -> u64) {
    group.bench_function(name, |b| {
        b.iter_custom(|iters| timed(iters, || run(&setup())))
    });
}

/// oncedb batched and single-key, growing from empty, against dashmap.
fn memory_common(group: &mut Group<'_>, ids: &[[u8; 16]]) {
    bench(group, "oncedb_insert_many_1024", memory_db, |db| {
        run_oncedb_batches(db, ids)
    });
    bench(group, "oncedb_insert_if_absent", memory_db, |db| {
        run_oncedb_single(db, ids)
    });
    bench(group, "dashmap_entry", || (), |()| run_dashmap(ids));
    bench(
        group,
        "bare_open_addressing_growing",
        || (),
        |()| run_bare_probe_growing(ids),
    );
}

fn memory(c: &mut Criterion) {
    let ids = id_stream(LARGE_OPS, DUP_RATE, 42);
    let mut group = group(c, "memory_10M_live", ids.len());
    memory_common(&mut group, &ids);
    // Tables sized up front without huge pages (by default tables made at open are
    // mapped and advised for transparent huge pages; growing ones stay on the heap).
    let presized_small_pages = || {
        Db::open(
            Options::in_memory()
                .expected_keys(LIVE_KEYS)
                .huge_pages(false),
        )
        .unwrap()
    };
    bench(
        &mut group,
        "oncedb_insert_many_1024_presized_small_pages",
        presized_small_pages,
        |db| run_oncedb_batches(db, &ids),
    );
    bench(
        &mut group,
        "oncedb_insert_if_absent_presized_small_pages",
        presized_small_pages,
        |db| run_oncedb_single(db, &ids),
    );
    // Tables sized for the live keys up front, like the bare table.
    let presized = || Db::open(Options::in_memory().expected_keys(LIVE_KEYS)).unwrap();
    bench(
        &mut group,
        "oncedb_insert_many_1024_presized",
        presized,
        |db| run_oncedb_batches(db, &ids),
    );
    bench(
        &mut group,
        "oncedb_insert_if_absent_presized",
        presized,
        |db| run_oncedb_single(db, &ids),
    );
    bench(
        &mut group,
        "bare_open_addressing",
        || (),
        |()| run_bare_probe(&ids),
    );
    bench(
        &mut group,
        "bare_open_addressing_prefetch",
        || (),
        |()| run_bare_probe_prefetch(&ids),
    );
    group.finish();
}

fn medium_memory(c: &mut Criterion) {
    let ids = id_stream(MEDIUM_OPS, DUP_RATE, 42);
    let mut group = group(c, "memory_3M_live", ids.len());
    memory_common(&mut group, &ids);
    group.finish();
}

fn small_memory(c: &mut Criterion) {
    let ids = id_stream(SMALL_OPS, DUP_RATE, 42);
    let mut group = group(c, "memory_1M", ids.len());
    memory_common(&mut group, &ids);
    bench(&mut group, "moka_ttl", || (), |()| run_moka(&ids));
    group.finish();
}

fn durable(c: &mut Criterion) {
    let ids = id_stream(SMALL_OPS, DUP_RATE, 42);
    let mut group = group(c, "durable_1M_batch_1024", ids.len());
    let oncedb = |durability: Durability| {
        let dir = tempfile::tempdir().unwrap();
        let db = durable_db(dir.path(), durability);
        let admitted = run_oncedb_batches(&db, &ids);
        db.flush().unwrap();
        admitted
    };
    group.bench_function("oncedb_interval_10ms", |b| {
        b.iter_custom(|iters| {
            timed(iters, || {
                oncedb(Durability::Interval(Duration::from_millis(10)))
            })
        })
    });
    group.bench_function("oncedb_sync_fsync_per_batch", |b| {
        b.iter_custom(|iters| timed(iters, || oncedb(Durability::Sync)))
    });
    group.bench_function("redb_fsync_per_batch", |b| {
        b.iter_custom(|iters| timed(iters, || run_redb(&ids, redb::Durability::Immediate)))
    });
    group.bench_function("redb_no_fsync", |b| {
        b.iter_custom(|iters| timed(iters, || run_redb(&ids, redb::Durability::None)))
    });
    group.bench_function("fjall_fsync_per_batch", |b| {
        b.iter_custom(|iters| timed(iters, || run_fjall(&ids, Some(fjall::PersistMode::SyncAll))))
    });
    group.bench_function("fjall_no_fsync", |b| {
        b.iter_custom(|iters| timed(iters, || run_fjall(&ids, None)))
    });
    group.finish();
}

fn records(c: &mut Criterion) {
    let keys = idempotency_keys(SMALL_OPS, DUP_RATE, 42);
    let response = response_body(7);
    let scope = Scope::new("bench", "create_payment");
    let mut group = group(c, "records_1M_reserve_complete", keys.len());
    group.bench_function("oncedb_memory", |b| {
        b.iter_custom(|iters| {
            timed(iters, || {
                let db = memory_db();
                let mut acquired = 0;
                for key in &keys {
                    if let Reservation::Acquired(lease) =
                        db.reserve(&scope, key.as_bytes(), key.as_bytes()).unwrap()
                    {
                        lease.complete(&response).unwrap();
                        acquired += 1;
                    }
                }
                acquired
            })
        })
    });
    group.bench_function("dashmap_string_to_response", |b| {
        b.iter_custom(|iters| {
            timed(iters, || {
                let map: DashMap<String, Vec<u8>> = DashMap::new();
                let mut acquired = 0;
                for key in &keys {
                    if let dashmap::Entry::Vacant(slot) = map.entry(key.clone()) {
                        slot.insert(response.clone());
                        acquired += 1;
                    }
                }
                acquired
            })
        })
    });
    group.finish();
}

/// The same stream admitted into 1 live bucket or spread over 16.
fn buckets(c: &mut Criterion) {
    let ids = id_stream(LARGE_OPS / 2, DUP_RATE, 42);
    let mut group = group(c, "live_buckets", ids.len());
    for live_buckets in [1u32, 16] {
        group.bench_with_input(
            BenchmarkId::from_parameter(live_buckets),
            &live_buckets,
            |b, &live| {
                b.iter_custom(|iters| {
                    timed(iters, || {
                        let clock = ManualClock::new(std::time::SystemTime::now());
                        let db = Db::open(
                            Options::in_memory()
                                .window(Duration::from_secs(16 * 60))
                                .bucket_width(Duration::from_secs(60))
                                .clock(clock.clone()),
                        )
                        .unwrap();
                        let per_bucket = ids.len().div_ceil(live as usize);
                        let mut admitted = 0;
                        for part in ids.chunks(per_bucket) {
                            admitted += run_oncedb_batches(&db, part);
                            clock.forward(Duration::from_secs(60));
                        }
                        admitted
                    })
                })
            },
        );
    }
    group.finish();
}

criterion_group!(
    benches,
    memory,
    medium_memory,
    small_memory,
    durable,
    records,
    buckets
);
criterion_main!(benches);
