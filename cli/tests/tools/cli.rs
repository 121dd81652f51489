//! `oncedb dedup`, `oncedb inspect` and `oncedb verify` as processes on real
//! directories. `verify` exits 0 when clean, 1 with the first damaged file and byte when
//! damaged, 2 on a directory that cannot be checked.

use std::path::Path;

use crate::support::{oncedb, serial};
use oncedb::{Db, Options, Reservation, Scope};

fn dedup(dir: &Path, extra: &[&str], stdin: &str) -> (i32, String, String) {
    let mut args = vec!["dedup", "--dir", dir.to_str().unwrap(), "--window", "24h"];
    args.extend_from_slice(extra);
    let out = oncedb(&args, stdin.as_bytes());
    (
        out.status.code().unwrap(),
        String::from_utf8(out.stdout).unwrap(),
        String::from_utf8(out.stderr).unwrap(),
    )
}

#[test]
fn lines_are_deduplicated_in_order_and_remembered_across_runs() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("store");
    // An empty line is a key like any other, as in `awk '!seen[$0]++'`: the first one
    // passes, the second is a duplicate.
    let (code, out, err) = dedup(&store, &[], "a\nb\na\nc\nb\n\nlast\n\n");
    assert_eq!(code, 0, "{err}");
    assert_eq!(out, "a\nb\nc\n\nlast\n");
    assert!(
        err.contains("8 lines, 5 emitted, 3 duplicates, 0 without a key"),
        "{err}"
    );
    // Every durability mode remembers what it admitted: each run admits a key of its
    // own, and the next run (in the next mode) must call it a duplicate.
    let mut previous = "a".to_owned();
    for durability in ["sync", "buffered", "interval:5", "sync"] {
        let new = format!("new-in-{durability}-after-{previous}");
        let input = format!("{previous}\n{new}\n");
        let (code, out, err) = dedup(&store, &["--durability", durability], &input);
        assert_eq!(code, 0, "{err}");
        assert_eq!(out, format!("{new}\n"), "{durability} forgot {previous}");
        previous = new;
    }
}

#[test]
fn keys_come_from_json_fields_and_regexes() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("json");
    let input = concat!(
        "{\"event\":{\"id\":\"e1\"},\"n\":1}\n",
        "{\"event\":{\"id\":\"e1\"},\"n\":2}\n",
        "not json at all\n",
        "{\"event\":{}}\n",
        "{\"event\":{\"id\":7}}\n",
    );
    let (code, out, err) = dedup(&store, &["--key", "json:event.id"], input);
    assert_eq!(code, 0, "{err}");
    assert_eq!(
        out,
        concat!(
            "{\"event\":{\"id\":\"e1\"},\"n\":1}\n",
            "not json at all\n",
            "{\"event\":{}}\n",
            "{\"event\":{\"id\":7}}\n",
        )
    );
    assert!(err.contains("2 without a key"), "{err}");
    let (_, out, _) = dedup(
        &store,
        &["--key", "json:event.id", "--drop-keyless"],
        "{\"event\":{\"id\":7}}\ngarbage\n{\"event\":{\"id\":8}}\n",
    );
    assert_eq!(out, "{\"event\":{\"id\":8}}\n");

    let store = dir.path().join("regex");
    let (code, out, err) = dedup(
        &store,
        &["--key", "regex:order=(\\d+)"],
        "x order=1 a\ny order=1 b\nno order\nz order=2\n",
    );
    assert_eq!(code, 0, "{err}");
    assert_eq!(out, "x order=1 a\nno order\nz order=2\n");
}

#[test]
fn large_inputs_are_batched_and_complete() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("big");
    let input: String = (0..50_000)
        .map(|i| format!("id-{}\n", i % 30_000))
        .collect();
    let (code, out, err) = dedup(&store, &["--batch", "1000"], &input);
    assert_eq!(code, 0, "{err}");
    assert_eq!(out.lines().count(), 30_000);
    assert!(
        out.lines()
            .enumerate()
            .all(|(i, line)| line == format!("id-{i}"))
    );
}

#[test]
fn bad_arguments_and_unusable_directories_give_one_line() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("s");
    for (args, needle) in [
        (vec!["--window", "5x"], "not a unit"),
        (vec!["--window", "0s"], "zero"),
        (vec!["--window", "24h", "--bucket", "7m"], "whole multiple"),
        (vec!["--window", "24h", "--key", "column:2"], "not a key"),
        (
            vec!["--window", "24h", "--durability", "often"],
            "interval:MS",
        ),
    ] {
        let mut all = vec!["dedup", "--dir", store.to_str().unwrap()];
        all.extend(args.iter().copied());
        let out = oncedb(&all, b"");
        let err = String::from_utf8(out.stderr).unwrap();
        assert_ne!(out.status.code(), Some(0), "{args:?}");
        assert_eq!(err.trim_end().lines().count(), 1, "{args:?}: {err}");
        assert!(err.contains(needle), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{err}");
    }
    // A locked store.
    let db = Db::open(Options::new(&store)).unwrap();
    let (code, _, err) = dedup(&store, &[], "a\n");
    assert_ne!(code, 0);
    assert!(err.contains("locked"), "{err}");
    drop(db);
    // Another window than the store was created with.
    let out = oncedb(
        &["dedup", "--dir", store.to_str().unwrap(), "--window", "1h"],
        b"",
    );
    let err = String::from_utf8(out.stderr).unwrap();
    assert_ne!(out.status.code(), Some(0));
    assert!(err.contains("was created with window"), "{err}");
    let unreadable = oncedb(&["inspect", "--dir", "/nonexistent/oncedb"], b"");
    assert_ne!(unreadable.status.code(), Some(0));
    let err = String::from_utf8(unreadable.stderr).unwrap();
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");
}

#[test]
fn inspect_shows_buckets_records_in_flight_and_settings() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("s");
    {
        let db = Db::open(
            Options::new(&store)
                .window(std::time::Duration::from_secs(3600))
                .bucket_width(std::time::Duration::from_secs(60)),
        )
        .unwrap();
        db.insert_many(&[b"k1", b"k2", b"k3"]).unwrap();
        let scope = Scope::new("org_123", "create_payment");
        let Reservation::Acquired(lease) = db.reserve(&scope, b"pay-1", b"req").unwrap() else {
            panic!("acquire");
        };
        lease.note(b"provider_outcome_unknown").unwrap();
        // The worker dies: the record stays in flight.
    }
    let out = oncedb(
        &["inspect", "--dir", store.to_str().unwrap(), "--json"],
        b"",
    );
    assert_eq!(out.status.code(), Some(0));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["window_ms"], 3_600_000);
    assert_eq!(report["bucket_ms"], 60_000);
    assert_eq!(report["live_keys"], 3);
    assert_eq!(report["buckets"][0]["keys"], 3);
    assert_eq!(report["buckets"][0]["records"], 1);
    let record = &report["in_flight"][0];
    assert_eq!(record["tenant"], "org_123");
    assert_eq!(record["key"], "pay-1");
    assert_eq!(record["note"], "provider_outcome_unknown");
    let text = oncedb(&["inspect", "--dir", store.to_str().unwrap()], b"");
    let text = String::from_utf8(text.stdout).unwrap();
    assert!(text.contains("records in flight: 1"), "{text}");
    assert!(text.contains("provider_outcome_unknown"), "{text}");
}

// `oncedb verify`.

fn verify(dir: &Path) -> (i32, String, String) {
    let out = oncedb(&["verify", "--dir", dir.to_str().unwrap()], b"");
    (
        out.status.code().unwrap(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn store(dir: &Path) {
    let db = Db::open(Options::new(dir)).unwrap();
    for i in 0..100u32 {
        db.insert_if_absent(&i.to_le_bytes()).unwrap();
    }
}

/// Every file of `dir`, name and bytes: what `verify` must leave as it found it.
fn snapshot(dir: &Path) -> Vec<(std::path::PathBuf, Vec<u8>)> {
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .map(|p| {
            let bytes = std::fs::read(&p).unwrap();
            (p, bytes)
        })
        .collect();
    files.sort();
    files
}

/// `verify`, checking that it changed no file of `dir`.
fn verify_unchanged(dir: &Path) -> (i32, String, String) {
    let before = snapshot(dir);
    let answer = verify(dir);
    assert_eq!(snapshot(dir), before, "verify changed the directory");
    answer
}

#[test]
fn clean_damaged_and_unreadable() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    store(dir.path());
    // A prepared segment left by the segment worker is part of a store, not a stray.
    let prepared = dir.path().join("prep-00000000000099999999-0000000000.log");
    std::fs::write(&prepared, b"a prepared header").unwrap();
    let (code, out, _) = verify_unchanged(dir.path());
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("clean"), "{out}");
    assert!(!out.contains("not an oncedb file"), "{out}");

    // The segment holding the keys (a clean close also leaves an empty newest one).
    let segment = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("seg-"))
        })
        .max_by_key(|p| std::fs::metadata(p).unwrap().len())
        .unwrap();
    let before = std::fs::read(&segment).unwrap();
    // A flipped byte inside the first key frame (after the 48-byte header and the 28-byte
    // mark that opens the commit group, so at byte 76): reported at that frame's first
    // byte.
    let mut bytes = before.clone();
    bytes[48 + 30] ^= 1;
    std::fs::write(&segment, &bytes).unwrap();
    let (code, out, _) = verify_unchanged(dir.path());
    assert_eq!(code, 1, "{out}");
    let last = out.lines().last().unwrap();
    assert!(last.starts_with("DAMAGED"), "{out}");
    assert!(last.contains(&segment.display().to_string()), "{out}");
    assert!(last.contains(" at byte 76:"), "{out}");

    // A torn tail on the newest segment (bytes a crash left unfinished) is reported with
    // its offset, and is no damage: open cuts it.
    std::fs::write(&segment, &before).unwrap();
    let newest = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("seg-"))
        })
        .max()
        .unwrap();
    let clean_len = std::fs::metadata(&newest).unwrap().len();
    let mut torn = std::fs::read(&newest).unwrap();
    torn.extend_from_slice(&[0xAB; 13]);
    std::fs::write(&newest, &torn).unwrap();
    let (code, out, _) = verify_unchanged(dir.path());
    assert_eq!(code, 0, "{out}");
    assert!(
        out.contains(&format!("torn tail at byte {clean_len}")),
        "{out}"
    );

    let (code, _, err) = verify(&dir.path().join("missing"));
    assert_eq!(code, 2);
    assert!(err.contains("oncedb verify"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn a_store_in_use_is_refused() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let db = Db::open(Options::new(dir.path())).unwrap();
    db.insert_if_absent(b"k").unwrap();
    let (code, _, err) = verify(dir.path());
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("locked"), "{err}");
}

/// `oncedb bench` checks its own answers: each workload admits exactly the distinct keys
/// of its stream (generated as it goes), and says so; windows and buckets take durations
/// or bare seconds, and a bad one is one error line.
#[test]
fn bench_checks_that_it_admitted_exactly_the_distinct_keys() {
    let _serial = serial();
    for workload in ["ids", "records"] {
        let out = oncedb(
            &[
                "bench",
                "--keys",
                "20000",
                "--threads",
                "2",
                "--batch",
                "64",
                "--workload",
                workload,
                "--window",
                "24h",
                "--bucket",
                "900",
                "--response-bytes",
                "1000",
            ],
            b"",
        );
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{workload}: {stderr}");
        let line = stderr
            .lines()
            .find(|line| line.contains("distinct keys"))
            .unwrap_or_else(|| panic!("{workload}: no admission line in {stderr}"));
        assert!(line.ends_with(": exact"), "{line}");
        let words: Vec<&str> = line.split_whitespace().collect();
        let (admitted, distinct) = (words[1], words[3]);
        assert_eq!(admitted, distinct, "{line}");
        let distinct: u64 = distinct.parse().unwrap();
        assert!((15_000..17_000).contains(&distinct), "20% repeats: {line}");
        assert!(String::from_utf8_lossy(&out.stdout).contains("peak MiB"));
        if workload == "records" {
            // Every repeat was answered: a replay checked byte for byte, or (1% of the
            // operations, sent with another request) a mismatch.
            let retries = stderr
                .lines()
                .find(|line| line.contains("retries:"))
                .unwrap_or_else(|| panic!("no retries line in {stderr}"));
            assert!(retries.ends_with(": exact"), "{retries}");
            let words: Vec<&str> = retries.split_whitespace().collect();
            let (replayed, mismatched): (u64, u64) =
                (words[1].parse().unwrap(), words[6].parse().unwrap());
            assert_eq!(replayed + mismatched, 20_000 - distinct, "{retries}");
            assert!((100..300).contains(&mismatched), "1% mismatches: {retries}");
        }
    }
    let bad = oncedb(&["bench", "--keys", "10", "--window", "5x"], b"");
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("5x"));
}

/// `--memory-budget` takes sizes with units; a durable run under a small budget seals
/// keys into runs and still admits exactly the distinct keys; a bad size is one error.
#[test]
fn bench_under_a_memory_budget_seals_and_stays_exact() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let out = oncedb(
        &[
            "bench",
            "--keys",
            "200000",
            "--durability",
            "buffered",
            "--memory-budget",
            "256KiB",
            "--dir",
            dir.path().to_str().unwrap(),
        ],
        b"",
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("distinct keys: exact"), "{stderr}");
    let sealed = stderr
        .lines()
        .find(|line| line.contains("sealed:"))
        .unwrap_or_else(|| panic!("no seal in {stderr}"));
    assert!(!sealed.contains(" 0 runs written"), "{sealed}");
    for bad in ["12XB", "GiB", "99999999999999GiB"] {
        let out = oncedb(&["bench", "--keys", "10", "--memory-budget", bad], b"");
        assert!(!out.status.success(), "{bad}");
        assert!(String::from_utf8_lossy(&out.stderr).contains(bad), "{bad}");
    }
}

/// An archive of expired segments (`Options::archive_dir`) reads with `verify` and
/// `inspect` as a store does, without being opened (which would expire it).
#[test]
fn verify_and_inspect_read_an_archive() {
    let _serial = serial();
    let (dir, archive) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let clock = oncedb::ManualClock::new(std::time::SystemTime::now());
    let window = std::time::Duration::from_secs(60);
    let db = Db::open(
        Options::new(dir.path())
            .archive_dir(archive.path())
            .window(window)
            .bucket_width(window / 4)
            .clock(clock.clone()),
    )
    .unwrap();
    db.insert_many(&[b"a", b"b", b"c"]).unwrap();
    clock.forward(window * 2);
    db.insert_if_absent(b"later").unwrap();
    db.flush().unwrap();
    drop(db);
    let archive = archive.path().to_str().unwrap();
    let verified = oncedb(&["verify", "--dir", archive], b"");
    assert!(
        verified.status.success(),
        "{}",
        String::from_utf8_lossy(&verified.stdout)
    );
    let inspected = oncedb(&["inspect", "--dir", archive, "--json"], b"");
    assert!(
        inspected.status.success(),
        "{}",
        String::from_utf8_lossy(&inspected.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&inspected.stdout).unwrap();
    assert_eq!(report["clean"], true);
    let keys: u64 = report["segments"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["keys"].as_u64().unwrap())
        .sum();
    assert_eq!(keys, 3, "{report:#}");
    assert!(oncedb::is_archive(archive).unwrap());
    assert!(!oncedb::is_archive(dir.path()).unwrap());
}

/// `oncedb checkpoint` copies a store into a new directory: `dedup` on the copy remembers
/// every line the store admitted, and the store goes on by itself; a directory that
/// holds files is refused with one line and exit 1.
#[test]
fn a_checkpoint_remembers_every_line_the_store_admitted() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("store");
    let copy = dir.path().join("copy");
    let (code, _, err) = dedup(&store, &[], "a\nb\nc\n");
    assert_eq!(code, 0, "{err}");
    let out = oncedb(
        &[
            "checkpoint",
            "--dir",
            store.to_str().unwrap(),
            "--to",
            copy.to_str().unwrap(),
        ],
        b"",
    );
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert_eq!(out.status.code(), Some(0), "{stdout}");
    assert!(stdout.starts_with("checkpoint "), "{stdout}");
    let (code, out, err) = dedup(&copy, &[], "a\nb\nc\nd\n");
    assert_eq!(code, 0, "{err}");
    assert_eq!(out, "d\n", "the copy forgot a line");
    // The copy and the store are two stores now.
    let (code, out, _) = dedup(&store, &[], "d\n");
    assert_eq!((code, out.as_str()), (0, "d\n"));
    let again = oncedb(
        &[
            "checkpoint",
            "--dir",
            store.to_str().unwrap(),
            "--to",
            copy.to_str().unwrap(),
        ],
        b"",
    );
    let stderr = String::from_utf8(again.stderr).unwrap();
    assert_eq!(again.status.code(), Some(1), "{stderr}");
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(stderr.contains("not empty"), "{stderr}");
}

/// `--replicate URL --replica NAME --replica-copies 1`: a replica on one test server,
/// which keeps one copy.
fn replica_flags<'a>(url: &'a str, name: &'a str) -> [&'a str; 6] {
    [
        "--replicate",
        url,
        "--replica",
        name,
        "--replica-copies",
        "1",
    ]
}

/// `oncedb restore --from URL --replica NAME --dir DIR`.
fn restore(url: &str, replica: &str, dir: &Path) -> std::process::Output {
    let args = [
        "restore",
        "--from",
        url,
        "--replica",
        replica,
        "--replica-copies",
        "1",
        "--dir",
    ];
    let mut args: Vec<&str> = args.to_vec();
    args.push(dir.to_str().unwrap());
    oncedb(&args, b"")
}

/// `oncedb standby --promote` follows a replica until its input ends, then takes it over:
/// `dedup` on the promoted directory remembers every line the old store took.
#[test]
fn a_standby_promoted_remembers_every_line() {
    let _serial = serial();
    let server = oncedb_testkit::servers::nats::NatsServer::start();
    let url = server.url();
    let dir = tempfile::tempdir().unwrap();
    let replicated = replica_flags(&url, "warm");
    let (code, out, err) = dedup(&dir.path().join("store"), &replicated, "a\nb\na\n");
    assert_eq!(code, 0, "{err}");
    assert_eq!(out, "a\nb\n");
    let standby = dir.path().join("standby");
    let args = [
        "standby",
        "--from",
        url.as_str(),
        "--replica",
        "warm",
        "--replica-copies",
        "1",
        "--promote",
        "--dir",
    ];
    let mut args: Vec<&str> = args.to_vec();
    args.push(standby.to_str().unwrap());
    // Standard input empty: it ends at once, and the standby promotes.
    let out = oncedb(&args, b"");
    let stdout = String::from_utf8(out.stdout).unwrap();
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert_eq!(out.status.code(), Some(0), "{stdout}{stderr}");
    assert!(stdout.starts_with("promoted "), "{stdout}");
    let (code, out, err) = dedup(&standby, &replicated, "a\nb\nc\n");
    assert_eq!(code, 0, "{err}");
    assert_eq!(out, "c\n", "the promoted standby forgot a line");
}

/// `oncedb dedup --replicate` through a JetStream stall (the server paused with SIGSTOP
/// mid-run): the batches JetStream did not acknowledge are asked again once it is back,
/// so every line passes exactly once, and a second run over the same lines passes none.
#[test]
fn dedup_passes_every_line_once_through_a_replica_stall() {
    use std::io::{BufRead, Write};
    let _serial = serial();
    let server = oncedb_testkit::servers::nats::NatsServer::start();
    let url = server.url();
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("store");
    let replicated = [&replica_flags(&url, "stall")[..], &["--batch", "4"]].concat();
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_oncedb"))
        .args(["dedup", "--dir", store.to_str().unwrap(), "--window", "24h"])
        .args(&replicated)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    let mut stdout = std::io::BufReader::new(child.stdout.take().unwrap()).lines();
    let mut stderr = std::io::BufReader::new(child.stderr.take().unwrap()).lines();
    let lines: Vec<String> = (0..40).map(|n| format!("line-{n}")).collect();
    let mut seen = Vec::new();
    for line in &lines[..20] {
        writeln!(stdin, "{line}").unwrap();
        stdin.flush().unwrap();
        seen.push(stdout.next().unwrap().unwrap());
    }
    server.pause();
    for line in &lines[20..] {
        writeln!(stdin, "{line}").unwrap();
    }
    stdin.flush().unwrap();
    // The run says once that it asks again; then JetStream comes back.
    let note = stderr.next().unwrap().unwrap();
    assert!(note.contains("asking again until it answers"), "{note}");
    server.resume();
    drop(stdin);
    seen.extend(stdout.map(Result::unwrap));
    assert!(child.wait().unwrap().success());
    assert_eq!(seen, lines, "a line lost or passed twice through the stall");
    let (code, out, err) = dedup(&store, &replicated, &(lines.join("\n") + "\n"));
    assert_eq!(code, 0, "{err}");
    assert_eq!(out, "", "a line passed again after the stall");
}

/// `oncedb dedup --replicate` keeps three copies of its replica by default: on a single
/// server, which cannot keep them, it exits 1 with one line that names the flag to
/// change, having passed no line; a stream made with other copies is refused by name.
#[test]
fn dedup_on_a_server_too_small_for_its_copies_names_the_flag() {
    let _serial = serial();
    let server = oncedb_testkit::servers::nats::NatsServer::start();
    let url = server.url();
    let dir = tempfile::tempdir().unwrap();
    let replicated = ["--replicate", url.as_str(), "--replica", "three"];
    let (code, out, err) = dedup(&dir.path().join("store"), &replicated, "a\nb\n");
    assert_eq!(code, 1, "{out}{err}");
    assert_eq!(out, "");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.contains("--replica-copies"), "{err}");
    assert!(err.contains("3 copies"), "{err}");
    // One copy made the stream; asking for two later is refused, naming both.
    let one = [&replicated[..], &["--replica-copies", "1"]].concat();
    let (code, _, err) = dedup(&dir.path().join("one"), &one, "a\n");
    assert_eq!(code, 0, "{err}");
    let two = [&replicated[..], &["--replica-copies", "2"]].concat();
    let (code, _, err) = dedup(&dir.path().join("two"), &two, "a\n");
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("keeps 1 copies where this store asks for 2"),
        "{err}"
    );
}

/// `oncedb dedup --replicate URL --replica NAME` survives the loss of its directory:
/// `oncedb restore` rebuilds it from JetStream, and `dedup` on the restored directory
/// remembers every line; the lost store's replica now belongs to the restored one.
#[test]
fn dedup_with_a_replica_survives_the_loss_of_its_directory() {
    let _serial = serial();
    let server = oncedb_testkit::servers::nats::NatsServer::start();
    let url = server.url();
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("store");
    let replicated = replica_flags(&url, "lines");
    let (code, out, err) = dedup(&store, &replicated, "a\nb\na\nc\n");
    assert_eq!(code, 0, "{err}");
    assert_eq!(out, "a\nb\nc\n");
    std::fs::remove_dir_all(&store).unwrap();
    let restored = dir.path().join("restored");
    let out = restore(&url, "lines", &restored);
    let stdout = String::from_utf8(out.stdout).unwrap();
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert_eq!(out.status.code(), Some(0), "{stdout}{stderr}");
    assert!(stdout.starts_with("restored "), "{stdout}");
    let (code, out, err) = dedup(&restored, &replicated, "a\nb\nc\nd\n");
    assert_eq!(code, 0, "{err}");
    assert_eq!(out, "d\n", "the restored store forgot a line");
    // A replica of another name does not exist: one line, exit 1.
    let missing = restore(&url, "nothing", &dir.path().join("none"));
    let stderr = String::from_utf8(missing.stderr).unwrap();
    assert_eq!(missing.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("no replica named nothing"), "{stderr}");
}
