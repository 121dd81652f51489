//! What the modules of this binary share: the test window and a manual clock (from
//! `oncedb_testkit::fixtures`), and the lock that keeps the crash tests' child processes
//! from holding on to the lock files of stores that other tests reopen.

pub use oncedb_testkit::fixtures::*;

use std::sync::{PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};

/// Between fork and exec, a child process holds a copy of every file descriptor of this
/// process, and with it the lock of any store open at that moment. A store that a test
/// closes meanwhile stays locked until the child has exec'd, and reopening it (in this
/// process, or in a child of its own) fails with `Error::Locked`. Tests that spawn
/// children hold this lock exclusively, tests that open stores on the real file system
/// hold it shared; stores on a `MemStorage` need neither.
static CHILDREN: RwLock<()> = RwLock::new(());

/// Held for the whole of a test that spawns child processes: no other test of this binary
/// that holds [`CHILDREN`] runs meanwhile.
pub fn spawning_children() -> RwLockWriteGuard<'static, ()> {
    CHILDREN.write().unwrap_or_else(PoisonError::into_inner)
}

/// Held for the whole of a test that opens (and reopens) stores on the real file system.
pub fn real_files() -> RwLockReadGuard<'static, ()> {
    CHILDREN.read().unwrap_or_else(PoisonError::into_inner)
}
