// What a stage's chunks hold, as snapshots. See stage_state.hpp.
#include "topology/stage_state.hpp"

#include <stdexcept>

namespace troupe::topology {

using messages::stage_snapshot;
using messages::tensor_role;

std::string checkpoint_name(const engine::rank_chunks& chunks, int c,
                            const engine::parameter_info& p) {
  const auto& r = chunks.range(c);
  return r.head && !r.embedding && p.name == "transformer.wte.weight" ? engine::checkpoint_head_copy
                                                                      : p.name;
}

stage_snapshot snapshot_of(const engine::rank_chunks& chunks,
                           const std::vector<engine::rank_chunks::host_state>& states, bool state,
                           bool moments, int rank, int replica) {
  stage_snapshot s;
  s.rank = rank;
  s.replica = replica;
  for (int c = 0; c < chunks.chunk_count(); ++c) {
    const auto& h = states.at(static_cast<std::size_t>(c));
    auto values = [](const float* base, const engine::parameter_info& q) {
      return std::vector<float>(base + q.offset, base + q.offset + q.numel);
    };
    for (const auto& p : chunks.layout(c)) {
      const auto name = state ? checkpoint_name(chunks, c, p) : p.name;
      s.parameters.emplace_back(name, values(h.params, p));
      if (!moments) continue;
      s.pieces.push_back({tensor_role::exp_avg, name, 0, values(h.m, p)});
      s.pieces.push_back({tensor_role::exp_avg_sq, name, 0, values(h.v, p)});
    }
  }
  return s;
}

namespace {
// The parameter of chunk c whose elements hold flat offset `offset`.
const engine::parameter_info& parameter_at(const engine::rank_chunks& chunks, int c,
                                           std::int64_t offset) {
  for (const auto& p : chunks.layout(c))
    if (p.offset <= offset && offset < p.offset + p.numel) return p;
  throw std::logic_error("no parameter at offset " + std::to_string(offset) + " of chunk " +
                         std::to_string(c));
}
}  // namespace

stage_snapshot with_owned_pieces(stage_snapshot s, const engine::rank_chunks& chunks,
                                 const std::vector<engine::bucket_shard>& shards,
                                 const messages::zero_state& z, bool sharded_params) {
  for (const auto& b : shards) {
    for (const auto& seg : b.segments) {
      const auto& p = parameter_at(chunks, seg.chunk, seg.offset);
      const std::int64_t offset = seg.offset - p.offset;
      const auto name = checkpoint_name(chunks, seg.chunk, p);
      auto piece = [&](tensor_role role, const std::vector<float>& from) {
        s.pieces.push_back(
            {role, name, offset, {from.data() + seg.at, from.data() + seg.at + seg.numel}});
      };
      piece(tensor_role::exp_avg, z.m);
      piece(tensor_role::exp_avg_sq, z.v);
      if (sharded_params) piece(tensor_role::parameter, z.params);
    }
  }
  return s;
}

}  // namespace troupe::topology
