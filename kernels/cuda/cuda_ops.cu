// The foundation ops on the GPU. See cuda_ops.hpp.
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <map>
#include <memory>
#include <utility>
#include <vector>

#include "kernels/cuda/cublaslt_loader.hpp"
#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/cuda_ops.hpp"

namespace troupe::kernels::cuda {
using namespace detail;
namespace {

using detail::check;
void check(cublasStatus_t s, const char* what) {
  if (s != CUBLAS_STATUS_SUCCESS)
    throw cuda_error(std::string(what) + ": cuBLASLt status " + std::to_string(int(s)));
}

// ---- layernorm: one warp per row ---------------------------------------------------------------
template <class T>
__global__ void layernorm_forward_kernel(T* out, float* mean, float* rstd, const T* inp,
                                         const float* w, const float* b, int N, int C) {
  const int row = static_cast<int>((blockIdx.x * blockDim.x + threadIdx.x) / 32);
  const int lane = threadIdx.x % 32;
  if (row >= N) return;
  const T* x = inp + static_cast<std::int64_t>(row) * C;
  float s = 0;
  for (int i = lane; i < C; i += 32) s += to_f(x[i]);
  const float m = warp_sum(s) / C;
  float v = 0;
  for (int i = lane; i < C; i += 32) {
    const float d = to_f(x[i]) - m;
    v += d * d;
  }
  const float rs = rsqrtf(warp_sum(v) / C + 1e-5f);
  T* y = out + static_cast<std::int64_t>(row) * C;
  for (int i = lane; i < C; i += 32) y[i] = from_f<T>((to_f(x[i]) - m) * rs * w[i] + b[i]);
  if (lane == 0) {
    mean[row] = m;
    rstd[row] = rs;
  }
}

template <class T>
__global__ void layernorm_dinp_kernel(T* dinp, const T* dout, const T* inp, const float* w,
                                      const float* mean, const float* rstd, int N, int C) {
  const int row = static_cast<int>((blockIdx.x * blockDim.x + threadIdx.x) / 32);
  const int lane = threadIdx.x % 32;
  if (row >= N) return;
  const std::int64_t at = static_cast<std::int64_t>(row) * C;
  const float m = mean[row], rs = rstd[row];
  float a = 0, b = 0;
  for (int i = lane; i < C; i += 32) {
    const float dnorm = to_f(dout[at + i]) * w[i];
    a += dnorm;
    b += dnorm * (to_f(inp[at + i]) - m) * rs;
  }
  a = warp_sum(a) / C;
  b = warp_sum(b) / C;
  for (int i = lane; i < C; i += 32) {
    const float norm = (to_f(inp[at + i]) - m) * rs;
    const float dnorm = to_f(dout[at + i]) * w[i];
    dinp[at + i] = from_f<T>(to_f(dinp[at + i]) + (dnorm - a - norm * b) * rs);
  }
}

// ---- column sums (layernorm dweight/dbias, linear dbias): deterministic, in two stages ------
// Stage 1: a block per (32 columns, 256-row chunk), 8 row lanes per column, each lane summing its
// rows in order, the 8 lanes summed in order; one partial per (chunk, column). Stage 2: a thread
// per column sums the chunks in order. No atomics: the sums repeat bitwise.
constexpr int kColTile = 32, kRowLanes = 8, kChunkRows = 256;

// WITH_NORM: also sum (inp - mean) * rstd * dout (layernorm's dweight) into pw.
template <class T, bool WITH_NORM>
__global__ void column_partials_kernel(float* pw, float* pb, const T* dout, const T* inp,
                                       const float* mean, const float* rstd, int N, int C) {
  __shared__ float sw[kRowLanes][kColTile], sb[kRowLanes][kColTile];
  const int c = static_cast<int>(blockIdx.x) * kColTile + static_cast<int>(threadIdx.x);
  const int n0 = static_cast<int>(blockIdx.y) * kChunkRows, n1 = min(N, n0 + kChunkRows);
  float a = 0, b = 0;
  if (c < C) {
    for (int n = n0 + static_cast<int>(threadIdx.y); n < n1; n += kRowLanes) {
      const std::int64_t at = static_cast<std::int64_t>(n) * C + c;
      const float dy = to_f(dout[at]);
      if constexpr (WITH_NORM) a += (to_f(inp[at]) - mean[n]) * rstd[n] * dy;
      b += dy;
    }
  }
  sw[threadIdx.y][threadIdx.x] = a;
  sb[threadIdx.y][threadIdx.x] = b;
  __syncthreads();
  if (threadIdx.y != 0 || c >= C) return;
  float ta = 0, tb = 0;
  for (int y = 0; y < kRowLanes; ++y) {
    ta += sw[y][threadIdx.x];
    tb += sb[y][threadIdx.x];
  }
  const std::int64_t at = static_cast<std::int64_t>(blockIdx.y) * C + c;
  if constexpr (WITH_NORM) pw[at] = ta;
  pb[at] = tb;
}

__global__ void column_finish_kernel(float* dw, float* db, const float* pw, const float* pb,
                                     int chunks, int C) {
  const int c = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  if (c >= C) return;
  float a = 0, b = 0;
  for (int k = 0; k < chunks; ++k) {
    const std::int64_t at = static_cast<std::int64_t>(k) * C + c;
    if (pw) a += pw[at];
    b += pb[at];
  }
  if (dw) dw[c] += a;
  if (db) db[c] += b;
}

// db[c] += sum over rows of dout[., c]; with WITH_NORM also dw[c] += sum of the normalised input
// times dout (layernorm). Either output may be nullptr.
template <class T, bool WITH_NORM>
void column_sums(const context& ctx, float* dw, float* db, const T* dout, const T* inp,
                 const float* mean, const float* rstd, int N, int C) {
  if (N <= 0 || C <= 0) return;
  const int chunks = (N + kChunkRows - 1) / kChunkRows;
  const std::size_t per = static_cast<std::size_t>(chunks) * static_cast<std::size_t>(C);
  float* partial = nullptr;
  check(cudaMallocAsync(reinterpret_cast<void**>(&partial),
                        (WITH_NORM ? 2 : 1) * per * sizeof(float), ctx.stream()),
        "cudaMallocAsync(column_sums)");
  float* pw = WITH_NORM ? partial : nullptr;
  float* pb = WITH_NORM ? partial + per : partial;
  const dim3 grid(static_cast<unsigned>((C + kColTile - 1) / kColTile),
                  static_cast<unsigned>(chunks));
  column_partials_kernel<T, WITH_NORM>
      <<<grid, dim3(kColTile, kRowLanes), 0, ctx.stream()>>>(pw, pb, dout, inp, mean, rstd, N, C);
  check_launch("column_partials_kernel");
  column_finish_kernel<<<blocks_for(C), kThreads, 0, ctx.stream()>>>(WITH_NORM ? dw : nullptr, db,
                                                                     pw, pb, chunks, C);
  check_launch("column_finish_kernel");
  check(cudaFreeAsync(partial, ctx.stream()), "cudaFreeAsync(column_sums)");
}

// ---- elementwise
// ---------------------------------------------------------------------------------
constexpr float kBeta = 0.7978845608028654f;  // sqrt(2/pi)
constexpr float kKappa = 0.044715f;

// exp(-2u) with its argument clamped to [-87, 88], as the CPU's fast_expf: never inf, so the
// backward's e * s never turns into inf * 0 = NaN (x below about -10.1 did).
__device__ inline float gelu_exp(float u) { return expf(fminf(fmaxf(-2.0f * u, -87.0f), 88.0f)); }

// The elementwise ops as functions of floats, one place for the scalar and the 128-bit kernels.
struct gelu_op {  // out = gelu(x)
  __device__ float operator()(float x, float, float) const {
    const float u = kBeta * (x + kKappa * x * x * x);
    return x / (1.0f + gelu_exp(u));
  }
};
struct gelu_backward_op {  // dinp += dout * gelu'(x)
  __device__ float operator()(float dinp, float x, float dout) const {
    const float u = kBeta * (x + kKappa * x * x * x);
    const float e = gelu_exp(u);
    const float s = 1.0f / (1.0f + e);
    const float du = kBeta * (1.0f + 3.0f * kKappa * x * x);
    return dinp + dout * (s + 2.0f * x * s * (e * s) * du);
  }
};
struct gelu_grad_op {  // dout * gelu'(x): gelu_backward_op's onto 0, the same bits
  __device__ float operator()(float x, float dout, float) const {
    return gelu_backward_op{}(0.0f, x, dout);
  }
};
struct add_op {  // out = a + b
  __device__ float operator()(float a, float b, float) const { return a + b; }
};

// out[i] = f(a[i], b[i], c[i]) for the first `Arity` inputs (the others unread, may be null).
// Each thread takes W consecutive elements: W = 1 (scalar accesses, any alignment) or a 16-byte
// pack (the fast kernels: every pointer 16-byte aligned), the last pack's thread the tail.
template <int Arity, int W, class T, class F>
__global__ void map_kernel(T* out, const T* a, const T* b, const T* c, std::int64_t n, F f) {
  const std::int64_t first = (static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * W;
  if (first >= n) return;
  if constexpr (W > 1) {
    if (first + W <= n) {
      static_assert(W == pack<T>::n);
      pack<T> pb{}, pc{}, po;
      const pack<T> pa = load_pack(a + first);
      if constexpr (Arity >= 2) pb = load_pack(b + first);
      if constexpr (Arity >= 3) pc = load_pack(c + first);
#pragma unroll
      for (int j = 0; j < W; ++j)
        po.v[j] = from_f<T>(
            f(to_f(pa.v[j]), Arity >= 2 ? to_f(pb.v[j]) : 0.0f, Arity >= 3 ? to_f(pc.v[j]) : 0.0f));
      store_pack(out + first, po);
      return;
    }
  }
  const std::int64_t last = first + W < n ? first + W : n;
  for (std::int64_t i = first; i < last; ++i)
    out[i] =
        from_f<T>(f(to_f(a[i]), Arity >= 2 ? to_f(b[i]) : 0.0f, Arity >= 3 ? to_f(c[i]) : 0.0f));
}

// map_kernel over n elements: 16-byte packs where the context's fast kernels are on and every
// pointer allows them.
template <int Arity, class T, class F>
void map(const context& ctx, T* out, const T* a, const T* b, const T* c, std::int64_t n, F f,
         const char* name) {
  if (n <= 0) return;  // a grid of 0 blocks is an invalid launch
  constexpr int W = pack<T>::n;
  if (ctx.fast_kernels() && aligned16(out) && aligned16(a) && (Arity < 2 || aligned16(b)) &&
      (Arity < 3 || aligned16(c))) {
    map_kernel<Arity, W, T, F>
        <<<blocks_for((n + W - 1) / W), kThreads, 0, ctx.stream()>>>(out, a, b, c, n, f);
  } else {
    map_kernel<Arity, 1, T, F><<<blocks_for(n), kThreads, 0, ctx.stream()>>>(out, a, b, c, n, f);
  }
  check_launch(name);
}

// ---- softmax + cross-entropy: one block per row ----------------------------------------------
// The block's row: its logits, its dlogits (may be the same memory) and its target.
template <class T>
struct ce_row {
  const T* x;
  T* dx;
  int t;
  bool counted;  // the target is not ignore_index
  __device__ ce_row(T* dlogits, const T* logits, const std::int32_t* targets, int Vp,
                    int ignore_index)
      : x(logits + static_cast<std::int64_t>(blockIdx.x) * Vp),
        dx(dlogits + static_cast<std::int64_t>(blockIdx.x) * Vp),
        t(targets[blockIdx.x]),
        counted(t != ignore_index) {}
  // The row's loss from its max and sum, written by thread 0, the target's logit read (by
  // every thread) before any thread writes dlogits.
  __device__ void loss(float* losses, float mx, float sum) const {
    const float x_t = counted ? to_f(x[t]) : 0.0f;
    __syncthreads();
    if (threadIdx.x == 0) losses[blockIdx.x] = counted ? mx + logf(sum) - x_t : 0.0f;
  }
};

template <class T>
__global__ void softmax_ce_kernel(T* dlogits, const T* logits, const std::int32_t* targets,
                                  float* losses, int V, int Vp, int ignore_index, float scale) {
  __shared__ float shared[32];
  const ce_row<T> r(dlogits, logits, targets, Vp, ignore_index);
  const T* x = r.x;
  float mx = -INFINITY;
  for (int j = threadIdx.x; j < V; j += blockDim.x) mx = fmaxf(mx, to_f(x[j]));
  mx = block_reduce(mx, true, shared);
  float sum = 0;
  for (int j = threadIdx.x; j < V; j += blockDim.x) sum += expf(to_f(x[j]) - mx);
  sum = block_reduce(sum, false, shared);
  r.loss(losses, mx, sum);
  for (int j = threadIdx.x; j < Vp; j += blockDim.x) {
    float g = 0;
    if (r.counted && j < V) g = (expf(to_f(x[j]) - mx) / sum - (j == r.t ? 1.0f : 0.0f)) * scale;
    r.dx[j] = from_f<T>(g);
  }
}

// The fast kernels' classifier (Vp a multiple of a 16-byte pack, rows 16-byte aligned): the row
// read once for its maximum and sum together (each thread's running pair rescaled as its
// maximum grows, then combined over the block), once more to write dlogits, in 16-byte packs.
template <class T>
__global__ void softmax_ce_vec_kernel(T* dlogits, const T* logits, const std::int32_t* targets,
                                      float* losses, int V, int Vp, int ignore_index, float scale) {
  constexpr int P = pack<T>::n;
  __shared__ float shared[32];
  const ce_row<T> r(dlogits, logits, targets, Vp, ignore_index);
  const T* x = r.x;
  float m = -INFINITY, s = 0;
  for (int k = threadIdx.x * P; k < V; k += blockDim.x * P) {
    const pack<T> p = load_pack(x + k);
    float v[P], pm = -INFINITY;
#pragma unroll
    for (int j = 0; j < P; ++j) {
      v[j] = k + j < V ? to_f(p.v[j]) : -INFINITY;
      pm = fmaxf(pm, v[j]);
    }
    if (pm > m) {
      s *= expf(m - pm);  // 0 while m is -inf
      m = pm;
    }
#pragma unroll
    for (int j = 0; j < P; ++j) s += expf(v[j] - m);
  }
  const float mx = block_reduce(m, true, shared);
  const float sum = block_reduce(m == -INFINITY ? 0.0f : s * expf(m - mx), false, shared);
  r.loss(losses, mx, sum);
  const float inv = 1.0f / sum;
  for (int k = threadIdx.x * P; k < Vp; k += blockDim.x * P) {
    pack<T> p = load_pack(x + k);
#pragma unroll
    for (int j = 0; j < P; ++j) {
      const int col = k + j;
      float g = 0;
      if (r.counted && col < V)
        g = (expf(to_f(p.v[j]) - mx) * inv - (col == r.t ? 1.0f : 0.0f)) * scale;
      p.v[j] = from_f<T>(g);
    }
    store_pack(r.dx + k, p);
  }
}

template <class T>
cudaDataType_t data_type();
template <>
cudaDataType_t data_type<float>() {
  return CUDA_R_32F;
}
template <>
cudaDataType_t data_type<bf16>() {
  return CUDA_R_16BF;
}
template <>
cudaDataType_t data_type<fp16>() {
  return CUDA_R_16F;
}

}  // namespace

// One GEMM shape's cuBLASLt objects and the algorithm the heuristic chose, made on the shape's
// first call and reused: a GPT-2 step runs a few dozen shapes thousands of times, and creating
// descriptors and asking the heuristic costs tens of microseconds of host time per call.
struct gemm_plan {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t la = nullptr, lb = nullptr, ld = nullptr;
  cublasLtMatmulAlgo_t algo{};
  bool usable = true;  // false: cuBLASLt has no algorithm for this fused epilogue
  gemm_plan() = default;
  gemm_plan(const gemm_plan&) = delete;
  gemm_plan& operator=(const gemm_plan&) = delete;
  ~gemm_plan() {
    if (ld) cublasLtMatrixLayoutDestroy(ld);
    if (lb) cublasLtMatrixLayoutDestroy(lb);
    if (la) cublasLtMatrixLayoutDestroy(la);
    if (op) cublasLtMatmulDescDestroy(op);
  }
};

// What the GEMM's epilogue adds to D = alpha op(A) op(B) + beta D.
enum class epilogue : std::int64_t {
  none,
  bias,           // + bias[m] per row of D
  gelu_aux_bias,  // D = gelu(AB + bias), aux = AB + bias (the GELU's input, for backward)
  dgelu,          // D = (AB) * gelu'(aux)
  bgradb,         // bias[n] = the sum over k of op(B)[k, n] (fp32; written, not accumulated)
};

// The key: everything the plan depends on, including each pointer's alignment (the heuristic
// must not pick an algorithm that needs more alignment than the pointers have), for a strided
// batch the batch count and the three strides, and the epilogue with its aux matrix's leading
// dimension and alignment.
using gemm_key = std::array<std::int64_t, 20>;

struct gemm_cache {
  std::map<gemm_key, std::unique_ptr<gemm_plan>> plans;
};

namespace {
// The largest power of two (at most 256) that divides the address.
std::uint32_t alignment_of(std::uintptr_t a) {
  std::uint32_t align = 256;
  while (align > 1 && a % align != 0) align /= 2;
  return align;
}
// What every matrix of a (strided) batch is aligned to: the base's alignment and the stride's.
template <class T>
std::int64_t batch_alignment(const T* p, int batch, std::int64_t stride) {
  const std::uint32_t base = alignment_of(reinterpret_cast<std::uintptr_t>(p));
  if (batch <= 1) return base;
  return std::min(base, alignment_of(static_cast<std::uintptr_t>(stride) * sizeof(T)));
}
}  // namespace

// cuBLASLt column-major GEMM: D[m,n] = alpha op(A) op(B) + beta C, C = D, with an epilogue;
// with batch > 1, `batch` such products, matrix i at a + i * stride_a (b, d alike).
struct gemm_access {
  // False (running nothing) where cuBLASLt has no algorithm for a GELU or bias-gradient
  // epilogue: the caller then runs the unfused ops. Throws for the plain GEMM and the bias
  // epilogue.
  template <class TA, class TD>
  static bool run(const context& ctx, const gemm_shape& g, const TA* a, const TA* b, TD* d,
                  const TD* bias, epilogue epi = epilogue::none, TD* aux = nullptr,
                  int aux_ld = 0) {
    if (epi == epilogue::none && bias) epi = epilogue::bias;
    auto lt = static_cast<cublasLtHandle_t>(ctx.lt_);
    const gemm_key key{g.trans_a,
                       g.trans_b,
                       g.m,
                       g.n,
                       g.k,
                       g.lda,
                       g.ldb,
                       g.ldd,
                       int(data_type<TA>()),
                       int(data_type<TD>()),
                       static_cast<std::int64_t>(epi),
                       batch_alignment(a, g.batch, g.stride_a),
                       batch_alignment(b, g.batch, g.stride_b),
                       batch_alignment(d, g.batch, g.stride_d),
                       g.batch,
                       g.stride_a,
                       g.stride_b,
                       g.stride_d,
                       aux_ld,
                       aux ? alignment_of(reinterpret_cast<std::uintptr_t>(aux)) : 0};
    auto& slot = ctx.gemms_->plans[key];
    if (!slot) slot = make_plan<TA, TD>(ctx, key);
    gemm_plan& plan = *slot;
    if (!plan.usable) return false;
    if (bias)
      check(cublasLtMatmulDescSetAttribute(plan.op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias,
                                           sizeof bias),
            "cublasLtMatmulDescSetAttribute(BIAS_POINTER)");
    if (aux)
      check(cublasLtMatmulDescSetAttribute(plan.op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &aux,
                                           sizeof aux),
            "cublasLtMatmulDescSetAttribute(EPILOGUE_AUX_POINTER)");
    check(cublasLtMatmul(lt, plan.op, &g.alpha, a, plan.la, b, plan.lb, &g.beta, d, plan.ld, d,
                         plan.ld, &plan.algo, ctx.workspace_, ctx.workspace_bytes_, ctx.stream_),
          "cublasLtMatmul");
    return true;
  }

 private:
  static void set_batch(cublasLtMatrixLayout_t layout, std::int64_t batch, std::int64_t stride) {
    if (batch <= 1) return;
    const std::int32_t count = static_cast<std::int32_t>(batch);
    check(cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count,
                                           sizeof count),
          "cublasLtMatrixLayoutSetAttribute(BATCH_COUNT)");
    check(cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                                           &stride, sizeof stride),
          "cublasLtMatrixLayoutSetAttribute(STRIDED_BATCH_OFFSET)");
  }

  template <class TA, class TD>
  static std::unique_ptr<gemm_plan> make_plan(const context& ctx, const gemm_key& key) {
    const bool trans_a = key[0] != 0, trans_b = key[1] != 0;
    const auto m = static_cast<std::uint64_t>(key[2]), n = static_cast<std::uint64_t>(key[3]),
               k = static_cast<std::uint64_t>(key[4]);
    const auto epi = static_cast<epilogue>(key[10]);
    auto plan = std::make_unique<gemm_plan>();
    cublasLtMatmulPreference_t pref = nullptr;
    try {
      check(cublasLtMatmulDescCreate(&plan->op, CUBLAS_COMPUTE_32F, CUDA_R_32F),
            "cublasLtMatmulDescCreate");
      const cublasOperation_t ta = trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
      const cublasOperation_t tb = trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
      check(cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta),
            "cublasLtMatmulDescSetAttribute(TRANSA)");
      check(cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb),
            "cublasLtMatmulDescSetAttribute(TRANSB)");
      if (epi != epilogue::none) {
        const cublasLtEpilogue_t e = epi == epilogue::bias ? CUBLASLT_EPILOGUE_BIAS
                                     : epi == epilogue::gelu_aux_bias
                                         ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS
                                     : epi == epilogue::dgelu ? CUBLASLT_EPILOGUE_DGELU
                                                              : CUBLASLT_EPILOGUE_BGRADB;
        check(cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_EPILOGUE, &e, sizeof e),
              "cublasLtMatmulDescSetAttribute(EPILOGUE)");
      }
      if (epi == epilogue::bgradb) {  // the bias gradient in fp32, whatever D's type
        const cudaDataType_t fp32 = CUDA_R_32F;
        check(cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &fp32,
                                             sizeof fp32),
              "cublasLtMatmulDescSetAttribute(BIAS_DATA_TYPE)");
      }
      if (epi == epilogue::gelu_aux_bias || epi == epilogue::dgelu) {
        const std::int64_t aux_ld = key[18];
        check(cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD,
                                             &aux_ld, sizeof aux_ld),
              "cublasLtMatmulDescSetAttribute(EPILOGUE_AUX_LD)");
      }
      check(cublasLtMatrixLayoutCreate(&plan->la, data_type<TA>(), trans_a ? k : m, trans_a ? m : k,
                                       key[5]),
            "cublasLtMatrixLayoutCreate(A)");
      check(cublasLtMatrixLayoutCreate(&plan->lb, data_type<TA>(), trans_b ? n : k, trans_b ? k : n,
                                       key[6]),
            "cublasLtMatrixLayoutCreate(B)");
      check(cublasLtMatrixLayoutCreate(&plan->ld, data_type<TD>(), m, n, key[7]),
            "cublasLtMatrixLayoutCreate(D)");
      set_batch(plan->la, key[14], key[15]);
      set_batch(plan->lb, key[14], key[16]);
      set_batch(plan->ld, key[14], key[17]);
      check(cublasLtMatmulPreferenceCreate(&pref), "cublasLtMatmulPreferenceCreate");
      check(
          cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                               &ctx.workspace_bytes_, sizeof ctx.workspace_bytes_),
          "cublasLtMatmulPreferenceSetAttribute(MAX_WORKSPACE_BYTES)");
      // The aux matrix's alignment bounds D's: the heuristic knows only D's.
      const auto d_align = key[19] ? std::min(key[13], key[19]) : key[13];
      const std::uint32_t align[] = {static_cast<std::uint32_t>(key[11]),
                                     static_cast<std::uint32_t>(key[12]),
                                     static_cast<std::uint32_t>(d_align)};
      const cublasLtMatmulPreferenceAttributes_t which[] = {
          CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
          CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
      for (int i = 0; i < 4; ++i)
        check(cublasLtMatmulPreferenceSetAttribute(pref, which[i], &align[std::min(i, 2)],
                                                   sizeof(std::uint32_t)),
              "cublasLtMatmulPreferenceSetAttribute(MIN_ALIGNMENT)");
      cublasLtMatmulHeuristicResult_t heuristic{};
      int found = 0;
      const cublasStatus_t asked =
          cublasLtMatmulAlgoGetHeuristic(static_cast<cublasLtHandle_t>(ctx.lt_), plan->op, plan->la,
                                         plan->lb, plan->ld, plan->ld, pref, 1, &heuristic, &found);
      const bool fused =
          epi == epilogue::gelu_aux_bias || epi == epilogue::dgelu || epi == epilogue::bgradb;
      if (fused && (asked != CUBLAS_STATUS_SUCCESS || found == 0)) {
        plan->usable = false;  // the caller runs the unfused ops
      } else {
        check(asked, "cublasLtMatmulAlgoGetHeuristic");
        if (found == 0)
          throw cuda_error("cublasLtMatmulAlgoGetHeuristic: no algorithm for m=" +
                           std::to_string(m) + " n=" + std::to_string(n) +
                           " k=" + std::to_string(k) + " batch=" + std::to_string(key[14]));
        plan->algo = heuristic.algo;
      }
    } catch (...) {
      if (pref) cublasLtMatmulPreferenceDestroy(pref);
      throw;
    }
    cublasLtMatmulPreferenceDestroy(pref);
    return plan;
  }
};

namespace detail {
template <class TA, class TD>
void gemm(const context& ctx, const gemm_shape& shape, const TA* a, const TA* b, TD* d) {
  gemm_access::run<TA, TD>(ctx, shape, a, b, d, nullptr);
}
template void gemm<float, float>(const context&, const gemm_shape&, const float*, const float*,
                                 float*);
template void gemm<bf16, bf16>(const context&, const gemm_shape&, const bf16*, const bf16*, bf16*);
template void gemm<fp16, fp16>(const context&, const gemm_shape&, const fp16*, const fp16*, fp16*);
}  // namespace detail

context::context() {
  // The constructor throws, so the destructor would not run: free what was made on failure.
  try {
    require_cublaslt();  // loaded on first use: a clear error if it cannot be
    check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate");
    cublasLtHandle_t lt = nullptr;
    check(cublasLtCreate(&lt), "cublasLtCreate");
    lt_ = lt;
    workspace_bytes_ = std::size_t{32} << 20;  // 32 MiB, as cuBLAS recommends for Hopper
    check(cudaMalloc(&workspace_, workspace_bytes_), "cudaMalloc(cuBLASLt workspace)");
    gemms_ = new gemm_cache;
  } catch (...) {
    release();
    throw;
  }
}

context::~context() { release(); }

void context::release() noexcept {
  delete_op_timer(std::exchange(timer_, nullptr));
  delete_cudnn_state(std::exchange(cudnn_, nullptr));  // before the stream it runs on
  delete std::exchange(gemms_, nullptr);               // before the handle its plans were made with
  if (workspace_) cudaFree(std::exchange(workspace_, nullptr));
  if (lt_) cublasLtDestroy(static_cast<cublasLtHandle_t>(std::exchange(lt_, nullptr)));
  if (stream_) cudaStreamDestroy(std::exchange(stream_, nullptr));
}

int context::unfused_epilogue_shapes() const {
  int n = 0;
  for (const auto& [key, plan] : gemms_->plans) n += plan->usable ? 0 : 1;
  return n;
}

void context::synchronize() const {
  check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
}

template <class T>
void layernorm_forward(const context& ctx, T* out, float* mean, float* rstd, const T* inp,
                       const float* weight, const float* bias, int N, int C) {
  const timed_op timing(ctx, op_family::layernorm_forward);
  if (N <= 0) return;  // a grid of 0 blocks is an invalid launch
  if (ctx.fast_kernels() &&
      layernorm_forward_vectorized(ctx, out, mean, rstd, inp, weight, bias, N, C))
    return;
  layernorm_forward_kernel<T><<<blocks_for(std::int64_t{N} * 32), kThreads, 0, ctx.stream()>>>(
      out, mean, rstd, inp, weight, bias, N, C);
  check_launch("layernorm_forward_kernel");
}

template <class T>
void residual_layernorm_forward(const context& ctx, T* res, T* out, float* mean, float* rstd,
                                const T* a, const T* b, const float* weight, const float* bias,
                                int N, int C) {
  if (N <= 0) return;
  // One op (one layernorm_forward in the timings) where the fused kernel runs, else two.
  if (ctx.fast_kernels() && layernorm_vectors_per_lane<T>(C) > 0 && aligned16(res) &&
      aligned16(out) && aligned16(a) && aligned16(b)) {
    const timed_op timing(ctx, op_family::layernorm_forward);
    if (layernorm_forward_vectorized(ctx, out, mean, rstd, a, weight, bias, N, C, b, res)) return;
  }
  residual_forward(ctx, res, a, b, std::int64_t{N} * C);
  layernorm_forward(ctx, out, mean, rstd, static_cast<const T*>(res), weight, bias, N, C);
}

template <class T>
void layernorm_backward(const context& ctx, T* dinp, float* dweight, float* dbias, const T* dout,
                        const T* inp, const float* weight, const float* mean, const float* rstd,
                        int N, int C) {
  const timed_op timing(ctx, op_family::layernorm_backward);
  if (N <= 0) return;
  if (dinp && !(ctx.fast_kernels() &&
                layernorm_dinp_vectorized(ctx, dinp, dout, inp, weight, mean, rstd, N, C))) {
    layernorm_dinp_kernel<T><<<blocks_for(std::int64_t{N} * 32), kThreads, 0, ctx.stream()>>>(
        dinp, dout, inp, weight, mean, rstd, N, C);
    check_launch("layernorm_dinp_kernel");
  }
  if (dweight || dbias) column_sums<T, true>(ctx, dweight, dbias, dout, inp, mean, rstd, N, C);
}

// Row-major out[N,OC] = inp[N,C] W[OC,C]^T is column-major out^T[OC,N] = W^T... with A = W
// (column-major [C,OC], transposed), B = inp (column-major [C,N]).
template <class T>
void linear_forward(const context& ctx, T* out, const T* inp, const T* weight, const T* bias, int N,
                    int C, int OC) {
  const timed_op timing(ctx, op_family::linear_forward);
  gemm_access::run<T, T>(ctx, {true, false, OC, N, C, C, C, OC}, weight, inp, out, bias);
}

// The GEMM epilogues (GELU, bias gradient) and the one-read classifier: the fast kernels in bf16
// and fp16. fp32 keeps the reference arithmetic (the GELU of cuda_ops' kernels, the column sums,
// the classifier's division), so an fp32 run with the fast kernels stays within the CPU's
// rounding.
namespace {
template <class T>
bool fused_16bit_kernels(const context& ctx) {
  return !std::is_same_v<T, float> && ctx.fast_kernels();
}
}  // namespace

template <class T>
void linear_backward(const context& ctx, T* dinp, float* dweight, float* dbias, const T* dout,
                     const T* inp, const T* weight, int N, int C, int OC) {
  const timed_op timing(ctx, op_family::linear_backward);
  // dinp[N,C] += dout[N,OC] W[OC,C]: column-major dinp^T[C,N] = W^T[C,OC] dout^T[OC,N].
  if (dinp)
    gemm_access::run<T, T>(ctx, {false, false, C, N, OC, C, OC, C, 1.0f, 1.0f}, weight, dout, dinp,
                           nullptr);
  // dW[OC,C] += dout^T inp: column-major dW^T[C,OC] = inp^T[C,N] dout[N,OC], into fp32. With the
  // fast kernels in bf16 and fp16, db in the same GEMM: cuBLASLt's BGRADB epilogue sums dout's
  // columns (op(B)'s, over k = N) as it reads them, into a scratch (the epilogue writes; the
  // gradients accumulate) then added to db. Else, or where cuBLASLt has no algorithm for the
  // epilogue, the column sums read dout again.
  bool bias_done = false;
  if (dweight) {
    const gemm_shape shape{false, true, C, OC, N, C, OC, C, 1.0f, 1.0f};
    if (dbias && fused_16bit_kernels<T>(ctx)) {
      float* sums = nullptr;
      check(cudaMallocAsync(reinterpret_cast<void**>(&sums), std::size_t(OC) * sizeof(float),
                            ctx.stream()),
            "cudaMallocAsync(linear_backward bias gradient)");
      bias_done =
          gemm_access::run<T, float>(ctx, shape, inp, dout, dweight, sums, epilogue::bgradb);
      if (bias_done) {
        column_finish_kernel<<<blocks_for(OC), kThreads, 0, ctx.stream()>>>(nullptr, dbias, nullptr,
                                                                            sums, 1, OC);
        check_launch("column_finish_kernel");
      }
      check(cudaFreeAsync(sums, ctx.stream()), "cudaFreeAsync(linear_backward bias gradient)");
    }
    if (!bias_done) gemm_access::run<T, float>(ctx, shape, inp, dout, dweight, nullptr);
  }
  if (dbias && !bias_done)
    column_sums<T, false>(ctx, nullptr, dbias, dout, dout, nullptr, nullptr, N, OC);
}

template <class T>
void linear_gelu_forward(const context& ctx, T* out, T* pre, const T* inp, const T* weight,
                         const T* bias, int N, int C, int OC) {
  {
    const timed_op timing(ctx, op_family::linear_forward);
    if (fused_16bit_kernels<T>(ctx) &&
        gemm_access::run<T, T>(ctx, {true, false, OC, N, C, C, C, OC}, weight, inp, out, bias,
                               epilogue::gelu_aux_bias, pre, OC))
      return;
  }
  linear_forward(ctx, pre, inp, weight, bias, N, C, OC);
  gelu_forward(ctx, out, static_cast<const T*>(pre), std::int64_t{N} * OC);
}

template <class T>
void linear_backward_dgelu(const context& ctx, T* dpre, T* dact, float* dweight, float* dbias,
                           const T* dout, const T* act, const T* pre, const T* weight, int N, int C,
                           int OC) {
  bool fused = false;
  {
    const timed_op timing(ctx, op_family::linear_backward);
    // dpre^T[C,N] = W^T[C,OC] dout^T[OC,N], times gelu'(pre) in the epilogue (pre as D is laid);
    // else the product alone into dact.
    const gemm_shape shape{false, false, C, N, OC, C, OC, C, 1.0f, 0.0f};
    fused = fused_16bit_kernels<T>(ctx) &&
            gemm_access::run<T, T>(ctx, shape, weight, dout, dpre, nullptr, epilogue::dgelu,
                                   const_cast<T*>(pre), C);
    if (!fused) gemm_access::run<T, T>(ctx, shape, weight, dout, dact, nullptr);
  }
  // The weight and bias gradients, as linear_backward's (from act).
  linear_backward<T>(ctx, nullptr, dweight, dbias, dout, act, weight, N, C, OC);
  if (fused) return;
  const timed_op timing(ctx, op_family::elementwise);
  map<2>(ctx, dpre, pre, static_cast<const T*>(dact), static_cast<const T*>(nullptr),
         std::int64_t{N} * C, gelu_grad_op{}, "gelu_backward_kernel");
}

template <class T>
void gelu_forward(const context& ctx, T* out, const T* inp, std::int64_t n) {
  const timed_op timing(ctx, op_family::elementwise);
  map<1>(ctx, out, inp, static_cast<const T*>(nullptr), static_cast<const T*>(nullptr), n,
         gelu_op{}, "gelu_forward_kernel");
}

template <class T>
void gelu_backward(const context& ctx, T* dinp, const T* inp, const T* dout, std::int64_t n) {
  const timed_op timing(ctx, op_family::elementwise);
  map<3>(ctx, dinp, static_cast<const T*>(dinp), inp, dout, n, gelu_backward_op{},
         "gelu_backward_kernel");
}

template <class T>
void residual_forward(const context& ctx, T* out, const T* a, const T* b, std::int64_t n) {
  const timed_op timing(ctx, op_family::elementwise);
  map<2>(ctx, out, a, b, static_cast<const T*>(nullptr), n, add_op{}, "residual_forward_kernel");
}

template <class T>
cross_entropy_result softmax_cross_entropy_backward(const context& ctx, T* dlogits, const T* logits,
                                                    const std::int32_t* targets, float* losses,
                                                    int N, int V, int Vp, int ignore_index,
                                                    std::int64_t count, float grad_scale) {
  const timed_op timing(ctx, op_family::cross_entropy);
  cross_entropy_result r;
  r.count = count;
  if (N <= 0) return r;
  const float scale = count > 0 ? grad_scale / static_cast<float>(count) : 0.0f;
  if (fused_16bit_kernels<T>(ctx) && Vp % pack<T>::n == 0 && aligned16(dlogits) &&
      aligned16(logits)) {
    softmax_ce_vec_kernel<T><<<static_cast<unsigned>(N), 1024, 0, ctx.stream()>>>(
        dlogits, logits, targets, losses, V, Vp, ignore_index, scale);
    check_launch("softmax_ce_vec_kernel");
  } else {
    softmax_ce_kernel<T><<<static_cast<unsigned>(N), 1024, 0, ctx.stream()>>>(
        dlogits, logits, targets, losses, V, Vp, ignore_index, scale);
    check_launch("softmax_ce_kernel");
  }
  r.loss_sum = host_row_sum(ctx, losses, N);
  return r;
}

#define TROUPE_INSTANTIATE(T)                                                                      \
  template void layernorm_forward<T>(const context&, T*, float*, float*, const T*, const float*,   \
                                     const float*, int, int);                                      \
  template void layernorm_backward<T>(const context&, T*, float*, float*, const T*, const T*,      \
                                      const float*, const float*, const float*, int, int);         \
  template void linear_forward<T>(const context&, T*, const T*, const T*, const T*, int, int,      \
                                  int);                                                            \
  template void linear_backward<T>(const context&, T*, float*, float*, const T*, const T*,         \
                                   const T*, int, int, int);                                       \
  template void linear_gelu_forward<T>(const context&, T*, T*, const T*, const T*, const T*, int,  \
                                       int, int);                                                  \
  template void linear_backward_dgelu<T>(const context&, T*, T*, float*, float*, const T*,         \
                                         const T*, const T*, const T*, int, int, int);             \
  template void gelu_forward<T>(const context&, T*, const T*, std::int64_t);                       \
  template void gelu_backward<T>(const context&, T*, const T*, const T*, std::int64_t);            \
  template void residual_forward<T>(const context&, T*, const T*, const T*, std::int64_t);         \
  template void residual_layernorm_forward<T>(const context&, T*, T*, float*, float*, const T*,    \
                                              const T*, const float*, const float*, int, int);     \
  template cross_entropy_result softmax_cross_entropy_backward<T>(                                 \
      const context&, T*, const T*, const std::int32_t*, float*, int, int, int, int, std::int64_t, \
      float);
TROUPE_INSTANTIATE(float)
TROUPE_INSTANTIATE(bf16)
TROUPE_INSTANTIATE(fp16)
#undef TROUPE_INSTANTIATE

namespace {
struct replica_pointers {
  float* p[kMaxLocalReplicas];
};
__global__ void replica_mean_kernel(replica_pointers copies, int k, float scale, std::int64_t n) {
  const std::int64_t i = std::int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  if (i >= n) return;
  float sum = copies.p[0][i];
  for (int d = 1; d < k; ++d) sum = sum + copies.p[d][i];
  const float mean = sum * scale;
  for (int d = 0; d < k; ++d) copies.p[d][i] = mean;
}
}  // namespace

void replica_mean(cudaStream_t stream, float* const* copies, int k, std::int64_t n) {
  if (k < 1 || k > kMaxLocalReplicas)
    throw std::invalid_argument("replica_mean: " + std::to_string(k) + " replicas (1 to " +
                                std::to_string(kMaxLocalReplicas) + ")");
  if (n <= 0 || k == 1) return;
  replica_pointers r{};
  for (int d = 0; d < k; ++d) r.p[d] = copies[d];
  replica_mean_kernel<<<blocks_for(n), kThreads, 0, stream>>>(r, k, 1.0f / static_cast<float>(k),
                                                              n);
  check_launch("replica_mean_kernel");
}

}  // namespace troupe::kernels::cuda
