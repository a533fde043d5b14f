// idem purge: deletes expired PostgreSQL rows in batches (Redis expires its records itself).

#include <iostream>

#include "common.hpp"

void register_purge(CLI::App& app, idem::tool::Globals& g) {
  auto batch = std::make_shared<std::size_t>(1000);
  CLI::App* sub = idem::tool::subcommand(app, g, "purge",
                                         "Delete expired records (PostgreSQL) in batches, each its own short "
                                         "transaction; a progress line on a terminal. Redis needs none (TTL).");
  sub->add_option("--batch", *batch, "rows per transaction")->capture_default_str()->check(CLI::Range(1, 1000000));
  sub->callback([&g, batch] {
    idem::tool::guarded(g, [&] {
      auto store = idem::tool::open(g);
      const bool tty = idem::tool::stderr_is_tty();
      auto n = store->purge(*batch, [&](std::size_t done, std::size_t expired) {
        if (tty) std::cerr << "\rpurged " << done << " of " << expired << " expired rows" << std::flush;
      });
      if (!n) {
        std::cout << "nothing to purge: Redis expires idem's records itself (key TTL = retention)\n";
        return idem::tool::exit_ok;
      }
      if (tty) std::cerr << "\n";
      std::cout << "purged " << *n << " expired rows from " << store->where() << "\n";
      return idem::tool::exit_ok;
    });
  });
}
