// Causal attention through cuDNN's fused flash attention (cuda_ops.hpp), built with cuDNN's graph
// (backend) API: the same operation graph cuDNN's own frontend builds for scaled-dot-product
// attention (Q·Kᵀ, the scale, the causal mask, softmax with its statistics, P·V; and the
// backward's), which cuDNN's heuristics match to its fused flash-attention engines. cuDNN is
// loaded on first use (cudnn_loader.hpp).
//
// q, k and v are strided views of qkv [B, T, 3, NH, hs] (dims [B, NH, T, hs], strides
// {3C·T, hs, 3C, 1} at offsets 0, C and 2C), out and dout [B, T, NH, hs]; dq, dk and dv are the
// same views of dqkv. lse is [B, NH, T, 1] fp32. Plans are built once per (dtype, B, T, NH, hs)
// and kept on the context with their workspace.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/cuda_ops.hpp"
#include "kernels/cuda/cudnn_loader.hpp"

namespace troupe::kernels::cuda {
using namespace detail;

namespace {

void check_cudnn(cudnnStatus_t status, const std::string& what) {
  if (status == CUDNN_STATUS_SUCCESS) return;
  const cudnn_api& a = require_cudnn();
  char last[1024] = {};
  a.cudnnGetLastErrorString(last, sizeof last);
  throw cuda_error("cuDNN " + what + ": " + a.cudnnGetErrorString(status) +
                   (last[0] ? std::string(" (") + last + ")" : std::string()));
}

// One backend descriptor, destroyed with its owner.
class descriptor {
 public:
  descriptor(cudnnBackendDescriptorType_t type, std::string what) : what_(std::move(what)) {
    check_cudnn(require_cudnn().cudnnBackendCreateDescriptor(type, &d_), "create " + what_);
  }
  ~descriptor() {
    if (d_) require_cudnn().cudnnBackendDestroyDescriptor(d_);
  }
  descriptor(const descriptor&) = delete;
  descriptor& operator=(const descriptor&) = delete;
  cudnnBackendDescriptor_t get() const { return d_; }

  descriptor& set(cudnnBackendAttributeName_t name, cudnnBackendAttributeType_t type,
                  std::int64_t count, const void* values) {
    check_cudnn(require_cudnn().cudnnBackendSetAttribute(d_, name, type, count, values),
                "set attribute " + std::to_string(name) + " of " + what_);
    return *this;
  }
  descriptor& set_int(cudnnBackendAttributeName_t name, std::int64_t v) {
    return set(name, CUDNN_TYPE_INT64, 1, &v);
  }
  descriptor& set_ints(cudnnBackendAttributeName_t name, const std::vector<std::int64_t>& v) {
    return set(name, CUDNN_TYPE_INT64, static_cast<std::int64_t>(v.size()), v.data());
  }
  descriptor& set_bool(cudnnBackendAttributeName_t name, bool v) {
    return set(name, CUDNN_TYPE_BOOLEAN, 1, &v);
  }
  descriptor& set_type(cudnnBackendAttributeName_t name, cudnnDataType_t v) {
    return set(name, CUDNN_TYPE_DATA_TYPE, 1, &v);
  }
  descriptor& set_desc(cudnnBackendAttributeName_t name, const descriptor& v) {
    cudnnBackendDescriptor_t d = v.get();
    return set(name, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &d);
  }
  descriptor& finalize() {
    check_cudnn(require_cudnn().cudnnBackendFinalize(d_), "finalize " + what_);
    return *this;
  }

 private:
  cudnnBackendDescriptor_t d_ = nullptr;
  std::string what_;
};

// CUDNN_ATTR_OPERATIONGRAPH_HANDLE and CUDNN_ATTR_EXECUTION_PLAN_HANDLE: deprecated in the 9.19
// headers, but cuDNN 9.14 finds no engine for the attention graphs without them.
constexpr auto kGraphHandle = static_cast<cudnnBackendAttributeName_t>(800);
constexpr auto kPlanHandle = static_cast<cudnnBackendAttributeName_t>(400);

// The tensors' unique ids in the variant pack; virtual tensors count up from kFirstVirtual.
enum uid : std::int64_t {
  kQ = 1,
  kK,
  kV,
  kO,
  kStats,
  kDO,
  kDQ,
  kDK,
  kDV,
  kScale = 20,
  kNegInf,
  kOne,
  kSoftmaxSum,
  kSeqLenQ,
  kSeqLenKV,
  kNegInfPadding = 27,
  kFirstVirtual = 100
};

// One operation graph under construction: its tensors and operations, kept alive with the plan.
class graph_builder {
 public:
  explicit graph_builder(cudnnDataType_t io) : io_(io) {}
  cudnnDataType_t io() const { return io_; }

  const descriptor& tensor(const std::vector<std::int64_t>& dims,
                           const std::vector<std::int64_t>& strides, cudnnDataType_t type,
                           std::int64_t id, bool is_virtual = false, bool by_value = false) {
    auto& t = keep("tensor " + std::to_string(id), CUDNN_BACKEND_TENSOR_DESCRIPTOR);
    t.set_type(CUDNN_ATTR_TENSOR_DATA_TYPE, type)
        .set_ints(CUDNN_ATTR_TENSOR_DIMENSIONS, dims)
        .set_ints(CUDNN_ATTR_TENSOR_STRIDES, strides)
        .set_int(CUDNN_ATTR_TENSOR_UNIQUE_ID, id)
        .set_int(CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, 16);
    if (is_virtual) t.set_bool(CUDNN_ATTR_TENSOR_IS_VIRTUAL, true);
    if (by_value) t.set_bool(CUDNN_ATTR_TENSOR_IS_BY_VALUE, true);
    t.finalize();
    shapes_[t.get()] = {dims, strides};
    return t;
  }
  // A virtual tensor shaped as `like` (or as given), FLOAT unless told.
  const descriptor& virt(const descriptor& like, cudnnDataType_t type = CUDNN_DATA_FLOAT) {
    const auto& s = shapes_.at(like.get());
    return tensor(s.first, s.second, type, next_virtual_++, true);
  }
  const descriptor& virt(const std::vector<std::int64_t>& dims,
                         const std::vector<std::int64_t>& strides,
                         cudnnDataType_t type = CUDNN_DATA_FLOAT) {
    return tensor(dims, strides, type, next_virtual_++, true);
  }
  // A host float passed by value (the variant pack points at it).
  const descriptor& scalar(std::int64_t id) {
    return tensor({1, 1, 1, 1}, {1, 1, 1, 1}, CUDNN_DATA_FLOAT, id, false, true);
  }

  void pointwise(cudnnPointwiseMode_t mode, const descriptor& x, const descriptor& y,
                 const descriptor* b = nullptr, const descriptor* t = nullptr,
                 cudnnDataType_t precision = CUDNN_DATA_FLOAT, int axis = -1) {
    auto& pw = keep("pointwise descriptor", CUDNN_BACKEND_POINTWISE_DESCRIPTOR);
    pw.set(CUDNN_ATTR_POINTWISE_MODE, CUDNN_TYPE_POINTWISE_MODE, 1, &mode)
        .set_type(CUDNN_ATTR_POINTWISE_MATH_PREC, precision);
    if (axis >= 0) pw.set_int(CUDNN_ATTR_POINTWISE_AXIS, axis);
    pw.finalize();
    auto& op = keep("pointwise operation " + std::to_string(mode),
                    CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR);
    op.set_desc(CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, pw)
        .set_desc(CUDNN_ATTR_OPERATION_POINTWISE_XDESC, x)
        .set_desc(CUDNN_ATTR_OPERATION_POINTWISE_YDESC, y);
    if (b) op.set_desc(CUDNN_ATTR_OPERATION_POINTWISE_BDESC, *b);
    if (t) op.set_desc(CUDNN_ATTR_OPERATION_POINTWISE_TDESC, *t);
    const float one = 1.0f;
    op.set(CUDNN_ATTR_OPERATION_POINTWISE_ALPHA1, CUDNN_TYPE_FLOAT, 1, &one)
        .set(CUDNN_ATTR_OPERATION_POINTWISE_ALPHA2, CUDNN_TYPE_FLOAT, 1, &one)
        .finalize();
    ops_.push_back(op.get());
  }
  // c = a·b, batched over the first two dims; m, n, k override the product's extents per batch
  // (the padding mask's lengths) where given.
  void matmul(const descriptor& a, const descriptor& b, const descriptor& c,
              const descriptor* m = nullptr, const descriptor* n = nullptr,
              const descriptor* k = nullptr) {
    auto& md = keep("matmul descriptor", CUDNN_BACKEND_MATMUL_DESCRIPTOR);
    md.set_type(CUDNN_ATTR_MATMUL_COMP_TYPE, CUDNN_DATA_FLOAT).finalize();
    auto& op = keep("matmul operation", CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR);
    op.set_desc(CUDNN_ATTR_OPERATION_MATMUL_ADESC, a)
        .set_desc(CUDNN_ATTR_OPERATION_MATMUL_BDESC, b)
        .set_desc(CUDNN_ATTR_OPERATION_MATMUL_CDESC, c)
        .set_desc(CUDNN_ATTR_OPERATION_MATMUL_DESC, md);
    if (m) op.set_desc(CUDNN_ATTR_OPERATION_MATMUL_GEMM_M_OVERRIDE_DESC, *m);
    if (n) op.set_desc(CUDNN_ATTR_OPERATION_MATMUL_GEMM_N_OVERRIDE_DESC, *n);
    if (k) op.set_desc(CUDNN_ATTR_OPERATION_MATMUL_GEMM_K_OVERRIDE_DESC, *k);
    op.finalize();
    ops_.push_back(op.get());
  }
  // y = the reduction of x over the axes where y's extent is 1.
  void reduction(cudnnReduceTensorOp_t op_type, const descriptor& x, const descriptor& y) {
    auto& rd = keep("reduction descriptor", CUDNN_BACKEND_REDUCTION_DESCRIPTOR);
    rd.set_type(CUDNN_ATTR_REDUCTION_COMP_TYPE, CUDNN_DATA_FLOAT)
        .set(CUDNN_ATTR_REDUCTION_OPERATOR, CUDNN_TYPE_REDUCTION_OPERATOR_TYPE, 1, &op_type)
        .set_bool(CUDNN_ATTR_REDUCTION_IS_DETERMINISTIC, false)
        .finalize();
    auto& op = keep("reduction operation", CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR);
    op.set_desc(CUDNN_ATTR_OPERATION_REDUCTION_DESC, rd)
        .set_desc(CUDNN_ATTR_OPERATION_REDUCTION_XDESC, x)
        .set_desc(CUDNN_ATTR_OPERATION_REDUCTION_YDESC, y)
        .finalize();
    ops_.push_back(op.get());
  }
  void reshape(const descriptor& x, const descriptor& y) {
    auto& op = keep("reshape operation", CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR);
    op.set_desc(CUDNN_ATTR_OPERATION_RESHAPE_XDESC, x)
        .set_desc(CUDNN_ATTR_OPERATION_RESHAPE_YDESC, y)
        .finalize();
    ops_.push_back(op.get());
  }
  // y = x where row >= column, else -inf (the causal mask, top-left aligned).
  const descriptor& causal_mask(const descriptor& x, const descriptor& neg_inf) {
    const auto& row = virt(x, CUDNN_DATA_INT32);
    const auto& col = virt(x, CUDNN_DATA_INT32);
    const auto& keep_mask = virt(x, CUDNN_DATA_BOOLEAN);
    const auto& y = virt(x);
    pointwise(CUDNN_POINTWISE_GEN_INDEX, x, row, nullptr, nullptr, CUDNN_DATA_FLOAT, 2);
    pointwise(CUDNN_POINTWISE_GEN_INDEX, x, col, nullptr, nullptr, CUDNN_DATA_FLOAT, 3);
    pointwise(CUDNN_POINTWISE_CMP_GE, row, keep_mask, &col, nullptr, CUDNN_DATA_BOOLEAN);
    pointwise(CUDNN_POINTWISE_BINARY_SELECT, x, y, &neg_inf, &keep_mask);
    return y;
  }
  // y = x where row < seq_len_q and column < seq_len_kv, else -inf.
  const descriptor& padding_mask(const descriptor& x, const descriptor& seq_q,
                                 const descriptor& seq_kv, const descriptor& neg_inf) {
    const auto& row = virt(x, CUDNN_DATA_INT32);
    const auto& col = virt(x, CUDNN_DATA_INT32);
    const auto& row_in = virt(x, CUDNN_DATA_BOOLEAN);
    const auto& col_in = virt(x, CUDNN_DATA_BOOLEAN);
    const auto& inside = virt(x, CUDNN_DATA_BOOLEAN);
    const auto& y = virt(x);
    pointwise(CUDNN_POINTWISE_GEN_INDEX, x, row, nullptr, nullptr, CUDNN_DATA_INT32, 2);
    pointwise(CUDNN_POINTWISE_GEN_INDEX, x, col, nullptr, nullptr, CUDNN_DATA_INT32, 3);
    pointwise(CUDNN_POINTWISE_CMP_LT, row, row_in, &seq_q, nullptr, CUDNN_DATA_BOOLEAN);
    pointwise(CUDNN_POINTWISE_CMP_LT, col, col_in, &seq_kv, nullptr, CUDNN_DATA_BOOLEAN);
    pointwise(CUDNN_POINTWISE_LOGICAL_AND, row_in, inside, &col_in, nullptr, CUDNN_DATA_BOOLEAN);
    pointwise(CUDNN_POINTWISE_BINARY_SELECT, x, y, &neg_inf, &inside);
    return y;
  }

  // The finalized operation graph (handle may be null only to check construction).
  descriptor& finish(cudnnHandle_t handle) {
    auto& g = keep("operation graph", CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR);
    if (handle) g.set(kGraphHandle, CUDNN_TYPE_HANDLE, 1, &handle);
    g.set(CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR,
          static_cast<std::int64_t>(ops_.size()), ops_.data());
    g.finalize();
    return g;
  }
  std::size_t operations() const { return ops_.size(); }  // so far
  std::vector<std::unique_ptr<descriptor>> take() { return std::move(kept_); }

 private:
  descriptor& keep(const std::string& what, cudnnBackendDescriptorType_t type) {
    kept_.push_back(std::make_unique<descriptor>(type, what));
    return *kept_.back();
  }
  cudnnDataType_t io_;
  std::int64_t next_virtual_ = kFirstVirtual;
  std::vector<std::unique_ptr<descriptor>> kept_;
  std::vector<cudnnBackendDescriptor_t> ops_;
  std::map<cudnnBackendDescriptor_t,
           std::pair<std::vector<std::int64_t>, std::vector<std::int64_t>>>
      shapes_;
};

// The attention's shapes: q, k, v (and dq, dk, dv) in qkv's layout, o and do in out's.
struct sdpa_shape {
  std::int64_t b, h, s, d;
  std::vector<std::int64_t> dims() const { return {b, h, s, d}; }
  std::vector<std::int64_t> qkv_strides() const { return {s * 3 * h * d, d, 3 * h * d, 1}; }
  // Kᵀ (and Vᵀ): K's memory with the last two dims and strides swapped.
  std::vector<std::int64_t> transposed_dims() const { return {b, h, d, s}; }
  std::vector<std::int64_t> transposed_strides() const { return {s * 3 * h * d, d, 1, 3 * h * d}; }
  std::vector<std::int64_t> out_strides() const { return {s * h * d, d, h * d, 1}; }
  std::vector<std::int64_t> scores() const { return {b, h, s, s}; }
  std::vector<std::int64_t> score_strides() const { return {h * s * s, s * s, s, 1}; }
  std::vector<std::int64_t> score_strides_transposed() const { return {h * s * s, s * s, 1, s}; }
  std::vector<std::int64_t> rows() const { return {b, h, s, 1}; }
  std::vector<std::int64_t> row_strides() const { return {h * s, s, 1, 1}; }
};

// Forward: S = scale Q·Kᵀ, causal mask, M = rowmax, E = exp(S − M), Z = rowsum(E),
// stats = M + log Z, P = E / Z (io type), O = P·V. 14 operations.
void build_forward(graph_builder& g, const sdpa_shape& x) {
  const auto io = g.io();
  const auto& q = g.tensor(x.dims(), x.qkv_strides(), io, kQ);
  const auto& kt = g.tensor(x.transposed_dims(), x.transposed_strides(), io, kK);
  const auto& v = g.tensor(x.dims(), x.qkv_strides(), io, kV);
  const auto& o = g.tensor(x.dims(), x.out_strides(), io, kO);
  const auto& stats = g.tensor(x.rows(), x.row_strides(), CUDNN_DATA_FLOAT, kStats);
  const auto& scale = g.scalar(kScale);
  const auto& neg_inf = g.scalar(kNegInf);
  const auto& s1 = g.virt(x.scores(), x.score_strides());
  g.matmul(q, kt, s1);
  const auto& s2 = g.virt(s1);
  g.pointwise(CUDNN_POINTWISE_MUL, s1, s2, &scale);
  const auto& s3 = g.causal_mask(s2, neg_inf);
  const auto& m = g.virt(x.rows(), x.row_strides());
  g.reduction(CUDNN_REDUCE_TENSOR_MAX, s3, m);
  const auto& s4 = g.virt(s1);
  g.pointwise(CUDNN_POINTWISE_SUB, s3, s4, &m);
  const auto& e = g.virt(s1);
  g.pointwise(CUDNN_POINTWISE_EXP, s4, e);
  const auto& z = g.virt(x.rows(), x.row_strides());
  g.reduction(CUDNN_REDUCE_TENSOR_ADD, e, z);
  const auto& log_z = g.virt(z);
  g.pointwise(CUDNN_POINTWISE_LOG, z, log_z);
  g.pointwise(CUDNN_POINTWISE_ADD, m, stats, &log_z);
  const auto& p = g.virt(s1, io);
  g.pointwise(CUDNN_POINTWISE_DIV, e, p, &z);
  g.matmul(p, v, o);
}

// Backward (deterministic: the last matmul writes dQ itself, no fp32 accumulator):
// softmax_sum = rowsum(dO∘O); P = exp(mask(scale Q·Kᵀ) − stats); dV = Pᵀ·dO;
// dS = scale P∘(dO·Vᵀ − softmax_sum); dK = dSᵀ·Q; dQ = dS·K. 21 operations, 27 with the padding
// mask cuDNN up to 9.15.0 needs when T is no multiple of 128.
void build_backward(graph_builder& g, const sdpa_shape& x, bool padding) {
  const auto io = g.io();
  const auto& q = g.tensor(x.dims(), x.qkv_strides(), io, kQ);
  const auto& kt = g.tensor(x.transposed_dims(), x.transposed_strides(), io, kK);
  const auto& vt = g.tensor(x.transposed_dims(), x.transposed_strides(), io, kV);
  const auto& o = g.tensor(x.dims(), x.out_strides(), io, kO);
  const auto& d_o = g.tensor(x.dims(), x.out_strides(), io, kDO);
  const auto& stats = g.tensor(x.rows(), x.row_strides(), CUDNN_DATA_FLOAT, kStats);
  const auto& dq = g.tensor(x.dims(), x.qkv_strides(), io, kDQ);
  const auto& dk = g.tensor(x.dims(), x.qkv_strides(), io, kDK);
  const auto& dv = g.tensor(x.dims(), x.qkv_strides(), io, kDV);
  const auto& scale = g.scalar(kScale);
  const auto& one = g.scalar(kOne);
  const auto& neg_inf = g.scalar(kNegInf);
  const descriptor *seq_q = nullptr, *seq_kv = nullptr;
  if (padding) {
    seq_q = &g.tensor({x.b, 1, 1, 1}, {1, 1, 1, 1}, CUDNN_DATA_INT32, kSeqLenQ);
    seq_kv = &g.tensor({x.b, 1, 1, 1}, {1, 1, 1, 1}, CUDNN_DATA_INT32, kSeqLenKV);
  }
  const auto& a = g.virt(x.dims(), {x.h * x.s * x.d, x.s * x.d, x.h * x.d, 1});
  g.pointwise(CUDNN_POINTWISE_MUL, d_o, a, &o);
  const auto& r = g.virt(x.rows(), x.row_strides());
  g.reduction(CUDNN_REDUCE_TENSOR_ADD, a, r);
  const auto& softmax_sum = g.tensor(x.rows(), x.row_strides(), CUDNN_DATA_FLOAT, kSoftmaxSum);
  g.pointwise(CUDNN_POINTWISE_MUL, r, softmax_sum, &one);
  const auto& s1 = g.virt(x.scores(), x.score_strides());
  g.matmul(q, kt, s1, seq_q, seq_kv);
  const descriptor* s2 = &g.virt(s1);
  g.pointwise(CUDNN_POINTWISE_MUL, s1, *s2, &scale);
  if (padding) s2 = &g.padding_mask(*s2, *seq_q, *seq_kv, g.scalar(kNegInfPadding));
  const auto& s3 = g.virt(s1);
  g.pointwise(CUDNN_POINTWISE_SUB, *s2, s3, &stats);
  const auto& s4 = g.causal_mask(s3, neg_inf);
  const auto& p = g.virt(s1);
  g.pointwise(CUDNN_POINTWISE_EXP, s4, p);
  const auto& pt = g.virt(x.scores(), x.score_strides_transposed(), io);
  g.reshape(p, pt);
  g.matmul(pt, d_o, dv, seq_kv, nullptr, seq_q);
  const auto& dp = g.virt(s1);
  g.matmul(d_o, vt, dp, seq_q, seq_kv);
  const auto& dp2 = g.virt(s1);
  g.pointwise(CUDNN_POINTWISE_SUB, dp, dp2, &softmax_sum);
  const auto& ds = g.virt(s1);
  g.pointwise(CUDNN_POINTWISE_MUL, dp2, ds, &p);
  const auto& ds2 = g.virt(s1);
  g.pointwise(CUDNN_POINTWISE_MUL, ds, ds2, &scale);
  const auto& dst = g.virt(x.scores(), x.score_strides_transposed(), io);
  g.reshape(ds2, dst);
  g.matmul(dst, q, dk, seq_kv, nullptr, seq_q);
  const auto& k = g.virt(x.dims(), x.qkv_strides());  // Kᵀ viewed back as K (FLOAT, as cuDNN's
  g.reshape(kt, k);                                   // frontend declares it)
  g.matmul(ds2, k, dq, seq_q, nullptr, seq_kv);
}

// A finalized execution plan and everything it was built from.
struct sdpa_plan {
  std::vector<std::unique_ptr<descriptor>> kept;  // tensors, operations, the graph
  std::unique_ptr<descriptor> config, plan;
  std::int64_t workspace = 0;
  bool padding = false;  // the backward's padding mask (seq_len tensors in the variant pack)
};

}  // namespace

// A context's cuDNN: its handle on the context's stream, the plans by shape, one workspace.
struct cudnn_state {
  cudnnHandle_t handle = nullptr;
  std::map<std::tuple<int, int, int, int, int, bool>, std::unique_ptr<sdpa_plan>> plans;
  void* workspace = nullptr;  // the plans' workspace, the largest asked for
  std::size_t workspace_bytes = 0;
  void* buffers = nullptr;  // backward's softmax_sum and the padding mask's lengths
  std::size_t buffer_bytes = 0;
  ~cudnn_state();
};

}  // namespace troupe::kernels::cuda

namespace troupe::kernels::cuda {
namespace {

// Whether the engine's numerical notes could be read and none says non-deterministic.
bool notes_known_deterministic(cudnnBackendDescriptor_t engine) {
  const cudnn_api& a = require_cudnn();
  cudnnBackendNumericalNote_t notes[CUDNN_NUMERICAL_NOTE_TYPE_COUNT];
  std::int64_t count = 0;
  if (a.cudnnBackendGetAttribute(engine, CUDNN_ATTR_ENGINE_NUMERICAL_NOTE,
                                 CUDNN_TYPE_NUMERICAL_NOTE, CUDNN_NUMERICAL_NOTE_TYPE_COUNT, &count,
                                 notes) != CUDNN_STATUS_SUCCESS)
    return false;
  for (std::int64_t i = 0; i < count; ++i)
    if (notes[i] == CUDNN_NUMERICAL_NOTE_NONDETERMINISTIC) return false;
  return true;
}

// The first of heuristics mode A's engine configurations that builds a plan (skipping engines
// cuDNN marks non-deterministic, or whose notes cannot be read, where asked).
void choose_plan(cudnnHandle_t handle, descriptor& graph, sdpa_plan& out, bool deterministic,
                 const std::string& what) {
  const cudnn_api& a = require_cudnn();
  descriptor heuristics(CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR, what + " heuristics");
  const cudnnBackendHeurMode_t mode = CUDNN_HEUR_MODE_A;
  heuristics.set_desc(CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, graph)
      .set(CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, 1, &mode)
      .finalize();
  std::int64_t count = 0;
  check_cudnn(a.cudnnBackendGetAttribute(heuristics.get(), CUDNN_ATTR_ENGINEHEUR_RESULTS,
                                         CUDNN_TYPE_BACKEND_DESCRIPTOR, 0, &count, nullptr),
              what + ": heuristics' count");
  std::vector<std::unique_ptr<descriptor>> configs;
  std::vector<cudnnBackendDescriptor_t> raw;
  for (std::int64_t i = 0; i < count; ++i) {
    configs.push_back(
        std::make_unique<descriptor>(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR, what + " config"));
    raw.push_back(configs.back()->get());
  }
  std::int64_t returned = 0;
  if (count > 0)
    check_cudnn(
        a.cudnnBackendGetAttribute(heuristics.get(), CUDNN_ATTR_ENGINEHEUR_RESULTS,
                                   CUDNN_TYPE_BACKEND_DESCRIPTOR, count, &returned, raw.data()),
        what + ": heuristics' results");
  std::string last = "no engine configuration";
  for (std::int64_t i = 0; i < returned; ++i) {
    if (deterministic) {
      descriptor engine(CUDNN_BACKEND_ENGINE_DESCRIPTOR, what + " engine");
      cudnnBackendDescriptor_t e = engine.get();
      std::int64_t one = 0;
      // An engine whose notes cannot be read is not known to be deterministic: skipped too.
      if (a.cudnnBackendGetAttribute(raw[static_cast<std::size_t>(i)], CUDNN_ATTR_ENGINECFG_ENGINE,
                                     CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &one,
                                     &e) != CUDNN_STATUS_SUCCESS ||
          !notes_known_deterministic(e))
        continue;
    }
    auto plan =
        std::make_unique<descriptor>(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR, what + " plan");
    plan->set_desc(CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, *configs[static_cast<std::size_t>(i)])
        .set(kPlanHandle, CUDNN_TYPE_HANDLE, 1, &handle);
    const cudnnStatus_t status = a.cudnnBackendFinalize(plan->get());
    if (status != CUDNN_STATUS_SUCCESS) {
      last = a.cudnnGetErrorString(status);
      continue;
    }
    std::int64_t one = 0;
    check_cudnn(a.cudnnBackendGetAttribute(plan->get(), CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE,
                                           CUDNN_TYPE_INT64, 1, &one, &out.workspace),
                what + ": workspace size");
    out.config = std::move(configs[static_cast<std::size_t>(i)]);
    out.plan = std::move(plan);
    return;
  }
  char detail[1024] = {};
  a.cudnnGetLastErrorString(detail, sizeof detail);
  throw cuda_error("cuDNN has no engine for " + what + " (" + std::to_string(returned) +
                   " configurations from its heuristics; last: " + last +
                   (detail[0] ? std::string("; ") + detail : std::string()) +
                   "); CUDNN_LOGLEVEL_DBG=2 CUDNN_LOGDEST_DBG=stderr says why");
}

// T = 1: softmax over one key is 1, so out = v and the scores' gradient is 0 (dq = dk = 0,
// dv = dout); lse is the one scaled score. cuDNN has no engine for one row and one key.
template <class T>
__global__ void single_token_forward(T* out, float* lse, const T* qkv, int B, int NH, int hs,
                                     float scale) {
  const int bh = blockIdx.x, b = bh / NH, h = bh % NH, C = NH * hs;
  const T* row = qkv + std::int64_t{b} * 3 * C;
  float dot = 0;
  for (int d = threadIdx.x; d < hs; d += 32) {
    dot += to_f(row[h * hs + d]) * to_f(row[C + h * hs + d]);
    out[std::int64_t{b} * C + h * hs + d] = row[2 * C + h * hs + d];
  }
  dot = warp_sum(dot);
  if (threadIdx.x == 0) lse[bh] = dot * scale;
}

template <class T>
__global__ void single_token_backward(T* dqkv, const T* dout, int B, int C) {
  const std::int64_t i = std::int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  if (i >= std::int64_t{B} * 3 * C) return;
  const std::int64_t b = i / (3 * C), c = i % (3 * C);
  dqkv[i] = c < 2 * C ? from_f<T>(0.0f) : dout[b * C + c - 2 * C];
}

__global__ void fill_int(std::int32_t* p, int n, std::int32_t value) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) p[i] = value;
}

template <class T>
constexpr cudnnDataType_t io_type() {
  return std::is_same_v<T, bf16> ? CUDNN_DATA_BFLOAT16 : CUDNN_DATA_HALF;
}

void check_shape(int B, int T_, int C, int NH) {
  if (B <= 0 || T_ <= 0 || NH <= 0 || C % NH != 0)
    throw std::invalid_argument("cuDNN attention: bad shape B=" + std::to_string(B) +
                                " T=" + std::to_string(T_) + " C=" + std::to_string(C) +
                                " heads=" + std::to_string(NH));
  const int hs = C / NH;
  if (hs % 8 != 0 || hs > 128)
    throw std::invalid_argument("cuDNN attention: head size " + std::to_string(hs) +
                                " (cuDNN's flash attention takes multiples of 8 up to 128)");
}

}  // namespace

cudnn_state::~cudnn_state() {
  plans.clear();  // before the handle they were made with
  if (workspace) cudaFree(workspace);
  if (buffers) cudaFree(buffers);
  if (handle) require_cudnn().cudnnDestroy(handle);
}

namespace detail {
void delete_cudnn_state(cudnn_state* state) noexcept { delete state; }
}  // namespace detail

struct cudnn_access {
  // The context's cuDNN state, made on first use: the library, a handle on the context's stream.
  static cudnn_state& state(const context& ctx) {
    if (!ctx.cudnn_) {
      const cudnn_api& a = require_cudnn();
      auto s = std::make_unique<cudnn_state>();
      check_cudnn(a.cudnnCreate(&s->handle), "cudnnCreate");
      check_cudnn(a.cudnnSetStream(s->handle, ctx.stream()), "cudnnSetStream");
      ctx.cudnn_ = s.release();
    }
    return *ctx.cudnn_;
  }
  static std::size_t bytes(const context& ctx) {
    return ctx.cudnn_ ? ctx.cudnn_->workspace_bytes + ctx.cudnn_->buffer_bytes : 0;
  }
};

namespace {

// The plan for this shape, built on first use.
template <class T>
sdpa_plan& plan_for(const context& ctx, int B, int T_, int NH, int hs, bool backward) {
  cudnn_state& st = cudnn_access::state(ctx);
  const auto key = std::make_tuple(static_cast<int>(io_type<T>()), B, T_, NH, hs, backward);
  auto it = st.plans.find(key);
  if (it != st.plans.end()) return *it->second;
  const std::string what = std::string(backward ? "attention backward" : "attention forward") +
                           " (B=" + std::to_string(B) + " T=" + std::to_string(T_) +
                           " heads=" + std::to_string(NH) + " head size=" + std::to_string(hs) +
                           ")";
  auto plan = std::make_unique<sdpa_plan>();
  // cuDNN up to 9.15.0 needs the padding mask in backward when T is no multiple of 128 (what
  // cuDNN's frontend adds for that version).
  plan->padding = backward && T_ % 128 != 0 && require_cudnn().cudnnGetVersion() <= 91500;
  graph_builder g(io_type<T>());
  const sdpa_shape shape{B, NH, T_, hs};
  if (backward) {
    build_backward(g, shape, plan->padding);
  } else {
    build_forward(g, shape);
  }
  descriptor& graph = g.finish(st.handle);
  choose_plan(st.handle, graph, *plan, backward, what);
  plan->kept = g.take();
  auto& ref = *plan;
  st.plans.emplace(key, std::move(plan));
  return ref;
}

// Grows the context's workspace and scratch to what a plan needs (after the stream's work: the
// old buffers may be in use).
void grow(const context& ctx, void*& buffer, std::size_t& bytes, std::size_t need,
          const char* what) {
  if (need <= bytes) return;
  ctx.synchronize();
  if (buffer) cudaFree(std::exchange(buffer, nullptr));
  bytes = 0;
  check(cudaMalloc(&buffer, need), what);
  bytes = need;
}
void reserve(const context& ctx, cudnn_state& st, std::size_t workspace, std::size_t buffers) {
  grow(ctx, st.workspace, st.workspace_bytes, workspace, "cudaMalloc(cuDNN workspace)");
  grow(ctx, st.buffers, st.buffer_bytes, buffers, "cudaMalloc(cuDNN attention scratch)");
}

void execute(cudnn_state& st, sdpa_plan& plan,
             const std::vector<std::pair<std::int64_t, void*>>& pointers, const std::string& what) {
  std::vector<std::int64_t> uids;
  std::vector<void*> data;
  for (const auto& [id, ptr] : pointers) {
    uids.push_back(id);
    data.push_back(ptr);
  }
  void* workspace = st.workspace;
  descriptor pack(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR, what + " variant pack");
  pack.set(CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, 1, &workspace)
      .set(CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR,
           static_cast<std::int64_t>(data.size()), data.data())
      .set_ints(CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, uids)
      .finalize();
  check_cudnn(require_cudnn().cudnnBackendExecute(st.handle, plan.plan->get(), pack.get()), what);
}

}  // namespace

template <class T>
void attention_cudnn_forward(const context& ctx, T* out, float* lse, const T* qkv, int B, int T_,
                             int C, int NH) {
  if constexpr (std::is_same_v<T, float>) {
    throw cuda_error("cuDNN attention computes in bf16 or fp16, not fp32 (use the fused kernel)");
  } else {
    check_shape(B, T_, C, NH);
    timed_op timing(ctx, op_family::attention_forward);
    const int hs = C / NH;
    float scale = 1.0f / std::sqrt(static_cast<float>(hs)), neg_inf = -INFINITY;
    if (T_ == 1) {
      single_token_forward<T><<<B * NH, 32, 0, ctx.stream()>>>(out, lse, qkv, B, NH, hs, scale);
      check_launch("single_token_forward");
      return;
    }
    sdpa_plan& plan = plan_for<T>(ctx, B, T_, NH, hs, false);
    cudnn_state& st = cudnn_access::state(ctx);
    reserve(ctx, st, static_cast<std::size_t>(plan.workspace), 0);
    auto* base = const_cast<T*>(qkv);
    execute(st, plan,
            {{kQ, base},
             {kK, base + C},
             {kV, base + 2 * C},
             {kO, out},
             {kStats, lse},
             {kScale, &scale},
             {kNegInf, &neg_inf}},
            "attention forward");
  }
}

template <class T>
void attention_cudnn_backward(const context& ctx, T* dqkv, const T* dout, const T* qkv,
                              const T* out, const float* lse, int B, int T_, int C, int NH) {
  if constexpr (std::is_same_v<T, float>) {
    throw cuda_error("cuDNN attention computes in bf16 or fp16, not fp32 (use the fused kernel)");
  } else {
    check_shape(B, T_, C, NH);
    timed_op timing(ctx, op_family::attention_backward);
    const int hs = C / NH;
    if (T_ == 1) {
      single_token_backward<T>
          <<<blocks_for(std::int64_t{B} * 3 * C), kThreads, 0, ctx.stream()>>>(dqkv, dout, B, C);
      check_launch("single_token_backward");
      return;
    }
    sdpa_plan& plan = plan_for<T>(ctx, B, T_, NH, hs, true);
    cudnn_state& st = cudnn_access::state(ctx);
    // The scratch: softmax_sum [B, NH, T] fp32, then (padding mask) B lengths twice, each
    // 16-byte aligned as every tensor is declared.
    const auto align16 = [](std::size_t n) { return (n + 15) / 16 * 16; };
    const std::size_t sums = align16(std::size_t{4} * B * NH * T_);
    const std::size_t one_length = align16(std::size_t{4} * B);
    const std::size_t lengths = plan.padding ? 2 * one_length : 0;
    reserve(ctx, st, static_cast<std::size_t>(plan.workspace), sums + lengths);
    float scale = 1.0f / std::sqrt(static_cast<float>(hs)), neg_inf = -INFINITY,
          neg_inf_padding = -INFINITY, one = 1.0f;
    auto* base = const_cast<T*>(qkv);
    auto* softmax_sum = static_cast<char*>(st.buffers);
    std::vector<std::pair<std::int64_t, void*>> pointers = {{kQ, base},
                                                            {kK, base + C},
                                                            {kV, base + 2 * C},
                                                            {kO, const_cast<T*>(out)},
                                                            {kDO, const_cast<T*>(dout)},
                                                            {kStats, const_cast<float*>(lse)},
                                                            {kDQ, dqkv},
                                                            {kDK, dqkv + C},
                                                            {kDV, dqkv + 2 * C},
                                                            {kScale, &scale},
                                                            {kNegInf, &neg_inf},
                                                            {kOne, &one},
                                                            {kSoftmaxSum, softmax_sum}};
    if (plan.padding) {
      auto* seq = reinterpret_cast<std::int32_t*>(softmax_sum + sums);
      fill_int<<<blocks_for(std::int64_t(one_length / 2)), kThreads, 0, ctx.stream()>>>(
          seq, static_cast<int>(one_length / 2), T_);  // both lengths and the gaps between
      check_launch("fill_int(sequence lengths)");
      pointers.push_back({kSeqLenQ, seq});
      pointers.push_back({kSeqLenKV, seq + one_length / 4});
      pointers.push_back({kNegInfPadding, &neg_inf_padding});
    }
    execute(st, plan, pointers, "attention backward");
  }
}

std::size_t attention_cudnn_workspace_bytes(const context& ctx) { return cudnn_access::bytes(ctx); }

int attention_cudnn_graph_operations(bool bf16_io, int B, int T_, int NH, int hs, bool backward,
                                     bool padding) {
  graph_builder g(bf16_io ? CUDNN_DATA_BFLOAT16 : CUDNN_DATA_HALF);
  const sdpa_shape shape{B, NH, T_, hs};
  if (backward) {
    build_backward(g, shape, padding);
  } else {
    build_forward(g, shape);
  }
  g.finish(nullptr);
  return static_cast<int>(g.operations());
}

bool cudnn_attention_available(std::string* why) {
  try {
    require_cudnn();
    return true;
  } catch (const cuda_error& e) {
    if (why) *why = e.what();
    return false;
  }
}

#define TROUPE_CUDNN_ATTENTION(T)                                                               \
  template void attention_cudnn_forward<T>(const context&, T*, float*, const T*, int, int, int, \
                                           int);                                                \
  template void attention_cudnn_backward<T>(const context&, T*, const T*, const T*, const T*,   \
                                            const float*, int, int, int, int);
TROUPE_CUDNN_ATTENTION(float)
TROUPE_CUDNN_ATTENTION(bf16)
TROUPE_CUDNN_ATTENTION(fp16)
#undef TROUPE_CUDNN_ATTENTION

}  // namespace troupe::kernels::cuda
