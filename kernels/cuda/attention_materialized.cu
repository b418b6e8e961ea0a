// Causal attention on tensor cores, the score matrix materialised (llm.c's route): cuBLASLt
// strided-batched GEMMs for Q·Kᵀ, P·V and their gradients around a fused causal softmax and its
// backward. See cuda_ops.hpp.
//
// One layer, BH = B * NH (batch, head) pairs, each a [T, hs] slice of q, k and v:
//  forward:  split_heads(qkv) -> q, k, v [BH, T, hs];  S = scale q kᵀ (GEMM, into probs);
//            P = causal_softmax(S) in place (fp32 max and sum; 0 above the diagonal);
//            O = P v (GEMM) -> merge_heads -> out [B, T, C].
//  backward: split_heads(qkv), split_heads(dout) -> dO;  dP = dO vᵀ;  dV = Pᵀ dO;
//            dS = P (dP - rowsum(P dP)) in place (fp32 row sums);  dQ = scale dS k;
//            dK = scale dSᵀ q;  merge_heads(dQ, dK, dV) += into dqkv.
// Every GEMM runs a fixed cuBLASLt plan and every kernel sums in a fixed order: the gradient
// repeats bitwise. The GEMMs write whole [T, T] tiles; the softmax kernels write the masked
// upper triangle as 0, so the GEMMs that read P or dS see exact zeros there.
#include <cuda_runtime.h>

#include <cmath>
#include <stdexcept>

#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/cuda_ops.hpp"

namespace troupe::kernels::cuda {
using namespace detail;
namespace {

// dst[p][b, h, t, :] = src[(b T + t) stride + p C + h hs + :] for parts p in [0, parts): a
// [B, T, parts·C] row layout to `parts` contiguous [B, NH, T, hs] arrays. A thread per value.
template <class T>
__global__ void split_heads_kernel(T* dst, const T* src, int B, int Tn, int NH, int hs,
                                   std::int64_t stride, int parts) {
  const std::int64_t per_part = std::int64_t{B} * NH * Tn * hs;
  const std::int64_t i = std::int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  if (i >= per_part * parts) return;
  const int p = static_cast<int>(i / per_part);
  std::int64_t r = i % per_part;
  const int d = static_cast<int>(r % hs);
  r /= hs;
  const int t = static_cast<int>(r % Tn);
  r /= Tn;
  const int h = static_cast<int>(r % NH);
  const std::int64_t b = r / NH;
  const std::int64_t C = std::int64_t{NH} * hs;
  dst[i] = src[(b * Tn + t) * stride + p * C + std::int64_t{h} * hs + d];
}

// The inverse: dst[(b T + t) stride + p C + h hs + d] (=, or += with ACCUMULATE) src[p][b, h, t,
// d]. A thread per destination value, in destination order.
template <class T, bool ACCUMULATE>
__global__ void merge_heads_kernel(T* dst, const T* src, int B, int Tn, int NH, int hs,
                                   std::int64_t stride, int parts) {
  const std::int64_t C = std::int64_t{NH} * hs, width = C * parts;
  const std::int64_t i = std::int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  if (i >= std::int64_t{B} * Tn * width) return;
  const std::int64_t row = i / width;  // b T + t
  const std::int64_t col = i % width;
  const int p = static_cast<int>(col / C);
  const int h = static_cast<int>((col % C) / hs), d = static_cast<int>(col % hs);
  const std::int64_t b = row / Tn, t = row % Tn;
  const std::int64_t per_part = std::int64_t{B} * NH * Tn * hs;
  const float v = to_f(src[p * per_part + ((b * NH + h) * Tn + t) * hs + d]);
  T* out = dst + row * stride + col;
  *out = from_f<T>(ACCUMULATE ? to_f(*out) + v : v);
}

constexpr int kRowsPerBlock = kThreads / 32;  // softmax kernels: a warp per row

// In place on rows of [BH, T, T]: row (bh, i) becomes softmax over keys j <= i of its (already
// scaled) scores, and 0 for j > i. Max and sum in fp32: each lane keeps its own running max and
// sum over its keys, the warp combines them.
template <class T>
__global__ void causal_softmax_forward_kernel(T* att, std::int64_t rows, int Tn) {
  const std::int64_t row = std::int64_t{blockIdx.x} * kRowsPerBlock + threadIdx.x / 32;
  const int lane = static_cast<int>(threadIdx.x % 32);
  if (row >= rows) return;
  const int i = static_cast<int>(row % Tn);
  T* x = att + row * Tn;
  float m = -INFINITY, l = 0.0f;
  for (int j = lane; j <= i; j += 32) {
    const float s = to_f(x[j]);
    if (s > m) {
      l *= expf(m - s);  // 0 on the lane's first key (m = -inf)
      m = s;
    }
    l += expf(s - m);
  }
  const float M = warp_max(m);  // finite: key 0 is always seen
  const float L = warp_sum(m == -INFINITY ? 0.0f : l * expf(m - M));
  const float inv = 1.0f / L;
  for (int j = lane; j < Tn; j += 32) x[j] = from_f<T>(j <= i ? expf(to_f(x[j]) - M) * inv : 0.0f);
}

// In place on rows of [BH, T, T]: datt (dP) becomes dS = P (dP - sum_k P_k dP_k) for j <= i and 0
// above the diagonal; the row sum in fp32, lanes in order of the warp reduction.
template <class T>
__global__ void causal_softmax_backward_kernel(T* datt, const T* att, std::int64_t rows, int Tn) {
  const std::int64_t row = std::int64_t{blockIdx.x} * kRowsPerBlock + threadIdx.x / 32;
  const int lane = static_cast<int>(threadIdx.x % 32);
  if (row >= rows) return;
  const int i = static_cast<int>(row % Tn);
  T* dx = datt + row * Tn;
  const T* p = att + row * Tn;
  float dot = 0.0f;
  for (int j = lane; j <= i; j += 32) dot += to_f(p[j]) * to_f(dx[j]);
  dot = warp_sum(dot);
  for (int j = lane; j < Tn; j += 32)
    dx[j] = from_f<T>(j <= i ? to_f(p[j]) * (to_f(dx[j]) - dot) : 0.0f);
}

struct shapes {
  int B, Tn, C, NH, hs;
  std::int64_t BH, NC, TT;  // pairs, values of one [B, T, C] array, values of one [T, T] tile
  shapes(int b, int t, int c, int nh)
      : B(b),
        Tn(t),
        C(c),
        NH(nh),
        hs(head_size(c, nh)),
        BH(std::int64_t{b} * nh),
        NC(std::int64_t{b} * t * c),
        TT(std::int64_t{t} * t) {}
  static int head_size(int c, int nh) {
    if (nh <= 0 || c <= 0 || c % nh != 0)
      throw std::invalid_argument("attention: width " + std::to_string(c) +
                                  " is not a positive multiple of the heads (" +
                                  std::to_string(nh) + ")");
    return c / nh;
  }
  // X[T, T] = alpha A[T, hs] B[T, hs]ᵀ per pair (S = q kᵀ: a = k, b = q).
  gemm_shape scores(float alpha) const {
    return {true,
            false,
            Tn,
            Tn,
            hs,
            hs,
            hs,
            Tn,
            alpha,
            0.0f,
            int(BH),
            Tn * std::int64_t{hs},
            Tn * std::int64_t{hs},
            TT};
  }
  // Y[T, hs] = alpha op(X)[T, T] A[T, hs] per pair, op(X) = X (O = P v: a = v, b = P) or, with
  // transpose_x, Xᵀ (dV = Pᵀ dO: a = dO, b = P).
  gemm_shape times_values(float alpha, bool transpose_x) const {
    return {false,   transpose_x,
            hs,      Tn,
            Tn,      hs,
            Tn,      hs,
            alpha,   0.0f,
            int(BH), Tn * std::int64_t{hs},
            TT,      Tn * std::int64_t{hs}};
  }
};

template <class T>
void split_heads(const context& ctx, T* dst, const T* src, const shapes& s, int parts) {
  const std::int64_t n = s.NC * parts;
  split_heads_kernel<T><<<blocks_for(n), kThreads, 0, ctx.stream()>>>(
      dst, src, s.B, s.Tn, s.NH, s.hs, std::int64_t{parts} * s.C, parts);
  check_launch("split_heads_kernel");
}

template <class T, bool ACCUMULATE>
void merge_heads(const context& ctx, T* dst, const T* src, const shapes& s, int parts) {
  const std::int64_t n = s.NC * parts;
  merge_heads_kernel<T, ACCUMULATE><<<blocks_for(n), kThreads, 0, ctx.stream()>>>(
      dst, src, s.B, s.Tn, s.NH, s.hs, std::int64_t{parts} * s.C, parts);
  check_launch("merge_heads_kernel");
}

unsigned softmax_blocks(std::int64_t rows) {
  return static_cast<unsigned>((rows + kRowsPerBlock - 1) / kRowsPerBlock);
}

}  // namespace

std::int64_t attention_probs_values(int B, int Tn, int NH) {
  return std::int64_t{B} * NH * Tn * Tn;
}

std::int64_t attention_materialized_scratch_values(int B, int Tn, int C, int NH) {
  // q, k, v and O (dO) split by head; dQ, dK, dV; dP (dS).
  return 7 * std::int64_t{B} * Tn * C + attention_probs_values(B, Tn, NH);
}

template <class T>
void attention_materialized_forward(const context& ctx, T* out, T* probs, T* scratch, const T* qkv,
                                    int B, int Tn, int C, int NH) {
  const timed_op timing(ctx, op_family::attention_forward);
  if (B <= 0 || Tn <= 0) return;
  const shapes s(B, Tn, C, NH);
  T* q = scratch;
  T* k = q + s.NC;
  T* v = k + s.NC;
  T* o = v + s.NC;
  split_heads(ctx, q, qkv, s, 3);
  gemm<T, T>(ctx, s.scores(1.0f / std::sqrt(static_cast<float>(s.hs))), k, q, probs);
  const std::int64_t rows = s.BH * Tn;
  causal_softmax_forward_kernel<T>
      <<<softmax_blocks(rows), kThreads, 0, ctx.stream()>>>(probs, rows, Tn);
  check_launch("causal_softmax_forward_kernel");
  gemm<T, T>(ctx, s.times_values(1.0f, false), v, probs, o);
  merge_heads<T, false>(ctx, out, o, s, 1);
}

template <class T>
void attention_materialized_backward(const context& ctx, T* dqkv, const T* dout, const T* qkv,
                                     const T* probs, T* scratch, int B, int Tn, int C, int NH) {
  const timed_op timing(ctx, op_family::attention_backward);
  if (B <= 0 || Tn <= 0) return;
  const shapes s(B, Tn, C, NH);
  const float scale = 1.0f / std::sqrt(static_cast<float>(s.hs));
  T* q = scratch;
  T* k = q + s.NC;
  T* v = k + s.NC;
  T* dO = v + s.NC;
  T* dq = dO + s.NC;
  T* dk = dq + s.NC;
  T* dv = dk + s.NC;
  T* datt = dv + s.NC;
  split_heads(ctx, q, qkv, s, 3);
  split_heads(ctx, dO, dout, s, 1);
  gemm<T, T>(ctx, s.scores(1.0f), v, dO, datt);                // dP = dO vᵀ
  gemm<T, T>(ctx, s.times_values(1.0f, true), dO, probs, dv);  // dV = Pᵀ dO
  const std::int64_t rows = s.BH * Tn;
  causal_softmax_backward_kernel<T>
      <<<softmax_blocks(rows), kThreads, 0, ctx.stream()>>>(datt, probs, rows, Tn);
  check_launch("causal_softmax_backward_kernel");
  gemm<T, T>(ctx, s.times_values(scale, false), k, datt, dq);  // dQ = scale dS k
  gemm<T, T>(ctx, s.times_values(scale, true), q, datt, dk);   // dK = scale dSᵀ q
  merge_heads<T, true>(ctx, dqkv, dq, s, 3);
}

#define TROUPE_INSTANTIATE(T)                                                                     \
  template void attention_materialized_forward<T>(const context&, T*, T*, T*, const T*, int, int, \
                                                  int, int);                                      \
  template void attention_materialized_backward<T>(const context&, T*, const T*, const T*,        \
                                                   const T*, T*, int, int, int, int);
TROUPE_INSTANTIATE(float)
TROUPE_INSTANTIATE(bf16)
TROUPE_INSTANTIATE(fp16)
#undef TROUPE_INSTANTIATE

}  // namespace troupe::kernels::cuda
