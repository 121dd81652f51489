-- oncedb schema, version 1: idempotency records, dedup keys, ordering marks, and the
-- transactional inbox and outbox. Applied by `PostgresStore::migrate`, inside one
-- transaction holding an advisory lock, so concurrent service instances apply it once.

-- Fencing epochs: every reservation and take-over draws the next value, so a lease
-- handed out later always carries a larger epoch, even across release and expiry.
CREATE SEQUENCE oncedb_lease_epoch AS bigint;

-- The seed's idempotency_records, with oncedb's byte keys and lease columns.
CREATE TABLE idempotency_records (
    tenant_id bytea NOT NULL,
    operation bytea NOT NULL,
    idempotency_key bytea NOT NULL,
    -- XXH3-128 of the request bytes, 32 lowercase hex digits.
    request_hash text NOT NULL,
    status text NOT NULL CHECK (status IN ('processing', 'completed', 'failed')),
    response_body bytea,
    -- What the lease holder recorded about the operation in flight.
    note bytea,
    -- The lease that may finish the record (fencing token), and the first lease of
    -- this reservation: epochs in [first_epoch, epoch) are fenced.
    epoch bigint NOT NULL,
    first_epoch bigint NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    updated_at timestamptz NOT NULL DEFAULT now(),
    finished_at timestamptz,
    expires_at timestamptz NOT NULL,
    PRIMARY KEY (tenant_id, operation, idempotency_key),
    CHECK (first_epoch <= epoch)
);

-- Finds old completed records for batched cleanup.
CREATE INDEX idempotency_records_expiration_idx
ON idempotency_records (expires_at)
WHERE status IN ('completed', 'failed');

-- Detects records that may require recovery after a worker crash.
CREATE INDEX idempotency_records_processing_idx
ON idempotency_records (updated_at)
WHERE status = 'processing';

-- Dedup keys (`insert_if_absent`): a key is present until expires_at.
CREATE TABLE dedup_keys (
    key bytea PRIMARY KEY,
    expires_at timestamptz NOT NULL
);

CREATE INDEX dedup_keys_expiration_idx ON dedup_keys (expires_at);

-- The ordering guard (`advance`): the newest applied version of each aggregate.
CREATE TABLE ordering_marks (
    tenant_id bytea NOT NULL,
    operation bytea NOT NULL,
    aggregate_id bytea NOT NULL,
    version bigint NOT NULL CHECK (version >= 0),
    expires_at timestamptz NOT NULL,
    PRIMARY KEY (tenant_id, operation, aggregate_id)
);

CREATE INDEX ordering_marks_expiration_idx ON ordering_marks (expires_at);

-- The transactional inbox: one row per message a consumer has applied.
CREATE TABLE inbox_messages (
    consumer_name text NOT NULL,
    message_id text NOT NULL,
    aggregate_id text,
    processed_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer_name, message_id)
);

CREATE INDEX inbox_messages_processed_idx ON inbox_messages (processed_at);

-- The transactional outbox. `id` is the stable message id consumers deduplicate on;
-- `seq` orders the messages of one aggregate.
CREATE TABLE outbox_messages (
    id text PRIMARY KEY DEFAULT gen_random_uuid()::text,
    seq bigint GENERATED ALWAYS AS IDENTITY UNIQUE,
    aggregate_type text NOT NULL,
    aggregate_id text NOT NULL,
    message_type text NOT NULL,
    payload bytea NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    published_at timestamptz
);

CREATE INDEX outbox_messages_unpublished_idx
ON outbox_messages (seq)
WHERE published_at IS NULL;

CREATE INDEX outbox_messages_aggregate_idx
ON outbox_messages (aggregate_type, aggregate_id, seq)
WHERE published_at IS NULL;

CREATE INDEX outbox_messages_published_idx
ON outbox_messages (published_at)
WHERE published_at IS NOT NULL;
