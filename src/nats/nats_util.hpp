#pragma once
// What idem::nats and the JetStream outbox publisher share: the connection they open and how a
// client status becomes one of idem's typed errors. Internal (no public header includes nats.h),
// header-only so that both libraries can be linked into one program.

#include <cstdint>
#include <memory>
#include <cstring>
#include <string>

#include <fmt/format.h>
#include <nats/nats.h>

#include "idem/core/error.hpp"
#include "idem/core/record.hpp"

namespace idem::detail::nats {

/// Owners of the client library's objects, each freed by its own destroy function.
struct ConnectionFree {
  void operator()(natsConnection* c) const noexcept { natsConnection_Destroy(c); }  ///< closes too
};
/// Frees a JetStream context.
struct JsFree {
  void operator()(jsCtx* j) const noexcept { jsCtx_Destroy(j); }  ///< no I/O
};
/// Frees a message.
struct MsgFree {
  void operator()(natsMsg* m) const noexcept { natsMsg_Destroy(m); }  ///< no I/O
};
using ConnectionPtr = std::unique_ptr<natsConnection, ConnectionFree>;  ///< an owned connection
using JsPtr = std::unique_ptr<jsCtx, JsFree>;                           ///< an owned JetStream context
using MsgPtr = std::unique_ptr<natsMsg, MsgFree>;                       ///< an owned message

/// True when the status says the server could not be reached or answered in time: a retry helps.
inline bool transient(natsStatus s, jsErrCode code) noexcept {
  switch (s) {
    case NATS_NO_SERVER:
    case NATS_CONNECTION_CLOSED:
    case NATS_CONNECTION_DISCONNECTED:
    case NATS_TIMEOUT:
    case NATS_NO_RESPONDERS:
    case NATS_STALE_CONNECTION:
    case NATS_IO_ERROR:
    case NATS_SLOW_CONSUMER:
    case NATS_DRAINING:
    case NATS_NOT_YET_CONNECTED: return true;
    default: break;
  }
  // A JetStream that is still starting (after a restart) or has lost its quorum answers these.
  return code == JSClusterNotAvailErr || code == JSClusterNoPeersErr || code == JSStreamOfflineErr;
}

/// True when a request ended because the server is shutting down: nats.c reports the server's
/// 409 "Server Shutdown" on a pull request as a plain NATS_ERR with that text. It comes back (or
/// another takes over): a retry helps.
inline bool server_shutdown(natsStatus s, const char* detail) noexcept {
  return s == NATS_ERR && detail != nullptr && std::strstr(detail, "Server Shutdown") != nullptr;
}

/// Throws connection_error (unreachable, timed out: retryable) or store_error (JetStream refused:
/// code "JS<n>"), naming `what`, the client's own last error text and `hint` (what to check).
[[noreturn]] inline void fail(natsStatus s, jsErrCode code, const std::string& what, const std::string& hint = {}) {
  natsStatus last = NATS_OK;
  const char* detail = nats_GetLastError(&last);
  std::string msg = fmt::format("idem: {} failed: {}", what, natsStatus_GetText(s));
  if (code != 0) msg += fmt::format(" (JetStream error {})", static_cast<int>(code));
  if (detail != nullptr && *detail != '\0') msg += fmt::format(": {}", detail);
  const bool retry = transient(s, code) || server_shutdown(s, detail);
  if (!hint.empty()) msg += fmt::format("; {}", hint);
  else if (retry) msg += "; retry once the NATS server is reachable";
  if (retry && code == 0) throw connection_error(msg, natsStatus_GetText(s), true);
  throw store_error(msg, code != 0 ? fmt::format("JS{}", static_cast<int>(code)) : natsStatus_GetText(s), retry);
}

/// Connects to `url` (a comma-separated list allowed), reconnecting by itself forever once up.
inline ConnectionPtr connect(const std::string& url, millis timeout, const char* who) {
  natsOptions* raw = nullptr;
  natsStatus s = natsOptions_Create(&raw);
  if (s != NATS_OK) fail(s, jsErrCode{}, fmt::format("{}: creating the connection options", who));
  std::unique_ptr<natsOptions, void (*)(natsOptions*)> opts(raw, natsOptions_Destroy);
  s = natsOptions_SetURL(opts.get(), url.c_str());
  if (s != NATS_OK) throw invalid_options_error(fmt::format("idem: {}::url '{}' is not a NATS URL: {}", who, url, natsStatus_GetText(s)));
  // Once connected, the client reconnects by itself forever: the loop sees timeouts, never a closed
  // connection, while the server restarts. Published acks wait in its buffer meanwhile.
  (void)natsOptions_SetTimeout(opts.get(), timeout.count());
  (void)natsOptions_SetMaxReconnect(opts.get(), -1);
  (void)natsOptions_SetReconnectWait(opts.get(), 100);
  natsConnection* nc = nullptr;
  s = natsConnection_Connect(&nc, opts.get());
  if (s != NATS_OK) fail(s, jsErrCode{}, fmt::format("{}: connecting to {}", who, url), "check the URL and that nats-server is running");
  return ConnectionPtr(nc);
}

/// A JetStream context on `nc` whose API requests wait up to `timeout`.
inline JsPtr jetstream(natsConnection* nc, millis timeout) {
  jsOptions jo;
  jsOptions_Init(&jo);
  jo.Wait = timeout.count();
  jsCtx* js = nullptr;
  const natsStatus s = natsConnection_JetStream(&js, nc, &jo);
  if (s != NATS_OK) fail(s, jsErrCode{}, "creating the JetStream context");
  return JsPtr(js);
}

/// `text` made safe for a header value: no CR or LF, at most 1024 bytes.
inline std::string header_value(std::string text) {
  for (char& c : text)
    if (c == '\r' || c == '\n') c = ' ';
  if (text.size() > 1024) text.resize(1024);
  return text;
}

}  // namespace idem::detail::nats
