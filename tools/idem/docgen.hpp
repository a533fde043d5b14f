#pragma once
// The completion script and the man page of `idem`, from its CLI11 definition (docgen.cpp).

#include <string>

#include <CLI/CLI.hpp>

namespace idem::tool {

// A bash completion script (`complete -F _idem idem`): the commands, then each one's options.
std::string bash_completion(const CLI::App& app);
// The man page, idem(1), in roff: every command with its options and descriptions.
std::string man_page(const CLI::App& app);

}  // namespace idem::tool
