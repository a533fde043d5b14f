// RedisAdmin (include/idem/redis/admin.hpp): plain commands on the Redis engine of a client of its
// own (admin_impl.hpp), so every URL a store takes reaches the operator's tool too (TCP or a Unix
// socket, TLS and mutual TLS, Sentinel, Cluster). No scripts loaded at connect: doctor must work
// for a user who may not load them.


#include "admin_impl.hpp"

namespace idem {

RedisAdmin::RedisAdmin(RedisOptions options) : impl_(std::make_unique<Impl>(std::move(options))) {}
RedisAdmin::~RedisAdmin() = default;

std::string RedisAdmin::address() const {
  std::string out;
  for (const auto& n : impl_->nodes) out += (out.empty() ? "" : ",") + n.name();
  return out;
}

std::optional<AdminRecord> RedisAdmin::inspect(std::string_view key) {
  Node& n = impl_->node_of(key);
  impl_->load_scripts(n);
  auto r = command(n, {"EVALSHA", n.inspect_sha, "1", impl_->opt.key_prefix + std::string(key), "1"});
  return Impl::decode(n, std::string(key), r.get());
}

// One DEL per key, pipelined a page at a time: a DEL of many keys is refused (CROSSSLOT) when a
// cluster node's page spans slots, and each key's own reply says whether it was there.
std::size_t RedisAdmin::remove_all() {
  const std::string match = glob_escape(impl_->opt.key_prefix) + "*";
  std::size_t deleted = 0;
  for (auto& n : impl_->nodes)
    scan_pages(n, match, 1000, [&](const redisReply* keys) {
      std::vector<std::vector<std::string>> cmds;
      cmds.reserve(keys->elements);
      for (std::size_t i = 0; i < keys->elements; ++i) cmds.push_back({"DEL", reply_text(keys->element[i])});
      for (const auto& d : pipeline(n, cmds)) {
        if (d->type == REDIS_REPLY_ERROR) throw_reply(n, "DEL", d.get());
        deleted += static_cast<std::size_t>(reply_int(d.get()));
      }
      return true;
    });
  return deleted;
}

// Redis 7 says only "The user executing the script can't run this command" when a script is
// refused a command; run outside a script, the same command's NOPERM names it.
std::string RedisAdmin::refused_script_command() {
  const std::string k = impl_->opt.key_prefix + "acl-probe";
  Node& n = impl_->node_of("acl-probe");
  const std::vector<std::vector<std::string>> calls{
      {"TIME"}, {"GET", k}, {"SET", k, "x", "PX", "60000"}, {"PTTL", k}, {"PEXPIRE", k, "60000"}, {"DEL", k}};
  for (const auto& c : calls) {
    auto r = command(n, c);
    if (r->type == REDIS_REPLY_ERROR && reply_text(r.get()).rfind("NOPERM", 0) == 0) return reply_text(r.get());
  }
  return {};
}

std::size_t RedisAdmin::list(const ListFilter& filter, const std::function<bool(const AdminRecord&)>& each) {
  std::size_t passed = 0, corrupt = 0;
  bool stop = false;
  // Stuck keys first: with no state asked, one pass per state, in_progress then failed then completed.
  std::vector<std::optional<State>> passes;
  if (filter.state)
    passes.push_back(filter.state);
  else
    passes = {State::in_progress, State::failed, State::completed};
  for (const auto& st : passes) {
    if (stop) break;
    if (filter.older_than && st == State::completed) continue;  // nothing of a completed record is overdue
    ListFilter f = filter;
    f.state = st;
    impl_->scan(std::max<std::size_t>(filter.page, 1), [&](AdminRecord& a) {
      if (!Impl::selected(f, a)) return true;
      ++passed;
      if (!each(a) || (filter.limit && passed >= filter.limit)) {
        stop = true;
        return false;
      }
      return true;
    }, corrupt);
  }
  return passed;
}

ReleaseResult RedisAdmin::release(std::string_view key, std::uint64_t fence, bool force) {
  Node& n = impl_->node_of(key);
  impl_->load_scripts(n);
  auto r = command(n, {"EVALSHA", n.release_sha, "1", impl_->opt.key_prefix + std::string(key), std::to_string(fence),
                       force ? "1" : "0", fmt::format("released by idem release (fence {})", fence)});
  if (r->type == REDIS_REPLY_ERROR) throw_reply(n, fmt::format("release of '{}'", key), r.get());
  if (r->type != REDIS_REPLY_ARRAY || r->elements != 3) throw store_error("idem: unexpected release reply", "", false);
  ReleaseResult out;
  constexpr ReleaseStatus codes[] = {ReleaseStatus::released, ReleaseStatus::not_found, ReleaseStatus::fence_mismatch,
                                     ReleaseStatus::completed, ReleaseStatus::live};
  const auto code = reply_int(r->element[0]);
  if (code < 0 || code > 4) throw store_error("idem: unexpected release status", "", false);
  out.status = codes[code];
  out.fence = static_cast<std::uint64_t>(reply_int(r->element[1]));
  out.state = static_cast<State>(reply_int(r->element[2]));
  return out;
}

AdminStats RedisAdmin::stats() {
  AdminStats s;
  std::size_t corrupt = 0;
  impl_->scan(1000, [&](AdminRecord& a) {
    const auto st = static_cast<std::size_t>(a.record.state);
    if (st < s.by_state.size()) ++s.by_state[st];
    ++s.records;
    s.bytes += a.bytes + a.key.size() + impl_->opt.key_prefix.size();
    if (a.record.state == State::in_progress) {
      const auto o = overdue_ms(a);
      if (o >= 0) ++s.lapsed;
      if (!s.most_overdue_ms || o > *s.most_overdue_ms) s.most_overdue_ms = o;
    }
    return true;
  }, corrupt);
  return s;
}

}  // namespace idem
