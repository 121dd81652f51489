-- Keys as long as the embedded store accepts: a tenant and an operation of up to 1 KiB
-- each and keys of up to 64 KiB exceed what one btree entry holds (2704 bytes), so
-- every table is keyed by a SHA-256 digest of its key parts instead, and keeps the
-- full key in its own columns. Every statement looks a row up by the digest and
-- compares the full key as well.

-- The digest of a scoped key: tenant and operation length-prefixed (4 bytes, big
-- endian), so that no two different (tenant, operation, key) triples share an input.
CREATE FUNCTION oncedb_digest(tenant bytea, operation bytea, key bytea) RETURNS bytea
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
AS $$
    SELECT sha256(int4send(length(tenant)) || tenant
                  || int4send(length(operation)) || operation || key)
$$;

ALTER TABLE idempotency_records
    ADD COLUMN key_digest bytea NOT NULL
        GENERATED ALWAYS AS (oncedb_digest(tenant_id, operation, idempotency_key)) STORED;
ALTER TABLE idempotency_records
    DROP CONSTRAINT idempotency_records_pkey,
    ADD PRIMARY KEY (key_digest);

ALTER TABLE dedup_keys
    ADD COLUMN key_digest bytea NOT NULL GENERATED ALWAYS AS (sha256(key)) STORED;
ALTER TABLE dedup_keys
    DROP CONSTRAINT dedup_keys_pkey,
    ADD PRIMARY KEY (key_digest);

ALTER TABLE ordering_marks
    ADD COLUMN key_digest bytea NOT NULL
        GENERATED ALWAYS AS (oncedb_digest(tenant_id, operation, aggregate_id)) STORED;
ALTER TABLE ordering_marks
    DROP CONSTRAINT ordering_marks_pkey,
    ADD PRIMARY KEY (key_digest);
