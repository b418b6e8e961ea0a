// gpu_chunk in a build without CUDA (-Dwith_cuda=disabled, or no nvcc): constructing one says
// so; nothing else can be reached.
#include <stdexcept>

#include "engine/chunks/device_chunk.hpp"
#include "engine/chunks/gpu_chunk.hpp"

namespace troupe::engine {

bool cuda_training_available(std::string* why_not) {
  if (why_not) *why_not = "this build has no CUDA (nvcc was not found, or -Dwith_cuda=disabled)";
  return false;
}

bool cudnn_attention_usable(std::string* why_not) {
  if (why_not) *why_not = "this build has no CUDA";
  return false;
}

struct gpu_chunk::impl {
  gpt_config config;
  chunk_range range;
  std::vector<parameter_info> layout;
};

chunk_factory cuda_chunks(const gpu_trainer_options&, int, int, int) {
  std::string why;
  cuda_training_available(&why);
  throw std::runtime_error("--device cuda: " + why);
}

std::vector<std::shared_ptr<device_tensor_group>> make_device_tensor_group(
    const std::string&, const std::vector<int>&, std::chrono::milliseconds) {
  std::string why;
  cuda_training_available(&why);
  throw std::runtime_error("--device cuda: " + why);
}

std::shared_ptr<device_tensor_group> join_process_tensor_group(const std::string&,
                                                               const std::vector<std::uint8_t>&,
                                                               int, int, int,
                                                               std::chrono::milliseconds) {
  std::string why;
  cuda_training_available(&why);
  throw std::runtime_error("--device cuda: " + why);
}

std::shared_ptr<device_tensor_group> make_staged_tensor_member(std::shared_ptr<tensor_group>, int) {
  std::string why;
  cuda_training_available(&why);
  throw std::runtime_error("--device cuda: " + why);
}

gpu_chunk::gpu_chunk(const gpt_chunk&, int, int, const gpu_trainer_options&, int, int,
                     std::shared_ptr<device_tensor_group>) {
  std::string why;
  cuda_training_available(&why);
  throw std::runtime_error("--device cuda: " + why);
}
gpu_chunk::~gpu_chunk() = default;
// Unreachable: no gpu_chunk exists in this build.
const gpt_config& gpu_chunk::config() const { return impl_->config; }
const chunk_range& gpu_chunk::range() const { return impl_->range; }
int gpu_chunk::add_slot() { return 0; }
int gpu_chunk::slots() const { return 0; }
bool gpu_chunk::recomputes() const { return false; }
std::size_t gpu_chunk::activation_bytes() const { return 0; }
void* gpu_chunk::input(int) { return nullptr; }
void* gpu_chunk::input_gradient(int) { return nullptr; }
double gpu_chunk::forward(int, const std::int32_t*, const std::int32_t*, float, bool, int) {
  return 0;
}
std::vector<float> gpu_chunk::last_logits(int, const std::int32_t*, int) { return {}; }
block_pass gpu_chunk::forward_pass(int, const std::int32_t*, const std::int32_t*, float, bool, int,
                                   double*) {
  return {};
}
block_pass gpu_chunk::backward_pass(int, const void*, grad_block_fn, const void**) { return {}; }
block_pass gpu_chunk::backward_input_pass(int, const void*, const void**) { return {}; }
block_pass gpu_chunk::backward_weight_pass(int, grad_block_fn) { return {}; }
block_pass gpu_chunk::on_device(block_pass inner) { return inner; }
const void* gpu_chunk::output(int) const { return nullptr; }
const void* gpu_chunk::backward(int, const void*, const grad_block_fn&) { return nullptr; }
const void* gpu_chunk::backward_input(int, const void*) { return nullptr; }
void gpu_chunk::backward_weight(int, const grad_block_fn&) {}
void* gpu_chunk::output_gradient(int) { return nullptr; }
void gpu_chunk::copy(void*, const void*, std::size_t) {}
void gpu_chunk::copy_to_host(void*, const void*, std::size_t) {}
void gpu_chunk::copy_from_host(void*, const void*, std::size_t) {}
void gpu_chunk::add_gradients(std::int64_t, const float*, std::int64_t) {}
void gpu_chunk::copy_gradients(std::int64_t, const float*, std::int64_t) {}
float* gpu_chunk::gradient_scratch(std::int64_t) { return nullptr; }
void gpu_chunk::zero_grad() {}
double gpu_chunk::grad_square_sum(bool) { return 0; }
void gpu_chunk::adamw(const kernels::adamw_hparams&, int, float) {}
float* gpu_chunk::device_parameters() { return nullptr; }
float* gpu_chunk::device_gradients() { return nullptr; }
std::int64_t gpu_chunk::parameter_count() const { return 0; }
const std::vector<parameter_info>& gpu_chunk::layout() const { return impl_->layout; }
std::vector<float> gpu_chunk::parameters() const { return {}; }
std::vector<float> gpu_chunk::gradients() const { return {}; }
void gpu_chunk::copy_parameters_to(gpt_chunk&) const {}
void gpu_chunk::load_parameters(std::int64_t, const float*, std::int64_t) {}
std::pair<std::vector<float>, std::vector<float>> gpu_chunk::moments() const { return {}; }
void gpu_chunk::load_moments(const float*, const float*) {}
gpu_chunk::state_view gpu_chunk::begin_state_copy(bool) { return {}; }
void gpu_chunk::own(std::vector<shard_segment>, bool) {}
double gpu_chunk::owned_square_sum(const std::vector<shard_segment>&) { return 0; }
void gpu_chunk::adamw_owned(const kernels::adamw_hparams&, int, float) {}
void gpu_chunk::parameters_changed(std::int64_t, std::int64_t) {}
std::pair<std::vector<float>, std::vector<float>> gpu_chunk::owned_moments() const { return {}; }
void gpu_chunk::load_owned_moments(const float*, const float*) {}
void gpu_chunk::put_owned_parameters(const std::vector<shard_segment>&) {}
std::vector<float> gpu_chunk::owned_parameters() const { return {}; }
std::int64_t gpu_chunk::owned_parameter_bytes() const { return 0; }
void gpu_chunk::parameter_round() {}
void gpu_chunk::release_parameters(std::int64_t, std::int64_t) {}
void gpu_chunk::acquire_parameters(std::int64_t, std::int64_t) {}
std::int64_t gpu_chunk::device_bytes() const { return 0; }
std::int64_t gpu_chunk::optimizer_bytes() const { return 0; }
std::string gpu_chunk::device_name() const { return {}; }
void* gpu_chunk::stream() const { return nullptr; }
void* gpu_chunk::record_event() { return nullptr; }
void gpu_chunk::wait_event(void*) {}
void gpu_chunk::synchronize() const {}
void gpu_chunk::set_kernel_timing(bool) {}
std::vector<kernel_time> gpu_chunk::take_kernel_times() { return {}; }

}  // namespace troupe::engine
