// Layer ranges of virtual pipeline stages. See pipeline_layout.hpp.
#include "engine/parallel/pipeline_layout.hpp"

#include <stdexcept>
#include <string>

namespace troupe::engine {

std::vector<chunk_range> pipeline_layout::rank_chunks(int rank) const {
  std::vector<chunk_range> out;
  for (int c = 0; c < virtual_stages; ++c) out.push_back(stages[virtual_stage_of(rank, c)]);
  return out;
}

pipeline_layout make_pipeline_layout(const gpt_config& model, int ranks, int virtual_stages,
                                     const std::vector<int>& split) {
  if (ranks < 1 || virtual_stages < 1)
    throw std::invalid_argument("pipeline ranks and virtual stages must be >= 1");
  const int n = ranks * virtual_stages;
  pipeline_layout out;
  out.ranks = ranks;
  out.virtual_stages = virtual_stages;
  if (split.empty()) {
    out.stages = partition_layers(model, n);
    return out;
  }
  if (static_cast<int>(split.size()) != n)
    throw std::invalid_argument("layer split has " + std::to_string(split.size()) +
                                " entries for " + std::to_string(n) + " virtual stages");
  int first = 0;
  for (int k = 0; k < n; ++k) {
    if (split[static_cast<std::size_t>(k)] < 1)
      throw std::invalid_argument("layer split: every virtual stage needs at least one layer");
    const int last = first + split[static_cast<std::size_t>(k)];
    out.stages.push_back({first, last, k == 0, k == n - 1});
    first = last;
  }
  if (first != model.layers)
    throw std::invalid_argument("layer split sums to " + std::to_string(first) + ", model has " +
                                std::to_string(model.layers) + " layers");
  return out;
}

}  // namespace troupe::engine
