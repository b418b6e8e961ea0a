// Per-thread compute thread count. See cpu_threads.hpp for what OpenBLAS does with it.
#include "kernels/cpu_threads.hpp"

#include <omp.h>

#include <stdexcept>
#include <string>

namespace troupe::kernels {

void set_compute_threads(int n) {
  if (n < 1) {
    throw std::invalid_argument("compute threads must be at least 1, got " + std::to_string(n));
  }
  omp_set_num_threads(n);
}

int compute_threads() { return omp_get_max_threads(); }

}  // namespace troupe::kernels
