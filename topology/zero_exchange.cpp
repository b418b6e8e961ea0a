// ZeRO's collectives between processes, in host memory. See zero_exchange.hpp.
#include "topology/zero_exchange.hpp"

#include <algorithm>
#include <cstring>
#include <stdexcept>

#include "engine/chunks/zero_group.hpp"

namespace troupe::topology {
namespace {

std::int64_t total(const engine::zero_group::float_ranges& r) {
  std::int64_t n = 0;
  for (const auto& [p, k] : r) n += k;
  return n;
}

// Chunk c of `ranges` copied out, and copied in.
std::vector<float> chunk_of(const engine::zero_group::float_ranges& ranges, int d, int c) {
  const auto [b, e] = engine::owned_chunk_bounds(total(ranges), d, c);
  std::vector<float> out(static_cast<std::size_t>(e - b));
  engine::for_each_piece(ranges, b, e, [&](float* p, std::int64_t k, std::int64_t off) {
    std::memcpy(out.data() + off, p, static_cast<std::size_t>(k) * sizeof(float));
  });
  return out;
}
void put_chunk(const engine::zero_group::float_ranges& ranges, int d, int c, const float* values) {
  const auto [b, e] = engine::owned_chunk_bounds(total(ranges), d, c);
  engine::for_each_piece(ranges, b, e, [&](float* p, std::int64_t k, std::int64_t off) {
    std::memcpy(p, values + off, static_cast<std::size_t>(k) * sizeof(float));
  });
}

}  // namespace

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
    m.data = std::make_shared<messages::payload<float>>(chunk_of(ranges, d, chunk));
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
  if (p.phase == 0) {  // the owned chunk's sum in the ring's order, scaled, into its ranges
    const int c = (replica + 1) % d;
    std::vector<float> own = chunk_of(p.ranges, d, c), sum(own.size());
    for (int j = 0; j < d; ++j) {
      const int from = (c + j) % d;
      const float* x = from == replica ? own.data() : p.received.at(from).data->data();
      if (from != replica && p.received.at(from).data->size() != own.size())
        throw std::logic_error(describe() + ": replica " + std::to_string(from) +
                               " sent another size of chunk " + std::to_string(c));
      for (std::size_t i = 0; i < sum.size(); ++i) sum[i] = j == 0 ? x[i] : sum[i] + x[i];
    }
    const float scale = 1.0f / static_cast<float>(d);
    for (float& v : sum) v = v * scale;
    put_chunk(p.ranges, d, c, sum.data());
  } else {  // every other owner's chunk into its ranges
    for (const auto& [from, m] : p.received) put_chunk(p.ranges, d, m.chunk, m.data->data());
  }
  done_fn done = std::move(p.done);
  pending_.erase(it);
  return done;
}

}  // namespace troupe::topology
