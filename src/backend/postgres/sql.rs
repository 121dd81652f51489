//! The statements of [`PostgresStore`](super::PostgresStore). Parameters `$1, $2, $3` of
//! a record statement are always tenant, operation and key; windows are milliseconds.
//! Rows are found by their key digest (migration 4), and the full key is compared too.

/// The condition that picks the row of tenant `$1`, operation `$2`, key `$3`.
macro_rules! scoped_key {
    ($key:literal) => {
        concat!(
            " key_digest = oncedb_digest($1, $2, $3) AND tenant_id = $1 AND operation = $2 AND ",
            $key,
            " = $3 "
        )
    };
}

/// `$1` key, `$2` window: a row back when the key was absent or expired.
pub(super) const INSERT_KEY: &str = "
INSERT INTO dedup_keys (key, expires_at)
VALUES ($1, now() + $2::bigint * interval '1 millisecond')
ON CONFLICT (key_digest) DO UPDATE SET expires_at = EXCLUDED.expires_at
WHERE dedup_keys.expires_at <= now() AND dedup_keys.key = EXCLUDED.key
RETURNING 1";

/// `$1` distinct keys, `$2` window: the keys that were absent or expired.
pub(super) const INSERT_KEYS: &str = "
INSERT INTO dedup_keys (key, expires_at)
SELECT k, now() + $2::bigint * interval '1 millisecond' FROM unnest($1::bytea[]) AS k
ON CONFLICT (key_digest) DO UPDATE SET expires_at = EXCLUDED.expires_at
WHERE dedup_keys.expires_at <= now() AND dedup_keys.key = EXCLUDED.key
RETURNING key";

/// `$4` request hash, `$5` window: the new lease when the record was absent or expired.
/// One statement, so of any number of racing reservations exactly one gets a row.
pub(super) const RESERVE: &str = "
INSERT INTO idempotency_records AS r
    (tenant_id, operation, idempotency_key, request_hash, status, epoch, first_epoch,
     created_at, updated_at, expires_at)
SELECT $1, $2, $3, $4, 'processing', e.v, e.v, now(), now(),
       now() + $5::bigint * interval '1 millisecond'
FROM (SELECT nextval('oncedb_lease_epoch') AS v) AS e
ON CONFLICT (key_digest) DO UPDATE SET
    request_hash = EXCLUDED.request_hash, status = 'processing',
    epoch = EXCLUDED.epoch, first_epoch = EXCLUDED.first_epoch, taken_epochs = '{}',
    response_body = NULL, note = NULL, created_at = EXCLUDED.created_at,
    updated_at = EXCLUDED.updated_at, finished_at = NULL, expires_at = EXCLUDED.expires_at
WHERE r.expires_at <= now() AND r.tenant_id = $1 AND r.operation = $2
  AND r.idempotency_key = $3
RETURNING epoch, created_at";

/// The live record.
pub(super) const GET: &str = concat!(
    "SELECT request_hash, status, response_body, created_at, finished_at, note
     FROM idempotency_records WHERE",
    scoped_key!("idempotency_key"),
    "AND expires_at > now()"
);

/// How long ago the lease holding the live record in flight was granted or renewed, in
/// milliseconds by the server's clock, and whether the record carries a note.
pub(super) const LEASE_AGE: &str = concat!(
    "SELECT (extract(epoch FROM now() - updated_at) * 1000)::bigint, note IS NOT NULL
     FROM idempotency_records WHERE",
    scoped_key!("idempotency_key"),
    "AND status = 'processing' AND expires_at > now()"
);

/// What decides whether a lease owns the live record.
pub(super) const LEASE_STATE: &str = concat!(
    "SELECT status, epoch, taken_epochs, created_at FROM idempotency_records WHERE",
    scoped_key!("idempotency_key"),
    "AND expires_at > now()"
);

/// The condition every lease statement adds: lease `$4` holds the live record.
macro_rules! owned_by_lease {
    () => {
        concat!(
            " WHERE",
            scoped_key!("idempotency_key"),
            "AND status = 'processing' AND epoch = $4 AND expires_at > now()"
        )
    };
}

/// `$5` status, `$6` response, `$7` the record's notification topic: the ending
/// notifies its waiters when it commits (`listen.rs`); a refused ending (no row) sends
/// nothing. The rows returned are the rows changed.
pub(super) const FINISH: &str = concat!(
    "WITH done AS (UPDATE idempotency_records SET status = $5, response_body = $6,
     finished_at = now(), updated_at = now(), note = NULL",
    owned_by_lease!(),
    " RETURNING 1) SELECT pg_notify('oncedb_finished', $7::text) FROM done"
);

/// `$5` the record's notification topic, as for [`FINISH`].
pub(super) const RELEASE: &str = concat!(
    "WITH done AS (DELETE FROM idempotency_records",
    owned_by_lease!(),
    " RETURNING 1) SELECT pg_notify('oncedb_finished', $5::text) FROM done"
);

/// The lease's timeout counts from now (`updated_at` of a record in flight is when its
/// lease was granted or last renewed).
pub(super) const RENEW: &str = concat!(
    "UPDATE idempotency_records SET updated_at = now()",
    owned_by_lease!()
);

/// `$5` note. A note leaves `updated_at` alone: the lease timeout counts from the grant
/// of the lease (its reservation or take-over), on every store.
pub(super) const NOTE: &str = concat!(
    "UPDATE idempotency_records SET note = $5",
    owned_by_lease!()
);

/// The lease timeout's take-over: a new epoch for the live record of `$1..$3` in flight
/// for the request `$4` whose lease was granted `$5` ms ago or more, by the server's
/// clock (`updated_at` of a record in flight is when its lease was granted), unless it
/// carries a note (an outcome unknown, left to a reconciler's explicit take-over).
pub(super) const TAKE_OVER_STUCK: &str = concat!(
    "UPDATE idempotency_records SET taken_epochs = taken_epochs || epoch,
         epoch = nextval('oncedb_lease_epoch'), updated_at = now()
     WHERE",
    scoped_key!("idempotency_key"),
    "AND request_hash = $4 AND status = 'processing' AND expires_at > now()
     AND updated_at <= now() - $5::bigint * interval '1 millisecond' AND note IS NULL
     RETURNING epoch, created_at"
);

/// A new epoch for a live record in flight; the replaced one joins `taken_epochs`.
pub(super) const TAKE_OVER: &str = concat!(
    "UPDATE idempotency_records SET taken_epochs = taken_epochs || epoch,
         epoch = nextval('oncedb_lease_epoch'), updated_at = now()
     WHERE",
    scoped_key!("idempotency_key"),
    "AND status = 'processing' AND expires_at > now()
     RETURNING epoch, created_at"
);

/// `$1` age in milliseconds.
pub(super) const IN_FLIGHT: &str = "
SELECT tenant_id, operation, idempotency_key, created_at, epoch, note
FROM idempotency_records
WHERE status = 'processing' AND expires_at > now()
  AND created_at <= now() - $1::bigint * interval '1 millisecond'
ORDER BY created_at";

/// `$4` version, `$5` window: a row back when the version was applied.
pub(super) const ADVANCE: &str = "
INSERT INTO ordering_marks AS m (tenant_id, operation, aggregate_id, version, expires_at)
VALUES ($1, $2, $3, $4, now() + $5::bigint * interval '1 millisecond')
ON CONFLICT (key_digest) DO UPDATE SET
    version = EXCLUDED.version, expires_at = EXCLUDED.expires_at
WHERE (m.version + 1 = EXCLUDED.version OR m.expires_at <= now())
  AND m.tenant_id = $1 AND m.operation = $2 AND m.aggregate_id = $3
RETURNING version";

/// The live ordering mark.
pub(super) const MARK: &str = concat!(
    "SELECT version FROM ordering_marks WHERE",
    scoped_key!("aggregate_id"),
    "AND expires_at > now()"
);

/// `$1` batch: expired rows, one batch per statement, through the expiry indexes.
///
/// The inner `SELECT` locks the rows it picks with `SKIP LOCKED`, so a purge never waits
/// on a row lock: a row that a reservation, a batch or an ordering guard is replacing
/// is left for a later purge, and a purge cannot deadlock with a batch whatever order
/// either locks in. A row replaced between the purge's snapshot and its lock is
/// re-checked at its newest version, and the outer `DELETE` repeats the expiry
/// condition too, so a re-admitted row (which expires later) is never deleted.
pub(super) const PURGE_EXPIRED: [&str; 4] = [
    "DELETE FROM idempotency_records WHERE ctid IN (
        SELECT ctid FROM idempotency_records
        WHERE status IN ('completed', 'failed') AND expires_at <= now()
        LIMIT $1 FOR UPDATE SKIP LOCKED)
     AND status IN ('completed', 'failed') AND expires_at <= now()",
    "DELETE FROM idempotency_records WHERE ctid IN (
        SELECT ctid FROM idempotency_records
        WHERE status = 'processing' AND expires_at <= now()
        LIMIT $1 FOR UPDATE SKIP LOCKED)
     AND status = 'processing' AND expires_at <= now()",
    "DELETE FROM dedup_keys WHERE ctid IN (
        SELECT ctid FROM dedup_keys WHERE expires_at <= now()
        LIMIT $1 FOR UPDATE SKIP LOCKED)
     AND expires_at <= now()",
    "DELETE FROM ordering_marks WHERE ctid IN (
        SELECT ctid FROM ordering_marks WHERE expires_at <= now()
        LIMIT $1 FOR UPDATE SKIP LOCKED)
     AND expires_at <= now()",
];

/// `$1` batch, `$2` retention: inbox and published outbox rows past retention.
pub(super) const PURGE_RETAINED: [&str; 2] = [
    "DELETE FROM inbox_messages WHERE ctid IN (
        SELECT ctid FROM inbox_messages
        WHERE processed_at <= now() - $2::bigint * interval '1 millisecond'
        LIMIT $1 FOR UPDATE SKIP LOCKED)
     AND processed_at <= now() - $2::bigint * interval '1 millisecond'",
    "DELETE FROM outbox_messages WHERE ctid IN (
        SELECT ctid FROM outbox_messages
        WHERE published_at <= now() - $2::bigint * interval '1 millisecond'
        LIMIT $1 FOR UPDATE SKIP LOCKED)
     AND published_at <= now() - $2::bigint * interval '1 millisecond'",
];
