// The per-rank memory plan of a recipe, computed before anything is allocated
// (`troupe train --dry-run`): model state from the ZeRO formulas over the rank's own parameter
// count (engine/parallel/zero.hpp), and the activations of the micro-batches the schedule keeps in
// flight on the rank (its plan walked: +1 at a forward, -1 when the micro-batch's last backward
// frees it), with or without activation checkpointing (engine::activation_bytes).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "engine/parallel/zero.hpp"
#include "engine/training/recipe.hpp"

namespace troupe::engine {

struct rank_memory_plan {
  int rank = 0;
  std::int64_t parameters = 0;  // psi: fp32 parameters of the rank's chunks (with alignment)
  model_state_bytes model_state;
  std::int64_t activation_bytes_per_micro_batch = 0;
  int micro_batches_in_flight = 0;     // at most, in the schedule's plan for this rank
  std::int64_t recompute_scratch = 0;  // activation checkpointing: one block_scratch per rank
  // The same rank without checkpointing (equal to activation_bytes() when it is off).
  std::int64_t activation_bytes_without_recompute = 0;
  // What cpu_chunks::activation_bytes() measures once the schedule has run a step.
  std::int64_t activation_bytes() const {
    return activation_bytes_per_micro_batch * micro_batches_in_flight + recompute_scratch;
  }
};

// Throws recipe_error as validate_recipe does.
std::vector<rank_memory_plan> plan_memory(const recipe& r);

// A table, one line per rank, and the formula in words.
std::string format_memory_plan(const recipe& r, const std::vector<rank_memory_plan>& plan);

// device = "cuda": the device memory of the whole model on one GPU (plan_gpu_memory in
// engine/training/gpu_trainer.hpp), or with parallel.pp > 1 of every device stage's chunks
// (plan_gpu_chunk_memory), with and without activation checkpointing. Throws recipe_error.
std::string format_gpu_memory_plan(const recipe& r);
// The slots a device stage's chunks start with on pipeline rank `rank`: the most micro-batches
// one of its chunks holds at once in the schedule's plan (forward done, backward not). A chunk
// adds a slot at run time when an activation arrives ahead of its forward under a link credit.
int device_stage_slots(const recipe& r, int rank);

}  // namespace troupe::engine
