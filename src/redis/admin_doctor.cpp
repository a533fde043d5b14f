// RedisAdmin::doctor (admin.cpp has the rest): what a Redis deployment needs for idem's guarantees,
// checked node by node.

#include "admin_impl.hpp"

namespace idem {

std::vector<Finding> RedisAdmin::doctor() {
  std::vector<Finding> out;
  const bool many = impl_->nodes.size() > 1;
  for (auto& n : impl_->nodes) {
    const std::string at = many ? fmt::format("{}: ", n.name()) : "";
    auto add = [&](Severity s, std::string check, std::string message, std::string fix = {}) {
      out.push_back({s, std::move(check), at + std::move(message), std::move(fix)});
    };
    auto info = parse_info(reply_text(checked(n, {"INFO", "server"}).get()));
    for (auto& [k, v] : parse_info(reply_text(checked(n, {"INFO", "replication"}).get()))) info[k] = v;
    for (auto& [k, v] : parse_info(reply_text(checked(n, {"INFO", "persistence"}).get()))) info[k] = v;
    for (auto& [k, v] : parse_info(reply_text(checked(n, {"INFO", "cluster"}).get()))) info[k] = v;
    for (auto& [k, v] : parse_info(reply_text(checked(n, {"INFO", "memory"}).get()))) info[k] = v;

    const std::string version = info["redis_version"];
    const int vn = version_number(version);
    if (vn < 500)
      add(Severity::error, "version", fmt::format("Redis {}: the scripts need Redis >= 5 (writes after TIME)", version),
          "upgrade Redis to 6.2 or later");
    else if (vn < 600)
      add(Severity::warning, "version",
          fmt::format("Redis {}: no ACLs, and older than anything idem is tested with", version), "upgrade Redis to 7");
    else
      add(Severity::ok, "version", fmt::format("Redis {}", version));

    if (info["role"] != "master")
      add(Severity::error, "role", fmt::format("this server is a {}: every idem script writes", info["role"]),
          "point the URL at the master");

    // CONFIG GET may be refused to the application's user: a warning, not a finding about the server.
    std::map<std::string, std::string> cfg;
    auto r = command(n, {"CONFIG", "GET", "*"});
    if (r->type == REDIS_REPLY_ARRAY) {
      for (std::size_t i = 0; i + 1 < r->elements; i += 2) cfg[reply_text(r->element[i])] = reply_text(r->element[i + 1]);
    } else {
      add(Severity::warning, "config",
          fmt::format("CONFIG GET is refused ({}): eviction and persistence could not be checked", reply_text(r.get())),
          "run idem doctor as a user allowed +config|get");
    }
    if (!cfg.empty()) {
      const std::string policy = cfg["maxmemory-policy"];
      const std::string maxmemory = cfg["maxmemory"];
      if (policy != "noeviction") {
        if (maxmemory != "0")
          add(Severity::error, "maxmemory-policy",
              fmt::format("maxmemory-policy is {} with maxmemory {}: Redis evicts idempotency records under memory "
                          "pressure, and their messages run again",
                          policy, maxmemory),
              "CONFIG SET maxmemory-policy noeviction (and CONFIG REWRITE); size maxmemory for the retention");
        else
          add(Severity::warning, "maxmemory-policy",
              fmt::format("maxmemory-policy is {}: nothing is evicted while maxmemory is 0, but setting a limit later "
                          "silently starts evicting records",
                          policy),
              "CONFIG SET maxmemory-policy noeviction (and CONFIG REWRITE)");
      } else {
        add(Severity::ok, "maxmemory-policy", "noeviction (a full server refuses writes: capacity_error, fail closed)");
      }
      if (maxmemory != "0" && policy == "noeviction") {
        const double used = std::stod(info["used_memory"].empty() ? "0" : info["used_memory"]);
        const double limit = std::stod(maxmemory);
        if (limit > 0 && used / limit > 0.9)
          add(Severity::warning, "memory",
              fmt::format("used memory is {}% of maxmemory: acquires will fail (OOM) soon",
                          static_cast<int>(100 * used / limit)),
              "raise maxmemory or shorten the retention");
      }
      const bool aof = cfg["appendonly"] == "yes";
      const bool rdb = !cfg["save"].empty();
      if (!aof) {
        add(Severity::error, "appendonly",
            fmt::format("appendonly is no{}: a restart forgets the records written since the last snapshot, and their "
                        "messages run again",
                        rdb ? fmt::format(" (RDB snapshots only: {})", cfg["save"]) : " and no RDB snapshots"),
            "CONFIG SET appendonly yes (and CONFIG REWRITE)");
      } else {
        const std::string fsync = cfg["appendfsync"];
        if (fsync == "always")
          add(Severity::ok, "appendfsync", "always: every write is on disk before it is acknowledged");
        else if (fsync == "everysec")
          add(Severity::info, "appendfsync",
              "everysec: a machine crash (not a Redis crash) can lose the last second of records",
              "appendfsync always, if a machine crash must not re-run a message");
        else
          add(Severity::warning, "appendfsync",
              fmt::format("appendfsync {}: the OS decides when records reach the disk", fsync),
              "CONFIG SET appendfsync everysec (or always)");
      }
    }

    const int replicas = std::atoi(info["connected_slaves"].c_str());
    const int min_replicas = cfg.empty() ? -1 : std::atoi(cfg["min-replicas-to-write"].c_str());
    if (replicas == 0) {
      add(Severity::info, "replicas", "no replicas: this server's disk is the only copy of the records");
    } else if (min_replicas == 0) {
      add(Severity::warning, "min-replicas-to-write",
          fmt::format("{} replica(s) but min-replicas-to-write 0: replication is asynchronous, a failover can lose "
                      "acknowledged records",
                      replicas),
          "RedisOptions::min_replica_acks = 1 (WAIT per write), or CONFIG SET min-replicas-to-write 1");
    } else {
      add(Severity::ok, "replicas",
          fmt::format("{} replica(s), min-replicas-to-write {}", replicas,
                      min_replicas < 0 ? std::string("unknown") : std::to_string(min_replicas)));
    }

    if (info["cluster_enabled"] == "1") {
      auto ci = parse_info(reply_text(checked(n, {"CLUSTER", "INFO"}).get()));
      if (ci["cluster_state"] != "ok")
        add(Severity::error, "cluster",
            fmt::format("cluster_state is {} ({} slots assigned): keys of unserved slots fail", ci["cluster_state"],
                        ci["cluster_slots_assigned"]),
            "redis-cli --cluster check / fix");
      else
        add(Severity::ok, "cluster", fmt::format("cluster_state ok, {} slots assigned", ci["cluster_slots_assigned"]));
      if (!impl_->cluster)
        add(Severity::warning, "cluster", "a cluster node reached with redis://: keys of other slots answer MOVED",
            "use redis-cluster://host:port");
    }

    // The permissions the stores' scripts need, checked for the connected user without running
    // anything: ACL DRYRUN (Redis 7). A refused DRYRUN is a warning: it says nothing about the user.
    if (vn >= 700) {
      const std::string user = reply_text(command(n, {"ACL", "WHOAMI"}).get());
      const std::string k = impl_->opt.key_prefix + "doctor-probe";
      const std::vector<std::vector<std::string>> needed{
          {"EVALSHA", "0000000000000000000000000000000000000000", "1", k},
          {"SCRIPT", "LOAD", "return 1"},
          {"GET", k},
          {"SET", k, "v", "PX", "1"},
          {"PTTL", k},
          {"PEXPIRE", k, "1"},
          {"TIME"}};
      std::vector<std::string> missing;
      std::string refused;
      for (const auto& c : needed) {
        std::vector<std::string> args{"ACL", "DRYRUN", user};
        args.insert(args.end(), c.begin(), c.end());
        auto d = command(n, args);
        if (d->type == REDIS_REPLY_ERROR) {
          refused = reply_text(d.get());
          break;
        }
        if (reply_text(d.get()) != "OK") missing.push_back(c[0] == "SCRIPT" ? "SCRIPT LOAD" : c[0]);
      }
      if (!refused.empty())
        add(Severity::warning, "acl",
            fmt::format("ACL DRYRUN is refused to user {} ({}): the scripts' permissions could not be checked", user,
                        refused),
            "run idem doctor with the application's URL and a user allowed +acl|dryrun, or check the ACL by hand");
      else if (!missing.empty()) {
        std::string list;
        for (const auto& m : missing) list += (list.empty() ? "" : ", ") + m;
        add(Severity::error, "acl",
            fmt::format("user {} may not run {} on {}*: every store call will fail (NOPERM)", user, list,
                        impl_->opt.key_prefix),
            fmt::format("ACL SETUSER {} ~{}* +evalsha +script|load +get +mget +set +pttl +pexpire +time", user,
                        impl_->opt.key_prefix));
      } else {
        add(Severity::ok, "acl",
            fmt::format("user {} may run every command the scripts use on {}*", user, impl_->opt.key_prefix));
      }
    }
  }
  return out;
}

}  // namespace idem
