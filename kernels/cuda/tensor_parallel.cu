// The GPU ops of tensor parallelism: the vocabulary-parallel embedding and cross-entropy, and the
// in-place sums and maxima of one device's group members. See cuda_ops.hpp.
#include <cuda_runtime.h>

#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/cuda_ops.hpp"

namespace troupe::kernels::cuda {
using namespace detail;
namespace {

template <class T>
__global__ void embedding_rows_kernel(T* out, const std::int32_t* tokens, const T* wte,
                                      int first_row, int rows, int C, std::int64_t total) {
  const std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= total) return;
  const std::int64_t n = i / C;
  const int c = static_cast<int>(i % C);
  const int row = tokens[n] - first_row;
  out[i] = row >= 0 && row < rows ? wte[static_cast<std::int64_t>(row) * C + c] : from_f<T>(0.0f);
}

template <class T>
__global__ void add_positions_kernel(T* out, const T* wpe, int Tn, int C, std::int64_t total) {
  const std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= total) return;
  const std::int64_t n = i / C;
  const int c = static_cast<int>(i % C), t = static_cast<int>(n % Tn);
  out[i] = from_f<T>(to_f(out[i]) + to_f(wpe[static_cast<std::int64_t>(t) * C + c]));
}

// The shard's real columns: [0, real) of its cols (the rest is the padded vocabulary).
__host__ __device__ inline int real_columns(const vocab_shard& v) {
  const int r = v.V - v.first;
  return r < 0 ? 0 : (r < v.cols ? r : v.cols);
}

// One block per row.
template <class T>
__global__ void vocab_max_kernel(float* row_max, const T* logits, vocab_shard v) {
  __shared__ float shared[32];
  const std::int64_t row = blockIdx.x;
  const T* x = logits + row * v.cols;
  const int real = real_columns(v);
  float mx = -INFINITY;
  for (int j = threadIdx.x; j < real; j += blockDim.x) mx = fmaxf(mx, to_f(x[j]));
  mx = block_reduce(mx, true, shared);
  if (threadIdx.x == 0) row_max[row] = mx;
}

template <class T>
__global__ void vocab_stats_kernel(float* stats, const T* logits, const std::int32_t* targets,
                                   const float* row_max, vocab_shard v, int ignore_index) {
  __shared__ float shared[32];
  const std::int64_t row = blockIdx.x;
  const T* x = logits + row * v.cols;
  const int real = real_columns(v);
  const float mx = row_max[row];
  float sum = 0;
  for (int j = threadIdx.x; j < real; j += blockDim.x) sum += expf(to_f(x[j]) - mx);
  sum = block_reduce(sum, false, shared);
  if (threadIdx.x == 0) {
    const int t = targets[row] - v.first;
    const bool here = targets[row] != ignore_index && t >= 0 && t < real;
    stats[2 * row] = sum;
    stats[2 * row + 1] = here ? to_f(x[t]) : 0.0f;
  }
}

template <class T>
__global__ void vocab_loss_kernel(T* dlogits, const T* logits, const std::int32_t* targets,
                                  const float* row_max, const float* stats, float* losses,
                                  vocab_shard v, int ignore_index, float scale) {
  const std::int64_t row = blockIdx.x;
  const bool counted = targets[row] != ignore_index;
  const float mx = row_max[row], sum = stats[2 * row];
  if (threadIdx.x == 0) losses[row] = counted ? mx + logf(sum) - stats[2 * row + 1] : 0.0f;
  if (!dlogits) return;
  const T* x = logits + row * v.cols;
  T* dx = dlogits + row * v.cols;
  const int real = real_columns(v), t = targets[row] - v.first;
  for (int j = threadIdx.x; j < v.cols; j += blockDim.x) {
    float g = 0;
    if (counted && j < real) g = (expf(to_f(x[j]) - mx) / sum - (j == t ? 1.0f : 0.0f)) * scale;
    dx[j] = from_f<T>(g);  // each element read, then written, by the same thread
  }
}

template <class T>
struct member_pointers {
  T* p[kMaxLocalReplicas];
};

template <class T, bool MAX>
__global__ void local_reduce_kernel(member_pointers<T> copies, int k, std::int64_t n) {
  const std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  float r = to_f(copies.p[0][i]);
  for (int d = 1; d < k; ++d) r = MAX ? fmaxf(r, to_f(copies.p[d][i])) : r + to_f(copies.p[d][i]);
  const T out = from_f<T>(r);
  for (int d = 0; d < k; ++d) copies.p[d][i] = out;
}

template <class T, bool MAX>
void local_reduce(cudaStream_t stream, T* const* copies, int k, std::int64_t n, const char* what) {
  if (k < 1 || k > kMaxLocalReplicas)
    throw std::invalid_argument(std::string(what) + ": " + std::to_string(k) + " members (1 to " +
                                std::to_string(kMaxLocalReplicas) + ")");
  if (n <= 0 || k == 1) return;
  member_pointers<T> m{};
  for (int d = 0; d < k; ++d) m.p[d] = copies[d];
  local_reduce_kernel<T, MAX><<<blocks_for(n), kThreads, 0, stream>>>(m, k, n);
  check_launch("local_reduce_kernel");
}

}  // namespace

template <class T>
void embedding_rows_forward(const context& ctx, T* out, const std::int32_t* tokens, const T* wte,
                            int first_row, int rows, std::int64_t N, int C) {
  const timed_op timing(ctx, op_family::embedding);
  const std::int64_t total = N * C;
  if (total <= 0) return;
  embedding_rows_kernel<T><<<blocks_for(total), kThreads, 0, ctx.stream()>>>(
      out, tokens, wte, first_row, rows, C, total);
  check_launch("embedding_rows_kernel");
}

template <class T>
void add_positions(const context& ctx, T* out, const T* wpe, int B, int Tn, int C) {
  const timed_op timing(ctx, op_family::embedding);
  const std::int64_t total = std::int64_t{B} * Tn * C;
  if (total <= 0) return;
  add_positions_kernel<T><<<blocks_for(total), kThreads, 0, ctx.stream()>>>(out, wpe, Tn, C, total);
  check_launch("add_positions_kernel");
}

template <class T>
void vocab_shard_max(const context& ctx, float* row_max, const T* logits, int N,
                     const vocab_shard& v) {
  const timed_op timing(ctx, op_family::cross_entropy);
  if (N <= 0) return;
  vocab_max_kernel<T><<<static_cast<unsigned>(N), 1024, 0, ctx.stream()>>>(row_max, logits, v);
  check_launch("vocab_max_kernel");
}

template <class T>
void vocab_shard_stats(const context& ctx, float* stats, const T* logits,
                       const std::int32_t* targets, const float* row_max, int N,
                       const vocab_shard& v, int ignore_index) {
  const timed_op timing(ctx, op_family::cross_entropy);
  if (N <= 0) return;
  vocab_stats_kernel<T><<<static_cast<unsigned>(N), 1024, 0, ctx.stream()>>>(
      stats, logits, targets, row_max, v, ignore_index);
  check_launch("vocab_stats_kernel");
}

template <class T>
cross_entropy_result vocab_parallel_cross_entropy_backward(
    const context& ctx, T* dlogits, const T* logits, const std::int32_t* targets,
    const float* row_max, const float* stats, float* losses, int N, const vocab_shard& v,
    int ignore_index, std::int64_t count, float grad_scale) {
  const timed_op timing(ctx, op_family::cross_entropy);
  cross_entropy_result r;
  r.count = count;
  if (N <= 0) return r;
  const float scale = count > 0 ? grad_scale / static_cast<float>(count) : 0.0f;
  vocab_loss_kernel<T><<<static_cast<unsigned>(N), 1024, 0, ctx.stream()>>>(
      dlogits, logits, targets, row_max, stats, losses, v, ignore_index, scale);
  check_launch("vocab_loss_kernel");
  r.loss_sum = host_row_sum(ctx, losses, N);
  return r;
}

template <class T>
void local_sum(cudaStream_t stream, T* const* copies, int k, std::int64_t n) {
  local_reduce<T, false>(stream, copies, k, n, "local_sum");
}
void local_max(cudaStream_t stream, float* const* copies, int k, std::int64_t n) {
  local_reduce<float, true>(stream, copies, k, n, "local_max");
}

#define TROUPE_INSTANTIATE(T)                                                                     \
  template void embedding_rows_forward<T>(const context&, T*, const std::int32_t*, const T*, int, \
                                          int, std::int64_t, int);                                \
  template void add_positions<T>(const context&, T*, const T*, int, int, int);                    \
  template void vocab_shard_max<T>(const context&, float*, const T*, int, const vocab_shard&);    \
  template void vocab_shard_stats<T>(const context&, float*, const T*, const std::int32_t*,       \
                                     const float*, int, const vocab_shard&, int);                 \
  template cross_entropy_result vocab_parallel_cross_entropy_backward<T>(                         \
      const context&, T*, const T*, const std::int32_t*, const float*, const float*, float*, int, \
      const vocab_shard&, int, std::int64_t, float);                                              \
  template void local_sum<T>(cudaStream_t, T* const*, int, std::int64_t);
TROUPE_INSTANTIATE(float)
TROUPE_INSTANTIATE(bf16)
TROUPE_INSTANTIATE(fp16)
#undef TROUPE_INSTANTIATE

}  // namespace troupe::kernels::cuda
