// Device time per op family: CUDA event pairs around the ops of a context while timing is on.
// See cuda_ops.hpp (context::set_timing) and cuda_common.cuh (timed_op).
#include <cuda_runtime.h>

#include <array>
#include <utility>
#include <vector>

#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/cuda_ops.hpp"

namespace troupe::kernels::cuda {
using namespace detail;

// Event pairs reused from one take_timings() to the next; pairs[0, used) hold this period's.
struct op_timer {
  struct pair {
    op_family family = op_family::elementwise;
    cudaEvent_t start = nullptr, stop = nullptr;
  };
  std::vector<pair> pairs;
  std::size_t used = 0;
  op_timer() = default;
  op_timer(const op_timer&) = delete;
  op_timer& operator=(const op_timer&) = delete;
  ~op_timer() {
    for (auto& p : pairs) {
      cudaEventDestroy(p.start);
      cudaEventDestroy(p.stop);
    }
  }
};

const char* op_family_name(op_family family) {
  switch (family) {
    case op_family::attention_forward:
      return "attention forward";
    case op_family::attention_backward:
      return "attention backward";
    case op_family::linear_forward:
      return "linear forward (GEMM)";
    case op_family::linear_backward:
      return "linear backward (GEMM, bias)";
    case op_family::layernorm_forward:
      return "layernorm forward";
    case op_family::layernorm_backward:
      return "layernorm backward";
    case op_family::elementwise:
      return "GELU, residual, convert";
    case op_family::cross_entropy:
      return "softmax + cross-entropy";
    case op_family::embedding:
      return "embedding";
    case op_family::optimizer:
      return "AdamW, gradient norm";
  }
  return "?";
}

namespace detail {
timed_op::timed_op(const context& ctx, op_family family) : ctx_(ctx) {
  op_timer* t = ctx.timer_;
  if (!t) return;
  if (t->used == t->pairs.size()) {
    op_timer::pair p;
    check(cudaEventCreate(&p.start), "cudaEventCreate(timing)");
    if (const cudaError_t e = cudaEventCreate(&p.stop); e != cudaSuccess) {
      cudaEventDestroy(p.start);
      check(e, "cudaEventCreate(timing)");
    }
    t->pairs.push_back(p);
  }
  auto& p = t->pairs[t->used];
  p.family = family;
  check(cudaEventRecord(p.start, ctx.stream()), "cudaEventRecord(timing)");
  index_ = static_cast<int>(t->used++);
}

timed_op::~timed_op() {
  if (index_ >= 0 && ctx_.timer_)
    cudaEventRecord(ctx_.timer_->pairs[static_cast<std::size_t>(index_)].stop, ctx_.stream());
}
}  // namespace detail

void context::set_timing(bool on) {
  if (on && !timer_) timer_ = new op_timer;
  if (!on && timer_) {
    synchronize();
    delete std::exchange(timer_, nullptr);
  }
}

std::vector<op_family_time> context::take_timings() {
  std::vector<op_family_time> out;
  if (!timer_) return out;
  synchronize();
  std::array<op_family_time, kOpFamilies> sums{};
  for (int f = 0; f < kOpFamilies; ++f) sums[static_cast<std::size_t>(f)].family = op_family(f);
  for (std::size_t i = 0; i < timer_->used; ++i) {
    const auto& p = timer_->pairs[i];
    float ms = 0;
    check(cudaEventElapsedTime(&ms, p.start, p.stop), "cudaEventElapsedTime");
    auto& sum = sums[static_cast<std::size_t>(p.family)];
    sum.ms += ms;
    ++sum.calls;
  }
  timer_->used = 0;
  for (const auto& sum : sums)
    if (sum.calls > 0) out.push_back(sum);
  return out;
}

namespace detail {
void delete_op_timer(op_timer* timer) noexcept { delete timer; }
}  // namespace detail

}  // namespace troupe::kernels::cuda
