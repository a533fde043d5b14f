// idem release [URL] KEY --fence N: frees a stuck key, atomically, only while it still has that fence.

#include <iostream>
#include <vector>

#include <fmt/format.h>

#include "common.hpp"
#include "idem/core/error.hpp"

void register_release(CLI::App& app, idem::tool::Globals& g) {
  struct Opts {
    std::vector<std::string> args, hex_keys;
    std::string key;
    std::uint64_t fence = 0;
    bool yes = false, force = false, json = false;
  };
  auto o = std::make_shared<Opts>();
  CLI::App* sub = idem::tool::subcommand(
      app, g, "release",
      "Free a stuck key: it becomes failed, retryable at once, with no holder, so the next delivery runs it "
      "(fence + 1). Only if its fence is still N (take N from `idem inspect`): a holder that took the key over "
      "since is never freed. Completed keys are never released. Exit 1 when refused.",
      false);
  sub->add_option("key", o->args, "[URL] KEY: the store URL (optional: else --url or IDEM_URL), then the idempotency key");
  sub->add_option("--key-hex", o->hex_keys,
                  "the key as the hex of its bytes (the key_hex of --json output, for a key that is not UTF-8), "
                  "instead of KEY");
  sub->add_option("--fence", o->fence, "the fence the record must still have")->required();
  sub->add_flag("--yes,-y", o->yes, "do not ask (required when stdin is not a terminal)");
  sub->add_flag("--force", o->force, "also free an in_progress key whose lease is still live (its holder may still be running)");
  sub->add_flag("--json", o->json, "one JSON object when released (a refusal stays a message on stderr, exit 1)");
  sub->callback([&g, o] {
    idem::tool::guarded(g, [&] {
      using idem::tool::printable;
      idem::tool::take_url_argument(g, o->args);
      idem::tool::append_hex_keys(o->args, o->hex_keys);
      if (o->args.size() != 1)
        throw idem::usage_error(o->args.empty() ? "idem: release: no key given (idem release [URL] KEY --fence N)"
                                                : "idem: release: one key at a time (idem release [URL] KEY --fence N)");
      o->key = o->args.front();
      auto store = idem::tool::open(g);
      if (!o->yes) {
        if (!idem::tool::stdin_is_tty()) {
          std::cerr << "idem: release asks for confirmation on a terminal; pass --yes to release from a script\n";
          return idem::tool::exit_usage;
        }
        // The prompt shows what the operator is about to free; the release itself re-checks the fence.
        auto r = store->inspect(o->key);
        if (!r) {
          std::cerr << "idem: key '" << printable(o->key) << "' not found (never seen, or expired)\n";
          return idem::tool::exit_refused;
        }
        std::cerr << "release '" << printable(o->key) << "' (" << to_string(r->record.state) << ", fence "
                  << r->record.holder.fence << ", " << idem::tool::lease_text(*r)
                  << (r->record.owner.empty() ? "" : fmt::format(", owner {}", printable(r->record.owner)))
                  << ")? [y/N] ";
        std::string answer;
        std::getline(std::cin, answer);
        if (answer != "y" && answer != "Y" && answer != "yes") {
          std::cerr << "idem: not released\n";
          return idem::tool::exit_refused;
        }
      }
      const idem::ReleaseResult res = store->release(o->key, o->fence, o->force);
      const std::string k = fmt::format("'{}'", printable(o->key));
      switch (res.status) {
        case idem::ReleaseStatus::released:
          if (o->json) {
            idem::tool::Json j = idem::tool::Json::object();
            j["released"] = true;
            idem::tool::put_bytes(j, "key", o->key);
            j["fence"] = res.fence;
            j["was"] = std::string(to_string(res.state));
            j["next_fence"] = res.fence + 1;
            idem::tool::print_json(j);
            return idem::tool::exit_ok;
          }
          std::cout << "released " << k << " (fence " << res.fence << ", was " << to_string(res.state)
                    << "): the next delivery acquires it with fence " << res.fence + 1 << "\n";
          return idem::tool::exit_ok;
        case idem::ReleaseStatus::not_found:
          std::cerr << "idem: key " << k << " not found (never seen, or expired): nothing to release\n";
          return idem::tool::exit_refused;
        case idem::ReleaseStatus::fence_mismatch:
          std::cerr << "idem: refused: " << k << " has fence " << res.fence << ", not " << o->fence
                    << ": it was acquired since; run idem inspect again\n";
          return idem::tool::exit_refused;
        case idem::ReleaseStatus::completed:
          std::cerr << "idem: refused: " << k << " is completed (its effect happened); completed keys are never released\n";
          return idem::tool::exit_refused;
        case idem::ReleaseStatus::live:
          std::cerr << "idem: refused: " << k << " is in_progress with a live lease: its holder may still be running; "
                    << "wait for the lease to lapse, or pass --force\n";
          return idem::tool::exit_refused;
      }
      return idem::tool::exit_store;
    });
  });
}
