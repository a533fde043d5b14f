// idem purge: deletes expired PostgreSQL or SQLite rows in batches (Redis expires its records itself).

#include <iostream>

#include "common.hpp"

void register_purge(CLI::App& app, idem::tool::Globals& g) {
  struct Opts {
    std::size_t batch = 1000;
    bool json = false;
  };
  auto o = std::make_shared<Opts>();
  CLI::App* sub = idem::tool::subcommand(app, g, "purge",
                                         "Delete expired records (PostgreSQL, SQLite) in batches, each its own short "
                                         "transaction; a progress line on a terminal. Redis needs none (TTL).");
  sub->add_option("--batch", o->batch, "rows per transaction")->capture_default_str()->check(CLI::Range(1, 1000000));
  sub->add_flag("--json", o->json, "one JSON object: rows purged (0 on Redis, which expires records itself)");
  sub->callback([&g, o] {
    idem::tool::guarded(g, [&] {
      auto store = idem::tool::open(g);
      const bool tty = idem::tool::stderr_is_tty();
      auto n = store->purge(o->batch, [&](std::size_t done, std::size_t expired) {
        if (tty) std::cerr << "\rpurged " << done << " of " << expired << " expired rows" << std::flush;
      });
      if (tty && n) std::cerr << "\n";
      if (o->json) {
        // store_expires: nothing to purge because the store drops expired records itself (Redis TTL).
        idem::tool::Json j = idem::tool::Json::object();
        j["purged"] = n.value_or(0);
        idem::tool::put_bytes(j, "store", store->where());
        j["store_expires"] = !n;
        idem::tool::print_json(j);
        return idem::tool::exit_ok;
      }
      if (!n) {
        std::cout << "nothing to purge: Redis expires idem's records itself (key TTL = retention)\n";
        return idem::tool::exit_ok;
      }
      std::cout << "purged " << *n << " expired rows from " << store->where() << "\n";
      return idem::tool::exit_ok;
    });
  });
}
