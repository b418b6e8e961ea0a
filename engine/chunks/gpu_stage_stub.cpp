// gpu_stage in a build without CUDA (-Dwith_cuda=disabled, or no nvcc): constructing one says
// so; nothing else can be reached.
#include <stdexcept>

#include "engine/chunks/device_chunk.hpp"
#include "engine/chunks/gpu_stage.hpp"

namespace troupe::engine {

bool cuda_training_available(std::string* why_not) {
  if (why_not) *why_not = "this build has no CUDA (nvcc was not found, or -Dwith_cuda=disabled)";
  return false;
}

bool cudnn_attention_usable(std::string* why_not) {
  if (why_not) *why_not = "this build has no CUDA";
  return false;
}

struct gpu_stage::impl {
  gpt_config config;
  stage_range range;
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

gpu_stage::gpu_stage(const gpt_stage&, int, int, const gpu_trainer_options&, int, int,
                     std::shared_ptr<device_tensor_group>) {
  std::string why;
  cuda_training_available(&why);
  throw std::runtime_error("--device cuda: " + why);
}
gpu_stage::~gpu_stage() = default;
// Unreachable: no gpu_stage exists in this build.
const gpt_config& gpu_stage::config() const { return impl_->config; }
const stage_range& gpu_stage::range() const { return impl_->range; }
int gpu_stage::add_slot() { return 0; }
int gpu_stage::slots() const { return 0; }
bool gpu_stage::recomputes() const { return false; }
std::size_t gpu_stage::activation_bytes() const { return 0; }
void* gpu_stage::input(int) { return nullptr; }
void* gpu_stage::input_gradient(int) { return nullptr; }
double gpu_stage::forward(int, const std::int32_t*, const std::int32_t*, float, bool, int) {
  return 0;
}
std::vector<float> gpu_stage::last_logits(int, const std::int32_t*, int) { return {}; }
block_pass gpu_stage::forward_pass(int, const std::int32_t*, const std::int32_t*, float, bool, int,
                                   double*) {
  return {};
}
block_pass gpu_stage::backward_pass(int, const void*, grad_block_fn, const void**) { return {}; }
block_pass gpu_stage::backward_input_pass(int, const void*, const void**) { return {}; }
block_pass gpu_stage::backward_weight_pass(int, grad_block_fn) { return {}; }
block_pass gpu_stage::on_device(block_pass inner) { return inner; }
const void* gpu_stage::output(int) const { return nullptr; }
const void* gpu_stage::backward(int, const void*, const grad_block_fn&) { return nullptr; }
const void* gpu_stage::backward_input(int, const void*) { return nullptr; }
void gpu_stage::backward_weight(int, const grad_block_fn&) {}
void* gpu_stage::output_gradient(int) { return nullptr; }
void gpu_stage::copy(void*, const void*, std::size_t) {}
void gpu_stage::copy_to_host(void*, const void*, std::size_t) {}
void gpu_stage::copy_from_host(void*, const void*, std::size_t) {}
void gpu_stage::add_gradients(std::int64_t, const float*, std::int64_t) {}
void gpu_stage::copy_gradients(std::int64_t, const float*, std::int64_t) {}
float* gpu_stage::gradient_scratch(std::int64_t) { return nullptr; }
void gpu_stage::zero_grad() {}
double gpu_stage::grad_square_sum(bool) { return 0; }
void gpu_stage::adamw(const kernels::adamw_hparams&, int, float) {}
float* gpu_stage::device_parameters() { return nullptr; }
float* gpu_stage::device_gradients() { return nullptr; }
std::int64_t gpu_stage::parameter_count() const { return 0; }
const std::vector<parameter_info>& gpu_stage::layout() const { return impl_->layout; }
std::vector<float> gpu_stage::parameters() const { return {}; }
std::vector<float> gpu_stage::gradients() const { return {}; }
void gpu_stage::copy_parameters_to(gpt_stage&) const {}
void gpu_stage::load_parameters(std::int64_t, const float*, std::int64_t) {}
std::pair<std::vector<float>, std::vector<float>> gpu_stage::moments() const { return {}; }
void gpu_stage::load_moments(const float*, const float*) {}
std::int64_t gpu_stage::device_bytes() const { return 0; }
std::int64_t gpu_stage::optimizer_bytes() const { return 0; }
std::string gpu_stage::device_name() const { return {}; }
void* gpu_stage::stream() const { return nullptr; }
void* gpu_stage::record_event() { return nullptr; }
void gpu_stage::wait_event(void*) {}
void gpu_stage::synchronize() const {}
void gpu_stage::set_kernel_timing(bool) {}
std::vector<kernel_time> gpu_stage::take_kernel_times() { return {}; }

}  // namespace troupe::engine
