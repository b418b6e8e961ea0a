// `troupe sample WEIGHTS --prompt TEXT [--tokens N] [--temperature T] [--top-k K] [--seed S]
// [--recipe RECIPE.toml] [--tokenizer DIR] [--threads N] [--device cpu|cuda]`: text from a
// trained model, on the CPU or (--device cuda) on GPU 0 in fp32 with the fused attention
// kernel, the whole sequence's forward for each new token (docs/sample.md). WEIGHTS is a Hugging
// Face GPT-2 safetensors file, a checkpoint's step directory (its model.safetensors) or a
// checkpoint root (its newest step directory with a manifest.json). The model's shape comes from
// --recipe, else from the checkpoint's trainer_state.json, else from the tensor shapes (heads:
// GPT-2's head size 64, said on stderr). Tokens are bytes (engine/data/byte_tokenizer.hpp) for a
// byte-level model, or GPT-2's BPE from
// --tokenizer DIR (engine/model/bpe_tokenizer.hpp). stdout: the prompt, then the new text as it is
// sampled, then a newline; stderr: what was loaded and the speed. Exit 2 with one line naming
// the file or option on bad input (nothing sampled), 1 if sampling fails.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <memory>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <vector>

#include "engine/data/byte_tokenizer.hpp"
#include "engine/model/bpe_tokenizer.hpp"
#include "engine/model/gpt_weights.hpp"
#include "engine/model/safetensors.hpp"
#include "engine/model/sample.hpp"
#include "engine/training/checkpoint.hpp"
#include "engine/training/gpu_trainer.hpp"
#include "engine/training/recipe.hpp"
#include "kernels/cpu_threads.hpp"
#include "tools/commands.hpp"

namespace troupe::tools {
namespace {

namespace fs = std::filesystem;

// Bad input: the one line to print, exit 2.
class bad_input : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct options {
  std::string weights;
  std::string prompt;
  int tokens = 200;
  double temperature = 1.0;
  int top_k = 0;
  std::uint64_t seed = 1337;
  std::string recipe;
  std::string tokenizer;
  std::string device = "cpu";
  int threads = 0;  // 0: OpenMP's default
};

std::string read_text(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw bad_input(path.string() + ": cannot read");
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// The weights file WEIGHTS names, and the trainer_state.json beside it ("" if none).
struct model_files {
  fs::path weights;
  fs::path checkpoint;  // a step directory of part files (format 2): no weights file
  fs::path state;
  std::string note;  // said on stderr once the model is loaded
};

model_files find_model_files(const fs::path& where) {
  std::error_code ec;
  model_files f;
  if (fs::is_regular_file(where, ec)) {
    f.weights = where;
  } else if (fs::is_directory(where, ec)) {
    if (fs::is_regular_file(where / "model.safetensors", ec)) {
      f.weights = where / "model.safetensors";
    } else if (fs::is_regular_file(where / "manifest.json", ec)) {  // a step directory of parts
      f.checkpoint = where;
    } else {
      // A checkpoint root: the newest step directory that has a manifest (committed).
      long newest = -1;
      fs::path dir;
      for (const auto& entry : fs::directory_iterator(where, ec)) {
        const std::string name = entry.path().filename().string();
        if (!entry.is_directory(ec) || !name.starts_with("step-") || name.size() == 5 ||
            name.size() > 14 || name.find_first_not_of("0123456789", 5) != std::string::npos)
          continue;
        const long step = std::stol(name.substr(5));
        if (step > newest && fs::is_regular_file(entry.path() / "manifest.json", ec)) {
          newest = step;
          dir = entry.path();
        }
      }
      if (newest < 0)
        throw bad_input(where.string() +
                        ": no model.safetensors and no step-* directory with a manifest.json");
      f.weights = dir / "model.safetensors";
      if (!fs::is_regular_file(f.weights, ec)) {
        f.weights.clear();
        f.checkpoint = dir;
      }
      f.note = "checkpoint " + dir.string();
    }
  } else {
    throw bad_input(where.string() + ": no such file or directory");
  }
  const fs::path beside = f.weights.empty() ? f.checkpoint : f.weights.parent_path();
  if (const fs::path s = beside / "trainer_state.json"; fs::is_regular_file(s, ec)) f.state = s;
  return f;
}

// The model's shape and how its text was tokenized ("" when no recipe says).
struct model_shape {
  engine::gpt_config config;
  std::string data_format;
  std::string source;  // where the shape came from, for messages
  std::string note;    // said on stderr once the model is loaded
};

model_shape shape_from_recipe(const std::string& toml, const std::string& source,
                              const std::vector<std::string>& overrides) {
  try {
    const engine::recipe r = engine::parse_recipe(toml, source, overrides);
    return {r.model, r.data.format, source, {}};
  } catch (const engine::recipe_error& e) {
    throw bad_input(e.what());
  }
}

model_shape shape_from_state(const fs::path& state) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(read_text(state));
  } catch (const nlohmann::json::exception& e) {
    throw bad_input(state.string() + ": not JSON (" + e.what() + ")");
  }
  if (!j.is_object() || !j.contains("recipe") || !j["recipe"].is_string())
    throw bad_input(state.string() + ": no \"recipe\" string (pass --recipe)");
  std::vector<std::string> overrides;
  if (j.contains("overrides")) {
    const auto& o = j["overrides"];
    if (!o.is_array()) throw bad_input(state.string() + ": \"overrides\" is not a list");
    for (const auto& s : o) {
      if (!s.is_string()) throw bad_input(state.string() + ": \"overrides\" holds a non-string");
      overrides.push_back(s.get<std::string>());
    }
  }
  return shape_from_recipe(j["recipe"].get<std::string>(), state.string() + " (recipe)", overrides);
}

// Layers, width, vocabulary and context from the tensor shapes; heads from GPT-2's head size.
model_shape shape_from_tensors(const fs::path& weights) {
  const engine::safetensors_file file(weights);
  auto find = [&](const std::string& name) -> const engine::safetensors_entry& {
    if (file.contains("transformer." + name)) return file.at("transformer." + name);
    if (file.contains(name)) return file.at(name);
    throw bad_input(weights.string() + ": no tensor transformer." + name +
                    " (not a GPT-2 weights file?)");
  };
  const auto& wte = find("wte.weight");
  const auto& wpe = find("wpe.weight");
  if (wte.shape.size() != 2 || wpe.shape.size() != 2 || wte.shape[1] != wpe.shape[1])
    throw bad_input(weights.string() + ": transformer.wte.weight " +
                    kernels::shape_string(wte.shape) + " and transformer.wpe.weight " +
                    kernels::shape_string(wpe.shape) + " are not [vocab, width], [context, width]");
  int layers = 0;
  for (const auto& [name, entry] : file.entries()) {
    std::string_view n = name;
    if (n.starts_with("transformer.")) n.remove_prefix(12);
    if (!n.starts_with("h.")) continue;
    n.remove_prefix(2);
    const std::size_t dot = n.find('.');
    const std::string index(n.substr(0, dot));
    if (index.empty() || index.size() > 6 ||
        index.find_first_not_of("0123456789") != std::string::npos)
      continue;
    layers = std::max(layers, std::stoi(index) + 1);
  }
  model_shape s;
  s.source = weights.string() + " (tensor shapes)";
  s.config.vocab_size = s.config.padded_vocab_size = static_cast<int>(wte.shape[0]);
  s.config.context = static_cast<int>(wpe.shape[0]);
  s.config.width = static_cast<int>(wte.shape[1]);
  s.config.layers = layers;
  if (s.config.width % 64 != 0)
    throw bad_input(weights.string() + ": width " + std::to_string(s.config.width) +
                    " is not a multiple of GPT-2's head size 64, so the heads cannot be inferred: "
                    "pass --recipe");
  s.config.heads = s.config.width / 64;
  s.note = "no recipe: inferred from " + weights.string() + ": layers " + std::to_string(layers) +
           ", width " + std::to_string(s.config.width) + ", vocabulary " +
           std::to_string(s.config.vocab_size) + ", context " + std::to_string(s.config.context) +
           ", heads " + std::to_string(s.config.heads) +
           " (GPT-2's head size 64; --recipe sets them)";
  return s;
}

// Text to tokens and tokens to text, and the ids that may be sampled.
struct text_codec {
  std::function<std::vector<std::int32_t>(const std::string&)> encode;
  std::function<std::string(std::int32_t)> decode;
  int vocab_limit = 0;
};

text_codec make_codec(const options& o, const model_shape& shape) {
  const int vocab = shape.config.vocab_size;
  text_codec codec;
  if (!o.tokenizer.empty()) {
    std::shared_ptr<engine::bpe_tokenizer> bpe;
    try {
      bpe = std::make_shared<engine::bpe_tokenizer>(engine::bpe_tokenizer::load(o.tokenizer));
    } catch (const std::runtime_error& e) {
      throw bad_input(std::string("--tokenizer: ") + e.what());
    }
    if (bpe->vocab_size() > vocab)
      throw bad_input("--tokenizer: " + o.tokenizer + " has ids up to " +
                      std::to_string(bpe->vocab_size() - 1) + ", the model's vocabulary only " +
                      std::to_string(vocab) + " (" + shape.source + ")");
    codec.encode = [bpe](const std::string& s) { return bpe->encode(s); };
    codec.decode = [bpe](std::int32_t t) { return bpe->decode(t); };
    codec.vocab_limit = bpe->vocab_size();
    return codec;
  }
  if (vocab != engine::data::byte_tokenizer::vocab_size && shape.data_format != "text")
    throw bad_input("the model's vocabulary has " + std::to_string(vocab) +
                    " tokens, not the 256 bytes of the byte-level tokenizer: pass --tokenizer DIR "
                    "(its vocab.json and merges.txt)");
  codec.encode = [](const std::string& s) {
    const auto bytes = engine::data::byte_tokenizer{}.encode(s);
    return std::vector<std::int32_t>(bytes.begin(), bytes.end());
  };
  codec.decode = [](std::int32_t t) {
    return engine::data::byte_tokenizer{}.decode(std::span<const std::int32_t>(&t, 1));
  };
  codec.vocab_limit = engine::data::byte_tokenizer::vocab_size;
  return codec;
}

// What sampling needs, every check on the input passed. Throws bad_input (or, for an unreadable
// weights file, what the safetensors reader throws).
struct loaded_model {
  std::unique_ptr<engine::gpt_chunk> model;
  text_codec codec;
  std::vector<std::int32_t> prompt;
  std::string source;  // where the shape came from
};

loaded_model load_model(const options& o) {
  if (o.prompt.empty()) throw bad_input("--prompt: empty (the model needs a token to start)");
  const model_files files = find_model_files(o.weights);
  model_shape shape;
  if (!o.recipe.empty())
    shape = shape_from_recipe(read_text(o.recipe), o.recipe, {});
  else if (!files.state.empty())
    shape = shape_from_state(files.state);
  else if (!files.weights.empty())
    shape = shape_from_tensors(files.weights);
  else
    throw bad_input(files.checkpoint.string() + ": no trainer_state.json (pass --recipe)");
  try {
    shape.config.validate();
  } catch (const std::invalid_argument& e) {
    throw bad_input(shape.source + ": " + e.what());
  }
  loaded_model m;
  m.source = shape.source;
  m.codec = make_codec(o, shape);
  try {
    m.prompt = m.codec.encode(o.prompt);
  } catch (const std::runtime_error& e) {
    throw bad_input(std::string("--prompt: ") + e.what());
  }
  m.model =
      std::make_unique<engine::gpt_chunk>(shape.config, engine::chunk_range::whole(shape.config));
  try {
    if (files.weights.empty()) {  // the parts put together (engine::load_checkpoint_tensors)
      const auto values = engine::load_checkpoint_tensors(files.checkpoint, "model", shape.config,
                                                          engine::chunk_range::whole(shape.config));
      std::copy(values.begin(), values.end(), m.model->params());
    } else {
      engine::load_hf_weights(*m.model, files.weights);
    }
  } catch (const std::runtime_error& e) {
    throw bad_input(std::string(e.what()) + " (the model of " + shape.source + ")");
  }
  for (const std::string& note : {files.note, shape.note})
    if (!note.empty()) std::fprintf(stderr, "troupe sample: %s\n", note.c_str());
  return m;
}

int run_sample(const options& o) {
  if (o.device == "cuda") {  // no usable GPU is a failure to run, as for `troupe train`
    std::string why;
    if (!engine::cuda_training_available(&why)) {
      std::fprintf(stderr, "troupe sample: error: --device cuda: %s\n", why.c_str());
      return exit_failure;
    }
  }
  loaded_model m;
  try {
    m = load_model(o);
  } catch (const std::exception& e) {  // bad_input, or an unreadable or malformed weights file
    std::fprintf(stderr, "troupe sample: %s\n", e.what());
    return exit_bad_input;
  }
  if (o.threads > 0) kernels::set_compute_threads(o.threads);
  std::fwrite(o.prompt.data(), 1, o.prompt.size(), stdout);
  std::fflush(stdout);
  const auto start = std::chrono::steady_clock::now();
  try {
    const engine::sampling_options so{o.temperature, o.top_k, o.seed};
    const auto print = [&](std::int32_t t) {
      const std::string text = m.codec.decode(t);
      std::fwrite(text.data(), 1, text.size(), stdout);
      std::fflush(stdout);
    };
    const auto& c = m.model->config();
    if (o.device == "cuda") {  // fp32 and the fused kernel: the CPU's numbers within rounding
      engine::gpu_trainer gpu(*m.model, 1, c.context, engine::gpu_trainer_options{});
      const engine::logits_function on_gpu = [&](std::span<const std::int32_t> window) {
        return gpu.last_logits(window.data(), static_cast<int>(window.size()));
      };
      engine::generate(on_gpu, c.context, c.vocab_size, m.prompt, o.tokens, so, m.codec.vocab_limit,
                       print);
    } else {
      engine::generate(*m.model, m.prompt, o.tokens, so, m.codec.vocab_limit, print);
    }
  } catch (const std::exception& e) {
    std::fputc('\n', stdout);
    std::fprintf(stderr, "troupe sample: error: %s\n", e.what());
    return exit_failure;
  }
  std::fputc('\n', stdout);
  std::fflush(stdout);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const auto& c = m.model->config();
  std::fprintf(stderr,
               "troupe sample: %d tokens in %.2f s (%.1f tokens/s); layers %d, width %d, "
               "vocabulary %d, context %d (%s)\n",
               o.tokens, seconds, seconds > 0 ? o.tokens / seconds : 0.0, c.layers, c.width,
               c.vocab_size, c.context, m.source.c_str());
  return exit_ok;
}

}  // namespace

std::function<int()> add_sample_command(CLI::App& app) {
  auto opts = std::make_shared<options>();
  auto* cmd = app.add_subcommand("sample", "Generate text from trained weights (CPU or GPU)");
  cmd->add_option("weights", opts->weights,
                  "A GPT-2 safetensors file, a checkpoint step directory, or a checkpoint root "
                  "(its newest committed step)")
      ->required();
  cmd->add_option("--prompt", opts->prompt, "The text to continue")->required();
  cmd->add_option("--tokens", opts->tokens, "New tokens to generate")
      ->capture_default_str()
      ->check(CLI::Range(0, 1000000));
  cmd->add_option("--temperature", opts->temperature,
                  "Divides the logits before the softmax; 0 takes the most likely token")
      ->capture_default_str()
      ->check(CLI::Validator(
          [](std::string& text) -> std::string {
            double v = 0;
            if (!CLI::detail::lexical_cast(text, v) || !std::isfinite(v) || v < 0)
              return "must be a finite number >= 0, not " + text;
            return {};
          },
          "NUMBER >= 0"));
  cmd->add_option("--top-k", opts->top_k, "Draw only among the K most likely tokens (0: all)")
      ->capture_default_str()
      ->check(CLI::Range(0, 1000000));
  cmd->add_option("--seed", opts->seed, "The same seed, prompt and weights give the same text")
      ->capture_default_str();
  cmd->add_option("--recipe", opts->recipe,
                  "The recipe the model was trained with (its [model] shape; default: the "
                  "checkpoint's, else inferred from the tensors)");
  cmd->add_option("--tokenizer", opts->tokenizer,
                  "A directory with GPT-2 BPE vocab.json and merges.txt (for models whose "
                  "vocabulary is not the 256 bytes)");
  cmd->add_option("--device", opts->device,
                  "cpu, or cuda: GPU 0, fp32 (the logits within rounding of the CPU's)")
      ->capture_default_str()
      ->check(CLI::IsMember({"cpu", "cuda"}));
  cmd->add_option("--threads", opts->threads,
                  "BLAS/OpenMP threads (default: this machine's cores). The text can depend on "
                  "it: compare runs with the same count")
      ->check(CLI::Range(1, 1024));
  return [opts]() -> int { return run_sample(*opts); };
}

}  // namespace troupe::tools
