// The default owner of a guard's claims, compiled here so that the guard's header does not
// include <unistd.h>.
#include "idem/core/options.hpp"

#include <unistd.h>

#include <fmt/core.h>

namespace idem::detail {

std::string default_owner() {
  char host[256] = {};
  if (::gethostname(host, sizeof host - 1) != 0) host[0] = '\0';
  return fmt::format("{}:{}", host, ::getpid());
}

}  // namespace idem::detail
