//! The asynchronous `Store` interface over the embedded `Db` (feature `async`): the same
//! semantics as the synchronous API (the whole conformance suite), and no fsync on a
//! runtime thread.

use std::sync::{Arc, Mutex};
use std::thread::ThreadId;
use std::time::{Duration, SystemTime};

use crate::conformance::suite;
use oncedb::io::MemStorage;
use oncedb::{Db, Durability, ManualClock, Options, StoreOptions};
use oncedb_testkit::watched::WatchedStorage;

/// The thread of every file and directory sync.
type SyncThreads = Arc<Mutex<Vec<ThreadId>>>;

/// Durable stores on the recording storage, opened on the blocking pool, on a manual
/// clock. It keeps a handle to each: dropping the last handle of a durable `Db` closes
/// its journal, which syncs on the dropping thread, and that is not what is under test.
struct Recorded {
    storage: WatchedStorage,
    threads: SyncThreads,
    clock: ManualClock,
    stores: Mutex<Vec<Db>>,
}

impl suite::Harness for Recorded {
    type S = Db;

    async fn store_with(&self, shared: StoreOptions) -> Db {
        let n = self.stores.lock().unwrap().len();
        let window = shared.window();
        let options = shared
            .embedded(Options::new(format!("/db/{n}")))
            .storage(Arc::new(self.storage.clone()))
            .durability(Durability::Sync)
            .bucket_width(window / 10)
            .clock(self.clock.clone());
        // Opening syncs files too: not on the runtime thread either.
        let db = tokio::task::spawn_blocking(move || Db::open(options))
            .await
            .unwrap()
            .unwrap();
        self.stores.lock().unwrap().push(db.clone());
        db
    }

    async fn pass(&self, _store: &Db, window: Duration) {
        self.clock.forward(window + window / 5);
    }

    async fn approach(&self, _store: &Db, window: Duration) {
        self.clock.forward(window - Duration::from_millis(1));
    }
}

/// The whole conformance suite (insert_many, take_over, advance, release and the races
/// included) on a current-thread runtime: every fsync ran on another thread.
#[test]
fn a_durable_db_never_fsyncs_on_the_runtime_thread() {
    let threads = SyncThreads::default();
    let recorded = Arc::clone(&threads);
    let storage = WatchedStorage::new(MemStorage::new(), move || {
        recorded.lock().unwrap().push(std::thread::current().id());
    });
    let harness = Recorded {
        storage,
        threads,
        clock: ManualClock::new(SystemTime::now()),
        stores: Mutex::new(Vec::new()),
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    runtime.block_on(suite::run(&harness));
    let runtime_thread = std::thread::current().id();
    // Before the harness drops the stores.
    let threads = harness.threads.lock().unwrap().clone();
    assert_eq!(harness.stores.lock().unwrap().len(), 4);
    assert!(
        threads.len() > 40,
        "the writes were fsynced: {}",
        threads.len()
    );
    assert!(
        threads.iter().all(|&thread| thread != runtime_thread),
        "an fsync ran on the runtime thread"
    );
}
