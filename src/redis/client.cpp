// idem::RedisClient (client.hpp): the construction's checks on connections of their own, the
// hello a new connection sends, the engine's home. Opening a connection is opening.cpp.

#include "client.hpp"

#include "cluster.hpp"
#include "engine_store.hpp"

#include <charconv>
#include <utility>

#include <fmt/format.h>

#include "idem/core/error.hpp"
#include "idem/detail/warning_relay.hpp"
#include "idem/redis/client.hpp"
#include "idem/redis/hash_slot.hpp"

namespace idem {

namespace detail::redis {

namespace {

Command script_load(Script s) {
  Command cmd;
  cmd.arg("SCRIPT").arg("LOAD").arg(script(s).source);
  return cmd;
}

// `CONFIG GET maxmemory*` rather than naming two settings: Redis < 7 takes one pattern only.
constexpr std::size_t config_requests = 2;
void add_config_get(Pipeline& p) {
  p.add(Command().arg("CONFIG").arg("GET").arg("maxmemory*").format());
  p.add(Command().arg("CONFIG").arg("GET").arg("proto-max-bulk-len").format());
}
ServerConfig parse_config(const ReplyPtr* r);

}  // namespace

Client::Client(RedisOptions o)
    : opt_(resolve_options(std::move(o))),
      tls_(opt_.tls.enabled ? std::make_unique<const Tls>(opt_.tls) : nullptr),
      sentinels_(sentinel_endpoints(opt_)),
      rediscover_(!sentinels_.empty()) {
  // Cluster mode: the slot map, and a check of every master (a client per master, built by the
  // cluster, loads the scripts there).
  if (!opt_.cluster_nodes.empty()) {
    cluster_ = std::make_unique<Cluster>(opt_);
    return;
  }
  // One connection now, so a wrong address or password fails here and not mid-message; every
  // script is loaded on it in one round trip (a NOSCRIPT later reloads the one it names). With
  // min_replica_acks, ROLE says how many replicas the primary has now: fewer is worth a warning.
  // The server's settings come in the same round trip, for the store built next (server_config).
  Pipeline loads;
  for (std::size_t i = 0; i < script_count; ++i) loads.add(script_load(static_cast<Script>(i)).format());
  add_config_get(loads);
  if (opt_.min_replica_acks > 0) loads.add(Command().arg("ROLE").format());
  const std::vector<ReplyPtr> replies = session(loads.all(), loads.size(), "to SCRIPT LOAD");
  for (std::size_t i = 0; i < script_count; ++i) check_loaded(replies[i].get(), static_cast<Script>(i), store_hints);
  {
    std::lock_guard lock(config_mu_);
    first_config_ = parse_config(&replies[script_count]);
  }
  int replicas = -1;
  if (opt_.min_replica_acks > 0) {
    const redisReply* r = replies[script_count + config_requests].get();
    if (r->type == REDIS_REPLY_ARRAY && r->elements >= 3 && r->element[2]->type == REDIS_REPLY_ARRAY)
      replicas = static_cast<int>(r->element[2]->elements);
  }
  if (replicas >= 0 && replicas < opt_.min_replica_acks && opt_.observer)
    opt_.observer->on_warning(
        fmt::format("idem: min_replica_acks is {} but {} has {} replica(s) connected: every "
                    "write transition fails with durability_error until enough replicas are "
                    "attached",
                    opt_.min_replica_acks, where(), replicas));
}

Client::Client(RedisOptions o, FactoryOnly)
    : opt_(resolve_options(std::move(o))),
      tls_(opt_.tls.enabled ? std::make_unique<const Tls>(opt_.tls) : nullptr),
      sentinels_(sentinel_endpoints(opt_)),
      rediscover_(!sentinels_.empty()) {
  if (!opt_.cluster_nodes.empty()) cluster_ = std::make_unique<Cluster>(opt_, false);
}

Client::~Client() { core_.reset(); }

asio_redis::RedisCore& Client::core() {
  std::call_once(core_once_, [this] { core_ = std::make_unique<asio_redis::RedisCore>(*this); });
  return *core_;
}

std::string Client::where() const {
  if (cluster_) return cluster_->masters();
  if (sentinels_.empty()) return opt_.unix_socket.empty() ? describe({opt_.host, opt_.port}) : opt_.unix_socket;
  std::lock_guard lock(master_mu_);
  return master_.host.empty() ? std::string{} : describe(master_);
}

Command Client::evalsha(Script s, std::size_t numkeys) {
  Command cmd;
  cmd.arg("EVALSHA").arg(script(s).sha).arg(numkeys);
  return cmd;
}

Endpoint Client::server() const {
  return opt_.unix_socket.empty() ? Endpoint{opt_.host, opt_.port} : Endpoint{opt_.unix_socket, 0};
}

Hello hello_for(const RedisOptions& o, bool sentinel, bool tls) {
  Hello h;
  add_auth(h.requests, o.user, o.password);
  if (o.db != 0) h.requests.add(Command().arg("SELECT").arg(o.db).format());
  h.check_role = sentinel;
  if (sentinel) h.requests.add(Command().arg("ROLE").format());
  if (h.requests.size() == 0 && tls) h.requests.add(Command().arg("PING").format());
  return h;
}

std::string_view hello_refusal(const std::vector<ReplyPtr>& answers) {
  for (const ReplyPtr& a : answers)
    if (is_error(a.get())) return reply_text(a.get());
  return {};
}

bool hello_accepted(const Hello& h, const std::vector<ReplyPtr>& answers) {
  if (const std::string_view refused = hello_refusal(answers); !refused.empty())
    throw_reply_error(refused, "the connection handshake (AUTH/SELECT)", store_hints);
  if (!h.check_role) return true;
  const redisReply* r = answers.back().get();
  return r->type == REDIS_REPLY_ARRAY && r->elements > 0 && r->element[0]->type == REDIS_REPLY_STRING &&
         reply_text(r->element[0]) == "master";
}

void Client::check_loaded(const redisReply* r, Script s, const ReplyErrorHints& hints) {
  const ScriptInfo& info = script(s);
  throw_if_error(r, hints, [&] { return fmt::format("SCRIPT LOAD of {}", info.name); });
  if (r->type != REDIS_REPLY_STRING || reply_text(r) != info.sha)
    throw store_error(fmt::format("idem: SCRIPT LOAD of {} answered an unexpected SHA1", info.name), "", false);
}

void check_wait(const redisReply* wait, Script s, std::string_view what, const RedisOptions& o,
                const std::string& where) {
  const char* acquired = "the handler did not run: redeliver later (the key frees itself after the lease)";
  const char* written =
      "the write stands on the primary and is reported so the message is not acked: its redelivery finds it (or, if "
      "a failover lost it, runs again after the lease)";
  const std::string effect = s == Script::acquire ? fmt::format("; {}", acquired)
                             : s == Script::many  // a batch: its acquires, or its writes
                                 ? fmt::format("; for an acquire, {}; for a write, {}", acquired, written)
                                 : fmt::format("; {}", written);
  if (is_error(wait))
    throw store_error(fmt::format("idem: Redis refused WAIT after {}: {}; min_replica_acks needs WAIT on a primary "
                                  "(the ACL user needs +wait){}",
                                  what, reply_text(wait), effect),
                      std::string(error_code(reply_text(wait))), false);
  const long long acks = wait->type == REDIS_REPLY_INTEGER ? wait->integer : -1;
  if (acks < 0) throw_bad_reply(fmt::format("WAIT after {}", what));
  if (acks >= o.min_replica_acks) return;
  throw durability_error(fmt::format("idem: {} was written on the Redis primary at {} but {} of the {} replica(s) "
                                     "asked for (min_replica_acks) acknowledged it within replica_ack_timeout ({}): a "
                                     "failover now could lose it{}. If replicas are missing or lagging, see INFO "
                                     "replication on the primary",
                                     what, where, acks, o.min_replica_acks, ms(o.replica_ack_timeout), effect),
                         static_cast<int>(acks), o.min_replica_acks);
}

ReplyPtr Client::call(std::string_view req, const char* during) { return std::move(session(req, 1, during).front()); }

namespace {
// The value of `name` in a CONFIG GET reply (name, value, name, value...), or nullptr.
const redisReply* config_value(const redisReply* r, std::string_view name) {
  if (r->type != REDIS_REPLY_ARRAY) return nullptr;
  for (std::size_t i = 0; i + 1 < r->elements; i += 2)
    if (r->element[i]->type == REDIS_REPLY_STRING && reply_text(r->element[i]) == name &&
        r->element[i + 1]->type == REDIS_REPLY_STRING)
      return r->element[i + 1];
  return nullptr;
}

bool config_number(const redisReply* r, std::string_view name, std::uint64_t& out) {
  const redisReply* v = config_value(r, name);
  if (v == nullptr) return false;
  const std::string_view t = reply_text(v);
  return std::from_chars(t.data(), t.data() + t.size(), out).ec == std::errc{};
}
}  // namespace

ServerConfig Client::server_config() {
  if (cluster_) return cluster_->server_config();
  {
    std::lock_guard lock(config_mu_);
    if (first_config_) {
      ServerConfig cfg = std::move(*first_config_);
      first_config_.reset();
      return cfg;
    }
  }
  Pipeline p;
  add_config_get(p);
  const std::vector<ReplyPtr> r = session(p.all(), p.size(), "to CONFIG GET");
  return parse_config(r.data());
}

namespace {
// `r`: the replies to add_config_get's two requests.
ServerConfig parse_config(const ReplyPtr* r) {
  ServerConfig cfg;
  for (std::size_t i = 0; i < config_requests; ++i)
    if (const ReplyPtr& one = r[i]; is_error(one.get())) {
      cfg.problem = reply_text(one.get());
      return cfg;
    }
  const redisReply* policy = config_value(r[0].get(), "maxmemory-policy");
  if (policy == nullptr || !config_number(r[0].get(), "maxmemory", cfg.maxmemory) ||
      !config_number(r[1].get(), "proto-max-bulk-len", cfg.max_bulk_len)) {
    cfg.problem = "unexpected reply to CONFIG GET";
    return cfg;
  }
  cfg.policy = reply_text(policy);
  return cfg;
}
}  // namespace

}  // namespace detail::redis

namespace detail::redis {

ClientHandle::ClientHandle(std::shared_ptr<RedisClient> client, const char* owner)
    : client_(std::move(client)), owner_(owner) {
  if (!client_) throw usage_error(fmt::format("idem: {} needs a RedisClient, got a null pointer", owner));
}
ClientHandle::~ClientHandle() = default;
ClientHandle::ClientHandle(ClientHandle&&) noexcept = default;
ClientHandle& ClientHandle::operator=(ClientHandle&&) noexcept = default;

Client& ClientHandle::impl() const {
  if (!client_) throw usage_error(fmt::format("idem: this {} was moved from; use the store it was moved to", owner_));
  return *client_->impl_;
}
const RedisOptions& ClientHandle::options() const { return impl().options(); }
void ClientHandle::attach_observer(const std::shared_ptr<Observer>& o) const {
  idem::detail::attach_to_relay(impl().options().observer, o);
}
const std::shared_ptr<RedisClient>& ClientHandle::client() const {
  (void)impl();  // a moved-from store says so here too
  return client_;
}

}  // namespace detail::redis

RedisClient::RedisClient(RedisOptions options) : impl_(std::make_unique<detail::redis::Client>(std::move(options))) {}
RedisClient::~RedisClient() = default;
const RedisOptions& RedisClient::options() const noexcept { return impl_->options(); }
std::string RedisClient::address() const { return impl_->where(); }
std::uint64_t RedisClient::discoveries() const noexcept { return impl_->discoveries(); }
RedisClientStats RedisClient::stats() const noexcept { return impl_->stats(); }
std::string RedisClient::eviction_policy() { return impl_->server_config().policy; }

}  // namespace idem

namespace idem::detail::redis {

RedisClientStats Client::stats() const noexcept {
  RedisClientStats s;
  s.discoveries = discoveries_.load();
  if (cluster_) cluster_->add_stats(s);
  return s;
}



int Client::slot_of(std::initializer_list<std::string_view> parts) const {
  if (!cluster_) return -1;
  std::string key;
  for (std::string_view p : parts) key += p;
  return redis_hash_slot(key);
}

}  // namespace idem::detail::redis
