#pragma once
/// @file guard/context.hpp What a handler learns about its run: idem::Context, and BasicContext
/// with the open transaction on a store with a transactional mode.

#include <cstdint>
#include <stop_token>
#include <string_view>
#include <type_traits>

#include "idem/core/error.hpp"
#include "idem/core/store.hpp"

namespace idem {

/// What a handler may learn about its run; take `const idem::Context&` as the handler's only
/// parameter (or none at all). Works with every store.
struct Context {
  std::string_view key;        ///< the idempotency key
  std::uint64_t fence = 0;     ///< fencing token: grows on every acquire of this key; pass it downstream
  std::uint32_t attempt = 0;   ///< times the key has been acquired, this run included
  bool takeover = false;       ///< this run took over a holder whose lease lapsed
  std::stop_token stop;        ///< fires when the lease keeper finds the lease lost: stop and return
};

/// The context on a store with a transactional mode (PostgresStore): a Context plus the open
/// transaction to write through (null in lease mode). A handler may take either type.
template <class Tx = void>
struct BasicContext : Context {
  Tx* tx = nullptr;  ///< transactional mode: the open transaction; lease mode: null

  /// The transactional outbox of the open transaction (docs/outbox.md): `ctx.outbox().send(...)`.
  /// Exists when the transaction has one (PostgresStore) or wraps a PostgresStore transaction
  /// (`tx->postgres()`); usage_error in lease mode, where no transaction is open.
  decltype(auto) outbox() const
    requires requires(Tx& t) { t.outbox(); } || requires(Tx& t) { t.postgres().outbox(); }
  {
    if (tx == nullptr)
      throw usage_error("idem: ctx.outbox() needs transactional mode (no transaction is open in lease mode)");
    if constexpr (requires(Tx& t) { t.outbox(); })
      return tx->outbox();
    else
      return tx->postgres().outbox();
  }
};

/// Stores without transactions hand out the plain Context.
template <>
struct BasicContext<void> : Context {};

/// The context type handlers of an IdempotencyGuard<Store> receive.
template <class Store>
using context_t = std::conditional_t<std::is_void_v<transaction_t<Store>>, Context, BasicContext<transaction_t<Store>>>;

namespace detail {
/// Thrown by a sequencing wrapper's handler when, inside the run, the event turns out older than
/// its entity: the guard releases the key (rolls the transaction back) without counting a failure
/// and answers Status::stale. Not a std::exception: a handler's `catch (const std::exception&)`
/// must not swallow it.
struct stale_signal {};
}  // namespace detail

}  // namespace idem
