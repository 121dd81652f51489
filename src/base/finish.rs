//! How a lease ends: shared by the index (which applies it), the log (which records it)
//! and the API (which asks for it).

/// The end of a lease, borrowing the caller's response: the index copies it into the
/// record's buffer and the log into its frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Finish<'a> {
    /// Completed: the response is stored for replay.
    Complete(&'a [u8]),
    /// Failed deterministically: the failure is stored for replay.
    Fail(&'a [u8]),
    /// Released: the record is deleted so that a retry may run.
    Release,
}

impl<'a> Finish<'a> {
    /// The stored bytes; empty for a release.
    pub(crate) fn response(&self) -> &'a [u8] {
        match *self {
            Finish::Complete(response) | Finish::Fail(response) => response,
            Finish::Release => &[],
        }
    }
}
