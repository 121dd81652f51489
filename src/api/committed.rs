//! The writes of the asynchronous API (feature `async`): each runs on the calling task,
//! logs its entries, and awaits their group commit through a waker, so no thread blocks
//! for it. A write that may do blocking file work on the way (a roll-over, a seal, a
//! lease floor raise: [`Db::may_block_on_files`]) is the caller's to run elsewhere.

use super::db::{Db, with_scoped_key};
use super::observe;
use super::record::{Lease, Reservation, Scope};
use crate::base::{Advance, Finish, Result};
use crate::engine::{Concluded, Settle, merge_answers, seen_keys};

impl Db {
    /// Whether a write carrying `bytes` of keys and requests, admitting at most `keys`
    /// keys and taking at most `leases` leases may do blocking file work on the calling
    /// thread if made now.
    pub(crate) fn may_block_on_files(&self, bytes: usize, keys: usize, leases: u64) -> bool {
        self.engine.may_block_on_files(bytes, keys, leases)
    }

    /// Makes `write` with its wait deferred and awaits its commit; asks again while an
    /// answer that depended on another call's write lost it (taken back meanwhile).
    async fn deferred<T>(&self, mut write: impl FnMut(&mut Settle) -> Result<T>) -> Result<T> {
        loop {
            let mut settle = Settle::deferred();
            let answer = write(&mut settle)?;
            if self.engine.committed(settle).await? == Concluded::Stands {
                return Ok(answer);
            }
        }
    }

    /// [`Db::insert_if_absent`], awaiting the commit.
    pub(crate) async fn insert_if_absent_committed(&self, key: &[u8]) -> Result<bool> {
        let admitted = self
            .deferred(|settle| self.engine.insert_if_absent_settled(key, settle))
            .await?;
        observe::keys(&[admitted]);
        Ok(admitted)
    }

    /// [`Db::insert_many`], awaiting the commit. A batch whose "seen" answers lost the
    /// writes they rested on asks again for those keys alone (its own admissions stand).
    pub(crate) async fn insert_many_committed<K: AsRef<[u8]>>(
        &self,
        keys: &[K],
    ) -> Result<Vec<bool>> {
        let (mut admitted, mut settle) = (Vec::new(), Settle::deferred());
        self.engine
            .insert_many_settled(keys, &mut admitted, &mut settle)?;
        let mut concluded = self.engine.committed(settle).await?;
        while concluded == Concluded::Redo {
            let (positions, again) = seen_keys(keys, &admitted);
            let (mut answers, mut settle) = (Vec::new(), Settle::deferred());
            self.engine
                .insert_many_settled(&again, &mut answers, &mut settle)?;
            concluded = self.engine.committed(settle).await?;
            merge_answers(&mut admitted, &positions, &answers);
        }
        observe::keys(&admitted);
        Ok(admitted)
    }

    /// [`Db::reserve`], awaiting the commit of a new or taken-over record.
    pub(crate) async fn reserve_committed(
        &self,
        scope: &Scope,
        key: &[u8],
        request: &[u8],
    ) -> Result<Reservation> {
        self.engine.check_key(key)?;
        let reserved = self
            .deferred(|settle| {
                with_scoped_key(scope, key, |scoped| {
                    self.engine.reserve_settled(scoped, request, settle)
                })
            })
            .await?;
        Ok(self.reservation(scope, key, reserved))
    }

    /// [`Db::get`], awaiting the acknowledgement of the write the record shows (reads
    /// that rest on nothing unacknowledged return at once).
    pub(crate) async fn get_committed(
        &self,
        scope: &Scope,
        key: &[u8],
    ) -> Result<Option<crate::base::Record>> {
        self.engine.check_key(key)?;
        loop {
            let mut settle = Settle::deferred();
            let record = with_scoped_key(scope, key, |scoped| {
                self.engine.get_settled(scoped, &mut settle)
            })?;
            if !settle.waits() || self.engine.committed(settle).await? == Concluded::Stands {
                return Ok(record);
            }
        }
    }

    /// [`Db::take_over`], awaiting the commit.
    pub(crate) async fn take_over_committed(
        &self,
        scope: &Scope,
        key: &[u8],
    ) -> Result<Option<Lease>> {
        self.engine.check_key(key)?;
        let taken = self
            .deferred(|settle| {
                with_scoped_key(scope, key, |scoped| {
                    self.engine.take_over_settled(scoped, settle)
                })
            })
            .await?;
        Ok(self.taken_over(scope, key, taken))
    }

    /// [`Db::advance`], awaiting the commit.
    pub(crate) async fn advance_committed(
        &self,
        scope: &Scope,
        aggregate_id: &[u8],
        version: u64,
    ) -> Result<Advance> {
        self.engine.check_key(aggregate_id)?;
        let answer = self
            .deferred(|settle| {
                with_scoped_key(scope, aggregate_id, |scoped| {
                    self.engine.advance_settled(scoped, version, settle)
                })
            })
            .await?;
        observe::version(scope, answer);
        Ok(answer)
    }
}

impl Db {
    /// [`Db::wait_finished`] without holding a thread: the task sleeps on the ending's
    /// waker (and on a timer for the deadline and the lease timeout).
    pub(crate) async fn wait_finished_async(
        &self,
        scope: &Scope,
        key: &[u8],
        timeout: std::time::Duration,
    ) -> Result<Option<crate::base::Record>> {
        self.engine.check_key(key)?;
        let deadline = crate::base::deadline_after(timeout);
        let mut scoped = Vec::new();
        scope.encode_key_into(key, &mut scoped)?;
        loop {
            let mut settle = Settle::deferred();
            let (watch, wake) = match self.engine.look_for_ending(&scoped, deadline, &mut settle) {
                Ok(record) => {
                    let record = record?;
                    // The ending it shows is acknowledged before it is answered.
                    if self.engine.committed(settle).await? == Concluded::Stands {
                        return Ok(record);
                    }
                    continue;
                }
                Err(waiting) => waiting,
            };
            // Taken back when this wait ends without its ending, however it ends: at
            // its wake-up time, or dropped by its caller (a timeout, a `select!`).
            let registered = Registered {
                engine: &self.engine,
                watch,
            };
            let fired = std::future::poll_fn(|cx| registered.watch.1.poll_fired(cx));
            let wake = tokio::time::Instant::from_std(wake);
            let _ = tokio::time::timeout_at(wake, fired).await;
        }
    }
}

/// A wait's registration on an ending, taken back when dropped unless the ending came.
struct Registered<'a> {
    engine: &'a crate::engine::Engine,
    watch: crate::engine::Watch,
}

impl Drop for Registered<'_> {
    fn drop(&mut self) {
        if !self.watch.1.fired() {
            self.engine.forget_ending(&self.watch);
        }
    }
}

impl Lease {
    /// Whether ending the lease with a response of `bytes` may do blocking file work on
    /// the calling thread if made now.
    pub(crate) fn may_block_on_files(&self, bytes: usize) -> bool {
        self.engine.may_block_on_files(bytes, 0, 0)
    }

    /// [`Lease::complete`], awaiting the commit.
    pub(crate) async fn complete_committed(self, response: &[u8]) -> Result<()> {
        self.engine.check_response(response)?;
        self.end_committed(Finish::Complete(response), "completed")
            .await
    }

    /// [`Lease::fail`], awaiting the commit.
    pub(crate) async fn fail_committed(self, response: &[u8]) -> Result<()> {
        self.engine.check_response(response)?;
        self.end_committed(Finish::Fail(response), "failed").await
    }

    /// [`Lease::note`], awaiting the commit.
    pub(crate) async fn note_committed(&self, note: &[u8]) -> Result<()> {
        let lease = (self.fingerprint, self.lease_id);
        self.settled(
            |settle| self.engine.note_settled(lease, note, settle),
            "noted",
        )
        .await
    }

    /// [`Lease::release`], awaiting the commit.
    pub(crate) async fn keep_alive_committed(&self) -> Result<()> {
        let lease = (self.fingerprint, self.lease_id);
        self.settled(|settle| self.engine.renew_settled(lease, settle), "renewed")
            .await
    }

    pub(crate) async fn release_committed(self) -> Result<()> {
        self.end_committed(Finish::Release, "released").await
    }

    async fn end_committed(self, finish: Finish<'_>, ending: &'static str) -> Result<()> {
        let (fingerprint, lease_id) = (self.fingerprint, self.lease_id);
        let end = |settle: &mut Settle| {
            self.engine
                .finish_settled(fingerprint, lease_id, finish, settle)
        };
        self.settled(end, ending).await?;
        self.engine.ended(fingerprint);
        Ok(())
    }

    /// Makes the lease's write `write` with its wait deferred, awaits its commit, and
    /// observes the outcome as `ending`.
    async fn settled(
        &self,
        write: impl FnOnce(&mut Settle) -> Result<()>,
        ending: &'static str,
    ) -> Result<()> {
        let mut settle = Settle::deferred();
        let mut result = write(&mut settle);
        if result.is_ok() {
            result = self.engine.committed(settle).await.map(|_| ());
        }
        self.observe(&result, ending);
        result
    }
}
