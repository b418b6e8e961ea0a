// One job per directory (engine/training/run_lock.hpp) and whole metrics lines
// (engine::jsonl_writer): a held directory is refused naming its holder; stale holders (a dead
// pid, a reused pid, another host's old heartbeat) are taken over with a notice; live ones are
// refused even where flock is free; the heartbeat moves the lock file's mtime; metrics lines are
// whole after a torn line and under a file size limit.
#include <fcntl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <csignal>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "engine/training/metrics.hpp"
#include "engine/training/recipe.hpp"
#include "engine/training/run_lock.hpp"
#include "tests/data/temp_dir.hpp"

namespace {

using troupe::engine::run_lock;
using troupe::engine::run_lock_holder;
using troupe::engine::data::test::temp_dir;
namespace fs = std::filesystem;

std::string read_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

void write_file(const fs::path& p, const std::string& text) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out << text;
}

// The recipe_error a lock attempt throws ("" when it takes the lock).
std::string refusal(const std::vector<run_lock::directory>& dirs,
                    troupe::engine::run_lock_options o = {}) {
  try {
    run_lock lock(dirs, std::move(o));
  } catch (const troupe::engine::recipe_error& e) {
    return e.what();
  }
  return "";
}

// A pid that no process has now: a child that has ended and been reaped.
pid_t dead_pid() {
  const pid_t pid = ::fork();
  if (pid == 0) ::_exit(0);
  int status = 0;
  ::waitpid(pid, &status, 0);
  return pid;
}

// Writes a record for holder h into dir's lock file, its mtime age_s seconds ago.
void plant_record(const fs::path& dir, const run_lock_holder& h, int age_s = 0) {
  const auto file = dir / run_lock::file_name;
  write_file(file, troupe::engine::format_run_lock_record(h));
  timespec times[2];
  times[0].tv_sec = times[1].tv_sec = std::time(nullptr) - age_s;
  times[0].tv_nsec = times[1].tv_nsec = 0;
  REQUIRE(::utimensat(AT_FDCWD, file.c_str(), times, 0) == 0);
}

std::vector<std::string> lines_of(const fs::path& p) {
  std::vector<std::string> lines;
  std::istringstream in(read_file(p));
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

troupe::engine::step_metrics step(int s) {
  troupe::engine::step_metrics m;
  m.step = s;
  m.loss = 1.0 / s;
  return m;
}

}  // namespace

TEST_CASE("a held directory is refused naming its holder, and free again after release") {
  temp_dir tmp;
  const run_lock::directory out{tmp / "out", "output.dir"};
  std::string refused;
  {
    run_lock first({out});
    const auto record =
        troupe::engine::parse_run_lock_record(read_file(tmp / "out" / run_lock::file_name));
    REQUIRE(record);
    CHECK(record->pid == ::getpid());
    CHECK(record->start_ticks == troupe::engine::process_start_ticks(::getpid()).value());
    refused = refusal({out});
  }
  CHECK(refused.find("key output.dir: ") == 0);
  CHECK(refused.find("in use by another job") != std::string::npos);
  CHECK(refused.find("pid " + std::to_string(::getpid())) != std::string::npos);
  CHECK(refused.find((tmp / "out" / run_lock::file_name).string()) != std::string::npos);
  CHECK(refused.find('\n') == std::string::npos);
  CHECK(read_file(tmp / "out" / run_lock::file_name).empty());  // released: no record
  std::vector<std::string> notices;
  troupe::engine::run_lock_options o;
  o.notice = [&](const std::string& s) { notices.push_back(s); };
  CHECK(refusal({out}, o).empty());
  CHECK(notices.empty());
}

TEST_CASE("the output and checkpoint directories: one lock each, none kept when one is refused") {
  temp_dir tmp;
  const run_lock::directory out{tmp / "out", "output.dir"};
  const run_lock::directory ckpt{tmp / "ckpt", "checkpoint.dir"};
  {
    run_lock same({out, {tmp / "out", "checkpoint.dir"}});  // one directory named twice
    CHECK(!read_file(tmp / "out" / run_lock::file_name).empty());
  }
  run_lock holder({ckpt});
  const auto refused = refusal({out, ckpt});
  CHECK(refused.find("key checkpoint.dir: ") == 0);
  CHECK(read_file(tmp / "out" / run_lock::file_name).empty());  // output.dir was let go
  CHECK(refusal({out}).empty());
}

TEST_CASE("a stale holder on this host is taken over with one notice") {
  temp_dir tmp;
  fs::create_directories(tmp / "out");
  auto h = troupe::engine::current_process_holder();
  std::vector<std::string> notices;
  troupe::engine::run_lock_options o;
  o.notice = [&](const std::string& s) { notices.push_back(s); };

  SECTION("its process is gone (a kill -9)") {
    h.pid = dead_pid();
    plant_record(tmp / "out", h);
    CHECK(refusal({{tmp / "out", "output.dir"}}, o).empty());
    REQUIRE(notices.size() == 1);
    CHECK(notices[0].find("taking over the stale lock") == 0);
    CHECK(notices[0].find("process " + std::to_string(h.pid) + " is gone") != std::string::npos);
  }
  SECTION("its pid now belongs to another process") {
    h.pid = ::getppid();
    h.start_ticks = troupe::engine::process_start_ticks(h.pid).value() + 1;
    plant_record(tmp / "out", h);
    CHECK(refusal({{tmp / "out", "output.dir"}}, o).empty());
    REQUIRE(notices.size() == 1);
    CHECK(notices[0].find("is now another process") != std::string::npos);
  }
}

TEST_CASE("a live holder in the record is refused even where flock is free") {
  temp_dir tmp;
  fs::create_directories(tmp / "out");
  auto h = troupe::engine::current_process_holder();
  SECTION("this host, a live process") {
    h.pid = ::getppid();
    h.start_ticks = troupe::engine::process_start_ticks(h.pid).value();
    plant_record(tmp / "out", h);
  }
  SECTION("another host with a fresh heartbeat") {
    h.host = "some-other-host";
    h.pid = 1;
    plant_record(tmp / "out", h, 5);
  }
  const auto refused = refusal({{tmp / "out", "output.dir"}});
  CHECK(refused.find("host " + h.host + ", pid " + std::to_string(h.pid)) != std::string::npos);
  CHECK(troupe::engine::parse_run_lock_record(read_file(tmp / "out" / run_lock::file_name))->id ==
        h.id);  // the holder's record stays
}

TEST_CASE("another host's holder with an old heartbeat is taken over") {
  temp_dir tmp;
  fs::create_directories(tmp / "out");
  auto h = troupe::engine::current_process_holder();
  h.host = "some-other-host";
  plant_record(tmp / "out", h, 120);
  std::vector<std::string> notices;
  troupe::engine::run_lock_options o;
  o.stale_after = std::chrono::seconds(60);
  o.notice = [&](const std::string& s) { notices.push_back(s); };
  CHECK(refusal({{tmp / "out", "output.dir"}}, o).empty());
  REQUIRE(notices.size() == 1);
  CHECK(notices[0].find("host some-other-host") != std::string::npos);
  CHECK(notices[0].find("heartbeat is 1") != std::string::npos);  // 120 s or a little more
}

TEST_CASE("the heartbeat keeps the lock file's mtime fresh") {
  temp_dir tmp;
  troupe::engine::run_lock_options o;
  o.heartbeat = std::chrono::milliseconds(20);
  run_lock lock({{tmp / "out", "output.dir"}}, o);
  const auto file = tmp / "out" / run_lock::file_name;
  timespec old[2] = {{1000, 0}, {1000, 0}};
  REQUIRE(::utimensat(AT_FDCWD, file.c_str(), old, 0) == 0);
  bool refreshed = false;
  for (int i = 0; i < 500 && !refreshed; ++i) {  // bounded: at most 5 s
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    struct stat st {};
    refreshed = ::stat(file.c_str(), &st) == 0 && st.st_mtim.tv_sec > 1000;
  }
  CHECK(refreshed);
}

TEST_CASE("lock records: round trip; an empty or torn record is no holder") {
  auto h = troupe::engine::current_process_holder();
  const auto text = troupe::engine::format_run_lock_record(h);
  const auto back = troupe::engine::parse_run_lock_record(text);
  REQUIRE(back);
  CHECK(back->host == h.host);
  CHECK(back->pid == h.pid);
  CHECK(back->start_ticks == h.start_ticks);
  CHECK(back->id == h.id);
  CHECK(back->since == h.since);
  CHECK(!troupe::engine::parse_run_lock_record(""));
  CHECK(!troupe::engine::parse_run_lock_record(text.substr(0, text.size() / 2)));
  CHECK(!troupe::engine::process_start_ticks(dead_pid()));
}

TEST_CASE("metrics: a torn last line is dropped on resume, and every line stays whole") {
  temp_dir tmp;
  const auto path = tmp / "metrics.jsonl";
  {
    troupe::engine::jsonl_writer w(path);
    for (int s = 1; s <= 3; ++s) w.write(step(s));
  }
  {
    std::ofstream torn(path, std::ios::app);
    torn << R"({"step":4,"loss":0.2)";  // a crash in the middle of a line
  }
  {
    troupe::engine::jsonl_writer w(path, 10);
    w.write(step(4));
  }
  const auto lines = lines_of(path);
  REQUIRE(lines.size() == 4);
  for (std::size_t i = 0; i < lines.size(); ++i)
    CHECK(nlohmann::json::parse(lines[i]).at("step") == int(i) + 1);
  CHECK(read_file(path).back() == '\n');
}

TEST_CASE("metrics: under a file size limit a write fails naming the file, lines stay whole") {
  temp_dir tmp;
  const auto path = tmp / "metrics.jsonl";
  const pid_t pid = ::fork();
  if (pid == 0) {  // the limit and the ignored SIGXFSZ stay in this child
    std::signal(SIGXFSZ, SIG_IGN);
    try {
      troupe::engine::jsonl_writer w(path);
      w.write(step(1));
      const rlimit limit{static_cast<rlim_t>(fs::file_size(path) + 40),
                         static_cast<rlim_t>(fs::file_size(path) + 40)};
      ::setrlimit(RLIMIT_FSIZE, &limit);
      w.write(step(2));  // longer than 40 bytes: cut short by the limit
    } catch (const std::exception& e) {
      write_file(tmp / "error", e.what());
      ::_exit(0);
    }
    ::_exit(1);
  }
  int status = 0;
  REQUIRE(::waitpid(pid, &status, 0) == pid);
  REQUIRE(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
  const auto error = read_file(tmp / "error");
  CHECK(error.find(path.string() + ": write failed: File too large") == 0);
  const auto lines = lines_of(path);
  REQUIRE(lines.size() == 1);
  CHECK(nlohmann::json::parse(lines[0]).at("step") == 1);
}
