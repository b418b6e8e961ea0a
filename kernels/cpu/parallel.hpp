// Splitting channels among OpenMP threads for deterministic reductions over rows: each thread
// owns a block of channels (a multiple of 16 floats wide) and sums every row for it, in row
// order, so results do not depend on the thread count's effect on summation order.
#pragma once

#include <omp.h>

#include <algorithm>

namespace troupe::kernels {

struct channel_block {
  int begin;
  int end;
  int size() const { return end - begin; }
};

// This thread's block of [0, C). Call inside an OpenMP parallel region.
inline channel_block thread_channel_block(int C) {
  const int nt = omp_get_num_threads();
  const int tid = omp_get_thread_num();
  const int chunk = ((C + nt - 1) / nt + 15) / 16 * 16;
  const int begin = std::min(C, tid * chunk);
  return {begin, std::min(C, begin + chunk)};
}

}  // namespace troupe::kernels
