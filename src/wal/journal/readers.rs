//! Segment files kept open for replays: a finished record whose response (or key) stays
//! in the log is read back with one positioned read through a handle opened once per
//! segment, instead of an open, a read and a close per replay.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use parking_lot::Mutex;

use crate::io::{ReadAtFile, Storage};

/// Handles kept open at most; a replay from another segment lets one of them go.
const MAX_OPEN_SEGMENTS: usize = 64;

/// The open handles, by segment `(bucket, seq)`.
#[derive(Default)]
pub(super) struct SegmentReaders(Mutex<HashMap<(u64, u32), Arc<dyn ReadAtFile>>>);

impl SegmentReaders {
    /// The handle of `segment` at `path`, opened now if need be; `None` where the storage
    /// keeps no handles (every read then goes by path). A handle opened now is kept unless
    /// `expired` says the segment has left the window: the worker may be retiring it, and
    /// a kept handle would hold its disk space.
    pub(super) fn get(
        &self,
        storage: &dyn Storage,
        (segment, path): ((u64, u32), &Path),
        expired: impl FnOnce() -> bool,
    ) -> std::io::Result<Option<Arc<dyn ReadAtFile>>> {
        if let Some(file) = self.0.lock().get(&segment) {
            return Ok(Some(Arc::clone(file)));
        }
        let Some(file) = storage.open_read(path)? else {
            return Ok(None);
        };
        let file: Arc<dyn ReadAtFile> = Arc::from(file);
        let mut open = self.0.lock();
        // Checked under the lock, which the worker takes to forget the handles of the
        // segments it retired, after they left the window: a handle kept here is never
        // one of a retired segment.
        if !expired() {
            if open.len() >= MAX_OPEN_SEGMENTS
                && let Some(&any) = open.keys().next()
            {
                open.remove(&any);
            }
            open.insert(segment, Arc::clone(&file));
        }
        Ok(Some(file))
    }

    /// Lets go of the handles of `segments`, which the worker retired.
    pub(super) fn forget(&self, segments: &[(u64, u32)]) {
        let mut open = self.0.lock();
        for segment in segments {
            open.remove(segment);
        }
    }
}
