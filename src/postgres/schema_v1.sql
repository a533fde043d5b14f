-- idem PostgresStore schema, version 1: the table, its retention index, record_failure.
-- Placeholders, replaced with validated, quoted identifiers before this runs:
--   @S@ the schema, @T@ the table, @P@ the bare table name (used inside quoted derived names).
-- Times are milliseconds since the epoch on the server clock (clock_timestamp()), never the client's.

CREATE TABLE IF NOT EXISTS @S@.@T@ (
  -- Fixed-width columns first: no alignment padding, and no NULLs, so no null bitmap.
  fence       bigint   NOT NULL,
  token       bigint   NOT NULL,
  lease_until bigint   NOT NULL DEFAULT 0,
  retry_at    bigint   NOT NULL DEFAULT 0,
  expires_at  bigint   NOT NULL,
  -- expires_at rounded up to the next second: the only indexed column besides the key, and it
  -- rarely changes when a record completes, so completion is usually a HOT update (no new index
  -- entries, and the old version is pruned in place).
  purge_after bigint   NOT NULL,
  attempts    integer  NOT NULL,
  -- 1 in_progress, 2 completed, 3 failed. Deliberately no CHECK: a damaged value must reach the
  -- decoder and fail closed as corrupt_record_error instead of hiding behind a constraint.
  state       smallint NOT NULL,
  permanent   boolean  NOT NULL DEFAULT false,
  key         bytea    NOT NULL,
  owner       text     NOT NULL DEFAULT '',
  fingerprint bytea    NOT NULL DEFAULT '',
  result      bytea    NOT NULL DEFAULT '',
  error       bytea    NOT NULL DEFAULT '',
  CONSTRAINT "@P@_pkey" PRIMARY KEY (key)
) WITH (fillfactor = 80);  -- room on each page for the completing (HOT) update of its rows

-- Retention: purge walks this index to find expired rows in bounded batches.
CREATE INDEX IF NOT EXISTS "@P@_purge_idx" ON @S@.@T@ (purge_after);

-- The acquire function <table>_acquire is in schema_v2.sql: version 2 replaced version 1's in
-- place (same signature), and a new table gets version 1 and then 2 in one migration.

-- record_failure: transactional mode, record policy. The handler's transaction was rolled back,
-- so the failure is written afresh, unless someone acquired the key since (their fence is then
-- at least ours) - fencing without a lock held across the rollback.
CREATE OR REPLACE FUNCTION @S@."@P@_record_failure"(
    p_key bytea, p_fp bytea, p_owner text, p_fence bigint, p_token bigint, p_attempts integer,
    p_error bytea, p_permanent boolean, p_backoff bigint, p_retention bigint, p_lock_timeout text,
    OUT o_written boolean)
LANGUAGE plpgsql AS $fn$
DECLARE
  v_now bigint := floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint;
BEGIN
  PERFORM set_config('lock_timeout', p_lock_timeout, true);
  INSERT INTO @S@.@T@ AS t (key, state, fence, token, attempts, permanent, lease_until, retry_at,
                            expires_at, purge_after, owner, fingerprint, error)
  VALUES (p_key, 3, p_fence, p_token, p_attempts, p_permanent, 0, v_now + greatest(p_backoff, 0),
          v_now + p_retention, (v_now + p_retention + 999) / 1000 * 1000, p_owner, p_fp, p_error)
  ON CONFLICT (key) DO UPDATE
     SET state = 3, fence = excluded.fence, token = excluded.token, attempts = excluded.attempts,
         permanent = excluded.permanent, lease_until = 0, retry_at = excluded.retry_at,
         expires_at = excluded.expires_at, purge_after = excluded.purge_after, owner = excluded.owner, error = excluded.error,
         result = '',
         fingerprint = CASE WHEN t.expires_at <= v_now THEN excluded.fingerprint ELSE t.fingerprint END
   WHERE t.expires_at <= v_now OR (t.fence < excluded.fence AND t.state <> 2);
  o_written := FOUND;
END
$fn$;
