// `troupe bench train-step --device cuda`: GPT-2 small (12 layers, width 768, 12 heads, vocab
// 50257, T = 1024) trained on one GPU by engine::gpu_trainer, next to PyTorch on the same
// machine in the same run (eager and torch.compile: fp32 master weights, bf16 autocast, SDPA
// attention, fused AdamW), for each batch size and each GPU attention kernel asked for: tokens/s,
// MFU against the GPU's dense peak, device memory beside PyTorch's peak, and the ratios. With
// --breakdown, where Troupe's step goes: device time per op family from CUDA events.
// A benchmark: it prints, it asserts nothing.
#pragma once

#include <string>
#include <vector>

namespace troupe::bench {

struct gpu_train_step_options {
  std::vector<int> batches = {16};
  int seq_len = 1024;
  int layers = 12;
  int steps = 20;
  int warmup = 5;
  std::string dtype = "bf16";                      // bf16 | fp32
  std::vector<std::string> attention = {"cudnn"};  // engine::attention_kernel
  bool fast_paths = true;  // kernels.fast_paths: 128-bit layernorm, one AdamW launch
  bool breakdown = false;
  std::string python = "python3";  // with torch (the GPU machine's own)
  bool no_peer = false;
  bool json_output = false;
};

// Runs the benchmark and prints its table (or one JSON report). Returns the exit status: 0, or 1
// with a one-line reason on stderr when there is no usable GPU, the peer script cannot be found,
// or every Troupe run failed.
int run_gpu_train_step_bench(const gpu_train_step_options& options);

}  // namespace troupe::bench
