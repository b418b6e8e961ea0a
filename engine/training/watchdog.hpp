// The action watchdog (docs/checkpoints.md, "Hangs"): a thread that watches every actor of this
// process that enrolled, and reports one that stays in one action longer than the timeout,
// naming the actor, the action and its last actions. CAF-free: an actor calls begin/end around
// the work it does synchronously (a stage around each piece of an action's pass).
//
// Invariants:
//  - An actor between actions is never reported, however long it waits for messages.
//  - on_stuck runs at most once per watchdog, on the watchdog's thread, with the report; after
//    it the watchdog watches nothing more (the process is expected to end: a stuck thread
//    cannot be interrupted).
#pragma once

#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace troupe::engine {

class action_watchdog {
 public:
  using clock = std::chrono::steady_clock;
  // One enrolled actor: what it is doing now and its last actions.
  class entry {
   public:
    explicit entry(std::string who) : who_(std::move(who)) {}
    void begin(std::string what);
    void end();

   private:
    friend class action_watchdog;
    std::mutex mutex_;
    std::string who_, current_;
    clock::time_point since_{};
    bool busy_ = false;
    std::deque<std::pair<std::string, double>> last_;  // (action, milliseconds), oldest first
  };

  // timeout 0: off (enroll works, nothing is reported). history: actions kept per actor.
  action_watchdog(std::chrono::duration<double> timeout,
                  std::function<void(const std::string& report)> on_stuck, int history = 8);
  ~action_watchdog();
  action_watchdog(const action_watchdog&) = delete;
  action_watchdog& operator=(const action_watchdog&) = delete;

  std::shared_ptr<entry> enroll(std::string who);

 private:
  void watch();
  std::chrono::duration<double> timeout_;
  std::function<void(const std::string&)> on_stuck_;
  std::size_t history_;
  std::mutex mutex_;
  std::condition_variable wake_;
  bool stop_ = false;
  std::vector<std::shared_ptr<entry>> entries_;
  std::thread thread_;
};

}  // namespace troupe::engine
