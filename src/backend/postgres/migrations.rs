//! Schema migrations shipped in the crate, applied only by an explicit
//! [`PostgresStore::migrate`](super::PostgresStore::migrate).

use deadpool_postgres::Object;

use super::{column, pg_error};
use crate::base::Result;

/// Every migration this version ships, in order: (version, name, SQL).
pub const MIGRATIONS: &[(i32, &str, &str)] = &[
    (
        1,
        "records, keys, ordering marks, inbox, outbox",
        include_str!("migrations/0001_records.sql"),
    ),
    (
        2,
        "the epochs take-overs replaced",
        include_str!("migrations/0002_taken_epochs.sql"),
    ),
    (
        3,
        "outbox: commit-ordered aggregates, retries, dead letters",
        include_str!("migrations/0003_outbox_bad_days.sql"),
    ),
    (
        4,
        "tables keyed by digests, for keys of any accepted length",
        include_str!("migrations/0004_key_digests.sql"),
    ),
];

/// Advisory lock key under which migrations run ("oncedb" in ASCII).
const MIGRATION_LOCK: i64 = 0x6f6e_6365_6462;

/// Applies the migrations the database lacks, in one transaction; returns how many.
pub(super) async fn apply(client: &mut Object) -> Result<usize> {
    let tx = client.transaction().await.map_err(pg_error)?;
    // A migration may rewrite whole tables (migration 4 does): the store's response
    // timeout, which bounds every other statement, must not cancel it half-way.
    tx.batch_execute("SET LOCAL statement_timeout = 0")
        .await
        .map_err(pg_error)?;
    tx.execute("SELECT pg_advisory_xact_lock($1)", &[&MIGRATION_LOCK])
        .await
        .map_err(pg_error)?;
    tx.batch_execute(
        "CREATE TABLE IF NOT EXISTS oncedb_schema_migrations (
            version integer PRIMARY KEY,
            name text NOT NULL,
            applied_at timestamptz NOT NULL DEFAULT now())",
    )
    .await
    .map_err(pg_error)?;
    let row = tx
        .query_one(
            "SELECT coalesce(max(version), 0) FROM oncedb_schema_migrations",
            &[],
        )
        .await
        .map_err(pg_error)?;
    let current: i32 = column(&row, 0)?;
    let mut applied = 0;
    for (version, name, sql) in MIGRATIONS.iter().filter(|(v, _, _)| *v > current) {
        tx.batch_execute(sql).await.map_err(pg_error)?;
        tx.execute(
            "INSERT INTO oncedb_schema_migrations (version, name) VALUES ($1, $2)",
            &[version, name],
        )
        .await
        .map_err(pg_error)?;
        applied += 1;
    }
    tx.commit().await.map_err(pg_error)?;
    Ok(applied)
}
