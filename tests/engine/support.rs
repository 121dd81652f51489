//! What the modules of this binary share: the test window, a manual clock at a fixed
//! start and stores on it, from `oncedb_testkit::fixtures`.

pub use oncedb_testkit::fixtures::*;
