// One pipeline chunk of GPT-2 (a chunk_range: the embedding, blocks [first, last), the head) on
// one CUDA device, with the saved activations of up to `slots` micro-batches in flight: what a
// GPU pipeline stage holds (docs/gpu.md). gpu_trainer is the whole model as one chunk with one
// slot. Host code: the kernels come from kernels/cuda through the .cpp.
//
// Invariants:
//  - The weights start as the host chunk given (the same chunk_range, the same flat layout as
//    gpt_chunk), so a GPU chunk starts from the CPU chunk's exact weights, and parameters and
//    gradients keep gpt_chunk's layout. A head chunk without the embedding holds its own copy
//    of the tied wte, as on the CPU: whoever drives the pipeline sums the two copies' gradients.
//  - Master weights, gradients and AdamW moments are fp32. With compute_dtype bf16 or fp16 the
//    passes run on a 16-bit copy of the weights (refreshed by every AdamW update) and 16-bit
//    activations; layernorm parameters and statistics, GEMM accumulation, softmax and every
//    gradient reduction stay fp32. fp16 needs dynamic loss scaling: the caller seeds the head's
//    loss gradient with the scale and skips non-finite steps.
//  - Activations between chunks are device buffers of [B, T, width] in the compute dtype
//    (activation_bytes()). A slot is a micro-batch in flight: its forward keeps what its
//    backward needs until the slot's next forward; slots never share saved activations.
//  - A head chunk computes the loss in forward and, when training, turns the logits into the
//    loss gradient and runs the head's backward up to ln_f's input gradient right away (the
//    logits never outlive the forward), so its backward needs no incoming gradient.
//  - Activation checkpointing (recompute): each block keeps only its output per slot; the
//    blocks' internals live in one scratch shared by every layer and slot and are recomputed,
//    by the same kernels, before a block's backward (unless the scratch still holds that very
//    block of that slot), so the numbers are bitwise those of the run without it.
//  - Everything is enqueued on the chunk's own stream (stream()), in call order; gradients
//    accumulate (+=) across micro-batches until zero_grad. No atomics: a pass repeats bitwise.
//  - plan_gpu_chunk_memory() gives, without a device, exactly the bytes the chunk allocates.
// Without CUDA (the build or the machine), constructing one throws std::runtime_error saying
// why; cuda_training_available() tells beforehand.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "engine/model/block_pass.hpp"
#include "engine/model/gpt_model.hpp"
#include "engine/parallel/zero.hpp"
#include "engine/training/optimizer.hpp"

namespace troupe::engine {

enum class compute_dtype { fp32, bf16, fp16 };
// "fp32", "bf16" or "fp16"; anything else throws std::invalid_argument.
compute_dtype parse_compute_dtype(const std::string& name);
const char* compute_dtype_name(compute_dtype dtype);

// How a GPU chunk computes causal attention (docs/gpu.md, recipe key kernels.attention):
//  - fused: one kernel per pass, fp32 arithmetic with an online softmax, only each row's
//    log-sum-exp kept for backward; head sizes 16, 32, 64 and 128.
//  - materialized: tensor-core GEMMs (cuBLASLt) around a fused causal softmax; each layer keeps
//    its [T, T] probabilities per head in the compute dtype for backward; any head size.
//  - cudnn: cuDNN's fused flash attention (tensor cores, loaded on first use), bf16 and fp16
//    only; like fused, only each row's log-sum-exp kept; head sizes up to 128, multiples of 8.
enum class attention_kernel { fused, materialized, cudnn };
// "fused", "materialized" or "cudnn"; anything else throws std::invalid_argument.
attention_kernel parse_attention_kernel(const std::string& name);
const char* attention_kernel_name(attention_kernel kernel);

struct gpu_trainer_options {
  compute_dtype dtype = compute_dtype::fp32;
  bool recompute = false;  // activation checkpointing: every block recomputed in backward
  attention_kernel attention = attention_kernel::fused;
  // The newer kernels of the rest of the step (kernels::cuda::context::set_fast_kernels:
  // 128-bit layernorm, one AdamW launch over the flat buffers), within rounding of the others.
  bool fast_kernels = false;
  // Slots keep what a split backward's W needs (a zero-bubble schedule): per layer the output
  // gradients of its four linears, and the embedding's. With recompute, W recomputes each
  // block's internals from its kept input, as backward does.
  bool split_backward = false;
  // false: no AdamW moments on the device (ZeRO: its shards hold them); adamw throws.
  bool optimizer_state = true;
  // A checkpoint's capture (the cuda rank chunks' device_chunk::begin_state_copy): into pinned
  // host memory on a stream of the chunk's own, overlapping its later work, the memory allocated
  // with the chunk; false: into pageable memory before the capture returns.
  bool pinned_state_copy = false;
  // ZeRO-3 through the devices' groups: the flat master weights and their 16-bit copy are
  // mapped by granule (release_parameters gives memory back), not one allocation each, where the
  // device has CUDA's virtual memory management (otherwise one allocation each, kept).
  bool paged_parameters = false;
};

struct recipe;
// The options of a recipe's GPU chunks: precision.dtype, activation_checkpoint.mode,
// kernels.attention and kernels.fast_paths (the recipe validated); split_backward is the
// pipeline's to set (its schedule's).
gpu_trainer_options gpu_options(const recipe& r);

// Device time of one family of ops (gpu_chunk::take_kernel_times).
struct kernel_time {
  std::string family;
  double ms = 0;
  int calls = 0;
};

// The device memory a chunk allocates (its arena; cuBLASLt's workspace and the token groups
// are not counted), computed on the host.
struct gpu_memory_plan {
  std::int64_t model_state = 0;  // fp32 master weights, gradients, AdamW m and v (+ 16-bit copy)
  std::int64_t activations = 0;  // what forward keeps for backward, and backward's scratch
  std::int64_t activations_without_recompute = 0;  // the same without checkpointing
  std::int64_t total() const { return model_state + activations; }
};
// tp: the tensor-parallel degree (one shard's chunk).
gpu_memory_plan plan_gpu_chunk_memory(const gpt_config& config, const chunk_range& range, int B,
                                      int T, const gpu_trainer_options& options, int slots,
                                      int tp = 1);
// The whole model as one chunk with one slot (gpu_trainer).
gpu_memory_plan plan_gpu_memory(const gpt_config& config, int B, int T,
                                const gpu_trainer_options& options);

// Whether a CUDA device can train here; otherwise, when why_not is given, the reason.
bool cuda_training_available(std::string* why_not = nullptr);
// Whether cuDNN's attention can be loaded here (kernels.attention = "auto" falls back to the
// materialized route where it cannot); otherwise, when why_not is given, the reason.
bool cudnn_attention_usable(std::string* why_not = nullptr);

// One tensor shard's handle on its group, for device chunks (docs/tensor_parallel.md):
// collectives on buffers of the member's device, ordered on the calling chunk's stream (a
// cudaStream_t): each starts after what the stream has enqueued so far, and what the stream
// enqueues next waits for its result. Every member calls the same collectives in the same order,
// and gets the same bits. A call returns once its work is enqueued; it may wait (on the host, up
// to the group's deadline) for the other members to call it too. After abort(), by any member,
// waiting and later calls throw std::runtime_error with the reason.
class device_tensor_group : public group_member {
 public:
  // n values of the compute dtype (activations and their gradients).
  virtual void all_reduce_sum(void* data, std::int64_t n, compute_dtype dtype, void* stream) = 0;
  // n fp32 values (the cross-entropy's statistics).
  virtual void all_reduce_sum(float* data, std::int64_t n, void* stream) = 0;
  virtual void all_reduce_max(float* data, std::int64_t n, void* stream) = 0;
  virtual std::string describe() const = 0;
};

// The members of the group `name` whose member i drives CUDA device devices[i]: an NCCL
// communicator rank each (non-blocking, on its own stream) when the devices are distinct; a
// kernel summing the members' buffers in place, in member order, after the members have met on
// the host, when they are all one device (NCCL refuses two ranks on one device). Throws
// std::runtime_error naming parallel.tp for a mix, or saying why without CUDA.
std::vector<std::shared_ptr<device_tensor_group>> make_device_tensor_group(
    const std::string& name, const std::vector<int>& devices,
    std::chrono::milliseconds deadline = std::chrono::seconds(120));
// This process's member `rank` (on CUDA device `device`) of the group `name` of `size` members
// whose others each live in a process of their own: a rank of an NCCL communicator joined with
// `id` (128 bytes, from the rendezvous), connected before it returns (every member's process
// joins at once; each waits up to `deadline`).
std::shared_ptr<device_tensor_group> join_process_tensor_group(
    const std::string& name, const std::vector<std::uint8_t>& id, int rank, int size, int device,
    std::chrono::milliseconds deadline = std::chrono::seconds(120));
// A device chunk's member of a host tensor group (one whose shards live in several processes:
// topology/tensor_exchange.hpp), for a chunk on CUDA device `device`. Each collective copies the
// buffer into pinned host memory after the chunk's work so far, reduces it there in fp32 in
// member order (the arithmetic of the one-device kernel, so the same bits), and copies the result
// back before the chunk's later work. abort() aborts the host group.
std::shared_ptr<device_tensor_group> make_staged_tensor_member(std::shared_ptr<tensor_group> host,
                                                               int device);

class gpu_chunk {
 public:
  // The chunk of `weights` (its range and parameters) for micro-batches of B sequences of T
  // tokens (T <= config.context), on CUDA device `device`, with `slots` micro-batches in flight
  // at most. Every call makes that device current for the calling thread. A tensor shard's
  // weights (weights.shard() split) need the shard's member of its group on this device.
  gpu_chunk(const gpt_chunk& weights, int B, int T, const gpu_trainer_options& options,
            int slots = 1, int device = 0, std::shared_ptr<device_tensor_group> group = nullptr);
  ~gpu_chunk();
  gpu_chunk(const gpu_chunk&) = delete;
  gpu_chunk& operator=(const gpu_chunk&) = delete;

  const gpt_config& config() const;
  const chunk_range& range() const;
  int slots() const;
  bool recomputes() const;  // options.recompute
  // One more slot, its buffers allocated now (cudaMalloc); returns the new count.
  int add_slot();
  // Bytes of one activation (or activation gradient) between chunks: B * T * width values
  // (a micro-batch of a shorter sequence length uses the front B * seq_len * width).
  std::size_t activation_bytes() const;

  // A chunk without the embedding: the device buffer that receives `slot`'s input activation
  // (a link writes it, on this stream or ordered before it by an event) before forward(slot).
  void* input(int slot);
  // Forward of one micro-batch into `slot` (in [0, slots)). tokens: host, B*T, for a chunk with
  // the embedding (checked against the vocabulary); targets: host, for a head chunk. A head
  // chunk returns the mean loss (unscaled) over the counted targets and, when `train`, leaves
  // the loss gradient seeded with loss_scale ready for backward; other chunks return NaN.
  // seq_len (0: the chunk's T) may be shorter than the chunk's T: the micro-batch's B x seq_len
  // tokens use the front of the slot's buffers, and backward follows its length.
  double forward(int slot, const std::int32_t* tokens, const std::int32_t* targets,
                 float loss_scale = 1.0f, bool train = true, int seq_len = 0);
  // A whole, unsharded model with B = 1 (sampling, `troupe sample --device cuda`): the forward
  // of one sequence of seq_len tokens (host, each < vocab_size) into `slot`, and the logits at
  // its last position, vocab_size values (the padded rows left out) copied to the host as fp32.
  // Throws std::logic_error for another chunk.
  std::vector<float> last_logits(int slot, const std::int32_t* tokens, int seq_len);
  // forward, backward, backward_input and backward_weight as passes (engine/model/block_pass.hpp)
  // that stop before each piece reading parameters (pass_stops(range(), kind, recomputes())):
  // ZeRO-3 gathers the piece's blocks first. Each piece runs with the chunk's device current. The
  // pass keeps its arguments; `loss` (forward's return value) and `dinput` (backward's) are written
  // when the pass is done and must stay valid until then.
  block_pass forward_pass(int slot, const std::int32_t* tokens, const std::int32_t* targets,
                          float loss_scale, bool train, int seq_len, double* loss);
  block_pass backward_pass(int slot, const void* doutput, grad_block_fn on_block_done,
                           const void** dinput);
  block_pass backward_input_pass(int slot, const void* doutput, const void** dinput);
  block_pass backward_weight_pass(int slot, grad_block_fn on_block_done);
  // A chunk without the embedding: where the gradient of input(slot) goes (input(slot) itself,
  // or, for a split backward, a buffer of its own: W reads the input after B).
  void* input_gradient(int slot);
  // A chunk without the head: slot's output activation (device), valid until slot's next forward.
  const void* output(int slot) const;
  // Backward of slot's micro-batch; its weight gradients accumulate. doutput: the gradient of
  // output(slot) (device; nullptr for a head chunk). Returns the gradient of input(slot)
  // (device, valid until the next backward) for a chunk without the embedding, else nullptr.
  // on_block_done(i) runs once block i of chunk_grad_blocks has its gradient enqueued.
  const void* backward(int slot, const void* doutput, const grad_block_fn& on_block_done = {});
  // A split backward (zero-bubble schedules; a chunk made with options.split_backward): B is
  // backward_input, the same input gradient as backward with the layernorms' weight gradients,
  // the linears' and the embedding's left to backward_weight (W), which makes the blocks final
  // in backward's order. Together bitwise backward's gradients.
  const void* backward_input(int slot, const void* doutput);
  void backward_weight(int slot, const grad_block_fn& on_block_done = {});
  // A chunk without the head: where a link may receive the gradient of output(slot), once
  // output(slot) has been sent: output(slot) itself. backward(slot, ...) reads the gradient
  // before anything writes that buffer again (a recomputed last block), and nothing else reads
  // a non-head chunk's output in backward.
  void* output_gradient(int slot);
  // Copies `bytes` between device buffers of this chunk, on its stream.
  void copy(void* destination, const void* source, std::size_t bytes);
  // Copies between this chunk's device memory and host memory, on its stream after what it has
  // enqueued, and waits for the copy: the host buffer holds the bytes (to_host), or may be
  // reused (from_host), when the call returns.
  void copy_to_host(void* host, const void* device, std::size_t bytes);
  void copy_from_host(void* device, const void* host, std::size_t bytes);

  void zero_grad();
  // Sum of squared gradients as held (still carrying the loss scale), in fp64. Without
  // count_tied_copy, a head chunk's copy of the tied wte is left out (the pipeline counts wte
  // once, on the embedding chunk).
  double grad_square_sum(bool count_tied_copy = true);
  // AdamW on every parameter with 1-based `step`; every gradient is multiplied by
  // grad_multiplier first (1 / loss scale, times the clipping coefficient).
  void adamw(const kernels::adamw_hparams& hp, int step, float grad_multiplier);

  // fp32 master weights and gradients on the device, in gpt_chunk's layout (parameter_count()
  // floats each), for collectives and the tied-weight exchange, on this stream's order.
  float* device_parameters();
  float* device_gradients();
  std::int64_t parameter_count() const;
  const std::vector<parameter_info>& layout() const;
  // Copies to the host (after synchronizing).
  std::vector<float> parameters() const;
  std::vector<float> gradients() const;
  // Gradients [at, at + n) of the layout, on the stream: own + values[i], or values[i]
  // (values: n floats on this chunk's device).
  void add_gradients(std::int64_t at, const float* values, std::int64_t n);
  void copy_gradients(std::int64_t at, const float* values, std::int64_t n);
  // n floats on the device kept to receive a peer's gradients into (the tied wte's other copy):
  // allocated at the first call (counted in device_bytes()), the same buffer after.
  float* gradient_scratch(std::int64_t n);
  // The master weights into a host chunk of the same range (to save them).
  void copy_parameters_to(gpt_chunk& host) const;
  // Master weights [at, at + n) of the layout from host floats, and the 16-bit copy of them,
  // on the stream after what it has enqueued; the host buffer may be reused on return.
  void load_parameters(std::int64_t at, const float* host, std::int64_t n);
  // The AdamW moments (m, v) copied to the host after what the stream has enqueued; loading
  // them from host floats (parameter_count() each). Throw without optimizer state.
  std::pair<std::vector<float>, std::vector<float>> moments() const;
  void load_moments(const float* m, const float* v);
  // A checkpoint's capture (device_chunk::begin_state_copy): the master weights and (with
  // moments) the AdamW moments copied into pinned host memory (allocated once: at construction
  // with gpu_trainer_options::pinned_state_copy, else at the first call; kept) on a stream of
  // the chunk's own, after what the chunk's stream has enqueued, while its later work runs. The
  // returned call waits for the copy (any thread, sleeping) and gives the pinned floats: the
  // master weights, then with moments m and v, parameter_count() each; they stay valid until the
  // next begin_state_copy. The chunk's AdamW must not run before the call returned.
  using state_view = std::function<const float*()>;
  state_view begin_state_copy(bool with_moments);
  // ZeRO through a zero_group (device_chunk::own and what follows it): the owned segments'
  // AdamW moments on the device (owned storage order, counted in optimizer_bytes()) and, with
  // `parameters` (ZeRO-3), their master weights; their squared gradients (counted segments, in
  // order, fp64), AdamW on them alone (1-based step; the working copy following, or the owned
  // master weights updated), and the working copy of [at, at + n) after a gather wrote the
  // master weights. put_owned_parameters: segments of the owned master weights into the flat
  // ones, on the stream. release / acquire_parameters: with paged_parameters, the granules of the
  // master weights and their 16-bit copy that no held range covers are unmapped once the stream
  // has passed the release, and mapped again when acquired (kernels::cuda::paged_buffer);
  // without, the span is checked and the memory stays.
  void own(std::vector<shard_segment> segments, bool parameters);
  double owned_square_sum(const std::vector<shard_segment>& segments);
  void adamw_owned(const kernels::adamw_hparams& hp, int step, float grad_multiplier);
  void parameters_changed(std::int64_t at, std::int64_t n);
  std::pair<std::vector<float>, std::vector<float>> owned_moments() const;
  void load_owned_moments(const float* m, const float* v);
  void put_owned_parameters(const std::vector<shard_segment>& segments);
  std::vector<float> owned_parameters() const;
  std::int64_t owned_parameter_bytes() const;
  void parameter_round();
  void release_parameters(std::int64_t at, std::int64_t n);
  void acquire_parameters(std::int64_t at, std::int64_t n);

  std::int64_t device_bytes() const;     // everything this chunk allocated on the device
  std::int64_t optimizer_bytes() const;  // of which AdamW moments (0 without optimizer_state)
  std::string device_name() const;
  void* stream() const;  // the cudaStream_t everything is enqueued on
  // A cudaEvent_t recorded now on the stream, after everything enqueued so far (for a link's
  // or a reducer's `ready`). It marks that point until 32 more calls, then a later one.
  void* record_event();
  // The stream waits for a cudaEvent_t (a link's) before what is enqueued next.
  void wait_event(void* event);
  void synchronize() const;  // waits for everything enqueued

  // While on, each op on the chunk's stream is bracketed by CUDA events (a few microseconds of
  // host time per op); take_kernel_times() returns the device time per op family since it was
  // last called (or timing turned on), after waiting for the stream. Collectives and copies are
  // not ops: their time is what a step has beyond the families' sum.
  void set_kernel_timing(bool on);
  std::vector<kernel_time> take_kernel_times();

  struct impl;

 private:
  block_pass on_device(block_pass inner);
  std::unique_ptr<impl> impl_;
};

}  // namespace troupe::engine
