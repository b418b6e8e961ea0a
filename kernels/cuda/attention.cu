// Causal attention (fused, flash-attention style), the token + position embedding and dtype
// conversion on the GPU. See cuda_ops.hpp.
//
// Attention, for one (batch, head) and a tile of kRows rows per block, one row per thread:
//  - forward: the thread holds its query and output row in registers and walks the key/value
//    tiles it may see (keys <= its query) through shared memory, with an online softmax
//    (running max m, running sum l); it writes out = o / l and lse = m + log(l).
//  - backward: delta[i] = dout[i] . out[i]; then the dK/dV kernel (a thread per key row, the
//    query tiles at or after it) and the dQ kernel (a thread per query row, the key tiles at or
//    before it) each recompute p = exp(scale q.k - lse) and ds = p (dout.v - delta) scale.
//    Each output row belongs to one thread, summed in key or query order: no atomics.
#include <cuda_runtime.h>

#include <algorithm>
#include <numeric>
#include <stdexcept>
#include <type_traits>
#include <vector>

#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/cuda_ops.hpp"

namespace troupe::kernels::cuda {
using namespace detail;
namespace {

constexpr int kRows = 64;  // query (forward, dQ) or key (dK/dV) rows per block

// Rows of the tile a thread walks: 32 KiB of shared memory for a K and a V tile in fp32.
template <int HS>
__host__ __device__ constexpr int tile_rows() {
  return HS >= 128 ? 32 : 64;
}

template <class F>
void with_head_size(int hs, F&& f) {
  switch (hs) {
    case 16:
      return f(std::integral_constant<int, 16>{});
    case 32:
      return f(std::integral_constant<int, 32>{});
    case 64:
      return f(std::integral_constant<int, 64>{});
    case 128:
      return f(std::integral_constant<int, 128>{});
    default:
      throw std::invalid_argument("attention: head size " + std::to_string(hs) +
                                  " (width / heads) must be 16, 32, 64 or 128 on the GPU");
  }
}

// Loads rows [r0, r0 + rows) of one head's slice (column offset col) of a [T, stride] matrix into
// a shared [rows][ld] fp32 tile; rows past T read as 0.
template <class T>
__device__ void load_rows(float* tile, int ld, const T* base, std::int64_t stride, int col, int r0,
                          int rows, int hs, int Tn) {
  for (int idx = static_cast<int>(threadIdx.x); idx < rows * hs; idx += blockDim.x) {
    const int r = idx / hs, d = idx % hs, row = r0 + r;
    tile[r * ld + d] =
        row < Tn ? to_f(base[static_cast<std::int64_t>(row) * stride + col + d]) : 0.0f;
  }
}

template <class T, int HS>
__global__ void __launch_bounds__(kRows)
    attention_forward_kernel(T* out, float* lse, const T* qkv, int Tn, int C, int NH) {
  constexpr int BC = tile_rows<HS>();
  __shared__ float ks[BC * HS];
  __shared__ float vs[BC * HS];
  const int b = blockIdx.z, h = blockIdx.y, i0 = blockIdx.x * kRows;
  const int i = i0 + static_cast<int>(threadIdx.x);
  const std::int64_t C3 = 3LL * C;
  const T* base = qkv + static_cast<std::int64_t>(b) * Tn * C3 + static_cast<std::int64_t>(h) * HS;
  const float scale = 1.0f / sqrtf(static_cast<float>(HS));
  float q[HS], o[HS];
#pragma unroll
  for (int d = 0; d < HS; ++d) {
    q[d] = i < Tn ? to_f(base[static_cast<std::int64_t>(i) * C3 + d]) : 0.0f;
    o[d] = 0.0f;
  }
  float m = -INFINITY, l = 0.0f;
  const int last_key = min(i0 + kRows, Tn) - 1;
  for (int j0 = 0; j0 <= last_key; j0 += BC) {
    __syncthreads();
    load_rows(ks, HS, base, C3, C, j0, BC, HS, Tn);
    load_rows(vs, HS, base, C3, 2 * C, j0, BC, HS, Tn);
    __syncthreads();
    const int count = i < Tn ? min(BC, i - j0 + 1) : 0;
    for (int r = 0; r < count; ++r) {
      float s = 0.0f;
#pragma unroll
      for (int d = 0; d < HS; ++d) s += q[d] * ks[r * HS + d];
      s *= scale;
      if (s > m) {
        const float a = expf(m - s);  // 0 on the first key (m = -inf)
        l *= a;
#pragma unroll
        for (int d = 0; d < HS; ++d) o[d] *= a;
        m = s;
      }
      const float p = expf(s - m);
      l += p;
#pragma unroll
      for (int d = 0; d < HS; ++d) o[d] += p * vs[r * HS + d];
    }
  }
  if (i >= Tn) return;
  T* y = out + (static_cast<std::int64_t>(b) * Tn + i) * C + static_cast<std::int64_t>(h) * HS;
  const float inv = 1.0f / l;
#pragma unroll
  for (int d = 0; d < HS; ++d) y[d] = from_f<T>(o[d] * inv);
  lse[(static_cast<std::int64_t>(b) * NH + h) * Tn + i] = m + logf(l);
}

// delta[b,h,i] = dout[b,i,h,:] . out[b,i,h,:]
template <class T>
__global__ void attention_delta_kernel(float* delta, const T* dout, const T* out, int B, int Tn,
                                       int C, int NH, int hs) {
  const std::int64_t row = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (row >= static_cast<std::int64_t>(B) * NH * Tn) return;
  const int i = static_cast<int>(row % Tn);
  const int h = static_cast<int>((row / Tn) % NH);
  const int b = static_cast<int>(row / (static_cast<std::int64_t>(Tn) * NH));
  const std::int64_t at =
      (static_cast<std::int64_t>(b) * Tn + i) * C + static_cast<std::int64_t>(h) * hs;
  float s = 0.0f;
  for (int d = 0; d < hs; ++d) s += to_f(dout[at + d]) * to_f(out[at + d]);
  delta[row] = s;
}

template <int HS>
constexpr std::size_t dkdv_shared_bytes() {
  return sizeof(float) * (2 * kRows * (HS + 1) + 2 * tile_rows<HS>() * HS + 2 * tile_rows<HS>());
}

// A thread per key row j: dv[j] = sum_i p_ij dout_i; dk[j] = sum_i ds_ij q_i, over i >= j.
template <class T, int HS>
__global__ void __launch_bounds__(kRows)
    attention_dkdv_kernel(T* dqkv, const T* dout, const T* qkv, const float* lse,
                          const float* delta, int Tn, int C, int NH) {
  constexpr int BQ = tile_rows<HS>(), P = HS + 1;  // own rows padded: no bank conflicts
  extern __shared__ float smem[];
  float* kown = smem;
  float* vown = kown + kRows * P;
  float* qs = vown + kRows * P;
  float* dos = qs + BQ * HS;
  float* ls = dos + BQ * HS;
  float* dls = ls + BQ;
  const int b = blockIdx.z, h = blockIdx.y, j0 = blockIdx.x * kRows;
  const int tid = static_cast<int>(threadIdx.x), j = j0 + tid;
  const std::int64_t C3 = 3LL * C;
  const std::int64_t head = static_cast<std::int64_t>(h) * HS;
  const T* base = qkv + static_cast<std::int64_t>(b) * Tn * C3 + head;
  const T* dbase = dout + static_cast<std::int64_t>(b) * Tn * C + head;
  const float* lrow = lse + (static_cast<std::int64_t>(b) * NH + h) * Tn;
  const float* drow = delta + (static_cast<std::int64_t>(b) * NH + h) * Tn;
  const float scale = 1.0f / sqrtf(static_cast<float>(HS));
  load_rows(kown, P, base, C3, C, j0, kRows, HS, Tn);
  load_rows(vown, P, base, C3, 2 * C, j0, kRows, HS, Tn);
  float dk[HS], dv[HS];
#pragma unroll
  for (int d = 0; d < HS; ++d) dk[d] = dv[d] = 0.0f;
  for (int q0 = j0; q0 < Tn; q0 += BQ) {
    __syncthreads();
    load_rows(qs, HS, base, C3, 0, q0, BQ, HS, Tn);
    load_rows(dos, HS, dbase, C, 0, q0, BQ, HS, Tn);
    for (int r = tid; r < BQ; r += kRows) {
      ls[r] = q0 + r < Tn ? lrow[q0 + r] : 0.0f;
      dls[r] = q0 + r < Tn ? drow[q0 + r] : 0.0f;
    }
    __syncthreads();
    if (j >= Tn) continue;
    for (int r = max(0, j - q0); r < BQ && q0 + r < Tn; ++r) {
      float s = 0.0f, dp = 0.0f;
#pragma unroll
      for (int d = 0; d < HS; ++d) {
        s += qs[r * HS + d] * kown[tid * P + d];
        dp += dos[r * HS + d] * vown[tid * P + d];
      }
      const float p = expf(s * scale - ls[r]);
      const float ds = p * (dp - dls[r]) * scale;
#pragma unroll
      for (int d = 0; d < HS; ++d) {
        dv[d] += p * dos[r * HS + d];
        dk[d] += ds * qs[r * HS + d];
      }
    }
  }
  if (j >= Tn) return;
  T* g = dqkv + (static_cast<std::int64_t>(b) * Tn + j) * C3 + head;
#pragma unroll
  for (int d = 0; d < HS; ++d) {
    g[C + d] = from_f<T>(to_f(g[C + d]) + dk[d]);
    g[2 * C + d] = from_f<T>(to_f(g[2 * C + d]) + dv[d]);
  }
}

template <int HS>
constexpr std::size_t dq_shared_bytes() {
  return sizeof(float) * (2 * kRows * (HS + 1) + 2 * tile_rows<HS>() * HS);
}

// A thread per query row i: dq[i] = sum_j ds_ij k_j over j <= i.
template <class T, int HS>
__global__ void __launch_bounds__(kRows)
    attention_dq_kernel(T* dqkv, const T* dout, const T* qkv, const float* lse, const float* delta,
                        int Tn, int C, int NH) {
  constexpr int BC = tile_rows<HS>(), P = HS + 1;
  extern __shared__ float smem[];
  float* qown = smem;
  float* doown = qown + kRows * P;
  float* ks = doown + kRows * P;
  float* vs = ks + BC * HS;
  const int b = blockIdx.z, h = blockIdx.y, i0 = blockIdx.x * kRows;
  const int tid = static_cast<int>(threadIdx.x), i = i0 + tid;
  const std::int64_t C3 = 3LL * C;
  const std::int64_t head = static_cast<std::int64_t>(h) * HS;
  const T* base = qkv + static_cast<std::int64_t>(b) * Tn * C3 + head;
  const T* dbase = dout + static_cast<std::int64_t>(b) * Tn * C + head;
  const std::int64_t stat = (static_cast<std::int64_t>(b) * NH + h) * Tn;
  const float scale = 1.0f / sqrtf(static_cast<float>(HS));
  load_rows(qown, P, base, C3, 0, i0, kRows, HS, Tn);
  load_rows(doown, P, dbase, C, 0, i0, kRows, HS, Tn);
  const float L = i < Tn ? lse[stat + i] : 0.0f;
  const float D = i < Tn ? delta[stat + i] : 0.0f;
  float dq[HS];
#pragma unroll
  for (int d = 0; d < HS; ++d) dq[d] = 0.0f;
  const int last_key = min(i0 + kRows, Tn) - 1;
  for (int k0 = 0; k0 <= last_key; k0 += BC) {
    __syncthreads();
    load_rows(ks, HS, base, C3, C, k0, BC, HS, Tn);
    load_rows(vs, HS, base, C3, 2 * C, k0, BC, HS, Tn);
    __syncthreads();
    const int count = i < Tn ? min(BC, i - k0 + 1) : 0;
    for (int r = 0; r < count; ++r) {
      float s = 0.0f, dp = 0.0f;
#pragma unroll
      for (int d = 0; d < HS; ++d) {
        s += qown[tid * P + d] * ks[r * HS + d];
        dp += doown[tid * P + d] * vs[r * HS + d];
      }
      const float p = expf(s * scale - L);
      const float ds = p * (dp - D) * scale;
#pragma unroll
      for (int d = 0; d < HS; ++d) dq[d] += ds * ks[r * HS + d];
    }
  }
  if (i >= Tn) return;
  T* g = dqkv + (static_cast<std::int64_t>(b) * Tn + i) * C3 + head;
#pragma unroll
  for (int d = 0; d < HS; ++d) g[d] = from_f<T>(to_f(g[d]) + dq[d]);
}

// ---- embedding ---------------------------------------------------------------------------------
template <class T>
__global__ void embedding_forward_kernel(T* out, const std::int32_t* tokens, const T* wte,
                                         const T* wpe, int Tn, int C, std::int64_t total) {
  const std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= total) return;
  const std::int64_t n = i / C;
  const int c = static_cast<int>(i % C), t = static_cast<int>(n % Tn);
  out[i] = from_f<T>(to_f(wte[static_cast<std::int64_t>(tokens[n]) * C + c]) +
                     to_f(wpe[static_cast<std::int64_t>(t) * C + c]));
}

// One block row per token group, a thread per channel; the group's positions in order.
template <class T>
__global__ void embedding_dwte_kernel(float* dwte, const T* dout, const std::int32_t* groups, int G,
                                      int C) {
  const int g = blockIdx.x;
  const int c = static_cast<int>(blockIdx.y * blockDim.x + threadIdx.x);
  if (c >= C) return;
  const std::int32_t* offsets = groups + G;
  const std::int32_t* positions = offsets + G + 1;
  float s = 0.0f;
  for (int k = offsets[g]; k < offsets[g + 1]; ++k)
    s += to_f(dout[static_cast<std::int64_t>(positions[k]) * C + c]);
  dwte[static_cast<std::int64_t>(groups[g]) * C + c] += s;
}

// A thread per (t, c), batches in order.
template <class T>
__global__ void embedding_dwpe_kernel(float* dwpe, const T* dout, int B, int Tn, int C) {
  const std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= static_cast<std::int64_t>(Tn) * C) return;
  float s = 0.0f;
  for (int b = 0; b < B; ++b) s += to_f(dout[static_cast<std::int64_t>(b) * Tn * C + i]);
  dwpe[i] += s;
}

template <class T>
__global__ void convert_kernel(T* out, const float* in, std::int64_t n) {
  const std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) out[i] = from_f<T>(in[i]);
}

}  // namespace

// ---- attention ---------------------------------------------------------------------------------
template <class T>
void attention_forward(const context& ctx, T* out, float* lse, const T* qkv, int B, int Tn, int C,
                       int NH) {
  const timed_op timing(ctx, op_family::attention_forward);
  if (B <= 0 || Tn <= 0) return;
  with_head_size(C / NH, [&](auto hs) {
    constexpr int HS = decltype(hs)::value;
    const dim3 grid(blocks_for(Tn, kRows), static_cast<unsigned>(NH), static_cast<unsigned>(B));
    attention_forward_kernel<T, HS><<<grid, kRows, 0, ctx.stream()>>>(out, lse, qkv, Tn, C, NH);
  });
  check_launch("attention_forward_kernel");
}

std::int64_t attention_scratch_floats(int B, int Tn, int NH) {
  return static_cast<std::int64_t>(B) * NH * Tn;
}

template <class T>
void attention_backward(const context& ctx, T* dqkv, const T* dout, const T* qkv, const T* out,
                        const float* lse, float* scratch, int B, int Tn, int C, int NH) {
  const timed_op timing(ctx, op_family::attention_backward);
  if (B <= 0 || Tn <= 0) return;
  const std::int64_t rows = attention_scratch_floats(B, Tn, NH);
  attention_delta_kernel<T>
      <<<blocks_for(rows), kThreads, 0, ctx.stream()>>>(scratch, dout, out, B, Tn, C, NH, C / NH);
  check_launch("attention_delta_kernel");
  with_head_size(C / NH, [&](auto hs) {
    constexpr int HS = decltype(hs)::value;
    const dim3 grid(blocks_for(Tn, kRows), static_cast<unsigned>(NH), static_cast<unsigned>(B));
    constexpr std::size_t kv_bytes = dkdv_shared_bytes<HS>(), q_bytes = dq_shared_bytes<HS>();
    check(cudaFuncSetAttribute(attention_dkdv_kernel<T, HS>,
                               cudaFuncAttributeMaxDynamicSharedMemorySize, int(kv_bytes)),
          "cudaFuncSetAttribute(attention_dkdv_kernel)");
    check(cudaFuncSetAttribute(attention_dq_kernel<T, HS>,
                               cudaFuncAttributeMaxDynamicSharedMemorySize, int(q_bytes)),
          "cudaFuncSetAttribute(attention_dq_kernel)");
    attention_dkdv_kernel<T, HS>
        <<<grid, kRows, kv_bytes, ctx.stream()>>>(dqkv, dout, qkv, lse, scratch, Tn, C, NH);
    check_launch("attention_dkdv_kernel");
    attention_dq_kernel<T, HS>
        <<<grid, kRows, q_bytes, ctx.stream()>>>(dqkv, dout, qkv, lse, scratch, Tn, C, NH);
  });
  check_launch("attention_dq_kernel");
}

// ---- embedding ---------------------------------------------------------------------------------
template <class T>
void embedding_forward(const context& ctx, T* out, const std::int32_t* tokens, const T* wte,
                       const T* wpe, int B, int Tn, int C) {
  const timed_op timing(ctx, op_family::embedding);
  const std::int64_t total = static_cast<std::int64_t>(B) * Tn * C;
  if (total <= 0) return;
  embedding_forward_kernel<T>
      <<<blocks_for(total), kThreads, 0, ctx.stream()>>>(out, tokens, wte, wpe, Tn, C, total);
  check_launch("embedding_forward_kernel");
}

token_groups::~token_groups() {
  if (device_) cudaFree(device_);
}

void token_groups::build(const context& ctx, const std::int32_t* host_tokens, int N, int first_row,
                         int rows) {
  auto held = [&](std::int32_t t) { return rows < 0 || (t >= first_row && t - first_row < rows); };
  std::vector<std::int32_t> order;
  order.reserve(static_cast<std::size_t>(N));
  for (int n = 0; n < N; ++n)
    if (held(host_tokens[n])) order.push_back(n);
  std::stable_sort(order.begin(), order.end(),
                   [&](std::int32_t a, std::int32_t b) { return host_tokens[a] < host_tokens[b]; });
  std::vector<std::int32_t> tokens, offsets;
  const int kept = static_cast<int>(order.size());
  for (int k = 0; k < kept; ++k) {
    const std::int32_t t =
        host_tokens[order[static_cast<std::size_t>(k)]] - (rows < 0 ? 0 : first_row);
    if (tokens.empty() || tokens.back() != t) {
      tokens.push_back(t);
      offsets.push_back(k);
    }
  }
  offsets.push_back(kept);
  host_ = tokens;
  host_.insert(host_.end(), offsets.begin(), offsets.end());
  host_.insert(host_.end(), order.begin(), order.end());
  if (host_.size() > capacity_) {
    if (device_) check(cudaFree(device_), "cudaFree(token_groups)");
    device_ = nullptr;
    check(cudaMalloc(reinterpret_cast<void**>(&device_), host_.size() * sizeof(std::int32_t)),
          "cudaMalloc(token_groups)");
    capacity_ = host_.size();
  }
  check(cudaMemcpyAsync(device_, host_.data(), host_.size() * sizeof(std::int32_t),
                        cudaMemcpyHostToDevice, ctx.stream()),
        "cudaMemcpyAsync(token_groups)");
  groups_ = static_cast<int>(tokens.size());
  rows_ = N;
}

template <class T>
void embedding_backward(const context& ctx, float* dwte, float* dwpe, const T* dout,
                        const token_groups& groups, int B, int Tn, int C) {
  const timed_op timing(ctx, op_family::embedding);
  if (groups.rows() != B * Tn)
    throw std::invalid_argument("embedding_backward: token groups of " +
                                std::to_string(groups.rows()) +
                                " rows for B*T = " + std::to_string(B * Tn));
  if (dwte && groups.groups() > 0) {
    const dim3 grid(static_cast<unsigned>(groups.groups()), blocks_for(C));
    embedding_dwte_kernel<T>
        <<<grid, kThreads, 0, ctx.stream()>>>(dwte, dout, groups.device(), groups.groups(), C);
    check_launch("embedding_dwte_kernel");
  }
  if (dwpe) {
    embedding_dwpe_kernel<T>
        <<<blocks_for(static_cast<std::int64_t>(Tn) * C), kThreads, 0, ctx.stream()>>>(dwpe, dout,
                                                                                       B, Tn, C);
    check_launch("embedding_dwpe_kernel");
  }
}

template <class T>
void convert(const context& ctx, T* out, const float* in, std::int64_t n) {
  const timed_op timing(ctx, op_family::elementwise);
  if (n <= 0) return;
  convert_kernel<T><<<blocks_for(n), kThreads, 0, ctx.stream()>>>(out, in, n);
  check_launch("convert_kernel");
}

#define TROUPE_INSTANTIATE(T)                                                                     \
  template void attention_forward<T>(const context&, T*, float*, const T*, int, int, int, int);   \
  template void attention_backward<T>(const context&, T*, const T*, const T*, const T*,           \
                                      const float*, float*, int, int, int, int);                  \
  template void embedding_forward<T>(const context&, T*, const std::int32_t*, const T*, const T*, \
                                     int, int, int);                                              \
  template void embedding_backward<T>(const context&, float*, float*, const T*,                   \
                                      const token_groups&, int, int, int);                        \
  template void convert<T>(const context&, T*, const float*, std::int64_t);
TROUPE_INSTANTIATE(float)
TROUPE_INSTANTIATE(bf16)
TROUPE_INSTANTIATE(fp16)
#undef TROUPE_INSTANTIATE

}  // namespace troupe::kernels::cuda
