// Ring collectives. See collectives.hpp for the order of operations.
#include "topology/collectives.hpp"

#include "engine/chunks/zero_group.hpp"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace troupe::topology {
namespace {

std::int64_t total(const float_ranges& r) {
  std::int64_t n = 0;
  for (const auto& [p, k] : r) n += k;
  return n;
}

using engine::for_each_piece;  // the pieces of [begin, end) in ranges

int mod(int a, int d) { return ((a % d) + d) % d; }

}  // namespace

std::pair<std::int64_t, std::int64_t> ring_chunk_bounds(std::int64_t n, int d, int c) {
  return engine::owned_chunk_bounds(n, d, c);
}

void ring_order_mean(const std::vector<float_ranges>& replicas) {
  if (replicas.empty()) return;
  const int d = static_cast<int>(replicas.size());
  const std::int64_t n = total(replicas[0]);
  for (const auto& r : replicas)
    if (total(r) != n) throw std::logic_error("data-parallel replicas disagree on a bucket's size");
  const float scale = 1.0f / static_cast<float>(d);
  for (int c = 0; c < d; ++c) {
    const auto [b, e] = ring_chunk_bounds(n, d, c);
    std::vector<float> sum(static_cast<std::size_t>(e - b));
    for (int k = 0; k < d; ++k) {
      for_each_piece(replicas[static_cast<std::size_t>(mod(c + k, d))], b, e,
                     [&](float* p, std::int64_t cnt, std::int64_t off) {
                       for (std::int64_t i = 0; i < cnt; ++i)
                         sum[static_cast<std::size_t>(off + i)] =
                             k == 0 ? p[i] : sum[static_cast<std::size_t>(off + i)] + p[i];
                     });
    }
    for (float& v : sum) v = v * scale;
    for (const auto& r : replicas)
      for_each_piece(r, b, e, [&](float* p, std::int64_t cnt, std::int64_t off) {
        for (std::int64_t i = 0; i < cnt; ++i) p[i] = sum[static_cast<std::size_t>(off + i)];
      });
  }
}

ring_allreduce::ring_allreduce(float_ranges ranges, int replica, int replicas, ring_kind kind)
    : ranges_(std::move(ranges)),
      replica_(replica),
      replicas_(replicas),
      kind_(kind),
      n_(total(ranges_)) {
  if (replicas < 1 || replica < 0 || replica >= replicas)
    throw std::logic_error("ring_allreduce: replica " + std::to_string(replica) + " of " +
                           std::to_string(replicas));
  // A half run alone counts the other half as already done.
  if (kind_ == ring_kind::all_gather) received_[0] = replicas_ - 1;
  if (kind_ == ring_kind::reduce_scatter) received_[1] = replicas_ - 1;
}

std::shared_ptr<messages::payload<float>> ring_allreduce::gather(int chunk) const {
  const auto [b, e] = ring_chunk_bounds(n_, replicas_, chunk);
  auto out = std::make_shared<messages::payload<float>>(static_cast<std::size_t>(e - b),
                                                        messages::payload<float>::for_overwrite);
  for_each_piece(ranges_, b, e, [&](float* p, std::int64_t cnt, std::int64_t off) {
    std::copy(p, p + cnt, out->data() + off);
  });
  return out;
}

void ring_allreduce::scatter(int chunk, const float* data, bool add) {
  const auto [b, e] = ring_chunk_bounds(n_, replicas_, chunk);
  for_each_piece(ranges_, b, e, [&](float* p, std::int64_t cnt, std::int64_t off) {
    for (std::int64_t i = 0; i < cnt; ++i) p[i] = add ? data[off + i] + p[i] : data[off + i];
  });
}

// Reduce-scatter step s (s = received so far) receives chunk r-s-1; all-gather step s receives
// the chunk owned by replica r-s-1, i.e. chunk r-s.
int ring_allreduce::expected_chunk(int phase) const {
  const int s = received_[phase];
  return phase == 0 ? mod(replica_ - s - 1, replicas_) : mod(replica_ - s, replicas_);
}

std::vector<ring_allreduce::send> ring_allreduce::start() {
  if (replicas_ == 1) return {};
  if (kind_ == ring_kind::all_gather) {
    const int own = ring_owned_chunk(replica_, replicas_);
    return {{1, own, gather(own)}};
  }
  return {{0, replica_, gather(replica_)}};
}

std::vector<ring_allreduce::send> ring_allreduce::receive(int phase, int chunk, const float* data,
                                                          std::int64_t n) {
  const auto fail = [&](const std::string& what) {
    throw std::logic_error("ring all-reduce on replica " + std::to_string(replica_) + ": " + what);
  };
  if (phase != 0 && phase != 1) fail("phase " + std::to_string(phase));
  if (phase == 1 && received_[0] < replicas_ - 1) fail("all-gather chunk before reduce-scatter");
  if ((phase == 0 && kind_ == ring_kind::all_gather) ||
      (phase == 1 && kind_ == ring_kind::reduce_scatter))
    fail("phase " + std::to_string(phase) + " chunk in a collective without that phase");
  if (received_[phase] >= replicas_ - 1)
    fail("one chunk too many in phase " + std::to_string(phase));
  if (chunk != expected_chunk(phase))
    fail("chunk " + std::to_string(chunk) + " in phase " + std::to_string(phase) + ", expected " +
         std::to_string(expected_chunk(phase)));
  const auto [b, e] = ring_chunk_bounds(n_, replicas_, chunk);
  if (n != e - b) fail("chunk " + std::to_string(chunk) + " has " + std::to_string(n) + " floats");
  std::vector<send> out;
  if (phase == 0) {
    scatter(chunk, data, true);
    ++received_[0];
    if (received_[0] < replicas_ - 1) {
      out.push_back({0, chunk, gather(chunk)});
    } else {  // this replica owns `chunk` now: scale it and start the all-gather
      const float scale = 1.0f / static_cast<float>(replicas_);
      for_each_piece(ranges_, b, e, [&](float* p, std::int64_t cnt, std::int64_t) {
        for (std::int64_t i = 0; i < cnt; ++i) p[i] = p[i] * scale;
      });
      if (kind_ == ring_kind::all_reduce) out.push_back({1, chunk, gather(chunk)});
    }
  } else {
    scatter(chunk, data, false);
    ++received_[1];
    // Forward unless the next replica owns this chunk (it started this round of the gather).
    if (received_[1] < replicas_ - 1)
      out.push_back({1, chunk, std::make_shared<messages::payload<float>>(data, data + n)});
  }
  return out;
}

}  // namespace troupe::topology
