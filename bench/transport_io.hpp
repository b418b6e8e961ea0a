// Sockets, processes and CPU pinning shared by `troupe bench transport` (transport_bench.cpp,
// the measuring side) and its peer process (transport_peer.cpp). No UCX.
#pragma once

#include <sched.h>
#include <sys/types.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "messages/wire_codec.hpp"

namespace troupe::bench::transport_io {

using clock_type = std::chrono::steady_clock;
constexpr auto measurement_deadline = std::chrono::seconds(120);
constexpr auto reap_deadline = std::chrono::seconds(10);
inline const char* const peer_line_ok = "ok";

[[noreturn]] inline void fail(const std::string& what) { throw std::runtime_error(what); }

// Whole writes and reads (false on a closed or failed socket, or, reading, past the deadline).
bool write_all(int fd, const void* data, std::size_t n);
bool read_all(int fd, void* data, std::size_t n, clock_type::time_point deadline);
// A length-prefixed blob (a UCX worker address) over a socket; both throw on failure.
void send_blob(int fd, const std::vector<std::uint8_t>& blob);
std::vector<std::uint8_t> receive_blob(int fd);
// waitpid with a deadline: the wait status, or -1 after killing a process that outlived it.
int reap(pid_t pid, clock_type::time_point deadline);

// Both sides of every measurement, ours and ucx_perftest's, run pinned one process per core:
// the measuring side on the first allowed CPU, the other side on the second. Unpinned, the
// scheduler's placement moved ucx_perftest's 8-byte latency between 0.07 and 0.16 us from one
// run to the next on a 2-vCPU machine; pinned, it stayed within 0.160-0.166 us.
class cpu_pin {
 public:
  // side 0: the measuring side, 1: the other side. No pinning with fewer than two CPUs.
  explicit cpu_pin(int side) {
    static const cpu_set_t allowed = [] {  // the process's CPUs before any pinning
      cpu_set_t set;
      CPU_ZERO(&set);
      if (::sched_getaffinity(0, sizeof set, &set) != 0) CPU_ZERO(&set);
      return set;
    }();
    if (CPU_COUNT(&allowed) < 2 || ::sched_getaffinity(0, sizeof saved_, &saved_) != 0) return;
    int seen = 0;
    for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) {
      if (!CPU_ISSET(cpu, &allowed) || seen++ != side) continue;
      cpu_set_t one;
      CPU_ZERO(&one);
      CPU_SET(cpu, &one);
      pinned_ = ::sched_setaffinity(0, sizeof one, &one) == 0;
      break;
    }
  }
  ~cpu_pin() {
    if (pinned_) ::sched_setaffinity(0, sizeof saved_, &saved_);
  }
  cpu_pin(const cpu_pin&) = delete;
  cpu_pin& operator=(const cpu_pin&) = delete;

 private:
  cpu_set_t saved_{};
  bool pinned_ = false;
};

// posix_spawn with UCX_TLS replaced; stdout and stderr to out_fd (or /dev/null when -1).
// side: the CPU side (cpu_pin) the process runs on.
pid_t spawn(const std::vector<std::string>& args, const std::string& tls, int out_fd, int side);
// The path of a program on PATH (or the name itself if it holds a '/'), "" if not found.
std::string find_program(const std::string& name);
// A TCP port nobody listens on now (bound to port 0, then released): fresh for every run.
int fresh_port();
// The wire limits both sides decode bench frames with.
messages::wire::limits bench_limits();

}  // namespace troupe::bench::transport_io
