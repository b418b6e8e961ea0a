// The checkpoint writer. See checkpoint_writer.hpp.
#include "actors/checkpoint_writer.hpp"

#include <csignal>
#include <cstdio>
#include <cstdlib>

#include <algorithm>
#include <chrono>
#include <optional>
#include <set>
#include <stdexcept>

#include "actors/error_text.hpp"

namespace troupe::actors {
namespace {

using namespace messages;

class checkpoint_writer_impl : public checkpoint_writer_actor::base {
 public:
  checkpoint_writer_impl(caf::actor_config& cfg, checkpoint_writer_config config)
      : checkpoint_writer_actor::base(cfg), cfg_(std::move(config)) {}

  void on_exit() override {
    // A writer that stops (a failed write, a stage that did not answer) answers every flush
    // waiting on it: nobody waits for a checkpoint that will not come.
    for (auto& rp : flushes_)
      rp.deliver(caf::make_error(caf::sec::runtime_error,
                                 "the checkpoint writer stopped before committing the checkpoint"));
    flushes_.clear();
    cfg_.stages.clear();
    cfg_.tracer = nullptr;
  }

  behavior_type make_behavior() override {
    set_exception_handler(
        [](std::exception_ptr& e) -> caf::error { return exit_reason("checkpoint writer", e); });
    return {
        [this](checkpoint_begin& b) -> caf::result<checkpoint_copied> { return begin(b); },
        [this](checkpoint_flush& f) -> caf::result<bool> {
          if (!collecting_) return true;
          if (f.abandon) {  // W3: its stages may be gone; nothing of it is written
            collecting_ = false;
            ++generation_;
            assembler_.reset();
            for (auto& [b, rp] : deferred_)
              rp.deliver(caf::make_error(caf::sec::runtime_error, "checkpoint of step " +
                                                                      std::to_string(b.state.step) +
                                                                      " abandoned: the job ended"));
            deferred_.clear();
            for (auto& rp : flushes_) rp.deliver(true);
            flushes_.clear();
            return true;
          }
          auto rp = make_response_promise<bool>();
          flushes_.push_back(rp);
          return rp;
        },
    };
  }

 private:
  // W1: a checkpoint begun while the last one is collected or written waits for its commit.
  caf::result<checkpoint_copied> begin(checkpoint_begin& b) {
    auto rp = make_response_promise<checkpoint_copied>();
    if (collecting_) {
      deferred_.emplace_back(std::move(b), rp);
      return rp;
    }
    start(b, rp);
    return rp;
  }

  void start(checkpoint_begin& b, caf::typed_response_promise<checkpoint_copied> rp) {
    collecting_ = true;
    state_ = std::move(b.state);
    state_.mesh = cfg_.mesh;
    state_.model = cfg_.model;
    state_.schedule = cfg_.schedule;
    state_.recipe_text = cfg_.recipe_text;
    state_.overrides = cfg_.overrides;
    state_.recipe_changes = cfg_.recipe_changes;
    if (!cfg_.parts) assembler_.emplace(cfg_.model, cfg_.tp);
    t0_ = cfg_.trace.now_us();
    // W2: replica 0's lanes, or every replica's with ZeRO. W4: every stage captures its state
    // first; the next step may begin once all have, and their states are then collected.
    const int lanes = (cfg_.zero ? cfg_.dp : 1) * cfg_.tp;
    pending_ = lanes * cfg_.pp;
    for (int lane = 0; lane < lanes; ++lane) {
      for (const auto& stage : cfg_.stages.at(static_cast<std::size_t>(lane))) {
        request(stage, std::chrono::minutes(10), snapshot_request{state_.step, true, true, {}})
            .then(
                [this, rp, lanes, gen = generation_](stage_snapshot&) mutable {
                  if (gen != generation_) return;  // abandoned
                  if (--pending_ > 0) return;
                  rp.deliver(checkpoint_copied{state_.step});
                  collect(lanes);
                },
                [this, gen = generation_](caf::error& e) { failed(gen, e); });
      }
    }
  }

  // Every captured state, then the files (W1). Format 2: each stage writes its part into the
  // step's directory and answers with its name, size and xxh64; the commit lists them (W5).
  void collect(int lanes) {
    pending_ = lanes * cfg_.pp;
    std::string dir;
    if (cfg_.parts) {
      try {
        // Absolute: stages in other processes resolve it against their own working directory.
        dir = std::filesystem::absolute(
                  engine::prepare_checkpoint_dir(cfg_.root, state_.step, say_to_user))
                  .string();
      } catch (const std::exception& e) {
        quit(caf::make_error(caf::sec::runtime_error, e.what()));
        return;
      }
      parts_.clear();
    }
    for (int lane = 0; lane < lanes; ++lane) {
      for (const auto& stage : cfg_.stages.at(static_cast<std::size_t>(lane))) {
        request(stage, std::chrono::minutes(10), snapshot_request{state_.step, true, false, dir})
            .then(
                [this, lane, gen = generation_](stage_snapshot& s) {
                  if (gen != generation_) return;  // abandoned
                  if (cfg_.parts)
                    parts_.push_back(std::move(s.part));
                  else
                    add(s, lane);
                  if (--pending_ == 0) write();
                },
                [this, gen = generation_](caf::error& e) { failed(gen, e); });
      }
    }
  }

  void failed(int gen, const caf::error& e) {
    if (gen != generation_) return;  // abandoned
    quit(caf::make_error(caf::sec::runtime_error,
                         "checkpoint of step " + std::to_string(state_.step) +
                             ": a stage did not give its state: " + to_string(e)));
  }

  // One stage's state into the whole tensors (W2: other replicas' parameters are the same).
  // The values are taken, not copied, where a piece is a whole tensor (or shard's slice).
  void add(stage_snapshot& s, int lane) {
    const int shard = lane % cfg_.tp, replica = lane / cfg_.tp;
    using role = engine::checkpoint_assembler::role;
    if (replica == 0)
      for (auto& [name, values] : s.parameters)
        assembler_->add(role::parameter, name, shard, 0, std::move(values));
    for (auto& p : s.pieces)
      assembler_->add(static_cast<role>(p.role), p.name, shard, p.offset, std::move(p.values));
  }

  // A test hook: TROUPE_TEST_CHECKPOINT_KILL=POINT kills this process (SIGKILL) when the
  // write reaches POINT ("before manifest", "committed", "removed step-00000004", ...).
  static engine::checkpoint_hook kill_hook() {
    const char* at = std::getenv("TROUPE_TEST_CHECKPOINT_KILL");
    if (!at || !*at) return {};
    return [at = std::string(at)](const std::string& point) {
      if (point == at) std::raise(SIGKILL);
    };
  }

  // A line for the user, on stderr (the writer runs on the job's first process).
  static void say_to_user(const std::string& line) {
    std::fprintf(stderr, "troupe train: %s\n", line.c_str());
    std::fflush(stderr);
  }

  // The directories rotation left in place (they do not verify), each named once.
  void report(const std::vector<engine::checkpoint_left_alone>& left) {
    for (const auto& l : left)
      if (reported_.insert(l.dir.string() + "\n" + l.problem).second)
        say_to_user(
            l.dir.string() +
            " does not verify; it stays and does not count toward checkpoint.keep: " + l.problem);
  }

  // W1: on this actor's thread; messages wait meanwhile.
  void write() {
    const double t_copied = cfg_.trace.now_us();
    const auto hook = kill_hook();
    if (cfg_.parts) {
      for (const auto& p : parts_)
        if (p.name.empty())
          throw std::logic_error("checkpoint: a stage answered without its part file");
      std::sort(parts_.begin(), parts_.end(),
                [](const auto& a, const auto& b) { return a.name < b.name; });
      report(engine::commit_checkpoint_parts(cfg_.root, parts_, state_, cfg_.keep, hook));
      parts_.clear();
    } else {
      const auto tensors = assembler_->finish();
      report(engine::write_checkpoint(cfg_.root, cfg_.model, tensors, state_, cfg_.keep, hook,
                                      say_to_user));
    }
    assembler_.reset();
    cfg_.trace.span("checkpoint", "write step " + std::to_string(state_.step), t_copied,
                    cfg_.trace.now_us(), {state_.step - 1});
    cfg_.trace.span("checkpoint", "collect", t0_, t_copied, {state_.step - 1});
    if (cfg_.trace.enabled() && cfg_.tracer)
      caf::anon_send(caf::actor_cast<tracer_actor>(cfg_.tracer), trace_batch{cfg_.trace.take()});
    collecting_ = false;
    if (!deferred_.empty()) {  // W1: the next one now; flushes wait for it too
      auto [next, rp] = std::move(deferred_.front());
      deferred_.erase(deferred_.begin());
      start(next, rp);
      return;
    }
    for (auto& rp : flushes_) rp.deliver(true);  // W3
    flushes_.clear();
  }

  checkpoint_writer_config cfg_;
  bool collecting_ = false;
  int pending_ = 0;
  int generation_ = 0;  // the checkpoint being collected; an abandoned one's answers are stale
  double t0_ = 0;
  engine::checkpoint_state state_;
  std::optional<engine::checkpoint_assembler> assembler_;
  std::vector<engine::checkpoint_file> parts_;  // format 2: the stages' part files
  std::vector<caf::typed_response_promise<bool>> flushes_;
  std::set<std::string> reported_;  // directories left in place, named once each
  std::vector<std::pair<checkpoint_begin, caf::typed_response_promise<checkpoint_copied>>>
      deferred_;  // W1: begun while another was collected or written
};

}  // namespace

checkpoint_writer_actor spawn_checkpoint_writer(caf::actor_system& system,
                                                checkpoint_writer_config config) {
  return system.spawn<checkpoint_writer_impl, caf::detached>(std::move(config));
}

}  // namespace troupe::actors
