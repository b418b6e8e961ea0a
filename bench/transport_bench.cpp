// `troupe bench transport` (see transport_bench.hpp). This process is rank 0; the peer process
// (rank 1, `troupe bench transport-peer`) is spawned per measurement, swaps worker addresses over
// a socketpair, and is always reaped (killed if late). Bandwidth frames are real activation
// frames (messages::wire::encode of a link_message, encoded per send, decoded by the peer);
// latency frames are 8 raw bytes echoed back. ucx_perftest runs as server + client on a fresh
// port with the same UCX_TLS. A row runs `repeats` ucx_perftest runs, each between two of ours,
// and compares each with the mean of the two around it (transport_row).
#include "bench/transport_bench.hpp"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <set>
#include <sstream>
#include <stdexcept>
#include <thread>

#include "bench/transport_io.hpp"
#include "bench/transport_source.hpp"
#include "messages/wire_codec.hpp"
#include "transport/ucx_transport.hpp"

namespace troupe::bench {
namespace {

using namespace transport_io;

using std::chrono::seconds;
namespace wire = messages::wire;

// Bandwidth frames in flight: 32 like ucx_perftest's tag_bw window, at most 256 MiB.
std::size_t send_window(std::size_t frame_bytes) {
  return std::clamp<std::size_t>((std::size_t{256} << 20) / frame_bytes, 2, 32);
}

// ---- ucx_perftest ----------------------------------------------------------------------------

struct perftest_result {
  double bytes_per_s = 0, latency_median_us = 0, latency_mean_us = 0;
  std::string error;
};

// One ucx_perftest run (server + client on 127.0.0.1), parsed from the client's CSV (-v) line
// "iterations,50.0_percentile_lat,avg_lat,overall_lat,avg_bw,overall_bw,avg_mr,overall_mr".
perftest_result run_perftest(const std::string& exe, const std::string& tls,
                             const std::string& test, std::size_t size, long frames, long warmup,
                             bool sleep_mode) {
  const std::string port = std::to_string(fresh_port());
  const pid_t server = spawn({exe, "-p", port}, tls, -1, 1);
  const auto deadline = clock_type::now() + measurement_deadline;
  std::string out;
  int status = 0;
  for (int attempt = 0; attempt < 200; ++attempt) {  // until the server listens
    int pipe_fd[2];
    if (::pipe(pipe_fd) != 0) fail("transport bench: pipe failed");
    std::vector<std::string> args = {exe,  "127.0.0.1",
                                     "-p", port,
                                     "-t", test,
                                     "-s", std::to_string(size),
                                     "-n", std::to_string(frames),
                                     "-w", std::to_string(warmup),
                                     "-v"};
    if (sleep_mode) args.insert(args.end(), {"-E", "sleep"});
    const pid_t client = spawn(args, tls, pipe_fd[1], 0);
    ::close(pipe_fd[1]);
    out.clear();
    for (char buf[4096];;) {
      const auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline - clock_type::now());
      pollfd pfd{pipe_fd[0], POLLIN, 0};
      if (left.count() <= 0 || ::poll(&pfd, 1, static_cast<int>(left.count())) <= 0) break;
      const ssize_t n = ::read(pipe_fd[0], buf, sizeof buf);
      if (n <= 0) break;
      out.append(buf, static_cast<std::size_t>(n));
    }
    ::close(pipe_fd[0]);
    status = reap(client, deadline);
    if (status == 0 || out.find("Connection refused") == std::string::npos) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(25));
  }
  reap(server, clock_type::now() + reap_deadline);
  perftest_result r;
  std::string last, error_line;
  std::istringstream lines(out);
  for (std::string line; std::getline(lines, line);) {
    line.erase(0, line.find_first_not_of(' '));
    if (!line.empty() && std::isdigit(static_cast<unsigned char>(line[0]))) last = line;
    if (error_line.empty() && line.find("ERROR") != std::string::npos) error_line = line;
  }
  long iterations = 0;
  double median = 0, mean = 0, overall = 0, bw = 0, overall_bw = 0;
  if (status != 0 || std::sscanf(last.c_str(), "%ld,%lf,%lf,%lf,%lf,%lf", &iterations, &median,
                                 &mean, &overall, &bw, &overall_bw) != 6) {
    r.error = "ucx_perftest " + test + " failed (wait status " + std::to_string(status) +
              "): " + (error_line.empty() ? out.substr(0, out.find('\n')) : error_line);
    return r;
  }
  r.latency_median_us = median;
  r.latency_mean_us = overall;
  r.bytes_per_s = overall_bw * 1024.0 * 1024.0;  // ucx_perftest's MB/s are MiB/s
  return r;
}

// ---- our side --------------------------------------------------------------------------------

wire::envelope activation(const std::shared_ptr<messages::payload<float>>& tensor) {
  messages::link_message m;
  m.header.kind = messages::link_kind::activation;
  m.header.shape = {1, static_cast<std::int64_t>(tensor->size() / 256), 256};
  m.data = tensor;
  return wire::envelope{1, 0, 0, false, std::move(m)};
}

// Rank 0's end of one measurement: spawns the peer process, connects, and on finish() says bye
// (an empty frame), closes, reads the peer's status line and reaps it. Kills it if abandoned.
class peer_session {
 public:
  peer_session(const transport_bench_options& o, const std::string& tls, const std::string& mode,
               long warmup, long frames) {
    int sp[2];
    if (::socketpair(AF_UNIX, SOCK_STREAM, 0, sp) != 0) fail("transport bench: socketpair failed");
    sock_ = sp[0];
    ::fcntl(sock_, F_SETFD, FD_CLOEXEC);
    pid_ = spawn(
        {o.self_exe, "bench", "transport-peer", "--fd", std::to_string(sp[1]), "--transports", tls,
         "--mode", mode, "--warmup", std::to_string(warmup), "--frames", std::to_string(frames)},
        tls, 2, 1);
    ::close(sp[1]);
    transport::ucx_options uo;
    uo.transports = tls;
    transport = std::make_unique<transport::ucx_transport>(0, uo);
    const auto theirs = receive_blob(sock_);
    send_blob(sock_, transport->address());
    transport->connect(1, theirs);
  }
  ~peer_session() {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
    transport.reset();
    if (sock_ >= 0) ::close(sock_);
  }
  peer_session(const peer_session&) = delete;
  peer_session& operator=(const peer_session&) = delete;

  // Returns the peer's status line ("ok ..." when it checked everything it received).
  std::string finish() {
    bool sent = false;
    transport->send(1, {}, [&](bool, const std::string&) { sent = true; });
    const auto deadline = clock_type::now() + reap_deadline;
    while (!sent && clock_type::now() < deadline) transport->progress();
    transport.reset();
    std::string line;
    char c;
    while (read_all(sock_, &c, 1, deadline) && c != '\n') line += c;
    const int status = reap(std::exchange(pid_, -1), deadline);
    if (status != 0 && line.rfind(peer_line_ok, 0) == 0)
      line = "peer process exited with status " + std::to_string(status);
    return line.empty() ? "peer process sent no status" : line;
  }
  std::unique_ptr<transport::ucx_transport> transport;

 private:
  cpu_pin pin_{0};  // this process measures on the first CPU while the session lasts
  pid_t pid_ = -1;
  int sock_ = -1;
};

void check_deadline(clock_type::time_point deadline, const char* what) {
  if (clock_type::now() > deadline) fail(std::string("transport bench: ") + what + " timed out");
}

struct bandwidth_run {
  double bytes_per_s = 0;
  std::size_t frame_bytes = 0;
  bool zero_copy = true, views = false;
  long long unwritten_resident = -1;  // an unwritten tensor's resident bytes after the run
  long long huge_page_bytes = -1;     // a written tensor's mapping: bytes in huge pages after it
  std::string info;
};

bandwidth_run ours_bandwidth(const transport_bench_options& o, const std::string& tls,
                             std::size_t payload_bytes, long warmup, long frames,
                             const std::string& kind) {
  peer_session s(o, tls, "bandwidth", warmup, frames);
  const auto tensor = kind == "engine"    ? engine_tensor(payload_bytes)
                      : kind == "written" ? written_tensor(payload_bytes)
                                          : unwritten_tensor(payload_bytes);
  const wire::envelope e = activation(tensor);
  bandwidth_run run;
  run.info = s.transport->transport_info(1);
  long acks = 0;
  std::size_t in_flight = 0;
  std::string error;
  s.transport->on_receive(
      [&](int, std::shared_ptr<messages::aligned_buffer>, std::size_t) { ++acks; });
  const auto deadline = clock_type::now() + measurement_deadline;
  auto phase = [&](long count, long until_acks) {
    for (long sent = 0, spins = 0; acks < until_acks; ++spins) {
      while (in_flight < send_window(payload_bytes) && sent < count) {
        auto f = std::make_shared<wire::frame>(wire::encode(e));
        run.zero_copy &= std::any_of(f->iov.begin(), f->iov.end(), [&](const auto& piece) {
          return piece.first == tensor->data() && piece.second == payload_bytes;
        });
        run.frame_bytes = f->bytes;
        ++in_flight;
        ++sent;
        s.transport->send(1, f->iov, [f, &in_flight, &error](bool ok, const std::string& why) {
          --in_flight;
          if (!ok && error.empty()) error = why;
        });
      }
      s.transport->progress();
      if (!error.empty()) fail("transport bench: " + error);
      if (spins % 4096 == 4095) check_deadline(deadline, "bandwidth run");
    }
  };
  phase(warmup, 1);
  const auto t0 = clock_type::now();
  phase(frames, 2);
  const double elapsed = std::chrono::duration<double>(clock_type::now() - t0).count();
  run.bytes_per_s = static_cast<double>(run.frame_bytes) * static_cast<double>(frames) / elapsed;
  if (kind == "unwritten")
    run.unwritten_resident = resident_bytes(tensor->data());
  else
    run.huge_page_bytes = huge_page_bytes(tensor->data());
  const std::string status = s.finish();
  if (status.rfind(peer_line_ok, 0) != 0) fail("transport bench: peer: " + status);
  run.views = status.find("views=1") != std::string::npos;
  return run;
}

struct latency_run {
  double median_us = 0, mean_us = 0;
  std::string info;
};

latency_run ours_latency(const transport_bench_options& o, const std::string& tls,
                         const std::string& mode, long warmup, long frames) {
  peer_session s(o, tls, mode, warmup, frames);
  const bool wait_mode = mode == "latency-wait";
  latency_run run;
  run.info = s.transport->transport_info(1);
  std::uint64_t word = 0x7472'6f75'7065'0008;
  const transport::iov_list iov = {{&word, sizeof word}};
  std::vector<double> one_way_us;
  one_way_us.reserve(static_cast<std::size_t>(frames));
  const auto deadline = clock_type::now() + measurement_deadline;
  // A ping-pong driven by the receive callback, which sends the next frame (as an actor answers
  // one message with the next). One clock reading per round trip, as ucx_perftest takes one per
  // iteration, right after each send: two readings are one round trip apart, and the reading
  // (~20 ns here, a quarter of a shared-memory one-way latency) is not inside it.
  const long total = warmup + frames + 1;  // the last frame only ends the last round trip
  long sent = 0, received = 0;
  clock_type::time_point previous;
  auto send_next = [&] {
    s.transport->send(1, iov, [](bool, const std::string&) {});
    const auto now = clock_type::now();
    if (sent++ > warmup)
      one_way_us.push_back(std::chrono::duration<double, std::micro>(now - previous).count() / 2);
    previous = now;
  };
  s.transport->on_receive([&](int, std::shared_ptr<messages::aligned_buffer>, std::size_t) {
    if (++received < total) send_next();
  });
  send_next();
  for (unsigned spins = 0; received < total; ++spins) {
    if (s.transport->progress() == 0 && wait_mode)
      s.transport->wait(std::chrono::milliseconds(100));
    if (spins % 4096 == 4095) check_deadline(deadline, "latency run");
  }
  const std::string status = s.finish();
  if (status.rfind(peer_line_ok, 0) != 0) fail("transport bench: peer: " + status);
  double sum = 0;
  for (double v : one_way_us) sum += v;
  run.mean_us = sum / static_cast<double>(one_way_us.size());
  std::nth_element(one_way_us.begin(), one_way_us.begin() + one_way_us.size() / 2,
                   one_way_us.end());
  run.median_us = one_way_us[one_way_us.size() / 2];
  return run;
}

// Our figure around a ucx_perftest run: the mean of our runs just before and just after it (the
// last two so far). A row runs ours, peer, ours, peer, ..., peer, ours: every run follows one of
// the other program, and a drift of the host in a straight line over the three runs cancels
// (in pairs, ours then peer, the side that ran second would meet the machine a run later in every
// pair).
double around(const std::vector<double>& ours_runs) {
  return (ours_runs[ours_runs.size() - 2] + ours_runs.back()) / 2;
}

// --only: which rows run (see transport_bench_options::only).
class row_filter {
 public:
  explicit row_filter(const std::vector<std::string>& words) {
    for (const auto& w : words) {
      if (w == "shm" || w == "tcp")
        transports_.insert(w == "shm" ? "posix,cma,self" : "tcp");
      else if (w == "bandwidth" || w == "latency" || w == "latency-wait")
        metrics_.insert(w);
      else if (w == "64KiB" || w == "1MiB" || w == "16MiB")
        sizes_.insert(w == "64KiB"  ? std::size_t{64} << 10
                      : w == "1MiB" ? std::size_t{1} << 20
                                    : std::size_t{16} << 20);
      else
        fail("--only: unknown row kind '" + w +
             "' (shm, tcp, bandwidth, latency, latency-wait, 64KiB, 1MiB, 16MiB)");
    }
  }
  // payload 0: a latency row, which no size word excludes.
  bool operator()(const std::string& tls, const std::string& metric, std::size_t payload) const {
    return (transports_.empty() || transports_.count(tls)) &&
           (metrics_.empty() || metrics_.count(metric)) &&
           (sizes_.empty() || payload == 0 || sizes_.count(payload));
  }

 private:
  std::set<std::string> transports_, metrics_;
  std::set<std::size_t> sizes_;
};

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  const std::size_t half = v.size() / 2;
  std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(half), v.end());
  if (v.size() % 2 == 1) return v[half];
  return (v[half] + *std::max_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(half))) /
         2;
}

// A row's figures from its runs: the median run of each side, the best of each, and the verdict
// on the median of the pairs' ratios (higher is better for bandwidth, lower for latency).
void settle(transport_row& row, bool higher_is_better, const std::vector<double>& ours_means,
            const std::vector<double>& peer_means) {
  auto best = [&](const std::vector<double>& runs) {
    if (runs.empty()) return 0.0;
    return higher_is_better ? *std::max_element(runs.begin(), runs.end())
                            : *std::min_element(runs.begin(), runs.end());
  };
  row.ours = median(row.ours_runs);
  row.peer = median(row.peer_runs);
  row.ours_best = best(row.ours_runs);
  row.peer_best = best(row.peer_runs);
  row.ours_mean = median(ours_means);
  row.peer_mean = median(peer_means);
  row.ratio = median(row.ratios);
  row.peer_self_ratios.clear();
  for (std::size_t i = 1; i < row.peer_runs.size(); ++i)
    row.peer_self_ratios.push_back(row.peer_runs[i] / row.peer_runs[i - 1]);
  row.met = !row.ratios.empty() && (higher_is_better ? row.ratio >= 0.9 : row.ratio <= 2);
}

}  // namespace

transport_bench_report run_transport_bench(const transport_bench_options& o) {
  const std::string perftest = find_program(o.perftest);
  if (perftest.empty())
    fail(o.perftest + " not found on PATH: install Debian's ucx-utils (the peer measured against)");
  if (o.self_exe.empty()) fail("transport bench: the troupe binary's path is unknown");
  transport_bench_report report;
  report.repeats = o.repeats > 0 ? o.repeats : (o.quick ? 1 : 7);
  report.frame =
      "messages::wire activation frame (link_message, shape [1, n/256, 256]), encoded per send, "
      "decoded by the receiver";
  report.send_zero_copy_checked = report.receive_views_checked = true;
  if (o.source != "as-peer" && o.source != "written" && o.source != "engine")
    fail("--source: unknown '" + o.source + "' (as-peer, written or engine)");
  report.source = o.source;
  const std::size_t bytes_per_run = o.quick ? std::size_t{256} << 20 : std::size_t{2} << 30;
  const long latency_frames = o.quick ? 10000 : 50000, wait_frames = o.quick ? 2000 : 10000;
  auto log = [](const std::string& what, const std::string& tls) {
    std::fprintf(stderr, "troupe bench transport: %s over %s\n", what.c_str(), tls.c_str());
  };
  const row_filter wanted(o.only);
  for (const std::string tls : {"posix,cma,self", "tcp"}) {
    for (const std::size_t payload :
         {std::size_t{64} << 10, std::size_t{1} << 20, std::size_t{16} << 20}) {
      if (!wanted(tls, "bandwidth", payload)) continue;
      log("bandwidth " + human_bytes(payload), tls);
      transport_row row;
      row.metric = "bandwidth";
      row.transports = tls;
      row.payload_bytes = payload;
      row.frames = std::max<long>(50, static_cast<long>(bytes_per_run / payload));
      // Enough warm-up frames to fill the window several times: the receiver's buffer pool then
      // holds every buffer in use (steady state; a buffer's first use faults its pages in).
      const long warmup = std::max<long>(4 * long(send_window(payload)), row.frames / 10);
      // ucx_perftest's tcp sender never writes its buffer (transport_source.hpp); a tensor
      // never written sends the kernel's zero page whoever allocated it.
      row.tensor = o.source == "written"  ? "written"
                   : tls == "tcp"         ? "unwritten"
                   : o.source == "engine" ? "engine"
                                          : "written";
      // One untimed run of each side first: the first run of a bench process ran 10-25% slower
      // than the ones after it (5.3-6.6 against 6.5-8.7 GB/s at 64 KiB; a 250 ms run of any
      // rendezvous size before it removed that, a 40 ms one did not), and it is always ours.
      if (report.warmup_ours == 0) {
        const auto run = ours_bandwidth(o, tls, payload, warmup, row.frames, row.tensor);
        report.warmup_ours = run.bytes_per_s;
        report.warmup_peer =
            run_perftest(perftest, tls, "tag_bw", run.frame_bytes, row.frames, warmup, false)
                .bytes_per_s;
      }
      auto ours_run = [&] {
        const auto run = ours_bandwidth(o, tls, payload, warmup, row.frames, row.tensor);
        row.ours_runs.push_back(run.bytes_per_s);
        report.unwritten_resident_bytes =
            std::max(report.unwritten_resident_bytes, run.unwritten_resident);
        if (run.huge_page_bytes >= 0) {
          auto [at, fresh] = report.huge_page_bytes.try_emplace(row.tensor, run.huge_page_bytes,
                                                                run.huge_page_bytes);
          at->second.first = std::min(at->second.first, run.huge_page_bytes);
          at->second.second = std::max(at->second.second, run.huge_page_bytes);
        }
        row.frame_bytes = run.frame_bytes;
        report.send_zero_copy_checked &= run.zero_copy;
        report.receive_views_checked &= run.views;
        report.transport_info[tls] = run.info;
      };
      ours_run();
      for (int r = 0; r < report.repeats; ++r) {
        const auto peer =
            run_perftest(perftest, tls, "tag_bw", row.frame_bytes, row.frames, warmup, false);
        ours_run();
        if (!peer.error.empty()) {
          row.peer_error = peer.error;
          continue;
        }
        row.peer_runs.push_back(peer.bytes_per_s);
        row.ratios.push_back(around(row.ours_runs) / peer.bytes_per_s);
      }
      settle(row, true, {}, {});
      report.rows.push_back(row);
    }
    for (const std::string mode : {"latency", "latency-wait"}) {
      if (!wanted(tls, mode, 0)) continue;
      log(mode == "latency" ? "8 B latency (busy polling)" : "8 B latency (wait())", tls);
      const long frames = mode == "latency" ? latency_frames : wait_frames, warmup = frames / 10;
      transport_row row;
      row.metric = mode;
      row.transports = tls;
      row.payload_bytes = row.frame_bytes = 8;
      row.frames = frames;
      std::vector<double> ours_means, peer_means;
      auto ours_run = [&] {
        const auto run = ours_latency(o, tls, mode, warmup, frames);
        row.ours_runs.push_back(run.median_us);
        ours_means.push_back(run.mean_us);
      };
      ours_run();
      for (int r = 0; r < report.repeats; ++r) {
        const auto peer =
            run_perftest(perftest, tls, "tag_lat", 8, frames, warmup, mode != "latency");
        ours_run();
        if (!peer.error.empty()) {
          row.peer_error = peer.error;
          continue;
        }
        row.peer_runs.push_back(peer.latency_median_us);
        peer_means.push_back(peer.latency_mean_us);
        row.ratios.push_back(around(row.ours_runs) / peer.latency_median_us);
      }
      settle(row, false, ours_means, peer_means);
      report.rows.push_back(row);
    }
  }
  // The copy checks are made on bandwidth frames only: without one, nothing was checked.
  const bool any_bandwidth = std::any_of(report.rows.begin(), report.rows.end(),
                                         [](const auto& row) { return row.metric == "bandwidth"; });
  report.send_zero_copy_checked &= any_bandwidth;
  report.receive_views_checked &= any_bandwidth;
  return report;
}

}  // namespace troupe::bench
