// The one chunk contract: what a pipeline rank's model chunks offer its stage actor, whatever
// the device (docs/pipeline.md). CAF-free. Two kinds implement it:
//  - CPU chunks (make_cpu_rank_chunks): engine::cpu_chunks's gpt_chunks, BLAS arithmetic,
//    passes that stop before each piece reading parameters (ZeRO-3 gathers), split backward,
//    any micro-batch shape; payloads are host buffers the caller hands in and keeps.
//  - device chunks (make_device_rank_chunks): engine::device_chunk's (CUDA's gpu_chunk, or
//    host_chunk for tests), one micro-batch shape, passes that run whole; payloads live in the
//    chunks' own buffers (slots) and move through chunk_links, ordered by events.
//
// Invariants (both kinds):
//  - A micro-batch in flight is named per chunk by its micro_batch_id: forward (or an
//    activation's receive_buffer) starts its state, release ends it. Device chunks map ids to
//    slots, adding a slot when none is free; a slot is free once its id is released and nothing
//    holds it (hold / drop: a payload read from it waits for its link credit).
//  - Gradients accumulate across micro-batches until zero_grad; every call's work is ordered on
//    the chunk's stream (record_event / wait_event; nullptr events for work that is done when the
//    call returns).
//  - Errors are exceptions naming the chunk and the micro-batch.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "engine/chunks/cpu_chunks.hpp"
#include "engine/model/block_pass.hpp"
#include "engine/model/gpt_model.hpp"
#include "engine/training/optimizer.hpp"

namespace troupe::engine {

struct chunk_factory;  // device_chunk.hpp
class device_chunk;

enum class payload_kind { activation, gradient };

class rank_chunks {
 public:
  virtual ~rank_chunks() = default;

  // ---- the chunks and their parameters ------------------------------------------------------
  virtual std::string kind() const = 0;  // "cpu", or the device factory's name ("cuda", "host")
  virtual int chunk_count() const = 0;
  virtual const chunk_range& range(int c) const = 0;
  virtual const std::vector<parameter_info>& layout(int c) const = 0;
  virtual std::int64_t parameter_count(int c) const = 0;
  // chunk_grad_blocks of the chunk: the ranges whose gradients become final together.
  virtual const std::vector<grad_block>& grad_blocks(int c) const = 0;
  // fp32 gradients in the layout, in the chunk's memory (host memory for CPU chunks).
  virtual float* gradients(int c) = 0;
  // CPU chunks: the chunk's gpt_chunk (ZeRO works on its host buffers); nullptr otherwise.
  virtual gpt_chunk* cpu_chunk(int c) = 0;
  // Device chunks: the chunk itself (ZeRO through a zero_group works on its owned floats);
  // nullptr otherwise.
  virtual device_chunk* device(int c) = 0;
  // The master weights, copied to the host.
  virtual std::vector<float> parameters(int c) const = 0;

  // ---- payloads --------------------------------------------------------------------------
  // true: activations and their gradients are host buffers the caller hands to forward and
  // backward and keeps until release (CPU chunks: a message's payload, read in place). false:
  // they live in the chunks' buffers below and move through links.
  virtual bool host_payloads() const = 0;
  // Device chunks: where the payload of `kind` that (c, id) receives goes: an activation of
  // B x T tokens into the input of id's slot (taken now), a gradient into its output's gradient.
  // nullptr for CPU chunks.
  virtual void* receive_buffer(int c, micro_batch_id id, payload_kind kind, int B, int T) = 0;
  // Device chunks: the payload of `kind` that (c, id) sends: its output activation (after
  // forward), or its input's gradient (after backward, written into its input). nullptr for
  // CPU chunks (the output is output(); the input's gradient is the caller's dinput).
  virtual const void* send_buffer(int c, micro_batch_id id, payload_kind kind) = 0;
  virtual std::size_t payload_bytes(int c, micro_batch_id id) const = 0;
  // Device chunks: the slots chunk c has (it adds one when a micro-batch needs one and none is
  // free); 0 for CPU chunks, whose micro-batch state is allocated (and pooled) as needed.
  virtual int slot_count(int c) const = 0;
  // While held, id's slot is not reused (device chunks); nothing for CPU chunks.
  virtual void hold(int c, micro_batch_id id) = 0;
  virtual void drop(int c, micro_batch_id id) = 0;

  // ---- passes ------------------------------------------------------------------------------
  using forward_args = cpu_chunks::forward_args;  // `input` is ignored by device chunks
  virtual block_pass forward(int c, micro_batch_id id, forward_args args) = 0;
  // After forward: a head chunk's mean loss over its counted targets, NaN otherwise.
  virtual double loss(int c, micro_batch_id id) const = 0;
  // A non-head chunk's output [B, T, width] in host memory (CPU chunks; device chunks throw).
  virtual const float* output(int c, micro_batch_id id) const = 0;
  virtual std::pair<int, int> shape(int c, micro_batch_id id) const = 0;  // (B, T)
  // doutput, dinput: host buffers for CPU chunks; ignored by device chunks (their slot's).
  virtual block_pass backward(int c, micro_batch_id id, const float* doutput, float* dinput,
                              grad_block_fn on_block_done) = 0;
  // Split backward (B, then W): the input's gradient, then the weight gradients; together
  // backward's. Device chunks: chunks made for a schedule that splits backward.
  virtual block_pass backward_input(int c, micro_batch_id id, const float* doutput,
                                    float* dinput) = 0;
  virtual block_pass backward_weight(int c, micro_batch_id id, grad_block_fn on_block_done) = 0;
  virtual void release(int c, micro_batch_id id) = 0;
  // Where c's passes of `kind` stop (pass_stops with the chunks' checkpointing): a ZeRO-3 stage
  // plans its gathers from them.
  virtual std::vector<std::vector<int>> stops(int c, pass_kind kind) const = 0;

  // ---- gradients and the optimizer -----------------------------------------------------------
  virtual void zero_grad() = 0;
  // Without count_tied_copy, a head chunk's copy of the tied wte is left out.
  virtual double grad_square_sum(int c, bool count_tied_copy) = 0;
  // Unscale by `unscale`, clip to grad_norm, AdamW at 0-based `step`; returns the rate.
  virtual double update(int c, const optimizer_config& config, int step, int total_steps,
                        double grad_norm, double unscale) = 0;
  // Gradients [at, at + n) of c's layout: own + values[i], or values[i] (values in c's memory).
  virtual void add_gradients(int c, std::int64_t at, const float* values, std::int64_t n) = 0;
  virtual void copy_gradients(int c, std::int64_t at, const float* values, std::int64_t n) = 0;
  // n floats in c's memory kept to receive a peer's gradients into (the same buffer each call).
  virtual float* gradient_scratch(int c, std::int64_t n) = 0;
  virtual void* record_event(int c) = 0;
  virtual void wait_event(int c, void* event) = 0;
  // Between c's memory and the host (payloads and buckets staged across processes): after c's
  // work so far, done when the call returns (device_chunk::copy_to_host). CPU chunks: a copy.
  virtual void copy_to_host(int c, void* host, const void* memory, std::size_t bytes) = 0;
  virtual void copy_from_host(int c, void* memory, const void* host, std::size_t bytes) = 0;

  // ---- ZeRO: the chunks' flat buffers in host memory ---------------------------------------
  // ZeRO's shards (actors/zero_shard.cpp) reduce, update and gather in host memory: CPU chunks'
  // own parameter and gradient buffers; device chunks' host copies of them, in private anonymous
  // mappings (whose pages ZeRO may release), made at the first call (the parameters copied from
  // the chunk then).
  virtual float* host_parameters(int c) = 0;
  virtual float* host_gradients(int c) = 0;
  // Device chunks: gradients [at, at + n) of c's layout into host_gradients, after c's work so
  // far (done when the call returns); parameters [at, at + n) from host_parameters into c's
  // weights (and their compute copy), before c's later work. Nothing for CPU chunks.
  virtual void gradients_to_host(int c, std::int64_t at, std::int64_t n) = 0;
  virtual void parameters_from_host(int c, std::int64_t at, std::int64_t n) = 0;

  // ---- checkpoints ---------------------------------------------------------------------------
  // The AdamW moments (m, v) of c in its flat layout, copied to the host after c's work so far;
  // and loading them (chunks made with optimizer state).
  virtual std::pair<std::vector<float>, std::vector<float>> moments(int c) = 0;
  virtual void load_moments(int c, const float* m, const float* v) = 0;
  // c's master weights and (with_moments) AdamW moments readable on the host until c's next
  // work: views of the chunk's own buffers where they are host memory (CPU chunks: nothing is
  // copied), otherwise copies the result owns (parameters() and moments()).
  struct host_state {
    const float* params = nullptr;
    const float* m = nullptr;
    const float* v = nullptr;
    std::vector<float> owned_params, owned_m, owned_v;
    // capture_state's: the floats are no longer the chunk's (a copy), so its update may run
    // while they are read; false: views of the chunk's buffers, read before its update.
    bool detached = false;
  };
  virtual host_state state_on_host(int c, bool with_moments);
  // A checkpoint's capture (actors/stage.cpp, S7): begins taking c's master weights and
  // (with_moments) AdamW moments to the host now, after c's work so far, and returns the call
  // that waits for them and gives them as state_on_host does, on any thread. Until it returns,
  // c may run work that only reads them (forward, backward), never its update; and until what it
  // gave has been read, unless it is detached. CPU chunks: the call gives views of the chunks'
  // buffers; device chunks: device_chunk::begin_state_copy's copy (detached; CUDA: views of
  // pinned memory valid until c's next capture).
  virtual std::function<host_state()> capture_state(int c, bool with_moments);

  // ---- memory --------------------------------------------------------------------------
  virtual std::int64_t optimizer_bytes() const = 0;   // AdamW moments held here
  virtual std::int64_t activation_bytes() const = 0;  // what the passes keep and pool
};

// A chunk's weights before it starts (GPT-2 init from a seed, or a Hugging Face file).
using chunk_init = std::function<void(gpt_chunk&)>;

// CPU chunks for `ranges` (cpu_chunks's arguments), each initialised by `init`.
std::unique_ptr<rank_chunks> make_cpu_rank_chunks(const gpt_config& model,
                                                  const std::vector<chunk_range>& ranges,
                                                  const chunk_init& init, bool optimizer_state,
                                                  bool recompute, tensor_shard shard = {},
                                                  std::shared_ptr<tensor_group> group = nullptr);

// Device chunks made by `factory` (device_chunk.hpp) for pipeline rank `rank` of lane `lane`,
// micro-batches of B x T, `slots` in flight to start with; without optimizer_state they hold no
// AdamW moments (ZeRO: its shards do) and update throws.
std::unique_ptr<rank_chunks> make_device_rank_chunks(
    const chunk_factory& factory, const gpt_config& model, const std::vector<chunk_range>& ranges,
    tensor_shard shard, const chunk_init& init, int B, int T, int slots, int rank, int lane,
    std::shared_ptr<group_member> tp_member, bool optimizer_state = true);

}  // namespace troupe::engine
