// Device helpers shared by the CUDA op files (kernels/cuda/*.cu): error checks, dtype
// conversion, warp reductions, launch sizes. Included only by .cu files.
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "kernels/cuda/cuda_ops.hpp"

namespace troupe::kernels::cuda::detail {

inline void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw cuda_error(std::string(what) + ": " + cudaGetErrorString(e));
}
inline void check_launch(const char* kernel) { check(cudaGetLastError(), kernel); }

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(bf16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_f(fp16 x) { return __half2float(x); }
template <class T>
__device__ __forceinline__ T from_f(float x);
template <>
__device__ __forceinline__ float from_f<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ bf16 from_f<bf16>(float x) {
  return __float2bfloat16(x);
}
template <>
__device__ __forceinline__ fp16 from_f<fp16>(float x) {
  return __float2half(x);
}

// 16 bytes of T, loaded and stored whole (128-bit accesses: the fast kernels).
template <class T>
struct alignas(16) pack {
  static constexpr int n = 16 / static_cast<int>(sizeof(T));
  T v[n];
};
template <class T>
__device__ __forceinline__ pack<T> load_pack(const T* p) {
  pack<T> r;
  *reinterpret_cast<uint4*>(r.v) = *reinterpret_cast<const uint4*>(p);
  return r;
}
template <class T>
__device__ __forceinline__ void store_pack(T* p, const pack<T>& r) {
  *reinterpret_cast<uint4*>(p) = *reinterpret_cast<const uint4*>(r.v);
}

inline bool aligned16(const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 16 == 0; }

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// The sum of n per-row values of the device (a cross-entropy's losses), in fp64 on the host in
// row order, after everything enqueued on ctx's stream.
inline double host_row_sum(const context& ctx, const float* values, int n) {
  std::vector<float> host(static_cast<std::size_t>(n));
  check(cudaMemcpyAsync(host.data(), values, host.size() * sizeof(float), cudaMemcpyDeviceToHost,
                        ctx.stream()),
        "cudaMemcpyAsync(losses)");
  ctx.synchronize();
  double sum = 0;
  for (float v : host) sum += v;
  return sum;
}

// The sum (or max) of v over the block, on every thread; blockDim.x a multiple of 32, shared
// at least 32 floats.
__device__ inline float block_reduce(float v, bool is_max, float* shared) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  v = is_max ? warp_max(v) : warp_sum(v);
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  float r = lane < warps ? shared[lane] : (is_max ? -INFINITY : 0.0f);
  r = is_max ? warp_max(r) : warp_sum(r);
  __syncthreads();
  return r;
}

// A column-major GEMM through cuBLASLt (cuda_ops.cu): D[m,n] = alpha op(A)[m,k] op(B)[k,n] +
// beta D, op transposing where trans_a / trans_b, fp32 accumulation; with batch > 1, `batch`
// products, the i-th at a + i * stride_a, b + i * stride_b, d + i * stride_d. Plans are cached
// per shape on the context; a product repeats bitwise.
struct gemm_shape {
  bool trans_a = false, trans_b = false;
  int m = 0, n = 0, k = 0;
  int lda = 0, ldb = 0, ldd = 0;
  float alpha = 1.0f, beta = 0.0f;
  int batch = 1;
  std::int64_t stride_a = 0, stride_b = 0, stride_d = 0;
};
template <class TA, class TD>
void gemm(const context& ctx, const gemm_shape& shape, const TA* a, const TA* b, TD* d);

// Frees a context's timer (op_timing.cu, where op_timer is defined).
void delete_op_timer(op_timer* timer) noexcept;
// Frees a context's cuDNN handle, plans and workspace (attention_cudnn.cu).
void delete_cudnn_state(cudnn_state* state) noexcept;

// Brackets one op with the context's timing events while timing is on (context::set_timing);
// nothing otherwise. Declared first thing in each public op.
class timed_op {
 public:
  timed_op(const context& ctx, op_family family);
  ~timed_op();
  timed_op(const timed_op&) = delete;
  timed_op& operator=(const timed_op&) = delete;

 private:
  const context& ctx_;
  int index_ = -1;  // the event pair's, when timing
};

// The 128-bit layernorm kernels (layernorm_vectorized.cu): each returns false, launching
// nothing, when the row does not fit them (C a multiple of 32 lanes x 16 bytes, 1-4, 6 or 8
// vectors a lane, 16-byte aligned rows); the caller then runs the warp-per-row kernel. Forward
// with res: the row is the residual sum inp + inp2, stored to res (residual_layernorm_forward).
template <class T>
int layernorm_vectors_per_lane(int C);  // 0: does not fit
template <class T>
bool layernorm_forward_vectorized(const context& ctx, T* out, float* mean, float* rstd,
                                  const T* inp, const float* weight, const float* bias, int N,
                                  int C, const T* inp2 = nullptr, T* res = nullptr);
template <class T>
bool layernorm_dinp_vectorized(const context& ctx, T* dinp, const T* dout, const T* inp,
                               const float* weight, const float* mean, const float* rstd, int N,
                               int C);

constexpr int kThreads = 256;
inline unsigned blocks_for(std::int64_t n, int per_block = kThreads) {
  return static_cast<unsigned>((n + per_block - 1) / per_block);
}

}  // namespace troupe::kernels::cuda::detail
