// How a model is cut into pipeline pieces: p ranks x v chunks = p*v virtual stages, each a
// contiguous layer range; virtual stage k runs on rank k % p as its chunk k / p (the layout
// of Megatron-LM's interleaved schedule; with v = 1 it is the plain pipeline).
// Invariants: the ranges cover every layer once, in order; virtual stage 0 holds the
// embedding and the last virtual stage the head; every stage has at least one layer.
#pragma once

#include <vector>

#include "engine/model/gpt_model.hpp"

namespace troupe::engine {

struct pipeline_layout {
  int ranks = 1;
  int virtual_stages = 1;
  std::vector<chunk_range> stages;  // by virtual stage

  int virtual_stage_count() const { return static_cast<int>(stages.size()); }
  int rank_of(int virtual_stage) const { return virtual_stage % ranks; }
  int chunk_of(int virtual_stage) const { return virtual_stage / ranks; }
  int virtual_stage_of(int rank, int chunk) const { return chunk * ranks + rank; }
  // The ranges of the chunks of one rank, by chunk.
  std::vector<chunk_range> rank_chunks(int rank) const;
  int embedding_rank() const { return 0; }
  int head_rank() const { return rank_of(virtual_stage_count() - 1); }
};

// split: layers per virtual stage (empty: as even as possible, earlier stages take the
// remainder). Throws std::invalid_argument naming what is wrong.
pipeline_layout make_pipeline_layout(const gpt_config& model, int ranks, int virtual_stages,
                                     const std::vector<int>& split = {});

}  // namespace troupe::engine
