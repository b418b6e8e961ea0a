// Global L2 gradient norm and torch.nn.utils.clip_grad_norm_-style clipping.
// Sums of squares accumulate in double over fixed-size blocks that are then added in order,
// so the norm is deterministic for any thread count. Clipping multiplies every gradient by
// coef = max_norm / (norm + 1e-6) only when coef < 1; max_norm <= 0 disables it.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <span>
#include <vector>

#include "kernels/cpu_ops.hpp"

namespace troupe::kernels {

namespace {

constexpr std::int64_t kBlock = 1 << 15;

struct block {
  float* data;
  std::int64_t n;
};

std::vector<block> split_blocks(std::span<const gradient_span> grads) {
  std::vector<block> blocks;
  for (const gradient_span& g : grads) {
    for (std::int64_t off = 0; off < g.n; off += kBlock) {
      blocks.push_back({g.data + off, std::min(kBlock, g.n - off)});
    }
  }
  return blocks;
}

}  // namespace

double global_grad_norm(std::span<const gradient_span> grads) {
  const std::vector<block> blocks = split_blocks(grads);
  const std::int64_t nb = static_cast<std::int64_t>(blocks.size());
  std::vector<double> partial(blocks.size(), 0.0);
#pragma omp parallel for schedule(static)
  for (std::int64_t i = 0; i < nb; ++i) {
    const float* x = blocks[static_cast<std::size_t>(i)].data;
    const std::int64_t n = blocks[static_cast<std::size_t>(i)].n;
    double s = 0.0;
#pragma omp simd reduction(+ : s)
    for (std::int64_t j = 0; j < n; ++j) s += static_cast<double>(x[j]) * x[j];
    partial[static_cast<std::size_t>(i)] = s;
  }
  double total = 0.0;
  for (double p : partial) total += p;
  return std::sqrt(total);
}

double clip_grad_norm(std::span<const gradient_span> grads, double max_norm) {
  const double norm = global_grad_norm(grads);
  if (max_norm <= 0.0) return norm;
  const double coef = max_norm / (norm + 1e-6);
  if (!(coef < 1.0)) return norm;
  const float c = static_cast<float>(coef);
  const std::vector<block> blocks = split_blocks(grads);
  const std::int64_t nb = static_cast<std::int64_t>(blocks.size());
#pragma omp parallel for schedule(static)
  for (std::int64_t i = 0; i < nb; ++i) {
    float* x = blocks[static_cast<std::size_t>(i)].data;
    const std::int64_t n = blocks[static_cast<std::size_t>(i)].n;
#pragma omp simd
    for (std::int64_t j = 0; j < n; ++j) x[j] *= c;
  }
  return norm;
}

}  // namespace troupe::kernels
