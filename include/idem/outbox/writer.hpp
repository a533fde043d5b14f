#pragma once
/// @file outbox/writer.hpp OutboxWriter, what `ctx.outbox()` returns in PostgreSQL transactional
/// mode: defined with the PostgreSQL store (postgres/outbox_writer.hpp), which it belongs to.

#include "idem/postgres/store.hpp"  // IWYU pragma: export (it defines OutboxWriter at its end)
