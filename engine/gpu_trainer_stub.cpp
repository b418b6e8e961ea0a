// gpu_trainer in a build without CUDA (-Dwith_cuda=disabled, or no nvcc): it says so.
#include <stdexcept>

#include "engine/gpu_trainer.hpp"

namespace troupe::engine {

bool cuda_training_available(std::string* why_not) {
  if (why_not) *why_not = "this build has no CUDA (nvcc was not found, or -Dwith_cuda=disabled)";
  return false;
}

struct gpu_trainer::impl {};

namespace {
[[noreturn]] void no_cuda() {
  std::string why;
  cuda_training_available(&why);
  throw std::runtime_error("--device cuda: " + why);
}
}  // namespace

gpu_trainer::gpu_trainer(const gpt_config&, int, int, compute_dtype, std::uint64_t) { no_cuda(); }
gpu_trainer::gpu_trainer(const gpt_stage&, int, int, const gpu_trainer_options&) { no_cuda(); }
double gpu_trainer::evaluate(const std::int32_t*, const std::int32_t*) { return 0; }
void gpu_trainer::copy_parameters_to(gpt_stage&) const {}
gpu_trainer::~gpu_trainer() = default;
double gpu_trainer::forward_backward(const std::int32_t*, const std::int32_t*, float) { return 0; }
void gpu_trainer::zero_grad() {}
double gpu_trainer::grad_square_sum() { return 0; }
double gpu_trainer::update(const optimizer_config&, int, int, double) { return 0; }
gpu_trainer::step_result gpu_trainer::train_step(const std::int32_t*, const std::int32_t*,
                                                 const optimizer_config&, int, int) {
  return {};
}
std::vector<float> gpu_trainer::parameters() const { return {}; }
std::vector<float> gpu_trainer::gradients() const { return {}; }
const std::vector<parameter_info>& gpu_trainer::layout() const {
  static const std::vector<parameter_info> none;
  return none;
}
std::int64_t gpu_trainer::device_bytes() const { return 0; }
std::string gpu_trainer::device_name() const { return {}; }
void gpu_trainer::synchronize() const {}

}  // namespace troupe::engine
