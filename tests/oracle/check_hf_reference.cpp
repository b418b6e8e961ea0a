// Compares Troupe's GPT-2 with Hugging Face on one batch: logits, loss and every parameter
// gradient, tensor by tensor. Reads DIR/model.safetensors (the HF model) and
// DIR/reference.safetensors (inputs, targets, logits, loss, grad.<name>) written by
// hf_reference.py. Error of a tensor = max|troupe - hf| / max|hf| (relative to the tensor's
// scale, so near-zero entries do not divide by ~0). Exit 0 when every error <= 1e-4.
#include <cmath>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "engine/model/gpt_weights.hpp"
#include "engine/model/safetensors.hpp"

using namespace troupe;

namespace {

struct comparison {
  std::string name;
  double error = 0;
  double max_abs_diff = 0;
};

comparison compare(const std::string& name, const float* got, const float* want, std::int64_t n) {
  double max_diff = 0, max_ref = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    max_diff = std::max(max_diff, std::fabs(double(got[i]) - want[i]));
    max_ref = std::max(max_ref, std::fabs(double(want[i])));
  }
  return {name, max_ref > 0 ? max_diff / max_ref : max_diff, max_diff};
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s DIR\n", argv[0]);
    return 2;
  }
  const std::string dir = argv[1];
  const double tolerance = 1e-4;
  try {
    const engine::safetensors_file ref(dir + "/reference.safetensors");
    const auto logits_ref = ref.read_f32("logits");
    const int B = static_cast<int>(logits_ref.dim(0)), T = static_cast<int>(logits_ref.dim(1));
    const int V = static_cast<int>(logits_ref.dim(2));
    const auto inputs = ref.read_i32("inputs");
    const auto targets = ref.read_i32("targets");
    const float loss_ref = ref.read_f32("loss").f32()[0];

    // The model's shape comes from the weights themselves.
    const engine::safetensors_file weights(dir + "/model.safetensors");
    engine::gpt_config config;
    config.vocab_size = V;
    config.padded_vocab_size = V + 6;  // exercise vocabulary padding: must not change anything
    const auto& wpe = weights.at(
        weights.contains("transformer.wpe.weight") ? "transformer.wpe.weight" : "wpe.weight");
    config.context = static_cast<int>(wpe.shape[0]);
    config.width = static_cast<int>(wpe.shape[1]);
    config.layers = 0;
    while (weights.contains("transformer.h." + std::to_string(config.layers) + ".ln_1.weight") ||
           weights.contains("h." + std::to_string(config.layers) + ".ln_1.weight")) {
      ++config.layers;
    }
    std::ifstream hf_config(dir + "/hf/config.json");
    if (!hf_config) throw std::runtime_error(dir + "/hf/config.json: cannot read");
    config.heads = nlohmann::json::parse(hf_config).at("n_head").get<int>();

    engine::gpt_chunk model(config, engine::chunk_range::whole(config));
    engine::load_hf_weights(model, dir + "/model.safetensors");
    engine::gpt_activations acts(model, B, T);
    engine::chunk_forward(model, acts, inputs.data(), nullptr);

    std::vector<comparison> results;
    // Logits: compare the first V of each padded row.
    const float* logits = engine::chunk_output(acts);
    std::vector<float> real(static_cast<std::size_t>(B) * T * V);
    for (std::int64_t r = 0; r < std::int64_t{B} * T; ++r) {
      for (int v = 0; v < V; ++v) real[r * V + v] = logits[r * config.padded_vocab_size + v];
    }
    results.push_back(compare("logits", real.data(), logits_ref.f32(), logits_ref.numel()));
    const auto loss = engine::chunk_loss_backward_start(model, acts, targets.data(), 1.0f);
    const float loss_got = static_cast<float>(loss.mean());
    results.push_back(compare("loss", &loss_got, &loss_ref, 1));
    engine::chunk_backward(model, acts, nullptr, nullptr);

    for (const auto& p : model.parameters()) {
      std::string key = "grad." + p.name;
      if (!ref.contains(key)) key = "grad." + p.name.substr(std::string("transformer.").size());
      const auto want = ref.read_f32(key);
      // Bring Troupe's gradient into HF layout.
      std::vector<float> got(static_cast<std::size_t>(want.numel()));
      const float* g = model.grads() + p.offset;
      if (p.conv1d) {
        kernels::transpose_2d(got.data(), g, p.shape[0], p.shape[1]);
      } else {
        std::copy(g, g + want.numel(), got.begin());
      }
      results.push_back(compare(key, got.data(), want.f32(), want.numel()));
    }

    const comparison* worst = &results.front();
    bool ok = true;
    for (const auto& c : results) {
      std::printf("%-50s max|diff| %.3e  error %.3e%s\n", c.name.c_str(), c.max_abs_diff, c.error,
                  c.error > tolerance ? "  FAIL" : "");
      ok = ok && c.error <= tolerance;
      if (c.error > worst->error) worst = &c;
    }
    std::printf("loss: troupe %.7f  hugging face %.7f\n", loss_got, loss_ref);
    std::printf("worst tensor: %s error %.3e (tolerance %.0e) -> %s\n", worst->name.c_str(),
                worst->error, tolerance, ok ? "PASS" : "FAIL");
    return ok ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "check_hf_reference: %s\n", e.what());
    return 1;
  }
}
