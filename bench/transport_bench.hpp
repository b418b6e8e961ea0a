// `troupe bench transport`: transport::ucx_transport between two processes (this one and a peer
// process, the troupe binary itself run as `bench transport-peer`) next to ucx_perftest measured
// in the same run on the same UCX transports: bandwidth of activation frames (64 KiB, 1 MiB,
// 16 MiB payloads) and 8-byte one-way latency. A benchmark: it prints, it asserts nothing.
#pragma once

#include <cstddef>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace troupe::bench {

struct transport_bench_options {
  bool quick = false;  // fewer frames and one repeat: for development
  int repeats = 0;     // ucx_perftest runs per row; 0 = 7 (1 with quick)
  // Row filters: "shm"/"tcp", "bandwidth"/"latency"/"latency-wait", "64KiB"/"1MiB"/"16MiB".
  // A row runs if, for each of the three kinds that has a word here, it matches one of them.
  std::vector<std::string> only;
  // The tensor of the bandwidth rows (transport_source.hpp). "engine": in the write state of
  // ucx_perftest's send buffer, from our own allocator: over shared memory written, in the
  // engine's payload storage (huge pages where the kernel gives them); over tcp never written.
  // "as-peer": the page size of ucx_perftest's buffer too (written in 4 KiB pages over shared
  // memory, never written over tcp). "written": written in 4 KiB pages on every transport.
  std::string source = "engine";
  std::string self_exe;                   // the troupe binary (runs the peer process)
  std::string perftest = "ucx_perftest";  // looked up on PATH unless it contains a '/'
};

struct transport_row {
  std::string metric;             // "bandwidth", "latency" (busy polling), "latency-wait" (wait())
  std::string transports;         // UCX_TLS of both sides, and of ucx_perftest
  std::size_t payload_bytes = 0;  // tensor bytes (bandwidth) or frame bytes (latency)
  std::size_t frame_bytes = 0;    // bytes on the wire per frame; ucx_perftest sends this size
  long frames = 0;                // timed frames (bandwidth) or round trips (latency)
  std::string tensor;  // bandwidth rows: "written", "unwritten" (never written) or "engine"
  // A row runs ours, ucx_perftest, ours, ..., ucx_perftest, ours (`repeats` runs of the peer,
  // one more of ours), and compares each peer run with the mean of our two runs around it (a
  // "pair"): runs that saw the same machine, a drift in a straight line cancelled.
  // This host's shared-memory latency moved between levels (0.075, 0.16 and 0.6 us for
  // ucx_perftest) from one fraction of a second to the next, so the best run of each side
  // compared runs from different levels whenever one side alone caught a fast moment; the
  // ratio of each pair does not (docs/transport.md).
  double ours = 0, peer = 0;  // the median run: bytes/s, or one-way latency in µs (its median)
  double ours_best = 0, peer_best = 0;  // the best run of each side
  double ours_mean = 0, peer_mean = 0;  // latency rows: mean one-way µs (median of runs)
  double ratio = 0;        // the median of the pairs' ratios (mean of ours around a peer run / it)
  bool met = false;        // the goal (see goal_text), on `ratio`
  std::string peer_error;  // non-empty: a ucx_perftest run failed
  std::vector<double> ours_runs, peer_runs;  // every run's figure, in run order
  // Each pair's ratio: the mean of our two runs around a peer run / that run (pairs whose peer
  // ran; with no failed peer run, (ours_runs[i] + ours_runs[i + 1]) / 2 / peer_runs[i]).
  std::vector<double> ratios;
  // Each ucx_perftest run / the one before it in this row: the peer against itself, a pair's
  // noise floor (this host: 0.96-1.06 for back-to-back 64 KiB shared-memory runs).
  std::vector<double> peer_self_ratios;
};

struct transport_bench_report {
  std::string frame;  // what a bandwidth frame is
  int repeats = 0;
  bool send_zero_copy_checked = false;  // every frame's iov held the tensor's own pointer
  bool receive_views_checked = false;   // the peer decoded every frame into views of its buffer
  std::map<std::string, std::string> transport_info;  // UCX_TLS -> what the endpoint used
  // The untimed warm-up pair before the first bandwidth row (its figures, bytes/s; 0 = none ran).
  double warmup_ours = 0, warmup_peer = 0;
  std::string source;  // the option it ran with
  // The most bytes of an unwritten send tensor found resident after a run (0: every one was
  // still unwritten, its sends read the zero page; -1: no row sent one).
  long long unwritten_resident_bytes = -1;
  // By tensor kind ("written", "engine"): the fewest and most bytes of a send tensor's mapping
  // found in huge pages after a run.
  std::map<std::string, std::pair<long long, long long>> huge_page_bytes;
  std::vector<transport_row> rows;
};

// Throws std::runtime_error with a one-line message (e.g. ucx_perftest missing from PATH).
transport_bench_report run_transport_bench(const transport_bench_options& options);
// The report (transport_report.cpp).
std::string goal_text(const transport_row& row);
std::string human_bytes(std::size_t bytes);  // "64 KiB", "1 MiB", "8 B"
std::string format_transport_report(const transport_bench_report& report);
std::string transport_report_json(const transport_bench_report& report);

// The peer process (`troupe bench transport-peer`, hidden). Returns an exit code.
struct transport_peer_options {
  int fd = -1;  // socket to the measuring process
  std::string transports;
  std::string mode;             // "bandwidth", "latency", "latency-wait"
  long warmup = 0, frames = 0;  // bandwidth: acknowledged after warmup and after warmup + frames
};
int run_transport_peer(const transport_peer_options& options);

}  // namespace troupe::bench
