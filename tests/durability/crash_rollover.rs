//! Kill -9 crash tests across segment roll-over, bucket expiry and `Db::open` itself.
//!
//! A writer child (this test binary re-run) writes with `Sync` durability into small
//! segments (4 KiB) while one thread moves its manual clock a bucket forward every few
//! writes, so segments roll over and expire while it runs; it is killed after a random
//! number of acknowledged writes. Between writer rounds, an opener child opens the store
//! through a storage layer that stops it right after recovery truncates a torn tail or
//! unlinks an expired segment, and is killed there. After every kill the parent reopens
//! the store and checks every acknowledged key and record that is still inside the
//! window. Rounds: 12, or `ONCEDB_CRASH_ROUNDS`.

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, UNIX_EPOCH};

use crate::support::{PausingStorage, Step, say, spawning_children};
use oncedb::io::{StdStorage, Storage};
use oncedb::{Db, Durability, ManualClock, Options, RecordStatus, Reservation, Scope};

const CHILD_ROLE: &str = "ONCEDB_ROLL_ROLE";
const CHILD_DIR: &str = "ONCEDB_ROLL_DIR";
const CHILD_START_BUCKET: &str = "ONCEDB_ROLL_START";
const CHILD_FIRST_KEY: &str = "ONCEDB_ROLL_FIRST_KEY";
const CHILD_PAUSE_AT: &str = "ONCEDB_ROLL_PAUSE_AT";
const THREADS: u64 = 3;
const BUCKET_MS: u64 = 1_000;
const SPAN: u64 = 8;
/// Thread 0 advances the clock one bucket every this many of its writes.
const WRITES_PER_BUCKET: u64 = 25;

fn options(dir: &Path, clock: &ManualClock, storage: Arc<dyn Storage>) -> Options {
    Options::new(dir)
        .durability(Durability::Sync)
        .window(Duration::from_millis(SPAN * BUCKET_MS))
        .bucket_width(Duration::from_millis(BUCKET_MS))
        .segment_max_bytes(4096)
        .clock(clock.clone())
        .storage(storage)
}

fn clock_at(bucket: u64) -> ManualClock {
    ManualClock::new(UNIX_EPOCH + Duration::from_millis(bucket * BUCKET_MS))
}

fn bucket_of(clock: &ManualClock) -> u64 {
    let ms = clock.now().duration_since(UNIX_EPOCH).unwrap().as_millis();
    u64::try_from(ms).unwrap() / BUCKET_MS
}

fn scope() -> Scope {
    Scope::new("crash", "roll")
}

fn env(name: &str) -> String {
    std::env::var(name).unwrap()
}

/// The child: a writer, or an opener that stops inside `Db::open`.
#[test]
#[ignore = "child process of the crash tests"]
fn crash_rollover_child() {
    let Ok(role) = std::env::var(CHILD_ROLE) else {
        return;
    };
    // End the test harness's "test ... " line, so every line after it is ours.
    say("\n");
    let dir = PathBuf::from(env(CHILD_DIR));
    let clock = clock_at(env(CHILD_START_BUCKET).parse().unwrap());
    if role == "open" {
        let storage = Arc::new(pausing_at(env(CHILD_PAUSE_AT)));
        let db = Db::open(options(&dir, &clock, storage)).unwrap();
        say("opened\n");
        drop(db);
        return;
    }
    let first: u64 = env(CHILD_FIRST_KEY).parse().unwrap();
    let storage: Arc<dyn Storage> = match std::env::var(CHILD_PAUSE_AT) {
        Ok(pause_at) => Arc::new(pausing_at(pause_at)),
        Err(_) => Arc::new(StdStorage),
    };
    let db = Arc::new(Db::open(options(&dir, &clock, storage)).unwrap());
    let threads: Vec<_> = (0..THREADS)
        .map(|thread| {
            let (db, clock) = (Arc::clone(&db), clock.clone());
            std::thread::spawn(move || {
                let start = first + thread * 1_000_000;
                for (i, n) in (start..start + 1_000_000).enumerate() {
                    if thread == 0 && i as u64 % WRITES_PER_BUCKET == WRITES_PER_BUCKET - 1 {
                        clock.forward(Duration::from_millis(BUCKET_MS));
                    }
                    write_one(&db, &clock, n);
                }
            })
        })
        .collect();
    for thread in threads {
        thread.join().unwrap();
    }
}

/// Writes key or record `n`, then prints it with the bucket the clock showed before.
fn write_one(db: &Db, clock: &ManualClock, n: u64) {
    let bucket = bucket_of(clock);
    let key = n.to_le_bytes();
    if n.is_multiple_of(5) {
        let Reservation::Acquired(lease) = db.reserve(&scope(), &key, &key).unwrap() else {
            panic!("fresh record {n} must be acquired");
        };
        lease.complete(&key).unwrap();
        say(&format!("record {n} {bucket}\n"));
    } else {
        assert!(db.insert_if_absent(&key).unwrap());
        say(&format!("key {n} {bucket}\n"));
    }
}

fn is_segment(path: &Path) -> bool {
    path.file_name()
        .is_some_and(|name| name.to_string_lossy().starts_with("seg-"))
}

/// The real file system, except that the chosen call on a segment (`seg-`) file
/// (`truncate`, `remove`, or `rename` of a prepared file into the log) is made and then
/// never returns: the child says so and waits to be killed. Calls on other files (the
/// manifest, prepared files being cleaned up) never pause.
fn pausing_at(pause_at: String) -> PausingStorage {
    PausingStorage::new(move |step| match step {
        Step::Truncated(path) => pause_at == "truncate" && is_segment(path),
        Step::Renamed(to) => pause_at == "rename" && is_segment(to),
        Step::Removed(path) => pause_at == "remove" && is_segment(path),
        _ => false,
    })
}

/// An acknowledged key (`record` false) or record, with the bucket before its call, and
/// whether a reopen has checked it yet.
#[derive(Debug, Clone, Copy)]
struct Ack {
    n: u64,
    record: bool,
    bucket: u64,
    checked: bool,
}

fn spawn(
    envs: &[(&str, String)],
) -> (
    std::process::Child,
    std::io::Lines<BufReader<std::process::ChildStdout>>,
) {
    let mut command = Command::new(std::env::current_exe().unwrap());
    command
        .args([
            "crash_rollover::crash_rollover_child",
            "--exact",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    for (name, value) in envs {
        command.env(name, value);
    }
    let mut child = command.spawn().unwrap();
    let lines = BufReader::new(child.stdout.take().unwrap()).lines();
    (child, lines)
}

/// Runs a writer until it has acknowledged `kill_after` writes, then kills it; with
/// `pause_at`, kills it instead where it pauses (a roll-over's rename into the log).
/// Returns the acknowledgements and whether it paused.
fn run_writer(
    dir: &Path,
    start_bucket: u64,
    first_key: u64,
    kill_after: usize,
    pause_at: Option<&str>,
) -> (Vec<Ack>, bool) {
    let mut envs = vec![
        (CHILD_ROLE, "write".to_owned()),
        (CHILD_DIR, dir.display().to_string()),
        (CHILD_START_BUCKET, start_bucket.to_string()),
        (CHILD_FIRST_KEY, first_key.to_string()),
    ];
    if let Some(pause_at) = pause_at {
        envs.push((CHILD_PAUSE_AT, pause_at.to_owned()));
    }
    let (mut child, lines) = spawn(&envs);
    let (mut acks, mut paused) = (Vec::new(), false);
    for line in lines.map_while(Result::ok) {
        if line == "paused" {
            paused = true;
            child.kill().unwrap();
            continue;
        }
        let parts: Vec<&str> = line.split(' ').collect();
        let [kind @ ("key" | "record"), n, bucket] = parts[..] else {
            continue;
        };
        acks.push(Ack {
            n: n.parse().unwrap(),
            record: kind == "record",
            bucket: bucket.parse().unwrap(),
            checked: false,
        });
        if acks.len() == kill_after && pause_at.is_none() {
            child.kill().unwrap();
        }
    }
    child.wait().unwrap();
    assert!(
        paused || acks.len() >= kill_after,
        "the writer stopped before it was killed"
    );
    (acks, paused)
}

/// Runs an opener that stops at `pause_at`; kills it there. Returns whether it paused
/// (it opens without pausing if recovery had nothing of that kind to do).
fn run_opener(dir: &Path, bucket: u64, pause_at: &str) -> bool {
    let (mut child, lines) = spawn(&[
        (CHILD_ROLE, "open".into()),
        (CHILD_DIR, dir.display().to_string()),
        (CHILD_START_BUCKET, bucket.to_string()),
        (CHILD_PAUSE_AT, pause_at.into()),
    ]);
    // A pause counts only inside `Db::open`: before the child says it opened.
    let (mut paused, mut opened) = (false, false);
    for line in lines.map_while(Result::ok) {
        match line.as_str() {
            "paused" if !opened => {
                paused = true;
                child.kill().unwrap();
            }
            "opened" => opened = true,
            _ => {}
        }
    }
    child.wait().unwrap();
    paused
}

/// The highest bucket any segment file of `dir` is named after.
fn newest_segment_bucket(dir: &Path) -> u64 {
    oncedb::verify(dir)
        .unwrap()
        .segments
        .iter()
        .map(|segment| segment.bucket)
        .max()
        .unwrap_or(0)
}

/// Reopens at `bucket` (or later, if segments are newer) and checks every
/// acknowledgement whose window has not ended by then. Returns the bucket it opened at
/// and how many acknowledgements it checked.
fn check(dir: &Path, bucket: u64, acks: &mut [Ack]) -> (u64, u64) {
    let now = bucket.max(newest_segment_bucket(dir));
    let clock = clock_at(now);
    let db = Db::open(options(dir, &clock, Arc::new(StdStorage)))
        .expect("reopen after SIGKILL must succeed");
    let mut checked = 0;
    for ack in acks.iter_mut().filter(|ack| now - ack.bucket <= SPAN) {
        let key = ack.n.to_le_bytes();
        if ack.record {
            let record = db.get(&scope(), &key).unwrap();
            let record = record.unwrap_or_else(|| panic!("acknowledged record {} lost", ack.n));
            assert_eq!(record.status(), RecordStatus::Completed);
            assert_eq!(record.response(), Some(&key[..]));
        } else {
            assert!(
                db.contains(&key).unwrap(),
                "acknowledged key {} lost",
                ack.n
            );
        }
        ack.checked = true;
        checked += 1;
    }
    (now, checked)
}

/// Appends bytes that look like the start of a frame torn by a crash.
fn tear_newest(dir: &Path) {
    let newest = oncedb::verify(dir)
        .unwrap()
        .segments
        .last()
        .unwrap()
        .path
        .clone();
    let mut file = std::fs::OpenOptions::new()
        .append(true)
        .open(newest)
        .unwrap();
    file.write_all(&[0x30, 0, 0, 0, 1, 0, 0xab]).unwrap();
}

#[test]
fn writes_survive_sigkill_across_roll_over_expiry_and_open() {
    let _children = spawning_children();
    let rounds: u64 = std::env::var("ONCEDB_CRASH_ROUNDS")
        .ok()
        .and_then(|r| r.parse().ok())
        .unwrap_or(12);
    let dir = tempfile::tempdir().unwrap();
    let mut bucket = 1_800_000_000;
    let mut acks: Vec<Ack> = Vec::new();
    let mut seed = 0x5eed_u64;
    let (mut paused_truncate, mut paused_remove, mut paused_rename, mut checked) = (0, 0, 0, 0);
    let mut most_segments = 0;
    for round in 0..rounds {
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let kill_after = 50 + (seed >> 33) as usize % 300;
        // Every third writer is killed inside a roll-over instead: right after it
        // renamed the prepared segment into the log, before the directory is synced.
        let pause_at = (round % 3 == 2).then_some("rename");
        let (written, paused) =
            run_writer(dir.path(), bucket, (round + 1) << 32, kill_after, pause_at);
        acks.extend(written);
        paused_rename += u64::from(paused);
        most_segments = most_segments.max(oncedb::verify(dir.path()).unwrap().segments.len());
        let (now, count) = check(dir.path(), bucket, &mut acks);
        (bucket, checked) = (now, checked + count);
        if round % 2 == 0 {
            tear_newest(dir.path());
            paused_truncate += u64::from(run_opener(dir.path(), bucket, "truncate"));
        } else {
            // Far enough ahead that the oldest segments expire at open.
            bucket += SPAN / 2;
            paused_remove += u64::from(run_opener(dir.path(), bucket, "remove"));
        }
        let (now, count) = check(dir.path(), bucket, &mut acks);
        (bucket, checked) = (now, checked + count);
    }
    eprintln!(
        "{} acknowledged, {checked} checks, up to {most_segments} segments, \
         {paused_truncate} opens killed cutting a tail, {paused_remove} deleting segments, \
         {paused_rename} writers killed inside a roll-over",
        acks.len()
    );
    let unchecked: Vec<u64> = acks
        .iter()
        .filter(|ack| !ack.checked)
        .map(|ack| ack.n)
        .collect();
    assert!(
        unchecked.is_empty(),
        "never checked after a kill: {unchecked:?}"
    );
    assert!(paused_rename > 0, "no writer was killed inside a roll-over");
    assert!(most_segments >= 4, "the writers must roll segments over");
    assert!(
        acks.first()
            .is_some_and(|first| bucket - first.bucket > SPAN),
        "the run must outlast the window, so segments expire while writers run"
    );
    assert!(
        paused_truncate > 0,
        "no open was killed while cutting a torn tail"
    );
    assert!(
        paused_remove > 0,
        "no open was killed while deleting expired segments"
    );
    let report = oncedb::verify(dir.path()).unwrap();
    assert!(report.is_clean(), "{report}");
}
