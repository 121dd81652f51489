//! The cost of a reserve and a complete on Redis through `Store`, next to the embedded
//! store on the same runtime (feature `redis`; needs `redis-server` on the PATH, started
//! here on a free loopback port and stopped at the end).
//!
//! `cargo bench --bench redis --features redis`.

#![expect(clippy::unwrap_used, reason = "benchmark: a failure aborts the run")]
#![expect(clippy::expect_used, reason = "benchmark: a failure aborts the run")]

use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use criterion::{Criterion, criterion_group, criterion_main};
use oncedb::{Db, Options, RedisStore, Reservation, Scope, Store, StoreLease};

struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn start_redis() -> (Server, u16) {
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let child = Command::new("redis-server")
        .args([
            "--port",
            &port.to_string(),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("redis-server on the PATH");
    let server = Server(child);
    let deadline = Instant::now() + Duration::from_secs(10);
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "redis-server did not start");
        std::thread::sleep(Duration::from_millis(20));
    }
    (server, port)
}

async fn reserve_complete<S: Store>(store: &S, scope: &Scope, key: u64) {
    let Reservation::Acquired(lease) = store
        .reserve(scope, &key.to_le_bytes(), b"req")
        .await
        .unwrap()
    else {
        panic!("fresh key");
    };
    lease.complete(b"response").await.unwrap();
}

fn redis(c: &mut Criterion) {
    let (_server, port) = start_redis();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let store = runtime
        .block_on(RedisStore::connect(
            &format!("redis://127.0.0.1:{port}/"),
            "bench",
            Duration::from_secs(3600),
        ))
        .unwrap();
    let memory = Db::open(Options::in_memory()).unwrap();
    let scope = Scope::new("org", "op");
    let next = AtomicU64::new(0);
    let mut group = c.benchmark_group("store_reserve_complete");
    group.sample_size(20);
    group.bench_function("redis", |b| {
        b.to_async(&runtime)
            .iter(|| reserve_complete(&store, &scope, next.fetch_add(1, Ordering::Relaxed)));
    });
    group.bench_function("redis_insert_if_absent", |b| {
        b.to_async(&runtime).iter(|| async {
            let key = next.fetch_add(1, Ordering::Relaxed).to_le_bytes();
            store.insert_if_absent(&key).await.unwrap();
        });
    });
    group.bench_function("memory_same_runtime", |b| {
        b.to_async(&runtime)
            .iter(|| reserve_complete(&memory, &scope, next.fetch_add(1, Ordering::Relaxed)));
    });
    group.finish();
}

criterion_group!(benches, redis);
criterion_main!(benches);
