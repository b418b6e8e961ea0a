// ZeRO-1/2 on device chunks through a zero_group. See device_zero.hpp.
#include "topology/device_zero.hpp"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace troupe::topology {

device_zero::device_zero(engine::rank_chunks& chunks, const grad_buckets& buckets,
                         std::shared_ptr<engine::zero_group> group, int replica, int replicas,
                         engine::tensor_shard tp, bool parameters)
    : chunks_(&chunks),
      buckets_(&buckets),
      group_(std::move(group)),
      replica_(replica),
      shards_(buckets.shards(replica, replicas, tp)),
      local_(shards_) {
  const int n = chunks.chunk_count();
  std::vector<std::vector<engine::shard_segment>> owned(static_cast<std::size_t>(n));
  owned_floats_.assign(static_cast<std::size_t>(n), 0);
  for (auto& b : local_) {
    for (auto& s : b.segments) {
      if (s.chunk < 0 || s.chunk >= n || !chunks.device(s.chunk))
        throw std::logic_error("device_zero: a segment of chunk " + std::to_string(s.chunk) +
                               ", not a device chunk of this rank");
      auto& at = owned_floats_[static_cast<std::size_t>(s.chunk)];
      s.at = at;
      at += s.numel;
      owned[static_cast<std::size_t>(s.chunk)].push_back(s);
    }
  }
  for (int c = 0; c < n; ++c)
    chunks.device(c)->own(std::move(owned[static_cast<std::size_t>(c)]), parameters);
}

std::int64_t device_zero::owned_floats() const {
  std::int64_t total = 0;
  for (const auto& b : shards_)
    for (const auto& s : b.segments) total = std::max(total, s.at + s.numel);
  return total;
}

std::vector<float> device_zero::to_shard_order(const std::vector<std::vector<float>>& local) const {
  std::vector<float> out(static_cast<std::size_t>(owned_floats()));
  for (std::size_t b = 0; b < shards_.size(); ++b) {
    for (std::size_t i = 0; i < shards_[b].segments.size(); ++i) {
      const auto& s = shards_[b].segments[i];
      const auto& from = local.at(static_cast<std::size_t>(s.chunk));
      std::copy_n(from.begin() + local_[b].segments[i].at, s.numel, out.begin() + s.at);
    }
  }
  return out;
}

std::pair<std::vector<float>, std::vector<float>> device_zero::moments() {
  std::vector<std::vector<float>> m, v;
  for (int c = 0; c < chunks_->chunk_count(); ++c) {
    auto [cm, cv] = chunks_->device(c)->owned_moments();
    m.push_back(std::move(cm));
    v.push_back(std::move(cv));
  }
  return {to_shard_order(m), to_shard_order(v)};
}

std::vector<float> device_zero::parameters() {
  std::vector<std::vector<float>> p;
  for (int c = 0; c < chunks_->chunk_count(); ++c)
    p.push_back(chunks_->device(c)->owned_parameters());
  return to_shard_order(p);
}

void device_zero::load_moments(const std::vector<float>& m, const std::vector<float>& v) {
  std::vector<std::pair<std::vector<float>, std::vector<float>>> local;
  for (const auto n : owned_floats_)
    local.emplace_back(std::vector<float>(static_cast<std::size_t>(n)),
                       std::vector<float>(static_cast<std::size_t>(n)));
  for (std::size_t b = 0; b < shards_.size(); ++b) {
    for (std::size_t i = 0; i < shards_[b].segments.size(); ++i) {
      const auto& s = shards_[b].segments[i];
      if (static_cast<std::int64_t>(m.size()) < s.at + s.numel ||
          static_cast<std::int64_t>(v.size()) < s.at + s.numel)
        throw std::logic_error("device_zero: moments shorter than the owned floats");
      auto& [lm, lv] = local.at(static_cast<std::size_t>(s.chunk));
      const auto to = local_[b].segments[i].at;
      std::copy_n(m.begin() + s.at, s.numel, lm.begin() + to);
      std::copy_n(v.begin() + s.at, s.numel, lv.begin() + to);
    }
  }
  for (int c = 0; c < chunks_->chunk_count(); ++c) {
    const auto& [lm, lv] = local[static_cast<std::size_t>(c)];
    chunks_->device(c)->load_owned_moments(lm.data(), lv.data());
  }
}

void device_zero::reduce_scatter(int step, int b, engine::zero_group::done_fn done) {
  const auto& info = buckets_->bucket(b);
  group_->reduce_scatter(step, b, replica_, info.ranges, chunks_->record_event(info.chunk),
                         std::move(done));
}

double device_zero::square_sum() {
  double sum = 0;
  for (const auto& b : local_) sum += chunks_->device(b.chunk)->owned_square_sum(b.segments);
  return sum;
}

double device_zero::update(const engine::optimizer_config& c, int step, int total_steps,
                           double grad_norm, double unscale) {
  double lr = engine::learning_rate(c, step, total_steps);
  for (int k = 0; k < chunks_->chunk_count(); ++k)
    lr = chunks_->device(k)->update_owned(c, step, total_steps, grad_norm, unscale);
  return lr;
}

void device_zero::all_gather(int step, int b, engine::zero_group::done_fn done) {
  const auto& info = buckets_->bucket(b);
  group_->all_gather(step, b, replica_, buckets_->param_ranges(b),
                     chunks_->record_event(info.chunk), std::move(done));
}

template <class F>
void device_zero::for_each_param_range(int b, F f) {
  const int c = buckets_->bucket(b).chunk;
  const float* base = chunks_->device(c)->device_parameters();
  for (const auto& [ptr, n] : buckets_->param_ranges(b)) f(chunks_->device(c), ptr - base, n);
}

void device_zero::release(int b) {
  for_each_param_range(b, [](engine::device_chunk* d, std::int64_t at, std::int64_t n) {
    d->release_parameters(at, n);
  });
}

void device_zero::acquire(int b) {
  for_each_param_range(b, [](engine::device_chunk* d, std::int64_t at, std::int64_t n) {
    d->acquire_parameters(at, n);
  });
}

void device_zero::parameter_round() {
  for (int c = 0; c < chunks_->chunk_count(); ++c) chunks_->device(c)->parameter_round();
}

void device_zero::gather(int step, int b, engine::zero_group::done_fn done) {
  const auto& info = buckets_->bucket(b);
  chunks_->device(info.chunk)
      ->put_owned_parameters(local_.at(static_cast<std::size_t>(b)).segments);
  group_->all_gather(step, b, replica_, buckets_->param_ranges(b),
                     chunks_->record_event(info.chunk), std::move(done));
}

void device_zero::bucket_gathered(int b) {
  for_each_param_range(b, [](engine::device_chunk* d, std::int64_t at, std::int64_t n) {
    d->parameters_changed(at, n);
  });
}

void device_zero::gathered() {
  for (int c = 0; c < chunks_->chunk_count(); ++c)
    chunks_->device(c)->parameters_changed(0, chunks_->parameter_count(c));
}

}  // namespace troupe::topology
