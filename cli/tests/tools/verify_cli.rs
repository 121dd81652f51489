//! `oncedb verify` as a process on real directories: exit 0 when clean, 1 with the first
//! damaged file and byte when damaged, 2 on a directory that cannot be checked.

#![expect(clippy::unwrap_used, reason = "test code: a panic is the test failing")]

use std::path::Path;
use std::process::Command;

use oncedb::{Db, Options};

/// The tests here run one at a time: a child spawned by one test inherits, between fork
/// and exec, the open lock file of a store another test just closed, and the lock lives
/// as long as that copy.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn verify(dir: &Path) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_oncedb"))
        .args(["verify", "--dir"])
        .arg(dir)
        .output()
        .unwrap();
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

#[test]
fn clean_damaged_and_unreadable() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    store(dir.path());
    let (code, out, _) = verify(dir.path());
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("clean"), "{out}");

    // The segment holding the keys (a clean close also leaves an empty newest one).
    let segment = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "log"))
        .max_by_key(|p| std::fs::metadata(p).unwrap().len())
        .unwrap();
    let mut bytes = std::fs::read(&segment).unwrap();
    let before = bytes.clone();
    let at = 48 + 30;
    if let Some(byte) = bytes.get_mut(at) {
        *byte ^= 1;
    }
    std::fs::write(&segment, &bytes).unwrap();
    let (code, out, _) = verify(dir.path());
    assert_eq!(code, 1, "{out}");
    let last = out.lines().last().unwrap();
    assert!(last.starts_with("DAMAGED"), "{out}");
    assert!(last.contains(&segment.display().to_string()), "{out}");
    // verify changed nothing.
    assert_eq!(std::fs::read(&segment).unwrap(), bytes);
    std::fs::write(&segment, before).unwrap();

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
