// The writer side of the transactional outbox: OutboxWriter::send inserts a row into the store's
// outbox table on the claiming transaction's own session, so it commits (or not) with the handler.

#include <openssl/evp.h>

#include <string>

#include <fmt/format.h>

#include "idem/core/error.hpp"
#include "idem/core/hex.hpp"
#include "idem/postgres/store.hpp"
#include "store_impl.hpp"

namespace idem {

namespace {

std::string sha256_hex(std::string_view in) {
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  if (EVP_Digest(in.data(), in.size(), md, &len, EVP_sha256(), nullptr) != 1)
    throw error("idem: OpenSSL EVP_Digest(SHA-256) failed", false);
  return detail::to_hex(md, len);
}

void put_u32(std::string& out, std::size_t n) {
  if (n > 0xffffffffu) throw usage_error("idem: outbox header longer than 4 GiB");
  for (int s = 24; s >= 0; s -= 8) out += static_cast<char>((n >> s) & 0xff);
}

}  // namespace

std::string outbox_message_id(std::string_view scope, std::string_view key, std::uint32_t index) {
  std::string in(scope);
  in += '\0';
  in.append(key);
  return sha256_hex(in).substr(0, 32) + "-" + std::to_string(index);
}

std::string outbox_channel(std::string_view schema, std::string_view table) {
  return "idem_outbox_" + sha256_hex(std::string(schema) + "." + std::string(table)).substr(0, 16);
}

OutboxWriter PostgresStore::Transaction::outbox() noexcept { return OutboxWriter(*this); }

std::uint32_t OutboxWriter::sent() const noexcept { return tx_->outbox_sent_; }

std::string OutboxWriter::send(std::string_view destination, std::string_view message_key, std::string_view payload,
                               const OutboxHeaders& headers) {
  PostgresStore::Transaction& tx = *tx_;
  if (!tx.conn_) throw usage_error("idem: outbox send on a transaction that is not open (not acquired, or already ended)");
  const detail::StoreImpl& s = *tx.store_;
  if (!s.opt.outbox)
    throw usage_error(
        fmt::format("idem: outbox send on a store without an outbox: set PostgresStoreOptions::outbox = "
                    "true (migrate() then creates {}_outbox)",
                    s.opt.table));
  std::string encoded;
  for (const auto& [name, value] : headers) {
    put_u32(encoded, name.size());
    encoded += name;
    put_u32(encoded, value.size());
    encoded += value;
  }
  const std::string id = outbox_message_id(s.opt.schema + "." + s.opt.table, tx.key_, tx.outbox_sent_);
  const std::string channel = outbox_channel(s.opt.schema, s.opt.table);
  // pg_notify in the transaction is delivered at commit only, and notifications of one transaction
  // on one channel with one payload are folded into one: a relay wakes once per committed handler.
  const std::string sql =
      "WITH i AS (INSERT INTO " + s.qs + "." + detail::quote_ident(s.opt.table + "_outbox") +
      " (id, destination, message_key, payload, headers, created_at) VALUES ($1, $2, $3, $4, $5, "
      "floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint) ON CONFLICT (id) DO NOTHING RETURNING 1) "
      "SELECT pg_notify($6, '')";
  detail::Params p;
  p.text(id).bin(destination).bin(message_key).bin(payload).bin(encoded).text(channel);
  PGconn* c = tx.conn_->pg;
  PostgresResult r = detail::ResultAccess::wrap(
      PQexecParams(c, sql.c_str(), p.size(), nullptr, p.values(), p.lengths(), p.formats(), 0));
  if (!detail::result_ok(detail::ResultAccess::native(r)))
    detail::throw_result("outbox send", detail::ResultAccess::native(r), c,
                         {"; the outbox table is missing: set PostgresStoreOptions::outbox and call migrate()", false});
  ++tx.outbox_sent_;
  return id;
}

}  // namespace idem
