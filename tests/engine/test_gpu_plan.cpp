// The GPU trainer's host-side parts, run everywhere: dtype names, and the device memory plan
// (plan_gpu_memory) that --dry-run prints and the GPU suite checks against the allocation:
// activation checkpointing keeps one set of block buffers instead of one per layer, 16-bit
// compute halves the activations and adds a 16-bit weight copy.
#include <catch2/catch.hpp>

#include <stdexcept>

#include "engine/chunks/gpu_chunk.hpp"
#include "engine/parallel/memory_plan.hpp"
#include "engine/parallel/pipeline_layout.hpp"
#include "engine/training/gpu_trainer.hpp"
#include "engine/training/recipe.hpp"

using namespace troupe::engine;

TEST_CASE("compute dtypes are named and parsed", "[gpu-plan]") {
  for (auto d : {compute_dtype::fp32, compute_dtype::bf16, compute_dtype::fp16})
    CHECK(parse_compute_dtype(compute_dtype_name(d)) == d);
  CHECK_THROWS_WITH(parse_compute_dtype("fp8"), Catch::Contains("fp8"));
}

TEST_CASE("the GPU memory plan follows the model, the dtype and checkpointing", "[gpu-plan]") {
  const gpt_config c{50257, 50304, 1024, 12, 12, 768};  // GPT-2 small
  const int B = 4, T = 1024;
  const std::int64_t P = 124'475'904;  // padded vocabulary: 50304 x 768 tied embedding
  const std::int64_t N = std::int64_t{B} * T, NC = N * 768;
  const auto fp32 = plan_gpu_memory(c, B, T, {compute_dtype::fp32, false});
  const auto bf16 = plan_gpu_memory(c, B, T, {compute_dtype::bf16, false});
  const auto fp16 = plan_gpu_memory(c, B, T, {compute_dtype::fp16, false});
  const auto bf16_ac = plan_gpu_memory(c, B, T, {compute_dtype::bf16, true});
  // fp32 master weights, gradients, m, v; plus a 16-bit copy.
  CHECK(fp32.model_state == 16 * P);
  CHECK(bf16.model_state == 18 * P);
  CHECK(fp16.model_state == bf16.model_state);
  CHECK(fp16.activations == bf16.activations);
  CHECK(fp32.activations == fp32.activations_without_recompute);
  // Per layer the block keeps ln1, qkv, atty, res2, ln2, fch, fch_gelu (15 NC values), its
  // output (NC), the layernorm statistics (4 N floats) and the attention's lse (B NH T floats).
  const std::int64_t layer16 = 16 * NC * 2 + 4 * N * 4 + std::int64_t{B} * 12 * T * 4;
  const std::int64_t layer32 = 16 * NC * 4 + 4 * N * 4 + std::int64_t{B} * 12 * T * 4;
  CHECK(plan_gpu_memory(c, B, T, {compute_dtype::bf16, false}).activations -
            plan_gpu_memory(gpt_config{50257, 50304, 1024, 11, 12, 768}, B, T,
                            {compute_dtype::bf16, false})
                .activations ==
        layer16);
  CHECK(fp32.activations - plan_gpu_memory(gpt_config{50257, 50304, 1024, 11, 12, 768}, B, T,
                                           {compute_dtype::fp32, false})
                               .activations ==
        layer32);
  // Checkpointing: the internals of 11 of the 12 blocks are not kept.
  CHECK(bf16_ac.activations_without_recompute == bf16.activations);
  CHECK(bf16.activations - bf16_ac.activations ==
        11 * (15 * NC * 2 + 4 * N * 4 + std::int64_t{B} * 12 * T * 4));
  CHECK(bf16_ac.model_state == bf16.model_state);
}

TEST_CASE("attention kernels are named and parsed", "[gpu-plan]") {
  for (auto a : {attention_kernel::fused, attention_kernel::materialized})
    CHECK(parse_attention_kernel(attention_kernel_name(a)) == a);
  CHECK_THROWS_WITH(parse_attention_kernel("flash"), Catch::Contains("flash"));
}

TEST_CASE("the materialized attention's plan keeps every layer's probabilities", "[gpu-plan]") {
  const gpt_config c{50257, 50304, 1024, 12, 12, 768};  // GPT-2 small
  const int B = 4, T = 1024;
  const std::int64_t N = std::int64_t{B} * T, NC = N * 768, rows = std::int64_t{B} * 12 * T;
  const gpu_trainer_options fused{compute_dtype::bf16, false};
  const gpu_trainer_options materialized{compute_dtype::bf16, false,
                                         attention_kernel::materialized};
  const auto f = plan_gpu_memory(c, B, T, fused);
  const auto m = plan_gpu_memory(c, B, T, materialized);
  CHECK(m.model_state == f.model_state);
  // Per layer the [T, T] probabilities of every head in bf16 instead of each row's fp32 lse;
  // once, the scratch: q, k, v, dO, dq, dk, dv (7 NC) and dP (rows x T) instead of delta (rows).
  CHECK(m.activations - f.activations ==
        12 * (rows * T * 2 - rows * 4) + (7 * NC + rows * T) * 2 - rows * 4);
  // With checkpointing one layer's probabilities are kept, in the shared block buffers.
  const auto m_ac =
      plan_gpu_memory(c, B, T, {compute_dtype::bf16, true, attention_kernel::materialized});
  const auto f_ac = plan_gpu_memory(c, B, T, {compute_dtype::bf16, true});
  CHECK(m_ac.activations - f_ac.activations ==
        (rows * T * 2 - rows * 4) + (7 * NC + rows * T) * 2 - rows * 4);
  // On a tensor shard (tp 2) the shard's heads.
  const auto ranges = chunk_range::whole(c);
  const auto m2 = plan_gpu_chunk_memory(c, ranges, B, T, materialized, 1, 2);
  const auto f2 = plan_gpu_chunk_memory(c, ranges, B, T, fused, 1, 2);
  CHECK(m2.activations - f2.activations ==
        12 * (rows / 2 * T * 2 - rows / 2 * 4) + (7 * NC / 2 + rows / 2 * T) * 2 - rows / 2 * 4);
}

TEST_CASE("a pipeline chunk's GPU plan: its own layers, a tied wte copy, slots in flight",
          "[gpu-plan]") {
  const gpt_config c{50257, 50304, 1024, 12, 12, 768};  // GPT-2 small
  const int B = 4, T = 1024;
  const std::int64_t N = std::int64_t{B} * T, NC = N * 768, lse = std::int64_t{B} * 12 * T * 4;
  const std::int64_t wte = std::int64_t{50304} * 768;
  const auto ranges = partition_layers(c, 2);  // 6 + 6 layers
  const gpu_trainer_options bf16{compute_dtype::bf16, false};
  const auto whole = plan_gpu_memory(c, B, T, bf16);
  CHECK(plan_gpu_chunk_memory(c, chunk_range::whole(c), B, T, bf16, 1).total() == whole.total());
  const auto first = plan_gpu_chunk_memory(c, ranges[0], B, T, bf16, 1);
  const auto last = plan_gpu_chunk_memory(c, ranges[1], B, T, bf16, 1);
  // The two chunks hold every parameter once, and the last one its own copy of the tied wte:
  // 18 bytes a parameter (fp32 weights, gradients, m, v and the bf16 copy).
  CHECK(first.model_state + last.model_state == whole.model_state + 18 * wte);
  // A second micro-batch in flight on the first chunk keeps another input and, per layer, the
  // block's output and internals (15 NC values, 4 N statistics, the lse).
  const std::int64_t per_slot = NC * 2 + 6 * (16 * NC * 2 + 4 * N * 4 + lse);
  CHECK(plan_gpu_chunk_memory(c, ranges[0], B, T, bf16, 2).activations - first.activations ==
        per_slot);
  CHECK(plan_gpu_chunk_memory(c, ranges[0], B, T, bf16, 5).activations - first.activations ==
        4 * per_slot);
  // With checkpointing a slot keeps only the input and the blocks' outputs.
  const gpu_trainer_options bf16_ac{compute_dtype::bf16, true};
  CHECK(plan_gpu_chunk_memory(c, ranges[0], B, T, bf16_ac, 2).activations -
            plan_gpu_chunk_memory(c, ranges[0], B, T, bf16_ac, 1).activations ==
        7 * NC * 2);
  // The head chunk's slot also keeps ln_f's statistics and its output's gradient.
  CHECK(plan_gpu_chunk_memory(c, ranges[1], B, T, bf16, 2).activations - last.activations ==
        per_slot + 2 * N * 4 + NC * 2);
}

TEST_CASE("--dry-run on the GPU prints the plan and what checkpointing saves", "[gpu-plan]") {
  recipe r = parse_recipe(
      "device = \"cuda\"\n[model]\nvocab_size = 256\ncontext = 128\nlayers = 4\nheads = 4\n"
      "width = 256\n[data]\ntrain = \"x\"\n[precision]\ndtype = \"bf16\"\n"
      "[activation_checkpoint]\nmode = \"full\"\n",
      "test.toml", {});
  const std::string text = format_gpu_memory_plan(r);
  const auto plan = plan_gpu_memory(r.model, r.batch.micro_batch, r.batch.seq_len, gpu_options(r));
  CHECK_THAT(text, Catch::Contains("bf16 compute") && Catch::Contains("activation checkpointing") &&
                       Catch::Contains("saves"));
  char total[32];
  std::snprintf(total, sizeof total, "%.1f MiB", static_cast<double>(plan.total()) / (1 << 20));
  CHECK_THAT(text, Catch::Contains(total));
}

TEST_CASE("a device stage's slots: its chunks' peak of micro-batches in flight", "[gpu-plan]") {
  recipe r = parse_recipe(
      "device = \"cuda\"\n[model]\nvocab_size = 256\ncontext = 128\nlayers = 4\nheads = 4\n"
      "width = 256\n[data]\ntrain = \"x\"\n[parallel]\npp = 4\nmicro_batches = 8\n",
      "test.toml", {});
  r.parallel.schedule = "1f1b";  // rank r holds pp - r micro-batches at its peak
  for (int rank = 0; rank < 4; ++rank) CHECK(device_stage_slots(r, rank) == 4 - rank);
  r.parallel.schedule = "gpipe";  // every forward before any backward
  for (int rank = 0; rank < 4; ++rank) CHECK(device_stage_slots(r, rank) == 8);
}

TEST_CASE("--dry-run of a GPU pipeline prints every device stage's chunks", "[gpu-plan]") {
  recipe r = parse_recipe(
      "device = \"cuda\"\n[model]\nvocab_size = 256\ncontext = 128\nlayers = 4\nheads = 4\n"
      "width = 256\n[data]\ntrain = \"x\"\n[parallel]\npp = 2\nvirtual_stages = 2\n"
      "micro_batches = 4\nlink_credits = 2\nschedule = \"interleaved_1f1b\"\n",
      "test.toml", {});
  const int slots = device_stage_slots(r, 1);
  CHECK(slots >= 1);
  CHECK(slots <= r.parallel.micro_batches);
  const std::string text = format_gpu_memory_plan(r);
  CHECK_THAT(text, Catch::Contains("a pipeline of 2 device stages") &&
                       Catch::Contains("the schedule's peak"));
  // Rank 1 holds chunks 1 and 3 (layer 1; layer 3 and the head with its wte copy), and a buffer
  // to receive the embedding's copy of the wte gradient.
  const auto layout = make_pipeline_layout(r.model, 2, 2, {});
  const std::int64_t tied = std::int64_t{r.model.padded_vocab_size} * r.model.width * 4;
  char tied_line[96];
  std::snprintf(tied_line, sizeof tied_line, "ranks 0 and 1 includes %.1f MiB to receive",
                static_cast<double>(tied) / (1 << 20));
  CHECK_THAT(text, Catch::Contains(tied_line));
  std::int64_t total = tied;
  for (const auto& range : layout.rank_chunks(1))
    total += plan_gpu_chunk_memory(r.model, range, r.batch.micro_batch, r.batch.seq_len,
                                   {compute_dtype::fp32, false}, slots)
                 .total();
  char figure[32];
  std::snprintf(figure, sizeof figure, "%.1f MiB\n", static_cast<double>(total) / (1 << 20));
  CHECK_THAT(text, Catch::Contains(figure));
}

TEST_CASE("a tensor shard's GPU plan holds its slices; --dry-run plans one shard", "[gpu-plan]") {
  const gpt_config c{256, 256, 128, 2, 4, 256};
  const int B = 2, T = 64;
  const gpu_trainer_options bf16{compute_dtype::bf16, false};
  const auto range = chunk_range::whole(c);
  const auto whole = plan_gpu_chunk_memory(c, range, B, T, bf16, 1);
  const auto shard = plan_gpu_chunk_memory(c, range, B, T, bf16, 1, 2);
  // Model state: the shard's parameters (its slices plus the replicated ones), 18 bytes each.
  const auto layout = chunk_parameter_layout(c, range, {1, 2});
  const std::int64_t P = layout.back().offset + layout.back().numel;
  CHECK(shard.model_state == 18 * P);
  CHECK(P < c.parameter_count());
  CHECK(2 * P > c.parameter_count());  // layernorms, wpe and row-parallel biases are whole
  // Activations: the column-parallel pieces, the heads' log-sum-exp and the logits halve; the
  // replicated activations do not, and the head adds its statistics (3 floats a row).
  const std::int64_t N = std::int64_t{B} * T, NC = N * c.width;
  const std::int64_t per_layer_halved = 12 * NC * 2 / 2 + 4 * std::int64_t{B} * c.heads * T / 2;
  const std::int64_t shared_halved =
      4 * std::int64_t{B} * c.heads * T / 2 + 12 * NC * 2 / 2 + N * c.padded_vocab_size * 2 / 2;
  CHECK(whole.activations - shard.activations ==
        c.layers * per_layer_halved + shared_halved - 3 * N * 4);
  recipe r = parse_recipe(
      "device = \"cuda\"\n[model]\nvocab_size = 256\ncontext = 128\nlayers = 2\nheads = 4\n"
      "width = 256\n[data]\ntrain = \"x\"\n[parallel]\ntp = 2\n",
      "test.toml", {});
  const std::string text = format_gpu_memory_plan(r);
  CHECK_THAT(text, Catch::Contains("of 2 tensor shards (one shard's figures)"));
  char params[32];
  std::snprintf(params, sizeof params, " %lld ", static_cast<long long>(P));
  CHECK_THAT(text, Catch::Contains(params));
}
