// idem inspect [URL] KEY...: each record as the store holds it, with its lease on the store clock.

#include <iostream>

#include "common.hpp"
#include "idem/core/error.hpp"

void register_inspect(CLI::App& app, idem::tool::Globals& g) {
  struct Opts {
    std::vector<std::string> keys, hex_keys;
    bool json = false;
  };
  auto o = std::make_shared<Opts>();
  CLI::App* sub = idem::tool::subcommand(app, g, "inspect",
                                         "Show keys' records: state, fence, owner, lease left on the store clock, "
                                         "attempts, result size, expiry. Exit 1 if a key is not found.",
                                         false);
  sub->add_option("keys", o->keys,
                  "[URL] KEY...: the store URL (optional: else --url or IDEM_URL), then the idempotency keys "
                  "(without the Redis prefix; a key that itself begins with a URL scheme goes after a store URL "
                  "argument)");
  sub->add_option("--key-hex", o->hex_keys,
                  "a key given as the hex of its bytes (the key_hex of --json output, for keys that are not UTF-8); "
                  "repeatable, after the positional keys");
  sub->add_flag("--json", o->json, "one JSON object per line");
  sub->callback([&g, o] {
    idem::tool::guarded(g, [&] {
      idem::tool::take_url_argument(g, o->keys);
      idem::tool::append_hex_keys(o->keys, o->hex_keys);
      if (o->keys.empty()) throw idem::usage_error("idem: inspect: no key given (idem inspect [URL] KEY...)");
      auto store = idem::tool::open(g);
      int rc = idem::tool::exit_ok;
      bool first = true;
      for (const auto& key : o->keys) {
        auto r = store->inspect(key);
        if (!r) {
          std::cerr << "idem: key '" << idem::tool::printable(key) << "' not found on " << store->where()
                    << " (never seen, or expired)\n";
          rc = idem::tool::exit_refused;
          continue;
        }
        if (o->json) {
          idem::tool::print_json(idem::tool::record_json(*r));
        } else {
          if (!first) std::cout << "\n";
          std::cout << idem::tool::record_text(*r);
        }
        first = false;
      }
      return rc;
    });
  });
}
