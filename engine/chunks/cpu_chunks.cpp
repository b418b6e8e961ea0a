// One pipeline rank's arithmetic. See cpu_chunks.hpp.
#include "engine/chunks/cpu_chunks.hpp"

#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>

namespace troupe::engine {
namespace {

std::string describe(int c, micro_batch_id id) {
  return "chunk " + std::to_string(c) + " round " + std::to_string(id.round) + " micro-batch " +
         std::to_string(id.micro_batch);
}

}  // namespace

cpu_chunks::cpu_chunks(const gpt_config& model, const std::vector<chunk_range>& chunks,
                       bool optimizer_state, bool recompute, tensor_shard shard,
                       std::shared_ptr<tensor_group> group)
    : recompute_(recompute), tp_(shard.size) {
  for (const auto& r : chunks) {
    chunk_state s;
    s.model = std::make_unique<gpt_chunk>(model, r, shard);
    if (group) s.model->set_tensor_group(group);
    if (optimizer_state) s.opt = std::make_unique<adamw_optimizer>(*s.model);
    chunks_.push_back(std::move(s));
  }
}

adamw_optimizer& cpu_chunks::optimizer(int c) {
  auto& opt = chunks_.at(static_cast<std::size_t>(c)).opt;
  if (!opt) throw std::logic_error("cpu_chunks: no optimizer state here (a ZeRO shard holds it)");
  return *opt;
}

std::int64_t cpu_chunks::optimizer_bytes() const {
  std::int64_t bytes = 0;
  for (const auto& c : chunks_)
    if (c.opt)
      bytes += static_cast<std::int64_t>(c.opt->first_moment().nbytes() +
                                         c.opt->second_moment().nbytes());
  return bytes;
}

std::int64_t cpu_chunks::activation_bytes() const {
  std::int64_t bytes = 0;
  for (const auto& c : chunks_) {
    for (const auto& [id, s] : c.live) bytes += s.acts->bytes();
    for (const auto& [shape, acts] : c.pool) bytes += acts->bytes();
  }
  for (const auto& [shape, s] : scratch_) bytes += s->bytes();
  return bytes;
}

void cpu_chunks::zero_grad() {
  for (auto& c : chunks_) c.model->zero_grad();
}

cpu_chunks::slot& cpu_chunks::live_slot(int c, micro_batch_id id) {
  auto& live = chunks_.at(static_cast<std::size_t>(c)).live;
  auto it = live.find(id);
  if (it == live.end()) throw std::logic_error("no forward state for " + describe(c, id));
  return it->second;
}

const cpu_chunks::slot& cpu_chunks::live_slot(int c, micro_batch_id id) const {
  const auto& live = chunks_.at(static_cast<std::size_t>(c)).live;
  auto it = live.find(id);
  if (it == live.end()) throw std::logic_error("no forward state for " + describe(c, id));
  return it->second;
}

block_pass cpu_chunks::forward(int c, micro_batch_id id, forward_args args) {
  auto& ch = chunks_.at(static_cast<std::size_t>(c));
  if (ch.live.count(id)) throw std::logic_error("forward twice for " + describe(c, id));
  slot fresh;
  auto pooled = ch.pool.find({args.B, args.T});
  if (pooled != ch.pool.end()) {
    fresh.acts = std::move(pooled->second);
    ch.pool.erase(pooled);
  } else {
    std::shared_ptr<block_scratch> scratch;
    if (recompute_) {
      auto& shared = scratch_[{args.B, args.T}];
      if (!shared)
        shared = std::make_shared<block_scratch>(ch.model->config(), args.B, args.T, tp_);
      scratch = shared;
    }
    fresh.acts = std::make_unique<gpt_activations>(*ch.model, args.B, args.T, std::move(scratch));
  }
  fresh.hold = std::move(args.hold);
  slot& s = ch.live.emplace(id, std::move(fresh)).first->second;  // map nodes do not move
  return forward_pass(*ch.model, s, args);
}

block_pass cpu_chunks::forward_pass(const gpt_chunk& st, slot& s, forward_args args) {
  auto inner = chunk_forward_pass(st, *s.acts, args.tokens, args.input);
  while (const auto* stop = inner.next()) co_yield *stop;
  if (st.range().head) {
    s.loss = args.train
                 ? chunk_loss_backward_start(st, *s.acts, args.targets, args.loss_scale).mean()
                 : chunk_loss(st, *s.acts, args.targets).mean();
  }
}

double cpu_chunks::loss(int c, micro_batch_id id) const { return live_slot(c, id).loss; }

const float* cpu_chunks::output(int c, micro_batch_id id) const {
  return chunk_output(*live_slot(c, id).acts);
}

std::pair<int, int> cpu_chunks::shape(int c, micro_batch_id id) const {
  const auto& acts = *live_slot(c, id).acts;
  return {acts.batch(), acts.seq_len()};
}

block_pass cpu_chunks::backward(int c, micro_batch_id id, const float* doutput, float* dinput,
                                grad_block_fn on_block_done) {
  return chunk_backward_pass(chunk(c), *live_slot(c, id).acts, doutput, dinput,
                             std::move(on_block_done));
}

block_pass cpu_chunks::backward_input(int c, micro_batch_id id, const float* doutput,
                                      float* dinput) {
  return chunk_backward_input_pass(chunk(c), *live_slot(c, id).acts, doutput, dinput);
}

block_pass cpu_chunks::backward_weight(int c, micro_batch_id id, grad_block_fn on_block_done) {
  return chunk_backward_weight_pass(chunk(c), *live_slot(c, id).acts, std::move(on_block_done));
}

void cpu_chunks::release(int c, micro_batch_id id) {
  auto& ch = chunks_.at(static_cast<std::size_t>(c));
  auto it = ch.live.find(id);
  if (it == ch.live.end()) throw std::logic_error("release without forward: " + describe(c, id));
  auto acts = std::move(it->second.acts);
  ch.live.erase(it);
  const std::pair<int, int> key{acts->batch(), acts->seq_len()};
  ch.pool.emplace(key, std::move(acts));
}

}  // namespace troupe::engine
