// The machine's measured FP32 peak: every thread runs independent FMA chains with the widest
// vector unit the CPU has (AVX-512, AVX2+FMA, or SSE), chosen at run time.
#pragma once

#include <string>

namespace troupe::bench {

struct peak_result {
  double flops_per_s = 0;  // all threads together
  int threads = 0;
  std::string isa;  // "avx512f", "avx2+fma", "sse2"
};

peak_result measure_fp32_peak(double seconds = 0.3);

}  // namespace troupe::bench
