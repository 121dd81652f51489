//! No subcommand panics on its output: a closed stdout (`oncedb verify | head -1`) is a
//! normal end, any other write failure is one error line and a non-zero exit.

use std::process::{Command, Stdio};

use crate::support::{oncedb, run, serial};

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
    let mut command = Command::new(env!("CARGO_BIN_EXE_oncedb"));
    let output = run(command.args(args), writer.into(), stdin);
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
        let mut command = Command::new(env!("CARGO_BIN_EXE_oncedb"));
        let output = run(command.args(&args), full.into(), &stdin);
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
    for attempt in 0..24 {
        let store = dir.path().join(format!("store-{attempt}"));
        let store = store.to_str().unwrap().to_owned();
        let tool: Vec<&str> = if attempt % 2 == 0 {
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
        // fiu-run comes with Debian's fiu-utils; .ci/run installs it.
        let mut command = Command::new("fiu-run");
        command
            .args([
                "-x",
                "-c",
                "enable_random name=posix/io/rw/*,probability=0.05",
            ])
            .arg(env!("CARGO_BIN_EXE_oncedb"))
            .args(&tool);
        let output = run(&mut command, Stdio::null(), &input);
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(
            !stderr.contains("panicked"),
            "run {attempt} ({tool:?}) panicked: {stderr}"
        );
        assert!(
            matches!(output.status.code(), Some(0 | 1)),
            "run {attempt} ({tool:?}): {:?} {stderr}",
            output.status
        );
    }
}
