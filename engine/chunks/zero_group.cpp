// In-process zero_groups. See zero_group.hpp.
#include "engine/chunks/zero_group.hpp"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <utility>

namespace troupe::engine {
namespace {

std::int64_t total(const zero_group::float_ranges& r) {
  std::int64_t n = 0;
  for (const auto& [p, k] : r) n += k;
  return n;
}

class host_zero_group final : public replicas_zero_group {
 public:
  using replicas_zero_group::replicas_zero_group;
  std::string describe() const override {
    return "host ZeRO group " + name() + " of " + std::to_string(replicas()) + " replicas";
  }

 protected:
  std::vector<void*> run(op o, const std::vector<float_ranges>& ranges,
                         const std::vector<void*>&) override {
    const int d = replicas();
    for (int c = 0; c < d; ++c) {
      const auto& owner = ranges[static_cast<std::size_t>(chunk_owner(c, d))];
      if (o == op::all_gather) {
        const auto values = copy_chunk_out(owner, d, c);
        for (const auto& r : ranges)
          if (&r != &owner) copy_chunk_in(r, d, c, values.data());
        continue;
      }
      std::vector<std::vector<float>> copies;
      std::vector<const float*> by_replica;
      for (const auto& r : ranges) copies.push_back(copy_chunk_out(r, d, c));
      for (const auto& x : copies) by_replica.push_back(x.data());
      copy_chunk_in(owner, d, c, ring_chunk_mean(by_replica, c, copies[0].size()).data());
    }
    return std::vector<void*>(ranges.size(), nullptr);
  }
};

}  // namespace

replicas_zero_group::replicas_zero_group(int replicas, std::string name)
    : replicas_(replicas), name_(std::move(name)) {
  if (replicas < 1)
    throw std::invalid_argument("zero group " + name_ + ": " + std::to_string(replicas) +
                                " replicas");
  calls_.assign(static_cast<std::size_t>(replicas), 0);
}

void replicas_zero_group::reduce_scatter(int step, int bucket, int replica,
                                         const float_ranges& ranges, void* ready, done_fn done) {
  call(op::reduce_scatter, step, bucket, replica, ranges, ready, std::move(done));
}

void replicas_zero_group::all_gather(int step, int bucket, int replica, const float_ranges& ranges,
                                     void* ready, done_fn done) {
  call(op::all_gather, step, bucket, replica, ranges, ready, std::move(done));
}

void replicas_zero_group::call(op o, int step, int bucket, int replica, const float_ranges& ranges,
                               void* ready, done_fn done) {
  if (replica < 0 || replica >= replicas_)
    throw std::logic_error("zero group " + name_ + ": replica " + std::to_string(replica) + " of " +
                           std::to_string(replicas_));
  auto what = [](int op_, int step_, int bucket_) {
    return std::string(op_ == static_cast<int>(op::reduce_scatter) ? "reduce-scatter"
                                                                   : "all-gather") +
           " of bucket " + std::to_string(bucket_) + " (step " + std::to_string(step_) + ")";
  };
  pending p;
  {
    std::lock_guard lock(mutex_);
    const auto at = static_cast<std::size_t>(replica);
    const auto key = std::make_tuple(static_cast<int>(o), step, bucket);
    const std::uint64_t seq = calls_[at]++;
    auto& q = pending_[seq];
    if (q.ranges.empty()) {
      q.key = key;
      q.ranges.resize(static_cast<std::size_t>(replicas_));
      q.ready.resize(static_cast<std::size_t>(replicas_));
      q.done.resize(static_cast<std::size_t>(replicas_));
    } else if (q.key != key) {
      const auto [o1, s1, b1] = q.key;
      throw std::logic_error("zero group " + name_ + ": replica " + std::to_string(replica) +
                             "'s collective " + std::to_string(seq) + " is the " +
                             what(static_cast<int>(o), step, bucket) + ", another replica's the " +
                             what(o1, s1, b1) + " (the replicas must call in one order)");
    }
    q.ranges[at] = ranges;
    q.ready[at] = ready;
    q.done[at] = std::move(done);
    if (++q.arrived < replicas_) return;
    p = std::move(q);
    pending_.erase(seq);
  }
  for (const auto& r : p.ranges) {
    bool same = r.size() == p.ranges[0].size();
    for (std::size_t i = 0; same && i < r.size(); ++i) same = r[i].second == p.ranges[0][i].second;
    if (!same)
      throw std::logic_error("zero group " + name_ + ": replicas disagree on bucket " +
                             std::to_string(bucket) + "'s ranges");
  }
  std::vector<void*> events;
  {
    std::lock_guard lock(run_mutex_);
    events = run(o, p.ranges, p.ready);
  }
  for (std::size_t r = 0; r < p.done.size(); ++r) p.done[r](events.at(r));
}

std::vector<float> copy_chunk_out(const zero_group::float_ranges& ranges, int d, int c) {
  const auto [b, e] = owned_chunk_bounds(total(ranges), d, c);
  std::vector<float> out(static_cast<std::size_t>(e - b));
  for_each_piece(ranges, b, e, [&](float* p, std::int64_t k, std::int64_t off) {
    std::memcpy(out.data() + off, p, static_cast<std::size_t>(k) * sizeof(float));
  });
  return out;
}

void copy_chunk_in(const zero_group::float_ranges& ranges, int d, int c, const float* values) {
  const auto [b, e] = owned_chunk_bounds(total(ranges), d, c);
  for_each_piece(ranges, b, e, [&](float* p, std::int64_t k, std::int64_t off) {
    std::memcpy(p, values + off, static_cast<std::size_t>(k) * sizeof(float));
  });
}

std::vector<float> ring_chunk_mean(const std::vector<const float*>& by_replica, int c,
                                   std::size_t n) {
  const int d = static_cast<int>(by_replica.size());
  std::vector<float> sum(n);
  for (int k = 0; k < d; ++k) {
    const float* x = by_replica[static_cast<std::size_t>((c + k) % d)];
    for (std::size_t i = 0; i < n; ++i) sum[i] = k == 0 ? x[i] : sum[i] + x[i];
  }
  const float scale = 1.0f / static_cast<float>(d);
  for (float& v : sum) v = v * scale;
  return sum;
}

std::shared_ptr<zero_group> make_host_zero_group(int replicas, std::string name) {
  return std::make_shared<host_zero_group>(replicas, std::move(name));
}

}  // namespace troupe::engine
