// PostgresStore's lease-mode transitions: each one prepared statement on a pooled session,
// decoded from PostgreSQL's binary format.

#include <openssl/evp.h>

#include <algorithm>
#include <utility>

#include <fmt/format.h>

#include "idem/core/error.hpp"
#include "idem/core/fingerprint.hpp"
#include "idem/detail/warning_relay.hpp"
#include "idem/core/validate.hpp"
#include "store_impl.hpp"

namespace idem {
namespace detail {

namespace {

constexpr std::array<const char*, kStatementCount> statement_suffixes{
    "acquire",     "acquire_lease",      "acquire_again", "complete", "complete_again", "unavailable",
    "unavailable_again", "fail", "fail_again", "extend", "inspect", "purge", "tx_complete", "record_failure",
    "acquire_many", "acquire_many_again"};

PostgresStoreOptions checked(PostgresStoreOptions o) {
  if (!valid_identifier(o.schema, 63) || o.schema.rfind("pg_", 0) == 0)
    throw invalid_options_error(
        fmt::format("idem: PostgresStoreOptions::schema '{}' is not a plain identifier; use "
                    "[a-z_][a-z0-9_]* (max 63, not pg_*)",
                    o.schema.substr(0, 80)));
  if (!valid_identifier(o.table, 40))
    throw invalid_options_error(
        fmt::format("idem: PostgresStoreOptions::table '{}' is not a plain identifier; use [a-z_][a-z0-9_]* (max 40)",
                    o.table.substr(0, 80)));
  if (o.claim_wait != PostgresClaimWait::none && o.claim_wait != PostgresClaimWait::bounded)
    throw invalid_options_error("idem: PostgresStoreOptions::claim_wait must be none or bounded");
  if (o.lock_timeout <= millis{0})
    throw invalid_options_error(
        "idem: PostgresStoreOptions::lock_timeout must be > 0; it bounds how long a duplicate waits");
  if (o.max_result_bytes == 0 || o.max_result_bytes > max_pg_result_bytes)
    throw invalid_options_error(fmt::format(
        "idem: PostgresStoreOptions::max_result_bytes must be 1..{} (bytea holds at most 1 GB); the default is 64 MiB",
        max_pg_result_bytes));
  if (o.batch_sessions == 0 || o.batch_sessions > 64)
    throw invalid_options_error("idem: PostgresStoreOptions::batch_sessions must be 1..64 (sessions a batch's "
                                "completions spread over); the default is 4");
  if (o.isolation != "read committed" && o.isolation != "repeatable read" && o.isolation != "serializable")
    throw invalid_options_error(
        "idem: PostgresStoreOptions::isolation must be \"read committed\", "
        "\"repeatable read\" or \"serializable\"");
  return o;
}

std::uint64_t as_u64(std::int64_t v) { return static_cast<std::uint64_t>(v); }

}  // namespace

AcquireResult decode_acquire_lease(const PGresult* r, std::uint64_t token) {
  if (PQntuples(r) != 0 || PQnfields(r) != 6) return decode_acquire(r, token);
  AcquireResult a;
  a.status = AcquireStatus::acquired;
  a.attempts = 1;
  a.holder = {1, token};
  return a;
}

void check_pg_key(std::string_view key) {
  // The store's own limit: no option raises it, so the advice is to hash, not to raise a limit.
  if (key.size() > max_pg_key_bytes)
    throw invalid_key_error(
        fmt::format("idem: the idempotency key is {} bytes, over PostgresStore's limit of {} (a "
                    "btree entry); hash long keys (idem::fingerprint)",
                    key.size(), max_pg_key_bytes));
}

std::string clean_owner(std::string_view o) {
  std::string s(o.substr(0, 200));
  for (char& ch : s)
    if (static_cast<unsigned char>(ch) < 0x20 || static_cast<unsigned char>(ch) > 0x7e) ch = '?';
  return s;
}

Params& Params::operator=(const Params& o) {
  if (this == &o) return *this;
  n_ = o.n_;
  owned_ = o.owned_;
  store_ = o.store_;
  lens_ = o.lens_;
  fmts_ = o.fmts_;
  for (int i = 0; i < cap; ++i) vals_[i] = owned_[i] ? store_[i].c_str() : o.vals_[i];
  return *this;
}

Params& Params::bin(std::string_view v) {
  vals_[n_] = v.data() ? v.data() : "";
  lens_[n_] = static_cast<int>(v.size());
  fmts_[n_] = 1;
  owned_[n_] = false;
  ++n_;
  return *this;
}

Params& Params::owned_bin(std::string v) {
  store_[n_] = std::move(v);
  vals_[n_] = store_[n_].c_str();
  lens_[n_] = static_cast<int>(store_[n_].size());
  fmts_[n_] = 1;
  owned_[n_] = true;
  ++n_;
  return *this;
}

Params& Params::null() {
  vals_[n_] = nullptr;
  lens_[n_] = 0;
  fmts_[n_] = 0;
  owned_[n_] = false;
  ++n_;
  return *this;
}

Params& Params::text(std::string v) {
  store_[n_] = std::move(v);
  vals_[n_] = store_[n_].c_str();
  lens_[n_] = 0;
  fmts_[n_] = 0;
  owned_[n_] = true;
  ++n_;
  return *this;
}

// PQfname is null for a column the result does not have: a row narrower than our statement's is
// corrupt_record_error too, never a null std::string.
std::string column_name(const PGresult* r, int col) {
  const char* n = PQfname(r, col);
  return n ? std::string(n) : fmt::format("#{} (missing)", col);
}

std::int64_t be_int(const PGresult* r, int row, int col, int bytes) {
  if (PQgetisnull(r, row, col) || PQgetlength(r, row, col) != bytes)
    throw corrupt_record_error(
        fmt::format("idem: postgres returned an unreadable value in column {}", column_name(r, col)));
  const auto* p = reinterpret_cast<const unsigned char*>(PQgetvalue(r, row, col));
  std::uint64_t v = 0;
  for (int i = 0; i < bytes; ++i) v = (v << 8) | p[i];
  if (bytes < 8 && (p[0] & 0x80)) v |= ~std::uint64_t{0} << (8 * bytes);  // sign-extend
  return static_cast<std::int64_t>(v);
}

std::string bytes_of(const PGresult* r, int row, int col) {
  if (PQgetisnull(r, row, col))
    throw corrupt_record_error(fmt::format("idem: postgres returned NULL in column {}", column_name(r, col)));
  return std::string(PQgetvalue(r, row, col), static_cast<std::size_t>(PQgetlength(r, row, col)));
}

AcquireResult decode_acquire(const PGresult* r, std::uint64_t token) {
  if (PQntuples(r) != 1 || PQnfields(r) != 6)
    throw corrupt_record_error("idem: postgres acquire returned an unexpected shape");
  return decode_acquire_row(r, 0, 0, token);
}

AcquireResult decode_acquire_row(const PGresult* r, int row, int col, std::uint64_t token) {
  AcquireResult a;
  const auto st = be_int(r, row, col, 2);
  if (st < 0 || st > 5) throw corrupt_record_error(fmt::format("idem: postgres acquire returned status {}", st));
  // 5 (schema v2): a duplicate whose result was not stored; the payload is why.
  a.status = st == 5 ? AcquireStatus::duplicate : static_cast<AcquireStatus>(st);
  a.result_unavailable = st == 5;
  a.takeover = bool_of(r, row, col + 2);
  a.attempts = static_cast<std::uint32_t>(be_int(r, row, col + 3, 4));
  a.retry_after = millis{std::max<std::int64_t>(0, be_int(r, row, col + 4, 8))};
  a.payload = bytes_of(r, row, col + 5);
  if (a.status == AcquireStatus::acquired) a.holder = {as_u64(be_int(r, row, col + 1, 8)), token};
  return a;
}

StoreImpl::StoreImpl(std::shared_ptr<PostgresClient> c, PostgresStoreOptions o)
    : client_ptr(std::move(c)),
      client(ClientAccess::of(client_ptr, "PostgresStore")),
      opt(checked(std::move(o))),
      qs(quote_ident(opt.schema)),
      qt(qs + "." + quote_ident(opt.table)),
      begin_sql("BEGIN ISOLATION LEVEL " + opt.isolation),
      lock_timeout_text(std::to_string(opt.lock_timeout.count())),
      statement_set(client.statement_set(qt)) {
  define_all();
  // A name says what it runs: its kind, then SHA-256 of the format version and the statement's
  // whole text (which holds the schema and table). Two stores, two clients or two services that
  // meet on one server session (a transaction-mode pooler hands sessions round) can then share a
  // name only when they share the statement, and a name never runs another table's SQL.
  for (std::size_t i = 0; i < names.size(); ++i)
    names[i] = fmt::format("idem_{}_{}", statement_suffixes[i],
                           idem::fingerprint(std::string(kStatementFormat) + '\0' + texts[i]).substr(0, 24));
}

Params StoreImpl::completion(std::string_view key, const Holder& h, std::string_view value, millis retention) const {
  check_holder(key, h);
  check_lease(retention, "retention");
  Params p;
  p.bin(key).num(as_i64(h.fence)).num(as_i64(h.token)).bin(value).num(retention.count());
  return p;
}

Params StoreImpl::acquire_params(std::string_view key, const AcquireParams& ap, const std::string& owner,
                                 bool tx) const {
  Params p;
  p.bin(key).bin(ap.fingerprint).num(ap.lease.count()).num(ap.retention.count()).num(as_i64(ap.token));
  p.text(owner).text(lock_timeout_text);
  p.text(!tx ? std::string() : opt.idle_timeout_is_lease ? std::to_string(ap.lease.count()) : std::string("-"));
  // $9: the claim lock to try, or NULL (claim_wait bounded: pg_try_advisory_xact_lock(NULL) is
  // NULL, and the statement then inserts and waits as before).
  if (opt.claim_wait == PostgresClaimWait::none)
    p.num(claim_lock_id(key));
  else
    p.null();
  return p;
}

Params StoreImpl::failure_record(std::string_view key, std::string_view fingerprint, const std::string& owner,
                                 const AcquireResult& d, const FailParams& f) const {
  Params p;
  p.bin(key).bin(fingerprint).text(owner).num(as_i64(d.holder.fence)).num(as_i64(d.holder.token)).num(d.attempts);
  p.bin(f.error).boolean(f.permanent).num(std::max<std::int64_t>(0, f.backoff.count())).num(f.retention.count());
  p.text(lock_timeout_text);
  return p;
}

std::int64_t StoreImpl::claim_lock_id(std::string_view key) const {
  std::string in;
  in.reserve(qt.size() + 1 + key.size());
  in.append(qt).push_back('\0');
  in.append(key);
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  if (EVP_Digest(in.data(), in.size(), md, &len, EVP_sha256(), nullptr) != 1 || len < 8)
    throw error("idem: OpenSSL EVP_Digest(SHA-256) failed", false);
  std::uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v = (v << 8) | md[i];
  return static_cast<std::int64_t>(v);
}

AcquireResult StoreImpl::lock_busy(const AcquireParams& ap) {
  AcquireResult a;
  a.status = AcquireStatus::in_flight;
  a.retry_after = ap.lease;
  return a;
}

std::optional<Record> decode_inspect(const PGresult* res, std::string_view key) {
  if (PQntuples(res) == 0) return std::nullopt;
  if (PQnfields(res) != 11)
    throw corrupt_record_error(fmt::format("idem: postgres inspect of key '{}' returned {} columns, not 11",
                                           key.substr(0, 64), PQnfields(res)));
  Record rec;
  const auto st = be_int(res, 0, 0, 2);
  if (st < 1 || st > 3)
    throw corrupt_record_error(fmt::format("idem: the record of key '{}' has state {}", key.substr(0, 64), st));
  rec.state = static_cast<State>(st);
  rec.holder = {as_u64(be_int(res, 0, 1, 8)), as_u64(be_int(res, 0, 2, 8))};
  rec.owner = bytes_of(res, 0, 3);
  rec.lease_until_ms = be_int(res, 0, 4, 8);
  rec.retry_at_ms = be_int(res, 0, 5, 8);
  const auto attempts = be_int(res, 0, 6, 4);
  if (rec.holder.fence == 0 || attempts < 1 || static_cast<std::int64_t>(rec.holder.fence) < 0)
    throw corrupt_record_error(fmt::format("idem: the record of key '{}' has fence {} and attempts {}",
                                           key.substr(0, 64), static_cast<std::int64_t>(rec.holder.fence), attempts));
  rec.attempts = static_cast<std::uint32_t>(attempts);
  rec.permanent = bool_of(res, 0, 7);
  rec.fingerprint = bytes_of(res, 0, 8);
  rec.result = bytes_of(res, 0, 9);
  rec.error = bytes_of(res, 0, 10);
  return rec;
}

}  // namespace detail

using detail::Params;
using detail::ResultAccess;

PostgresStore::PostgresStore(PostgresOptions options, PostgresStoreOptions store)
    : PostgresStore(std::make_shared<PostgresClient>(std::move(options)), std::move(store)) {}
PostgresStore::PostgresStore(std::shared_ptr<PostgresClient> client, PostgresStoreOptions store)
    : impl_(std::make_unique<detail::StoreImpl>(std::move(client), std::move(store))) {}
PostgresStore::~PostgresStore() = default;
PostgresStore::PostgresStore(PostgresStore&&) noexcept = default;
PostgresStore& PostgresStore::operator=(PostgresStore&&) noexcept = default;

bool PostgresStore::transactional() const noexcept { return impl_->opt.mode == PostgresMode::transactional; }

void PostgresStore::attach_observer(const std::shared_ptr<Observer>& o) const {
  detail::attach_to_relay(impl_->client.options().observer, o);
}
const PostgresStoreOptions& PostgresStore::options() const noexcept { return impl_->opt; }
StoreLimits PostgresStore::limits() const noexcept { return {max_key_bytes, impl_->opt.max_result_bytes}; }
const std::shared_ptr<PostgresClient>& PostgresStore::client() const noexcept { return impl_->client_ptr; }
const std::string& PostgresStore::qualified_table() const noexcept { return impl_->qt; }

void PostgresStore::migrate() { impl_->migrate(); }

AcquireResult PostgresStore::acquire(std::string_view key, const AcquireParams& ap) {
  detail::check_acquire(key, ap);
  detail::check_pg_key(key);
  Params p = impl_->acquire_params(key, ap, detail::clean_owner(ap.owner), false);
  PostgresResult r = impl_->exchange(detail::kAcquireLease, detail::kAcquireAgain, p, "acquire", true);
  const PGresult* res = ResultAccess::native(r);
  if (!detail::result_ok(res)) {
    if (detail::sqlstate_of(res) == "55P03") return detail::StoreImpl::lock_busy(ap);
    detail::throw_result("acquire", res, nullptr, detail::store_missing);
  }
  return detail::decode_acquire_lease(res, ap.token);
}

WriteStatus PostgresStore::complete(std::string_view key, const Holder& h, std::string_view result, millis retention) {
  if (result.size() > impl_->opt.max_result_bytes)
    throw usage_error(
        fmt::format("idem: a result of {} bytes is over PostgresStoreOptions::max_result_bytes ({}); "
                    "nothing was written, use complete_unavailable",
                    result.size(), impl_->opt.max_result_bytes));
  return impl_->write(detail::kComplete, detail::kCompleteAgain, impl_->completion(key, h, result, retention),
                      "complete");
}

WriteStatus PostgresStore::complete_unavailable(std::string_view key, const Holder& h, std::string_view reason,
                                                millis retention) {
  return impl_->write(detail::kUnavailable, detail::kUnavailableAgain, impl_->completion(key, h, reason, retention),
                      "complete_unavailable");
}

WriteStatus PostgresStore::fail(std::string_view key, const Holder& h, const FailParams& f) {
  detail::check_holder(key, h);
  detail::check_lease(f.retention, "retention");
  Params p;
  p.bin(key).num(detail::as_i64(h.fence)).num(detail::as_i64(h.token)).bin(f.error);
  p.boolean(!f.release && f.permanent).num(f.release ? 0 : std::max<std::int64_t>(0, f.backoff.count()));
  p.num(f.retention.count());
  return impl_->write(detail::kFail, detail::kFailAgain, p, "fail");
}

WriteStatus PostgresStore::extend(std::string_view key, const Holder& h, millis lease) {
  detail::check_holder(key, h);
  detail::check_lease(lease);
  Params p;
  p.bin(key).num(detail::as_i64(h.fence)).num(detail::as_i64(h.token)).num(lease.count());
  return impl_->write(detail::kExtend, detail::kExtend, p, "extend");
}

std::optional<Record> PostgresStore::inspect(std::string_view key) {
  detail::check_key(key, static_cast<std::size_t>(-1));
  Params p;
  p.bin(key);
  PostgresResult r = impl_->run(detail::kInspect, detail::kInspect, p, "inspect", false);
  return detail::decode_inspect(ResultAccess::native(r), key);
}

std::size_t PostgresStore::purge_expired(std::size_t batch, std::size_t max_batches) {
  if (batch == 0) throw invalid_options_error("idem: purge_expired batch must be > 0");
  std::size_t total = 0;
  for (std::size_t i = 0; i < max_batches; ++i) {
    Params p;
    p.num(static_cast<std::int64_t>(batch));
    // Deleting expired rows again deletes nothing twice: safe to send again.
    const std::uint64_t n = impl_->run(detail::kPurge, detail::kPurge, p, "purge", false).affected();
    total += n;
    if (n < batch) break;
  }
  return total;
}

PostgresStore::Transaction PostgresStore::begin(std::string_view key, const AcquireParams& ap) {
  detail::check_acquire(key, ap);
  detail::check_pg_key(key);
  return impl_->begin(key, ap);
}

}  // namespace idem
