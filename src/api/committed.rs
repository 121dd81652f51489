//! The writes of the asynchronous API (feature `async`): each runs on the calling task,
//! logs its entries, and awaits their group commit through a waker, so no thread blocks
//! for it. A write that may do blocking file work on the way (a roll-over, a seal, a
//! lease floor raise: [`Db::may_block_on_files`]) is the caller's to run elsewhere.

use super::db::{Db, with_scoped_key};
use super::observe;
use super::record::{Lease, Reservation, Scope};
use crate::base::{Advance, Finish, Result};
use crate::engine::Settle;

impl Db {
    /// Whether a write carrying `bytes` of keys and requests, admitting at most `keys`
    /// keys and taking at most `leases` leases may do blocking file work on the calling
    /// thread if made now.
    pub(crate) fn may_block_on_files(&self, bytes: usize, keys: usize, leases: u64) -> bool {
        self.engine.may_block_on_files(bytes, keys, leases)
    }

    /// [`Db::insert_if_absent`], awaiting the commit.
    pub(crate) async fn insert_if_absent_committed(&self, key: &[u8]) -> Result<bool> {
        let mut settle = Settle::Defer(None);
        let admitted = self.engine.insert_if_absent_settled(key, &mut settle)?;
        self.engine.committed(settle).await?;
        observe::keys(&[admitted]);
        Ok(admitted)
    }

    /// [`Db::insert_many`], awaiting the commit.
    pub(crate) async fn insert_many_committed<K: AsRef<[u8]>>(
        &self,
        keys: &[K],
    ) -> Result<Vec<bool>> {
        let (mut admitted, mut settle) = (Vec::new(), Settle::Defer(None));
        self.engine
            .insert_many_settled(keys, &mut admitted, &mut settle)?;
        self.engine.committed(settle).await?;
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
        let mut settle = Settle::Defer(None);
        let reserved = with_scoped_key(scope, key, |scoped| {
            self.engine.reserve_settled(scoped, request, &mut settle)
        })?;
        self.engine.committed(settle).await?;
        Ok(self.reservation(scope, key, reserved))
    }

    /// [`Db::take_over`], awaiting the commit.
    pub(crate) async fn take_over_committed(
        &self,
        scope: &Scope,
        key: &[u8],
    ) -> Result<Option<Lease>> {
        self.engine.check_key(key)?;
        let mut settle = Settle::Defer(None);
        let taken = with_scoped_key(scope, key, |scoped| {
            self.engine.take_over_settled(scoped, &mut settle)
        })?;
        self.engine.committed(settle).await?;
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
        let mut settle = Settle::Defer(None);
        let answer = with_scoped_key(scope, aggregate_id, |scoped| {
            self.engine.advance_settled(scoped, version, &mut settle)
        })?;
        self.engine.committed(settle).await?;
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
            let (watch, wake) = match self.engine.look_for_ending(&scoped, deadline) {
                Ok(record) => return record,
                Err(waiting) => waiting,
            };
            let fired = std::future::poll_fn(|cx| watch.1.poll_fired(cx));
            let wake = tokio::time::Instant::from_std(wake);
            if tokio::time::timeout_at(wake, fired).await.is_err() {
                self.engine.forget_ending(&watch);
            }
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
        let mut settle = Settle::Defer(None);
        let mut result = write(&mut settle);
        if result.is_ok() {
            result = self.engine.committed(settle).await;
        }
        self.observe(&result, ending);
        result
    }
}
