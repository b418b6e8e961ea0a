// What a stage's chunks hold, as the snapshots that checkpoints and the final weights take
// (messages::stage_snapshot): every parameter under its checkpoint name, the AdamW moments as
// pieces, and under ZeRO the floats a replica owns as pieces at their offsets. CAF-free: the
// stage actor (actors/stage.cpp) and its checkpoint capture (topology/stage_capture.hpp) call it.
#pragma once

#include <string>
#include <vector>

#include "engine/chunks/rank_chunks.hpp"
#include "engine/parallel/zero.hpp"
#include "messages/pipeline.hpp"

namespace troupe::topology {

// A parameter's name in a checkpoint: a head chunk's own copy of the tied wte is
// "lm_head.weight" (the two copies are summed in different orders over the replicas, so they may
// differ in their last bits, and exact resume needs both); every other parameter its own name.
std::string checkpoint_name(const engine::rank_chunks& chunks, int c,
                            const engine::parameter_info& p);

// The snapshot of chunk states taken already (by chunk; rank_chunks::state_on_host or
// capture_state): with `state`, the parameters under their checkpoint names (else their own);
// with `moments`, the AdamW moments as whole-tensor pieces. Reads only what `chunks` keeps
// constant (layouts and ranges), so it may run on another thread while the chunks work.
messages::stage_snapshot snapshot_of(const engine::rank_chunks& chunks,
                                     const std::vector<engine::rank_chunks::host_state>& states,
                                     bool state, bool moments, int rank, int replica);

// `s` with the floats a ZeRO replica owns (`shards`, by bucket; z stored in their owned order)
// added as pieces: both moments, and with sharded_params (ZeRO-3) the parameters. Throws
// std::logic_error where a segment lies outside every parameter of its chunk.
messages::stage_snapshot with_owned_pieces(messages::stage_snapshot s,
                                           const engine::rank_chunks& chunks,
                                           const std::vector<engine::bucket_shard>& shards,
                                           const messages::zero_state& z, bool sharded_params);

}  // namespace troupe::topology
