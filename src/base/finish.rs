//! How a lease ends: shared by the index (which applies it), the log (which records it)
//! and the API (which asks for it).

use std::sync::Arc;

/// The end of a lease.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Finish {
    /// Completed: the response is stored for replay.
    Complete(Arc<[u8]>),
    /// Failed deterministically: the failure is stored for replay.
    Fail(Arc<[u8]>),
    /// Released: the record is deleted so that a retry may run.
    Release,
}

impl Finish {
    /// The stored bytes; empty for a release.
    pub(crate) fn response(&self) -> &[u8] {
        match self {
            Finish::Complete(response) | Finish::Fail(response) => response,
            Finish::Release => &[],
        }
    }
}
