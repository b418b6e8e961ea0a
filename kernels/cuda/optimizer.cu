// AdamW and the gradients' sum of squares on the GPU. See cuda_ops.hpp.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/cuda_ops.hpp"

namespace troupe::kernels::cuda {
using namespace detail;
namespace {

// ---- AdamW: the CPU kernel's arithmetic ---------------------------------------------------------
struct adamw_coefficients {
  float step_size, bc2_sqrt, w1, beta2, w2, eps, keep, grad_scale;
};

template <class W>
__device__ __forceinline__ void adamw_element(float* param, const float* grad, float* m, float* v,
                                              std::int64_t i, const adamw_coefficients& c,
                                              float keep, W* copy) {
  // Every operation rounded on its own (no fused multiply-adds), as the CPU kernel computes, so
  // the per-tensor and the flat kernels give the same bits whatever nvcc contracts elsewhere.
  const float g = __fmul_rn(grad[i], c.grad_scale);
  const float p = __fmul_rn(param[i], keep);
  const float mi = __fadd_rn(m[i], __fmul_rn(c.w1, __fsub_rn(g, m[i])));
  const float vi = __fadd_rn(__fmul_rn(v[i], c.beta2), __fmul_rn(__fmul_rn(c.w2, g), g));
  const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(vi), c.bc2_sqrt), c.eps);
  const float out = __fsub_rn(p, __fmul_rn(c.step_size, __fdiv_rn(mi, denom)));
  param[i] = out;
  m[i] = mi;
  v[i] = vi;
  if (copy) copy[i] = from_f<W>(out);
}

template <class W>
__global__ void adamw_kernel(float* param, const float* grad, float* m, float* v, std::int64_t n,
                             adamw_coefficients c, W* copy) {
  const std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) adamw_element(param, grad, m, v, i, c, c.keep, copy);
}

// Every parameter of a flat buffer: element i's parameter is the last segment starting at or
// before i (starts[0, count] ascending, starts[count] = n); it decays (c.keep) or not (1).
template <class W>
__global__ void adamw_flat_kernel(float* param, const float* grad, float* m, float* v,
                                  const std::int64_t* starts, const std::uint8_t* decay, int count,
                                  adamw_coefficients c, W* copy) {
  const std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= starts[count]) return;
  int lo = 0, hi = count - 1;  // starts[lo] <= i < starts[hi + 1]
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (starts[mid] <= i) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  adamw_element(param, grad, m, v, i, c, decay[lo] ? c.keep : 1.0f, copy);
}

// ---- sum of squares: per-block partials in fp64, then the host in block order -------------------
__global__ void square_sum_kernel(double* partial, const float* x, std::int64_t n) {
  __shared__ double shared[kThreads];
  double s = 0;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x)
    s += static_cast<double>(x[i]) * x[i];
  shared[threadIdx.x] = s;
  __syncthreads();
  for (int stride = blockDim.x / 2; stride > 0; stride >>= 1) {
    if (static_cast<int>(threadIdx.x) < stride) shared[threadIdx.x] += shared[threadIdx.x + stride];
    __syncthreads();
  }
  if (threadIdx.x == 0) partial[blockIdx.x] = shared[0];
}

}  // namespace

namespace {
adamw_coefficients adamw_coefficients_for(const adamw_hparams& hp, int step, float grad_scale) {
  if (step < 1) throw std::invalid_argument("adamw_update: step is 1-based");
  const double bc1 = 1.0 - std::pow(double(hp.beta1), step);
  const double bc2 = 1.0 - std::pow(double(hp.beta2), step);
  adamw_coefficients c;
  c.step_size = static_cast<float>(static_cast<double>(hp.lr) / bc1);
  c.bc2_sqrt = static_cast<float>(std::sqrt(bc2));
  c.w1 = static_cast<float>(1.0 - double(hp.beta1));
  c.beta2 = hp.beta2;
  c.w2 = static_cast<float>(1.0 - double(hp.beta2));
  c.eps = hp.eps;
  // keep: the decayed parameters' factor.
  c.keep = hp.weight_decay != 0.0f
               ? static_cast<float>(1.0 - double(hp.lr) * double(hp.weight_decay))
               : 1.0f;
  c.grad_scale = grad_scale;
  return c;
}

template <class W>
void adamw_launch(const context& ctx, float* param, const float* grad, float* m, float* v,
                  std::int64_t n, const adamw_hparams& hp, int step, bool decay, float grad_scale,
                  W* param_copy) {
  const timed_op timing(ctx, op_family::optimizer);
  adamw_coefficients c = adamw_coefficients_for(hp, step, grad_scale);
  if (!decay) c.keep = 1.0f;
  if (n <= 0) return;
  adamw_kernel<W>
      <<<blocks_for(n), kThreads, 0, ctx.stream()>>>(param, grad, m, v, n, c, param_copy);
  check_launch("adamw_kernel");
}

template <class W>
void adamw_flat_launch(const context& ctx, float* param, const float* grad, float* m, float* v,
                       const adamw_segments& segments, const adamw_hparams& hp, int step,
                       float grad_scale, W* param_copy) {
  const timed_op timing(ctx, op_family::optimizer);
  const adamw_coefficients c = adamw_coefficients_for(hp, step, grad_scale);
  if (segments.total() <= 0) return;
  adamw_flat_kernel<W><<<blocks_for(segments.total()), kThreads, 0, ctx.stream()>>>(
      param, grad, m, v, segments.starts(), segments.decay(), segments.count(), c, param_copy);
  check_launch("adamw_flat_kernel");
}
}  // namespace

void adamw_update(const context& ctx, float* param, const float* grad, float* m, float* v,
                  std::int64_t n, const adamw_hparams& hp, int step, bool decay, float grad_scale,
                  bf16* param_copy) {
  adamw_launch(ctx, param, grad, m, v, n, hp, step, decay, grad_scale, param_copy);
}
void adamw_update(const context& ctx, float* param, const float* grad, float* m, float* v,
                  std::int64_t n, const adamw_hparams& hp, int step, bool decay, float grad_scale,
                  fp16* param_copy) {
  adamw_launch(ctx, param, grad, m, v, n, hp, step, decay, grad_scale, param_copy);
}
void adamw_update_flat(const context& ctx, float* param, const float* grad, float* m, float* v,
                       const adamw_segments& segments, const adamw_hparams& hp, int step,
                       float grad_scale, bf16* param_copy) {
  adamw_flat_launch(ctx, param, grad, m, v, segments, hp, step, grad_scale, param_copy);
}
void adamw_update_flat(const context& ctx, float* param, const float* grad, float* m, float* v,
                       const adamw_segments& segments, const adamw_hparams& hp, int step,
                       float grad_scale, fp16* param_copy) {
  adamw_flat_launch(ctx, param, grad, m, v, segments, hp, step, grad_scale, param_copy);
}

adamw_segments::~adamw_segments() {
  if (device_) cudaFree(device_);
}

void adamw_segments::upload(const context& ctx, const std::vector<segment>& segments) {
  std::int64_t at = 0;
  for (const auto& s : segments) {
    if (s.offset != at || s.numel < 0)
      throw std::invalid_argument("adamw_segments: a segment at " + std::to_string(s.offset) +
                                  " of " + std::to_string(s.numel) + " values; expected one at " +
                                  std::to_string(at));
    at += s.numel;
  }
  // [starts: count + 1 int64][decay: count bytes], built apart and taken only once on the
  // device: a failure leaves the table as it was.
  const std::size_t bytes = (segments.size() + 1) * sizeof(std::int64_t) + segments.size();
  std::vector<unsigned char> host(bytes, 0);
  auto* starts = reinterpret_cast<std::int64_t*>(host.data());
  auto* decay = host.data() + (segments.size() + 1) * sizeof(std::int64_t);
  for (std::size_t i = 0; i < segments.size(); ++i) {
    starts[i] = segments[i].offset;
    decay[i] = segments[i].decay ? 1 : 0;
  }
  starts[segments.size()] = at;
  void* device = nullptr;
  check(cudaMalloc(&device, bytes), "cudaMalloc(adamw_segments)");
  if (const cudaError_t e =
          cudaMemcpyAsync(device, host.data(), bytes, cudaMemcpyHostToDevice, ctx.stream());
      e != cudaSuccess) {
    cudaFree(device);
    check(e, "cudaMemcpyAsync(adamw_segments)");
  }
  if (device_) cudaFree(device_);  // waits for the launches that read it
  device_ = device;
  host_ = std::move(host);  // kept until the asynchronous copy has read it
  count_ = static_cast<int>(segments.size());
  total_ = at;
}

const std::int64_t* adamw_segments::starts() const {
  return static_cast<const std::int64_t*>(device_);
}
const std::uint8_t* adamw_segments::decay() const {
  return static_cast<const std::uint8_t*>(device_) +
         (static_cast<std::size_t>(count_) + 1) * sizeof(std::int64_t);
}

std::vector<double> square_sums(const context& ctx,
                                const std::vector<std::pair<const float*, std::int64_t>>& spans) {
  const timed_op timing(ctx, op_family::optimizer);
  // Each span's partials (square_sum's block count) one after the other in one buffer.
  std::vector<std::size_t> first(spans.size() + 1, 0);
  for (std::size_t i = 0; i < spans.size(); ++i) {
    const std::int64_t n = spans[i].second;
    first[i + 1] = first[i] + (n > 0 ? std::min<std::int64_t>(blocks_for(n), 1024) : 0);
  }
  std::vector<double> out(spans.size(), 0.0);
  if (first.back() == 0) return out;
  double* partial = nullptr;
  check(cudaMallocAsync(reinterpret_cast<void**>(&partial), first.back() * sizeof(double),
                        ctx.stream()),
        "cudaMallocAsync(square_sums)");
  for (std::size_t i = 0; i < spans.size(); ++i) {
    const auto blocks = static_cast<unsigned>(first[i + 1] - first[i]);
    if (blocks == 0) continue;
    square_sum_kernel<<<blocks, kThreads, 0, ctx.stream()>>>(partial + first[i], spans[i].first,
                                                             spans[i].second);
    check_launch("square_sum_kernel");
  }
  std::vector<double> host(first.back());
  check(cudaMemcpyAsync(host.data(), partial, host.size() * sizeof(double), cudaMemcpyDeviceToHost,
                        ctx.stream()),
        "cudaMemcpyAsync(square_sums)");
  check(cudaFreeAsync(partial, ctx.stream()), "cudaFreeAsync(square_sums)");
  ctx.synchronize();
  for (std::size_t i = 0; i < spans.size(); ++i)
    for (std::size_t b = first[i]; b < first[i + 1]; ++b) out[i] += host[b];
  return out;
}

double square_sum(const context& ctx, const float* x, std::int64_t n) {
  const timed_op timing(ctx, op_family::optimizer);
  const unsigned blocks = static_cast<unsigned>(std::min<std::int64_t>(blocks_for(n), 1024));
  if (n <= 0) return 0;
  double* partial = nullptr;
  check(cudaMallocAsync(reinterpret_cast<void**>(&partial), blocks * sizeof(double), ctx.stream()),
        "cudaMallocAsync(square_sum)");
  square_sum_kernel<<<blocks, kThreads, 0, ctx.stream()>>>(partial, x, n);
  check_launch("square_sum_kernel");
  std::vector<double> host(blocks);
  check(cudaMemcpyAsync(host.data(), partial, blocks * sizeof(double), cudaMemcpyDeviceToHost,
                        ctx.stream()),
        "cudaMemcpyAsync(square_sum)");
  check(cudaFreeAsync(partial, ctx.stream()), "cudaFreeAsync(square_sum)");
  ctx.synchronize();
  double s = 0;
  for (double p : host) s += p;
  return s;
}

}  // namespace troupe::kernels::cuda
