//! The `Store` conformance suite (`suite`) on every implementation:
//! the embedded `Db` (in memory and durable with `Sync`), PostgreSQL, one Redis server
//! and a three-primary Redis Cluster. The servers are real, started by the tests on free
//! loopback ports and stopped when a test ends, passed or failed.

pub mod once;
pub mod suite;

#[cfg(any(feature = "redis", feature = "postgres"))]
use crate::support::servers;

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, SystemTime};

use oncedb::{Db, Durability, ManualClock, Options, StoreOptions};
use suite::Harness;

/// The embedded engine on a manual clock: passing a window is advancing the clock.
struct Embedded {
    clock: ManualClock,
    dir: Option<tempfile::TempDir>,
    stores: AtomicU32,
}

impl Harness for Embedded {
    type S = Db;

    async fn store_with(&self, shared: StoreOptions) -> Db {
        let window = shared.window();
        let options = match &self.dir {
            Some(dir) => {
                let n = self.stores.fetch_add(1, Ordering::Relaxed);
                Options::new(dir.path().join(n.to_string())).durability(Durability::Sync)
            }
            None => Options::in_memory(),
        };
        Db::open(
            shared
                .embedded(options)
                .bucket_width(window / 10)
                .clock(self.clock.clone()),
        )
        .unwrap()
    }

    async fn pass(&self, _store: &Db, window: Duration) {
        self.clock.forward(window + window / 5);
    }

    async fn approach(&self, _store: &Db, window: Duration) {
        self.clock.forward(window - Duration::from_millis(1));
    }
}

fn embedded(durable: bool) -> Embedded {
    Embedded {
        clock: ManualClock::new(SystemTime::now()),
        dir: durable.then(|| tempfile::tempdir().unwrap()),
        stores: AtomicU32::new(0),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embedded_in_memory() {
    suite::run(&embedded(false)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embedded_durable() {
    suite::run(&embedded(true)).await;
}

/// Waits out a window on a server's own clock.
#[cfg(any(feature = "redis", feature = "postgres"))]
async fn wait_out(window: Duration) {
    // Real time passing is what is under test here; no event marks it.
    tokio::time::sleep(window + Duration::from_millis(200)).await;
}

/// Waits most of a window on a server's own clock.
#[cfg(any(feature = "redis", feature = "postgres"))]
async fn wait_most_of(window: Duration) {
    // Real time passing is what is under test here; no event marks it.
    tokio::time::sleep(window * 3 / 4).await;
}

#[cfg(feature = "postgres")]
mod postgres {
    use std::time::Duration;

    use oncedb::{PostgresStore, StoreOptions};

    use super::servers::postgres::PgServer;
    use super::servers::tls::Certificates;
    use super::{Harness, suite, wait_most_of, wait_out};

    struct Postgres {
        server: PgServer,
        /// The authority to trust, for a server that speaks TLS only.
        tls: Option<Certificates>,
    }

    impl Harness for Postgres {
        type S = PostgresStore;

        async fn store_with(&self, options: StoreOptions) -> PostgresStore {
            let (url, options) = match &self.tls {
                Some(certificates) => (
                    format!("{} sslmode=require", self.server.url()),
                    options.tls_root_certificates(certificates.ca_pem.clone()),
                ),
                None => (self.server.url(), options),
            };
            let store = PostgresStore::connect_with(&url, options).unwrap();
            store.migrate().await.unwrap();
            store
        }

        async fn pass(&self, _store: &PostgresStore, window: Duration) {
            wait_out(window).await;
        }

        async fn approach(&self, _store: &PostgresStore, window: Duration) {
            wait_most_of(window).await;
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn postgres() {
        let harness = Postgres {
            server: PgServer::start(),
            tls: None,
        };
        suite::run(&harness).await;
    }

    /// The same answers over TLS, from a server that refuses plain connections.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn postgres_over_tls() {
        let certificates = Certificates::generate();
        let harness = Postgres {
            server: PgServer::start_tls(&certificates),
            tls: Some(certificates),
        };
        suite::run(&harness).await;
    }
}

#[cfg(feature = "redis")]
mod redis {
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::time::Duration;

    use oncedb::{RedisStore, StoreOptions};

    use super::servers::redis::{RedisServer, start_cluster};
    use super::servers::tls::Certificates;
    use super::{Harness, suite, wait_most_of, wait_out};

    /// One server, or the primaries of a cluster; each store gets its own key prefix.
    struct Redis {
        nodes: Vec<RedisServer>,
        cluster: bool,
        stores: AtomicU32,
        /// The authority to trust, for servers that speak TLS only.
        tls: Option<Certificates>,
    }

    impl Harness for Redis {
        type S = RedisStore;

        async fn store_with(&self, options: StoreOptions) -> RedisStore {
            let prefix = format!("c{}", self.stores.fetch_add(1, Ordering::Relaxed));
            let urls: Vec<String> = self.nodes.iter().map(RedisServer::url).collect();
            let options = match &self.tls {
                Some(certificates) => options.tls_root_certificates(certificates.ca_pem.clone()),
                None => options,
            };
            if self.cluster {
                let urls: Vec<&str> = urls.iter().map(String::as_str).collect();
                RedisStore::connect_cluster_with(&urls, &prefix, options)
                    .await
                    .unwrap()
            } else {
                RedisStore::connect_with(urls.first().unwrap(), &prefix, options)
                    .await
                    .unwrap()
            }
        }

        async fn pass(&self, _store: &RedisStore, window: Duration) {
            wait_out(window).await;
        }

        async fn approach(&self, _store: &RedisStore, window: Duration) {
            wait_most_of(window).await;
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn redis_single() {
        let harness = Redis {
            nodes: vec![RedisServer::start(false)],
            cluster: false,
            stores: AtomicU32::new(0),
            tls: None,
        };
        suite::run(&harness).await;
    }

    /// The same answers over TLS (`rediss://`), from a server without a plain port.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn redis_single_over_tls() {
        let certificates = Certificates::generate();
        let harness = Redis {
            nodes: vec![RedisServer::start_tls(&certificates)],
            cluster: false,
            stores: AtomicU32::new(0),
            tls: Some(certificates),
        };
        suite::run(&harness).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn redis_cluster() {
        let harness = Redis {
            nodes: start_cluster(),
            cluster: true,
            stores: AtomicU32::new(0),
            tls: None,
        };
        suite::run(&harness).await;
    }
}

/// The property test of "once" (`once.rs`) on the embedded store with the system clock,
/// in memory and durable: leases time out for real, so renewal outages longer than the
/// timeout let another caller take a record over. The seed is printed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn once_holds_on_a_real_clock() {
    let dir = tempfile::tempdir().unwrap();
    for durable in [false, true] {
        let options = match durable {
            true => Options::new(dir.path()).durability(Durability::Sync),
            false => Options::in_memory(),
        };
        let store = Db::open(
            StoreOptions::new(Duration::from_secs(60))
                .lease_timeout(Duration::from_millis(200))
                .embedded(options)
                .bucket_width(Duration::from_secs(6)),
        )
        .unwrap();
        suite::check_once(store, "real-clock", 12).await;
    }
}
