//! Responses in the log: a durable store keeps a finished record's response in memory
//! only until the log is written past its finish entry, then just the entry's span,
//! and a replay reads the response back with one positioned read.

use std::collections::VecDeque;

use super::Engine;
use crate::base::{Error, Fingerprint, LogSpan, Record, Result};
use crate::wal::Ticket;

/// A finish entry appended but perhaps not yet written to its segment file.
pub(crate) struct Unwritten {
    pub(crate) ticket: Ticket,
    pub(crate) fingerprint: Fingerprint,
    pub(crate) lease_id: u64,
    pub(crate) span: LogSpan,
}

/// Finish entries whose responses memory still holds, oldest first.
#[derive(Default)]
pub(crate) struct UnwrittenQueue(parking_lot::Mutex<VecDeque<Unwritten>>);

impl Engine {
    /// Adds `entry` (if any) to the queue, then lets memory drop the responses of every
    /// queued entry the log has written: from now on they are read back from there.
    pub(crate) fn log_responses(&self, entry: Option<Unwritten>) {
        let Some(journal) = &self.journal else {
            return;
        };
        let written: Vec<Unwritten> = {
            let mut queue = self.unwritten.0.lock();
            queue.extend(entry);
            let count = queue
                .iter()
                .take_while(|unwritten| journal.is_written(unwritten.ticket))
                .count();
            queue.drain(..count).collect()
        };
        for unwritten in written {
            // Bucket 0: moving a response changes nothing about time.
            self.index.lock(unwritten.fingerprint, 0).log_response(
                unwritten.fingerprint,
                unwritten.lease_id,
                unwritten.span,
            );
        }
    }

    /// `record` with its key compared and its response read back from the log, where
    /// memory kept only spans; `None` if the segment expired meanwhile (and the record
    /// with it). A key in the log that is not `scoped_key` is `FingerprintCollision`.
    pub(crate) fn read_back(
        &self,
        fingerprint: Fingerprint,
        scoped_key: &[u8],
        mut record: Record,
    ) -> Result<Option<Record>> {
        if let Some(span) = record.key_logged.take()
            && !self.key_in_log_is(fingerprint, scoped_key, span)?
        {
            return Ok(None);
        }
        let (Some((span, lease_id)), Some(journal)) = (record.logged.take(), &self.journal) else {
            return Ok(Some(record));
        };
        Ok(journal
            .read_response(span, fingerprint, lease_id)?
            .map(|response| {
                record.response = Some(response.into());
                record
            }))
    }

    /// Whether the reserve frame at `span` still exists (`false`: its segment expired,
    /// and the record with it), checking that it holds `scoped_key`: a record in
    /// compact form compares its key here, as a full one does in memory.
    pub(crate) fn key_in_log_is(
        &self,
        fingerprint: Fingerprint,
        scoped_key: &[u8],
        span: LogSpan,
    ) -> Result<bool> {
        let Some(journal) = &self.journal else {
            return Ok(true);
        };
        match journal.read_key(span, fingerprint)? {
            None => Ok(false),
            Some(logged) if *logged == *scoped_key => Ok(true),
            Some(_) => Err(Error::FingerprintCollision),
        }
    }
}
