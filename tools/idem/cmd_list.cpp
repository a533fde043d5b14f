// idem list: records streamed page by page (Redis SCAN, PostgreSQL and SQLite key ranges), stuck ones first.

#include <iomanip>
#include <iostream>

#include "common.hpp"

void register_list(CLI::App& app, idem::tool::Globals& g) {
  struct Opts {
    std::string state, older_than;
    std::size_t limit = 0, page = 1000;
    bool json = false;
  };
  auto o = std::make_shared<Opts>();
  CLI::App* sub = idem::tool::subcommand(
      app, g, "list",
      "List records, streamed: in_progress first, then failed, then completed (or one --state). "
      "OVERDUE is how long ago an in_progress lease or a failed backoff ended (negative: still running).");
  sub->add_option("--state", o->state, "in_progress, failed or completed")
      ->check(CLI::IsMember({"in_progress", "failed", "completed"}));
  sub->add_option("--older-than", o->older_than,
                  "only records overdue by at least this (e.g. 5m): lapsed leases, failures past their backoff");
  sub->add_option("--limit", o->limit, "stop after N records (0 = all)");
  sub->add_option("--page", o->page, "records read per round trip")->capture_default_str()->check(CLI::Range(1, 100000));
  sub->add_flag("--json", o->json, "one JSON object per line (for scripts)");
  sub->callback([&g, o] {
    idem::tool::guarded(g, [&] {
      idem::ListFilter f;
      if (!o->state.empty()) f.state = idem::tool::parse_state(o->state);
      if (!o->older_than.empty()) {
        if (f.state == idem::State::completed)
          throw CLI::ValidationError("--older-than", "applies to in_progress and failed records, not completed ones");
        f.older_than = idem::tool::parse_duration(o->older_than);
      }
      f.limit = o->limit;
      f.page = o->page;
      auto store = idem::tool::open(g);
      if (!o->json)
        std::cout << std::left << std::setw(12) << "STATE" << std::setw(8) << "FENCE" << std::setw(12) << "OVERDUE"
                  << std::setw(12) << "EXPIRES" << std::setw(24) << "OWNER" << "KEY\n";
      // Written as they come: nothing but the current page is ever held.
      store->list(f, [&](const idem::AdminRecord& r) {
        if (o->json) {
          idem::tool::print_json(idem::tool::record_json(r));
        } else {
          const bool timed = r.record.state != idem::State::completed;
          std::cout << std::left << std::setw(12) << to_string(r.record.state) << std::setw(8) << r.record.holder.fence
                    << std::setw(12) << (timed ? idem::tool::format_duration(idem::overdue_ms(r)) : "-") << std::setw(12)
                    << (r.expires_in_ms < 0 ? "never" : idem::tool::format_duration(r.expires_in_ms)) << std::setw(24)
                    << (r.record.owner.empty() ? "-" : idem::tool::printable(r.record.owner)) << idem::tool::printable(r.key)
                    << "\n";
        }
        return static_cast<bool>(std::cout);
      });
      return idem::tool::exit_ok;
    });
  });
}
