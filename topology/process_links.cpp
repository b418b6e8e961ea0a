#include "topology/process_links.hpp"

#include <set>
#include <utility>

namespace troupe::topology {

std::string process_link::name() const {
  return (tied ? "tied-" : "pp-") + std::to_string(lane) + "-" + std::to_string(from) + "-" +
         std::to_string(to);
}

std::vector<process_link> process_links(const engine::pipeline_layout& layout,
                                        const job_placement& placement, int dp, int tp) {
  std::vector<process_link> out;
  for (int lane = 0; lane < dp * tp; ++lane) {
    auto process = [&](int rank) { return placement.process_of_stage(lane / tp, rank, lane % tp); };
    std::set<std::pair<int, int>> seen;
    for (int s = 0; s + 1 < layout.virtual_stage_count(); ++s) {
      const int a = layout.rank_of(s), b = layout.rank_of(s + 1);
      if (process(a) == process(b)) continue;
      for (auto [from, to] : {std::pair{a, b}, std::pair{b, a}})
        if (seen.insert({from, to}).second) out.push_back({lane, from, to});
    }
  }
  return out;
}

std::vector<process_link> process_tied_links(const engine::pipeline_layout& layout,
                                             const job_placement& placement, int dp, int tp) {
  std::vector<process_link> out;
  const int embedding = layout.embedding_rank(), head = layout.head_rank();
  if (embedding == head) return out;
  for (int lane = 0; lane < dp * tp; ++lane) {
    auto process = [&](int rank) { return placement.process_of_stage(lane / tp, rank, lane % tp); };
    if (process(embedding) == process(head)) continue;
    out.push_back({lane, embedding, head, true});
    out.push_back({lane, head, embedding, true});
  }
  return out;
}

namespace {
// Whether n members, member i in process process_of(i), each live in a process of their own.
template <class ProcessOf>
bool apart(int n, ProcessOf process_of) {
  std::set<int> processes;
  for (int i = 0; i < n; ++i) processes.insert(process_of(i));
  return static_cast<int>(processes.size()) == n;
}
}  // namespace

std::string process_group::name() const {
  return "dp-" + std::to_string(rank) + "-" + std::to_string(shard);
}

std::vector<process_group> process_groups(const job_placement& placement, int pp, int dp, int tp) {
  std::vector<process_group> out;
  if (dp < 2) return out;
  for (int rank = 0; rank < pp; ++rank) {
    for (int shard = 0; shard < tp; ++shard)
      if (apart(dp, [&](int d) { return placement.process_of_stage(d, rank, shard); }))
        out.push_back({rank, shard});
  }
  return out;
}

std::string process_tensor_group::name() const {
  return "tp-" + std::to_string(replica) + "-" + std::to_string(rank);
}

std::vector<process_tensor_group> process_tensor_groups(const job_placement& placement, int pp,
                                                        int dp, int tp) {
  std::vector<process_tensor_group> out;
  if (tp < 2) return out;
  for (int d = 0; d < dp; ++d) {
    for (int rank = 0; rank < pp; ++rank)
      if (apart(tp, [&](int j) { return placement.process_of_stage(d, rank, j); }))
        out.push_back({d, rank});
  }
  return out;
}

}  // namespace troupe::topology
