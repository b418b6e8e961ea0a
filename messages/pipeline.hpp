// The vocabulary of one training step, in process: plain structs that actors send each other.
// Tensor payloads travel as shared handles (payload.hpp), never copied by the transport.
// This header knows nothing of CAF; messages/protocols.hpp declares who accepts what.
//
// Invariants:
//  - Every activation and gradient carries its identity (step, round, micro-batch, receiving
//    virtual stage, replica) and its shape in a header, so a receiver can stash messages that
//    arrive early and micro-batches of one step may differ in sequence length.
//  - A sender may only send a link message the receiver granted a credit for (link_credit);
//    the receiver grants credits in the order its plan consumes messages, at most k ahead.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "engine/parallel/schedule.hpp"
#include "engine/parallel/zero.hpp"
#include "engine/trace/trace.hpp"
#include "engine/training/checkpoint.hpp"
#include "engine/training/metrics.hpp"
#include "messages/payload.hpp"

namespace troupe::messages {

using float_buffer = std::shared_ptr<payload<float>>;
using token_buffer = std::shared_ptr<payload<std::int32_t>>;

enum class link_kind : unsigned char { activation, gradient };

struct link_header {
  link_kind kind = link_kind::activation;
  int step = 0;
  int round = 0;
  int micro_batch = 0;
  int virtual_stage = 0;  // the receiving one
  int replica = 0;        // data-parallel replica of sender and receiver
  bool eval = false;
  std::vector<std::int64_t> shape;  // [B, T, C]
};

// An activation (forward) or gradient (backward) between pipeline ranks.
struct link_message {
  link_header header;
  float_buffer data;
  std::uint64_t flow_id = 0;
};

// Permission to send the one link message named by header (its shape is not used).
struct link_credit {
  link_header header;
};

enum class batch_part : unsigned char { inputs, targets };

// Tokens of one micro-batch from the data loader: inputs to virtual stage 0, targets to the
// last virtual stage.
struct batch_message {
  batch_part part = batch_part::inputs;
  int step = 0, round = 0, micro_batch = 0, replica = 0;
  bool eval = false;
  int B = 0, T = 0;
  token_buffer tokens;
  std::uint64_t flow_id = 0;
};

// A stage consumed a batch_message: the loader may send one more of that part.
struct batch_credit {
  batch_part part = batch_part::inputs;
  int replica = 0;
};

// What a rank runs in one step: `rounds` passes of the plan (gradient accumulation).
struct step_plan {
  int step = 0;
  int rounds = 1;
  bool eval = false;
  std::shared_ptr<const engine::pipeline_plan> plan;
  double loss_scale = 1;  // the head seeds its backward with it (dynamic loss scaling)
};

struct begin_step {
  int step = 0;
  int rounds = 1;
  double loss_scale = 1;
};

struct begin_eval {
  int step = 0;     // the training step after which evaluation runs
  int batches = 0;  // validation micro-batches over all replicas
};

// A rank finished its backward work, data-parallel reduction and tied-weight sync of a step.
struct grads_ready {
  int step = 0, rank = 0, replica = 0;
  double grad_square_sum = 0;  // this rank's gradients (tied wte counted once)
  double loss_sum = 0;         // head rank: sum of micro-batch mean losses
  int losses = 0;
};

// The coordinator's update guard decided: skip (no AdamW; gradients are dropped) or apply with
// the gradients multiplied by `unscale` (1 / the step's loss scale) and clipped by grad_norm.
struct apply_update {
  int step = 0;
  double grad_norm = 0;  // global, of the unscaled gradients, before clipping
  bool skip = false;
  double unscale = 1;
};

struct update_done {
  int step = 0, rank = 0, replica = 0;
  double lr = 0;
  engine::memory_report memory;  // what this (replica, rank) holds after the update
};

struct eval_done {
  int step = 0, replica = 0;
  double loss_sum = 0;
  int losses = 0;
};

// Data-parallel gradient bucket: the sender's gradient ranges, final for this step (device
// stages: on the device, final once the event `ready` of the chunk's stream has passed; nullptr
// for host memory).
struct grad_bucket {
  int step = 0, rank = 0, replica = 0, bucket = 0;
  std::vector<std::pair<float*, std::int64_t>> ranges;
  void* ready = nullptr;
};

// The bucket's ranges now hold the mean over all replicas (DDP), or (ZeRO) the replica's owned
// chunk does and square_sum is the squared norm of its counted parameters. Device stages: they
// hold it once the event `done` has passed (nullptr: now).
struct grad_bucket_reduced {
  int step = 0, bucket = 0;
  double square_sum = 0;
  void* done = nullptr;
};

// ZeRO, between a stage and its shard actor (always in the same process; raw pointers):
//   stage --zero_layout--> shard (once: what the replica owns of each bucket, where it lives)
//   stage --grad_bucket--> shard <--ring_chunk (reduce-scatter)--> shards of the other replicas
//   shard --grad_bucket_reduced{square_sum}--> stage (ZeRO-2: the stage releases the bucket)
//   stage --zero_update{grad_norm}--> shard: AdamW on the owned floats, then ring_chunk
//   (all-gather) of the new parameters --> shard --zero_update_done--> stage
// ZeRO-3 has no all-gather after the update; parameters are gathered before each use instead:
//   stage --zero_gather{seq, bucket}--> shard <--ring_chunk (all-gather)--> shards
//   shard --zero_gathered{seq}--> stage (the bucket's parameters are whole in the stage's buffer)
struct zero_layout {
  std::vector<engine::bucket_shard> buckets;  // by bucket index
  engine::shard_views views;                  // the stage's flat buffers (shard_* unset)
  std::vector<float> params;                  // ZeRO-3: the owned parameters (by segment.at)
  std::vector<float> m, v;  // resuming: the owned AdamW moments (by segment.at); empty: zeros
};
// A checkpoint: the stage asks its shard (same process) for what it owns, by segment.at.
struct zero_state_request {};
struct zero_state {
  std::vector<float> m, v, params;  // params: ZeRO-3 only
};
// Which collective a ZeRO ring serves; each numbers its instances within a step.
enum class zero_collective : int {
  buckets = 0,  // gradient reduce-scatter and update all-gather, by bucket
  train = 1,    // ZeRO-3 parameter gathers of a training step, by gather number
  eval = 2,     // of an evaluation
  final = 3,    // of the final weights (every bucket, once, before a snapshot)
};
struct zero_gather {
  int step = 0;
  zero_collective collective = zero_collective::train;
  int seq = 0;  // the gather's number within (step, collective): the same on every replica
  int bucket = 0;
};
struct zero_gathered {
  int step = 0;
  zero_collective collective = zero_collective::train;
  int seq = 0;
};
struct zero_update {
  int step = 0;
  double grad_norm = 0;
  bool skip = false;  // no AdamW and no all-gather: every replica still holds the parameters
  double unscale = 1;
};
struct zero_update_done {
  int step = 0;
  double lr = 0;
  engine::memory_report memory;  // the shard's part: moments, owned gradients, chunk buffers
};

// The tied wte gradient, exchanged between the embedding rank and the head rank.
struct tied_grad {
  int step = 0, replica = 0;
  float_buffer data;  // null: the copy went by a device link (topology/tied_wte.hpp)
};

// Switch the pipeline schedule from the next step on. Refused (with a reason) if the schedule
// is unknown, cannot serve the current shape, or fails the simulator.
struct swap_schedule {
  std::string name;
};
struct swap_result {
  bool ok = false;
  std::string message;
};

// Trace events recorded by an actor, flushed in batches.
struct trace_batch {
  std::vector<engine::trace::event> events;
};
struct trace_finish {
  engine::trace::metadata meta;
  std::vector<engine::trace::track> tracks;
  // The step's plan: the tracer sets meta.theory_bubble from it and the measured F/B/W costs.
  std::shared_ptr<const engine::pipeline_plan> plan;
};

// Snapshot of a stage's parameters by Hugging Face name (final weights, tests; on the wire the
// parameter-shard message). With `state` (a checkpoint at the end of `step`): the AdamW moments
// too, and, where ZeRO shards hold them, the parameters and moments as pieces; a ZeRO-3 stage
// gathers nothing for it. With `capture` too (a checkpoint's first phase, between steps): the
// stage takes its state aside and answers with an empty snapshot once the next step may begin
// (a CPU stage at once, copying while that step runs; its update waits for the copy); the state
// request that follows answers with what was taken.
struct snapshot_request {
  int step = 0;
  bool state = false;
  bool capture = false;
  // With state (a checkpoint of format 2): the stage writes its state as its part file into this
  // step directory and answers with the part alone.
  std::string part_dir;
};
enum class tensor_role : int { parameter = 0, exp_avg = 1, exp_avg_sq = 2 };
// Values [offset, offset + size) of a named tensor's flat elements (Troupe layout; a tensor
// shard's slice).
struct tensor_piece {
  tensor_role role = tensor_role::parameter;
  std::string name;
  std::int64_t offset = 0;
  std::vector<float> values;
};
struct stage_snapshot {
  int rank = 0, replica = 0;
  std::vector<std::pair<std::string, std::vector<float>>> parameters;
  std::vector<tensor_piece> pieces;
  engine::checkpoint_file part;  // the part file written (part.name empty: none)
};

// Checkpoints (docs/checkpoints.md), between actors of the control process:
//   coordinator --checkpoint_begin--> checkpoint writer --snapshot_request{capture}--> stages
//   writer --checkpoint_copied--> coordinator (every state captured: the next step may begin),
//   then the writer collects the states (snapshot_request{state}), writes and commits the files
//   while training goes on.
struct checkpoint_begin {
  engine::checkpoint_state state;  // the coordinator's part: step, tokens, data position, guard
};
struct checkpoint_copied {
  int step = 0;
};
// Answered (true) once every checkpoint begun before it is committed; with `abandon` (a job that
// failed: a stage that lost its process never answers) a checkpoint still being collected is
// dropped instead, never written, and the answer comes at once.
struct checkpoint_flush {
  bool abandon = false;
};

// Pacing, for an embedding's trainer (include/troupe/trainer.hpp): the coordinator runs steps
// until `step` steps are done, then pauses between steps and tells its client; a checkpoint can
// be taken while it is paused.
struct run_until {
  int step = 0;
};
struct training_paused {
  int step = 0;  // steps done
};
struct checkpoint_now {};
// End the run while paused, as if its last step were done (the final weights are written).
struct stop_run {};

// Coordinator -> whoever started the run.
struct step_report {
  engine::step_metrics metrics;
};
struct run_finished {
  bool ok = true;
  std::string message;  // the failure, naming the actor
};

}  // namespace troupe::messages
