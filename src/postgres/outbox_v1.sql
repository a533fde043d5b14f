-- The transactional outbox of one PostgresStore table (PostgresStoreOptions::outbox): a handler's
-- OutboxWriter::send inserts a row in its claiming transaction; idem::OutboxRelay publishes the
-- committed rows and marks them sent. Idempotent (IF NOT EXISTS): migrate() runs it every time
-- the store's outbox option is on, under the schema's advisory lock.
-- @S@ = quoted schema, @O@ = quoted outbox table, @P@ = outbox table name (for index names).
CREATE TABLE IF NOT EXISTS @S@.@O@ (
  seq bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,  -- outbox order (per message_key: publish order)
  id text NOT NULL UNIQUE,                 -- stable id: re-runs of a handler write the same ids
  destination bytea NOT NULL,              -- stream / topic / exchange, bytes as the handler gave them
  message_key bytea NOT NULL,              -- ordering key
  payload bytea NOT NULL,
  headers bytea NOT NULL,                  -- (u32 length, name, u32 length, value)*, big-endian
  created_at bigint NOT NULL,              -- ms since the epoch, server clock
  attempts integer NOT NULL DEFAULT 0,     -- failed publish attempts
  next_attempt_at bigint NOT NULL DEFAULT 0,  -- ms; a failed row waits until then (backoff)
  last_error text,
  sent_at bigint                           -- ms; NULL = not sent yet
);
-- The relay's claim (unsent rows in outbox order) and its per-key check (an earlier unsent row of
-- the same key holds a row back); both partial, so sent rows waiting for the purge cost nothing.
CREATE INDEX IF NOT EXISTS "@P@_unsent_idx" ON @S@.@O@ (seq) WHERE sent_at IS NULL;
CREATE INDEX IF NOT EXISTS "@P@_key_idx" ON @S@.@O@ (message_key, seq) WHERE sent_at IS NULL;
CREATE INDEX IF NOT EXISTS "@P@_sent_idx" ON @S@.@O@ (sent_at) WHERE sent_at IS NOT NULL;
