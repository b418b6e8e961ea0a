// The stage actor on device chunks of the host kind (engine::host_chunks): the protocol of GPU
// pipelines, where payloads move through links and link messages carry headers only, run on the
// CPU engine's arithmetic. Every step's loss, the validation losses and the final weights must
// equal the run on CPU chunks bitwise, on every schedule device stages take, with
// data-parallel replicas (whose final weights must also agree bitwise), ZeRO-1/2/3 and tensor
// shards, and ZeRO over tensor shards.
#include <cmath>
#include <tuple>

#include "engine/chunks/device_chunk.hpp"
#include "tests/actors/actor_test_util.hpp"

namespace troupe::actors::test {
namespace {

struct device_case {
  const char* name;
  int pp, v, m;
  const char* schedule;
  int grad_accum;
  bool recompute;
  int dp = 1;
  int bucket_layers = 1;
  int tp = 1;
  int zero = 0;
  bool zero_on_device = false;  // device chunks: ZeRO through their zero_group
};

run_options host_device(bool recompute) {
  run_options o;
  o.device_chunks = std::make_shared<engine::chunk_factory>(engine::host_chunks(recompute));
  o.check_replicas = true;  // data-parallel replicas end bitwise equal
  return o;
}

// Every step's loss, gradient norm and validation loss, and the final weights, bitwise equal;
// returns the validations counted.
int same_run(const run_result& got, const run_result& want) {
  REQUIRE(got.steps.size() == want.steps.size());
  int evaluated = 0;
  for (std::size_t i = 0; i < got.steps.size(); ++i) {
    INFO("step " << i + 1);
    REQUIRE(std::isfinite(got.steps[i].loss));
    CHECK(got.steps[i].loss == want.steps[i].loss);
    CHECK(got.steps[i].grad_norm == want.steps[i].grad_norm);
    REQUIRE(got.steps[i].val_loss.has_value() == want.steps[i].val_loss.has_value());
    if (got.steps[i].val_loss) {
      CHECK(*got.steps[i].val_loss == *want.steps[i].val_loss);
      ++evaluated;
    }
  }
  REQUIRE(got.parameters.size() == want.parameters.size());
  for (const auto& [name, values] : want.parameters) {
    INFO(name);
    REQUIRE(got.parameters.count(name) == 1);
    CHECK(got.parameters.at(name) == values);
  }
  return evaluated;
}

TEST_CASE("device stages on host chunks equal the CPU stages bitwise", "[actors][device]") {
  temp_dir dir;
  engine::recipe base = tiny_recipe(dir);
  base.steps = 8;
  base.eval_interval = 4;
  base.eval_batches = 3;
  base.data.val_fraction = 0.1;
  const std::vector<device_case> cases = {
      {"one stage", 1, 1, 2, "1f1b", 1, false},
      {"PP=2 1F1B", 2, 1, 4, "1f1b", 1, false},
      {"PP=3 GPipe, grad_accum 2", 3, 1, 3, "gpipe", 2, false},
      {"PP=2 interleaved v=2", 2, 2, 4, "interleaved_1f1b", 1, false},
      {"PP=4 1F1B, checkpointing", 4, 1, 4, "1f1b", 1, true},
      {"one rank, two chunks (a hop through the rank's own link)", 1, 2, 2, "interleaved_1f1b", 1,
       false},
      // Data parallelism: buckets reduced while backward goes on, then the tied wte summed.
      {"DP=2, one stage", 1, 1, 2, "1f1b", 1, false, 2},
      {"PP=2 x DP=2 1F1B, grad_accum 2", 2, 1, 4, "1f1b", 2, false, 2, 2},
      {"PP=2 x DP=3 interleaved v=2", 2, 2, 4, "interleaved_1f1b", 1, false, 3},
      {"PP=3 x DP=2 GPipe, checkpointing", 3, 1, 3, "gpipe", 1, true, 2},
      // Tensor parallelism: each shard's chunks meet the other shards' in their tensor group;
      // the lanes' links, buckets and tied copies are the shard's slices.
      {"TP=2, one stage", 1, 1, 2, "1f1b", 1, false, 1, 1, 2},
      {"PP=2 x TP=2 1F1B, grad_accum 2", 2, 1, 4, "1f1b", 2, false, 1, 1, 2},
      {"PP=2 x DP=2 x TP=2 interleaved v=2", 2, 2, 4, "interleaved_1f1b", 1, false, 2, 1, 2},
      {"PP=3 x TP=2 GPipe, checkpointing", 3, 1, 3, "gpipe", 1, true, 1, 1, 2},
      // A split backward (ZB-H1): B, then W on the devices, slots held until W.
      {"PP=2 ZB-H1", 2, 1, 4, "zb_h1", 1, false},
      {"PP=2 x DP=2 ZB-H1, grad_accum 2", 2, 1, 4, "zb_h1", 2, false, 2},
      {"PP=2 x TP=2 ZB-H1", 2, 1, 4, "zb_h1", 1, false, 1, 1, 2},
      // W recomputes each block's internals from the input B kept.
      {"PP=2 ZB-H1, checkpointing", 2, 1, 4, "zb_h1", 1, true},
      {"PP=2 x DP=2 x TP=2 ZB-H1, checkpointing", 2, 1, 4, "zb_h1", 1, true, 2, 1, 2},
      // ZeRO-1/2: buckets copied to the chunks' host buffers, reduce-scattered and updated by
      // the shard actors there, the parameters loaded back after the all-gather.
      {"DP=2 ZeRO-1", 1, 1, 2, "1f1b", 1, false, 2, 1, 1, 1},
      {"PP=2 x DP=2 ZeRO-1, grad_accum 2", 2, 1, 4, "1f1b", 2, false, 2, 2, 1, 1},
      {"PP=2 x DP=3 ZeRO-2 interleaved v=2", 2, 2, 4, "interleaved_1f1b", 1, false, 3, 1, 1, 2},
      {"PP=2 x DP=2 ZeRO-2 ZB-H1, checkpointing", 2, 1, 4, "zb_h1", 1, true, 2, 1, 1, 2},
      {"DP=2 ZeRO-2, one micro-batch a step", 1, 1, 1, "1f1b", 1, false, 2, 1, 1, 2},
      // ZeRO-3: the passes stop before each piece reading parameters; each bucket is gathered
      // into the chunks' host copy, then loaded into the chunk before the piece goes on.
      {"DP=2 ZeRO-3", 1, 1, 2, "1f1b", 1, false, 2, 1, 1, 3},
      {"PP=2 x DP=2 ZeRO-3, grad_accum 2", 2, 1, 4, "1f1b", 2, false, 2, 2, 1, 3},
      {"PP=2 x DP=3 ZeRO-3 interleaved v=2", 2, 2, 4, "interleaved_1f1b", 1, false, 3, 1, 1, 3},
      {"PP=2 x DP=2 ZeRO-3 ZB-H1", 2, 1, 4, "zb_h1", 1, false, 2, 1, 1, 3},
      {"PP=3 x DP=2 ZeRO-3 GPipe, checkpointing", 3, 1, 3, "gpipe", 1, true, 2, 1, 1, 3},
      // ... and W stops before each block it recomputes, gathered again.
      {"PP=2 x DP=2 ZeRO-3 ZB-H1, checkpointing", 2, 1, 4, "zb_h1", 1, true, 2, 1, 1, 3},
      {"PP=2 x DP=2 x TP=2 ZeRO-3 ZB-H1, checkpointing", 2, 1, 4, "zb_h1", 1, true, 2, 1, 2, 3},
      // ZeRO over tensor shards: each shard's replicas shard its slices, its zero shards ring
      // with the same shard of the other replicas.
      {"DP=2 x TP=2 ZeRO-1", 1, 1, 2, "1f1b", 1, false, 2, 1, 2, 1},
      {"PP=2 x DP=2 x TP=2 ZeRO-2 ZB-H1", 2, 1, 4, "zb_h1", 1, false, 2, 1, 2, 2},
      {"PP=2 x DP=2 x TP=2 ZeRO-3 interleaved v=2", 2, 2, 4, "interleaved_1f1b", 1, false, 2, 1, 2,
       3},
      // ZeRO-1/2 through the devices' group (parallel.zero_on_device): reduce-scatter, owned
      // AdamW and all-gather in the chunks' own memory, no shard actor, the same numbers (S8:
      // buckets keep their order past the one waiting for the tied exchange).
      {"DP=2 ZeRO-1 on the devices", 1, 1, 2, "1f1b", 1, false, 2, 1, 1, 1, true},
      {"PP=2 x DP=2 ZeRO-1 on the devices, grad_accum 2", 2, 1, 4, "1f1b", 2, false, 2, 2, 1, 1,
       true},
      {"PP=2 x DP=3 ZeRO-2 on the devices, interleaved v=2", 2, 2, 4, "interleaved_1f1b", 1, false,
       3, 1, 1, 2, true},
      {"PP=2 x DP=2 ZeRO-2 on the devices, ZB-H1, checkpointing", 2, 1, 4, "zb_h1", 1, true, 2, 1,
       1, 2, true},
      {"PP=3 x DP=2 ZeRO-1 on the devices, GPipe", 3, 1, 3, "gpipe", 1, false, 2, 1, 1, 1, true},
      {"PP=2 x DP=2 x TP=2 ZeRO-1 on the devices, ZB-H1", 2, 1, 4, "zb_h1", 1, false, 2, 1, 2, 1,
       true},
      // ZeRO-3 through the devices' group: the owned master weights beside their moments, each
      // bucket gathered into the chunk's released buffers before each use.
      {"DP=2 ZeRO-3 on the devices", 1, 1, 2, "1f1b", 1, false, 2, 1, 1, 3, true},
      {"PP=2 x DP=2 ZeRO-3 on the devices, grad_accum 2", 2, 1, 4, "1f1b", 2, false, 2, 2, 1, 3,
       true},
      {"PP=2 x DP=3 ZeRO-3 on the devices, interleaved v=2", 2, 2, 4, "interleaved_1f1b", 1, false,
       3, 1, 1, 3, true},
      {"PP=2 x DP=2 ZeRO-3 on the devices, ZB-H1, checkpointing", 2, 1, 4, "zb_h1", 1, true, 2, 1,
       1, 3, true},
      {"PP=3 x DP=2 ZeRO-3 on the devices, GPipe, checkpointing", 3, 1, 3, "gpipe", 1, true, 2, 1,
       1, 3, true},
      {"PP=2 x DP=2 x TP=2 ZeRO-3 on the devices, ZB-H1", 2, 1, 4, "zb_h1", 1, false, 2, 1, 2, 3,
       true},
  };
  for (const auto& c : cases) {
    DYNAMIC_SECTION(c.name) {
      engine::recipe r = base;
      r.parallel.pp = c.pp;
      r.parallel.virtual_stages = c.v;
      r.parallel.micro_batches = c.m;
      r.parallel.schedule = c.schedule;
      r.batch.grad_accum = c.grad_accum;
      r.activation_checkpoint.mode = c.recompute ? "full" : "none";
      r.parallel.dp = c.dp;
      r.parallel.bucket_layers = c.bucket_layers;
      r.parallel.tp = c.tp;
      r.parallel.zero = c.zero;
      run_options cpu;
      cpu.check_replicas = false;
      const auto want = run_actors(r, cpu);
      engine::recipe on_device = r;
      on_device.parallel.zero_on_device = c.zero_on_device;
      const auto got = run_actors(on_device, host_device(c.recompute));
      CHECK(same_run(got, want) == 2);  // two validations
      if (c.zero > 0 && c.zero < 3) {
        // Host shards keep host copies of the chunks' buffers (buffers); through the devices
        // nothing is kept on the host, and the owned moments are the chunks' own.
        REQUIRE_FALSE(got.steps.back().memory.empty());
        for (const auto& m : got.steps.back().memory) {
          INFO("replica " << m.replica << " rank " << m.rank);
          CHECK(m.optimizer > 0);
          if (c.zero_on_device)
            CHECK(m.buffers == 0);
          else
            CHECK(m.buffers > 0);
        }
      }
      if (c.zero == 3 && c.zero_on_device) {
        // The owned master weights and moments on the devices are what the CPU's shards own;
        // the buffers hold the most gathered at once, as the CPU stages' do.
        REQUIRE(got.steps.back().memory.size() == want.steps.back().memory.size());
        for (const auto& m : got.steps.back().memory) {
          INFO("replica " << m.replica << " rank " << m.rank);
          bool found = false;
          for (const auto& w : want.steps.back().memory) {
            if (w.replica != m.replica || w.rank != m.rank) continue;
            found = true;
            CHECK(m.parameters == w.parameters);
            CHECK(m.optimizer == w.optimizer);
            CHECK(m.buffers > 0);
            CHECK(m.buffers < m.gradients);  // never every bucket at once
          }
          CHECK(found);
        }
      }
    }
  }
}

TEST_CASE("a device tensor shard that dies ends the run naming it; its peers do not hang",
          "[actors][device]") {
  temp_dir dir;
  engine::recipe r = tiny_recipe(dir);
  r.steps = 50;
  r.parallel.pp = 2;
  r.parallel.micro_batches = 4;
  r.parallel.tp = 2;
  run_options o = host_device(false);
  o.after_step = [](caf::actor_system&, const run_handles& h, int step) {
    // Lane 1 is shard 1 of replica 0.
    if (step == 2) caf::anon_send_exit(h.stages.at(1).at(0), caf::exit_reason::kill);
  };
  // Its own stop, or its peer's failure in the group the dead shard aborted on its way out.
  REQUIRE_THROWS_WITH(run_actors(r, o),
                      Catch::Matches(".*stage (0 · dp 0 · |rank 0 replica 0 )tp 1 stopped.*"));
}

// Micro-batches of several sequence lengths: a chunk's slots hold the longest (evaluation's
// here), a shorter one uses their front, and its payloads and the links' transfers are its own
// size.
TEST_CASE("device stages take variable sequence lengths, bitwise the CPU stages",
          "[actors][device]") {
  temp_dir dir;
  engine::recipe base = tiny_recipe(dir);
  base.steps = 4;
  base.eval_interval = 2;
  base.eval_batches = 2;
  base.data.val_fraction = 0.1;
  base.batch.seq_len = 24;  // evaluation's micro-batches, longer than any training one
  for (const auto& [pp, dp, m] : {std::tuple{2, 1, 4}, std::tuple{2, 2, 3}, std::tuple{1, 1, 3}}) {
    DYNAMIC_SECTION("pp " << pp << " dp " << dp << " m " << m) {
      engine::recipe r = base;
      r.parallel.pp = pp;
      r.parallel.dp = dp;
      r.parallel.micro_batches = m;
      run_options cpu;
      cpu.check_replicas = false;
      cpu.seq_lens = {16, 5, 11};
      run_options dev = host_device(false);
      dev.seq_lens = cpu.seq_lens;
      const auto want = run_actors(r, cpu);
      const auto got = run_actors(r, dev);
      same_run(got, want);
    }
  }
}

}  // namespace
}  // namespace troupe::actors::test
