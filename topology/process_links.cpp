#include "topology/process_links.hpp"

#include <set>
#include <utility>

namespace troupe::topology {

std::string process_link::name() const {
  return std::string(tied ? "tied-" : "pp-") + std::to_string(lane) + "-" + std::to_string(from) +
         "-" + std::to_string(to);
}

std::vector<process_link> process_links(const engine::pipeline_layout& layout,
                                        const job_placement& placement, int dp, int tp) {
  std::vector<process_link> out;
  const int embedding = layout.rank_of(0), head = layout.rank_of(layout.virtual_stage_count() - 1);
  for (int lane = 0; lane < dp * tp; ++lane) {
    auto process = [&](int rank) { return placement.process_of_stage(lane / tp, rank, lane % tp); };
    std::set<std::pair<int, int>> seen;
    for (int s = 0; s + 1 < layout.virtual_stage_count(); ++s) {
      const int a = layout.rank_of(s), b = layout.rank_of(s + 1);
      if (process(a) == process(b)) continue;
      for (auto [from, to] : {std::pair{a, b}, std::pair{b, a}})
        if (seen.insert({from, to}).second) out.push_back({lane, from, to, false});
    }
    if (embedding != head && process(embedding) != process(head)) {
      out.push_back({lane, embedding, head, true});
      out.push_back({lane, head, embedding, true});
    }
  }
  return out;
}

}  // namespace troupe::topology
