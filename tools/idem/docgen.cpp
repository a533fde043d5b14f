// The bash completion script and the man page, written from the tool's own CLI11 definition
// (`idem --bash-completion`, `idem --man-page`): the build runs them for the package, so neither
// can drift from the commands and options.

#include "docgen.hpp"

#include <string>
#include <vector>

#include <fmt/format.h>

#include "idem/core/version.hpp"

namespace idem::tool {

namespace {

std::vector<const CLI::App*> commands(const CLI::App& app) {
  return app.get_subcommands([](const CLI::App*) { return true; });
}

// "--url -u --json ...": every name of the options of `cmd`.
std::string option_words(const CLI::App& cmd) {
  std::string out;
  for (const CLI::Option* o : cmd.get_options()) {
    for (const auto& l : o->get_lnames()) out += "--" + l + " ";
    for (const auto& s : o->get_snames()) out += "-" + s + " ";
  }
  if (!out.empty()) out.pop_back();
  return out;
}

// roff text: a backslash is \e, and a line may not start with a control character.
std::string roff(const std::string& text) {
  std::string out;
  for (char c : text) {
    if (c == '\\')
      out += "\\e";
    else if (c == '-')
      out += "\\-";
    else
      out += c;
  }
  if (!out.empty() && (out[0] == '.' || out[0] == '\'')) out.insert(0, "\\&");
  return out;
}

}  // namespace

std::string bash_completion(const CLI::App& app) {
  std::string names;
  for (const CLI::App* c : commands(app)) names += c->get_name() + " ";
  std::string cases;
  for (const CLI::App* c : commands(app))
    cases += fmt::format("    {}) words=\"{}\" ;;\n", c->get_name(), option_words(*c));
  return fmt::format(
      R"(# bash completion for idem {version}: written by `idem --bash-completion` (tools/idem/docgen.cpp).
_idem() {{
  local cur="${{COMP_WORDS[COMP_CWORD]}}" prev="${{COMP_WORDS[COMP_CWORD-1]}}" words
  if ((COMP_CWORD == 1)); then
    COMPREPLY=($(compgen -W "{names}--help --version" -- "$cur"))
    return
  fi
  case "$prev" in
    --state) COMPREPLY=($(compgen -W "in_progress failed completed" -- "$cur")); return ;;
  esac
  case "${{COMP_WORDS[1]}}" in
{cases}    *) return ;;
  esac
  COMPREPLY=($(compgen -W "$words" -- "$cur"))
}}
complete -F _idem idem
)",
      fmt::arg("version", idem::version_string), fmt::arg("names", names), fmt::arg("cases", cases));
}

std::string man_page(const CLI::App& app) {
  std::string out = fmt::format(".TH IDEM 1 \"\" \"idem {}\" \"User Commands\"\n", idem::version_string);
  out += ".SH NAME\nidem \\- " + roff(app.get_description().substr(app.get_description().find(':') + 2)) + "\n";
  out += ".SH SYNOPSIS\n.B idem\n.I command\n[\\fIURL\\fR] [\\fIoptions\\fR]\n.br\n.B idem\n\\-\\-version\n";
  out += ".SH DESCRIPTION\n" + roff(app.get_footer()) + "\n";
  out += ".SH COMMANDS\n";
  for (const CLI::App* c : commands(app)) {
    out += ".SS \"idem " + c->get_name() + "\"\n" + roff(c->get_description()) + "\n";
    for (const CLI::Option* o : c->get_options()) {
      if (!o->nonpositional()) {
        out += ".TP\n.I " + roff(o->get_name()) + "\n" + roff(o->get_description()) + "\n";
        continue;
      }
      std::string names;
      for (const auto& l : o->get_lnames()) names += (names.empty() ? "" : ", ") + std::string("\\fB\\-\\-") + l + "\\fR";
      for (const auto& s : o->get_snames()) names += (names.empty() ? "" : ", ") + std::string("\\fB\\-") + s + "\\fR";
      const std::string type = o->get_type_name();
      if (o->get_type_size_max() > 0 && !type.empty()) names += " \\fI" + roff(type) + "\\fR";
      out += ".TP\n" + names + "\n" + roff(o->get_description()) + "\n";
    }
  }
  out += ".SH ENVIRONMENT\n.TP\n.B IDEM_URL\nThe store when neither a URL argument nor \\-\\-url is given: " +
         roff("redis://, rediss://, unix://, redis-cluster://, redis-sentinel://, postgresql:// or sqlite:///path "
              "(a SqliteStore file on this host).") +
         "\n";
  out += ".SH EXIT STATUS\n0 when the command did what it says; 1 when it ran and found a problem (a key not "
         "found, a release refused, a doctor error, a pending migration, a failed conformance case); 2 for bad "
         "usage; 3 when the store could not be reached or refused the command.\n";
  out += ".SH SEE ALSO\nThe operations guide of idem (docs/operations.md in its sources).\n";
  return out;
}

}  // namespace idem::tool
