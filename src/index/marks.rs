//! The ordering guard of one shard: per-aggregate version high-water marks, keyed by
//! fingerprint with full keys compared, expiring with the bucket of their last change.

use std::collections::VecDeque;

use super::records::{FingerprintMap, expire_queue, live_entry};
use crate::base::{Advance, Result, Window};

/// One aggregate's mark.
#[derive(Debug, Clone)]
pub(crate) struct Mark {
    pub(crate) scoped_key: Box<[u8]>,
    pub(crate) version: u64,
    /// Bucket of the last applied version; the mark expires with it.
    pub(crate) bucket: u64,
}

/// Marks plus an expiry queue in stamping order, drained a few entries per operation.
#[derive(Debug, Default)]
pub(crate) struct MarkMap {
    map: FingerprintMap<Mark>,
    expiry: VecDeque<(u64, u128)>,
}

impl MarkMap {
    /// The live mark of `fingerprint`, checking that it belongs to `scoped_key`.
    fn live(
        &mut self,
        fingerprint: u128,
        scoped_key: &[u8],
        window: Window,
        current: u64,
    ) -> Result<Option<&mut Mark>> {
        live_entry(
            &mut self.map,
            fingerprint,
            Some(scoped_key),
            window,
            current,
            |m| (m.bucket, Some(&m.scoped_key)),
        )
    }

    /// The answer to `version` for the aggregate, without changing anything.
    pub(crate) fn check(
        &mut self,
        fingerprint: u128,
        scoped_key: &[u8],
        version: u64,
        window: Window,
        current: u64,
    ) -> Result<(Advance, Option<u64>)> {
        let Some(mark) = self.live(fingerprint, scoped_key, window, current)? else {
            return Ok((Advance::Applied, None));
        };
        let answer = match version.checked_sub(mark.version) {
            Some(1) => Advance::Applied,
            Some(0) => Advance::Duplicate,
            None => Advance::Stale {
                current: mark.version,
            },
            Some(_) => Advance::Gap {
                expected: mark.version + 1,
            },
        };
        Ok((answer, Some(mark.bucket)))
    }

    /// Sets the mark of `fingerprint` to `version`, stamped `bucket`; returns the
    /// replaced mark's bucket.
    pub(crate) fn set(
        &mut self,
        fingerprint: u128,
        scoped_key: &[u8],
        version: u64,
        bucket: u64,
    ) -> Option<u64> {
        self.expiry.push_back((bucket, fingerprint));
        let mark = Mark {
            scoped_key: scoped_key.into(),
            version,
            bucket,
        };
        self.map.insert(fingerprint, mark).map(|old| old.bucket)
    }

    /// The live mark's version, for recovery.
    pub(crate) fn version(
        &mut self,
        fingerprint: u128,
        scoped_key: &[u8],
        window: Window,
        current: u64,
    ) -> Option<u64> {
        self.live(fingerprint, scoped_key, window, current)
            .ok()
            .flatten()
            .map(|mark| mark.version)
    }

    /// Removes up to `budget` marks whose bucket has left the window.
    pub(crate) fn expire(&mut self, budget: usize, window: Window, current: u64) -> bool {
        expire_queue(
            &mut self.map,
            &mut self.expiry,
            budget,
            window,
            current,
            |m| m.bucket,
        )
    }

    /// Marks held, live or expired but not yet removed.
    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.map.len()
    }

    /// Approximate heap bytes held.
    pub(crate) fn heap_bytes(&self) -> usize {
        let keys: usize = self.map.values().map(|m| m.scoped_key.len()).sum();
        self.map.capacity() * (size_of::<(u128, Mark)>() + 1) + self.expiry.capacity() * 24 + keys
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::base::Error;

    #[test]
    fn answers_follow_the_mark() {
        let window = Window::new(4, 1);
        let mut marks = MarkMap::default();
        let check =
            |marks: &mut MarkMap, version| marks.check(1, b"a", version, window, 0).unwrap().0;
        assert_eq!(check(&mut marks, 7), Advance::Applied);
        marks.set(1, b"a", 7, 0);
        assert_eq!(check(&mut marks, 8), Advance::Applied);
        assert_eq!(check(&mut marks, 7), Advance::Duplicate);
        assert_eq!(check(&mut marks, 6), Advance::Stale { current: 7 });
        assert_eq!(check(&mut marks, 10), Advance::Gap { expected: 8 });
        assert_eq!(check(&mut marks, u64::MAX), Advance::Gap { expected: 8 });
        assert!(matches!(
            marks.check(1, b"b", 8, window, 0),
            Err(Error::FingerprintCollision)
        ));
        // Past the window the mark is gone and any version starts afresh.
        assert_eq!(
            marks.check(1, b"a", 3, window, 5).unwrap().0,
            Advance::Applied
        );
    }
}
