// Softmax cross-entropy over the first V of Vp columns (padded columns are ignored in the
// log-sum-exp and get zero gradient). Rows whose target is ignore_index are not counted.
// Per-row losses are summed serially in double (deterministic). The fused backward OVERWRITES
// dlogits, which may alias logits: each row's max and sum are computed before it is written.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/cpu_ops.hpp"

namespace troupe::kernels {

namespace {

// Validates shapes and targets; returns the number of counted rows.
std::int64_t count_targets(const std::int32_t* targets, int N, int V, int Vp, int ignore_index) {
  if (V <= 0 || Vp < V) {
    throw std::invalid_argument("cross_entropy: need 0 < V <= Vp, got V=" + std::to_string(V) +
                                " Vp=" + std::to_string(Vp));
  }
  std::int64_t count = 0;
  for (int n = 0; n < N; ++n) {
    const int t = targets[n];
    if (t == ignore_index) continue;
    if (t < 0 || t >= V) {
      throw std::out_of_range("cross_entropy: target " + std::to_string(t) + " at row " +
                              std::to_string(n) + " outside [0, " + std::to_string(V) + ")");
    }
    ++count;
  }
  return count;
}

struct row_stats {
  float max;
  double sum;  // sum of exp(x - max) over the first V columns
};

inline row_stats softmax_stats(const float* x, int V) {
  float mx = x[0];
  for (int j = 1; j < V; ++j) mx = x[j] > mx ? x[j] : mx;
  double sum = 0.0;
  for (int j = 0; j < V; ++j) sum += std::exp(x[j] - mx);
  return {mx, sum};
}

}  // namespace

cross_entropy_result cross_entropy_forward(float* losses, const float* logits,
                                           const std::int32_t* targets, int N, int V, int Vp,
                                           int ignore_index) {
  cross_entropy_result r;
  if (N <= 0) return r;
  r.count = count_targets(targets, N, V, Vp, ignore_index);
  std::vector<double> row_loss(static_cast<std::size_t>(N), 0.0);
#pragma omp parallel for schedule(static)
  for (int n = 0; n < N; ++n) {
    const int t = targets[n];
    if (t == ignore_index) continue;
    const float* x = logits + static_cast<std::int64_t>(n) * Vp;
    const row_stats s = softmax_stats(x, V);
    row_loss[static_cast<std::size_t>(n)] =
        static_cast<double>(s.max) + std::log(s.sum) - static_cast<double>(x[t]);
  }
  for (int n = 0; n < N; ++n) {
    const double l = row_loss[static_cast<std::size_t>(n)];
    r.loss_sum += l;
    if (losses) losses[n] = static_cast<float>(l);
  }
  return r;
}

cross_entropy_result softmax_cross_entropy_backward(float* dlogits, const float* logits,
                                                    const std::int32_t* targets, int N, int V,
                                                    int Vp, int ignore_index, float grad_scale) {
  cross_entropy_result r;
  if (N <= 0) return r;
  r.count = count_targets(targets, N, V, Vp, ignore_index);
  const float factor =
      r.count > 0
          ? static_cast<float>(static_cast<double>(grad_scale) / static_cast<double>(r.count))
          : 0.0f;
  std::vector<double> row_loss(static_cast<std::size_t>(N), 0.0);
#pragma omp parallel for schedule(static)
  for (int n = 0; n < N; ++n) {
    const int t = targets[n];
    const float* x = logits + static_cast<std::int64_t>(n) * Vp;
    float* d = dlogits + static_cast<std::int64_t>(n) * Vp;
    if (t == ignore_index) {
      for (int j = 0; j < Vp; ++j) d[j] = 0.0f;
      continue;
    }
    // Read everything this row needs before the (possibly aliased) row is overwritten.
    const row_stats s = softmax_stats(x, V);
    const float xt = x[t];
    row_loss[static_cast<std::size_t>(n)] =
        static_cast<double>(s.max) + std::log(s.sum) - static_cast<double>(xt);
    const float mx = s.max;
    const float inv_sum = static_cast<float>(1.0 / s.sum);
    for (int j = 0; j < V; ++j) d[j] = std::exp(x[j] - mx) * inv_sum * factor;
    d[t] = (std::exp(xt - mx) * inv_sum - 1.0f) * factor;
    for (int j = V; j < Vp; ++j) d[j] = 0.0f;
  }
  for (int n = 0; n < N; ++n) r.loss_sum += row_loss[static_cast<std::size_t>(n)];
  return r;
}

namespace {

// The shard's columns that are real vocabulary: [0, real) of its `cols`.
int real_columns(const vocab_shard& s) { return std::max(0, std::min(s.cols, s.V - s.first)); }

}  // namespace

void vocab_shard_max(float* row_max, const float* logits, int N, const vocab_shard& s) {
  const int real = real_columns(s);
#pragma omp parallel for schedule(static)
  for (int n = 0; n < N; ++n) {
    const float* x = logits + static_cast<std::int64_t>(n) * s.cols;
    float mx = -std::numeric_limits<float>::infinity();
    for (int j = 0; j < real; ++j) mx = x[j] > mx ? x[j] : mx;
    row_max[n] = mx;
  }
}

void vocab_shard_stats(double* stats, const float* logits, const std::int32_t* targets,
                       const float* row_max, int N, const vocab_shard& s, int ignore_index) {
  const int real = real_columns(s);
#pragma omp parallel for schedule(static)
  for (int n = 0; n < N; ++n) {
    double sum = 0.0, xt = 0.0;
    if (targets[n] != ignore_index) {
      const float* x = logits + static_cast<std::int64_t>(n) * s.cols;
      const float mx = row_max[n];
      for (int j = 0; j < real; ++j) sum += std::exp(x[j] - mx);
      const int t = targets[n] - s.first;
      if (t >= 0 && t < real) xt = x[t];
    }
    stats[2 * n] = sum;
    stats[2 * n + 1] = xt;
  }
}

cross_entropy_result vocab_parallel_loss(const std::int32_t* targets, const float* row_max,
                                         const double* stats, int N, int V, int Vp,
                                         int ignore_index) {
  cross_entropy_result r;
  if (N <= 0) return r;
  r.count = count_targets(targets, N, V, Vp, ignore_index);
  for (int n = 0; n < N; ++n) {
    if (targets[n] == ignore_index) continue;
    r.loss_sum += static_cast<double>(row_max[n]) + std::log(stats[2 * n]) - stats[2 * n + 1];
  }
  return r;
}

void vocab_shard_backward(float* dlogits, const float* logits, const std::int32_t* targets,
                          const float* row_max, const double* stats, int N, const vocab_shard& s,
                          int ignore_index, float grad_scale, std::int64_t count) {
  const int real = real_columns(s);
  const float factor =
      count > 0 ? static_cast<float>(static_cast<double>(grad_scale) / static_cast<double>(count))
                : 0.0f;
#pragma omp parallel for schedule(static)
  for (int n = 0; n < N; ++n) {
    const float* x = logits + static_cast<std::int64_t>(n) * s.cols;
    float* d = dlogits + static_cast<std::int64_t>(n) * s.cols;
    if (targets[n] == ignore_index) {
      for (int j = 0; j < s.cols; ++j) d[j] = 0.0f;
      continue;
    }
    const float mx = row_max[n];
    const float inv_sum = static_cast<float>(1.0 / stats[2 * n]);
    const int t = targets[n] - s.first;
    const float xt = t >= 0 && t < real ? x[t] : 0.0f;  // read before the row is overwritten
    for (int j = 0; j < real; ++j) d[j] = std::exp(x[j] - mx) * inv_sum * factor;
    if (t >= 0 && t < real) d[t] = (std::exp(xt - mx) * inv_sum - 1.0f) * factor;
    for (int j = real; j < s.cols; ++j) d[j] = 0.0f;
  }
}

}  // namespace troupe::kernels
