// Helpers for the actor-engine tests: a tiny recipe over a generated text corpus, the serial
// reference losses, and relays that deliver messages between stages in adversarial orders.
#pragma once

#include <caf/all.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "actors/pipeline_run.hpp"
#include "engine/training/recipe.hpp"
#include "engine/training/trainer.hpp"
#include "tests/data/temp_dir.hpp"

namespace troupe::actors::test {

using engine::data::test::temp_dir;

// Deterministic pseudo-English bytes: enough variety for a non-trivial loss curve.
inline std::string write_corpus(const temp_dir& dir) {
  static const char* words[] = {"the ",    "actor ", "sends ",     "a ",      "gradient ",
                                "to ",     "its ",   "neighbour ", "while ",  "pipeline ",
                                "stages ", "wait. ", "Messages ",  "arrive ", "early, ",
                                "late ",   "or ",    "never.\n"};
  std::mt19937 rng(7);
  std::string text;
  while (text.size() < 40000) text += words[rng() % 18];
  const auto path = dir / "corpus.txt";
  std::ofstream(path) << text;
  return path.string();
}

// 9 layers (so every split below is uneven somewhere), width 32, vocab 256 bytes.
inline engine::recipe tiny_recipe(const temp_dir& dir) {
  engine::recipe r;
  r.seed = 42;
  r.steps = 20;
  r.eval_interval = 0;
  r.model.vocab_size = r.model.padded_vocab_size = 256;
  r.model.context = 32;
  r.model.layers = 9;
  r.model.heads = 2;
  r.model.width = 32;
  r.data.train = write_corpus(dir);
  r.data.val_fraction = 0;
  r.batch.micro_batch = 2;
  r.batch.seq_len = 16;
  r.optimizer.lr = 3e-3f;
  r.optimizer.warmup_steps = 4;
  r.optimizer.grad_clip = 1.0f;
  r.output.dir = (dir / "out").string();
  r.output.weights = "";
  return r;
}

// A parallel layout of the actor engine: PP x DP, ZeRO stage, micro-batches, schedule.
struct parallel_case {
  const char* name;
  int pp, dp, zero, m;
  const char* schedule;
};
inline engine::recipe with_layout(engine::recipe r, const parallel_case& c) {
  r.parallel.pp = c.pp;
  r.parallel.dp = c.dp;
  r.parallel.zero = c.zero;
  r.parallel.micro_batches = c.m;
  r.parallel.schedule = c.schedule;
  return r;
}

inline std::vector<double> losses_of(const std::vector<engine::step_metrics>& steps) {
  std::vector<double> out;
  for (const auto& m : steps) out.push_back(m.loss);
  return out;
}

// Every step of the one-stage, one-replica serial loop over the same N micro-batches per step.
inline std::vector<engine::step_metrics> serial_steps(engine::recipe r) {
  r.batch.grad_accum = r.micro_batches_per_step();
  r.parallel = {};
  std::vector<engine::step_metrics> out;
  engine::train_callbacks cb;
  cb.on_step = [&](const engine::step_metrics& m) { out.push_back(m); };
  engine::train(r, cb);
  return out;
}

inline std::vector<double> serial_losses(const engine::recipe& r) {
  return losses_of(serial_steps(r));
}

// The serial loop's validation losses, at the steps it evaluates.
inline std::vector<double> serial_val_losses(const engine::recipe& r) {
  std::vector<double> out;
  for (const auto& m : serial_steps(r))
    if (m.val_loss) out.push_back(*m.val_loss);
  return out;
}

inline run_result run_actors(const engine::recipe& r, run_options o = {}) {
  if (o.compute_threads == 0) o.compute_threads = 1;
  engine::validate_recipe(r);
  return run_training(r, {}, o);
}

inline void require_close(const std::vector<double>& got, const std::vector<double>& want,
                          double rel) {
  REQUIRE(got.size() == want.size());
  for (std::size_t i = 0; i < got.size(); ++i) {
    INFO("step " << i + 1 << ": " << got[i] << " vs serial " << want[i]);
    REQUIRE(std::abs(got[i] - want[i]) <= rel * std::abs(want[i]));
  }
}

// ---- adversarial delivery ------------------------------------------------------------------
using flush_atom = caf::atom_constant<caf::atom("flush")>;

enum class delivery { reversed, delayed, interleaved };

// Messages that went through a relay (so a test can tell the relays were really in the way).
inline std::atomic<long> relayed{0};

// Holds messages for one target and releases them in reverse order (when `window` are held or
// 3 ms after the first), or each after a random delay of 0-3 ms.
inline caf::behavior relay_fn(caf::event_based_actor* self, caf::actor target, delivery how,
                              int window, unsigned seed) {
  auto held = std::make_shared<std::vector<caf::message>>();
  auto rng = std::make_shared<std::mt19937>(seed);
  auto flush = [=] {
    auto batch = std::move(*held);
    held->clear();
    if (how == delivery::reversed) std::reverse(batch.begin(), batch.end());
    if (how == delivery::interleaved) std::shuffle(batch.begin(), batch.end(), *rng);
    for (auto& m : batch) self->anon_send(target, std::move(m));
  };
  self->set_default_handler(
      [=](caf::scheduled_actor*, caf::message_view& x) -> caf::result<caf::message> {
        caf::message m = x.move_content_to_message();
        ++relayed;
        if (how == delivery::delayed) {
          self->delayed_anon_send(target, std::chrono::microseconds((*rng)() % 3000), std::move(m));
          return caf::message{};
        }
        held->push_back(std::move(m));
        if (held->size() == 1)
          self->delayed_send(self, std::chrono::milliseconds(3), flush_atom::value);
        if (static_cast<int>(held->size()) >= window) flush();
        return caf::message{};
      });
  return {[=](flush_atom) { flush(); }};
}

// A link_relay hook for run_options. For `interleaved`, every link of the run goes through one
// mixer that shuffles what it holds, so messages of different links overtake each other.
inline std::function<caf::actor(caf::actor_system&, const caf::actor&)> adversarial(delivery how) {
  auto counter = std::make_shared<unsigned>(0);
  auto mixer = std::make_shared<caf::actor>();
  return [=](caf::actor_system& sys, const caf::actor& target) -> caf::actor {
    if (how != delivery::interleaved) return sys.spawn(relay_fn, target, how, 3, ++*counter);
    // One forwarder per target in front of a shared shuffling mixer.
    if (!*mixer) {
      // (With an argument: CAF 0.17 trips UBSan when starting argument-less function actors.)
      *mixer = sys.spawn(
          [](caf::event_based_actor* self, unsigned seed) -> caf::behavior {
            auto held = std::make_shared<std::vector<std::pair<caf::actor, caf::message>>>();
            auto rng = std::make_shared<std::mt19937>(seed);
            auto flush = [=] {
              auto batch = std::move(*held);
              held->clear();
              std::shuffle(batch.begin(), batch.end(), *rng);
              for (auto& [to, m] : batch) self->anon_send(to, std::move(m));
            };
            return {[=](caf::actor& to, caf::message& m) {
                      held->emplace_back(to, std::move(m));
                      if (held->size() == 1)
                        self->delayed_send(self, std::chrono::milliseconds(3), flush_atom::value);
                      if (held->size() >= 4) flush();
                    },
                    [=](flush_atom) { flush(); }};
          },
          99u);
    }
    return sys.spawn(
        [](caf::event_based_actor* self, caf::actor m, caf::actor target) -> caf::behavior {
          self->link_to(m);  // the mixer ends with the forwarders
          self->set_default_handler(
              [=](caf::scheduled_actor*, caf::message_view& x) -> caf::result<caf::message> {
                ++relayed;
                self->anon_send(m, target, x.move_content_to_message());
                return caf::message{};
              });
          return {[](flush_atom) {}};
        },
        *mixer, target);
  };
}

}  // namespace troupe::actors::test
