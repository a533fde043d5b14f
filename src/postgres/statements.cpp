// PostgresStore's prepared statements: their SQL, and their preparation on each pooled session
// (after the schema exists, since they call its functions).

#include <string>

#include <fmt/format.h>

#include "store_impl.hpp"

namespace idem::detail {

void StoreImpl::define_all() {
  const auto define = [this](Stmt st, std::string text, int n) {
    texts[st] = std::move(text);
    nparams[st] = n;
  };
  const std::string fn = qs + ".";
  const std::string clock_ms = "floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint AS ms";
  const std::string now = "(SELECT " + clock_ms + ") c";
  const std::string holder = "t.key = $1 AND t.state = 1 AND t.fence = $2 AND t.token = $3 AND t.expires_at > c.ms";
  // Both acquire statements: a new key is settled by this INSERT alone; only an existing key pays
  // for the plpgsql decision function (a one-time filter on `ins` keeps it from running otherwise).
  const std::string insert_new =
      "ins AS (INSERT INTO " + qt +
      " (key, state, fence, token, attempts, lease_until, expires_at, purge_after, owner, fingerprint) "
      "SELECT $1, 1, 1, $5, 1, cfg.ms + $3, cfg.ms + $4, (cfg.ms + $4 + 999) / 1000 * 1000, $6, $2 "
      "FROM cfg WHERE cfg.how <> 'busy' ON CONFLICT (key) DO NOTHING RETURNING 1 AS one)";
  // How this claim locks (the function's p_lock_timeout, schema_v2.sql), from the claim lock $9
  // (claim_wait none; a simple CASE tries it once): 'nowait' when taken, 'busy' when another
  // transaction holds it (then nothing is inserted: the INSERT would wait on that claimant's), and
  // $7, today's bounded wait, when $9 is NULL (claim_wait bounded). The lock is transaction-scoped:
  // a lease-mode acquire drops it at its implicit commit, a claiming transaction at its end.
  const std::string how =
      "CASE pg_try_advisory_xact_lock($9) WHEN true THEN 'nowait' WHEN false THEN 'busy' ELSE $7 END AS how";
  const std::string acquire_fn = fn + quote_ident(opt.table + "_acquire");
  // The claim of a transaction: cfg sets the claim's lock_timeout before the INSERT can wait on a
  // concurrent claim; fin puts the caller's back (claiming transactions only: $8 <> '') and sets
  // the idle timeout.
  define(kAcquire,
              "WITH cfg AS MATERIALIZED (SELECT current_setting('lock_timeout') AS saved, "
              "set_config('lock_timeout', $7, true) AS lt, " +
                  how + ", " + clock_ms + "), " + insert_new +
                  ", fin AS MATERIALIZED (SELECT CASE WHEN $8 <> '' THEN set_config('lock_timeout', cfg.saved, true) "
                  "END AS a, "
                  "CASE WHEN $8 NOT IN ('', '-') THEN set_config('idle_in_transaction_session_timeout', $8, true) END "
                  "AS b FROM cfg, ins) "
                  "SELECT 0::smallint, 1::bigint, false, 1, 0::bigint, ''::bytea FROM fin "
                  "UNION ALL "
                  "SELECT f.o_status, f.o_fence, f.o_takeover, f.o_attempts, f.o_retry_after, f.o_payload FROM cfg, " +
                  acquire_fn + "($1, $2, $3, $4, $5, $6, cfg.how, $8, cfg.saved) f WHERE NOT EXISTS (SELECT 1 FROM ins)",
              9);
  // acquire in lease mode ($8 = '' always; an implicit transaction of its own): the decisions
  // of kAcquire with what only a claiming transaction needs left out, because the executor sets
  // up every node of a statement on each call, run or not. Nothing to put back (kAcquire's fin
  // is a no-op when $8 = '', and the function restores lock_timeout only when p_idle_timeout is
  // not ''), and no row for a new key: zero rows means the INSERT took the key (fence 1, attempts
  // 1; see decode_acquire_lease), since the function, when called, returns exactly one row or
  // raises. The function is called from the target list of a one-row subquery (OFFSET 0 keeps it
  // from being flattened, so it runs at most once), cheaper to set up than a function scan; the
  // uncorrelated NOT EXISTS is a one-time filter, so it runs only when the INSERT found the key.
  // `mine` / `not_mine`: the extra CTE and filter of kAcquireAgain.
  const auto lease_acquire = [&](const std::string& mine, const std::string& not_mine) {
    return "WITH " + mine + "cfg AS MATERIALIZED (SELECT set_config('lock_timeout', $7, true) AS lt, " + how + ", " +
           clock_ms + "), " + insert_new +
           " SELECT (d).o_status, (d).o_fence, (d).o_takeover, (d).o_attempts, (d).o_retry_after, "
           "(d).o_payload FROM (SELECT " + acquire_fn +
           "($1, $2, $3, $4, $5, $6, cfg.how, $8, NULL) AS d FROM cfg WHERE NOT EXISTS (SELECT 1 FROM ins)" + not_mine +
           " OFFSET 0) s";
  };
  define(kAcquireLease, lease_acquire("", ""), 9);
  // The same acquire sent again after a lost reply: a live in_progress row with our token is the
  // acquisition that reply carried (tokens are per acquire), answered with its fence and nothing
  // written; otherwise the acquire as above (the INSERT of a new key cannot conflict with mine).
  define(kAcquireAgain,
              lease_acquire("mine AS MATERIALIZED (SELECT t.fence, t.attempts FROM " + qt + " t, " + now +
                                " WHERE t.key = $1 AND t.state = 1 AND t.token = $5 AND t.lease_until > c.ms AND "
                                "t.expires_at > c.ms), ",
                            " AND NOT EXISTS (SELECT 1 FROM mine)") +
                  " UNION ALL SELECT 0::smallint, fence, false, attempts, 0::bigint, ''::bytea FROM mine",
              9);
  // acquire_many in lease mode (batch.cpp): up to acquire_many_chunk keys in one statement, each
  // decided exactly as kAcquireLease decides it, with its own fingerprint, lease, retention, token,
  // owner and claim lock ($1..$6, $8: arrays of one element per key, $7 the claim's lock_timeout).
  // `req` tries every key's claim lock (how, as above); one INSERT ... ON CONFLICT DO NOTHING then
  // settles every new key whose lock it holds, and the decision function runs for the others alone.
  // It must not run before the INSERT has finished (a key the INSERT takes is not "existing"), so
  // it is called on the rows of `j`, a LEFT JOIN against the INSERT's RETURNING: a row that finds
  // no match there exists only once the join has read the INSERT to its end, whatever plan it
  // takes (a hash on either side, a merge after sorting it, a nested loop rescanning it); and the
  // UNION's first branch reads `j` to its end before the second calls anything.
  // Row locks are taken with NOWAIT as in kAcquireLease, so a key whose row another transaction
  // holds fails the whole statement with 55P03 (and a record that kept changing with 40001): the
  // caller then decides that chunk's keys one by one with kAcquireLease, which answers those
  // in_flight exactly as acquire does. Answers: one row per key, (i, the six columns of
  // kAcquireLease), i the key's 1-based position; a new key is (i, 0, 1, false, 1, 0, '').
  // `mine`, `mine_join`, `mine_cols`, `mine_*`: the extras of kAcquireManyAgain.
  const auto many_acquire = [&](const std::string& mine, const std::string& mine_join, const std::string& mine_cols,
                                const std::string& mine_got, const std::string& mine_fence,
                                const std::string& mine_attempts) {
    return "WITH cfg AS MATERIALIZED (SELECT set_config('lock_timeout', $7, true) AS lt, " + clock_ms +
           "), req AS MATERIALIZED (SELECT r.i, r.key, r.fp, r.lease, r.retention, r.token, r.owner, "
           "CASE pg_try_advisory_xact_lock(r.lock) WHEN true THEN 'nowait' WHEN false THEN 'busy' ELSE $7 END AS how "
           "FROM cfg, unnest($1::bytea[], $2::bytea[], $3::int8[], $4::int8[], $5::int8[], $6::text[], $8::int8[]) "
           "WITH ORDINALITY AS r(key, fp, lease, retention, token, owner, lock, i)), " +
           mine + "ins AS (INSERT INTO " + qt +
           " (key, state, fence, token, attempts, lease_until, expires_at, purge_after, owner, fingerprint) "
           "SELECT req.key, 1, 1, req.token, 1, cfg.ms + req.lease, cfg.ms + req.retention, "
           "(cfg.ms + req.retention + 999) / 1000 * 1000, req.owner, req.fp FROM req, cfg WHERE req.how <> 'busy' "
           "ON CONFLICT (key) DO NOTHING RETURNING key), "
           "j AS MATERIALIZED (SELECT req.i, req.key, req.fp, req.lease, req.retention, req.token, req.owner, req.how, "
           "ins.key IS NOT NULL AS got" + mine_cols + " FROM req LEFT JOIN ins ON ins.key = req.key" + mine_join +
           ") SELECT j.i, 0::smallint, " + mine_fence + ", false, " + mine_attempts +
           ", 0::bigint, ''::bytea FROM j WHERE j.got" + mine_got +
           " UNION ALL SELECT s.i, (s.d).o_status, (s.d).o_fence, (s.d).o_takeover, (s.d).o_attempts, "
           "(s.d).o_retry_after, (s.d).o_payload FROM (SELECT j.i, " + acquire_fn +
           "(j.key, j.fp, j.lease, j.retention, j.token, j.owner, j.how, '', NULL) AS d FROM j WHERE NOT (j.got" +
           mine_got + ") OFFSET 0) s";
  };
  define(kAcquireMany, many_acquire("", "", "", "", "1::bigint", "1"), 8);
  // Sent again after a lost reply: a key whose live in_progress row carries its token is the
  // acquisition that reply carried, answered with that row's fence and attempts (as kAcquireAgain).
  // `m` reads the statement's snapshot, which does not see the INSERT's rows.
  define(kAcquireManyAgain,
              many_acquire("m AS MATERIALIZED (SELECT req.key, t.fence, t.attempts FROM req JOIN " + qt +
                               " t ON t.key = req.key, cfg WHERE t.state = 1 AND t.token = req.token AND "
                               "t.lease_until > cfg.ms AND t.expires_at > cfg.ms), ",
                           " LEFT JOIN m ON m.key = req.key", ", m.fence AS mfence, m.attempts AS mattempts",
                           " OR j.mfence IS NOT NULL", "CASE WHEN j.got THEN 1::bigint ELSE j.mfence END",
                           "CASE WHEN j.got THEN 1 ELSE j.mattempts END"),
              8);
  // The holder-checked writes. `done` says what this holder's own write left on the row: the
  // Again variant answers one row when it writes now or finds that write already made.
  const auto holder_write = [&](Stmt st, Stmt again, const std::string& set, const std::string& done, int n) {
    const std::string update = "UPDATE " + qt + " t SET " + set + " FROM " + now + " WHERE " + holder;
    define(st, update, n);
    if (again == st) return;
    define(again,
                "WITH u AS (" + update + " RETURNING 1) SELECT 1 FROM u UNION ALL SELECT 1 FROM " + qt + " t, " +
                    now + " WHERE t.key = $1 AND t.fence = $2 AND t.token = $3 AND " + done +
                    " AND t.expires_at > c.ms AND NOT EXISTS (SELECT 1 FROM u)",
                n);
  };
  const std::string expiry = "lease_until = 0, expires_at = c.ms + $5, purge_after = (c.ms + $5 + 999) / 1000 * 1000";
  holder_write(kComplete, kCompleteAgain, "state = 2, result = $4, " + expiry, "t.state = 2 AND NOT t.permanent", 5);
  // Completed without its result: permanent marks it, error says why (acquire answers status 5).
  holder_write(kUnavailable, kUnavailableAgain, "state = 2, result = '', permanent = true, error = $4, " + expiry,
               "t.state = 2 AND t.permanent", 5);
  holder_write(kFail, kFailAgain,
               "state = 3, error = $4, lease_until = 0, permanent = $5, retry_at = c.ms + $6, "
               "expires_at = c.ms + $7, purge_after = (c.ms + $7 + 999) / 1000 * 1000",
               "t.state = 3 AND t.permanent = $5", 7);
  // Extending twice is extending: its own retry needs no variant.
  holder_write(kExtend, kExtend,
               "lease_until = c.ms + $4, expires_at = greatest(t.expires_at, c.ms + $4), "
               "purge_after = (greatest(t.expires_at, c.ms + $4) + 999) / 1000 * 1000",
               "", 4);
  define(kInspect,
              "SELECT state, fence, token, owner, lease_until, retry_at, attempts, permanent, fingerprint, result, "
              "error FROM " +
                  qt + " t, " + now + " WHERE t.key = $1 AND t.expires_at > c.ms",
              1);
  define(kPurge,
              "DELETE FROM " + qt + " d WHERE d.key IN (SELECT t.key FROM " + qt + " t, " + now +
                  " WHERE t.purge_after <= c.ms LIMIT $1 FOR UPDATE OF t SKIP LOCKED)",
              1);
  // tx_complete travels in one pipeline with COMMIT, so it must fail, not match nothing, when the
  // claim is gone: 1 / count(*) raises division_by_zero (22012) on zero rows, and COMMIT then
  // rolls back instead of committing business writes without their record.
  define(kTxComplete,
              "WITH u AS (UPDATE " + qt +
                  " t SET state = 2, result = $4, lease_until = 0, expires_at = c.ms + $5, "
                  "purge_after = (c.ms + $5 + 999) / 1000 * 1000 FROM " +
                  now +
                  " WHERE t.key = $1 AND t.state = 1 AND t.fence = $2 AND t.token = $3 RETURNING 1) "
                  "SELECT 1 / count(*)::int FROM u",
              5);
  define(kRecordFailure,
              "SELECT o_written FROM " + fn + quote_ident(opt.table + "_record_failure") +
                  "($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)",
              11);
}

void StoreImpl::prepare(Connection& c) {
  if (c.prepared(statement_set)) return;
  if (opt.auto_migrate) ensure_migrated(c.pg);
  // Behind a transaction-mode pooler the next transaction may run on another server session,
  // where nothing of ours is prepared: every statement is then sent unnamed, with its text.
  if (!client.options().transaction_pooler) {
    for (std::size_t st = 0; st < kStatementCount; ++st) {
      PostgresResult r = ResultAccess::wrap(PQprepare(c.pg, names[st].c_str(), texts[st].c_str(), nparams[st], nullptr));
      if (!result_ok(ResultAccess::native(r))) {
        const std::string code = sqlstate_of(ResultAccess::native(r));
        if (code == "42P05") {  // on a session this connection never prepared on: a pooler hands sessions round
          // The name is derived from the text, so it is this very statement, prepared by another
          // client of the pooler; unless someone else took the name, which is said too.
          const char* name = names[st].c_str();
          PostgresResult q = exec_text(c.pg, "SELECT statement FROM pg_prepared_statements WHERE name = $1", &name, 1);
          const PGresult* qn = ResultAccess::native(q);
          const bool foreign = result_ok(qn) && PQntuples(qn) == 1 && texts[st] != PQgetvalue(qn, 0, 0);
          throw invalid_options_error(fmt::format(
              "idem: prepared statement {} already exists on a new session{}: the conninfo reaches a "
              "transaction-mode pooler (PgBouncer pool_mode=transaction); set PostgresOptions::transaction_pooler",
              names[st], foreign ? " with another statement's text" : ""));
        }
        throw_result(fmt::format("prepare {}", names[st]), ResultAccess::native(r), c.pg, store_missing);
      }
    }
  }
  c.sets.push_back(statement_set);
}

int StoreImpl::send_statement(PGconn* c, Stmt st, const Params& p) const {
  if (client.options().transaction_pooler)
    return PQsendQueryParams(c, texts[st].c_str(), p.size(), nullptr, p.values(), p.lengths(), p.formats(), 1);
  return PQsendQueryPrepared(c, names[st].c_str(), p.size(), p.values(), p.lengths(), p.formats(), 1);
}

}  // namespace idem::detail
