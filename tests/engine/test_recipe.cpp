// Recipes: defaults from docs/recipe.md, unknown keys and wrong types named, --set overrides
// (numbers, bare and quoted strings, nested keys, unknown and malformed), impossible shapes and
// bad enum values named, the learning-rate schedule against hand-computed values, and
// load_recipe's file checks (missing recipe, missing data, init of the wrong shape).
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <numbers>
#include <sstream>
#include <string>
#include <vector>

#include "engine/chunks/gpu_chunk.hpp"
#include "engine/model/gpt_weights.hpp"
#include "engine/parallel/support.hpp"
#include "engine/training/optimizer.hpp"
#include "engine/training/recipe.hpp"
#include "tests/engine/engine_test_util.hpp"

using namespace troupe::engine;
using namespace troupe::engine::test;
namespace kernels = troupe::kernels;
namespace fs = std::filesystem;

namespace {

recipe parse(const std::string& text, const std::vector<std::string>& overrides = {}) {
  return parse_recipe(text, "test.toml", overrides);
}

// The recipe_error message of parsing text with overrides.
std::string parse_error(const std::string& text, const std::vector<std::string>& overrides = {}) {
  return error_message<recipe_error>([&] { parse(text, overrides); });
}

void check_one_line(const std::string& msg) { CHECK(msg.find('\n') == std::string::npos); }

}  // namespace

TEST_CASE("a minimal recipe gets the documented defaults", "[recipe]") {
  const std::string text = GENERATE(std::string(""), std::string("# nothing but a comment\n"),
                                    std::string("seed = 1337\n[model]\n"));
  const recipe r = parse(text);
  CHECK(r.seed == 1337);
  CHECK(r.steps == 200);
  CHECK(r.eval_interval == 50);
  CHECK(r.eval_batches == 8);
  CHECK(r.init.empty());
  CHECK(r.model.vocab_size == 256);
  CHECK(r.model.padded_vocab_size == 256);
  CHECK(r.model.context == 128);
  CHECK(r.model.layers == 4);
  CHECK(r.model.heads == 4);
  CHECK(r.model.width == 256);
  CHECK(r.data.format == "text");
  CHECK(r.data.train == "/usr/share/games/fortunes");
  CHECK(r.data.val.empty());
  CHECK(r.data.val_fraction == 0.05);
  CHECK(r.data.order == "random");
  CHECK(r.batch.micro_batch == 8);
  CHECK(r.batch.seq_len == 128);
  CHECK(r.batch.grad_accum == 1);
  CHECK(r.optimizer.lr == 1e-3f);
  CHECK(r.optimizer.min_lr == 1e-4f);
  CHECK(r.optimizer.warmup_steps == 20);
  CHECK(r.optimizer.decay == "cosine");
  CHECK(r.optimizer.beta1 == 0.9f);
  CHECK(r.optimizer.beta2 == 0.95f);
  CHECK(r.optimizer.eps == 1e-8f);
  CHECK(r.optimizer.weight_decay == 0.1f);
  CHECK(r.optimizer.grad_clip == 1.0f);
  CHECK(r.output.dir == "runs/default");
  CHECK(r.output.metrics == "metrics.jsonl");
  CHECK(r.output.weights == "final.safetensors");
  CHECK(r.metrics_path() == fs::path("runs/default/metrics.jsonl"));
  CHECK(r.weights_path() == fs::path("runs/default/final.safetensors"));
}

TEST_CASE("recipe values are read; padded_vocab_size follows vocab_size", "[recipe]") {
  const recipe r = parse(R"(
seed = 123456789012
steps = 7
eval_interval = 0
init = "w.safetensors"
[model]
vocab_size = 300
context = 64
layers = 2
heads = 2
width = 32
[data]
format = "shards"
train = "a.bin"
val = "b.bin"
val_fraction = 0.25
order = "sequential"
[batch]
micro_batch = 3
seq_len = 64
grad_accum = 4
[optimizer]
lr = 1
min_lr = 0.5
warmup_steps = 0
decay = "linear"
grad_clip = 0
[output]
dir = "out"
weights = ""
)");
  CHECK(r.seed == 123456789012);
  CHECK(r.steps == 7);
  CHECK(r.eval_interval == 0);
  CHECK(r.init == "w.safetensors");
  CHECK(r.model.vocab_size == 300);
  CHECK(r.model.padded_vocab_size == 300);
  CHECK(r.model.width == 32);
  CHECK(r.data.format == "shards");
  CHECK(r.data.val == "b.bin");
  CHECK(r.data.val_fraction == 0.25);
  CHECK(r.data.order == "sequential");
  CHECK(r.batch.grad_accum == 4);
  CHECK(r.optimizer.lr == 1.0f);  // an integer is accepted for a float key
  CHECK(r.optimizer.decay == "linear");
  CHECK(r.optimizer.grad_clip == 0.0f);
  CHECK(r.weights_path().empty());
  CHECK(r.metrics_path() == fs::path("out/metrics.jsonl"));

  const recipe p = parse("[model]\nvocab_size = 300\npadded_vocab_size = 320\n");
  CHECK(p.model.padded_vocab_size == 320);
}

TEST_CASE("unknown keys are named", "[recipe]") {
  auto msg = parse_error("colour = \"blue\"\n");
  CHECK_THAT(msg, Catch::Contains("colour") && Catch::Contains("test.toml"));
  check_one_line(msg);
  CHECK_THAT(parse_error("[model]\ndepth = 3\n"), Catch::Contains("model.depth"));
  CHECK_THAT(parse_error("[optimiser]\nlr = 0.1\n"), Catch::Contains("optimiser.lr"));
  // A table where a value belongs, and a value where a table belongs.
  CHECK_THAT(parse_error("[steps]\nn = 3\n"), Catch::Contains("steps.n"));
  CHECK_THAT(parse_error("model = 3\n"), Catch::Contains("model"));
}

TEST_CASE("values of the wrong type are named", "[recipe]") {
  auto msg = parse_error("steps = \"ten\"\n");
  CHECK_THAT(msg, Catch::Contains("steps") && Catch::Contains("integer"));
  check_one_line(msg);
  CHECK_THAT(parse_error("[data]\nformat = 3\n"), Catch::Contains("data.format"));
  CHECK_THAT(parse_error("[data]\ntrain = 3\n"), Catch::Contains("data.train"));
  CHECK_THAT(parse_error("steps = 1.5\n"), Catch::Contains("steps"));
  CHECK_THAT(parse_error("[optimizer]\nlr = \"fast\"\n"), Catch::Contains("optimizer.lr"));
  CHECK_THAT(parse_error("[batch]\nmicro_batch = true\n"), Catch::Contains("batch.micro_batch"));
  CHECK_THAT(parse_error("[model]\nwidth = [256]\n"), Catch::Contains("model.width"));
  CHECK_THAT(parse_error("init = 0\n"), Catch::Contains("init"));
  CHECK_THAT(parse_error("steps = 3000000000\n"), Catch::Contains("steps"));
}

TEST_CASE("TOML syntax errors name the source and line", "[recipe]") {
  const auto msg = parse_error("steps = 3\nseed = = 4\n");
  CHECK_THAT(msg, Catch::StartsWith("test.toml:2"));
}

TEST_CASE("--set overrides keys", "[recipe][set]") {
  const std::string base = "steps = 5\n[optimizer]\nlr = 0.01\n";
  CHECK(parse(base, {"steps=9"}).steps == 9);
  CHECK(parse(base, {"optimizer.lr=3e-4"}).optimizer.lr == 3e-4f);
  CHECK(parse(base, {"optimizer.lr=1"}).optimizer.lr == 1.0f);
  CHECK(parse(base, {"data.order=sequential"}).data.order == "sequential");
  CHECK(parse(base, {"data.order=\"sequential\""}).data.order == "sequential");
  CHECK(parse(base, {"data.train=/tmp/some dir/corpus.txt"}).data.train ==
        "/tmp/some dir/corpus.txt");
  CHECK(parse(base, {"output.dir=123"}).output.dir == "123");
  CHECK(parse(base, {"output.dir=true"}).output.dir == "true");
  CHECK(parse(base, {"output.weights="}).output.weights.empty());
  CHECK(parse(base, {"init=w.safetensors"}).init == "w.safetensors");
  CHECK(parse(base, {"seed=-5"}).seed == -5);
  const recipe nested = parse(base, {"model.width=32", "model.heads=2", "model.context=16",
                                     "batch.seq_len=16", "steps=3", "steps=4"});
  CHECK(nested.model.width == 32);
  CHECK(nested.model.heads == 2);
  CHECK(nested.batch.seq_len == 16);
  CHECK(nested.steps == 4);  // the last override wins
  // padded_vocab_size still follows an overridden vocab_size.
  CHECK(parse(base, {"model.vocab_size=512"}).model.padded_vocab_size == 512);
}

TEST_CASE("--set errors name the key", "[recipe][set]") {
  auto msg = parse_error("", {"optimizer.momentum=0.9"});
  CHECK_THAT(msg, Catch::Contains("optimizer.momentum"));
  check_one_line(msg);
  CHECK_THAT(parse_error("", {"steps"}), Catch::Contains("steps") && Catch::Contains("="));
  CHECK_THAT(parse_error("", {"=5"}), Catch::Contains("=5"));
  CHECK_THAT(parse_error("", {"steps=abc"}), Catch::Contains("steps"));
  CHECK_THAT(parse_error("", {"steps=2.5"}), Catch::Contains("steps"));
  CHECK_THAT(parse_error("", {"optimizer.lr=fast"}), Catch::Contains("optimizer.lr"));
  CHECK_THAT(parse_error("", {"model.heads=3"}), Catch::Contains("model.heads"));
  CHECK_THAT(parse_error("", {"data.order=shuffled"}), Catch::Contains("data.order"));
}

TEST_CASE("impossible shapes are named", "[recipe]") {
  auto msg = parse_error("[model]\ncontext = 64\n[batch]\nseq_len = 65\n");
  CHECK_THAT(msg,
             Catch::Contains("batch.seq_len") && Catch::Contains("65") && Catch::Contains("64"));
  check_one_line(msg);
  CHECK_THAT(parse_error("[model]\nwidth = 100\nheads = 3\n"), Catch::Contains("model.heads"));
  CHECK_THAT(parse_error("[model]\nvocab_size = 300\npadded_vocab_size = 299\n"),
             Catch::Contains("model.padded_vocab_size"));
  CHECK_THAT(parse_error("[model]\nlayers = 0\n"), Catch::Contains("model.layers"));
  CHECK_THAT(parse_error("[model]\nwidth = -8\n"), Catch::Contains("model.width"));
  CHECK_THAT(parse_error("[model]\nvocab_size = 100\n"), Catch::Contains("model.vocab_size"));
  CHECK_THAT(parse_error("[batch]\nmicro_batch = 0\n"), Catch::Contains("batch.micro_batch"));
  CHECK_THAT(parse_error("[batch]\ngrad_accum = 0\n"), Catch::Contains("batch.grad_accum"));
  CHECK_THAT(parse_error("steps = 0\n"), Catch::Contains("steps"));
  CHECK_THAT(parse_error("eval_interval = -1\n"), Catch::Contains("eval_interval"));
  CHECK_THAT(parse_error("eval_batches = 0\n"), Catch::Contains("eval_batches"));
  CHECK_THAT(parse_error("[data]\nval_fraction = 1.0\n"), Catch::Contains("data.val_fraction"));
  CHECK_THAT(parse_error("[data]\ntrain = \"\"\n"), Catch::Contains("data.train"));
  CHECK_THAT(parse_error("[optimizer]\nmin_lr = 0.01\nlr = 0.001\n"),
             Catch::Contains("optimizer.min_lr"));
  CHECK_THAT(parse_error("[optimizer]\nbeta2 = 1.0\n"), Catch::Contains("optimizer.beta2"));
  CHECK_THAT(parse_error("[optimizer]\neps = 0\n"), Catch::Contains("optimizer.eps"));
  CHECK_THAT(parse_error("[optimizer]\nwarmup_steps = -1\n"),
             Catch::Contains("optimizer.warmup_steps"));
  CHECK_THAT(parse_error("[output]\ndir = \"\"\n"), Catch::Contains("output.dir"));
  CHECK_THAT(parse_error("[output]\nmetrics = \"\"\n"), Catch::Contains("output.metrics"));
}

TEST_CASE("an explicit padded_vocab_size of 0 is refused", "[recipe]") {
  // docs/recipe.md: padded_vocab_size >= vocab_size; a recipe that states 0 is impossible and
  // must fail naming the key (0 is not a documented "same as vocab_size" marker).
  CHECK_THAT(parse_error("[model]\npadded_vocab_size = 0\n"),
             Catch::Contains("model.padded_vocab_size"));
  CHECK_THAT(parse_error("", {"model.padded_vocab_size=0"}),
             Catch::Contains("model.padded_vocab_size"));
}

TEST_CASE("bad enum values are named", "[recipe]") {
  auto msg = parse_error("[data]\norder = \"shuffled\"\n");
  CHECK_THAT(msg, Catch::Contains("data.order") && Catch::Contains("shuffled"));
  check_one_line(msg);
  CHECK_THAT(parse_error("[optimizer]\ndecay = \"step\"\n"),
             Catch::Contains("optimizer.decay") && Catch::Contains("step"));
  CHECK_THAT(parse_error("[data]\nformat = \"csv\"\n"),
             Catch::Contains("data.format") && Catch::Contains("csv"));
  CHECK_THAT(parse_error("[data]\nformat = \"Text\"\n"), Catch::Contains("data.format"));
  CHECK_THAT(parse_error("[precision]\ndtype = \"fp8\"\n"),
             Catch::Contains("precision.dtype") && Catch::Contains("fp8"));
  CHECK_THAT(parse_error("[precision]\nloss_scale = \"static\"\n"),
             Catch::Contains("precision.loss_scale") && Catch::Contains("static"));
}

TEST_CASE("precision and guard keys are range-checked by name", "[recipe]") {
  const auto msg = parse_error("[precision]\ndtype = \"bf16\"\n");
  CHECK_THAT(msg, Catch::Contains("precision.dtype") && Catch::Contains("device = \"cuda\""));
  check_one_line(msg);
  CHECK_THAT(parse_error("[precision]\ninit_scale = 0\n"), Catch::Contains("precision.init_scale"));
  CHECK_THAT(parse_error("[precision]\ngrowth_interval = 0\n"),
             Catch::Contains("precision.growth_interval"));
  CHECK_THAT(parse_error("[precision]\ngrowth_factor = 1.0\n"),
             Catch::Contains("precision.growth_factor"));
  CHECK_THAT(parse_error("[precision]\nbackoff_factor = 1.0\n"),
             Catch::Contains("precision.backoff_factor"));
  CHECK_THAT(parse_error("[guard]\nloss_zscore = -1\n"), Catch::Contains("guard.loss_zscore"));
  CHECK_THAT(parse_error("[guard]\ngrad_norm_zscore = -1\n"),
             Catch::Contains("guard.grad_norm_zscore"));
  CHECK_THAT(parse_error("[guard]\nwindow = 1\n"), Catch::Contains("guard.window"));
  CHECK_THAT(parse_error("[guard]\nmax_skips = -1\n"), Catch::Contains("guard.max_skips"));
}

TEST_CASE("device picks the CPU or one GPU, and the 16-bit dtypes need the GPU", "[recipe]") {
  CHECK(parse("").device == "cpu");
  CHECK(parse("device = \"cuda\"\n").device == "cuda");
  CHECK(parse("", {"device=cuda"}).device == "cuda");
  const auto bad = parse_error("device = \"tpu\"\n");
  CHECK_THAT(bad, Catch::Contains("key device") && Catch::Contains("tpu"));
  check_one_line(bad);
  // bf16 and fp16 run on the GPU; fp16 only with dynamic loss scaling.
  CHECK(parse("device = \"cuda\"\n[precision]\ndtype = \"bf16\"\n").precision.dtype == "bf16");
  CHECK_THAT(parse_error("device = \"cpu\"\n[precision]\ndtype = \"fp16\"\n"),
             Catch::Contains("precision.dtype"));
  const auto fp16 = parse_error("device = \"cuda\"\n[precision]\ndtype = \"fp16\"\n");
  CHECK_THAT(fp16, Catch::Contains("precision.loss_scale") && Catch::Contains("dynamic"));
  CHECK(parse("device = \"cuda\"\n[precision]\ndtype = \"fp16\"\nloss_scale = \"dynamic\"\n")
            .precision.dtype == "fp16");
  // The fused GPU attention kernel's head sizes: 16, 32, 64, 128; the materialized one takes any.
  const auto heads = parse_error(
      "device = \"cuda\"\n[model]\nwidth = 96\nheads = 2\n[kernels]\nattention = \"fused\"\n");
  CHECK_THAT(heads, Catch::Contains("model.heads") && Catch::Contains("head size 48") &&
                        Catch::Contains("materialized"));
  CHECK(parse("[model]\nwidth = 96\nheads = 2\n").model.heads == 2);  // fine on the CPU
  CHECK(parse("device = \"cuda\"\n[model]\nwidth = 128\nheads = 2\n").model.heads == 2);
  CHECK(parse("device = \"cuda\"\n[model]\nwidth = 96\nheads = 2\n[kernels]\n"
              "attention = \"materialized\"\n")
            .model.heads == 2);
  // cuDNN's: multiples of 8 up to 128, in bf16 or fp16 only.
  const auto cudnn_heads = parse_error(
      "device = \"cuda\"\n[model]\nwidth = 120\nheads = 6\n[precision]\ndtype = \"bf16\"\n"
      "[kernels]\nattention = \"cudnn\"\n");
  CHECK_THAT(cudnn_heads, Catch::Contains("model.heads") && Catch::Contains("head size 20"));
  const auto cudnn32 = parse_error("device = \"cuda\"\n[kernels]\nattention = \"cudnn\"\n");
  CHECK_THAT(cudnn32, Catch::Contains("key kernels.attention") && Catch::Contains("bf16 or fp16"));
  check_one_line(cudnn32);
}

TEST_CASE("kernels.attention and kernels.fast_paths pick the GPU kernels", "[recipe]") {
  CHECK(parse("").kernels.attention == "auto");
  // auto: cuDNN's in 16 bits, the fused kernel in fp32, the materialized route for head sizes
  // neither takes.
  CHECK(attention_kernel_for(parse("device = \"cuda\"\n")) == "fused");
  // (cuDNN's where it can be loaded: a build without CUDA falls back to the materialized route)
  const std::string sixteen = cudnn_attention_usable() ? "cudnn" : "materialized";
  CHECK(attention_kernel_for(parse("device = \"cuda\"\n[precision]\ndtype = \"bf16\"\n")) ==
        sixteen);
  CHECK(attention_kernel_for(parse("device = \"cuda\"\n[model]\nwidth = 96\nheads = 2\n")) ==
        "materialized");
  CHECK(attention_kernel_for(parse("device = \"cuda\"\n[model]\nwidth = 120\nheads = 6\n"
                                   "[precision]\ndtype = \"bf16\"\n")) == "materialized");
  CHECK(gpu_options(parse("device = \"cuda\"\n[precision]\ndtype = \"bf16\"\n")).attention ==
        parse_attention_kernel(sixteen));
  CHECK(parse("", {"kernels.attention=materialized"}).kernels.attention == "materialized");
  CHECK(gpu_options(parse("device = \"cuda\"\n[kernels]\nattention = \"materialized\"\n"))
            .attention == attention_kernel::materialized);
  CHECK(gpu_options(parse("device = \"cuda\"\n")).attention == attention_kernel::fused);
  CHECK(parse("").kernels.fast_paths);
  CHECK_FALSE(parse("[kernels]\nfast_paths = false\n").kernels.fast_paths);
  CHECK_FALSE(parse("", {"kernels.fast_paths=false"}).kernels.fast_paths);
  CHECK(gpu_options(parse("device = \"cuda\"\n")).fast_kernels);
  const auto not_bool = parse_error("[kernels]\nfast_paths = 1\n");
  CHECK_THAT(not_bool, Catch::Contains("kernels.fast_paths") && Catch::Contains("true or false"));
  const auto bad = parse_error("[kernels]\nattention = \"flash3\"\n");
  CHECK_THAT(bad, Catch::Contains("key kernels.attention") && Catch::Contains("flash3"));
  check_one_line(bad);
}

TEST_CASE("learning-rate schedule matches docs/recipe.md", "[recipe][lr]") {
  optimizer_config c;
  c.lr = 1.0f;
  c.min_lr = 0.1f;
  c.warmup_steps = 4;
  const int steps = 14;  // 10 decay steps after warmup
  const double lr = 1.0, min_lr = double(0.1f);

  SECTION("warmup") {
    for (const char* decay : {"cosine", "linear", "constant"}) {
      c.decay = decay;
      CHECK(learning_rate(c, 0, steps) == Approx(0.25));
      CHECK(learning_rate(c, 1, steps) == Approx(0.5));
      CHECK(learning_rate(c, 3, steps) == Approx(1.0));
    }
  }
  SECTION("cosine") {
    c.decay = "cosine";
    CHECK(learning_rate(c, 4, steps) == Approx(1.0));
    // ratio 0.5: halfway between lr and min_lr.
    CHECK(learning_rate(c, 9, steps) == Approx(min_lr + 0.5 * (lr - min_lr)));
    // ratio 0.2: min + 0.5 (1 + cos(0.2 pi)) (lr - min).
    CHECK(learning_rate(c, 6, steps) ==
          Approx(min_lr + 0.5 * (1 + std::cos(0.2 * std::numbers::pi)) * (lr - min_lr)));
    CHECK(learning_rate(c, 6, steps) == Approx(0.9140576).epsilon(1e-6));
    CHECK(learning_rate(c, 13, steps) == Approx(0.1220246).epsilon(1e-6));
    CHECK(learning_rate(c, 14, steps) == Approx(min_lr));
  }
  SECTION("linear") {
    c.decay = "linear";
    CHECK(learning_rate(c, 4, steps) == Approx(1.0));
    CHECK(learning_rate(c, 9, steps) == Approx(0.55));
    CHECK(learning_rate(c, 6, steps) == Approx(0.82));
    CHECK(learning_rate(c, 13, steps) == Approx(0.19));
  }
  SECTION("constant") {
    c.decay = "constant";
    for (int s : {4, 5, 9, 13}) CHECK(learning_rate(c, s, steps) == Approx(1.0));
  }
  SECTION("no warmup") {
    c.warmup_steps = 0;
    c.decay = "linear";
    CHECK(learning_rate(c, 0, 10) == Approx(1.0));
    CHECK(learning_rate(c, 5, 10) == Approx(0.55));
  }
  SECTION("warmup as long as the run") {
    c.warmup_steps = 10;
    c.decay = "cosine";
    CHECK(learning_rate(c, 9, 10) == Approx(1.0));
    CHECK(std::isfinite(learning_rate(c, 10, 10)));
  }
  SECTION("the recipe defaults") {
    const optimizer_config d;  // lr 1e-3, min 1e-4, warmup 20, cosine
    CHECK(learning_rate(d, 0, 200) == Approx(5e-5));
    CHECK(learning_rate(d, 19, 200) == Approx(1e-3));
    CHECK(learning_rate(d, 110, 200) == Approx(1e-4 + 0.5 * 0.9e-3).epsilon(1e-5));
  }
}

TEST_CASE("load_recipe checks files and names them", "[recipe][files]") {
  temp_dir dir;
  write_file(dir / "corpus.txt", std::string(2000, 'a'));
  const std::string corpus = (dir / "corpus.txt").string();
  auto recipe_text = [&](const std::string& top, const std::string& train) {
    return top +
           "\n[model]\ncontext = 16\nlayers = 1\nheads = 2\nwidth = 16\n"
           "[batch]\nmicro_batch = 2\nseq_len = 16\n[data]\ntrain = \"" +
           train + "\"\n[output]\ndir = \"" + (dir / "out").string() + "\"\n";
  };
  auto load_error = [&](const std::string& text, const std::vector<std::string>& overrides = {}) {
    write_file(dir / "r.toml", text);
    return error_message<recipe_error>([&] { load_recipe(dir / "r.toml", overrides); });
  };

  SECTION("a valid recipe loads") {
    write_file(dir / "r.toml", recipe_text("steps = 3", corpus));
    const recipe r = load_recipe(dir / "r.toml", {"steps=4"});
    CHECK(r.steps == 4);
    CHECK(r.data.train == corpus);
    CHECK_FALSE(fs::exists(dir / "out"));  // loading writes nothing
  }
  SECTION("a missing recipe file is named") {
    const auto p = dir / "no-such-recipe.toml";
    const auto msg = error_message<recipe_error>([&] { load_recipe(p, {}); });
    CHECK_THAT(msg, Catch::Contains(p.string()));
    check_one_line(msg);
  }
  SECTION("a directory is not a recipe") {
    // Reading a directory yields no text; it must not silently become the default recipe.
    CHECK_THAT(error_message<recipe_error>([&] { load_recipe(dir.path(), {}); }),
               Catch::Contains(dir.path().string()));
  }
  SECTION("a missing data.train names the key and the file") {
    const std::string missing = (dir / "nope.txt").string();
    const auto msg = load_error(recipe_text("", missing));
    CHECK_THAT(msg, Catch::Contains("data.train") && Catch::Contains(missing));
    check_one_line(msg);
    // The same through --set.
    CHECK_THAT(load_error(recipe_text("", corpus), {"data.train=" + missing}),
               Catch::Contains("data.train") && Catch::Contains(missing));
  }
  SECTION("a missing data.val names the key and the file") {
    const std::string missing = (dir / "val.txt").string();
    CHECK_THAT(load_error(recipe_text("", corpus), {"data.val=" + missing}),
               Catch::Contains("data.val") && Catch::Contains(missing));
  }
  SECTION("a missing init names the key and the file") {
    const std::string missing = (dir / "w.safetensors").string();
    CHECK_THAT(load_error(recipe_text("init = \"" + missing + "\"", corpus)),
               Catch::Contains("init") && Catch::Contains(missing));
  }
  SECTION("init of the wrong shape names init and the tensor") {
    gpt_config other;  // the recipe's model, but context 32 instead of 16
    other.vocab_size = other.padded_vocab_size = 256;
    other.context = 32;
    other.layers = 1;
    other.heads = 2;
    other.width = 16;
    gpt_chunk s(other, chunk_range::whole(other));
    s.init_gpt2(1);
    const std::string w = (dir / "w.safetensors").string();
    save_hf_weights(s, w);
    const auto msg = load_error(recipe_text("init = \"" + w + "\"", corpus));
    CHECK_THAT(msg, Catch::StartsWith("key init") && Catch::Contains("transformer.wpe.weight") &&
                        Catch::Contains("[32, 16]") && Catch::Contains("[16, 16]"));
    check_one_line(msg);
    // The matching model loads.
    write_file(dir / "r.toml", recipe_text("init = \"" + w + "\"", corpus));
    CHECK_NOTHROW(load_recipe(dir / "r.toml", {"model.context=32"}));
  }
  SECTION("an output.dir that is a file is refused") {
    write_file(dir / "out", "x");
    CHECK_THAT(load_error(recipe_text("", corpus)), Catch::Contains("output.dir"));
  }
}

TEST_CASE("activation_checkpoint.mode is checked by name", "[recipe]") {
  const auto msg = parse_error("[activation_checkpoint]\nmode = \"selective\"\n");
  CHECK_THAT(msg, Catch::Contains("activation_checkpoint.mode") && Catch::Contains("selective"));
  check_one_line(msg);
  // With ZeRO-3, also under a split backward (W gathers the blocks it recomputes).
  CHECK(parse("[activation_checkpoint]\nmode = \"full\"\n[parallel]\npp = 2\ndp = 2\n"
              "zero = 3\nschedule = \"zb_h1\"\nmicro_batches = 2\n",
              {})
            .activation_checkpoint.full());
  CHECK(parse("[activation_checkpoint]\nmode = \"full\"\n[parallel]\npp = 2\ndp = 2\nzero = 3\n"
              "micro_batches = 2\n",
              {})
            .activation_checkpoint.full());
}

TEST_CASE("the support rules refuse a job naming the key, and the table lists each rule",
          "[recipe][support]") {
  recipe r = parse("device = \"cuda\"\n[parallel]\ndp = 2\nzero = 3\n");  // fine as a recipe
  job_shape job;
  job.r = &r;
  CHECK_NOTHROW(check_support(job));
  job.device_chunks = true;  // the stages' chunks are CUDA chunks: every ZeRO stage runs there
  for (int stage : {1, 2, 3}) {
    r.parallel.zero = stage;
    CHECK_NOTHROW(check_support(job));
  }
  r.parallel.tp = 2;  // ZeRO over tensor shards, on either kind of chunk
  CHECK_NOTHROW(check_support(job));
  job.device_chunks = false;
  CHECK_NOTHROW(check_support(job));
  job.device_chunks = true;
  r.parallel.tp = 1;
  r.parallel.zero = 0;
  job.processes = 4;  // several processes run, device chunks' payloads staged through the host
  CHECK_NOTHROW(check_support(job));
  job.device_chunks = false;
  CHECK_NOTHROW(check_support(job));
  r.parallel.tp = 2;  // tensor shards across them on CPU chunks ...
  CHECK_NOTHROW(check_support(job));
  job.device_chunks = true;  // ... and on device chunks (a group across processes: host-staged)
  CHECK_NOTHROW(check_support(job));
  // ZeRO through the devices' groups needs device chunks (host test chunks are some).
  r.parallel.tp = 1;
  r.parallel.zero = 1;
  r.parallel.zero_on_device = true;
  CHECK_NOTHROW(check_support(job));
  r.device = "cpu";
  CHECK_NOTHROW(check_support(job));
  job.device_chunks = false;
  CHECK_THROWS_WITH(check_support(job), Catch::StartsWith("key parallel.zero_on_device: "));
  job.chunks_known = false;  // a recipe checked alone: host test chunks may serve it
  CHECK_NOTHROW(check_support(job));
  job.chunks_known = true;
  r.parallel.zero = 0;  // nothing to do without ZeRO
  CHECK_NOTHROW(check_support(job));
  // What is refused on CUDA is only what the kernels cannot do: head sizes, fp32 cuDNN.
  for (const auto& rule : support_rules()) CHECK((rule.cpu == "yes" || rule.cuda == "yes"));
  const std::string table = format_support_table();
  CHECK(std::count(table.begin(), table.end(), '\n') ==
        static_cast<std::ptrdiff_t>(support_rules().size() + 2));
  for (const auto& rule : support_rules()) CHECK_THAT(table, Catch::Contains(rule.feature));
}

// docs/recipe.md's table (`troupe train --help-keys`) comes from the schema: every row a key the
// parser takes, with its meaning; each default a value the key takes (or says how it is derived),
// and it round-trips: setting a key to its listed default changes nothing.
TEST_CASE("the recipe keys table lists every key with its type, default and meaning", "[recipe]") {
  const std::string table = format_recipe_keys();
  std::istringstream in(table);
  std::string line;
  REQUIRE(std::getline(in, line));
  CHECK(line == "| key | type | default | meaning |");
  REQUIRE(std::getline(in, line));
  int rows = 0;
  CHECK(format_recipe_keys(parse("")) == table);
  while (std::getline(in, line)) {
    INFO(line);
    std::vector<std::string> cells;
    for (std::size_t at = 2; at < line.size();) {
      const auto end = line.find(" | ", at);
      cells.push_back(line.substr(at, end == std::string::npos ? line.size() - 2 - at : end - at));
      if (end == std::string::npos) break;
      at = end + 3;
    }
    REQUIRE(cells.size() >= 4);
    REQUIRE(cells[0].size() > 2);
    const std::string key = cells[0].substr(1, cells[0].size() - 2);
    CHECK(!cells[3].empty());
    const std::string& value = cells[2];
    if (value.rfind("= ", 0) == 0 || value == "fortunes dir") continue;  // derived
    CHECK(format_recipe_keys(parse("", {key + "=" + value})) == table);
    ++rows;
  }
  CHECK(rows >= 55);
  CHECK_THAT(parse_error("", {"optimizer.lrr=1"}), Catch::Contains("unknown key optimizer.lrr"));
}
