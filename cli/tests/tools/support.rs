//! What the modules of this binary share: the `oncedb` tool run as a process, the lock
//! that runs its tests one at a time, and the real servers of `oncedb_testkit::servers`.

pub use oncedb_testkit::servers;

use std::io::Write;
use std::process::{Command, Output, Stdio};
use std::sync::{Mutex, MutexGuard, PoisonError};

/// The tests here run one at a time: a child spawned by one test inherits, between fork
/// and exec, the open lock file of a store another test just closed, and the lock lives
/// as long as that copy.
static SERIAL: Mutex<()> = Mutex::new(());

/// Held for the whole of every test of this binary.
pub fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Runs `oncedb` with `args`, feeding it `stdin`.
pub fn oncedb(args: &[&str], stdin: &[u8]) -> Output {
    run(
        Command::new(env!("CARGO_BIN_EXE_oncedb")).args(args),
        Stdio::piped(),
        stdin,
    )
}

/// Runs `command` with its stdout on `stdout` and stderr captured, feeding it `stdin`.
pub fn run(command: &mut Command, stdout: Stdio, stdin: &[u8]) -> Output {
    let mut child = command
        .stdin(Stdio::piped())
        .stdout(stdout)
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|err| panic!("{command:?}: {err}"));
    // Feed stdin from another thread: the child's stdout fills while we write.
    let mut input = child.stdin.take().unwrap();
    let stdin = stdin.to_vec();
    let feeder = std::thread::spawn(move || {
        // The child may exit before reading everything (bad arguments).
        let _ = input.write_all(&stdin);
    });
    let output = child.wait_with_output().unwrap();
    feeder.join().unwrap();
    output
}
