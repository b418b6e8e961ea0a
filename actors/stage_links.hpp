// What the CPU and the device pipeline stage actors share about following a plan: the keys of
// link and batch messages, which link message an action consumes, and the credit that lets
// its sender send it. Plain functions of the layout and the plan; no actor state.
#pragma once

#include <optional>
#include <vector>

#include "engine/parallel/pipeline_layout.hpp"
#include "engine/parallel/schedule.hpp"
#include "messages/pipeline.hpp"
#include "topology/link_credits.hpp"

namespace troupe::actors {

inline topology::link_key key_of(const messages::link_header& h) {
  return {static_cast<int>(h.kind), h.eval, h.step, h.virtual_stage, h.round, h.micro_batch};
}

struct batch_key {
  int part = 0;
  bool eval = false;
  int step = 0, round = 0, micro_batch = 0;
  friend auto operator<=>(const batch_key&, const batch_key&) = default;
};

inline batch_key key_of(const messages::batch_message& b) {
  return {static_cast<int>(b.part), b.eval, b.step, b.round, b.micro_batch};
}

// The keys of the current plan's link and batch messages.
inline topology::link_key plan_link_key(const messages::step_plan& plan, messages::link_kind kind,
                                        int virtual_stage, int round, int mb) {
  return {static_cast<int>(kind), plan.eval, plan.step, virtual_stage, round, mb};
}
inline batch_key plan_batch_key(const messages::step_plan& plan, messages::batch_part part,
                                int round, int mb) {
  return {static_cast<int>(part), plan.eval, plan.step, round, mb};
}

// Whether action `a` of round `round` has its inputs: tokens or the activation, and the targets
// (the last virtual stage) for a forward; the gradient for a backward of any stage but the last.
// Stashes: maps keyed by link_key and batch_key of what arrived and was not consumed yet.
template <class LinkStash, class BatchStash>
bool action_ready(const messages::step_plan& plan, int last_virtual_stage,
                  const engine::pipeline_action& a, int round, const LinkStash& links,
                  const BatchStash& batches) {
  using messages::batch_part;
  using messages::link_kind;
  if (a.kind == engine::action_kind::forward) {
    const bool input =
        a.virtual_stage == 0
            ? batches.count(plan_batch_key(plan, batch_part::inputs, round, a.micro_batch)) > 0
            : links.count(plan_link_key(plan, link_kind::activation, a.virtual_stage, round,
                                        a.micro_batch)) > 0;
    const bool targets =
        a.virtual_stage != last_virtual_stage ||
        batches.count(plan_batch_key(plan, batch_part::targets, round, a.micro_batch)) > 0;
    return input && targets;
  }
  if (a.kind == engine::action_kind::backward && a.virtual_stage != last_virtual_stage)
    return links.count(
               plan_link_key(plan, link_kind::gradient, a.virtual_stage, round, a.micro_batch)) > 0;
  return true;
}

// The remote link message that action `a` of round `round` consumes on pipeline rank `rank`,
// if any (a neighbouring virtual stage on another rank sends it).
inline std::optional<topology::link_key> incoming_key(const engine::pipeline_layout& layout,
                                                      int rank, const messages::step_plan& plan,
                                                      const engine::pipeline_action& a, int round) {
  using messages::link_kind;
  const int last = layout.virtual_stage_count() - 1;
  if (a.kind == engine::action_kind::forward && a.virtual_stage > 0 &&
      layout.rank_of(a.virtual_stage - 1) != rank)
    return topology::link_key{static_cast<int>(link_kind::activation),
                              plan.eval,
                              plan.step,
                              a.virtual_stage,
                              round,
                              a.micro_batch};
  if (a.kind == engine::action_kind::backward && a.virtual_stage < last &&
      layout.rank_of(a.virtual_stage + 1) != rank)
    return topology::link_key{static_cast<int>(link_kind::gradient),
                              plan.eval,
                              plan.step,
                              a.virtual_stage,
                              round,
                              a.micro_batch};
  return std::nullopt;
}

// The rank that sends the link message `k` names.
inline int sender_of(const engine::pipeline_layout& layout, const topology::link_key& k) {
  return k.kind == static_cast<int>(messages::link_kind::activation)
             ? layout.rank_of(k.virtual_stage - 1)
             : layout.rank_of(k.virtual_stage + 1);
}

// The credit for link message `k`, from the receiving stage of `replica`.
inline messages::link_credit credit_for(const topology::link_key& k, int replica) {
  messages::link_credit c;
  c.header.kind = static_cast<messages::link_kind>(k.kind);
  c.header.eval = k.eval;
  c.header.step = k.step;
  c.header.virtual_stage = k.virtual_stage;
  c.header.round = k.round;
  c.header.micro_batch = k.micro_batch;
  c.header.replica = replica;
  return c;
}

// By chunk of the rank: the index in `actions` of the last action that accumulates its weight
// gradients (backward, or weight when the plan splits backward); -1 for none. In a step's last
// round that action leaves the chunk's gradients final, block by block.
inline std::vector<int> last_weight_actions(const engine::pipeline_layout& layout,
                                            const std::vector<engine::pipeline_action>& actions,
                                            bool split_backward, int chunks) {
  std::vector<int> last(static_cast<std::size_t>(chunks), -1);
  const auto kind = split_backward ? engine::action_kind::weight : engine::action_kind::backward;
  for (int i = 0; i < static_cast<int>(actions.size()); ++i) {
    const auto& a = actions[static_cast<std::size_t>(i)];
    if (a.kind == kind) last.at(static_cast<std::size_t>(layout.chunk_of(a.virtual_stage))) = i;
  }
  return last;
}

}  // namespace troupe::actors
