//! Real servers for the backend tests, started on free loopback ports in temp dirs and
//! stopped when dropped, so a failing test stops them too. `.ci/run` installs them from
//! Debian's packages when missing.

#![allow(dead_code)]
#![expect(clippy::unwrap_used, reason = "test code: a panic is the test failing")]
#![expect(clippy::expect_used, reason = "test code: a panic is the test failing")]

pub mod nats;
pub mod postgres;
pub mod proxy;
pub mod redis;
pub mod tls;

use std::net::TcpListener;
use std::process::Command;
use std::time::{Duration, Instant};

/// The path of example `name`, built by `cargo test` next to the test binaries'
/// directory.
pub fn example(name: &str) -> std::path::PathBuf {
    let exe = std::env::current_exe().unwrap();
    let deps = exe.parent().unwrap();
    deps.parent().unwrap().join("examples").join(name)
}

/// A free loopback port whose cluster bus port (+10000) is free too.
pub fn free_port() -> u16 {
    loop {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        if port < 55_000 && TcpListener::bind(("127.0.0.1", port + 10_000)).is_ok() {
            return port;
        }
    }
}

/// Polls `ready` until it holds, for at most thirty seconds: an external server's
/// start-up, which no signal announces.
pub fn wait_for(what: &str, mut ready: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !ready() {
        assert!(
            Instant::now() < deadline,
            "{what} did not happen within 30 s"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Sends `signal` (`KILL`, `QUIT`, ...) to `pids` with kill(1).
pub fn signal(signal: &str, pids: &[u32]) {
    if pids.is_empty() {
        return;
    }
    let _ = Command::new("kill")
        .arg(format!("-{signal}"))
        .args(pids.iter().map(u32::to_string))
        .status();
}

/// Whether process `pid` still exists (and is not a zombie).
pub fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|stat| {
            !stat
                .rsplit(')')
                .next()
                .unwrap_or("")
                .trim_start()
                .starts_with('Z')
        })
        .unwrap_or(false)
}

/// The children of `pid`, from /proc.
pub fn children(pid: u32) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(|entry| entry.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&child| {
            std::fs::read_to_string(format!("/proc/{child}/stat"))
                .ok()
                .and_then(|stat| {
                    let after = stat.rsplit(')').next()?.to_owned();
                    after.split_whitespace().nth(1)?.parse::<u32>().ok()
                })
                == Some(pid)
        })
        .collect()
}

/// A multi-threaded runtime for one test.
pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}
