// Layer normalisation with 128-bit loads (llm.c's layout): a warp per row, each lane holding
// `VPL` 16-byte vectors of the row in registers, so forward reads its row once and backward
// reads dout and inp once. The same arithmetic as cuda_ops.cu's warp-per-row kernels (fp32
// statistics, eps 1e-5, biased variance), summed in another fixed order: deterministic, within
// rounding of them. Used by layernorm_forward/_backward when the context's fast kernels are on
// and the row fits (see layernorm_vectorized_fits).
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/cuda_ops.hpp"

namespace troupe::kernels::cuda {
using namespace detail;
namespace {

// With RESIDUAL, the row is first the residual sum inp + inp2, rounded to T as residual_forward
// rounds it and stored to res (each lane reads its vectors before writing them: res may alias
// inp or inp2).
template <class T, int VPL, bool RESIDUAL>
__global__ void layernorm_forward_vec_kernel(T* out, float* mean, float* rstd, const T* inp,
                                             const T* inp2, T* res, const float* w, const float* b,
                                             int N, int C) {
  constexpr int V = pack<T>::n;
  const int row = static_cast<int>((blockIdx.x * blockDim.x + threadIdx.x) / 32);
  const int lane = static_cast<int>(threadIdx.x % 32);
  if (row >= N) return;
  const std::int64_t at = static_cast<std::int64_t>(row) * C;
  float x[VPL][V];
  float s = 0;
#pragma unroll
  for (int k = 0; k < VPL; ++k) {
    const std::int64_t c0 = at + (k * 32 + lane) * V;
    pack<T> p = load_pack(inp + c0);
    if constexpr (RESIDUAL) {
      const pack<T> q = load_pack(inp2 + c0);
#pragma unroll
      for (int j = 0; j < V; ++j) p.v[j] = from_f<T>(to_f(p.v[j]) + to_f(q.v[j]));
      store_pack(res + c0, p);
    }
#pragma unroll
    for (int j = 0; j < V; ++j) {
      x[k][j] = to_f(p.v[j]);
      s += x[k][j];
    }
  }
  const float m = warp_sum(s) / C;
  float var = 0;
#pragma unroll
  for (int k = 0; k < VPL; ++k)
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const float d = x[k][j] - m;
      var += d * d;
    }
  const float rs = rsqrtf(warp_sum(var) / C + 1e-5f);
#pragma unroll
  for (int k = 0; k < VPL; ++k) {
    const int c0 = (k * 32 + lane) * V;
    pack<T> p;
#pragma unroll
    for (int j = 0; j < V; ++j) p.v[j] = from_f<T>((x[k][j] - m) * rs * w[c0 + j] + b[c0 + j]);
    store_pack(out + at + c0, p);
  }
  if (lane == 0) {
    mean[row] = m;
    rstd[row] = rs;
  }
}

// dinp += (dnorm - mean(dnorm) - norm * mean(dnorm * norm)) * rstd, dnorm = dout * w.
template <class T, int VPL>
__global__ void layernorm_dinp_vec_kernel(T* dinp, const T* dout, const T* inp, const float* w,
                                          const float* mean, const float* rstd, int N, int C) {
  constexpr int V = pack<T>::n;
  const int row = static_cast<int>((blockIdx.x * blockDim.x + threadIdx.x) / 32);
  const int lane = static_cast<int>(threadIdx.x % 32);
  if (row >= N) return;
  const std::int64_t at = static_cast<std::int64_t>(row) * C;
  const float m = mean[row], rs = rstd[row];
  float dn[VPL][V], xn[VPL][V];
  float a = 0, bsum = 0;
#pragma unroll
  for (int k = 0; k < VPL; ++k) {
    const int c0 = (k * 32 + lane) * V;
    const pack<T> dy = load_pack(dout + at + c0);
    const pack<T> x = load_pack(inp + at + c0);
#pragma unroll
    for (int j = 0; j < V; ++j) {
      xn[k][j] = (to_f(x.v[j]) - m) * rs;
      dn[k][j] = to_f(dy.v[j]) * w[c0 + j];
      a += dn[k][j];
      bsum += dn[k][j] * xn[k][j];
    }
  }
  a = warp_sum(a) / C;
  bsum = warp_sum(bsum) / C;
#pragma unroll
  for (int k = 0; k < VPL; ++k) {
    const int c0 = (k * 32 + lane) * V;
    pack<T> g = load_pack(dinp + at + c0);
#pragma unroll
    for (int j = 0; j < V; ++j)
      g.v[j] = from_f<T>(to_f(g.v[j]) + (dn[k][j] - a - xn[k][j] * bsum) * rs);
    store_pack(dinp + at + c0, g);
  }
}

// The vectors-a-lane counts the kernels are instantiated for (with_vectors_per_lane's cases).
constexpr bool instantiated(int vpl) {
  return vpl == 1 || vpl == 2 || vpl == 3 || vpl == 4 || vpl == 6 || vpl == 8;
}

template <class F>
bool with_vectors_per_lane(int vpl, F&& f) {
  switch (vpl) {
    case 1:
      f(std::integral_constant<int, 1>{});
      return true;
    case 2:
      f(std::integral_constant<int, 2>{});
      return true;
    case 3:
      f(std::integral_constant<int, 3>{});
      return true;
    case 4:
      f(std::integral_constant<int, 4>{});
      return true;
    case 6:
      f(std::integral_constant<int, 6>{});
      return true;
    case 8:
      f(std::integral_constant<int, 8>{});
      return true;
    default:
      return false;
  }
}

}  // namespace

namespace detail {

template <class T>
int layernorm_vectors_per_lane(int C) {
  constexpr int per_warp = 32 * pack<T>::n;
  if (C <= 0 || C % per_warp != 0) return 0;
  const int vpl = C / per_warp;
  return instantiated(vpl) ? vpl : 0;
}

template <class T>
bool layernorm_forward_vectorized(const context& ctx, T* out, float* mean, float* rstd,
                                  const T* inp, const float* weight, const float* bias, int N,
                                  int C, const T* inp2, T* res) {
  if (!aligned16(out) || !aligned16(inp)) return false;
  if (res && (!aligned16(inp2) || !aligned16(res))) return false;
  return with_vectors_per_lane(layernorm_vectors_per_lane<T>(C), [&](auto v) {
    constexpr int VPL = decltype(v)::value;
    const unsigned blocks = blocks_for(std::int64_t{N} * 32);
    if (res)
      layernorm_forward_vec_kernel<T, VPL, true><<<blocks, kThreads, 0, ctx.stream()>>>(
          out, mean, rstd, inp, inp2, res, weight, bias, N, C);
    else
      layernorm_forward_vec_kernel<T, VPL, false><<<blocks, kThreads, 0, ctx.stream()>>>(
          out, mean, rstd, inp, nullptr, nullptr, weight, bias, N, C);
    check_launch("layernorm_forward_vec_kernel");
  });
}

template <class T>
bool layernorm_dinp_vectorized(const context& ctx, T* dinp, const T* dout, const T* inp,
                               const float* weight, const float* mean, const float* rstd, int N,
                               int C) {
  if (!aligned16(dinp) || !aligned16(dout) || !aligned16(inp)) return false;
  return with_vectors_per_lane(layernorm_vectors_per_lane<T>(C), [&](auto v) {
    constexpr int VPL = decltype(v)::value;
    layernorm_dinp_vec_kernel<T, VPL>
        <<<blocks_for(std::int64_t{N} * 32), kThreads, 0, ctx.stream()>>>(dinp, dout, inp, weight,
                                                                          mean, rstd, N, C);
    check_launch("layernorm_dinp_vec_kernel");
  });
}

#define TROUPE_INSTANTIATE(T)                                                                      \
  template int layernorm_vectors_per_lane<T>(int);                                                 \
  template bool layernorm_forward_vectorized<T>(const context&, T*, float*, float*, const T*,      \
                                                const float*, const float*, int, int, const T*,    \
                                                T*);                                               \
  template bool layernorm_dinp_vectorized<T>(const context&, T*, const T*, const T*, const float*, \
                                             const float*, const float*, int, int);
TROUPE_INSTANTIATE(float)
TROUPE_INSTANTIATE(bf16)
TROUPE_INSTANTIATE(fp16)
#undef TROUPE_INSTANTIATE

}  // namespace detail
}  // namespace troupe::kernels::cuda
