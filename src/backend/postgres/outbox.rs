//! The transactional outbox: messages written in the caller's transaction with the
//! business update ([`enqueue`]), published afterwards by a [`Relay`].
//!
//! - A message keeps its id for ever, and the relay publishes it with that id every
//!   time, so a consumer (or a broker's duplicate window) can drop a re-send.
//! - The messages of one aggregate are published in the order their transactions
//!   committed (`aggregate_seq`, taken from the aggregate's counter row, which the
//!   writing transaction holds locked until it ends), even with several relays: a relay
//!   claims the oldest unpublished message of each aggregate with `FOR UPDATE SKIP
//!   LOCKED`, and the messages after it only while it holds that one.
//! - A message that fails to publish is retried with exponential back-off, keeping its
//!   attempt count and last error; after the relay's attempt limit it is dead. A failing
//!   or dead message holds back its own aggregate only: the relay goes on with every
//!   other aggregate. [`status`] counts pending, retrying and dead messages, and
//!   [`revive`] gives a dead one (once fixed) a fresh start.
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
    /// Failed publish attempts so far.
    pub attempts: u32,
}

/// Writes `message` to the outbox inside `tx`; returns its id. A message with an id
/// that is already in the outbox is refused with [`Error::Backend`] (unique violation)
/// and the caller's transaction is then aborted, as for any failed statement.
pub async fn enqueue(tx: &Transaction<'_>, message: &NewMessage<'_>) -> Result<String> {
    // The aggregate's counter row stays locked until `tx` ends: a second transaction
    // writing for the same aggregate waits here, so numbers follow commit order.
    let row = tx
        .query_one(
            "WITH next AS (
                INSERT INTO outbox_aggregates AS a (aggregate_type, aggregate_id, last_seq)
                VALUES ($2, $3, 1)
                ON CONFLICT (aggregate_type, aggregate_id)
                DO UPDATE SET last_seq = a.last_seq + 1
                RETURNING last_seq)
             INSERT INTO outbox_messages
                 (id, aggregate_type, aggregate_id, message_type, payload, aggregate_seq)
             SELECT coalesce($1, gen_random_uuid()::text), $2, $3, $4, $5, next.last_seq
             FROM next
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

/// The columns a relay reads.
macro_rules! message_columns {
    () => {
        "o.id, o.seq, o.aggregate_seq, o.aggregate_type, o.aggregate_id, o.message_type,
         o.payload, o.created_at, o.attempts"
    };
}

/// Claims the oldest unpublished message of each aggregate whose predecessors are all
/// published, when it is alive and due, skipping rows another relay holds. A dead or
/// waiting head holds back its aggregate (its followers are not heads).
const CLAIM_HEADS: &str = concat!(
    "SELECT ",
    message_columns!(),
    "
FROM outbox_messages o
WHERE o.published_at IS NULL AND o.dead_at IS NULL AND o.next_attempt_at <= now()
  AND NOT EXISTS (
    SELECT 1 FROM outbox_messages p
    WHERE p.published_at IS NULL AND p.aggregate_type = o.aggregate_type
      AND p.aggregate_id = o.aggregate_id AND p.aggregate_seq < o.aggregate_seq)
ORDER BY o.seq
LIMIT $1
FOR UPDATE SKIP LOCKED"
);

/// The messages after the claimed heads of the same aggregates. No other relay can hold
/// them: none of them is a head while this relay holds its aggregate's head.
const CLAIM_FOLLOWERS: &str = concat!(
    "SELECT ",
    message_columns!(),
    "
FROM outbox_messages o
JOIN unnest($1::text[], $2::text[], $3::bigint[]) AS h(aggregate_type, aggregate_id, seq)
  ON o.aggregate_type = h.aggregate_type AND o.aggregate_id = h.aggregate_id
     AND o.aggregate_seq > h.seq
WHERE o.published_at IS NULL AND o.dead_at IS NULL
ORDER BY o.aggregate_seq
LIMIT $4
FOR UPDATE OF o"
);

/// `$1` id, `$2` error, `$3` seconds to wait, `$4` attempt limit: one failed attempt.
const RECORD_FAILURE: &str = "
UPDATE outbox_messages
SET attempts = attempts + 1, last_error = $2,
    next_attempt_at = now() + $3::double precision * interval '1 second',
    dead_at = CASE WHEN attempts + 1 >= $4 THEN now() END
WHERE id = $1";

const MARK_PUBLISHED: &str =
    "UPDATE outbox_messages SET published_at = now() WHERE id = ANY($1::text[])";

/// Publishes committed outbox messages through a [`Publisher`]. Several relays may run
/// at once, in one process or many.
#[derive(Debug)]
pub struct Relay<P> {
    pool: Pool,
    publisher: P,
    batch: i64,
    max_attempts: i32,
    first_backoff: Duration,
    max_backoff: Duration,
}

impl<P: Publisher> Relay<P> {
    /// A relay over `store`'s database, claiming at most 256 messages per batch.
    pub fn new(store: &PostgresStore, publisher: P) -> Relay<P> {
        Relay {
            pool: store.pool().clone(),
            publisher,
            batch: 256,
            max_attempts: 10,
            first_backoff: Duration::from_secs(1),
            max_backoff: Duration::from_secs(300),
        }
    }

    /// A message that failed this many times (1..=1000; default 10) is dead: kept, with
    /// its last error, and no longer tried until [`revive`]d. It holds back its own
    /// aggregate only.
    pub fn max_attempts(mut self, attempts: u32) -> Result<Relay<P>> {
        self.max_attempts = i32::try_from(attempts)
            .ok()
            .filter(|n| (1..=1000).contains(n))
            .ok_or_else(|| {
                Error::InvalidOptions(format!("max_attempts {attempts} outside 1..=1000"))
            })?;
        Ok(self)
    }

    /// After its n-th failure a message waits `first * 2^(n-1)`, at most `max`
    /// (defaults 1 s and 5 min).
    pub fn backoff(mut self, first: Duration, max: Duration) -> Relay<P> {
        self.first_backoff = first;
        self.max_backoff = max.max(first);
        self
    }

    /// The wait after a message's `attempts`-th failure.
    fn wait_after(&self, attempts: u32) -> Duration {
        let doublings = attempts.saturating_sub(1).min(30);
        self.first_backoff
            .saturating_mul(1 << doublings)
            .min(self.max_backoff)
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
    /// transaction. Returns how many messages it published (0: nothing to do now). A
    /// message that fails to publish records the attempt (count, error, back-off, death
    /// after the attempt limit), and the rest of its aggregate waits for it; the other
    /// aggregates of the batch go on. Failures are logged; only a database error is
    /// returned.
    pub async fn run_once(&self) -> Result<usize> {
        let mut client = self.pool.get().await.map_err(pool_error)?;
        let tx = client.transaction().await.map_err(pg_error)?;
        let messages = claim(&tx, self.batch).await?;
        let mut published = Vec::with_capacity(messages.len());
        let mut blocked: Vec<(&str, &str)> = Vec::new();
        for message in &messages {
            let aggregate = (
                message.aggregate_type.as_str(),
                message.aggregate_id.as_str(),
            );
            if blocked.contains(&aggregate) {
                continue; // an earlier message of the aggregate failed: order holds
            }
            if let Err(err) = self.publisher.publish(message).await {
                blocked.push(aggregate);
                self.record_failure(&tx, message, &err).await?;
                continue;
            }
            published.push(message.id.clone());
        }
        if !published.is_empty() {
            tx.execute(MARK_PUBLISHED, &[&published])
                .await
                .map_err(pg_error)?;
        }
        tx.commit().await.map_err(pg_error)?;
        Ok(published.len())
    }

    async fn record_failure(
        &self,
        tx: &Transaction<'_>,
        message: &OutboxMessage,
        err: &Error,
    ) -> Result<()> {
        let attempts = message.attempts.saturating_add(1);
        let wait = self.wait_after(attempts).as_secs_f64();
        let text = err.to_string();
        tx.execute(
            RECORD_FAILURE,
            &[&message.id, &text, &wait, &self.max_attempts],
        )
        .await
        .map_err(pg_error)?;
        if i64::from(attempts) >= i64::from(self.max_attempts) {
            log::warn!(
                "outbox relay: message {} is dead after {attempts} attempts: {text}",
                message.id
            );
        } else if attempts.is_power_of_two() {
            log::warn!(
                "outbox relay: message {} failed (attempt {attempts}): {text}",
                message.id
            );
        }
        Ok(())
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
        let seqs: Vec<i64> = heads
            .iter()
            .map(|row| column(row, "aggregate_seq"))
            .collect::<Result<_>>()?;
        let followers = tx
            .query(CLAIM_FOLLOWERS, &[&types, &ids, &seqs, &room])
            .await
            .map_err(pg_error)?;
        for row in &followers {
            messages.push(read(row)?);
        }
    }
    // Heads first, then the followers by their aggregate's order: every aggregate's
    // messages come in its own order.
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
        attempts: u32::try_from(column::<i32>(row, "attempts")?)
            .map_err(|_| super::unexpected("outbox attempts"))?,
    })
}

/// How many messages wait in the outbox.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct OutboxStatus {
    /// Unpublished and never failed.
    pub pending: u64,
    /// Unpublished after at least one failed attempt, still retried.
    pub retrying: u64,
    /// Failed the relay's attempt limit: kept, not retried, holding back their
    /// aggregates until [`revive`]d.
    pub dead: u64,
}

/// Counts the outbox's unpublished messages (for monitoring: alert on `dead > 0`).
pub async fn status(store: &PostgresStore) -> Result<OutboxStatus> {
    let client = store.pool().get().await.map_err(pool_error)?;
    let row = client
        .query_one(
            "SELECT
                count(*) FILTER (WHERE attempts = 0 AND dead_at IS NULL),
                count(*) FILTER (WHERE attempts > 0 AND dead_at IS NULL),
                count(*) FILTER (WHERE dead_at IS NOT NULL)
             FROM outbox_messages WHERE published_at IS NULL",
            &[],
        )
        .await
        .map_err(pg_error)?;
    let count = |index: usize| -> Result<u64> { unsigned(column(&row, index)?, "outbox count") };
    Ok(OutboxStatus {
        pending: count(0)?,
        retrying: count(1)?,
        dead: count(2)?,
    })
}

/// Gives dead message `id` a fresh start (attempts 0, due now), once whatever made it
/// fail is fixed. Returns whether such a dead message existed.
pub async fn revive(store: &PostgresStore, id: &str) -> Result<bool> {
    let client = store.pool().get().await.map_err(pool_error)?;
    let revived = client
        .execute(
            "UPDATE outbox_messages
             SET dead_at = NULL, attempts = 0, next_attempt_at = now()
             WHERE id = $1 AND dead_at IS NOT NULL AND published_at IS NULL",
            &[&id],
        )
        .await
        .map_err(pg_error)?;
    Ok(revived == 1)
}
