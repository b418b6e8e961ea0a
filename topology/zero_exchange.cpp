// ZeRO's collectives between processes, in host memory. See zero_exchange.hpp.
#include "topology/zero_exchange.hpp"

#include <algorithm>
#include <cstring>
#include <stdexcept>

#include "engine/chunks/zero_group.hpp"

namespace troupe::topology {
using engine::copy_chunk_in;
using engine::copy_chunk_out;

exchange_zero_group::exchange_zero_group(std::string name, int rank, std::vector<bool> here,
                                         post_fn remote)
    : name_(std::move(name)),
      rank_(rank),
      replicas_(static_cast<int>(here.size())),
      here_(std::move(here)),
      remote_(std::move(remote)),
      calls_(here_.size(), 0) {}

std::string exchange_zero_group::describe() const {
  return "ZeRO group " + name_ + " of " + std::to_string(replicas_) + " replicas across processes";
}

std::string exchange_zero_group::collective(int phase, int step, int bucket) const {
  return std::string(phase == 0 ? "reduce-scatter" : "all-gather") + " of bucket " +
         std::to_string(bucket) + " (step " + std::to_string(step) + ")";
}

void exchange_zero_group::reduce_scatter(int step, int bucket, int replica,
                                         const float_ranges& ranges, void*, done_fn done) {
  call(0, step, bucket, replica, ranges, std::move(done));
}

void exchange_zero_group::all_gather(int step, int bucket, int replica, const float_ranges& ranges,
                                     void*, done_fn done) {
  call(1, step, bucket, replica, ranges, std::move(done));
}

void exchange_zero_group::call(int phase, int step, int bucket, int replica,
                               const float_ranges& ranges, done_fn done) {
  if (replica < 0 || replica >= replicas_ || !here_[static_cast<std::size_t>(replica)])
    throw std::logic_error(describe() + ": replica " + std::to_string(replica) +
                           " is not one of this process's");
  const int d = replicas_, owned = (replica + 1) % d;
  std::uint64_t k = 0;
  {
    std::lock_guard lock(m_);
    k = calls_[static_cast<std::size_t>(replica)]++;
    auto& p = pending_[{replica, k}];
    for (const auto& [from, m] : p.received)
      if (m.phase != phase || m.step != step || m.bucket != bucket)
        throw std::logic_error(
            describe() + ": replica " + std::to_string(replica) + "'s collective " +
            std::to_string(k) + " is the " + collective(phase, step, bucket) + ", replica " +
            std::to_string(from) + "'s the " + collective(m.phase, m.step, m.bucket) +
            " (the replicas must call in one order)");
    p.called = true;
    p.phase = phase;
    p.step = step;
    p.bucket = bucket;
    p.ranges = ranges;
    p.done = std::move(done);
  }
  // Its pieces leave: each chunk it does not own to the chunk's owner (reduce-scatter), or its
  // owned chunk to every other replica (all-gather).
  for (int to = 0; to < d; ++to) {
    if (to == replica) continue;
    const int chunk = phase == 0 ? (to + 1) % d : owned;
    messages::ring_chunk m;
    m.step = step;
    m.rank = rank_;
    m.bucket = bucket;
    m.from_replica = replica;
    m.phase = phase;
    m.chunk = chunk;
    m.collective = static_cast<int>(k);
    m.data = std::make_shared<messages::payload<float>>(copy_chunk_out(ranges, d, chunk));
    send(to, std::move(m));
  }
  done_fn finished;
  {
    std::lock_guard lock(m_);
    finished = complete(replica, k);
  }
  if (finished) finished(nullptr);
}

void exchange_zero_group::send(int to, messages::ring_chunk m) {
  if (here_[static_cast<std::size_t>(to)]) {
    deliver(to, std::move(m));  // handed over in this process
  } else {
    remote_(to, std::move(m));
  }
}

void exchange_zero_group::deliver(int replica, messages::ring_chunk m) {
  if (replica < 0 || replica >= replicas_ || !here_[static_cast<std::size_t>(replica)])
    throw std::logic_error(describe() + ": a message for replica " + std::to_string(replica) +
                           ", not one of this process's");
  done_fn finished;
  {
    std::lock_guard lock(m_);
    const auto k = static_cast<std::uint64_t>(m.collective);
    const int from = m.from_replica;
    pending_[{replica, k}].received[from] = std::move(m);
    finished = complete(replica, k);
  }
  if (finished) finished(nullptr);
}

exchange_zero_group::done_fn exchange_zero_group::complete(int replica, std::uint64_t k) {
  const auto it = pending_.find({replica, k});
  if (it == pending_.end()) return {};
  auto& p = it->second;
  const int d = replicas_;
  if (!p.called || static_cast<int>(p.received.size()) < d - 1) return {};
  for (const auto& [from, m] : p.received)
    if (m.phase != p.phase || m.step != p.step || m.bucket != p.bucket)
      throw std::logic_error(
          describe() + ": replica " + std::to_string(replica) + "'s collective " +
          std::to_string(k) + " is the " + collective(p.phase, p.step, p.bucket) + ", replica " +
          std::to_string(from) + "'s the " + collective(m.phase, m.step, m.bucket) +
          " (the replicas must call in one order)");
  if (p.phase == 0) {  // the owned chunk's mean in the ring's order, into its ranges
    const int c = (replica + 1) % d;
    const std::vector<float> own = copy_chunk_out(p.ranges, d, c);
    std::vector<const float*> by_replica(static_cast<std::size_t>(d), own.data());
    for (const auto& [from, m] : p.received) {
      if (m.data->size() != own.size())
        throw std::logic_error(describe() + ": replica " + std::to_string(from) +
                               " sent another size of chunk " + std::to_string(c));
      by_replica[static_cast<std::size_t>(from)] = m.data->data();
    }
    copy_chunk_in(p.ranges, d, c, engine::ring_chunk_mean(by_replica, c, own.size()).data());
  } else {  // every other owner's chunk into its ranges
    for (const auto& [from, m] : p.received) copy_chunk_in(p.ranges, d, m.chunk, m.data->data());
  }
  done_fn done = std::move(p.done);
  pending_.erase(it);
  return done;
}

}  // namespace troupe::topology
