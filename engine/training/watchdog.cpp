// The action watchdog. See watchdog.hpp.
#include "engine/training/watchdog.hpp"

#include <algorithm>
#include <cstdio>

namespace troupe::engine {
namespace {

std::string seconds(double s) {
  char text[32];
  std::snprintf(text, sizeof text, "%.1f s", s);
  return text;
}

}  // namespace

void action_watchdog::entry::begin(std::string what) {
  std::lock_guard lock(mutex_);
  current_ = std::move(what);
  since_ = clock::now();
  busy_ = true;
}

void action_watchdog::entry::end() {
  std::lock_guard lock(mutex_);
  if (!busy_) return;
  busy_ = false;
  last_.emplace_back(std::move(current_),
                     std::chrono::duration<double, std::milli>(clock::now() - since_).count());
  while (last_.size() > 8) last_.pop_front();
}

action_watchdog::action_watchdog(std::chrono::duration<double> timeout,
                                 std::function<void(const std::string&)> on_stuck, int history)
    : timeout_(timeout),
      on_stuck_(std::move(on_stuck)),
      history_(static_cast<std::size_t>(std::max(1, history))) {
  if (timeout_.count() > 0) thread_ = std::thread([this] { watch(); });
}

action_watchdog::~action_watchdog() {
  {
    std::lock_guard lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  if (thread_.joinable()) thread_.join();
}

std::shared_ptr<action_watchdog::entry> action_watchdog::enroll(std::string who) {
  auto e = std::make_shared<entry>(std::move(who));
  std::lock_guard lock(mutex_);
  entries_.push_back(e);
  return e;
}

void action_watchdog::watch() {
  // Checks a few times per timeout, at least once a second.
  const auto period =
      std::min<std::chrono::duration<double>>(timeout_ / 4, std::chrono::seconds(1));
  std::unique_lock lock(mutex_);
  while (!stop_) {
    wake_.wait_for(lock, period);
    if (stop_) return;
    const auto now = clock::now();
    for (const auto& e : entries_) {
      std::lock_guard entry_lock(e->mutex_);
      if (!e->busy_) continue;
      const std::chrono::duration<double> stuck = now - e->since_;
      if (stuck < timeout_) continue;
      std::string report = e->who_ + " has been in " + e->current_ + " for " +
                           seconds(stuck.count()) + " (watchdog.action_timeout " +
                           seconds(timeout_.count()) + "); its last actions:";
      const std::size_t from = e->last_.size() > history_ ? e->last_.size() - history_ : 0;
      if (from == e->last_.size()) report += " none";
      for (std::size_t i = from; i < e->last_.size(); ++i) {
        char ms[32];
        std::snprintf(ms, sizeof ms, " (%.0f ms)", e->last_[i].second);
        report += (i > from ? ", " : " ") + e->last_[i].first + ms;
      }
      stop_ = true;  // once: the process is expected to end
      on_stuck_(report);
      return;
    }
  }
}

}  // namespace troupe::engine
