//! The transactional outbox: messages written in the caller's transaction with the
//! business update ([`enqueue`]), published afterwards by a [`Relay`].
//!
//! - A message keeps its id for ever, and the relay publishes it with that id every
//!   time, so a consumer (or a broker's duplicate window) can drop a re-send.
//! - The messages of one aggregate are published in the order they were written
//!   (`seq`), even with several relays: a relay claims the oldest unpublished message of
//!   each aggregate with `FOR UPDATE SKIP LOCKED`, and the messages after it only
//!   while it holds that one.
//! - A relay that dies between publishing and marking published leaves its rows
//!   unpublished and unlocked: they are published again, with the same ids. Nothing is
//!   lost; only the same messages are duplicated.

use std::future::Future;
use std::time::{Duration, SystemTime};

use deadpool_postgres::Pool;
use tokio_postgres::Transaction;

use super::{PostgresStore, column, pg_error, pool_error, unsigned};
use crate::base::{Error, Result};

/// A message to write with [`enqueue`].
#[derive(Debug, Clone, Copy)]
pub struct NewMessage<'a> {
    /// The stable message id; `None` lets the database assign a random UUID. Deriving
    /// it from the input (say, the inbox message id and the message type) makes a
    /// re-processed input produce the same id.
    pub id: Option<&'a str>,
    /// The kind of aggregate (`payment`).
    pub aggregate_type: &'a str,
    /// The aggregate's id; ordering holds per (type, id).
    pub aggregate_id: &'a str,
    /// The message type (`payment.authorized`).
    pub message_type: &'a str,
    /// The message body.
    pub payload: &'a [u8],
}

/// A message read back for publishing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutboxMessage {
    /// The stable message id: publish it as the broker's message id.
    pub id: String,
    /// Position in the outbox; increases in write order.
    pub seq: u64,
    /// The kind of aggregate.
    pub aggregate_type: String,
    /// The aggregate's id.
    pub aggregate_id: String,
    /// The message type.
    pub message_type: String,
    /// The message body.
    pub payload: Vec<u8>,
    /// When it was written.
    pub created_at: SystemTime,
}

/// Writes `message` to the outbox inside `tx`; returns its id. A message with an id
/// that is already in the outbox is refused with [`Error::Backend`] (unique violation)
/// and the caller's transaction is then aborted, as for any failed statement.
pub async fn enqueue(tx: &Transaction<'_>, message: &NewMessage<'_>) -> Result<String> {
    let row = tx
        .query_one(
            "INSERT INTO outbox_messages (id, aggregate_type, aggregate_id, message_type, payload)
             VALUES (coalesce($1, gen_random_uuid()::text), $2, $3, $4, $5)
             RETURNING id",
            &[
                &message.id,
                &message.aggregate_type,
                &message.aggregate_id,
                &message.message_type,
                &message.payload,
            ],
        )
        .await
        .map_err(pg_error)?;
    row.try_get(0).map_err(pg_error)
}

/// Where a [`Relay`] publishes: a broker, a queue, or a test sink.
pub trait Publisher: Send + Sync + 'static {
    /// Publishes one message, with `message.id` as its deduplication id. Returns once
    /// the target has accepted it (a broker's ack): the relay marks it published after.
    fn publish(&self, message: &OutboxMessage) -> impl Future<Output = Result<()>> + Send;
}

/// Claims the oldest unpublished message of each aggregate whose predecessors are all
/// published, skipping rows another relay holds.
const CLAIM_HEADS: &str = "
SELECT o.id, o.seq, o.aggregate_type, o.aggregate_id, o.message_type, o.payload, o.created_at
FROM outbox_messages o
WHERE o.published_at IS NULL
  AND NOT EXISTS (
    SELECT 1 FROM outbox_messages p
    WHERE p.published_at IS NULL AND p.aggregate_type = o.aggregate_type
      AND p.aggregate_id = o.aggregate_id AND p.seq < o.seq)
ORDER BY o.seq
LIMIT $1
FOR UPDATE SKIP LOCKED";

/// The messages after the claimed heads of the same aggregates. No other relay can hold
/// them: none of them is a head while this relay holds its aggregate's head.
const CLAIM_FOLLOWERS: &str = "
SELECT o.id, o.seq, o.aggregate_type, o.aggregate_id, o.message_type, o.payload, o.created_at
FROM outbox_messages o
JOIN unnest($1::text[], $2::text[], $3::bigint[]) AS h(aggregate_type, aggregate_id, seq)
  ON o.aggregate_type = h.aggregate_type AND o.aggregate_id = h.aggregate_id AND o.seq > h.seq
WHERE o.published_at IS NULL
ORDER BY o.seq
LIMIT $4
FOR UPDATE OF o";

const MARK_PUBLISHED: &str =
    "UPDATE outbox_messages SET published_at = now() WHERE id = ANY($1::text[])";

/// Publishes committed outbox messages through a [`Publisher`]. Several relays may run
/// at once, in one process or many.
#[derive(Debug)]
pub struct Relay<P> {
    pool: Pool,
    publisher: P,
    batch: i64,
}

impl<P: Publisher> Relay<P> {
    /// A relay over `store`'s database, claiming at most 256 messages per batch.
    pub fn new(store: &PostgresStore, publisher: P) -> Relay<P> {
        Relay {
            pool: store.pool().clone(),
            publisher,
            batch: 256,
        }
    }

    /// Claims at most `batch` (1..=65536) messages per transaction.
    pub fn batch(mut self, batch: usize) -> Result<Relay<P>> {
        if !(1..=65_536).contains(&batch) {
            return Err(Error::InvalidOptions(format!(
                "relay batch {batch} outside 1..=65536"
            )));
        }
        self.batch = i64::try_from(batch).unwrap_or(256);
        Ok(self)
    }

    /// The publisher.
    pub fn publisher(&self) -> &P {
        &self.publisher
    }

    /// Claims one batch, publishes it in order and marks what was published, in one
    /// transaction. Returns how many messages it published (0: nothing to do). A
    /// publish error marks the messages before it and returns the error; the rest are
    /// published again later.
    pub async fn run_once(&self) -> Result<usize> {
        let mut client = self.pool.get().await.map_err(pool_error)?;
        let tx = client.transaction().await.map_err(pg_error)?;
        let messages = claim(&tx, self.batch).await?;
        let mut published = Vec::with_capacity(messages.len());
        let mut failure = None;
        for message in &messages {
            if let Err(err) = self.publisher.publish(message).await {
                failure = Some(err);
                break;
            }
            published.push(message.id.clone());
        }
        if !published.is_empty() {
            tx.execute(MARK_PUBLISHED, &[&published])
                .await
                .map_err(pg_error)?;
        }
        tx.commit().await.map_err(pg_error)?;
        match failure {
            Some(err) => Err(err),
            None => Ok(published.len()),
        }
    }

    /// Runs batches until `stop` completes, waiting `idle` after a batch that found
    /// nothing. A failed batch is retried after `idle` too; errors are logged.
    pub async fn run(&self, idle: Duration, stop: impl Future<Output = ()>) {
        let mut stop = std::pin::pin!(stop);
        loop {
            let wait = match self.run_once().await {
                Ok(0) => true,
                Ok(_) => false,
                Err(err) => {
                    log::warn!("outbox relay: {err}");
                    true
                }
            };
            if wait {
                tokio::select! {
                    () = &mut stop => return,
                    () = tokio::time::sleep(idle) => {}
                }
            }
        }
    }
}

async fn claim(tx: &Transaction<'_>, batch: i64) -> Result<Vec<OutboxMessage>> {
    let heads = tx.query(CLAIM_HEADS, &[&batch]).await.map_err(pg_error)?;
    let mut messages = heads.iter().map(read).collect::<Result<Vec<_>>>()?;
    let room = batch - i64::try_from(messages.len()).unwrap_or(batch);
    if room > 0 && !messages.is_empty() {
        let types: Vec<&str> = messages.iter().map(|m| m.aggregate_type.as_str()).collect();
        let ids: Vec<&str> = messages.iter().map(|m| m.aggregate_id.as_str()).collect();
        let seqs = messages
            .iter()
            .map(|m| i64::try_from(m.seq).map_err(|_| super::unexpected("outbox seq")))
            .collect::<Result<Vec<i64>>>()?;
        let followers = tx
            .query(CLAIM_FOLLOWERS, &[&types, &ids, &seqs, &room])
            .await
            .map_err(pg_error)?;
        for row in &followers {
            messages.push(read(row)?);
        }
        messages.sort_by_key(|message| message.seq);
    }
    Ok(messages)
}

fn read(row: &tokio_postgres::Row) -> Result<OutboxMessage> {
    Ok(OutboxMessage {
        id: column(row, "id")?,
        seq: unsigned(column(row, "seq")?, "outbox seq")?,
        aggregate_type: column(row, "aggregate_type")?,
        aggregate_id: column(row, "aggregate_id")?,
        message_type: column(row, "message_type")?,
        payload: column(row, "payload")?,
        created_at: column(row, "created_at")?,
    })
}
