// Checkpoints of the actor engine and exact resume (docs/checkpoints.md): a run that saves every
// 3 steps and is resumed from its step-3 checkpoint ends bitwise as the run that went through:
// every later step's loss, gradient norm and validation loss, and the final weights, on every
// layout (pipeline, data-parallel, ZeRO-1/2/3, tensor shards, interleaving, ZB-H1, device
// chunks of the host kind, the update guard's windows). Resumed at another mesh (resharding),
// the run continues the same data and stays within 1e-5 of the one that went through. A
// checkpoint copied while the next step runs holds the state between the steps, however late the
// copy.
#include <algorithm>
#include <cmath>
#include <filesystem>

#include "actors/checkpoint_writer.hpp"
#include "engine/chunks/device_chunk.hpp"
#include "engine/training/checkpoint.hpp"
#include "tests/actors/actor_test_util.hpp"

namespace troupe::actors::test {
namespace {

namespace fs = std::filesystem;

struct mesh {
  int pp = 1, dp = 1, tp = 1, zero = 0, v = 1, m = 2;
  const char* schedule = "1f1b";
  bool host_chunks = false;
  bool zero_on_device = false;  // host chunks: ZeRO through their zero_group
  bool parts = false;           // checkpoint.format "parts": each stage writes its own part
};

engine::recipe with_mesh(engine::recipe r, const mesh& x) {
  r.parallel.pp = x.pp;
  r.parallel.dp = x.dp;
  r.parallel.tp = x.tp;
  r.parallel.zero = x.zero;
  r.parallel.virtual_stages = x.v;
  r.parallel.micro_batches = x.m;
  r.parallel.schedule = x.schedule;
  r.parallel.zero_on_device = x.zero_on_device;
  r.checkpoint.format = x.parts ? "parts" : "auto";
  return r;
}

run_options options(const mesh& x) {
  run_options o;
  if (x.host_chunks)
    o.device_chunks = std::make_shared<engine::chunk_factory>(engine::host_chunks(false));
  return o;
}

engine::recipe base_recipe(const temp_dir& dir) {
  engine::recipe r = tiny_recipe(dir);
  r.model.layers = 4;
  r.steps = 8;
  r.eval_interval = 4;
  r.eval_batches = 2;
  r.data.val_fraction = 0.1;
  r.batch.grad_accum = 1;
  // The guard's windows fill before the checkpoint and decide after it.
  r.guard.window = 2;
  r.guard.loss_zscore = 50;
  r.guard.grad_norm_zscore = 50;
  return r;
}

// Two checkpoints' tensor files (whole-model files, or every stage's part) are byte for byte the
// same.
void same_tensor_files(const fs::path& a, const fs::path& b) {
  auto files = [](const fs::path& dir) {
    std::vector<std::string> names;
    for (const auto& e : fs::directory_iterator(dir))
      if (e.path().extension() == ".safetensors") names.push_back(e.path().filename().string());
    std::sort(names.begin(), names.end());
    return names;
  };
  const auto names = files(a);
  REQUIRE(names.size() >= 2);
  REQUIRE(files(b) == names);
  for (const auto& f : names) {
    INFO(a.string() << " " << f);
    std::ifstream p(a / f, std::ios::binary), q(b / f, std::ios::binary);
    const std::string pa(std::istreambuf_iterator<char>(p), {}),
        qa(std::istreambuf_iterator<char>(q), {});
    CHECK(!pa.empty());
    CHECK(pa == qa);
  }
}

// Steps after `from` (1-based step numbers), bitwise or within rel.
void same_steps(const run_result& got, const run_result& want, int from, double rel) {
  REQUIRE(got.steps.size() == want.steps.size() - static_cast<std::size_t>(from));
  for (std::size_t i = 0; i < got.steps.size(); ++i) {
    const auto& g = got.steps[i];
    const auto& w = want.steps[i + static_cast<std::size_t>(from)];
    INFO("step " << g.step);
    REQUIRE(g.step == w.step);
    CHECK(g.tokens == w.tokens);
    if (rel == 0) {
      CHECK(g.loss == w.loss);
      CHECK(g.grad_norm == w.grad_norm);
    } else {
      CHECK(std::abs(g.loss - w.loss) <= rel * std::abs(w.loss));
      CHECK(std::abs(g.grad_norm - w.grad_norm) <= 10 * rel * std::abs(w.grad_norm));
    }
    REQUIRE(g.val_loss.has_value() == w.val_loss.has_value());
    if (g.val_loss) {
      if (rel == 0)
        CHECK(*g.val_loss == *w.val_loss);
      else
        CHECK(std::abs(*g.val_loss - *w.val_loss) <= rel * std::abs(*w.val_loss));
    }
  }
}

TEST_CASE("a run resumed from its checkpoint ends bitwise as the run that went through",
          "[actors][checkpoint]") {
  const std::vector<std::pair<const char*, mesh>> cases = {
      {"one stage", {}},
      {"PP=2 1F1B", {2, 1, 1, 0, 1, 4}},
      {"PP=2 x DP=2 interleaved v=2", {2, 2, 1, 0, 2, 4, "interleaved_1f1b"}},
      {"DP=2 ZeRO-1", {1, 2, 1, 1}},
      {"PP=2 x DP=2 ZeRO-2 ZB-H1", {2, 2, 1, 2, 1, 4, "zb_h1"}},
      {"PP=2 x DP=3 ZeRO-3", {2, 3, 1, 3, 1, 2}},
      {"PP=2 x TP=2", {2, 1, 2, 0, 1, 4}},
      {"DP=2 x TP=2 ZeRO-3", {1, 2, 2, 3, 1, 2}},
      {"device chunks PP=2 x DP=2", {2, 2, 1, 0, 1, 4, "1f1b", true}},
      {"device chunks PP=2 x DP=2 ZeRO-1", {2, 2, 1, 1, 1, 4, "1f1b", true}},
      {"device chunks PP=2 x DP=2 ZeRO-2 on the devices", {2, 2, 1, 2, 1, 4, "1f1b", true, true}},
      {"device chunks PP=2 x DP=3 ZeRO-3 on the devices", {2, 3, 1, 3, 1, 2, "1f1b", true, true}},
      // Format 2: each stage writes its part.
      {"PP=2 x DP=2 interleaved v=2, parts",
       {2, 2, 1, 0, 2, 4, "interleaved_1f1b", false, false, true}},
      {"PP=2 x DP=3 ZeRO-3, parts", {2, 3, 1, 3, 1, 2, "1f1b", false, false, true}},
      {"DP=2 x TP=2 ZeRO-1, parts", {1, 2, 2, 1, 1, 2, "1f1b", false, false, true}},
      {"device chunks PP=2 x DP=2 ZeRO-2 on the devices, parts",
       {2, 2, 1, 2, 1, 4, "1f1b", true, true, true}},
  };
  for (const auto& [name, x] : cases) {
    DYNAMIC_SECTION(name) {
      temp_dir dir;
      const engine::recipe r = with_mesh(base_recipe(dir), x);
      const auto through = run_actors(r, options(x));

      engine::recipe saving = r;
      saving.checkpoint.every = 3;
      saving.output.dir = (dir / "saving").string();
      const auto saved = run_actors(saving, options(x));
      same_steps(saved, through, 0, 0);  // checkpointing changes nothing
      CHECK(saved.parameters == through.parameters);
      const auto root = saving.checkpoint_path();
      const auto all = engine::list_checkpoints(root);
      REQUIRE(all.size() == 2);  // steps 6 and 3 (keep 2)
      CHECK(all[0].step == 6);
      CHECK(engine::verify_checkpoint(all[1].dir).empty());

      engine::recipe resumed = saving;
      resumed.output.dir = (dir / "resumed").string();
      run_options o = options(x);
      o.resume = all[1].dir.string();
      const auto got = run_actors(resumed, o);
      same_steps(got, through, 3, 0);
      CHECK(got.parameters == through.parameters);
      // It wrote its own checkpoint of step 6, bitwise the first run's.
      const auto again = engine::list_checkpoints(resumed.checkpoint_path());
      REQUIRE(again.size() == 1);
      CHECK(again[0].step == 6);
      CHECK(fs::exists(all[0].dir / (x.parts ? "part-000-000.safetensors" : "model.safetensors")));
      same_tensor_files(again[0].dir, all[0].dir);
    }
  }
}

TEST_CASE("a checkpoint resumes at another mesh and goes on with the same data",
          "[actors][checkpoint]") {
  // The same micro-batches per step at both meshes (dp x micro_batches), so the steps after the
  // checkpoint see the same data as the run that went through.
  const std::vector<std::tuple<const char*, mesh, mesh>> cases = {
      {"PP=2 x DP=2 ZeRO-1 -> one stage", {2, 2, 1, 1, 1, 2}, {1, 1, 1, 0, 1, 4}},
      {"one stage -> PP=3 x TP=2", {1, 1, 1, 0, 1, 4}, {3, 1, 2, 0, 1, 4}},
      {"DP=2 ZeRO-3 -> DP=4 ZeRO-2", {1, 2, 1, 3, 1, 2}, {1, 4, 1, 2, 1, 1}},
      {"PP=2 x DP=2 x TP=2 ZeRO-2 -> one stage", {2, 2, 2, 2, 1, 2}, {1, 1, 1, 0, 1, 4}},
      {"one stage -> DP=2 x TP=2 ZeRO-1", {1, 1, 1, 0, 1, 4}, {1, 2, 2, 1, 1, 2}},
      {"PP=2 x TP=2 -> device chunks PP=2 x DP=2 ZeRO-1",
       {2, 1, 2, 0, 1, 4},
       {2, 2, 1, 1, 1, 2, "1f1b", true}},
      {"device chunks DP=2 ZeRO-3 on the devices -> PP=2 x DP=2 ZeRO-3 on the devices",
       {1, 2, 1, 3, 1, 2, "1f1b", true, true},
       {2, 2, 1, 3, 1, 2, "1f1b", true, true}},
      {"PP=2 x DP=2 x TP=2 ZeRO-2, parts -> one stage",
       {2, 2, 2, 2, 1, 2, "1f1b", false, false, true},
       {1, 1, 1, 0, 1, 4}},
  };
  for (const auto& [name, from, to] : cases) {
    DYNAMIC_SECTION(name) {
      temp_dir dir;
      engine::recipe r = with_mesh(base_recipe(dir), from);
      r.checkpoint.every = 3;
      r.checkpoint.keep = 3;
      const auto through = run_actors(r, options(from));
      const auto step3 = engine::checkpoint_dir(r.checkpoint_path(), 3);
      REQUIRE(engine::verify_checkpoint(step3).empty());

      engine::recipe at = with_mesh(r, to);
      at.output.dir = (dir / "resharded").string();
      run_options o = options(to);
      o.resume = step3.string();
      const auto got = run_actors(at, o);
      same_steps(got, through, 3, 1e-5);
      // Its step-6 checkpoint holds the same tensors, within rounding.
      const auto mine = engine::checkpoint_dir(at.checkpoint_path(), 6);
      const auto theirs = engine::checkpoint_dir(r.checkpoint_path(), 6);
      for (const char* f : {"model", "exp_avg"}) {
        const auto a = engine::load_checkpoint_tensors(mine, f, at.model,
                                                       engine::chunk_range::whole(at.model));
        const auto b = engine::load_checkpoint_tensors(theirs, f, r.model,
                                                       engine::chunk_range::whole(r.model));
        REQUIRE(a.size() == b.size());
        double worst = 0, largest = 0;
        for (std::size_t i = 0; i < a.size(); ++i) {
          worst = std::max(worst, double(std::abs(a[i] - b[i])));
          largest = std::max(largest, double(std::abs(b[i])));
        }
        INFO(f << ": largest difference " << worst << " of " << largest);
        CHECK(worst <= 1e-4 * largest);
      }
    }
  }
}

TEST_CASE("a fresh run does not write over another run's checkpoints", "[actors][checkpoint]") {
  temp_dir dir;
  engine::recipe r = base_recipe(dir);
  r.steps = 3;
  r.checkpoint.every = 3;
  run_actors(r);
  REQUIRE(engine::list_checkpoints(r.checkpoint_path()).size() == 1);
  CHECK_THROWS_WITH(run_actors(r), Catch::Contains("key checkpoint.dir") &&
                                       Catch::Contains("step-00000003") &&
                                       Catch::Contains("--resume"));
  run_options o;
  o.resume = r.checkpoint_path().string();
  r.steps = 2;  // fewer than the checkpoint's (at exactly its steps, a resume ends at once)
  CHECK_THROWS_WITH(run_actors(r, o),
                    Catch::Contains("key steps") && Catch::Contains("nothing to run"));
  o.resume = (dir / "nowhere").string();
  CHECK_THROWS_WITH(run_actors(r, o),
                    Catch::Contains("cannot resume") && Catch::Contains("nowhere"));
}

void late_copy_is_exact(const mesh& x) {
  temp_dir dir;
  engine::recipe r = with_mesh(base_recipe(dir), x);
  r.checkpoint.every = 3;
  engine::recipe prompt = r, late = r;
  prompt.output.dir = (dir / "prompt").string();
  late.output.dir = (dir / "late").string();
  const auto a = run_actors(prompt, options(x));
  run_options o = options(x);
  o.test_capture_delay_ms = 300;
  const auto b = run_actors(late, o);
  same_steps(b, a, 0, 0);
  for (const int step : {3, 6}) {
    INFO("step " << step);
    same_tensor_files(engine::checkpoint_dir(prompt.checkpoint_path(), step),
                      engine::checkpoint_dir(late.checkpoint_path(), step));
  }
}

// A stage copies a captured state while the next step runs (device chunks: begun at the capture,
// taken on a thread), and that step's update waits for the copy (stage S7): with every copy made
// to be taken 300 ms late, long after the next update would otherwise have run, the checkpoints
// are still byte for byte those of a run without delay, with and without ZeRO.
TEST_CASE("a checkpoint holds the state between its steps, however late its copy runs",
          "[actors][checkpoint]") {
  const std::vector<std::pair<const char*, mesh>> cases = {
      {"CPU chunks PP=2", {2, 1, 1, 0, 1, 4}},
      {"device chunks PP=2 x DP=2", {2, 2, 1, 0, 1, 4, "1f1b", true}},
      // ZeRO: replica 0's parameters copied on the thread, the owned floats asked of the shard
      // at the capture (answered before the update that follows), or copied from the devices.
      {"CPU chunks PP=2 x DP=2 ZeRO-1", {2, 2, 1, 1, 1, 4}},
      {"CPU chunks DP=2 ZeRO-3", {1, 2, 1, 3, 1, 2}},
      {"device chunks PP=2 x DP=2 ZeRO-2", {2, 2, 1, 2, 1, 4, "1f1b", true}},
      {"device chunks PP=2 x DP=2 ZeRO-1 on the devices", {2, 2, 1, 1, 1, 4, "1f1b", true, true}},
      {"device chunks DP=2 ZeRO-3 on the devices", {1, 2, 1, 3, 1, 2, "1f1b", true, true}},
      {"CPU chunks PP=2 x DP=2 ZeRO-1, parts", {2, 2, 1, 1, 1, 4, "1f1b", false, false, true}},
  };
  for (const auto& [name, x] : cases) {
    DYNAMIC_SECTION(name) { late_copy_is_exact(x); }
  }
}

}  // namespace
}  // namespace troupe::actors::test

namespace troupe::actors::test {
namespace {

// A stage whose process was lost: it takes snapshot requests and never answers. (A class: CAF
// 0.17's function-based actors spawned without arguments trip UBSan inside CAF.)
class silent_stage : public caf::event_based_actor {
 public:
  using caf::event_based_actor::event_based_actor;
  caf::behavior make_behavior() override {
    return {[this](const messages::snapshot_request&) -> caf::result<messages::stage_snapshot> {
      return make_response_promise<messages::stage_snapshot>();
    }};
  }
};

}  // namespace

// A failed job's teardown does not wait for a checkpoint whose stage is gone (W3): the flush that
// abandons it is answered at once and nothing of it is written; a plain flush with nothing
// being collected is answered too.
TEST_CASE("a flush that abandons a checkpoint being collected answers at once",
          "[actors][checkpoint]") {
  temp_dir dir;
  const auto root = dir.path() / "ckpt";
  caf::actor_system_config cfg;
  caf::actor_system sys{cfg};
  {
    auto stage = sys.spawn<silent_stage>();
    checkpoint_writer_config wc;
    wc.model = tiny_recipe(dir).model;
    wc.root = root;
    wc.stages = {{stage}};
    auto writer = spawn_checkpoint_writer(sys, std::move(wc));
    caf::scoped_actor self{sys};
    bool answered = false;
    self->request(writer, std::chrono::seconds(10), messages::checkpoint_flush{})
        .receive([&](bool ok) { answered = ok; }, [](caf::error&) {});
    CHECK(answered);  // nothing being collected
    engine::checkpoint_state state;
    state.step = 3;
    self->send(writer, messages::checkpoint_begin{state});  // its stage never answers
    answered = false;
    self->request(writer, std::chrono::seconds(10), messages::checkpoint_flush{true})
        .receive([&](bool ok) { answered = ok; }, [](caf::error&) {});
    CHECK(answered);
    CHECK(engine::list_checkpoints(root).empty());
    self->send_exit(writer, caf::exit_reason::user_shutdown);
    self->send_exit(stage, caf::exit_reason::user_shutdown);
  }
}

}  // namespace troupe::actors::test
