// Per-rank memory plan. See memory_plan.hpp.
#include "engine/parallel/memory_plan.hpp"

#include <algorithm>
#include <cstdio>
#include <map>

#include "engine/model/gpt_model.hpp"
#include "engine/parallel/pipeline_layout.hpp"
#include "engine/parallel/schedule.hpp"
#include "engine/training/gpu_trainer.hpp"

namespace troupe::engine {
namespace {

std::string mib(double bytes) {
  char b[32];
  std::snprintf(b, sizeof b, "%.1f MiB", bytes / (1 << 20));
  return b;
}

}  // namespace

std::vector<rank_memory_plan> plan_memory(const recipe& r) {
  validate_recipe(r);
  const auto layout = make_pipeline_layout(r.model, r.parallel.pp, r.parallel.virtual_stages,
                                           r.parallel.layer_split);
  const auto plan = make_plan(r.parallel.schedule,
                              {r.parallel.pp, r.parallel.micro_batches, r.parallel.virtual_stages});
  std::vector<rank_memory_plan> out;
  for (int rank = 0; rank < r.parallel.pp; ++rank) {
    rank_memory_plan p;
    p.rank = rank;
    const bool recompute = r.activation_checkpoint.full();
    const int B = r.batch.micro_batch, T = r.batch.seq_len, tp = r.parallel.tp;
    std::int64_t act = 0, act_plain = 0;
    for (const auto& range : layout.rank_chunks(rank)) {  // one tensor shard's (all the same)
      const auto params = chunk_parameter_layout(r.model, range, {0, tp});
      if (!params.empty()) p.parameters += params.back().offset + params.back().numel;
      act += activation_bytes(r.model, range, B, T, recompute, plan.split_backward, tp);
      act_plain += activation_bytes(r.model, range, B, T, false, plan.split_backward, tp);
    }
    // Chunks of a rank hold their micro-batches separately: the walk below counts live
    // (chunk, micro-batch) pairs, each charged the rank's mean chunk size.
    const auto chunks = static_cast<std::int64_t>(layout.rank_chunks(rank).size());
    p.activation_bytes_per_micro_batch = act / chunks;
    if (recompute) p.recompute_scratch = block_scratch_bytes(r.model, B, T, tp);
    const auto release = plan.split_backward ? action_kind::weight : action_kind::backward;
    int live = 0;
    for (const auto& a : plan.ranks.at(static_cast<std::size_t>(rank))) {
      if (a.kind == action_kind::forward) ++live;
      if (a.kind == release) --live;
      p.micro_batches_in_flight = std::max(p.micro_batches_in_flight, live);
    }
    p.activation_bytes_without_recompute = act_plain / chunks * p.micro_batches_in_flight;
    p.model_state = zero_formula(static_cast<zero_stage>(r.parallel.zero),
                                 static_cast<double>(p.parameters), r.parallel.dp);
    out.push_back(p);
  }
  return out;
}

std::string format_memory_plan(const recipe& r, const std::vector<rank_memory_plan>& plan) {
  static const char* formulas[] = {"16 psi (DDP)", "8 psi + 8 psi/N (ZeRO-1)",
                                   "4 psi + 12 psi/N (ZeRO-2)", "16 psi/N (ZeRO-3)"};
  std::string s =
      std::string("memory plan per rank (every replica ") +
      (r.parallel.tp > 1 ? "and each of its " + std::to_string(r.parallel.tp) + " tensor shards "
                         : "") +
      "the same), fp32 AdamW, N = parallel.dp = " + std::to_string(r.parallel.dp) +
      ", model state " + formulas[std::clamp(r.parallel.zero, 0, 3)] + ":\n";
  char line[256];
  std::snprintf(line, sizeof line, "%-5s %12s %12s %12s %12s %12s %14s %12s\n", "rank", "psi",
                "parameters", "gradients", "optimizer", "model state", "activations", "total");
  s += line;
  for (const auto& p : plan) {
    const double act = static_cast<double>(p.activation_bytes());
    std::snprintf(line, sizeof line, "%-5d %12lld %12s %12s %12s %12s %8s x%-3d %12s\n", p.rank,
                  static_cast<long long>(p.parameters), mib(p.model_state.parameters).c_str(),
                  mib(p.model_state.gradients).c_str(), mib(p.model_state.optimizer).c_str(),
                  mib(p.model_state.total()).c_str(),
                  mib(static_cast<double>(p.activation_bytes_per_micro_batch)).c_str(),
                  p.micro_batches_in_flight, mib(p.model_state.total() + act).c_str());
    s += line;
    if (p.recompute_scratch > 0) {
      s.pop_back();
      s += " (activations: + " + mib(static_cast<double>(p.recompute_scratch)) +
           " recompute scratch)\n";
    }
  }
  s += "activations: one micro-batch's activations x the most micro-batches the '" +
       r.parallel.schedule +
       "' plan keeps in flight on the rank; temporary buffers (gradient buckets in flight, "
       "collective chunks) come on top and are reported per step in metrics.jsonl.\n";
  if (r.activation_checkpoint.full()) {
    s += "activation checkpointing (full): each micro-batch keeps its blocks' outputs only; one "
         "block's activations are recomputed at a time, in a scratch per rank";
    for (const auto& p : plan) {
      std::snprintf(
          line, sizeof line, "; rank %d: %s (scratch %s included) instead of %s, saves %s", p.rank,
          mib(static_cast<double>(p.activation_bytes())).c_str(),
          mib(static_cast<double>(p.recompute_scratch)).c_str(),
          mib(static_cast<double>(p.activation_bytes_without_recompute)).c_str(),
          mib(static_cast<double>(p.activation_bytes_without_recompute - p.activation_bytes()))
              .c_str());
      s += line;
    }
    s += ".\n";
  }
  return s;
}

int device_stage_slots(const recipe& r, int rank) {
  const auto layout = make_pipeline_layout(r.model, r.parallel.pp, r.parallel.virtual_stages,
                                           r.parallel.layer_split);
  const auto plan = make_plan(r.parallel.schedule,
                              {r.parallel.pp, r.parallel.micro_batches, r.parallel.virtual_stages});
  const auto release = plan.split_backward ? action_kind::weight : action_kind::backward;
  std::map<int, int> live;  // by chunk
  int peak = 1;
  for (const auto& a : plan.ranks.at(static_cast<std::size_t>(rank))) {
    int& n = live[layout.chunk_of(a.virtual_stage)];
    if (a.kind == action_kind::forward) ++n;
    if (a.kind == release) --n;
    peak = std::max(peak, n);
  }
  return peak;
}

namespace {

// pp > 1 or tp > 1: every rank's chunks as device stage actors hold them (device_stage_slots
// each); with tensor parallelism, one shard's.
std::string format_gpu_pipeline_plan(const recipe& r, const gpu_trainer_options& o) {
  const int tp = r.parallel.tp;
  const auto layout = make_pipeline_layout(r.model, r.parallel.pp, r.parallel.virtual_stages,
                                           r.parallel.layer_split);
  std::string s =
      "device memory plan, a pipeline of " + std::to_string(r.parallel.pp) + " device stages" +
      (tp > 1 ? " of " + std::to_string(tp) + " tensor shards (one shard's figures)"
              : std::string()) +
      " (" + r.precision.dtype + " compute, " + attention_kernel_for(r) +
      " attention, fp32 master weights, gradients" +
      (o.optimizer_state   ? " and AdamW moments"
       : zero_on_device(r) ? std::string("; the AdamW moments of the floats each replica owns") +
                                 (r.parallel.zero >= 3
                                      ? " and their master weights (ZeRO-3 through the devices' "
                                        "groups: the weights' buffers hold the buckets gathered at "
                                        "once between uses, all of them at most)"
                                      : " (ZeRO through the devices' groups)")
                           : "; AdamW moments in ZeRO's shards, in host memory") +
      "), micro-batch " + std::to_string(r.batch.micro_batch) + " x " +
      std::to_string(r.batch.seq_len) +
      " tokens; slots: the micro-batches a chunk holds at the schedule's peak (a chunk "
      "adds one when an activation arrives ahead under its link credit):\n";
  char line[256];
  std::snprintf(line, sizeof line, "%6s %6s %12s %12s %14s %12s\n", "rank", "slots", "parameters",
                "model state", "activations", "total");
  s += line;
  std::int64_t with = 0, without = 0;
  // A rank with one copy of the tied wte keeps a buffer to receive the other copy's gradient.
  const int embedding = layout.rank_of(0), head = layout.rank_of(layout.virtual_stage_count() - 1);
  const std::int64_t tied_receive =
      embedding == head ? 0
                        : std::int64_t{r.model.padded_vocab_size / tp} * r.model.width *
                              static_cast<std::int64_t>(sizeof(float));
  for (int rank = 0; rank < r.parallel.pp; ++rank) {
    const int slots = device_stage_slots(r, rank);
    gpu_memory_plan sum;
    if (rank == embedding || rank == head) sum.model_state += tied_receive;
    std::int64_t params = 0;
    for (const auto& range : layout.rank_chunks(rank)) {
      const auto p =
          plan_gpu_chunk_memory(r.model, range, r.batch.micro_batch, r.batch.seq_len, o, slots, tp);
      sum.model_state += p.model_state;
      sum.activations += p.activations;
      sum.activations_without_recompute += p.activations_without_recompute;
      const auto params_of = chunk_parameter_layout(r.model, range, {0, tp});
      if (!params_of.empty()) params += params_of.back().offset + params_of.back().numel;
    }
    // ZeRO through the devices' groups: moments (ZeRO-3: and master weights) of about 1/dp of
    // the rank's floats (each bucket's ring chunk; at most one float more per bucket).
    if (zero_on_device(r))
      sum.model_state += (params + r.parallel.dp - 1) / r.parallel.dp *
                         (r.parallel.zero >= 3 ? 3 : 2) * static_cast<std::int64_t>(sizeof(float));
    with += sum.activations;
    without += sum.activations_without_recompute;
    std::snprintf(line, sizeof line, "%6d %6d %12lld %12s %14s %12s\n", rank, slots,
                  static_cast<long long>(params), mib(static_cast<double>(sum.model_state)).c_str(),
                  mib(static_cast<double>(sum.activations)).c_str(),
                  mib(static_cast<double>(sum.total())).c_str());
    s += line;
  }
  if (tied_receive > 0) {
    std::snprintf(line, sizeof line,
                  "model state of ranks %d and %d includes %s to receive the other copy of the "
                  "tied wte's gradient.\n",
                  embedding, head, mib(static_cast<double>(tied_receive)).c_str());
    s += line;
  }
  if (o.recompute) {
    std::snprintf(line, sizeof line,
                  "activation checkpointing (full): every rank's activations together %s instead "
                  "of %s, saves %s.\n",
                  mib(static_cast<double>(with)).c_str(), mib(static_cast<double>(without)).c_str(),
                  mib(static_cast<double>(without - with)).c_str());
    s += line;
  }
  return s;
}

}  // namespace

std::string format_gpu_memory_plan(const recipe& r) {
  validate_recipe(r);
  gpu_trainer_options o = gpu_options(r);
  // Device stages: the schedule may split backward; ZeRO's shards hold the moments (through the
  // devices' groups, the chunks hold the owned ones: the formula's optimizer term).
  if (r.parallel.pp > 1 || r.parallel.tp > 1 || r.parallel.zero > 0) {
    o.split_backward = splits_backward(r);
    o.optimizer_state = r.parallel.zero == 0;
    return format_gpu_pipeline_plan(r, o);
  }
  const gpu_memory_plan p = plan_gpu_memory(r.model, r.batch.micro_batch, r.batch.seq_len, o);
  const std::int64_t P = r.model.parameter_count();
  std::string s =
      "device memory plan, the whole model on one GPU (" + r.precision.dtype + " compute, " +
      attention_kernel_for(r) + " attention, fp32 master weights, gradients and AdamW " +
      "moments" +
      (o.dtype == compute_dtype::fp32 ? "" : ", a " + r.precision.dtype + " copy of the weights") +
      "), micro-batch " + std::to_string(r.batch.micro_batch) + " x " +
      std::to_string(r.batch.seq_len) + " tokens:\n";
  char line[256];
  std::snprintf(line, sizeof line, "%12s %12s %14s %12s\n", "parameters", "model state",
                "activations", "total");
  s += line;
  std::snprintf(line, sizeof line, "%12lld %12s %14s %12s\n", static_cast<long long>(P),
                mib(static_cast<double>(p.model_state)).c_str(),
                mib(static_cast<double>(p.activations)).c_str(),
                mib(static_cast<double>(p.total())).c_str());
  s += line;
  s += "activations: what the forward keeps for the backward and the backward's scratch, for one "
       "micro-batch (micro-batches run one after another); cuBLASLt's 32 MiB workspace comes on "
       "top.\n";
  if (o.recompute) {
    std::snprintf(
        line, sizeof line,
        "activation checkpointing (full): each block keeps its output only, one set of "
        "block buffers is shared and recomputed: %s instead of %s, saves %s.\n",
        mib(static_cast<double>(p.activations)).c_str(),
        mib(static_cast<double>(p.activations_without_recompute)).c_str(),
        mib(static_cast<double>(p.activations_without_recompute - p.activations)).c_str());
    s += line;
  }
  return s;
}

}  // namespace troupe::engine
