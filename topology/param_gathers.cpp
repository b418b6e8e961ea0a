// ZeRO-3 parameter buckets of a rank. See param_gathers.hpp.
#include "topology/param_gathers.hpp"

#include <algorithm>
#include <stdexcept>
#include <utility>

namespace troupe::topology {

param_gathers::param_gathers(const grad_buckets& buckets, std::int64_t capacity_bytes)
    : buckets_(buckets), pool_(std::make_unique<engine::page_pool>(capacity_bytes)) {
  memory_.release = [this](int b) {
    for (const auto& [ptr, n] : buckets_.param_ranges(b)) pool_->release(ptr, n);
  };
  memory_.acquire = [this](int b) {
    for (const auto& [ptr, n] : buckets_.param_ranges(b)) pool_->acquire(ptr, n);
  };
}

param_gathers::param_gathers(const grad_buckets& buckets, bucket_memory memory)
    : buckets_(buckets), memory_(std::move(memory)) {}

std::vector<int> param_gathers::buckets_of(int chunk, const std::vector<int>& blocks) const {
  std::vector<int> b;
  for (int block : blocks) b.push_back(buckets_.bucket_of(chunk, block));
  std::sort(b.begin(), b.end());
  b.erase(std::unique(b.begin(), b.end()), b.end());
  return b;
}

void param_gathers::start(std::vector<std::vector<int>> uses, int prefetch, gather_fn gather) {
  gather_ = std::move(gather);
  cursor_ = 0;
  seq_ = 0;
  bucket_of_seq_.clear();
  peak_ = gathered_;
  apply(residency_.start(std::move(uses), prefetch));
}

void param_gathers::check_next(const std::vector<int>& buckets) const {
  if (cursor_ >= residency_.uses() || buckets != residency_.use(cursor_))
    throw std::logic_error("ZeRO-3: a pass read parameters its plan did not foresee");
}

bool param_gathers::next_ready() const { return residency_.ready(cursor_); }

void param_gathers::finish(int use) { apply(residency_.finished(use)); }

int param_gathers::gathered(int seq) {
  const int b = bucket_of_seq_.at(seq);
  residency_.gathered(b);
  return b;
}

// Releases first: at most prefetch + 1 uses' buckets are ever in the buffers, and the pages a
// release frees are the ones the gathers after it take.
void param_gathers::apply(const engine::param_residency::changes& ch) {
  if (memory_.round && (!ch.release.empty() || !ch.gather.empty())) memory_.round();
  for (int b : ch.release) {
    memory_.release(b);
    gathered_ -= bucket_bytes(b);
  }
  for (int b : ch.gather) {
    memory_.acquire(b);
    bucket_of_seq_[seq_] = b;
    gather_(seq_++, b);
    gathered_ += bucket_bytes(b);
  }
  peak_ = std::max(peak_, gathered_);
}

void param_gathers::gather_all(const gather_fn& gather) {
  for (int b = 0; b < buckets_.size(); ++b) {
    memory_.acquire(b);
    gather(b, b);
  }
}

std::int64_t param_gathers::bucket_bytes(int b) const {
  std::int64_t n = 0;
  for (const auto& r : buckets_.bucket(b).ranges) n += r.second;
  return n * static_cast<std::int64_t>(sizeof(float));
}

}  // namespace troupe::topology
