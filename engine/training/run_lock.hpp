// One job per directory: a job holds an exclusive lock on its output directory and on its
// checkpoint directory for its whole life, so that two jobs never write the same metrics or
// checkpoints (docs/checkpoints.md, "One job per directory").
// The lock is DIR/.troupe.lock, held two ways:
// - flock(2) on the file, released by the kernel however the process ends;
// - a record inside it (host, pid, the process's start time, a random id, since when), and a
//   heartbeat: the file's mtime, refreshed every few seconds by a thread. It decides where
//   flock cannot be trusted (some shared file systems grant it to everyone).
// Invariants: a directory held by a live job is refused with engine::recipe_error naming the
// holder and the lock file, before anything is written; a stale holder (same host: its pid is
// gone or is another process; other host: its heartbeat is older than stale_after) is taken
// over with one notice; an empty record means free (the record is emptied at release).
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace troupe::engine {

// Who holds (or held) a lock file, as its record says.
struct run_lock_holder {
  std::string host;
  std::int64_t pid = 0;
  std::uint64_t start_ticks = 0;  // /proc/PID/stat's starttime: tells a reused pid apart
  std::string id;                 // random, one per lock taken
  std::int64_t since = 0;         // unix seconds when it was taken
};

// The record's text form (one JSON object) and back; nullopt for text that is not one (an empty
// or torn record).
std::string format_run_lock_record(const run_lock_holder& h);
std::optional<run_lock_holder> parse_run_lock_record(const std::string& text);

// This process as a holder (a fresh random id, since now).
run_lock_holder current_process_holder();
// The start time of process pid in clock ticks since boot, or nullopt when it does not exist.
std::optional<std::uint64_t> process_start_ticks(std::int64_t pid);

// Why a recorded holder no longer counts ("" when it still does): same host, its pid gone or
// another process now; other host, its heartbeat older than stale_after.
std::string stale_reason(const run_lock_holder& h, const std::string& this_host,
                         std::chrono::seconds heartbeat_age, std::chrono::seconds stale_after);

struct run_lock_options {
  std::chrono::milliseconds heartbeat{std::chrono::seconds(5)};  // mtime refresh period
  std::chrono::seconds stale_after{60};  // a holder on another host with an older heartbeat
  std::function<void(const std::string&)> notice;  // one line per stale lock taken over
};

class run_lock {
 public:
  struct directory {
    std::filesystem::path path;  // created if missing
    std::string key;             // the recipe key that names it, for messages ("output.dir")
  };
  // Takes every directory's lock (one lock per directory, however many keys name it), or
  // throws engine::recipe_error naming the key, the holder and the lock file, holding none.
  // Other failures (the lock file cannot be created) throw std::runtime_error naming the file.
  explicit run_lock(const std::vector<directory>& dirs, run_lock_options options = {});
  ~run_lock();  // empties the records and releases the locks
  run_lock(const run_lock&) = delete;
  run_lock& operator=(const run_lock&) = delete;

  static constexpr const char* file_name = ".troupe.lock";

 private:
  struct held {
    std::filesystem::path file;
    int fd = -1;
  };
  void release() noexcept;
  void beat();

  run_lock_options options_;
  run_lock_holder me_;
  std::vector<held> held_;
  std::mutex mutex_;
  std::condition_variable wake_;
  bool stopping_ = false;
  std::thread heartbeat_;
};

}  // namespace troupe::engine
