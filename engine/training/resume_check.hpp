// Resuming a run without forking it by accident (docs/checkpoints.md, "Resume" and "What a
// resume may change"): the recipe compared key by key with the one the checkpoint was saved
// with, and the newer checkpoints a resume from an older one would collide with, set aside on
// request. CAF-free; actors/pipeline_run.cpp calls it before anything is written or spawned.
// Invariants: nothing here deletes a file; a refusal is one recipe_error line naming the key
// (with both values) or the checkpoints at fault.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "engine/training/checkpoint.hpp"
#include "engine/training/recipe.hpp"

namespace troupe::engine {

// The derived trajectory quantity `--allow-change` names like a key: tokens per optimizer step.
inline constexpr const char* global_batch_key = "global_batch";
// dp × micro_batches × grad_accum × micro_batch × seq_len.
std::int64_t global_batch_tokens(const recipe& r);

// What a resume changes of the checkpoint's recipe, once accepted.
struct resume_review {
  std::vector<recipe_change> allowed;  // trajectory changes named by --allow-change
  std::vector<std::string> mesh;       // "parallel.dp 1 -> 2", one per mesh key changed
  std::vector<std::string> free;       // the same for free keys
};

// Compares every key of `now` with `saved` (the checkpoint's recipe) for a resume after step
// `step`. Throws recipe_error (one line) when a model key changed (the first, with the
// checkpoint's value and the recipe's), when trajectory keys or the global batch changed without
// being named in `allowed` (each with both values), and for a name in `allowed` that is no
// trajectory key or global_batch.
resume_review review_resume(const recipe& saved, const recipe& now, int step,
                            const std::vector<std::string>& allowed);

// The recipe a checkpoint was saved with (its TOML and overrides through parse_recipe, whose
// input files need not exist); nullopt when the state has none. Throws recipe_error naming dir
// when it no longer parses.
std::optional<recipe> saved_recipe(const checkpoint_state& state, const std::filesystem::path& dir);

// The committed checkpoints under root after `step` that verify (a torn or corrupt one is
// replaced when its step is written again), newest first.
std::vector<checkpoint_entry> newer_checkpoints(const std::filesystem::path& root, int step);

// Moves `newer` into root/set-aside-<step>-<UTC time>/ (a new directory; nothing is deleted)
// and returns it. Throws std::runtime_error naming the directory that could not be moved.
std::filesystem::path set_aside_checkpoints(const std::filesystem::path& root,
                                            const std::vector<checkpoint_entry>& newer, int step);

}  // namespace troupe::engine
