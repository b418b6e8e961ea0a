// Resume identity (engine/training/resume_check.hpp, docs/checkpoints.md): every recipe key has
// a class; a changed model key is refused naming both values; trajectory keys and the global
// batch are refused unless allowed, and then recorded; mesh and free changes are reported; a
// checkpoint's recipe parses back without its input files; trainer states without recorded
// changes still read; metrics lines after a resumed step are kept aside, never lost.
#include <catch2/catch.hpp>

#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "engine/training/checkpoint.hpp"
#include "engine/training/metrics.hpp"
#include "engine/training/resume_check.hpp"

using namespace troupe::engine;
namespace fs = std::filesystem;

namespace {

const char* kRecipe = R"(seed = 9
steps = 6
[model]
vocab_size = 256
context = 16
layers = 2
heads = 2
width = 16
[data]
train = "/nonexistent/corpus.txt"
[batch]
micro_batch = 2
seq_len = 16
[parallel]
pp = 2
micro_batches = 2
)";

recipe with(const std::vector<std::string>& overrides) {
  return parse_recipe(kRecipe, "test.toml", overrides);
}

std::string refusal(const recipe& saved, const recipe& now,
                    const std::vector<std::string>& allowed = {}) {
  try {
    review_resume(saved, now, 4, allowed);
  } catch (const recipe_error& e) {
    return e.what();
  }
  return "";
}

std::string read_all(const fs::path& p) {
  std::ifstream in(p);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

step_metrics at_step(int step, double loss) {
  step_metrics m;
  m.step = step;
  m.loss = loss;
  return m;
}

fs::path fresh_dir(const std::string& name) {
  const auto dir = fs::temp_directory_path() / ("troupe_resume_check_" + name);
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

}  // namespace

TEST_CASE("every recipe key has a resume class, and the table lists each") {
  const auto keys = recipe_keys(recipe{});
  REQUIRE(keys.size() > 50);
  const auto table = format_key_classes();
  for (const auto& k : keys) {
    CHECK(!k.why.empty());
    CHECK(table.find("| `" + k.name + "` | " + key_class_name(k.cls) + " |") != std::string::npos);
  }
  const auto cls = [&](const std::string& name) {
    for (const auto& k : keys)
      if (k.name == name) return std::string(key_class_name(k.cls));
    return std::string("none");
  };
  CHECK(cls("model.heads") == "model");
  CHECK(cls("seed") == "trajectory");
  CHECK(cls("optimizer.beta2") == "trajectory");
  CHECK(cls("data.order") == "trajectory");
  CHECK(cls("parallel.pp") == "mesh");
  CHECK(cls("steps") == "free");
  CHECK(cls("checkpoint.keep") == "free");
}

TEST_CASE("the same recipe resumes with nothing to say") {
  const auto r = with({});
  const auto review = review_resume(r, r, 4, {});
  CHECK(review.allowed.empty());
  CHECK(review.mesh.empty());
  CHECK(review.free.empty());
  CHECK(refusal(r, with({"steps=20"})).empty());  // a run extended
}

TEST_CASE("a model key is refused with the checkpoint's value and the recipe's") {
  const auto e = refusal(with({}), with({"model.heads=4"}), {"optimizer.lr"});
  CHECK(e ==
        "key model.heads: the checkpoint's model has 2, the recipe 4: a resume cannot "
        "change the model");
}

TEST_CASE("trajectory keys are refused unless allowed, then recorded at the step") {
  const auto saved = with({});
  const auto now = with({"seed=3", "optimizer.lr=0.002"});
  const auto e = refusal(saved, now);
  CHECK(e.find("seed (9 -> 3)") != std::string::npos);
  CHECK(e.find("optimizer.lr (0.001 -> 0.002)") != std::string::npos);
  CHECK(e.find("--allow-change") != std::string::npos);
  CHECK(refusal(saved, now, {"seed"}).find("optimizer.lr") != std::string::npos);
  const auto review = review_resume(saved, now, 4, {"seed", "optimizer.lr"});
  REQUIRE(review.allowed.size() == 2);
  CHECK(review.allowed[0] == recipe_change{4, "seed", "9", "3"});
  CHECK(review.allowed[1] == recipe_change{4, "optimizer.lr", "0.001", "0.002"});
}

TEST_CASE("mesh keys reshard while the global batch stays; otherwise it is a trajectory change") {
  const auto saved = with({});
  // Twice the replicas, half the micro-batches each: the same micro-batches per step.
  const auto review =
      review_resume(saved, with({"parallel.dp=2", "parallel.micro_batches=1"}), 4, {});
  CHECK(review.allowed.empty());
  CHECK(review.mesh ==
        std::vector<std::string>{"parallel.dp 1 -> 2", "parallel.micro_batches 2 -> 1"});
  CHECK(global_batch_tokens(saved) == 2 * 2 * 16);
  const auto doubled = with({"parallel.dp=2"});
  CHECK(refusal(saved, doubled).find("global_batch (64 -> 128 tokens per step)") !=
        std::string::npos);
  CHECK(review_resume(saved, doubled, 4, {"global_batch"}).allowed ==
        std::vector<recipe_change>{{4, "global_batch", "64", "128"}});
  // An allowed batch key changes the global batch with it.
  const auto rows = review_resume(saved, with({"batch.micro_batch=4"}), 4, {"batch.micro_batch"});
  CHECK(rows.allowed.size() == 2);
  CHECK(rows.allowed.back().key == "global_batch");
}

TEST_CASE("free keys change freely and are listed") {
  const auto review =
      review_resume(with({}), with({"eval_interval=3", "checkpoint.keep=5"}), 4, {});
  CHECK(review.free == std::vector<std::string>{"eval_interval 50 -> 3", "checkpoint.keep 2 -> 5"});
}

TEST_CASE("--allow-change names only trajectory keys") {
  const auto r = with({});
  CHECK(refusal(r, r, {"no.such"}) == "--allow-change: unknown key no.such");
  CHECK(refusal(r, r, {"parallel.pp"}).find("a mesh key, not a trajectory key") !=
        std::string::npos);
  CHECK(refusal(r, r, {"model.width"}).find("a model key") != std::string::npos);
}

TEST_CASE("a checkpoint's recipe parses back without its input files") {
  checkpoint_state s;
  s.recipe_text = kRecipe;
  s.overrides = {"optimizer.lr=0.002"};
  const auto r = saved_recipe(s, "ckpt/step-00000004");
  REQUIRE(r);
  CHECK(r->optimizer.lr == Approx(0.002));
  CHECK(!saved_recipe(checkpoint_state{}, "ckpt"));
  s.recipe_text = "steps = \"many\"";
  CHECK_THROWS_WITH(
      saved_recipe(s, "ckpt"),
      Catch::Contains("the checkpoint's recipe does not parse") && Catch::Contains("steps"));
}

TEST_CASE("trainer states with and without recorded changes read") {
  const auto dir = fresh_dir("state");
  const std::string common =
      R"("step": 4, "tokens": 256, "micro_batches": 8, "schedule": "1f1b",
      "guard": {"scale_bits": 4607182418800017408, "scale": 1, "good_steps": 0,
                "skips_in_a_row": 0,
                "loss_window": {"values_bits": [], "next": 0, "count": 0},
                "grad_norm_window": {"values_bits": [], "next": 0, "count": 0}},
      "mesh": {"pp": 2, "dp": 1, "tp": 1, "zero": 0, "virtual_stages": 1, "micro_batches": 2,
               "grad_accum": 1, "micro_batch": 2},
      "recipe": "", "overrides": [])";
  CHECK(parse_checkpoint_state("{" + common + "}\n").recipe_changes.empty());
  CHECK(parse_checkpoint_state(
            "{" + common +
            R"(, "recipe_changes": [{"step": 4, "key": "seed", "from": "9", "to": "3"}]})")
            .recipe_changes == std::vector<recipe_change>{{4, "seed", "9", "3"}});
  fs::remove_all(dir);
}

TEST_CASE("a resumed run's metrics keep the later lines aside and record allowed changes") {
  const auto dir = fresh_dir("metrics");
  const auto path = dir / "metrics.jsonl";
  {
    jsonl_writer w(path);
    for (int s = 1; s <= 5; ++s) w.write(at_step(s, 1.0 * s));
  }
  {
    jsonl_writer w(path, 3);
    REQUIRE(!w.set_aside().empty());
    CHECK(w.set_aside().parent_path() == dir);
    CHECK(w.set_aside().filename().string().starts_with("metrics.jsonl.set-aside-00000003-"));
    const auto aside = read_all(w.set_aside());
    CHECK(aside.find("\"step\":4") != std::string::npos);
    CHECK(aside.find("\"step\":5") != std::string::npos);
    CHECK(aside.find("\"step\":3") == std::string::npos);
    w.write(at_step(4, 0.5), {{3, "seed", "9", "3"}});
    w.write(at_step(5, 0.4));
  }
  const auto now = read_all(path);
  CHECK(now.find("\"step\":3") != std::string::npos);
  CHECK(now.find(R"("recipe_changes":[{"from":"9","key":"seed","step":3,"to":"3"}])") !=
        std::string::npos);
  CHECK(std::count(now.begin(), now.end(), '\n') == 5);
  {
    jsonl_writer w(path, 2);  // again: another side file, the first one kept
    CHECK(w.set_aside().filename().string().starts_with("metrics.jsonl.set-aside-00000002-"));
  }
  int files = 0;
  for (const auto& e : fs::directory_iterator(dir)) files += e.is_regular_file();
  CHECK(files == 3);
  {
    jsonl_writer w(path, 2);  // nothing after step 2: no side file
    CHECK(w.set_aside().empty());
  }
  fs::remove_all(dir);
}
