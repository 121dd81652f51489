//! Replays the checked-in fuzz corpus (`fuzz/seeds/<target>/`) through the fuzz harnesses,
//! so that every seed and every fixed crash reproducer runs under `cargo test`. The
//! harnesses live in `tests/fuzzing/` and are shared with the cargo-fuzz targets in `fuzz/`.

#[path = "../fuzzing/reservation_races.rs"]
mod reservation_races;
#[path = "../fuzzing/run_decode.rs"]
mod run_decode;
#[path = "../fuzzing/segment_decode.rs"]
mod segment_decode;

use std::fs;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::{Path, PathBuf};

fn seeds() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("fuzz")
        .join("seeds")
}

fn seed_dir(target: &str) -> PathBuf {
    seeds().join(target)
}

/// Runs every file of `dir`, naming the files that fail.
fn replay_dir(dir: &Path, run: fn(&[u8])) -> usize {
    let mut paths: Vec<PathBuf> = fs::read_dir(dir)
        .unwrap_or_else(|err| panic!("{}: {err}", dir.display()))
        .map(|entry| entry.unwrap().path())
        .filter(|path| path.is_file())
        .collect();
    paths.sort();
    let mut failed = Vec::new();
    for path in &paths {
        let data = fs::read(path).unwrap();
        if catch_unwind(AssertUnwindSafe(|| run(&data))).is_err() {
            failed.push(path.display().to_string());
        }
    }
    assert!(failed.is_empty(), "failing inputs: {failed:#?}");
    paths.len()
}

/// Runs every file of `fuzz/seeds/<target>/`.
fn replay(target: &str, run: fn(&[u8])) {
    let dir = seed_dir(target);
    let count = replay_dir(&dir, run);
    assert!(count >= 10, "{} holds only {count} inputs", dir.display());
}

#[test]
fn segment_decode_corpus() {
    replay("segment_decode", segment_decode::run);
}

#[test]
fn run_decode_corpus() {
    replay("run_decode", run_decode::run);
}

/// Random damage to a sealed run, beyond the seeds: never a panic.
#[test]
fn run_decode_random_inputs() {
    let mut random = oncedb::io::SplitMix64::new(0x5eed);
    for _ in 0..400 {
        let len = (random.next_u64() % 64) as usize;
        let data: Vec<u8> = (0..len).map(|_| random.next_u64() as u8).collect();
        let outcome = catch_unwind(AssertUnwindSafe(|| run_decode::run(&data)));
        assert!(outcome.is_ok(), "input {data:?}");
    }
}

#[test]
fn reservation_races_corpus() {
    replay("reservation_races", reservation_races::run);
}

/// Rewrites the generated seeds (not the reproducers or corpus finds kept beside them).
/// Run by hand after changing a harness's input encoding:
/// `cargo test --test durability -- --ignored fuzz_corpus::write_seeds`.
#[test]
#[ignore = "writes fuzz/seeds/; run by hand after changing a harness"]
fn write_seeds() {
    for (target, seeds) in [
        ("segment_decode", segment_decode::seeds()),
        ("reservation_races", reservation_races::seeds()),
        ("run_decode", run_decode::seeds()),
    ] {
        let dir = seed_dir(target);
        fs::create_dir_all(&dir).unwrap();
        for (name, data) in seeds {
            fs::write(dir.join(format!("seed-{name}")), data).unwrap();
        }
    }
}
