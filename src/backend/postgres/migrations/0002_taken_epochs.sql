-- The epochs take-overs replaced on a record, oldest first: exactly the leases fenced on
-- it. Epochs come from one sequence for every record, so the range between a record's
-- first and current epoch also holds other records' epochs.
ALTER TABLE idempotency_records
    ADD COLUMN taken_epochs bigint[] NOT NULL DEFAULT '{}';
