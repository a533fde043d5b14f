#pragma once
/// @file postgres/outbox_writer.hpp OutboxWriter: what `ctx.outbox()` returns in PostgreSQL transactional
/// mode. send() inserts a message into the store's outbox table inside the handler's claiming
/// transaction, so the message exists if and only if the handler's effect committed.

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

// Not self-contained on purpose: postgres/store.hpp includes this file at its end, after the
// transaction it writes through, so the two never include each other.
#ifndef IDEM_POSTGRES_STORE_BODY
#error "include idem/postgres/store.hpp (or idem/outbox/writer.hpp), not idem/postgres/outbox_writer.hpp"
#endif

namespace idem {

/// Headers of an outbox message: name/value pairs, in order (OutboxMessage::headers).
using OutboxHeaders = std::vector<std::pair<std::string, std::string>>;

/**
 * Writes messages into the outbox of an open PostgresStore transaction (docs/outbox.md). Cheap to
 * copy; valid while its transaction is open. The i-th send() of a transaction (0-based) gets the id
 * outbox_message_id(scope, key, i), so a handler that is run again after a rollback writes the
 * same ids, and a downstream consumer deduplicates on them.
 *
 * @code
 * guard.run(msg.id, [&](const auto& ctx) {
 *   ctx.tx->exec("UPDATE account SET balance = balance + $1 WHERE id = $2", msg.amount, msg.account);
 *   ctx.outbox().send("balances", msg.account, R"({"account":"a1","delta":5})");
 * });
 * @endcode
 */
class OutboxWriter {
 public:
  /// The writer of `tx`; the store needs PostgresStoreOptions::outbox (else send() is a usage_error).
  explicit OutboxWriter(PostgresStore::Transaction& tx) noexcept : tx_(&tx) {}

  /// Inserts one message in the transaction (one round trip) and returns its id. `destination`
  /// names the stream/topic/exchange, `message_key` orders it (rows of one key are published in
  /// the order written); all bytes, any content. A message whose id is already in the outbox (the
  /// same key handled again after its record expired) is not written twice. Throws usage_error
  /// when the transaction is not open or the store has no outbox, store_error from the server.
  std::string send(std::string_view destination, std::string_view message_key, std::string_view payload,
                   const OutboxHeaders& headers = {});

  /// Messages this transaction has sent so far (the index the next send() gets).
  [[nodiscard]] std::uint32_t sent() const noexcept;

 private:
  PostgresStore::Transaction* tx_;
};

/// The stable id of the `index`-th message (0-based) a handler of `key` sends through the outbox of
/// table `scope` ("schema.table" of the store): the first 32 hex digits of SHA-256(scope, NUL, key),
/// '-', then `index` in decimal. Printable ASCII whatever the key's bytes; the scope keeps two
/// stores that see the same keys from minting the same ids.
std::string outbox_message_id(std::string_view scope, std::string_view key, std::uint32_t index);

/// The outbox table of a store's table `table` ("<table>_outbox", in the store's schema).
inline std::string outbox_table_name(std::string_view table) { return std::string(table) + "_outbox"; }

/// The LISTEN/NOTIFY channel of the outbox of `schema`.`table`: "idem_outbox_" + 16 hex digits of
/// SHA-256("schema.table"), always a valid channel name (at most 63 bytes).
std::string outbox_channel(std::string_view schema, std::string_view table);

}  // namespace idem
