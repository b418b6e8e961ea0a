// Gradient buckets and the in-process mean. See grad_buckets.hpp.
#include "topology/grad_buckets.hpp"

#include "engine/chunks/device_chunk.hpp"

#include <stdexcept>

namespace troupe::topology {

void grad_buckets::build(const std::vector<engine::gpt_chunk*>& chunks, int layers_per_bucket) {
  std::vector<std::vector<engine::grad_block>> blocks;
  std::vector<float*> grads;
  for (auto* st : chunks) {
    blocks.push_back(engine::chunk_grad_blocks(*st));
    grads.push_back(st->grads());
  }
  build(blocks, grads, layers_per_bucket);
  for (auto* st : chunks)
    sides_.push_back({st->range(), &st->parameters(), st->params(), st->grads()});
}

void grad_buckets::build(engine::rank_chunks& chunks, int layers_per_bucket, zero_side side) {
  std::vector<std::vector<engine::grad_block>> blocks;
  std::vector<float*> grads;
  for (int c = 0; c < chunks.chunk_count(); ++c) {
    blocks.push_back(chunks.grad_blocks(c));
    grads.push_back(chunks.gradients(c));
  }
  build(blocks, grads, layers_per_bucket);
  if (side == zero_side::none) return;
  for (int c = 0; c < chunks.chunk_count(); ++c) {
    if (side == zero_side::host) {
      sides_.push_back({chunks.range(c), &chunks.layout(c), chunks.host_parameters(c),
                        chunks.host_gradients(c)});
      continue;
    }
    auto* d = chunks.device(c);
    if (!d) throw std::logic_error("grad_buckets: a device side over chunks of another kind");
    sides_.push_back(
        {chunks.range(c), &chunks.layout(c), d->device_parameters(), d->device_gradients()});
  }
}

void grad_buckets::build(const std::vector<std::vector<engine::grad_block>>& chunk_blocks,
                         const std::vector<float*>& grads, int layers_per_bucket) {
  if (chunk_blocks.size() != grads.size())
    throw std::invalid_argument("grad_buckets: blocks and gradient buffers of other chunk counts");
  grad_base_ = grads;
  sides_.clear();
  buckets_.clear();
  bucket_of_block_.clear();
  for (int c = 0; c < static_cast<int>(chunk_blocks.size()); ++c) {
    const auto& blocks = chunk_blocks[static_cast<std::size_t>(c)];
    float* const base = grads[static_cast<std::size_t>(c)];
    std::vector<int> owner(blocks.size(), -1);
    int layers_in_open = 0;
    int open = -1;
    for (int b = 0; b < static_cast<int>(blocks.size()); ++b) {
      const auto& blk = blocks[static_cast<std::size_t>(b)];
      const bool layer = blk.name.rfind("h.", 0) == 0;
      if (!layer || open < 0 || layers_in_open >= layers_per_bucket) {
        buckets_.push_back({c, blk.name, {}, {}});
        open = layer ? static_cast<int>(buckets_.size()) - 1 : -1;
        layers_in_open = 0;
      } else {
        buckets_.back().name += "," + blk.name;
      }
      auto& bk = buckets_.back();
      for (const auto& [offset, n] : blk.ranges) bk.ranges.emplace_back(base + offset, n);
      bk.blocks.push_back(b);
      owner[static_cast<std::size_t>(b)] = static_cast<int>(buckets_.size()) - 1;
      if (layer) ++layers_in_open;
    }
    bucket_of_block_.push_back(std::move(owner));
  }
  start_step();
}

void grad_buckets::start_step() {
  remaining_.assign(buckets_.size(), 0);
  for (std::size_t i = 0; i < buckets_.size(); ++i)
    remaining_[i] = static_cast<int>(buckets_[i].blocks.size());
}

std::optional<int> grad_buckets::block_done(int chunk, int block) {
  const int b = bucket_of(chunk, block);
  if (--remaining_.at(static_cast<std::size_t>(b)) == 0) return b;
  if (remaining_[static_cast<std::size_t>(b)] < 0)
    throw std::logic_error("gradient block reported final twice in one step");
  return std::nullopt;
}

int grad_buckets::bucket_of(int chunk, int block) const {
  return bucket_of_block_.at(static_cast<std::size_t>(chunk)).at(static_cast<std::size_t>(block));
}

const grad_buckets::shard_side& grad_buckets::side(int chunk) const {
  if (sides_.empty()) throw std::logic_error("grad_buckets: built without ZeRO's side");
  return sides_.at(static_cast<std::size_t>(chunk));
}

std::vector<std::pair<float*, std::int64_t>> grad_buckets::param_ranges(int bucket) const {
  const auto& b = this->bucket(bucket);
  const auto& s = side(b.chunk);
  const float* base = grad_base_.at(static_cast<std::size_t>(b.chunk));
  std::vector<std::pair<float*, std::int64_t>> r;
  for (const auto& [ptr, n] : b.ranges) r.emplace_back(s.params + (ptr - base), n);
  return r;
}

std::vector<std::pair<float*, std::int64_t>> grad_buckets::shard_grad_ranges(int bucket) const {
  const auto& b = this->bucket(bucket);
  const auto& s = side(b.chunk);
  const float* base = grad_base_.at(static_cast<std::size_t>(b.chunk));
  std::vector<std::pair<float*, std::int64_t>> r;
  for (const auto& [ptr, n] : b.ranges) r.emplace_back(s.grads + (ptr - base), n);
  return r;
}

int grad_buckets::bucket_containing(const float* grad) const {
  for (std::size_t b = 0; b < buckets_.size(); ++b)
    for (const auto& [ptr, n] : buckets_[b].ranges)
      if (ptr <= grad && grad < ptr + n) return static_cast<int>(b);
  throw std::logic_error("no gradient bucket holds this gradient");
}

std::vector<engine::bucket_shard> grad_buckets::shards(int replica, int replicas,
                                                       engine::tensor_shard tp) const {
  std::vector<engine::bucket_shard> out;
  std::int64_t at = 0;
  for (const auto& info : buckets_) {
    const auto& s = side(info.chunk);
    const float* base = grad_base_.at(static_cast<std::size_t>(info.chunk));
    std::vector<std::pair<std::int64_t, std::int64_t>> ranges;
    for (const auto& [ptr, n] : info.ranges) ranges.emplace_back(ptr - base, n);
    out.push_back(engine::make_bucket_shard(s.range, *s.layout, info.chunk, std::move(ranges),
                                            replica, replicas, at, tp));
    at += out.back().end - out.back().begin;
  }
  return out;
}

engine::shard_views grad_buckets::views() const {
  engine::shard_views v;
  for (int c = 0; c < static_cast<int>(grad_base_.size()); ++c) {
    v.params.push_back(side(c).params);
    v.grads.push_back(side(c).grads);
  }
  return v;
}

}  // namespace troupe::topology
