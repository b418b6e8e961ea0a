// The two-process harness of test_ucx_transport.cpp: every case forks its sides (UCX must not be
// initialised across fork), the sides exchange worker addresses over a socketpair and report
// "key value" lines through a pipe, and the parent checks those reports and the exit statuses
// under a deadline (a late child is killed and the case fails). Every wait in a child has a
// deadline too, and each child arms alarm() as a last resort. Also: helpers used inside a side,
// and frames whose every byte the receiver can check.
#pragma once

#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <chrono>
#include <cstring>
#include <functional>
#include <map>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "transport/ucx_transport.hpp"

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/lsan_interface.h>
#endif

namespace ucx_test {

using troupe::transport::iov_list;
using troupe::transport::ucx_error;
using troupe::transport::ucx_options;
using troupe::transport::ucx_transport;
using clock_type = std::chrono::steady_clock;
using namespace std::chrono_literals;

constexpr auto child_deadline = 60s;   // a side's own waits
constexpr auto parent_deadline = 90s;  // the parent kills a side still running after this

// ---- process harness ------------------------------------------------------------------------

// What a side tells the parent: "key value" lines; a line "fail ..." marks a failed check.
struct report {
  int fd;
  void line(const std::string& key, const std::string& value) const {
    const std::string text = key + " " + value + "\n";
    if (::write(fd, text.data(), text.size()) < 0) ::_exit(90);
  }
};

#define SIDE_CHECK(cond)                                                                 \
  do {                                                                                   \
    if (!(cond)) {                                                                       \
      out.line("fail", std::string(#cond) + " (line " + std::to_string(__LINE__) + ")"); \
      return 1;                                                                          \
    }                                                                                    \
  } while (0)

using side_fn = std::function<int(int peer_socket, const report& out)>;

struct side_result {
  int status = -1;  // waitpid status
  bool killed_late = false;
  std::map<std::string, std::string> values;
  std::vector<std::string> failures;
  bool exited_ok() const { return !killed_late && WIFEXITED(status) && WEXITSTATUS(status) == 0; }
};

// Forks one process per side, connected by a socketpair; returns each side's report.
inline std::vector<side_result> run_sides(const std::vector<side_fn>& sides) {
  int sp[2];
  REQUIRE(::socketpair(AF_UNIX, SOCK_STREAM, 0, sp) == 0);
  std::fflush(stdout);
  std::fflush(stderr);
  std::vector<pid_t> pids;
  std::vector<int> pipes;
  for (std::size_t i = 0; i < sides.size(); ++i) {
    int p[2];
    REQUIRE(::pipe(p) == 0);
    const pid_t pid = ::fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {
      ::alarm(static_cast<unsigned>(parent_deadline.count()));
      ::close(p[0]);
      ::close(sp[1 - i % 2]);
      int rc = 2;
      try {
        rc = sides[i](sp[i % 2], report{p[1]});
      } catch (const std::exception& e) {
        report{p[1]}.line("fail", std::string("exception: ") + e.what());
      }
#if defined(__SANITIZE_ADDRESS__)
      __lsan_do_leak_check();  // _exit skips LeakSanitizer's atexit check
#endif
      ::_exit(rc);
    }
    ::close(p[1]);
    pids.push_back(pid);
    pipes.push_back(p[0]);
  }
  ::close(sp[0]);
  ::close(sp[1]);
  std::vector<side_result> results(sides.size());
  std::vector<std::string> text(sides.size());
  std::vector<bool> running(sides.size(), true);
  const auto deadline = clock_type::now() + parent_deadline;
  auto drain = [&](std::size_t i) {
    char buf[4096];
    for (;;) {
      pollfd fd{pipes[i], POLLIN, 0};
      if (::poll(&fd, 1, 0) <= 0) return;
      const ssize_t n = ::read(pipes[i], buf, sizeof buf);
      if (n <= 0) return;
      text[i].append(buf, static_cast<std::size_t>(n));
    }
  };
  while (std::count(running.begin(), running.end(), true) > 0) {
    for (std::size_t i = 0; i < sides.size(); ++i) {
      drain(i);
      if (running[i] && ::waitpid(pids[i], &results[i].status, WNOHANG) == pids[i])
        running[i] = false;
      if (running[i] && clock_type::now() > deadline) {
        ::kill(pids[i], SIGKILL);
        ::waitpid(pids[i], &results[i].status, 0);
        results[i].killed_late = true;
        running[i] = false;
      }
    }
    std::this_thread::sleep_for(5ms);
  }
  for (std::size_t i = 0; i < sides.size(); ++i) {
    drain(i);
    ::close(pipes[i]);
    std::istringstream lines(text[i]);
    for (std::string l; std::getline(lines, l);) {
      const auto space = l.find(' ');
      const std::string key = l.substr(0, space), value = l.substr(space + 1);
      if (key == "fail")
        results[i].failures.push_back(value);
      else
        results[i].values[key] = value;
    }
    INFO("side " << i << " reported: " << text[i]);
    CHECK(results[i].failures.empty());
    CHECK_FALSE(results[i].killed_late);
  }
  return results;
}

// ---- helpers used inside a side -------------------------------------------------------------

inline bool write_all(int fd, const void* data, std::size_t n) {
  const auto* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t w = ::write(fd, p, n);
    if (w <= 0) return false;
    p += w;
    n -= static_cast<std::size_t>(w);
  }
  return true;
}

inline bool read_all(int fd, void* data, std::size_t n, clock_type::time_point deadline) {
  auto* p = static_cast<char*>(data);
  while (n > 0) {
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - clock_type::now());
    pollfd fd_poll{fd, POLLIN, 0};
    if (left.count() <= 0 || ::poll(&fd_poll, 1, static_cast<int>(left.count())) <= 0) return false;
    const ssize_t r = ::read(fd, p, n);
    if (r <= 0) return false;
    p += r;
    n -= static_cast<std::size_t>(r);
  }
  return true;
}

// Sends this worker's address, reads the other side's and connects to it as `peer`.
inline void exchange_addresses(ucx_transport& t, int sock, int peer) {
  const auto mine = t.address();
  const std::uint32_t n = static_cast<std::uint32_t>(mine.size());
  if (!write_all(sock, &n, sizeof n) || !write_all(sock, mine.data(), n))
    throw std::runtime_error("address exchange: write failed");
  std::uint32_t m = 0;
  const auto deadline = clock_type::now() + child_deadline;
  if (!read_all(sock, &m, sizeof m, deadline))
    throw std::runtime_error("address exchange: no length");
  std::vector<std::uint8_t> theirs(m);
  if (!read_all(sock, theirs.data(), m, deadline))
    throw std::runtime_error("address exchange: short address");
  t.connect(peer, theirs);
}

// Progresses (sleeping in wait() when idle) until done() or the deadline; false if late.
inline bool pump(ucx_transport& t, const std::function<bool()>& done,
                 clock_type::time_point deadline = clock_type::now() + child_deadline) {
  while (!done()) {
    if (clock_type::now() > deadline) return false;
    if (t.progress() == 0) t.wait(1ms);
  }
  return true;
}

// A one-byte barrier over the socket ("this side has everything"); the waiting side keeps
// progressing UCX, since the other side may still need it.
inline bool signal_other(int sock) { return write_all(sock, "x", 1); }
inline bool await_other(ucx_transport& t, int sock) {
  return pump(t, [&] {
    pollfd fd{sock, POLLIN, 0};
    char c;
    return ::poll(&fd, 1, 0) > 0 && ::read(sock, &c, 1) == 1;
  });
}

// ---- frames ---------------------------------------------------------------------------------

// Frame k: [16-byte header: index, payload size][payload: seeded bytes][3-byte trailer]. The
// sender's payload sits at an odd address and goes as three iov pieces of odd lengths.
struct frame_source {
  std::vector<std::uint8_t> header = std::vector<std::uint8_t>(16);
  std::vector<std::uint8_t> storage;  // payload at storage.data() + 3
  std::vector<std::uint8_t> trailer = {0xA5, 0x5A, 0xC3};
  iov_list iov;
  frame_source(std::uint64_t index, std::size_t payload_bytes) {
    const std::uint64_t size = payload_bytes;
    std::memcpy(header.data(), &index, 8);
    std::memcpy(header.data() + 8, &size, 8);
    storage.resize(payload_bytes + 3);
    std::mt19937_64 random(index * 7919 + payload_bytes);
    for (std::size_t i = 0; i < payload_bytes; i += 8) {
      const std::uint64_t word = random();
      std::memcpy(&storage[3 + i], &word, std::min<std::size_t>(8, payload_bytes - i));
    }
    const std::uint8_t* payload = storage.data() + 3;
    std::size_t a = std::min<std::size_t>(payload_bytes, 1), b = payload_bytes / 3 | 1;
    if (index % 2 == 1 && payload_bytes >= 60000) {  // [header][long][9000 B alone][long][trailer]
      a = 20000;
      b = 9000;
    }
    const std::size_t cut = std::min(payload_bytes, a + b);
    iov = {{header.data(), header.size()},
           {payload, a},
           {payload + a, cut - a},
           {payload + cut, payload_bytes - cut},
           {trailer.data(), trailer.size()}};
  }
  std::vector<std::uint8_t> bytes() const {
    std::vector<std::uint8_t> all(header);
    all.insert(all.end(), storage.begin() + 3, storage.end());
    all.insert(all.end(), trailer.begin(), trailer.end());
    return all;
  }
};

inline std::uint64_t frame_index(const troupe::messages::aligned_buffer& b) {
  std::uint64_t index = 0;
  std::memcpy(&index, b.data(), 8);
  return index;
}

// Sends frames with the given payload sizes (all posted at once) and receives as many from the
// other side, checking each whole, in order and bit-exact. Reports transport_info.
inline int send_and_receive(ucx_transport& t, int sock, const report& out, int peer,
                            const std::vector<std::size_t>& to_send,
                            const std::vector<std::size_t>& to_receive) {
  std::vector<std::unique_ptr<frame_source>> sources;
  std::size_t completed = 0, failed = 0;
  for (std::size_t k = 0; k < to_send.size(); ++k) {
    sources.push_back(std::make_unique<frame_source>(k, to_send[k]));
    t.send(peer, sources.back()->iov,
           [&](bool ok, const std::string&) { ++(ok ? completed : failed); });
  }
  std::size_t received = 0, mismatched = 0, misaligned = 0;
  t.on_receive(
      [&](int from, std::shared_ptr<troupe::messages::aligned_buffer> b, std::size_t bytes) {
        const std::size_t k = received++;
        if (from != peer || k >= to_receive.size() || bytes > b->size() || bytes < 16 ||
            frame_index(*b) != k) {
          ++mismatched;
          return;
        }
        if (reinterpret_cast<std::uintptr_t>(b->data()) % 64 != 0) ++misaligned;
        const auto expected = frame_source(k, to_receive[k]).bytes();
        if (expected.size() != bytes || std::memcmp(expected.data(), b->data(), bytes) != 0)
          ++mismatched;
      });
  SIDE_CHECK(pump(
      t, [&] { return completed + failed == to_send.size() && received >= to_receive.size(); }));
  SIDE_CHECK(failed == 0);
  SIDE_CHECK(received == to_receive.size());
  SIDE_CHECK(mismatched == 0);
  SIDE_CHECK(misaligned == 0);
  out.line("transport", t.transport_info(peer));
  out.line("received", std::to_string(received));
  // Keep the worker alive until the other side has everything (its receives need our endpoint).
  SIDE_CHECK(signal_other(sock));
  SIDE_CHECK(await_other(t, sock));
  return 0;
}

inline const std::vector<std::size_t> frame_sizes = {8, 64 << 10, 1 << 20, 16 << 20};

inline std::vector<std::size_t> mixed_sizes(std::size_t n, unsigned seed) {
  std::mt19937 random(seed);
  const std::size_t choices[] = {0, 8, 100, 4000, 9000, 64 << 10, 300000, 1 << 20};
  std::vector<std::size_t> sizes(n);
  for (auto& s : sizes) s = choices[random() % std::size(choices)];
  return sizes;
}

}  // namespace ucx_test
