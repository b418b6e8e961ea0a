// One job per directory: flock(2) plus a record with a heartbeat. See run_lock.hpp.
#include "engine/training/run_lock.hpp"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <ctime>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <stdexcept>

#include "engine/training/recipe.hpp"

namespace troupe::engine {

namespace {

constexpr const char* record_magic = "troupe-run-lock";
constexpr int record_version = 1;

std::string host_name() {
  char name[256] = {};
  if (::gethostname(name, sizeof name - 1) != 0) return "unknown-host";
  return name;
}

std::string random_id() {
  unsigned char bytes[8] = {};
  std::ifstream in("/dev/urandom", std::ios::binary);
  in.read(reinterpret_cast<char*>(bytes), sizeof bytes);
  if (!in) {  // no /dev/urandom: time and pid still differ between holders
    const auto t = std::chrono::steady_clock::now().time_since_epoch().count();
    for (std::size_t i = 0; i < sizeof bytes; ++i)
      bytes[i] = static_cast<unsigned char>((t >> (8 * i)) ^ (::getpid() >> (i % 4 * 8)));
  }
  static const char digits[] = "0123456789abcdef";
  std::string hex;
  for (unsigned char b : bytes) {
    hex += digits[b >> 4];
    hex += digits[b & 15];
  }
  return hex;
}

std::string utc_time(std::int64_t unix_seconds) {
  const std::time_t t = static_cast<std::time_t>(unix_seconds);
  std::tm tm{};
  char text[64] = "an unknown time";
  if (::gmtime_r(&t, &tm)) std::strftime(text, sizeof text, "%Y-%m-%d %H:%M:%S UTC", &tm);
  return text;
}

std::string describe(const run_lock_holder& h) {
  return "host " + h.host + ", pid " + std::to_string(h.pid) + ", since " + utc_time(h.since);
}

std::string read_all(int fd) {
  std::string text;
  char buf[4096];
  for (off_t at = 0;;) {
    const ssize_t n = ::pread(fd, buf, sizeof buf, at);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    text.append(buf, static_cast<std::size_t>(n));
    at += n;
    if (text.size() > (1 << 16)) break;  // no record is this long
  }
  return text;
}

std::chrono::seconds heartbeat_age(int fd) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) return std::chrono::seconds(0);
  const auto age = std::time(nullptr) - st.st_mtim.tv_sec;
  return std::chrono::seconds(age > 0 ? age : 0);
}

[[noreturn]] void refuse(const run_lock::directory& d, const std::filesystem::path& file,
                         const std::optional<run_lock_holder>& holder) {
  throw recipe_error("key " + d.key + ": " + d.path.string() + " is in use by another job (" +
                     (holder ? describe(*holder) : std::string("no holder recorded yet")) +
                     "; lock file " + file.string() + "): wait for it to end, or choose another " +
                     d.key);
}

}  // namespace

std::string format_run_lock_record(const run_lock_holder& h) {
  const nlohmann::json j = {
      {"magic", record_magic}, {"version", record_version},     {"host", h.host},
      {"pid", h.pid},          {"start_ticks", h.start_ticks},  {"id", h.id},
      {"since", h.since},      {"since_utc", utc_time(h.since)}};
  return j.dump() + "\n";
}

std::optional<run_lock_holder> parse_run_lock_record(const std::string& text) {
  const auto j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object() || j.value("magic", "") != record_magic) return std::nullopt;
  try {
    run_lock_holder h;
    h.host = j.at("host").get<std::string>();
    h.pid = j.at("pid").get<std::int64_t>();
    h.start_ticks = j.at("start_ticks").get<std::uint64_t>();
    h.id = j.at("id").get<std::string>();
    h.since = j.at("since").get<std::int64_t>();
    return h;
  } catch (const nlohmann::json::exception&) {
    return std::nullopt;
  }
}

std::optional<std::uint64_t> process_start_ticks(std::int64_t pid) {
  if (pid <= 0) return std::nullopt;
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string stat;
  if (!std::getline(in, stat)) return std::nullopt;
  // pid (comm) state ppid ...: comm may hold spaces and parentheses, so count after the last
  // ')'; starttime is field 22, the 20th after it.
  const auto paren = stat.rfind(')');
  if (paren == std::string::npos) return std::nullopt;
  std::istringstream fields(stat.substr(paren + 1));
  std::string field;
  for (int i = 0; i < 20; ++i)
    if (!(fields >> field)) return std::nullopt;
  try {
    return std::stoull(field);
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

run_lock_holder current_process_holder() {
  run_lock_holder h;
  h.host = host_name();
  h.pid = ::getpid();
  h.start_ticks = process_start_ticks(h.pid).value_or(0);
  h.id = random_id();
  h.since = static_cast<std::int64_t>(std::time(nullptr));
  return h;
}

std::string stale_reason(const run_lock_holder& h, const std::string& this_host,
                         std::chrono::seconds heartbeat_age, std::chrono::seconds stale_after) {
  if (h.host == this_host) {
    const auto start = process_start_ticks(h.pid);
    if (!start) return "process " + std::to_string(h.pid) + " is gone";
    if (h.start_ticks != 0 && *start != h.start_ticks)
      return "pid " + std::to_string(h.pid) + " is now another process";
    if (h.pid == ::getpid()) return "an earlier lock of this process";
    return "";
  }
  if (heartbeat_age > stale_after)
    return "its heartbeat is " + std::to_string(heartbeat_age.count()) + " s old (more than " +
           std::to_string(stale_after.count()) + " s)";
  return "";
}

run_lock::run_lock(const std::vector<directory>& dirs, run_lock_options options)
    : options_(std::move(options)), me_(current_process_holder()) {
  const std::string text = format_run_lock_record(me_);
  try {
    std::vector<std::filesystem::path> seen;
    for (const auto& d : dirs) {
      std::error_code ec;
      std::filesystem::create_directories(d.path, ec);
      if (ec)
        throw recipe_error("key " + d.key + ": cannot create " + d.path.string() + ": " +
                           ec.message());
      const auto canonical = std::filesystem::canonical(d.path, ec);
      if (!ec && std::find(seen.begin(), seen.end(), canonical) != seen.end()) continue;
      seen.push_back(canonical);
      const auto file = d.path / file_name;
      held h{file, ::open(file.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644)};
      if (h.fd < 0)
        throw recipe_error("key " + d.key + ": cannot open the lock file " + file.string() + ": " +
                           std::strerror(errno));
      held_.push_back(h);
      // flock first; a file system without it (ENOLCK, EINVAL) leaves the record to decide.
      if (::flock(h.fd, LOCK_EX | LOCK_NB) != 0 && errno == EWOULDBLOCK) {
        std::optional<run_lock_holder> holder;
        for (int i = 0; i < 20 && !holder; ++i) {  // its holder may be writing its record now
          holder = parse_run_lock_record(read_all(h.fd));
          if (!holder) std::this_thread::sleep_for(std::chrono::milliseconds(100));
        }
        refuse(d, file, holder);
      }
      const std::string old = read_all(h.fd);
      if (const auto holder = parse_run_lock_record(old)) {
        const auto why = stale_reason(*holder, me_.host, heartbeat_age(h.fd), options_.stale_after);
        if (why.empty()) refuse(d, file, holder);
        if (options_.notice)
          options_.notice("taking over the stale lock " + file.string() + " (" + describe(*holder) +
                          "): " + why);
      } else if (old.find_first_not_of(" \n") != std::string::npos && options_.notice) {
        options_.notice("replacing the unreadable record of the lock " + file.string());
      }
      if (::ftruncate(h.fd, 0) != 0 ||
          ::pwrite(h.fd, text.data(), text.size(), 0) != static_cast<ssize_t>(text.size()) ||
          ::fsync(h.fd) != 0)
        throw std::runtime_error(file.string() +
                                 ": cannot write the lock record: " + std::strerror(errno));
      // Where flock is not shared between hosts, two jobs may both get here: the last record
      // written wins, and the other job sees it.
      const auto now = parse_run_lock_record(read_all(h.fd));
      if (!now || now->id != me_.id) refuse(d, file, now);
    }
  } catch (...) {
    release();
    throw;
  }
  if (!held_.empty()) heartbeat_ = std::thread([this] { beat(); });
}

run_lock::~run_lock() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  if (heartbeat_.joinable()) heartbeat_.join();
  release();
}

void run_lock::beat() {
  std::unique_lock<std::mutex> lock(mutex_);
  while (!wake_.wait_for(lock, options_.heartbeat, [this] { return stopping_; }))
    for (const auto& h : held_) ::futimens(h.fd, nullptr);  // mtime = now
}

void run_lock::release() noexcept {
  for (auto& h : held_) {
    // Empty the record only while it is still this job's (a record someone else wrote where
    // flock failed stays theirs), then let go of flock by closing.
    const auto record = parse_run_lock_record(read_all(h.fd));
    if (record && record->id == me_.id) {
      [[maybe_unused]] const int rc = ::ftruncate(h.fd, 0);
    }
    ::close(h.fd);
  }
  held_.clear();
}

}  // namespace troupe::engine
