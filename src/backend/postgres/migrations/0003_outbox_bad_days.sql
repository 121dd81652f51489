-- The outbox on bad days.
--
-- Each aggregate numbers its messages in commit order: enqueue takes the next number
-- from the aggregate's row in outbox_aggregates, whose row lock it holds until the
-- caller's transaction ends, so of two open transactions writing for one aggregate the
-- one that commits first gets the lower number. (outbox_messages.seq is taken at
-- insert time and can disagree with commit order.)
--
-- A message that fails to publish is retried with exponential back-off
-- (next_attempt_at), keeps its attempt count and last error, and after the relay's
-- attempt limit is dead (dead_at): it blocks its own aggregate, and no other.
ALTER TABLE outbox_messages
    ADD COLUMN aggregate_seq bigint,
    ADD COLUMN attempts integer NOT NULL DEFAULT 0,
    ADD COLUMN last_error text,
    ADD COLUMN next_attempt_at timestamptz NOT NULL DEFAULT now(),
    ADD COLUMN dead_at timestamptz;

UPDATE outbox_messages SET aggregate_seq = seq;

ALTER TABLE outbox_messages ALTER COLUMN aggregate_seq SET NOT NULL;

CREATE TABLE outbox_aggregates (
    aggregate_type text NOT NULL,
    aggregate_id text NOT NULL,
    last_seq bigint NOT NULL,
    PRIMARY KEY (aggregate_type, aggregate_id)
);

INSERT INTO outbox_aggregates (aggregate_type, aggregate_id, last_seq)
SELECT aggregate_type, aggregate_id, max(seq) FROM outbox_messages
GROUP BY aggregate_type, aggregate_id;

CREATE INDEX outbox_messages_aggregate_seq_idx
ON outbox_messages (aggregate_type, aggregate_id, aggregate_seq)
WHERE published_at IS NULL;
