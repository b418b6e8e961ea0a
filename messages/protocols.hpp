// Who accepts which message: the typed interface of every actor role, declared once.
// Only actors/ and tools/ include this header (it pulls in CAF); engine/ and kernels/ never do.
//
//   coordinator --begin_step--> schedule --step_plan--> every stage
//   data loader --batch_message(inputs)--> stage of virtual stage 0
//               --batch_message(targets)--> stage of the last virtual stage
//   stage --link_message--> neighbour stage, only after a link_credit for that message
//   stage --grad_bucket--> dp reducer --grad_bucket_reduced--> stage
//   (across processes: stage --grad_bucket--> ring reducer <--ring_chunk--> ring reducers)
//   (ZeRO: stage --zero_layout, grad_bucket, zero_update, zero_gather--> zero shard
//    <--ring_chunk--> shards; shard --grad_bucket_reduced, zero_update_done, zero_gathered-->
//    stage; see messages/pipeline.hpp)
//   stage --grads_ready--> coordinator --apply_update--> stage --update_done--> coordinator
//   every actor --trace_batch--> tracer
#pragma once

#include <caf/all.hpp>

#include "messages/pipeline.hpp"
#include "messages/remote.hpp"

CAF_ALLOW_UNSAFE_MESSAGE_TYPE(troupe::messages::link_message)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(troupe::messages::link_credit)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(troupe::messages::batch_message)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(troupe::messages::batch_credit)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(troupe::messages::step_plan)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(troupe::messages::begin_step)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(troupe::messages::begin_eval)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(troupe::messages::grads_ready)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(troupe::messages::apply_update)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(troupe::messages::update_done)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(troupe::messages::eval_done)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(troupe::messages::grad_bucket)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(troupe::messages::grad_bucket_reduced)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(troupe::messages::zero_layout)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(troupe::messages::zero_update)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(troupe::messages::zero_update_done)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(troupe::messages::zero_gather)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(troupe::messages::zero_gathered)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(troupe::messages::tied_grad)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(troupe::messages::swap_schedule)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(troupe::messages::swap_result)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(troupe::messages::trace_batch)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(troupe::messages::trace_finish)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(troupe::messages::step_report)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(troupe::messages::run_finished)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(troupe::messages::snapshot_request)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(troupe::messages::stage_snapshot)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(troupe::messages::ring_chunk)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(troupe::messages::tensor_exchange)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(troupe::messages::heartbeat)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(troupe::messages::actor_down)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(troupe::messages::error_report)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(troupe::messages::job_shutdown)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(troupe::messages::checkpoint_chunk)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(troupe::messages::zero_state_request)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(troupe::messages::zero_state)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(troupe::messages::checkpoint_begin)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(troupe::messages::checkpoint_copied)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(troupe::messages::checkpoint_flush)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(troupe::messages::run_until)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(troupe::messages::training_paused)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(troupe::messages::checkpoint_now)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(troupe::messages::stop_run)

namespace troupe::messages {

// Peers of a stage, sent once before the first step. Entries are untyped so that a test can
// put a relay between two stages; `ranks` are this replica's stages by pipeline rank.
struct stage_wiring {
  std::vector<caf::actor> ranks;
  caf::actor loader, coordinator, reducer, tracer;
  caf::actor tied_partner;  // the stage holding the other copy of wte (may be this one)
};
struct loader_wiring {
  caf::actor first_stage, last_stage, tracer;
};
struct schedule_wiring {
  std::vector<std::vector<caf::actor>> stages;  // [replica][rank]
};
struct coordinator_wiring {
  caf::actor schedule, tracer, client;
  std::vector<caf::actor> loaders;              // by replica
  std::vector<std::vector<caf::actor>> stages;  // [replica][rank]
  std::vector<caf::actor> watched;              // every actor of the run, monitored
  std::vector<std::string> watched_names;
  caf::actor checkpointer;  // the checkpoint writer; unset without checkpoint.every
};
struct start_run {};
// A stage's note to itself: run the next action (after the mailbox had its turn).
struct stage_continue {};
// A stage's note to itself from the thread that copied a checkpoint's state aside: it is there.
struct snapshot_copied {};
// A stage's note to itself from its zero_group (ZeRO on the devices, topology/device_zero.hpp):
// bucket's parameters are all-gathered once the event `done` has passed (nullptr: now): after
// the update (collective `buckets`, ZeRO-1/2), or gather `seq` of a ZeRO-3 plan. The
// reduce-scatter's note is a grad_bucket_reduced.
struct bucket_gathered {
  int step = 0, bucket = 0;
  void* done = nullptr;
  zero_collective collective = zero_collective::buckets;
  int seq = 0;
};
// A stage's note to itself from the thread that wrote its part of a checkpoint (format 2): the
// file, or the error that stopped it.
struct part_written {
  int token = 0;
  engine::checkpoint_file file;
  std::string error;
};
struct trace_write {
  std::string path;
  trace_finish finish;
};
// A ring reducer's peers: its stage (grad_bucket in, grad_bucket_reduced out) and the reducer of
// the next replica of the same pipeline rank (ring_chunk), local or a gateway proxy.
struct ring_wiring {
  caf::actor stage, next, tracer;
};
// Gateway -> proxy: the remote actor stopped, or its process was lost; the proxy stops with this
// reason, so monitors of the proxy see the remote failure.
struct remote_down {
  std::string reason;
};
// Gateway -> proxy: the answer to a request the proxy forwarded.
struct remote_reply {
  std::uint64_t correlation = 0;
  stage_snapshot snapshot;
};

}  // namespace troupe::messages

CAF_ALLOW_UNSAFE_MESSAGE_TYPE(troupe::messages::stage_wiring)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(troupe::messages::loader_wiring)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(troupe::messages::schedule_wiring)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(troupe::messages::coordinator_wiring)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(troupe::messages::start_run)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(troupe::messages::stage_continue)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(troupe::messages::snapshot_copied)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(troupe::messages::bucket_gathered)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(troupe::messages::part_written)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(troupe::messages::trace_write)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(troupe::messages::ring_wiring)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(troupe::messages::remote_down)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(troupe::messages::remote_reply)

namespace troupe::messages {

using stage_actor = caf::typed_actor<
    caf::reacts_to<stage_wiring>, caf::reacts_to<step_plan>, caf::reacts_to<link_message>,
    caf::reacts_to<link_credit>, caf::reacts_to<batch_message>, caf::reacts_to<grad_bucket_reduced>,
    caf::reacts_to<tied_grad>, caf::reacts_to<apply_update>, caf::reacts_to<zero_update_done>,
    caf::reacts_to<zero_gathered>, caf::reacts_to<stage_continue>, caf::reacts_to<snapshot_copied>,
    caf::reacts_to<bucket_gathered>, caf::reacts_to<part_written>,
    caf::replies_to<snapshot_request>::with<stage_snapshot>>;

using loader_actor = caf::typed_actor<caf::reacts_to<loader_wiring>, caf::reacts_to<batch_credit>,
                                      caf::reacts_to<begin_eval>>;

using schedule_actor =
    caf::typed_actor<caf::reacts_to<schedule_wiring>, caf::reacts_to<begin_step>,
                     caf::reacts_to<begin_eval>, caf::replies_to<swap_schedule>::with<swap_result>>;

using reducer_actor = caf::typed_actor<caf::reacts_to<grad_bucket>>;

using tracer_actor =
    caf::typed_actor<caf::reacts_to<trace_batch>, caf::replies_to<trace_write>::with<std::string>>;

using ring_reducer_actor =
    caf::typed_actor<caf::reacts_to<ring_wiring>, caf::reacts_to<grad_bucket>,
                     caf::reacts_to<ring_chunk>>;

using zero_shard_actor = caf::typed_actor<caf::reacts_to<ring_wiring>, caf::reacts_to<zero_layout>,
                                          caf::reacts_to<grad_bucket>, caf::reacts_to<ring_chunk>,
                                          caf::reacts_to<zero_update>, caf::reacts_to<zero_gather>,
                                          caf::replies_to<zero_state_request>::with<zero_state>>;

using checkpoint_writer_actor =
    caf::typed_actor<caf::replies_to<checkpoint_begin>::with<checkpoint_copied>,
                     caf::replies_to<checkpoint_flush>::with<bool>>;

using coordinator_actor =
    caf::typed_actor<caf::reacts_to<coordinator_wiring>, caf::reacts_to<start_run>,
                     caf::reacts_to<grads_ready>, caf::reacts_to<update_done>,
                     caf::reacts_to<eval_done>, caf::replies_to<swap_schedule>::with<swap_result>,
                     caf::reacts_to<run_until>, caf::reacts_to<stop_run>,
                     caf::replies_to<checkpoint_now>::with<checkpoint_copied>>;

}  // namespace troupe::messages
