// idem doctor: the store's settings that decide whether exactly-once holds, with the fix for each.

#include <iostream>

#include <fmt/format.h>

#include "common.hpp"

void register_doctor(CLI::App& app, idem::tool::Globals& g) {
  auto json = std::make_shared<bool>(false);
  CLI::App* sub = idem::tool::subcommand(
      app, g, "doctor",
      "Check the store's settings: Redis eviction policy, persistence, replicas, version, ACL permissions, "
      "cluster state; PostgreSQL version, schema version, retention index, fsync/synchronous_commit, privileges, "
      "bloat; SQLite journal mode, synchronous, file system (nfs/smb refused), schema version, busy timeout, file size. "
      "Each finding has a severity and a fix; exit 1 if any is an error.");
  sub->add_flag("--json", *json, "one JSON object per finding");
  sub->callback([&g, json] {
    idem::tool::guarded(g, [&] {
      auto store = idem::tool::open(g);
      const auto findings = store->doctor();
      int errors = 0, warnings = 0;
      if (!*json) std::cout << "idem doctor: " << store->where() << "\n";
      for (const auto& f : findings) {
        errors += f.severity == idem::Severity::error;
        warnings += f.severity == idem::Severity::warning;
        if (*json) {
          idem::tool::Json j = idem::tool::Json::object();
          j["severity"] = std::string(to_string(f.severity));
          idem::tool::put_bytes(j, "check", f.check);
          idem::tool::put_bytes(j, "message", f.message);
          idem::tool::put_bytes(j, "fix", f.fix);
          idem::tool::print_json(j);
          continue;
        }
        const std::string tag = fmt::format("[{}]", to_string(f.severity));
        std::cout << tag << std::string(10 - tag.size(), ' ') << f.check << ": " << f.message << "\n";
        if (!f.fix.empty()) std::cout << "          fix: " << f.fix << "\n";
      }
      if (!*json)
        std::cout << errors << " error(s), " << warnings << " warning(s)"
                  << (errors ? ": the exactly-once guarantee does not hold as configured" : "") << "\n";
      return errors ? idem::tool::exit_refused : idem::tool::exit_ok;
    });
  });
}
