// What the device kind of engine::rank_chunks (the stage actor's chunks) drives: one pipeline
// chunk on a device, with the saved activations of a number of micro-batches in flight (slots), and
// the links that move activations and their gradients between chunks while the typed header
// travels as a message (docs/gpu.md). engine::gpu_chunk is the CUDA chunk and
// kernels::cuda::activation_link (through make_cuda_links) the CUDA links; host_chunk and
// make_host_link are the same contracts in host memory, so the actor's protocol is tested
// without a GPU against the CPU pipeline, bitwise.
//
// Invariants (for both kinds):
//  - Every buffer a call takes or returns is device memory of the chunk's device (host memory
//    for host_chunk); an activation, or its gradient, is activation_bytes() bytes.
//  - Work is enqueued in call order on the chunk's stream. An event (void*: a cudaEvent_t, or
//    nullptr for host chunks, whose calls finish before they return) orders it against links:
//    record_event() marks what was enqueued so far; wait_event(e) makes what follows wait for e.
//  - A link moves bytes in send order: the receiver posts its receives in the order the
//    sender's headers arrive, and the sender sends a payload right before its header.
#pragma once

#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "engine/chunks/gpu_chunk.hpp"
#include "engine/model/block_pass.hpp"
#include "engine/model/gpt_model.hpp"
#include "engine/parallel/zero.hpp"
#include "engine/training/optimizer.hpp"

namespace troupe::engine {

class device_chunk {
 public:
  virtual ~device_chunk() = default;

  virtual const chunk_range& range() const = 0;
  virtual int slots() const = 0;
  // One more slot (its buffers allocated now); returns the new count. Slots already handed out
  // keep their buffers.
  virtual int add_slot() = 0;
  // B * T * width values: the most an activation (or its gradient) holds; a micro-batch of
  // sequence length t uses the front B * t * width.
  virtual std::size_t activation_bytes() const = 0;
  // A chunk without the embedding: where slot's input activation is received before forward.
  virtual void* input(int slot) = 0;
  // A chunk without the embedding: where the gradient of input(slot) is written by backward (or
  // backward_input) and sent from: input(slot) itself, unless the chunk keeps the input for a
  // split backward's W.
  virtual void* input_gradient(int slot) = 0;
  // Forward of one micro-batch of B x seq_len tokens (seq_len <= T) into `slot` (tokens and
  // targets on the host); backward of the slot follows its length. A head chunk returns the
  // mean loss over the counted targets (and, training, seeds backward with loss_scale); other
  // chunks return NaN.
  double forward(int slot, int seq_len, const std::int32_t* tokens, const std::int32_t* targets,
                 float loss_scale, bool train) {
    double loss = std::numeric_limits<double>::quiet_NaN();
    forward_pass(slot, seq_len, tokens, targets, loss_scale, train, &loss).run();
    return loss;
  }
  // A chunk without the head: slot's output activation, valid until slot's next forward.
  virtual const void* output(int slot) const = 0;
  // A chunk without the head: where the gradient of output(slot) is received, once output(slot)
  // has been sent, before backward(slot).
  virtual void* output_gradient(int slot) = 0;
  // Backward of slot's micro-batch (weight gradients accumulate). A chunk without the embedding
  // writes the gradient of input(slot) to `dinput` (activation_bytes; it may be input(slot)).
  // on_block_done(i) (if set) runs once block i (an index into chunk_grad_blocks) has this
  // micro-batch's gradient enqueued: an event recorded then marks it final on the stream, so a
  // data-parallel reduction can start on it while backward continues on earlier blocks.
  void backward(int slot, void* dinput, const grad_block_fn& on_block_done) {
    backward_pass(slot, dinput, on_block_done).run();
  }
  // A split backward (zero-bubble schedules): backward_input writes the input's gradient as
  // backward does (B); backward_weight then makes the weight gradients final, calling
  // on_block_done as backward does (W). Together backward's gradients.
  void backward_input(int slot, void* dinput) { backward_input_pass(slot, dinput).run(); }
  void backward_weight(int slot, const grad_block_fn& on_block_done) {
    backward_weight_pass(slot, on_block_done).run();
  }
  // Whether the chunk checkpoints its blocks (recomputes them in backward, and in W).
  virtual bool recomputes() const = 0;
  // forward, backward, backward_input and backward_weight as passes (engine/model/block_pass.hpp)
  // that stop before each piece reading parameters (pass_stops(range(), kind, recomputes())), so a
  // ZeRO-3 stage gathers the piece's blocks first (the calls above run them whole). A pass keeps
  // its arguments; *loss (forward's return value) is written when the pass is done.
  virtual block_pass forward_pass(int slot, int seq_len, const std::int32_t* tokens,
                                  const std::int32_t* targets, float loss_scale, bool train,
                                  double* loss) = 0;
  virtual block_pass backward_pass(int slot, void* dinput, grad_block_fn on_block_done) = 0;
  virtual block_pass backward_input_pass(int slot, void* dinput) = 0;
  virtual block_pass backward_weight_pass(int slot, grad_block_fn on_block_done) = 0;

  virtual void zero_grad() = 0;
  virtual double grad_square_sum(bool count_tied_copy) = 0;
  // The optimizer step of the actor engine's apply_update: gradients unscaled by `unscale` and
  // clipped to the global grad_norm, then AdamW at 0-based `step`. Returns the learning rate.
  virtual double update(const optimizer_config& config, int step, int total_steps, double grad_norm,
                        double unscale) = 0;
  // Gradients [at, at + n) of the flat layout (gpt_chunk's), on the chunk's stream: each
  // becomes own + values[i] (in that order), or values[i]. values: n floats of device memory of
  // the chunk's device (of this chunk, another chunk of the rank, or gradient_scratch).
  virtual void add_gradients(std::int64_t at, const float* values, std::int64_t n) = 0;
  virtual void copy_gradients(std::int64_t at, const float* values, std::int64_t n) = 0;
  // n floats of device memory the chunk keeps to receive a peer's gradients into (the tied
  // wte's other copy): allocated at the first call, the same buffer after.
  virtual float* gradient_scratch(std::int64_t n) = 0;
  // fp32 gradients on the device, in the flat layout (parameter_count() floats), for
  // collectives on the chunk's stream order.
  virtual float* device_gradients() = 0;
  virtual std::int64_t parameter_count() const = 0;
  virtual const std::vector<parameter_info>& layout() const = 0;
  virtual std::vector<float> parameters() const = 0;  // the master weights, on the host
  // Master weights [at, at + n) of the layout from n host floats (and the 16-bit copy the
  // passes read), after the chunk's work so far; the host buffer may be reused on return.
  virtual void load_parameters(std::int64_t at, const float* host, std::int64_t n) = 0;
  // The AdamW moments (m, v) on the host, after the chunk's work so far; loading them (a chunk
  // made with optimizer state; parameter_count() floats each).
  virtual std::pair<std::vector<float>, std::vector<float>> moments() = 0;
  virtual void load_moments(const float* m, const float* v) = 0;
  // A checkpoint's capture: begins copying the master weights and (with_moments) the AdamW
  // moments to host memory now, after the chunk's work so far, and returns the call that waits
  // for the copy and gives it (parameter_count() floats each; m and v null without moments), on
  // any thread. Until it returns the chunk may run work that reads them, never update(); once it
  // has, the floats it gives are the chunk's no longer, and stay valid until the next
  // begin_state_copy (or until the state_copy goes, where it owns them). The default copies when
  // called (parameters(), moments()): for kinds whose calls are safe from another thread while
  // the chunk works (host chunks); CUDA chunks copy into pinned host memory on a stream of their
  // own, overlapping the chunk's later work, and give views of it.
  struct state_copy {
    const float* params = nullptr;
    const float* m = nullptr;
    const float* v = nullptr;
    std::vector<float> owned_params, owned_m, owned_v;  // where the copy owns its floats
  };
  virtual std::function<state_copy()> begin_state_copy(bool with_moments) {
    return [this, with_moments] {
      state_copy s;
      s.owned_params = parameters();
      s.params = s.owned_params.data();
      if (!with_moments) return s;
      std::tie(s.owned_m, s.owned_v) = moments();
      s.m = s.owned_m.data();
      s.v = s.owned_v.data();
      return s;
    };
  }
  virtual std::int64_t device_bytes() const = 0;     // what the chunk allocated
  virtual std::int64_t optimizer_bytes() const = 0;  // of which AdamW moments (owned ones too)

  // ---- ZeRO-1/2/3 on the device (zero_group): this replica's owned floats --------------------
  // The fp32 master weights on the device, in the flat layout (a zero_group gathers them).
  virtual float* device_parameters() = 0;
  // The segments of the flat layout this replica owns (offset, numel, decay; `at` into the
  // owned storage, which holds them one after the other); allocates their AdamW moments on the
  // device, zeroed. With `parameters` (ZeRO-3) their master weights are kept in owned storage
  // too, copied from the flat ones now: update_owned updates those, and the flat master weights
  // hold whatever was gathered last (the stage releases them between uses). Once, in a chunk made
  // without optimizer state.
  virtual void own(std::vector<shard_segment> segments, bool parameters) = 0;
  // Sum of the squared gradients of `segments` (some of own()'s, counted ones only), in double,
  // in segment order, after the chunk's work so far.
  virtual double owned_square_sum(const std::vector<shard_segment>& segments) = 0;
  // update() over the owned segments alone (their gradients, unscaled and clipped, then AdamW
  // with the owned moments); without owned parameters the compute copy of those weights
  // follows. Returns the lr.
  virtual double update_owned(const optimizer_config& config, int step, int total_steps,
                              double grad_norm, double unscale) = 0;
  // The master weights [at, at + n) changed on the device (a gather wrote them): the compute
  // copy the passes read follows, on the chunk's stream.
  virtual void parameters_changed(std::int64_t at, std::int64_t n) = 0;
  // The owned moments on the host (owned storage order), after the chunk's work so far; loading
  // them.
  virtual std::pair<std::vector<float>, std::vector<float>> owned_moments() = 0;
  virtual void load_owned_moments(const float* m, const float* v) = 0;
  // ZeRO-3 (own() with parameters): `segments` (some of own()'s) of the owned master weights
  // into the flat ones, on the chunk's stream (a gather then sends them); the owned master
  // weights on the host (owned storage order), after the chunk's work so far.
  virtual void put_owned_parameters(const std::vector<shard_segment>& segments) = 0;
  virtual std::vector<float> owned_parameters() = 0;
  virtual std::int64_t owned_parameter_bytes() const = 0;  // of device_bytes()
  // ZeRO-3: the flat master weights [at, at + n) and their compute copy are not needed until
  // acquired again (their memory may go back: host chunks release whole pages, CUDA chunks with
  // paged parameters their granules), and are again (their values unspecified until a gather
  // writes them). Ranges released are acquired whole, and never overlap another range held.
  virtual void release_parameters(std::int64_t at, std::int64_t n) = 0;
  virtual void acquire_parameters(std::int64_t at, std::int64_t n) = 0;
  // ZeRO-3: a round of releases and acquires begins (one per parameter use). A chunk whose
  // released memory goes back once its stream has passed the release (CUDA's paged parameters)
  // waits here for the releases of two rounds ago, so the host runs at most two uses ahead of the
  // device and the memory held is that of the buckets held (FSDP's limit_all_gathers).
  virtual void parameter_round() = 0;

  virtual void* record_event() = 0;
  virtual void wait_event(void* event) = 0;
  // Copies between this chunk's memory and the host (a payload staged through host memory
  // across processes), after the chunk's work so far; they return once the host buffer holds
  // the bytes (to_host) or may be reused (from_host), and the chunk's later work sees them.
  virtual void copy_to_host(void* host, const void* memory, std::size_t bytes) = 0;
  virtual void copy_from_host(void* memory, const void* host, std::size_t bytes) = 0;
};

// One direction of a link between two chunks (both ends may share the object).
class chunk_link {
 public:
  virtual ~chunk_link() = default;
  // Reads `data` after `ready`; returns the event after which `data` may be overwritten.
  virtual void* send(const void* data, std::size_t bytes, void* ready) = 0;
  // Writes the oldest payload not yet received into `data` after `ready`; returns the event
  // after which `data` holds it.
  virtual void* receive(void* data, std::size_t bytes, void* ready) = 0;
  virtual std::string describe() const = 0;
};

// The data-parallel replicas of one pipeline rank's chunks: replaces gradient ranges with their
// mean over the replicas. All of them in this process, or (make_process_group) this process's one
// replica of a group that spans processes.
class replica_group {
 public:
  using float_ranges = std::vector<std::pair<float*, std::int64_t>>;
  virtual ~replica_group() = default;
  // ranges[d]: replica d's copy of the same ranges (the same sizes, in the same order), final
  // after its event ready[d]. Enqueues the mean and returns, by replica, the event after which
  // its ranges hold it (nullptr: they already do). Returns at once; never waits for the
  // replicas' devices.
  virtual std::vector<void*> mean(const std::vector<float_ranges>& ranges,
                                  const std::vector<void*>& ready) = 0;
  virtual std::string describe() const = 0;
};

// ZeRO through the devices: the data-parallel replicas of one pipeline rank's tensor shard
// reduce-scatter each gradient bucket and all-gather its parameters in the chunks' own memory
// (ZeRO-1/2 after the update, ZeRO-3 before each use).
// A bucket is the concatenation of its ranges, cut into ring chunks (topology::ring_chunk_bounds)
// of which replica r owns chunk topology::ring_owned_chunk(r, d), as engine::make_bucket_shard
// says. One object serves this process's replicas of the group: each calls with its own copy of
// the bucket's ranges (the same sizes, in the same order), final after its event `ready`; once
// every replica of the process has called for (step, bucket), the collective is enqueued (on the
// last caller's thread) and each caller's `done` runs, on that thread, with the event after
// which its ranges hold the result (nullptr: they already do; an event may be re-recorded by a
// later collective, a later point). Every process enqueues its collectives in the order its
// replicas call: the callers keep one order in every process.
//  - reduce_scatter: each replica's owned chunk ends as the mean over the replicas (the ring's
//    order of sums where the kind can keep it); the rest of its ranges is unspecified.
//  - all_gather: every replica's ranges end as the owners' chunks.
class zero_group {
 public:
  using float_ranges = std::vector<std::pair<float*, std::int64_t>>;
  using done_fn = std::function<void(void* event)>;
  virtual ~zero_group() = default;
  virtual void reduce_scatter(int step, int bucket, int replica, const float_ranges& ranges,
                              void* ready, done_fn done) = 0;
  virtual void all_gather(int step, int bucket, int replica, const float_ranges& ranges,
                          void* ready, done_fn done) = 0;
  virtual std::string describe() const = 0;
};

// How a device pipeline makes its chunks and links. A lane is one tensor shard of one
// data-parallel replica: lane d * tp + j is shard j of replica d (lanes are replicas without
// tensor parallelism). The CUDA kind places pipeline rank r of lane d * tp + j on device
// ((d * pp + r) * tp + j) % devices, the shards of a rank on neighbouring devices
// (cuda_chunks); the host kind is for tests.
struct chunk_factory {
  std::string name;  // "cuda", "host"
  // The chunk of `weights` (a tensor shard's slice when weights.shard() is split) for
  // micro-batches of B x T with `slots` in flight, for pipeline rank `rank` of lane `lane`.
  // tp_member: the shard's member of its (replica, rank) tensor group (make_tensor_group's),
  // null without tensor parallelism. Without optimizer_state the chunk holds no AdamW moments
  // (ZeRO: its shards do) and update throws.
  std::function<std::unique_ptr<device_chunk>(
      const gpt_chunk& weights, int B, int T, int slots, int rank, int lane,
      std::shared_ptr<group_member> tp_member, bool optimizer_state)>
      make_chunk;
  // The link carrying payloads from pipeline rank `from` to rank `to` of one lane (from may
  // equal to: chunks of one rank). One object serves both ends.
  std::function<std::shared_ptr<chunk_link>(int from, int to, int lane)> make_link;
  // The data-parallel group of tensor shard `shard` of pipeline rank `rank` over `replicas`
  // replicas. Unset: the chunks' gradients are host memory, and the host's ring-order mean
  // (topology::ring_order_mean) serves them.
  std::function<std::shared_ptr<replica_group>(int rank, int shard, int replicas)> make_group;
  // ZeRO through the devices: the data-parallel group of tensor shard `shard` of pipeline
  // rank `rank` over its `replicas` replicas, all in this process. Unset: this kind has none
  // (ZeRO runs in host shards). Across processes, make_process_group's groups are zero_groups
  // too where the kind has them, and host_memory kinds exchange messages.
  std::function<std::shared_ptr<zero_group>(int rank, int shard, int replicas)> make_zero_group;
  // The tensor-parallel group of pipeline rank `rank` of replica `replica`: member j for shard
  // j's chunks (every chunk of the rank's shard uses it, one pass at a time). Unset: this kind
  // has no tensor parallelism.
  std::function<std::vector<std::shared_ptr<group_member>>(int rank, int replica, int tp)>
      make_tensor_group;
  // Links and data-parallel groups between processes over NCCL (set by kinds that have them;
  // used where the rendezvous found every process on a device of its own, docs/processes.md).
  // device_identity: this process's device, as the rendezvous compares them (a PCI bus id, and
  // NCCL's host id where one is set). new_link_ids: n NCCL unique ids (128 bytes each; rank 0
  // makes them, the welcome carries them). make_process_link: this process's end of the link
  // carrying payloads from pipeline rank `from` to rank `to` of lane `lane`, which lives in
  // another process: a two-rank communicator of its own joined with `id`, the sender as rank 0;
  // it waits for the other end to join. make_process_group: this process's replica `replica` of
  // the data-parallel group of tensor shard `shard` of pipeline rank `rank`, whose `replicas`
  // replicas each live in a process of their own: rank `replica` of a communicator joined with
  // `id` (it waits for every replica to join); mean() takes this replica's ranges alone.
  std::function<std::string()> device_identity;
  std::function<std::vector<std::vector<std::uint8_t>>(std::size_t n)> new_link_ids;
  std::function<std::shared_ptr<chunk_link>(const std::string& name,
                                            const std::vector<std::uint8_t>& id, int from, int to,
                                            int lane, bool sender)>
      make_process_link;
  std::function<std::shared_ptr<replica_group>(const std::string& name,
                                               const std::vector<std::uint8_t>& id, int rank,
                                               int shard, int replica, int replicas)>
      make_process_group;
  // make_process_tensor_member: this process's member (shard `shard`) of the tensor group of
  // pipeline rank `rank` of replica `replica`, whose `shards` shards each live in a process of
  // their own: rank `shard` of a communicator joined with `id`, for make_chunk's tp_member.
  std::function<std::shared_ptr<group_member>(const std::string& name,
                                              const std::vector<std::uint8_t>& id, int rank,
                                              int replica, int shard, int shards)>
      make_process_tensor_member;
  // Whether make_chunk also takes a host tensor_group's member (engine/chunks/tensor_group.hpp): a
  // tensor group whose shards live in several processes is one (topology/tensor_exchange.hpp).
  bool host_tensor_groups = false;
  // Whether the chunks' memory is host memory (host chunks): ZeRO through the groups across
  // processes then exchanges the buckets' pieces as messages (topology/zero_exchange.hpp).
  bool host_memory = false;
};

// CUDA chunks (gpu_chunk) for a pipeline of `pp` ranks of `tp` tensor shards each, and links
// between them: a staged copy when both ends share a device, otherwise an NCCL group of two for
// each direction. A replica group is one NCCL communicator per replica (ncclAvg, one group call)
// when the replicas of a rank sit on distinct devices, a mean kernel when they share one device;
// a tensor group likewise (make_device_tensor_group), and a host tensor group (one spanning
// processes) is staged through pinned host memory (make_staged_tensor_member). Throws
// std::runtime_error saying why in a build or on a machine without CUDA.
// local_rank >= 0 (a process of a multi-process job): every chunk, link and group of this
// process on device local_rank mod the devices.
chunk_factory cuda_chunks(const gpu_trainer_options& options, int pp, int tp = 1,
                          int local_rank = -1);
// A process's device as the rendezvous compares them for NCCL (chunk_factory::device_identity),
// and as NCCL tells devices apart: its PCI bus id, with NCCL's host id where one is set
// (NCCL_HOSTID: NCCL then counts hosts by it, not by their names, so two processes on one device
// with different host ids are two hosts to it, joined by its network transport). A host id
// longer than 32 bytes goes by its xxh64, so the identity stays within the rendezvous's 64
// bytes; an empty one (set, but to nothing) is a host id too, as NCCL takes it. "" without a bus
// id (no device).
std::string device_identity(const std::string& bus_id,
                            const std::optional<std::string>& nccl_host_id);

// Host chunks and links: the CPU engine's arithmetic (engine::cpu_chunks) behind the device
// contracts, bitwise the CPU pipeline's numbers; tensor groups are make_local_tensor_group's
// (or, across processes, any host tensor_group).
chunk_factory host_chunks(bool recompute);

}  // namespace troupe::engine
