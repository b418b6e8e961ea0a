// Tensor parallelism on the actor engine (docs/tensor_parallel.md): t tensor-shard actors per
// stage. Every configuration's losses and gradient norms equal the serial run's within 1e-5
// relative over 20 steps (also with gradient accumulation and with evaluation), the shards' slices
// put back together are the parameters of a run without tensor parallelism, a shard that dies ends
// the run naming it (its peers, waiting in a collective, do not hang), a model that cannot
// be split is refused naming parallel.tp, and ZeRO-1/2/3 over tensor shards match the serial run.
#include "engine/parallel/memory_plan.hpp"
#include "tests/actors/actor_test_util.hpp"

namespace troupe::actors::test {
namespace {

struct config {
  const char* name;
  int pp, dp, tp, v, m;
  const char* schedule;
};

const std::vector<config>& configs() {
  static const std::vector<config> all = {
      {"TP=2", 1, 1, 2, 1, 1, "1f1b"},
      {"PP=2 x TP=2 1F1B", 2, 1, 2, 1, 4, "1f1b"},
      {"DP=2 x TP=2", 1, 2, 2, 1, 2, "1f1b"},
      {"PP=2 x DP=2 x TP=2 ZB-H1", 2, 2, 2, 1, 4, "zb_h1"},
      {"PP=2 x TP=4 interleaved v=2", 2, 1, 4, 2, 4, "interleaved_1f1b"},
  };
  return all;
}

engine::recipe tp_recipe(const temp_dir& dir) {
  engine::recipe r = tiny_recipe(dir);
  r.model.heads = 4;  // 4 shards of one head each at most
  r.model.layers = 4;
  return r;
}

engine::recipe with(engine::recipe r, const config& c) {
  r.parallel.pp = c.pp;
  r.parallel.dp = c.dp;
  r.parallel.tp = c.tp;
  r.parallel.virtual_stages = c.v;
  r.parallel.micro_batches = c.m;
  r.parallel.schedule = c.schedule;
  return r;
}

// The same tensors, each within tol of the largest magnitude of want's.
template <class Params>
void same_tensors_within(const Params& got, const Params& want, double tol) {
  REQUIRE(got.size() == want.size());
  for (const auto& [name, w] : want) {
    INFO(name);
    const auto& g = got.at(name);
    REQUIRE(g.size() == w.size());
    double diff = 0, mag = 1e-30;
    for (std::size_t i = 0; i < w.size(); ++i) {
      diff = std::max(diff, std::abs(double(g[i]) - double(w[i])));
      mag = std::max(mag, std::abs(double(w[i])));
    }
    CHECK(diff <= tol * mag);
  }
}

std::vector<double> norms_of(const std::vector<engine::step_metrics>& steps) {
  std::vector<double> out;
  for (const auto& m : steps) out.push_back(m.grad_norm);
  return out;
}

TEST_CASE("tensor-parallel configurations match the serial run step by step",
          "[actors][tensor_parallel]") {
  temp_dir dir;
  const engine::recipe base = tp_recipe(dir);
  for (const auto& c : configs()) {
    for (const bool accum : {false, true}) {
      engine::recipe r = with(base, c);
      if (accum) r.batch.grad_accum = 2;
      DYNAMIC_SECTION(c.name << (accum ? ", grad_accum 2" : "")) {
        run_options o;
        o.check_replicas = true;  // every data-parallel replica ends with the same parameters
        const auto got = run_actors(r, o).steps;
        const auto want = serial_steps(r);
        require_close(losses_of(got), losses_of(want), 1e-5);
        // The norm counts each slice once and each replicated parameter once.
        require_close(norms_of(got), norms_of(want), 1e-5);
      }
    }
  }
}

TEST_CASE("tensor shards evaluate the whole model", "[actors][tensor_parallel]") {
  temp_dir dir;
  engine::recipe r = with(tp_recipe(dir), configs()[1]);  // PP=2 x TP=2
  r.data.val_fraction = 0.1;
  r.eval_interval = 3;
  r.eval_batches = 3;
  r.steps = 6;
  std::vector<double> got;
  for (const auto& m : run_actors(r).steps)
    if (m.val_loss) got.push_back(*m.val_loss);
  require_close(got, serial_val_losses(r), 1e-5);
  REQUIRE(got.size() == 2);
}

TEST_CASE("the shards' slices put together are the parameters of an unsharded run",
          "[actors][tensor_parallel]") {
  temp_dir dir;
  engine::recipe r = with(tp_recipe(dir), configs()[1]);  // PP=2 x TP=2
  r.steps = 4;
  const auto sharded = run_actors(r).parameters;
  r.parallel.tp = 1;
  const auto whole = run_actors(r).parameters;
  same_tensors_within(sharded, whole, 1e-4);
}

TEST_CASE("each shard holds what the dry-run plans for a shard", "[actors][tensor_parallel]") {
  temp_dir dir;
  for (const bool full : {false, true}) {
    INFO((full ? "checkpointed" : "not checkpointed"));
    engine::recipe r = with(tp_recipe(dir), configs()[1]);  // PP=2 x TP=2
    r.activation_checkpoint.mode = full ? "full" : "none";
    r.steps = 2;
    const auto plan = engine::plan_memory(r);
    r.parallel.tp = 1;
    const auto unsharded = engine::plan_memory(r);
    r.parallel.tp = 2;
    const auto steps = run_actors(r).steps;
    REQUIRE(steps.back().memory.size() == 4);  // 2 ranks x 2 shards
    for (const auto& m : steps.back().memory) {
      const auto& p = plan.at(static_cast<std::size_t>(m.rank));
      INFO("lane " << m.replica << " rank " << m.rank);
      CHECK(m.activations == p.activation_bytes());
      CHECK(m.parameters == p.parameters * 4);
      CHECK(p.parameters < unsharded.at(static_cast<std::size_t>(m.rank)).parameters);
      CHECK(p.activation_bytes() <
            unsharded.at(static_cast<std::size_t>(m.rank)).activation_bytes());
    }
  }
}

TEST_CASE("a tensor shard that dies ends the run naming it; its peers do not hang",
          "[actors][tensor_parallel]") {
  temp_dir dir;
  engine::recipe r = with(tp_recipe(dir), configs()[1]);  // PP=2 x TP=2
  r.steps = 50;
  run_options o;
  o.after_step = [](caf::actor_system&, const run_handles& h, int step) {
    // Lane 1 is shard 1 of replica 0.
    if (step == 2) caf::anon_send_exit(h.stages.at(1).at(0), caf::exit_reason::kill);
  };
  // The report names shard 1: either its own stop ("stage 0 · dp 0 · tp 1 stopped ...") or, when
  // its peer's report comes first, the peer's failure, whose reason is "... stage rank 0
  // replica 0 tp 1 stopped" (the dead shard aborted their group on its way out).
  REQUIRE_THROWS_WITH(run_actors(r, o), Catch::Matches(".*stage (0 · dp 0 · |rank 0 replica 0 )tp "
                                                       "1 stopped.*"));
}

TEST_CASE("tensor parallelism refuses what it cannot split, naming parallel.tp",
          "[actors][tensor_parallel]") {
  temp_dir dir;
  engine::recipe r = tp_recipe(dir);
  r.parallel.tp = 3;
  REQUIRE_THROWS_WITH(engine::validate_recipe(r),
                      Catch::StartsWith("key parallel.tp: 4 heads (model.heads) do not split"));
}

// ZeRO over tensor shards: the replicas of each shard shard its slices. Losses and norms (each
// replicated parameter counted once, on shard 0) equal the serial run's; ZeRO-2 and 3 change no
// bit of ZeRO-1's run; the gathered weights are close to data parallelism's over the same shards.
TEST_CASE("ZeRO-1, 2 and 3 over tensor shards match the serial run step by step",
          "[actors][tensor_parallel][zero]") {
  temp_dir dir;
  const engine::recipe base = tp_recipe(dir);
  for (const int c : {2, 3}) {  // DP=2 x TP=2; PP=2 x DP=2 x TP=2 ZB-H1
    DYNAMIC_SECTION(configs()[static_cast<std::size_t>(c)].name) {
      engine::recipe r = with(base, configs()[static_cast<std::size_t>(c)]);
      r.batch.grad_accum = 2;
      run_options o;
      o.check_replicas = true;  // every replica ends with bitwise the same parameters
      const auto ddp = run_actors(r, o);
      const auto want = serial_steps(r);
      std::vector<run_result> zero;
      for (int stage : {1, 2, 3}) {
        r.parallel.zero = stage;
        zero.push_back(run_actors(r, o));
      }
      for (int stage : {1, 2, 3}) {
        INFO("ZeRO-" << stage);
        const auto& z = zero[static_cast<std::size_t>(stage - 1)];
        require_close(losses_of(z.steps), losses_of(want), 1e-5);
        require_close(norms_of(z.steps), norms_of(want), 1e-5);
        REQUIRE(losses_of(z.steps) == losses_of(zero[0].steps));
        REQUIRE(z.parameters == zero[0].parameters);
      }
      same_tensors_within(zero[0].parameters, ddp.parameters, 1e-4);
    }
  }
}

}  // namespace
}  // namespace troupe::actors::test
