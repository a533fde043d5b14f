#pragma once
// HTTP/1.0 GET on 127.0.0.1 over a plain socket, for the tests that read /metrics or ask a real
// Prometheus server's API (the server answers and closes: no client library needed), and the
// percent-encoding of a query parameter.

#include <cctype>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <string_view>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <fmt/core.h>

namespace idem::test {

struct HttpResponse {
  int status = 0;
  std::string body;
};

// GET `target` ("/metrics", "/api/v1/query?query=...") from 127.0.0.1:port, 5 s timeouts. Throws
// when it cannot connect or the answer is not HTTP; any status is returned.
inline HttpResponse http_get(int port, const std::string& target) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) throw std::runtime_error("test: socket() failed");
  timeval tv{5, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<std::uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
    const int err = errno;
    ::close(fd);
    throw std::runtime_error(fmt::format("connect to 127.0.0.1:{} failed: {}", port, std::strerror(err)));
  }
  const std::string req = fmt::format("GET {} HTTP/1.0\r\nHost: 127.0.0.1:{}\r\nAccept: */*\r\n\r\n", target, port);
  if (::send(fd, req.data(), req.size(), MSG_NOSIGNAL) != static_cast<ssize_t>(req.size())) {
    ::close(fd);
    throw std::runtime_error(fmt::format("send to 127.0.0.1:{} failed", port));
  }
  std::string resp;
  char buf[8192];
  ssize_t n;
  while ((n = ::recv(fd, buf, sizeof buf, 0)) > 0) resp.append(buf, static_cast<std::size_t>(n));
  ::close(fd);
  const auto head_end = resp.find("\r\n\r\n");
  if (resp.rfind("HTTP/1.", 0) != 0 || head_end == std::string::npos || resp.size() < 12)
    throw std::runtime_error(fmt::format("bad HTTP response from 127.0.0.1:{}{}: {}", port, target, resp.substr(0, 200)));
  return {std::atoi(resp.substr(9, 3).c_str()), resp.substr(head_end + 4)};
}

// `s` percent-encoded for a URL's query (RFC 3986: all but the unreserved characters).
inline std::string url_encode(std::string_view s) {
  std::string out;
  for (const unsigned char c : s) {
    if (std::isalnum(c) || c == '-' || c == '_' || c == '.' || c == '~')
      out += static_cast<char>(c);
    else
      out += fmt::format("%{:02X}", c);
  }
  return out;
}

}  // namespace idem::test
