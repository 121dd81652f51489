//! How a call's answer rests on the log: its own writes, which it waits for, and the
//! writes of other calls that its answer depends on ("seen" for a key another call
//! admitted, a record another call reserved or finished).
//!
//! Two rules hold under `Sync` (fsynced, and acknowledged by a replica in sync mode):
//! - **A failed write is not an admission.** A call whose write was not acknowledged
//!   (answered `Unavailable`, its outcome unknown to its caller) takes its keys back out
//!   of memory, unless the log was acknowledged past them meanwhile; the next call for
//!   such a key admits it, and that call's write is the one that counts.
//! - **An answer that depends on another call's write waits for it.** Every write is
//!   logged under the lock of the shard it changes, or (a batch's keys, without a budget
//!   or a bound) marked there with the batch's slot, which the batch publishes its log
//!   position to once logged (`index/pending.rs`); the shard remembers the log position
//!   past its newest write and which keys rest on which write. An answer that found the
//!   key waits for a marked batch to log (with no shard lock held), then until the log
//!   is acknowledged up to its write. Since a failing call takes its keys back only while its
//!   write is not acknowledged, and counts the take-back first, a waiter whose write it
//!   waited for was taken back sees the count move and looks again.
//!
//! `Buffered` and `Interval` acknowledge writes before they are durable, and answers that
//! depend on them do not wait either (docs/guarantees.md, "What an answer rests on").

use std::sync::atomic::Ordering;

use super::Engine;
use crate::base::{Fingerprint, Finish, Result};
use crate::index::{PendingWrite, Shard};
use crate::wal::{LogEntry, Ticket};

/// How a write waits for its log entries: here, blocking (the synchronous API), or by
/// keeping what it waits for to await through [`Engine::committed`] (the asynchronous
/// API).
#[derive(Debug)]
pub(crate) enum Settle {
    /// Wait in the call, leading a group commit if none is under way.
    Block,
    /// Keep what the call waits for.
    #[cfg(feature = "async")]
    Defer(Pending),
}

impl Settle {
    /// A deferred settle with nothing to wait for yet.
    #[cfg(feature = "async")]
    pub(crate) fn deferred() -> Settle {
        Settle::Defer(Pending::default())
    }

    /// Whether a deferred call has anything to wait for.
    #[cfg(feature = "async")]
    pub(crate) fn waits(&self) -> bool {
        matches!(self, Settle::Defer(pending) if pending.ticket.is_some())
    }
}

/// What a deferred call waits for, and what it takes back if its writes fail.
#[cfg(feature = "async")]
#[derive(Debug, Default)]
pub(crate) struct Pending {
    /// The newest ticket the call logged up to, or whose durability an answer depends on.
    pub(super) ticket: Option<Ticket>,
    /// The engine's take-back count before the call looked, if an answer depends on
    /// another call's write.
    pub(super) looked_at: Option<u64>,
    /// The call's own admissions, taken back if its commit fails.
    pub(super) undo: Undo,
}

/// What a failed write takes back.
#[derive(Debug, Default)]
pub(crate) enum Undo {
    /// Nothing: the write admitted nothing new.
    #[default]
    Nothing,
    /// Dedup keys admitted by a write logged up to the ticket.
    Keys(Vec<Fingerprint>, Ticket),
    /// A new record's lease, logged up to the ticket.
    Record(Fingerprint, u64, Ticket),
}

/// What a call's answer rests on.
#[derive(Debug)]
pub(super) struct Rests {
    /// The newest ticket the call's own writes logged up to.
    pub(super) own: Option<Ticket>,
    /// What those writes take back if their wait fails.
    pub(super) undo: Undo,
    /// Another call's write that an answer depends on, while it is not acknowledged.
    pub(super) dependency: Option<Ticket>,
    /// The take-back count before the call looked ([`Engine::looked_at`]).
    pub(super) looked_at: u64,
}

impl Rests {
    /// An answer about another call's write only (`dependency`, while unacknowledged),
    /// found after `looked_at`: the call wrote nothing of its own.
    pub(super) fn depending(dependency: Option<Ticket>, looked_at: u64) -> Rests {
        Rests {
            own: None,
            undo: Undo::Nothing,
            dependency,
            looked_at,
        }
    }
}

/// Whether an answer that depended on another call's write still stands once waited for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[must_use = "an answer that no longer stands is asked again"]
pub(crate) enum Concluded {
    /// The answer stands.
    Stands,
    /// A write it depended on was taken back meanwhile: ask again.
    Redo,
}

impl Engine {
    /// The ticket an answer that depends on `shard`'s earlier writes waits for: the
    /// shard's newest write, while it is not acknowledged (under `Sync` only).
    pub(super) fn dependency(&self, shard: &Shard) -> Option<Ticket> {
        let journal = self.sync_journal()?;
        let position = shard.logged_to();
        (position > journal.acknowledged_position()).then(|| Ticket::at(position))
    }

    /// The journal, under `Sync` (where answers wait for the writes they rest on).
    fn sync_journal(&self) -> Option<&crate::wal::Journal> {
        self.journal
            .as_ref()
            .filter(|journal| journal.answers_wait())
    }

    /// The write an answer "seen" for dedup key `fingerprint` (found in `shard`, locked)
    /// rests on: the write that admitted it, while it is not acknowledged (under `Sync`
    /// only). [`Engine::resolve`] turns it into a ticket once the lock is released.
    pub(super) fn key_dependency(
        &self,
        shard: &Shard,
        fingerprint: Fingerprint,
    ) -> Option<PendingWrite> {
        let acknowledged = self.sync_journal()?.acknowledged_position();
        shard.pending_write(fingerprint, (acknowledged, &self.batch_marks))
    }

    /// The ticket a write found by [`Engine::key_dependency`] waits for, called with no
    /// shard lock held (the batch it may wait for takes those locks until it logs). A
    /// batch that logged nothing, or whose write the log refused (its keys taken back
    /// first), leaves a ticket with nothing to wait for: the answer is still checked
    /// against the take-back count, and asked again if it moved.
    pub(super) fn resolve(&self, dependency: Option<PendingWrite>) -> Option<Ticket> {
        match dependency? {
            PendingWrite::Logged(position) => Some(Ticket::at(position)),
            PendingWrite::Batch(mark) => {
                Some(Ticket::at(self.batch_marks.wait_logged(mark).unwrap_or(0)))
            }
        }
    }

    /// Under `Sync`: remembers that the keys `fingerprints`, admitted in `shard` (locked),
    /// rest on write `at` (logged, or a batch's still admitting) until the log is
    /// acknowledged past it; the acknowledged position is read once for all of them.
    pub(super) fn note_pending_keys(
        &self,
        shard: &mut Shard,
        fingerprints: impl Iterator<Item = Fingerprint>,
        at: PendingWrite,
    ) {
        if let Some(journal) = self.sync_journal() {
            let acknowledged = (journal.acknowledged_position(), &self.batch_marks);
            shard.note_pending_keys(fingerprints, at, acknowledged);
        }
    }

    /// Under `Sync`, for one shard's `group` of a batch just admitted in `shard`
    /// (locked): notes the keys it admitted as resting on write `at`, and adds what its
    /// duplicates rest on to `found` (the marked batches among them to `marks`). The
    /// acknowledged position is read once for the group.
    #[expect(
        clippy::indexing_slicing,
        reason = "every index is below a length fixed at construction (shard count, table capacity, batch size)"
    )]
    pub(super) fn note_group(
        &self,
        shard: &mut Shard,
        (group, fingerprints, admitted): (&[u32], &[Fingerprint], &[bool]),
        at: PendingWrite,
        (found, marks): (&mut super::Found, &mut Vec<crate::index::BatchMark>),
    ) {
        let Some(journal) = self.sync_journal() else {
            return;
        };
        let acknowledged = (journal.acknowledged_position(), &self.batch_marks);
        let new = group.iter().filter(|&&i| admitted[i as usize]);
        shard.note_pending_keys(new.map(|&i| fingerprints[i as usize]), at, acknowledged);
        for &i in group.iter().filter(|&&i| !admitted[i as usize]) {
            found.add(
                shard.pending_write(fingerprints[i as usize], acknowledged),
                marks,
            );
        }
    }

    /// The take-back count, read before a call looks at what its answer depends on.
    pub(super) fn looked_at(&self) -> u64 {
        self.revocations.load(Ordering::Acquire)
    }

    /// Waits for what an answer rests on as `settle` says: the call's own writes (taking
    /// back what they admitted if that fails) and the other call's write it found;
    /// whether the answer still stands.
    pub(super) fn settle_answer(&self, rests: Rests, settle: &mut Settle) -> Result<Concluded> {
        let Rests {
            own,
            undo,
            dependency,
            looked_at,
        } = rests;
        match settle {
            Settle::Block => {
                if let Err(err) = self.wait(own.max(dependency)) {
                    self.take_back(&undo);
                    return Err(err);
                }
                Ok(match dependency {
                    Some(_) => self.stands_since(looked_at),
                    None => Concluded::Stands,
                })
            }
            #[cfg(feature = "async")]
            Settle::Defer(pending) => {
                pending.ticket = pending.ticket.max(own).max(dependency);
                if !matches!(undo, Undo::Nothing) {
                    pending.undo = undo;
                }
                if dependency.is_some() {
                    pending.looked_at =
                        Some(pending.looked_at.map_or(looked_at, |at| at.min(looked_at)));
                }
                Ok(Concluded::Stands)
            }
        }
    }

    /// Whether no write was taken back since `looked_at`, and none is being taken back:
    /// a caller that looked after a take-back was counted, but found its keys before
    /// they left memory, looks again too.
    pub(super) fn stands_since(&self, looked_at: u64) -> Concluded {
        if self.taking_back.load(Ordering::Acquire) == 0
            && self.revocations.load(Ordering::Acquire) == looked_at
        {
            Concluded::Stands
        } else {
            Concluded::Redo
        }
    }

    /// Counts a take-back for its whole length: the count moves when it starts and
    /// again when it ends, and [`Engine::stands_since`] answers `Redo` meanwhile.
    pub(super) fn counted_take_back(&self, take_back: impl FnOnce()) {
        self.taking_back.fetch_add(1, Ordering::AcqRel);
        self.revocations.fetch_add(1, Ordering::AcqRel);
        take_back();
        self.revocations.fetch_add(1, Ordering::AcqRel);
        self.taking_back.fetch_sub(1, Ordering::AcqRel);
    }

    /// Takes back what a write whose wait failed admitted, unless the log is
    /// acknowledged past it by now (then it stands, as if the wait had returned later).
    /// The take-back count moves first: a caller that found these admissions and waited
    /// for them then looks again.
    pub(super) fn take_back(&self, undo: &Undo) {
        let Some(journal) = &self.journal else {
            return;
        };
        if matches!(undo, Undo::Nothing) {
            return;
        }
        self.counted_take_back(|| self.take_back_counted(journal, undo));
    }

    fn take_back_counted(&self, journal: &crate::wal::Journal, undo: &Undo) {
        let bucket = self.current_bucket();
        match *undo {
            Undo::Nothing => {}
            Undo::Keys(ref fingerprints, ticket) => {
                let unacknowledged = || !journal.is_acknowledged(ticket);
                let missing = self.index.revoke_keys(fingerprints, bucket, unacknowledged);
                if missing > 0 {
                    // A seal took them out of memory meanwhile: they cannot be taken
                    // back, so the store stops rather than answer "seen" for them.
                    let err = journal.poison_with(crate::base::Error::Poisoned);
                    log::error!(
                        "oncedb: {missing} keys of a failed write were sealed meanwhile and \
                         cannot be taken back; the store is poisoned: {err}"
                    );
                }
            }
            Undo::Record(fingerprint, lease_id, ticket) => {
                let mut shard = self.index.lock(fingerprint, bucket);
                if journal.is_acknowledged(ticket) {
                    return;
                }
                let now_ms = self.clock.now_ms();
                if shard
                    .finish(fingerprint, lease_id, &Finish::Release, now_ms)
                    .is_ok()
                {
                    // Logged so that a reopen (or a restore) releases it too; nobody
                    // waits for it.
                    let released = self.enqueue(&[LogEntry::Finish {
                        fingerprint,
                        lease_id,
                        at_ms: now_ms,
                        finish: &Finish::Release,
                    }]);
                    if let Ok(Some(ticket)) = released {
                        shard.logged(ticket.position());
                    }
                    drop(shard);
                    // A release ends the record: its waiters look again.
                    self.ended(fingerprint);
                }
            }
        }
    }

    /// Completes a deferred write: resolves when the log covers its entries as the mode
    /// asks (durable for `Sync`), without a thread blocked for it; takes back its
    /// admissions if that fails, and says whether an answer that depended on another
    /// call's write still stands.
    #[cfg(feature = "async")]
    pub(crate) async fn committed(&self, settle: Settle) -> Result<Concluded> {
        let Settle::Defer(pending) = settle else {
            return Ok(Concluded::Stands);
        };
        let (Some(journal), Some(ticket)) = (&self.journal, pending.ticket) else {
            self.check_writable()?;
            return Ok(Concluded::Stands);
        };
        if let Err(err) = journal.commit(ticket).await {
            self.take_back(&pending.undo);
            return Err(err);
        }
        // Responses finished by deferred writes move to their frames once written.
        self.log_responses(None);
        Ok(match pending.looked_at {
            Some(looked_at) => self.stands_since(looked_at),
            None => Concluded::Stands,
        })
    }
}
