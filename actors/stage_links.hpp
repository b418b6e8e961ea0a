// What the CPU and the device pipeline stage actors share about following a plan: the keys of
// link and batch messages, which link message an action consumes, and the credit that lets
// its sender send it. Plain functions of the layout and the plan; no actor state.
#pragma once

#include <optional>

#include "engine/pipeline_layout.hpp"
#include "engine/schedule.hpp"
#include "messages/pipeline.hpp"
#include "topology/link_credits.hpp"

namespace troupe::actors {

inline topology::link_key key_of(const messages::link_header& h) {
  return {static_cast<int>(h.kind), h.eval, h.step, h.stage, h.round, h.micro_batch};
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

// The remote link message that action `a` of round `round` consumes on pipeline rank `rank`,
// if any (a neighbouring virtual stage on another rank sends it).
inline std::optional<topology::link_key> incoming_key(const engine::pipeline_layout& layout,
                                                      int rank, const messages::step_plan& plan,
                                                      const engine::pipeline_action& a, int round) {
  using messages::link_kind;
  const int last = layout.stage_count() - 1;
  if (a.kind == engine::action_kind::forward && a.stage > 0 && layout.rank_of(a.stage - 1) != rank)
    return topology::link_key{static_cast<int>(link_kind::activation),
                              plan.eval,
                              plan.step,
                              a.stage,
                              round,
                              a.micro_batch};
  if (a.kind == engine::action_kind::backward && a.stage < last &&
      layout.rank_of(a.stage + 1) != rank)
    return topology::link_key{
        static_cast<int>(link_kind::gradient), plan.eval, plan.step, a.stage, round, a.micro_batch};
  return std::nullopt;
}

// The rank that sends the link message `k` names.
inline int sender_of(const engine::pipeline_layout& layout, const topology::link_key& k) {
  return k.kind == static_cast<int>(messages::link_kind::activation) ? layout.rank_of(k.stage - 1)
                                                                     : layout.rank_of(k.stage + 1);
}

// The credit for link message `k`, from the receiving stage of `replica`.
inline messages::link_credit credit_for(const topology::link_key& k, int replica) {
  messages::link_credit c;
  c.header.kind = static_cast<messages::link_kind>(k.kind);
  c.header.eval = k.eval;
  c.header.step = k.step;
  c.header.stage = k.stage;
  c.header.round = k.round;
  c.header.micro_batch = k.micro_batch;
  c.header.replica = replica;
  return c;
}

}  // namespace troupe::actors
