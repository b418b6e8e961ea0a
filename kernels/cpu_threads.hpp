// How many threads the CPU compute calls of the calling thread use: our OpenMP kernels and
// OpenBLAS's GEMMs. Stage actors run on their own threads and each sizes its own calls, so that
// stages sharing a machine do not oversubscribe its cores.
//
// Invariants (OpenBLAS 0.3.21, OpenMP build, as linked here):
//  - The setting belongs to the calling thread (OpenMP's nthreads-var): other threads keep theirs.
//  - OpenBLAS follows it per call: its num_cpu_avail() (common_thread.h) reads the calling
//    thread's omp_get_max_threads(), and with 1 runs the GEMM in the calling thread without its
//    thread server. Concurrent calls from threads that all use 1 are safe and give the results
//    of the same call made alone.
//  - With more than 1, OpenBLAS 0.3.21 is not made for concurrent callers: it keeps one set of
//    thread buffers (NUM_PARALLEL = 1 in this build), so concurrent multi-threaded calls
//    spin-wait for each other, and a caller whose count differs from the last caller's rewrites
//    process-wide state (blas_cpu_number, the shared thread buffers) that another caller may be
//    using. Give several concurrent compute threads 1 thread each (or the same count, accepting
//    that their GEMMs serialise).
#pragma once

namespace troupe::kernels {

// For the calling thread: OpenMP regions and OpenBLAS calls use n threads (omp_set_num_threads).
// Throws std::invalid_argument when n < 1.
void set_compute_threads(int n);
// The calling thread's setting (omp_get_max_threads()).
int compute_threads();

}  // namespace troupe::kernels
