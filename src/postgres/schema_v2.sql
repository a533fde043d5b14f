-- idem PostgresStore schema, version 2: the acquire function, which since version 2 answers a
-- record completed without its result (permanent on a completed row, see complete_unavailable)
-- with status 5 and the reason, instead of a duplicate with an empty result. Same signature as
-- version 1's, so CREATE OR REPLACE upgrades a version-1 table in place; a statement prepared
-- before the upgrade calls the new body.
-- Placeholders as in schema_v1.sql: @S@ schema, @T@ table, @P@ bare table name.

-- acquire: the whole decision of docs/design.md in one statement (one round trip).
-- A new key is one INSERT; otherwise decisions that change nothing come from an unlocked read,
-- and a write takes the row lock and decides again on the locked row. p_lock_timeout is how the
-- claim locks (docs/postgres.md, "How a claim locks"):
--   'nowait' the caller holds the key's claim lock (an advisory lock on a hash of table and key)
--            and already tried the INSERT: the row lock is taken with FOR UPDATE NOWAIT;
--   'busy'   another transaction holds the claim lock: nothing is written and nothing waits; a
--            decision that would write (or a key not there yet) answers in flight;
--   a number (ms) bounds the wait for a row held by another transaction (claim_wait bounded).
-- Either way lock_not_available (55P03) means "in flight".
-- p_idle_timeout: '' = a lease-mode call (its own implicit transaction); otherwise a claiming
-- transaction: '-' leaves idle_in_transaction_session_timeout alone, a number (ms, the lease) ends
-- a session left idle inside its transaction for longer, so a paused holder cannot keep the key.
-- p_restore_lock_timeout: the caller's lock_timeout to put back (the statement that calls this may
-- already have set the claim's). Status codes: 0 acquired, 1 in_flight, 2 duplicate,
-- 3 previously_failed, 4 mismatch, 5 duplicate whose result was not stored (payload: why).
-- The store's prepared acquire statement tries the INSERT of a new key itself (no function call,
-- the common case) and calls this only when the key exists.
CREATE OR REPLACE FUNCTION @S@."@P@_acquire"(
    p_key bytea, p_fp bytea, p_lease bigint, p_retention bigint, p_token bigint, p_owner text,
    p_lock_timeout text, p_idle_timeout text, p_restore_lock_timeout text,
    OUT o_status smallint, OUT o_fence bigint, OUT o_takeover boolean, OUT o_attempts integer,
    OUT o_retry_after bigint, OUT o_payload bytea)
LANGUAGE plpgsql AS $fn$
DECLARE
  v_now   bigint := floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint;
  v_saved text   := coalesce(p_restore_lock_timeout, current_setting('lock_timeout'));
  r       @S@.@T@%ROWTYPE;
  v_pass  integer := 0;
  v_locking boolean := false;
  v_mode  text    := CASE WHEN p_lock_timeout IN ('nowait', 'busy') THEN p_lock_timeout ELSE 'wait' END;
  v_insert boolean := p_lock_timeout NOT IN ('nowait', 'busy');  -- 'nowait': the caller's INSERT found the key
BEGIN
  o_status := 1; o_fence := 0; o_takeover := false; o_attempts := 0; o_retry_after := 0; o_payload := '';
  IF v_mode = 'wait' THEN
    PERFORM set_config('lock_timeout', p_lock_timeout, true);
  END IF;
  IF p_idle_timeout NOT IN ('', '-') THEN
    PERFORM set_config('idle_in_transaction_session_timeout', p_idle_timeout, true);
  END IF;
  <<decide>>
  LOOP
    v_pass := v_pass + 1;
    IF v_pass > 6 THEN
      RAISE EXCEPTION 'idem: the record kept changing during acquire; retry' USING ERRCODE = '40001';
    END IF;
    IF NOT v_locking THEN
      -- The common case, a new key, is settled by this one statement.
      IF v_insert THEN
        INSERT INTO @S@.@T@ (key, state, fence, token, attempts, lease_until, expires_at, purge_after,
                             owner, fingerprint)
        VALUES (p_key, 1, 1, p_token, 1, v_now + p_lease, v_now + p_retention,
                (v_now + p_retention + 999) / 1000 * 1000, p_owner, p_fp)
        ON CONFLICT (key) DO NOTHING;
        IF FOUND THEN
          o_status := 0; o_fence := 1; o_attempts := 1;
          EXIT decide;
        END IF;
      END IF;
      SELECT * INTO r FROM @S@.@T@ t WHERE t.key = p_key;
    ELSIF v_mode = 'nowait' THEN
      SELECT * INTO r FROM @S@.@T@ t WHERE t.key = p_key FOR UPDATE NOWAIT;
    ELSE
      SELECT * INTO r FROM @S@.@T@ t WHERE t.key = p_key FOR UPDATE;
    END IF;
    IF NOT FOUND THEN
      -- 'busy': the key's claimant has not committed its INSERT (or a hash collision): in flight.
      IF v_mode = 'busy' THEN o_retry_after := p_lease; EXIT decide; END IF;
      v_locking := false; v_insert := true;  -- purged between the statements: insert again
      CONTINUE decide;
    END IF;
    IF r.state NOT IN (1, 2, 3) OR r.fence < 1 OR r.attempts < 1 THEN
      RAISE EXCEPTION 'idem: corrupt record (state %, fence %, attempts %)', r.state, r.fence, r.attempts
        USING ERRCODE = 'XX001';
    END IF;
    IF r.expires_at <= v_now THEN
      -- An expired record is absent: start over at fence 1 (the token keeps old holders out).
      IF v_mode = 'busy' THEN o_retry_after := p_lease; EXIT decide; END IF;  -- someone is claiming it
      IF NOT v_locking THEN v_locking := true; CONTINUE decide; END IF;
      UPDATE @S@.@T@ t SET state = 1, fence = 1, token = p_token, attempts = 1, permanent = false,
             lease_until = v_now + p_lease, retry_at = 0, expires_at = v_now + p_retention,
             purge_after = (v_now + p_retention + 999) / 1000 * 1000, owner = p_owner, fingerprint = p_fp, result = '', error = ''
       WHERE t.key = p_key;
      o_status := 0; o_fence := 1; o_attempts := 1;
      EXIT decide;
    END IF;
    o_attempts := r.attempts;
    IF p_fp <> ''::bytea AND r.fingerprint <> ''::bytea AND r.fingerprint <> p_fp THEN
      o_status := 4;
      EXIT decide;
    END IF;
    IF r.state = 2 AND r.permanent THEN  -- completed without its result (complete_unavailable)
      o_status := 5; o_payload := r.error;
      EXIT decide;
    ELSIF r.state = 2 THEN
      o_status := 2; o_payload := r.result;
      EXIT decide;
    ELSIF r.state = 1 AND r.lease_until > v_now THEN
      o_status := 1; o_retry_after := r.lease_until - v_now;
      EXIT decide;
    ELSIF r.state = 3 AND r.permanent THEN
      o_status := 3; o_payload := r.error;
      EXIT decide;
    ELSIF r.state = 3 AND r.retry_at > v_now THEN
      o_status := 1; o_retry_after := r.retry_at - v_now;
      EXIT decide;
    END IF;
    -- It would acquire: decide again under the row lock before writing ('busy': someone is on it).
    IF v_mode = 'busy' THEN o_status := 1; o_retry_after := p_lease; EXIT decide; END IF;
    IF NOT v_locking THEN v_locking := true; CONTINUE decide; END IF;
    UPDATE @S@.@T@ t SET state = 1, fence = r.fence + 1, token = p_token, owner = p_owner,
           lease_until = v_now + p_lease, retry_at = 0, attempts = r.attempts + 1, error = '',
           expires_at = greatest(r.expires_at, v_now + p_retention),
           purge_after = (greatest(r.expires_at, v_now + p_retention) + 999) / 1000 * 1000
     WHERE t.key = p_key;
    o_status := 0; o_fence := r.fence + 1; o_attempts := r.attempts + 1; o_takeover := (r.state = 1);
    EXIT decide;
  END LOOP;
  -- Lease mode ('') runs in its own implicit transaction, which ends the setting anyway; in a
  -- claiming transaction the handler's statements must not inherit the claim's lock_timeout.
  IF p_idle_timeout <> '' THEN
    PERFORM set_config('lock_timeout', v_saved, true);
  END IF;
END
$fn$;
