// idem stats: counts by state, stuck leases, records and bytes.

#include <iostream>

#include <fmt/format.h>

#include "common.hpp"

void register_stats(CLI::App& app, idem::tool::Globals& g) {
  auto json = std::make_shared<bool>(false);
  CLI::App* sub = idem::tool::subcommand(app, g, "stats",
                                         "Counts by state, lapsed in_progress leases (stuck) and the most overdue, "
                                         "records and bytes. Redis: one SCAN pass; PostgreSQL and SQLite: one aggregate query.");
  sub->add_flag("--json", *json, "one JSON object");
  sub->callback([&g, json] {
    idem::tool::guarded(g, [&] {
      auto store = idem::tool::open(g);
      const idem::AdminStats s = store->stats();
      const auto st = [&](idem::State x) { return s.by_state[static_cast<std::size_t>(x)]; };
      if (*json) {
        idem::tool::Json j = idem::tool::Json::object();
        j["records"] = s.records;
        j["in_progress"] = st(idem::State::in_progress);
        j["completed"] = st(idem::State::completed);
        j["failed"] = st(idem::State::failed);
        j["lapsed"] = s.lapsed;
        j["most_overdue_ms"] = s.most_overdue_ms ? idem::tool::Json(*s.most_overdue_ms) : idem::tool::Json(nullptr);
        j["bytes"] = s.bytes;
        j["expired_rows"] = s.expired_rows;
        idem::tool::print_json(j);
        return idem::tool::exit_ok;
      }
      std::cout << "store        " << store->where() << "\n"
                << "records      " << s.records << "\n"
                << "in_progress  " << st(idem::State::in_progress) << " (" << s.lapsed << " with a lapsed lease)\n"
                << "completed    " << st(idem::State::completed) << "\n"
                << "failed       " << st(idem::State::failed) << "\n"
                << "oldest lease "
                << (s.most_overdue_ms
                        ? (*s.most_overdue_ms >= 0
                               ? fmt::format("lapsed {} ago", idem::tool::format_duration(*s.most_overdue_ms))
                               : fmt::format("live, {} left", idem::tool::format_duration(-*s.most_overdue_ms)))
                        : std::string("-"))
                << "\n"
                << "bytes        " << s.bytes << "\n";
      if (!store->is_redis()) std::cout << "expired rows " << s.expired_rows << " (waiting for idem purge)\n";
      return idem::tool::exit_ok;
    });
  });
}
