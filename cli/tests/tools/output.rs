//! No subcommand panics on its output: a closed stdout (`oncedb verify | head -1`) is a
//! normal end, any other write failure is one error line and a non-zero exit.

use std::io::Write;
use std::process::{Command, Stdio};

use crate::support::{oncedb, serial};

/// Every subcommand, on a store made by the first: (name, arguments, stdin).
fn every_subcommand(dir: &str) -> Vec<(&'static str, Vec<String>, Vec<u8>)> {
    let lines: Vec<u8> = (0..20_000)
        .flat_map(|i| format!("line {i}\n").into_bytes())
        .collect();
    let args = |list: &[&str]| list.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
    vec![
        (
            "dedup",
            args(&["dedup", "--dir", dir, "--window", "1h"]),
            lines,
        ),
        ("inspect", args(&["inspect", "--dir", dir]), Vec::new()),
        ("verify", args(&["verify", "--dir", dir]), Vec::new()),
        (
            "bench",
            args(&[
                "bench",
                "--keys",
                "2000",
                "--threads",
                "1",
                "--batch",
                "100",
            ]),
            Vec::new(),
        ),
        ("help", args(&["--help"]), Vec::new()),
    ]
}

/// Runs `oncedb` with its stdout the write end of a pipe whose read end is already
/// closed, so its first write fails with `EPIPE`.
fn into_closed_pipe(args: &[String], stdin: &[u8]) -> (Option<i32>, String) {
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    let mut child = Command::new(env!("CARGO_BIN_EXE_oncedb"))
        .args(args)
        .stdin(Stdio::piped())
        .stdout(writer)
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut input = child.stdin.take().unwrap();
    let stdin = stdin.to_vec();
    let feeder = std::thread::spawn(move || {
        let _ = input.write_all(&stdin);
    });
    let output = child.wait_with_output().unwrap();
    feeder.join().unwrap();
    (
        output.status.code(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

#[test]
fn a_closed_stdout_ends_every_subcommand_as_a_success() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("store");
    let store = store.to_str().unwrap();
    // The store exists before inspect and verify look at it.
    assert!(
        oncedb(&["dedup", "--dir", store, "--window", "1h"], b"x\n")
            .status
            .success()
    );
    for (name, args, stdin) in every_subcommand(store) {
        let (code, stderr) = into_closed_pipe(&args, &stdin);
        assert!(!stderr.contains("panicked"), "{name} panicked: {stderr}");
        assert_eq!(code, Some(0), "{name}: {stderr}");
    }
}

#[test]
fn another_write_failure_is_one_error_line_and_a_failure() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("store");
    let store = store.to_str().unwrap();
    assert!(
        oncedb(&["dedup", "--dir", store, "--window", "1h"], b"x\n")
            .status
            .success()
    );
    for (name, args, stdin) in every_subcommand(store) {
        if name == "help" {
            continue; // clap prints help itself
        }
        let full = std::fs::OpenOptions::new()
            .write(true)
            .open("/dev/full")
            .unwrap();
        let mut child = Command::new(env!("CARGO_BIN_EXE_oncedb"))
            .args(&args)
            .stdin(Stdio::piped())
            .stdout(full)
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut input = child.stdin.take().unwrap();
        let feeder = std::thread::spawn(move || {
            let _ = input.write_all(&stdin);
        });
        let output = child.wait_with_output().unwrap();
        feeder.join().unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(!stderr.contains("panicked"), "{name} panicked: {stderr}");
        assert_ne!(output.status.code(), Some(0), "{name}: {stderr}");
        assert!(
            stderr
                .lines()
                .any(|line| line.contains("writing the output")),
            "{name}: {stderr}"
        );
    }
}

/// Under libfiu (Debian's `fiu-utils`), reads and writes of the tool fail at random: a
/// run ends with its output or with one error line, never with a panic.
#[test]
fn random_io_failures_never_make_a_tool_panic() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let input: Vec<u8> = (0..3000)
        .flat_map(|i| format!("{i}\n").into_bytes())
        .collect();
    for run in 0..24 {
        let store = dir.path().join(format!("store-{run}"));
        let store = store.to_str().unwrap().to_owned();
        let tool: Vec<&str> = if run % 2 == 0 {
            vec!["dedup", "--dir", &store, "--window", "1h"]
        } else {
            vec![
                "bench",
                "--keys",
                "2000",
                "--threads",
                "1",
                "--batch",
                "100",
            ]
        };
        let mut child = Command::new("fiu-run")
            .args([
                "-x",
                "-c",
                "enable_random name=posix/io/rw/*,probability=0.05",
            ])
            .arg(env!("CARGO_BIN_EXE_oncedb"))
            .args(&tool)
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("fiu-run must be installed (Debian's fiu-utils; .ci/run installs it)");
        let mut stdin = child.stdin.take().unwrap();
        let feed = input.clone();
        let feeder = std::thread::spawn(move || {
            let _ = stdin.write_all(&feed);
        });
        let output = child.wait_with_output().unwrap();
        feeder.join().unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(
            !stderr.contains("panicked"),
            "run {run} ({tool:?}) panicked: {stderr}"
        );
        assert!(
            matches!(output.status.code(), Some(0 | 1)),
            "run {run} ({tool:?}): {:?} {stderr}",
            output.status
        );
    }
}
