// Recipes: the TOML file that describes a training run (docs/recipe.md lists every key).
// Invariants: load_recipe either returns a fully checked recipe or throws recipe_error whose
// message is one line naming the key or file at fault; it never writes anything.
#pragma once

#include <cstdint>
#include <filesystem>
#include <stdexcept>
#include <string>
#include <vector>

#include "engine/model/gpt_model.hpp"
#include "engine/training/optimizer.hpp"
#include "engine/training/update_guard.hpp"

namespace troupe::engine {

class recipe_error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct data_config {
  std::string format = "text";  // text | shards
  std::string train = "/usr/share/games/fortunes";
  std::string val;  // "" = split val_fraction off the end of train
  double val_fraction = 0.05;
  std::string order = "random";  // random | sequential
};

struct batch_config {
  int micro_batch = 8;
  int seq_len = 128;
  int grad_accum = 1;
};

struct output_config {
  std::string dir = "runs/default";
  std::string metrics = "metrics.jsonl";
  std::string weights = "final.safetensors";
};

// Checkpoints (docs/checkpoints.md): every `every` steps (0: none) into `dir` (relative to
// output.dir unless absolute), the newest `keep` committed ones kept.
// A stage stuck in one action longer than this is reported and its process ends (0: never;
// docs/checkpoints.md, "Hangs").
struct watchdog_config {
  double action_timeout = 600;  // seconds
};

struct checkpoint_config {
  int every = 0;
  std::string dir = "checkpoints";
  int keep = 2;
  bool pinned_copy = true;  // CUDA: the state copied to pinned memory while the next step runs
  // "whole": whole-model Hugging Face files, written by one writer; "parts": a part file per
  // stage, each written by its stage (format 2); "auto": parts for a job of several processes.
  std::string format = "auto";
  // Whether a job of `processes` processes writes format 2.
  bool parts(int processes) const {
    return format == "parts" || (format == "auto" && processes > 1);
  }
};

// How the model is spread over actors (docs/pipeline.md, docs/zero.md, docs/tensor_parallel.md).
struct parallel_config {
  int pp = 1;                     // pipeline ranks (stage actors per replica)
  int dp = 1;                     // data-parallel replicas
  int tp = 1;                     // tensor shards per stage (Megatron-style tensor parallelism)
  std::string schedule = "1f1b";  // gpipe | 1f1b | interleaved_1f1b | zb_h1 | registered name
  int virtual_stages = 1;         // model chunks per pipeline rank (interleaved: >= 2)
  int micro_batches = 1;          // per pipeline pass and replica
  std::vector<int> layer_split;   // layers per virtual stage; empty: as even as possible
  int link_credits = 0;           // unacknowledged messages per link; 0: micro_batches
  int prefetch = 2;               // micro-batches the data loader keeps ready
  int bucket_layers = 1;          // transformer layers per data-parallel gradient bucket
  int zero = 0;                   // ZeRO stage over each rank's DP group: 0 (DDP), 1, 2
  int zero_prefetch = 1;          // ZeRO-3: layers gathered ahead of use
  bool nccl_links = true;         // device payloads and groups between processes by NCCL
  bool zero_on_device = false;    // ZeRO of device chunks through their DP groups
};

// Number formats and loss scaling (docs/recipe.md, [precision]).
struct precision_config {
  std::string dtype = "fp32";       // fp32 | bf16 | fp16 (bf16 and fp16: the CUDA backend)
  std::string loss_scale = "none";  // none | dynamic
  double init_scale = 65536;
  int growth_interval = 2000;
  double growth_factor = 2;
  double backoff_factor = 0.5;
  loss_scale_config scaling() const {
    return {loss_scale == "dynamic", init_scale, growth_factor, backoff_factor, growth_interval};
  }
};

// Activation checkpointing (docs/recipe.md, [activation_checkpoint]; torchtitan's names).
struct activation_checkpoint_config {
  std::string mode = "none";  // none | full (every transformer block recomputed in backward)
  bool full() const { return mode == "full"; }
};

// Which GPU kernels run the model (docs/recipe.md, [kernels]; device "cuda" only).
struct kernels_config {
  // auto | fused | materialized | cudnn (engine::attention_kernel): auto is cudnn in bf16 and
  // fp16, fused in fp32 (attention_kernel_for).
  std::string attention = "auto";
  // The newer kernels of the rest of the step: 128-bit layernorm forward and backward, one
  // AdamW launch over the flat buffers (kernels::cuda::context::set_fast_kernels).
  bool fast_paths = true;
};

struct recipe {
  std::int64_t seed = 1337;
  int steps = 200;
  int eval_interval = 50;
  int eval_batches = 8;
  std::string init;
  std::string device = "cpu";  // cpu | cuda (the whole model on one GPU: the serial loop)
  gpt_config model;
  data_config data;
  batch_config batch;
  optimizer_config optimizer;
  output_config output;
  parallel_config parallel;
  precision_config precision;
  guard_config guard;  // skipped updates: spikes and non-finite steps ([guard])
  activation_checkpoint_config activation_checkpoint;
  kernels_config kernels;
  checkpoint_config checkpoint;
  watchdog_config watchdog;
  // Where the recipe came from: its TOML text and the overrides applied to it (a checkpoint
  // keeps both, so the run it belongs to can be parsed again).
  std::string source_text;
  std::vector<std::string> overrides;

  // Micro-batches per optimizer step over all replicas: grad_accum * micro_batches * dp.
  int micro_batches_per_step() const {
    return batch.grad_accum * parallel.micro_batches * parallel.dp;
  }

  std::filesystem::path metrics_path() const;
  std::filesystem::path weights_path() const;     // empty when output.weights == ""
  std::filesystem::path checkpoint_path() const;  // checkpoint.dir under output.dir
};

// Parses the file, applies "key=value" overrides, checks types, ranges, shapes and that the
// input files exist (and that `init` matches the model). Throws recipe_error.
recipe load_recipe(const std::filesystem::path& path, const std::vector<std::string>& overrides);

// The same from TOML text (source names the origin in messages).
recipe parse_recipe(std::string_view toml_text, const std::string& source,
                    const std::vector<std::string>& overrides);

// Checks everything that does not need the file system; throws recipe_error.
void validate_recipe(const recipe& r);
// Whether the recipe's schedule splits backward (input, then weight gradients: zb_h1); false
// for a schedule that cannot be made (validate_recipe names it).
bool splits_backward(const recipe& r);
// Whether ZeRO runs through the devices' groups where the chunks have them
// (parallel.zero_on_device, with ZeRO-1, 2 or 3).
bool zero_on_device(const recipe& r);

// The head sizes (width / heads) each GPU attention kernel takes; materialized takes any.
bool fused_attention_head_size(int hs);  // 16, 32, 64, 128
bool cudnn_attention_head_size(int hs);  // multiples of 8 up to 128
// The attention kernel a GPU job runs: kernels.attention, with "auto" resolved by the compute
// dtype and head size: "cudnn" in bf16 and fp16 (where cuDNN can be loaded), "fused" in fp32,
// "materialized" for a head size neither takes (cudnn: multiples of 8 up to 128; fused: 16, 32,
// 64, 128) or 16-bit compute without cuDNN.
std::string attention_kernel_for(const recipe& r);

// Every recipe key with its type, default and meaning, as a Markdown table (docs/recipe.md;
// `troupe train --help-keys`), from the schema the parser checks keys against; the defaults
// are `defaults`' values (but where the schema says how a default is derived).
std::string format_recipe_keys(const recipe& defaults = recipe{});

// What a resume may change of the recipe the checkpoint was saved with (docs/checkpoints.md,
// "What a resume may change"): every key has one class.
//  - model: the model itself; never changes on resume.
//  - trajectory: the data stream or the optimizer's path; changes only when named with
//    `troupe train --allow-change KEY`, and is then recorded.
//  - mesh: how the same steps are laid out on actors and kernels (the same numbers within
//    rounding); reshards, and the run says what changed.
//  - free: read by nothing that decides a step's numbers; changes freely.
enum class key_class { model, trajectory, mesh, free };
const char* key_class_name(key_class c);
struct recipe_key {
  std::string name;
  key_class cls = key_class::free;
  std::string why;    // why the key has its class
  std::string value;  // the key's value in a recipe, as the keys table writes it
};
// Every key with its class and its value in r, in the keys table's order.
std::vector<recipe_key> recipe_keys(const recipe& r);
// The class table (`troupe train --help-key-classes`; docs/checkpoints.md).
std::string format_key_classes();

// A recipe key changed on resume by --allow-change: at the resume after step `step`, `key` went
// from `from` to `to` (values as the keys table writes them).
struct recipe_change {
  int step = 0;
  std::string key, from, to;
  bool operator==(const recipe_change&) const = default;
};

// Checks input files exist and match the model; throws recipe_error.
void check_recipe_inputs(const recipe& r);

}  // namespace troupe::engine
