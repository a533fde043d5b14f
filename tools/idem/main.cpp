// `idem`: the operator's command for idem stores (docs/operations.md). Subcommands come from
// commands.inc; each parses its own options and sets the exit code.

#include <iostream>
#include <string_view>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "common.hpp"
#include "docgen.hpp"
#include "idem/core/version.hpp"

#define IDEM_COMMAND(name) void register_##name(CLI::App&, idem::tool::Globals&);
#include "commands.inc"
#undef IDEM_COMMAND

int main(int argc, char** argv) {
  idem::tool::Globals g;
  CLI::App app{"idem: inspect, free and check the stores of idem (exactly-once effects over at-least-once delivery)"};
  app.require_subcommand(1);
  app.set_version_flag("--version", fmt::format("idem {}", idem::version_string));
  app.footer(fmt::format("Every command names its store the same way. {}`idem <command> --help` for its options.",
                         idem::tool::store_help));
#define IDEM_COMMAND(name) register_##name(app, g);
#include "commands.inc"
#undef IDEM_COMMAND
  // What the package installs (CMakeLists.txt): written from the definition above, not kept by hand.
  if (argc == 2 && std::string_view(argv[1]) == "--bash-completion") {
    std::cout << idem::tool::bash_completion(app);
    return 0;
  }
  if (argc == 2 && std::string_view(argv[1]) == "--man-page") {
    std::cout << idem::tool::man_page(app);
    return 0;
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int rc = app.exit(e);
    return rc == 0 ? 0 : idem::tool::exit_usage;
  }
  std::cout.flush();
  return g.exit_code;
}
