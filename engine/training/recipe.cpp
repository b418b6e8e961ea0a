// Recipe parsing (toml++), overrides, and checks. See recipe.hpp and docs/recipe.md.
#include "engine/training/recipe.hpp"

#include <toml++/toml.h>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <functional>
#include <map>
#include <sstream>
#include <variant>

#include "engine/chunks/gpu_chunk.hpp"
#include "engine/model/gpt_weights.hpp"
#include "engine/parallel/schedule.hpp"
#include "engine/parallel/support.hpp"

namespace troupe::engine {
namespace {

enum class kind { integer, floating, string, integer_array, boolean };

struct field {
  kind type;
  std::function<void(recipe&, const toml::node&)> set;
  std::function<std::string(const recipe&)> get;  // the value as the keys table writes it
  std::string doc;                                // what the key does: the keys table's last column
  std::string default_text;         // the table's default where it is derived, not a value
  key_class cls = key_class::free;  // what a resume may do with it (key_classes)
  std::string cls_why;
};

// A value as the keys table writes it (TOML's spelling).
std::string value_text(const std::string& v) { return "\"" + v + "\""; }
std::string value_text(bool v) { return v ? "true" : "false"; }
std::string value_text(const std::vector<int>& v) {
  std::string s = "[";
  for (std::size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + "]";
}
template <class T>
std::string value_text(T v) {
  if constexpr (std::is_floating_point_v<T>) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%g", static_cast<double>(v));
    std::string s = buf;  // 1e-08 -> 1e-8
    const auto e = s.find("e-0");
    if (e != std::string::npos) s.erase(e + 2, 1);
    return s;
  } else {
    return std::to_string(v);
  }
}

template <class T>
field int_field(T recipe::*member) {
  return {kind::integer,
          [member](recipe& r, const toml::node& n) {
            r.*member = static_cast<T>(*n.value<std::int64_t>());
          },
          [member](const recipe& r) { return value_text(r.*member); },
          {},
          {},
          key_class::free,
          {}};
}

field string_field(std::string recipe::*member) {
  return {kind::string,
          [member](recipe& r, const toml::node& n) { r.*member = *n.value<std::string>(); },
          [member](const recipe& r) { return value_text(r.*member); },
          {},
          {},
          key_class::free,
          {}};
}

// Fields of nested structs: a getter to the sub-struct and a member of it.
template <class S, class T>
field nested(S recipe::*sub, T S::*member) {
  kind k;
  if constexpr (std::is_same_v<T, std::string>) {
    k = kind::string;
  } else if constexpr (std::is_same_v<T, std::vector<int>>) {
    k = kind::integer_array;
  } else if constexpr (std::is_same_v<T, bool>) {
    k = kind::boolean;
  } else if constexpr (std::is_floating_point_v<T>) {
    k = kind::floating;
  } else {
    k = kind::integer;
  }
  return {k,
          [sub, member](recipe& r, const toml::node& n) {
            if constexpr (std::is_same_v<T, std::string>) {
              (r.*sub).*member = *n.value<std::string>();
            } else if constexpr (std::is_same_v<T, std::vector<int>>) {
              auto& out = (r.*sub).*member;
              out.clear();
              for (const auto& e : *n.as_array())
                out.push_back(static_cast<int>(*e.value<std::int64_t>()));
            } else if constexpr (std::is_same_v<T, bool>) {
              (r.*sub).*member = *n.value<bool>();
            } else if constexpr (std::is_floating_point_v<T>) {
              (r.*sub).*member = static_cast<T>(*n.value<double>());
            } else {
              (r.*sub).*member = static_cast<T>(*n.value<std::int64_t>());
            }
          },
          [sub, member](const recipe& r) { return value_text((r.*sub).*member); },
          {},
          {},
          key_class::free,
          {}};
}

field described(field f, std::string doc, std::string default_text = {}) {
  f.doc = std::move(doc);
  f.default_text = std::move(default_text);
  return f;
}

// What a resume may change (recipe.hpp, key_class): every key's class and why, by key or by
// table ("data." covers every data key). keys_in_order() refuses a key without one.
struct class_rule {
  const char* key;
  key_class cls;
  const char* why;
};
const std::vector<class_rule>& key_classes() {
  using enum key_class;
  static const std::vector<class_rule> rules = {
      {"seed", trajectory, "seeds the order of the data (the weights come from the checkpoint)"},
      {"steps", free,
       "may grow to extend the run (the learning-rate decay then spans the new total); a "
       "checkpoint past it is refused"},
      {"eval_interval", free, "validation only: reads the weights, changes no step"},
      {"eval_batches", free, "validation only: reads the weights, changes no step"},
      {"init", free, "read by a fresh run only; a resume takes the checkpoint's weights"},
      {"device", mesh, "where the same steps run: the same numbers within rounding"},
      {"model.", model, "the model's shape: the checkpoint's tensors are this model"},
      {"data.", trajectory, "the tokens each step trains on"},
      {"batch.micro_batch", trajectory,
       "which rows make a micro-batch (the data position "
       "counts micro-batches)"},
      {"batch.seq_len", trajectory, "the tokens of each row"},
      {"batch.grad_accum", mesh,
       "the same micro-batches in other rounds, while the global batch stays (below)"},
      {"optimizer.", trajectory, "the optimizer's path: learning rate, moments, decay, clipping"},
      {"output.", free, "where the outputs go"},
      {"checkpoint.", free, "when and where checkpoints are written"},
      {"watchdog.", free, "when a stuck stage is reported"},
      {"parallel.micro_batches", mesh,
       "the same micro-batches in other pipeline passes, while the global batch stays (below)"},
      {"parallel.dp", mesh,
       "the same micro-batches over other replicas, while the global batch "
       "stays (below)"},
      {"parallel.link_credits", free, "messages in flight: the values are the same bit for bit"},
      {"parallel.prefetch", free, "micro-batches kept ready: the values are the same bit for bit"},
      {"parallel.zero_prefetch", free,
       "parameters gathered ahead: the values are the same bit for bit"},
      {"parallel.", mesh, "how the model is spread over actors: the sums run in another order"},
      {"precision.", trajectory, "the arithmetic and the loss scale of every update"},
      {"guard.", trajectory, "which updates are skipped"},
      {"activation_checkpoint.", mesh, "memory for time: the forward is computed again"},
      {"kernels.", mesh, "another kernel for the same arithmetic: within rounding"},
  };
  return rules;
}

// Every key, in the order of docs/recipe.md's table (format_recipe_keys); keys_in_order() adds
// their classes.
const std::vector<std::pair<std::string, field>>& keys_without_classes() {
  static const std::vector<std::pair<std::string, field>> fields = {
      {"seed", described(int_field(&recipe::seed), "initialisation and sampling seed")},
      {"steps", described(int_field(&recipe::steps), "optimizer steps")},
      {"eval_interval", described(int_field(&recipe::eval_interval),
                                  "validate every N steps and after the last (0: never)")},
      {"eval_batches", described(int_field(&recipe::eval_batches), "micro-batches per validation")},
      {"init",
       described(string_field(&recipe::init),
                 "a safetensors file (Hugging Face GPT-2 names) to start from; \"\" = GPT-2 init")},
      {"device",
       described(string_field(&recipe::device),
                 "`cpu`, or `cuda`: the whole model on one GPU with the serial loop "
                 "([gpu.md](gpu.md#troupe-train---device-cuda)); `troupe train --device` sets it")},
      {"model.vocab_size",
       described(nested(&recipe::model, &gpt_config::vocab_size), "real vocabulary")},
      {"model.padded_vocab_size",
       described(nested(&recipe::model, &gpt_config::padded_vocab_size),
                 "rows of the embedding / columns of the logits (≥ vocab_size)", "= vocab_size")},
      {"model.context", described(nested(&recipe::model, &gpt_config::context),
                                  "maximum sequence length (rows of `wpe`)")},
      {"model.layers",
       described(nested(&recipe::model, &gpt_config::layers), "transformer blocks")},
      {"model.heads", described(nested(&recipe::model, &gpt_config::heads),
                                "attention heads (width % heads == 0)")},
      {"model.width", described(nested(&recipe::model, &gpt_config::width), "channels")},
      {"data.format",
       described(nested(&recipe::data, &data_config::format),
                 "`text` (byte-level tokens) or `shards` (llm.c uint16 token shards)")},
      {"data.train", described(nested(&recipe::data, &data_config::train),
                               "text file or directory, or a shard file", "fortunes dir")},
      {"data.val",
       described(nested(&recipe::data, &data_config::val),
                 "a separate validation file; \"\" = split `val_fraction` off the end of train")},
      {"data.val_fraction", described(nested(&recipe::data, &data_config::val_fraction),
                                      "share of the corpus held out when `data.val` is empty")},
      {"data.order",
       described(nested(&recipe::data, &data_config::order), "`random` (seeded) or `sequential`")},
      {"batch.micro_batch",
       described(nested(&recipe::batch, &batch_config::micro_batch), "B: rows per micro-batch")},
      {"batch.seq_len", described(nested(&recipe::batch, &batch_config::seq_len),
                                  "T: tokens per row (≤ model.context)")},
      {"batch.grad_accum",
       described(nested(&recipe::batch, &batch_config::grad_accum),
                 "rounds per optimizer step: each round is one pass of the pipeline schedule over "
                 "`parallel.micro_batches` micro-batches (the serial loop runs the same step's "
                 "`grad_accum × micro_batches × dp` micro-batches on one stage)")},
      {"optimizer.lr",
       described(nested(&recipe::optimizer, &optimizer_config::lr), "peak learning rate")},
      {"optimizer.min_lr", described(nested(&recipe::optimizer, &optimizer_config::min_lr),
                                     "learning rate at the end of the decay")},
      {"optimizer.warmup_steps",
       described(nested(&recipe::optimizer, &optimizer_config::warmup_steps),
                 "linear warmup steps")},
      {"optimizer.decay", described(nested(&recipe::optimizer, &optimizer_config::decay),
                                    "`cosine`, `linear` or `constant`")},
      {"optimizer.beta1",
       described(nested(&recipe::optimizer, &optimizer_config::beta1), "AdamW β1")},
      {"optimizer.beta2",
       described(nested(&recipe::optimizer, &optimizer_config::beta2), "AdamW β2")},
      {"optimizer.eps", described(nested(&recipe::optimizer, &optimizer_config::eps), "AdamW ε")},
      {"optimizer.weight_decay",
       described(nested(&recipe::optimizer, &optimizer_config::weight_decay),
                 "decoupled weight decay, applied to 2-D tensors only (weights, embeddings), not "
                 "to biases or layernorm")},
      {"optimizer.grad_clip", described(nested(&recipe::optimizer, &optimizer_config::grad_clip),
                                        "global gradient-norm clip (0: off)")},
      {"output.dir",
       described(nested(&recipe::output, &output_config::dir), "where outputs go (created)")},
      {"output.metrics", described(nested(&recipe::output, &output_config::metrics),
                                   "per-step JSONL, relative to `output.dir`")},
      {"output.weights", described(nested(&recipe::output, &output_config::weights),
                                   "final weights, relative to `output.dir` (\"\" = none)")},
      {"checkpoint.every", described(nested(&recipe::checkpoint, &checkpoint_config::every),
                                     "a checkpoint every N steps (0 = none; docs/checkpoints.md)")},
      {"checkpoint.dir",
       described(nested(&recipe::checkpoint, &checkpoint_config::dir),
                 "where checkpoints go, relative to `output.dir` unless absolute")},
      {"checkpoint.keep", described(nested(&recipe::checkpoint, &checkpoint_config::keep),
                                    "committed checkpoints kept; an older one is removed only "
                                    "after a newer one is committed")},
      {"checkpoint.pinned_copy",
       described(nested(&recipe::checkpoint, &checkpoint_config::pinned_copy),
                 "`device = \"cuda\"` with `checkpoint.every`: each chunk copies its state "
                 "into pinned host memory (allocated at start) on a stream of its own while the "
                 "next step runs; false: into pageable memory before it begins "
                 "([checkpoints.md](checkpoints.md#how-a-checkpoint-is-taken))")},
      {"checkpoint.format",
       described(nested(&recipe::checkpoint, &checkpoint_config::format),
                 "\"auto\", \"whole\" or \"parts\": whole-model Hugging Face files written "
                 "by one writer, or a part file per stage written by the stage itself; auto: parts "
                 "for a job of several processes "
                 "([checkpoints.md](checkpoints.md#what-a-checkpoint-holds))")},
      {"watchdog.action_timeout",
       described(nested(&recipe::watchdog, &watchdog_config::action_timeout),
                 "seconds a stage may spend in one action before it is reported and its process "
                 "ends (0 = never; docs/checkpoints.md)")},
      {"parallel.pp", described(nested(&recipe::parallel, &parallel_config::pp),
                                "pipeline ranks (stage actors per replica)")},
      {"parallel.dp",
       described(nested(&recipe::parallel, &parallel_config::dp), "data-parallel replicas")},
      {"parallel.tp",
       described(nested(&recipe::parallel, &parallel_config::tp),
                 "tensor shards per pipeline stage (Megatron-style: column/row-parallel blocks, "
                 "vocabulary-parallel embedding and head; docs/tensor_parallel.md). `model.heads` "
                 "and `model.padded_vocab_size` must divide by it")},
      {"parallel.schedule", described(nested(&recipe::parallel, &parallel_config::schedule),
                                      "`gpipe`, `1f1b`, `interleaved_1f1b`, `zb_h1`, or a "
                                      "registered user schedule (docs/schedules.md)")},
      {"parallel.virtual_stages",
       described(nested(&recipe::parallel, &parallel_config::virtual_stages),
                 "model chunks per rank (v); `interleaved_1f1b` needs ≥ 2, the others 1")},
      {"parallel.micro_batches",
       described(nested(&recipe::parallel, &parallel_config::micro_batches),
                 "m: micro-batches per pipeline pass and replica")},
      {"parallel.layer_split", described(nested(&recipe::parallel, &parallel_config::layer_split),
                                         "layers per virtual stage (pp × v entries, each ≥ 1, "
                                         "summing to `model.layers`); [] = as even as possible")},
      {"parallel.link_credits",
       described(nested(&recipe::parallel, &parallel_config::link_credits),
                 "unacknowledged messages allowed per pipeline link (0 = m)")},
      {"parallel.prefetch",
       described(nested(&recipe::parallel, &parallel_config::prefetch),
                 "micro-batches each data loader keeps ready per destination")},
      {"parallel.bucket_layers",
       described(
           nested(&recipe::parallel, &parallel_config::bucket_layers),
           "transformer layers per data-parallel gradient bucket (the ZeRO bucket size too)")},
      {"parallel.zero",
       described(nested(&recipe::parallel, &parallel_config::zero),
                 "ZeRO stage over each pipeline rank's DP group: 0 DDP, 1 optimizer state sharded, "
                 "2 gradients too, 3 parameters too (docs/zero.md)")},
      {"parallel.zero_prefetch",
       described(nested(&recipe::parallel, &parallel_config::zero_prefetch),
                 "ZeRO-3: parameter buckets gathered ahead of use")},
      {"parallel.nccl_links",
       described(nested(&recipe::parallel, &parallel_config::nccl_links),
                 "`device = \"cuda\"` across processes: carry the pipeline's activations and "
                 "gradients and the tied wte's gradient, average data-parallel gradients "
                 "(without ZeRO) and sum tensor groups between processes by NCCL where every "
                 "process has a GPU of its own; false, or where two processes share a GPU: "
                 "staged through host memory and the transport ("
                 "[processes.md](processes.md#gpus-across-processes))")},
      {"parallel.zero_on_device",
       described(nested(&recipe::parallel, &parallel_config::zero_on_device),
                 "ZeRO on device chunks: reduce-scatter the gradients, keep and update the "
                 "owned AdamW moments (ZeRO-3: and master weights) and all-gather the parameters "
                 "in device memory, through each rank's data-parallel group (NCCL); false: "
                 "through host shards ([zero.md](zero.md#on-device-chunks-device--cuda))")},
      {"precision.dtype",
       described(nested(&recipe::precision, &precision_config::dtype),
                 "`fp32`; `bf16` and `fp16` (16-bit compute, fp32 master weights and AdamW state) "
                 "need `device = \"cuda\"`; `fp16` needs `loss_scale = \"dynamic\"`")},
      {"precision.loss_scale",
       described(nested(&recipe::precision, &precision_config::loss_scale),
                 "`none` or `dynamic` (torch.amp.GradScaler's rule, below)")},
      {"precision.init_scale", described(nested(&recipe::precision, &precision_config::init_scale),
                                         "the first step's loss scale")},
      {"precision.growth_interval",
       described(nested(&recipe::precision, &precision_config::growth_interval),
                 "finite steps in a row before the scale grows")},
      {"precision.growth_factor",
       described(nested(&recipe::precision, &precision_config::growth_factor), "growth (> 1)")},
      {"precision.backoff_factor",
       described(nested(&recipe::precision, &precision_config::backoff_factor),
                 "backoff on a non-finite step (in (0, 1))")},
      {"guard.loss_zscore", described(nested(&recipe::guard, &guard_config::loss_zscore),
                                      "skip the update when the loss's z-score against the last "
                                      "`guard.window` steps exceeds this (0: off)")},
      {"guard.grad_norm_zscore", described(nested(&recipe::guard, &guard_config::grad_norm_zscore),
                                           "the same for the gradient norm (0: off)")},
      {"guard.window",
       described(nested(&recipe::guard, &guard_config::window),
                 "steps in the rolling mean and deviation (≥ 2; no z-score until full)")},
      {"guard.max_skips",
       described(nested(&recipe::guard, &guard_config::max_skips),
                 "stop the job after this many skipped updates in a row (0: never)")},
      {"activation_checkpoint.mode",
       described(nested(&recipe::activation_checkpoint, &activation_checkpoint_config::mode),
                 "`none` or `full`: recompute every transformer block in backward "
                 "([below](#activation-checkpointing))")},
      {"kernels.attention",
       described(nested(&recipe::kernels, &kernels_config::attention),
                 "GPU attention kernel (`device = \"cuda\"`): `cudnn` (cuDNN's fused flash "
                 "attention, bf16/fp16, head sizes multiples of 8 up to 128), `fused` (one fp32 "
                 "kernel per pass, head sizes 16/32/64/128), `materialized` (tensor-core GEMMs "
                 "around a fused softmax, each layer keeping its [T, T] probabilities; any head "
                 "size); `auto` takes `cudnn` in bf16 and fp16, `fused` in fp32, `materialized` "
                 "for a head size neither takes ([gpu.md](gpu.md#causal-attention-three-routes))")},
      {"kernels.fast_paths",
       described(nested(&recipe::kernels, &kernels_config::fast_paths),
                 "GPU (`device = \"cuda\"`): the newer kernels of the rest of the step: 128-bit "
                 "layernorm forward and backward (where a row is a multiple of 32 lanes × 16 "
                 "bytes) and elementwise kernels, the block's residual add fused into its "
                 "layernorm, one AdamW launch over the flat buffers, and in bf16/fp16 the GELU and "
                 "bias gradient in cuBLASLt's GEMM epilogues and a classifier that reads the "
                 "logits once for max and sum; within rounding of the others; `false` for the "
                 "older ones ([gpu.md](gpu.md#ops-kernelscudacuda_opshpp))")},
  };
  return fields;
}

const std::vector<std::pair<std::string, field>>& keys_in_order() {
  static const std::vector<std::pair<std::string, field>> fields = [] {
    auto out = keys_without_classes();
    for (auto& [key, f] : out) {
      const class_rule* rule = nullptr;
      for (const auto& c : key_classes()) {
        const std::string k = c.key;
        if (key == k || (k.ends_with('.') && key.starts_with(k))) {
          rule = &c;
          break;
        }
      }
      if (!rule) throw std::logic_error("recipe key " + key + " has no resume class");
      f.cls = rule->cls;
      f.cls_why = rule->why;
    }
    return out;
  }();
  return fields;
}

const std::map<std::string, field>& schema() {
  static const std::map<std::string, field> fields(keys_in_order().begin(), keys_in_order().end());
  return fields;
}

const char* kind_name(kind k) {
  switch (k) {
    case kind::integer:
      return "an integer";
    case kind::floating:
      return "a number";
    case kind::string:
      return "a string";
    case kind::integer_array:
      return "an array of integers";
    case kind::boolean:
      return "true or false";
  }
  return "?";
}

void apply(recipe& r, const std::string& key, const toml::node& node, const std::string& source) {
  const auto& fields = schema();
  auto it = fields.find(key);
  if (it == fields.end()) throw recipe_error(source + ": unknown key " + key);
  const kind k = it->second.type;
  bool ok = false;
  if (k == kind::integer) ok = node.is_integer();
  if (k == kind::floating) ok = node.is_integer() || node.is_floating_point();
  if (k == kind::string) ok = node.is_string();
  if (k == kind::boolean) ok = node.is_boolean();
  if (k == kind::integer_array) {
    const auto* a = node.as_array();
    ok = a != nullptr;
    if (a) {
      for (const auto& e : *a)
        ok = ok && e.is_integer() && *e.value<std::int64_t>() >= INT32_MIN &&
             *e.value<std::int64_t>() <= INT32_MAX;
    }
  }
  if (!ok) throw recipe_error(source + ": key " + key + " must be " + kind_name(k));
  if (k == kind::integer) {
    const auto v = *node.value<std::int64_t>();
    if (key != "seed" && (v < INT32_MIN || v > INT32_MAX)) {
      throw recipe_error(source + ": key " + key + " is out of range");
    }
  }
  it->second.set(r, node);
}

void apply_table(recipe& r, const toml::table& table, const std::string& prefix,
                 const std::string& source) {
  for (const auto& [k, node] : table) {
    const std::string key =
        prefix.empty() ? std::string(k.str()) : prefix + "." + std::string(k.str());
    if (const auto* sub = node.as_table()) {
      apply_table(r, *sub, key, source);
    } else {
      apply(r, key, node, source);
    }
  }
}

void apply_override(recipe& r, const std::string& text) {
  const auto eq = text.find('=');
  if (eq == std::string::npos || eq == 0) {
    throw recipe_error("--set " + text + ": expected key=value");
  }
  std::string key = text.substr(0, eq);
  const std::string value = text.substr(eq + 1);
  if (!schema().count(key)) throw recipe_error("--set: unknown key " + key);
  toml::table parsed;
  try {
    parsed = toml::parse("v = " + value);
  } catch (const toml::parse_error&) {
    parsed = toml::table{{"v", value}};  // a bare word is a string
  }
  const toml::node* node = parsed.get("v");
  if (schema().at(key).type == kind::string && !node->is_string()) {
    parsed = toml::table{{"v", value}};
    node = parsed.get("v");
  }
  apply(r, key, *node, "--set");
}

void require(bool ok, const std::string& key, const std::string& what) {
  if (!ok) throw recipe_error("key " + key + ": " + what);
}

// The names the combination rules (engine/parallel/support.hpp) read.
void validate_names(const recipe& r) {
  require(r.precision.dtype == "fp32" || r.precision.dtype == "bf16" || r.precision.dtype == "fp16",
          "precision.dtype", "'" + r.precision.dtype + "' is not fp32, bf16 or fp16");
  require(r.device == "cpu" || r.device == "cuda", "device",
          "'" + r.device + "' is not cpu or cuda");
  const auto& attention = r.kernels.attention;
  require(attention == "auto" || attention == "fused" || attention == "materialized" ||
              attention == "cudnn",
          "kernels.attention",
          "\"" + attention + "\" is not \"auto\", \"fused\", \"materialized\" or \"cudnn\"");
}

void validate_precision(const recipe& r) {
  const auto& p = r.precision;
  require(p.loss_scale == "none" || p.loss_scale == "dynamic", "precision.loss_scale",
          "'" + p.loss_scale + "' is not none or dynamic");
  require(p.dtype != "fp16" || p.loss_scale == "dynamic", "precision.loss_scale",
          "fp16 needs \"dynamic\" (fp16 gradients underflow without loss scaling)");
  require(std::isfinite(p.init_scale) && p.init_scale > 0, "precision.init_scale",
          "must be a finite number > 0");
  require(p.growth_interval >= 1, "precision.growth_interval", "must be >= 1");
  require(std::isfinite(p.growth_factor) && p.growth_factor > 1, "precision.growth_factor",
          "must be a finite number > 1");
  require(p.backoff_factor > 0 && p.backoff_factor < 1, "precision.backoff_factor",
          "must be in (0, 1)");
  const auto& g = r.guard;
  require(std::isfinite(g.loss_zscore) && g.loss_zscore >= 0, "guard.loss_zscore",
          "must be a finite number >= 0 (0: off)");
  require(std::isfinite(g.grad_norm_zscore) && g.grad_norm_zscore >= 0, "guard.grad_norm_zscore",
          "must be a finite number >= 0 (0: off)");
  require(g.window >= 2, "guard.window", "must be >= 2");
  require(g.max_skips >= 0, "guard.max_skips", "must be >= 0 (0: never stop)");
}

// Nonsensical parallel layouts are refused here, before anything runs.
void validate_parallel(const recipe& r) {
  const auto& p = r.parallel;
  require(p.pp >= 1, "parallel.pp", "must be >= 1");
  require(p.dp >= 1, "parallel.dp", "must be >= 1");
  require(p.tp >= 1, "parallel.tp", "must be >= 1");
  try {
    check_tensor_parallel(r.model, p.tp);
  } catch (const std::invalid_argument& e) {
    throw recipe_error(std::string("key ") + e.what());
  }
  require(p.virtual_stages >= 1, "parallel.virtual_stages", "must be >= 1");
  require(p.micro_batches >= 1, "parallel.micro_batches", "must be >= 1");
  require(p.link_credits >= 0, "parallel.link_credits", "must be >= 0 (0: micro_batches)");
  require(p.prefetch >= 1, "parallel.prefetch", "must be >= 1");
  require(p.bucket_layers >= 1, "parallel.bucket_layers", "must be >= 1");
  require(p.zero >= 0 && p.zero <= 3, "parallel.zero", "must be 0, 1, 2 or 3");
  require(p.zero_prefetch >= 1, "parallel.zero_prefetch", "must be >= 1");
  const int chunks = p.pp * p.virtual_stages;
  require(chunks <= r.model.layers, "parallel.pp",
          std::to_string(p.pp) + " ranks x " + std::to_string(p.virtual_stages) +
              " virtual stages need at least " + std::to_string(chunks) +
              " layers, model.layers is " + std::to_string(r.model.layers));
  if (!p.layer_split.empty()) {
    require(static_cast<int>(p.layer_split.size()) == chunks, "parallel.layer_split",
            "has " + std::to_string(p.layer_split.size()) + " entries, expected pp x " +
                "virtual_stages = " + std::to_string(chunks));
    int sum = 0;
    for (int n : p.layer_split) {
      require(n >= 1, "parallel.layer_split", "every virtual stage needs at least one layer");
      sum += n;
    }
    require(
        sum == r.model.layers, "parallel.layer_split",
        "sums to " + std::to_string(sum) + ", model.layers is " + std::to_string(r.model.layers));
  }
  if (!has_schedule(p.schedule)) {
    std::string known;
    for (const auto& n : schedule_names()) known += (known.empty() ? "" : ", ") + n;
    throw recipe_error("key parallel.schedule: unknown schedule \"" + p.schedule +
                       "\" (known: " + known + ")");
  }
  try {
    make_plan(p.schedule, schedule_shape{p.pp, p.micro_batches, p.virtual_stages});
  } catch (const std::invalid_argument& e) {
    throw recipe_error(std::string("key parallel.schedule: ") + e.what());
  }
  const auto& ac = r.activation_checkpoint.mode;
  require(ac == "none" || ac == "full", "activation_checkpoint.mode",
          "must be \"none\" or \"full\", not \"" + ac + "\"");
}

}  // namespace

std::filesystem::path recipe::metrics_path() const {
  return std::filesystem::path(output.dir) / output.metrics;
}

std::filesystem::path recipe::weights_path() const {
  if (output.weights.empty()) return {};
  return std::filesystem::path(output.dir) / output.weights;
}

std::filesystem::path recipe::checkpoint_path() const {
  return std::filesystem::path(output.dir) / checkpoint.dir;  // an absolute dir replaces
}

recipe parse_recipe(std::string_view toml_text, const std::string& source,
                    const std::vector<std::string>& overrides) {
  recipe r;
  r.source_text = toml_text;
  r.overrides = overrides;
  toml::table table;
  try {
    table = toml::parse(toml_text, source);
  } catch (const toml::parse_error& e) {
    std::ostringstream msg;
    msg << source << ":" << e.source().begin.line << ": " << e.description();
    throw recipe_error(msg.str());
  }
  apply_table(r, table, "", source);
  for (const auto& o : overrides) apply_override(r, o);
  // padded_vocab_size defaults to vocab_size (whatever value vocab_size ends up with).
  bool padded_set = table.at_path("model.padded_vocab_size").node() != nullptr;
  for (const auto& o : overrides)
    padded_set = padded_set || o.starts_with("model.padded_vocab_size=");
  if (!padded_set) r.model.padded_vocab_size = r.model.vocab_size;
  validate_recipe(r);
  return r;
}

recipe load_recipe(const std::filesystem::path& path, const std::vector<std::string>& overrides) {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec)) {
    throw recipe_error(path.string() + ": cannot read recipe (not a file)");
  }
  std::ifstream in(path);
  if (!in) throw recipe_error(path.string() + ": cannot read recipe");
  std::stringstream text;
  text << in.rdbuf();
  recipe r = parse_recipe(text.str(), path.string(), overrides);
  check_recipe_inputs(r);
  return r;
}

bool fused_attention_head_size(int hs) { return hs == 16 || hs == 32 || hs == 64 || hs == 128; }
bool cudnn_attention_head_size(int hs) { return hs > 0 && hs <= 128 && hs % 8 == 0; }

std::string format_recipe_keys(const recipe& defaults) {
  std::string s = "| key | type | default | meaning |\n|---|---|---|---|\n";
  for (const auto& [key, f] : keys_in_order()) {
    static const char* types[] = {"int", "float", "string", "int array", "bool"};
    s += "| `" + key + "` | " + types[static_cast<int>(f.type)] + " | " +
         (f.default_text.empty() ? f.get(defaults) : f.default_text) + " | " + f.doc + " |\n";
  }
  return s;
}

const char* key_class_name(key_class c) {
  switch (c) {
    case key_class::model:
      return "model";
    case key_class::trajectory:
      return "trajectory";
    case key_class::mesh:
      return "mesh";
    case key_class::free:
      return "free";
  }
  return "?";
}

std::vector<recipe_key> recipe_keys(const recipe& r) {
  std::vector<recipe_key> out;
  for (const auto& [key, f] : keys_in_order()) out.push_back({key, f.cls, f.cls_why, f.get(r)});
  return out;
}

std::string format_key_classes() {
  std::string s = "| key | class | why |\n|---|---|---|\n";
  for (const auto& k : recipe_keys(recipe{}))
    s += "| `" + k.name + "` | " + key_class_name(k.cls) + " | " + k.why + " |\n";
  s += "| global batch (derived) | trajectory | tokens per step: `parallel.dp × "
       "parallel.micro_batches × batch.grad_accum × batch.micro_batch × batch.seq_len`; "
       "`--allow-change global_batch` |\n";
  return s;
}

std::string attention_kernel_for(const recipe& r) {
  if (r.kernels.attention != "auto") return r.kernels.attention;
  const int heads = r.model.heads, hs = heads > 0 ? r.model.width / heads : 0;
  if (r.precision.dtype == "fp32") return fused_attention_head_size(hs) ? "fused" : "materialized";
  return cudnn_attention_head_size(hs) && cudnn_attention_usable() ? "cudnn" : "materialized";
}

bool zero_on_device(const recipe& r) { return r.parallel.zero_on_device && r.parallel.zero > 0; }

bool splits_backward(const recipe& r) {
  try {
    const auto& p = r.parallel;
    return make_plan(p.schedule, schedule_shape{p.pp, p.micro_batches, p.virtual_stages})
        .split_backward;
  } catch (const std::exception&) {
    return false;
  }
}

void validate_recipe(const recipe& r) {
  try {
    r.model.validate();
  } catch (const std::invalid_argument& e) {
    throw recipe_error(std::string("key ") + e.what());
  }
  require(r.steps > 0, "steps", "must be positive");
  validate_names(r);
  job_shape job;
  job.r = &r;
  job.chunks_known = false;  // run_training checks the rest, with its chunks
  check_support(job);        // the combinations not built (engine/parallel/support.hpp)
  validate_precision(r);
  require(r.eval_interval >= 0, "eval_interval", "must be >= 0");
  require(r.eval_batches > 0, "eval_batches", "must be positive");
  require(r.batch.micro_batch > 0, "batch.micro_batch", "must be positive");
  require(r.batch.seq_len > 0, "batch.seq_len", "must be positive");
  require(r.batch.seq_len <= r.model.context, "batch.seq_len",
          std::to_string(r.batch.seq_len) + " exceeds model.context " +
              std::to_string(r.model.context));
  require(r.batch.grad_accum > 0, "batch.grad_accum", "must be positive");
  require(r.data.format == "text" || r.data.format == "shards", "data.format",
          "must be \"text\" or \"shards\", got \"" + r.data.format + "\"");
  require(r.data.order == "random" || r.data.order == "sequential", "data.order",
          "must be \"random\" or \"sequential\", got \"" + r.data.order + "\"");
  require(r.data.val_fraction >= 0 && r.data.val_fraction < 1, "data.val_fraction",
          "must be in [0, 1)");
  require(!r.data.train.empty(), "data.train", "must name a file or directory");
  require(r.data.format != "text" || r.model.vocab_size >= 256, "model.vocab_size",
          "byte-level text needs at least 256, got " + std::to_string(r.model.vocab_size));
  const auto& o = r.optimizer;
  require(o.lr >= 0 && std::isfinite(o.lr), "optimizer.lr", "must be a finite number >= 0");
  require(o.min_lr >= 0 && o.min_lr <= o.lr, "optimizer.min_lr", "must be in [0, optimizer.lr]");
  require(o.warmup_steps >= 0, "optimizer.warmup_steps", "must be >= 0");
  require(o.decay == "cosine" || o.decay == "linear" || o.decay == "constant", "optimizer.decay",
          "must be \"cosine\", \"linear\" or \"constant\", got \"" + o.decay + "\"");
  require(o.beta1 >= 0 && o.beta1 < 1, "optimizer.beta1", "must be in [0, 1)");
  require(o.beta2 >= 0 && o.beta2 < 1, "optimizer.beta2", "must be in [0, 1)");
  require(o.eps > 0, "optimizer.eps", "must be positive");
  require(o.weight_decay >= 0, "optimizer.weight_decay", "must be >= 0");
  require(o.grad_clip >= 0, "optimizer.grad_clip", "must be >= 0 (0 disables clipping)");
  validate_parallel(r);
  require(!r.output.dir.empty(), "output.dir", "must not be empty");
  require(!r.output.metrics.empty(), "output.metrics", "must not be empty");
  require(r.checkpoint.every >= 0, "checkpoint.every", "must be >= 0 (0: no checkpoints)");
  require(!r.checkpoint.dir.empty(), "checkpoint.dir", "must not be empty");
  require(r.checkpoint.keep >= 1, "checkpoint.keep", "must be >= 1");
  const auto& cf = r.checkpoint.format;
  require(cf == "auto" || cf == "whole" || cf == "parts", "checkpoint.format",
          "must be \"auto\", \"whole\" or \"parts\" (got \"" + cf + "\")");
  require(std::isfinite(r.watchdog.action_timeout) && r.watchdog.action_timeout >= 0,
          "watchdog.action_timeout", "must be >= 0 seconds (0: no watchdog)");
}

void check_recipe_inputs(const recipe& r) {
  namespace fs = std::filesystem;
  auto exists = [](const std::string& path, const std::string& key) {
    std::error_code ec;
    if (!fs::exists(path, ec))
      throw recipe_error("key " + key + ": file " + path + " does not exist");
  };
  exists(r.data.train, "data.train");
  if (!r.data.val.empty()) exists(r.data.val, "data.val");
  if (!r.init.empty()) {
    exists(r.init, "init");
    try {
      check_hf_weights(r.model, r.init);
    } catch (const std::exception& e) {
      throw recipe_error(std::string("key init: ") + e.what());
    }
  }
  std::error_code ec;
  if (fs::exists(r.output.dir, ec) && !fs::is_directory(r.output.dir, ec)) {
    throw recipe_error("key output.dir: " + r.output.dir + " exists and is not a directory");
  }
}

}  // namespace troupe::engine
