//! The transactional inbox: "reserve message ID in inbox → apply business state change →
//! create outgoing outbox event → commit → acknowledge".
//!
//! [`receive`] writes the inbox row in the caller's open transaction, so the row and the
//! business update commit or roll back together: a crash before the commit leaves
//! neither, a redelivery after it finds the row and skips the message.

use tokio_postgres::Transaction;

use super::pg_error;
use crate::base::Result;

/// What [`receive`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[must_use = "a duplicate must not be applied again"]
pub enum Received {
    /// First delivery: apply the message in this transaction, then commit.
    New,
    /// The message was applied by a committed transaction: skip it and acknowledge.
    Duplicate,
}

/// Records `message_id` as received by `consumer` inside `tx`. A concurrent transaction
/// holding the same message waits for it: after its commit this answers `Duplicate`,
/// after its rollback `New`.
pub async fn receive(
    tx: &Transaction<'_>,
    consumer: &str,
    message_id: &str,
    aggregate_id: Option<&str>,
) -> Result<Received> {
    let statement = tx
        .prepare(
            "INSERT INTO inbox_messages (consumer_name, message_id, aggregate_id)
             VALUES ($1, $2, $3) ON CONFLICT DO NOTHING",
        )
        .await
        .map_err(pg_error)?;
    let inserted = tx
        .execute(&statement, &[&consumer, &message_id, &aggregate_id])
        .await
        .map_err(pg_error)?;
    Ok(if inserted == 1 {
        Received::New
    } else {
        Received::Duplicate
    })
}
