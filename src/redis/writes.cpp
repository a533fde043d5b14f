// The writes of one batch (client.hpp: Client::Stream, Writes): sent as the guard makes them,
// answered together, so no completion waits for the rest of the batch and the batch still waits
// for one round trip, not one per item.

#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "client.hpp"
#include "cluster.hpp"
#include "idem/core/error.hpp"

namespace idem::detail::redis {

void Client::Stream::send(Script s, std::string_view req) {
  requests_.emplace_back(s, std::string(req));
  if (broken_) return;  // finish() sends it alone
  try {
    if (!lease_) lease_ = std::make_unique<Pool<Traits>::Lease>(c_->pool_);
    Link& c = lease_->get().link;
    // Written whole or not counted: a request the server got in part cannot run.
    if (c.write(req) == req.size())
      ++written_;
    else
      broken_ = true;
  } catch (const error&) {
    broken_ = true;  // no connection now: finish() tries again, alone, and reports what it gets
  }
}

std::vector<ReplyPtr> Client::Stream::finish(const ReplyErrorHints& hints) {
  std::vector<ReplyPtr> out(requests_.size());
  ReplyPtr wait;
  if (lease_ && written_ > 0) {
    Link& c = lease_->get().link;
    try {
      const bool acks = !c_->wait_.empty();
      // One WAIT after the last write counts the replicas that have every write of the stream.
      if (acks && !broken_ && c.write(c_->wait_) != c_->wait_.size()) broken_ = true;
      for (std::size_t i = 0; i < written_; ++i) out[i] = c_->read_reply(c, "to a batch's write");
      if (acks && !broken_) wait = c_->read_reply(c, "to WAIT");
      if (!broken_) lease_->healthy();
    } catch (const InDoubt&) {
      c_->suspect();  // the rest are asked again below, as the same holder
    }
  }
  lease_.reset();
  std::vector<std::size_t> streamed;
  for (std::size_t i = 0; i < requests_.size(); ++i) {
    if (out[i] && !is_noscript(out[i].get())) {
      streamed.push_back(i);
      continue;
    }
    // Never sent, its answer lost, or NOSCRIPT (the script cache was flushed): alone, on a fresh
    // connection, as the same holder (the scripts answer a step already made as made).
    out[i] = c_->eval_at(requests_[i].first, requests_[i].second, hints, Resend::same_holder, false);
  }
  if (wait)
    for (std::size_t i : streamed) c_->check_acks(requests_[i].first, &out[i], 1, wait);
  else if (!c_->wait_.empty())
    for (std::size_t i : streamed)
      if (wrote(requests_[i].first, out[i].get()))
        throw durability_error(fmt::format("idem: a batch's {} was written, but the connection broke before WAIT "
                                           "could count the replicas that have it; the write stands on the primary "
                                           "and is reported so the message is not acked",
                                           script(requests_[i].first).name),
                               0, c_->options().min_replica_acks);
  return out;
}

struct Writes::Impl {
  Client* client;
  // Off a cluster: one stream. On a cluster: one per master, and where each request went.
  std::vector<std::pair<std::shared_ptr<Client>, std::unique_ptr<Client::Stream>>> streams;
  struct Sent {
    Script script;
    std::string request;
    int slot;
    std::size_t stream;
    std::size_t index;  // within its stream
  };
  std::vector<Sent> sent;
  std::vector<std::size_t> per_stream;
  bool unroutable = false;  // a write found no master
};

bool Writes::broken() const noexcept {
  if (impl_->unroutable) return true;
  for (const auto& s : impl_->streams)
    if (s.second->broken()) return true;
  return false;
}

Writes::Writes(Client& c) : impl_(std::make_unique<Impl>()) { impl_->client = &c; }
Writes::~Writes() = default;
Writes::Writes(Writes&&) noexcept = default;

void Writes::send(Script s, const Request& req, int slot) {
  Impl& m = *impl_;
  std::shared_ptr<Client> node;
  if (m.client->clustered()) {
    try {
      node = m.client->cluster_owner(slot);
    } catch (const error&) {
      // No master for it now: finish() routes it alone (and reports what that gets).
      m.unroutable = true;
      m.sent.push_back({s, std::string(req.view()), slot, static_cast<std::size_t>(-1), 0});
      return;
    }
  }
  std::size_t k = 0;
  while (k < m.streams.size() && m.streams[k].first != node) ++k;
  if (k == m.streams.size()) {
    Client& target = node ? *node : *m.client;
    m.streams.emplace_back(node, std::make_unique<Client::Stream>(target));
    m.per_stream.push_back(0);
  }
  m.streams[k].second->send(s, req.view());
  m.sent.push_back({s, std::string(req.view()), slot, k, m.per_stream[k]++});
}

std::vector<ReplyPtr> Writes::finish(const ReplyErrorHints& hints) {
  Impl& m = *impl_;
  std::vector<std::vector<ReplyPtr>> answers(m.streams.size());
  for (std::size_t k = 0; k < m.streams.size(); ++k) answers[k] = m.streams[k].second->finish(hints);
  std::vector<ReplyPtr> out(m.sent.size());
  for (std::size_t i = 0; i < m.sent.size(); ++i) {
    const Impl::Sent& s = m.sent[i];
    if (s.stream != static_cast<std::size_t>(-1)) out[i] = std::move(answers[s.stream][s.index]);
    // On a cluster, a write never routed goes alone through the cluster's routing, and an error
    // reply through its rules (a redirected one ran nothing and is sent again there).
    if (m.client->clustered() && (!out[i] || is_error(out[i].get())))
      out[i] = m.client->cluster_eval(s.script, s.request, hints, Resend::same_holder, s.slot, std::move(out[i]));
  }
  return out;
}

}  // namespace idem::detail::redis
