// Sockets, processes and CPU pinning of `troupe bench transport` (transport_io.hpp).
#include "bench/transport_io.hpp"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <sstream>
#include <thread>

extern char** environ;

namespace troupe::bench::transport_io {

bool write_all(int fd, const void* data, std::size_t n) {
  for (const char* p = static_cast<const char*>(data); n > 0;) {
    const ssize_t w = ::write(fd, p, n);
    if (w <= 0) return false;
    p += w;
    n -= static_cast<std::size_t>(w);
  }
  return true;
}

bool read_all(int fd, void* data, std::size_t n, clock_type::time_point deadline) {
  for (char* p = static_cast<char*>(data); n > 0;) {
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - clock_type::now());
    pollfd pfd{fd, POLLIN, 0};
    if (left.count() <= 0 || ::poll(&pfd, 1, static_cast<int>(left.count())) <= 0) return false;
    const ssize_t r = ::read(fd, p, n);
    if (r <= 0) return false;
    p += r;
    n -= static_cast<std::size_t>(r);
  }
  return true;
}

void send_blob(int fd, const std::vector<std::uint8_t>& blob) {
  const auto n = static_cast<std::uint32_t>(blob.size());
  if (!write_all(fd, &n, sizeof n) || !write_all(fd, blob.data(), n))
    fail("transport bench: writing a worker address to the other process failed");
}

std::vector<std::uint8_t> receive_blob(int fd) {
  const auto deadline = clock_type::now() + measurement_deadline;
  std::uint32_t n = 0;
  if (!read_all(fd, &n, sizeof n, deadline) || n > (1u << 20))
    fail("transport bench: no worker address from the other process");
  std::vector<std::uint8_t> blob(n);
  if (!read_all(fd, blob.data(), n, deadline))
    fail("transport bench: short worker address from the other process");
  return blob;
}

// Waits for pid until the deadline, then kills it; returns the wait status (-1 if killed).
int reap(pid_t pid, clock_type::time_point deadline) {
  int status = 0;
  while (::waitpid(pid, &status, WNOHANG) == 0) {
    if (clock_type::now() > deadline) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
      return -1;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return status;
}

// posix_spawn with UCX_TLS replaced; stdout and stderr to out_fd (or /dev/null when -1).
// side: the CPU side (cpu_pin) the process runs on.
pid_t spawn(const std::vector<std::string>& args, const std::string& tls, int out_fd, int side) {
  const cpu_pin pin(side);  // inherited by the child
  std::vector<std::string> env_text;
  for (char** e = environ; *e; ++e)
    if (std::strncmp(*e, "UCX_TLS=", 8) != 0) env_text.emplace_back(*e);
  if (!tls.empty()) env_text.push_back("UCX_TLS=" + tls);
  std::vector<char*> argv, envp;
  for (auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  for (auto& e : env_text) envp.push_back(e.data());
  argv.push_back(nullptr);
  envp.push_back(nullptr);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 0, "/dev/null", O_RDONLY, 0);
  if (out_fd >= 0) {
    posix_spawn_file_actions_adddup2(&actions, out_fd, 1);
    posix_spawn_file_actions_adddup2(&actions, out_fd, 2);
  } else {
    posix_spawn_file_actions_addopen(&actions, 1, "/dev/null", O_WRONLY, 0);
    posix_spawn_file_actions_addopen(&actions, 2, "/dev/null", O_WRONLY, 0);
  }
  pid_t pid = -1;
  const int rc = ::posix_spawn(&pid, argv[0], &actions, nullptr, argv.data(), envp.data());
  posix_spawn_file_actions_destroy(&actions);
  if (rc != 0) fail("transport bench: cannot run " + args[0] + ": " + std::strerror(rc));
  return pid;
}

std::string find_program(const std::string& name) {
  if (name.find('/') != std::string::npos) return ::access(name.c_str(), X_OK) == 0 ? name : "";
  const char* path = std::getenv("PATH");
  std::istringstream dirs(path ? path : "");
  for (std::string dir; std::getline(dirs, dir, ':');)
    if (!dir.empty() && ::access((dir + "/" + name).c_str(), X_OK) == 0) return dir + "/" + name;
  return "";
}

// A TCP port nobody listens on now (bound to port 0, then released): fresh for every run.
int fresh_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  socklen_t len = sizeof addr;
  if (fd < 0 || ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0)
    fail("transport bench: cannot find a free TCP port for ucx_perftest");
  ::close(fd);
  return ntohs(addr.sin_port);
}

messages::wire::limits bench_limits() {
  messages::wire::limits lim;
  lim.max_frame_bytes = std::uint64_t{1} << 30;
  lim.max_tensor_elements = std::uint64_t{1} << 28;
  lim.max_list_elements = 16;
  return lim;
}

}  // namespace troupe::bench::transport_io
