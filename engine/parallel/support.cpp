// See support.hpp.
#include "engine/parallel/support.hpp"

namespace troupe::engine {
namespace {

int head_size(const job_shape& j) { return j.r->model.width / j.r->model.heads; }

}  // namespace

const std::vector<support_rule>& support_rules() {
  static const std::vector<support_rule> rules = {
      {"16-bit compute (`precision.dtype` bf16 or fp16)", "precision.dtype",
       "no: the CPU engines compute in fp32", "yes",
       [](const job_shape& j) { return j.r->precision.dtype != "fp32" && j.r->device != "cuda"; },
       [](const job_shape& j) {
         return j.r->precision.dtype + " needs device = \"cuda\" (the CPU engines compute in fp32)";
       }},
      {"a head size other than 16, 32, 64 or 128 with `kernels.attention` \"fused\"", "model.heads",
       "yes", "no: kernels.attention = \"materialized\" takes any head size",
       [](const job_shape& j) {
         return j.r->device == "cuda" && attention_kernel_for(*j.r) == "fused" &&
                j.r->model.heads > 0 && !fused_attention_head_size(head_size(j));
       },
       [](const job_shape& j) {
         return "device \"cuda\": head size " + std::to_string(head_size(j)) +
                " (width / heads); the fused GPU attention kernel takes 16, 32, 64 or 128 "
                "(kernels.attention = \"materialized\" takes any)";
       }},
      {"a head size above 128 or no multiple of 8 with `kernels.attention` \"cudnn\"",
       "model.heads", "yes", "no: kernels.attention = \"materialized\" takes any head size",
       [](const job_shape& j) {
         return j.r->device == "cuda" && attention_kernel_for(*j.r) == "cudnn" &&
                j.r->model.heads > 0 && !cudnn_attention_head_size(head_size(j));
       },
       [](const job_shape& j) {
         return "device \"cuda\": head size " + std::to_string(head_size(j)) +
                " (width / heads); cuDNN's attention takes multiples of 8 up to 128 "
                "(kernels.attention = \"materialized\" takes any)";
       }},
      {"`kernels.attention` \"cudnn\" in fp32 (`precision.dtype` fp32)", "kernels.attention", "yes",
       "no: cuDNN's flash attention computes in bf16 or fp16",
       [](const job_shape& j) {
         return j.r->device == "cuda" && attention_kernel_for(*j.r) == "cudnn" &&
                j.r->precision.dtype == "fp32";
       },
       [](const job_shape&) {
         return std::string(
             "kernels.attention = \"cudnn\" needs precision.dtype bf16 or fp16 (cuDNN's flash "
             "attention has no fp32; fp32 runs use \"fused\" or \"materialized\")");
       }},
      {"ZeRO's collectives and optimizer in device memory (`parallel.zero_on_device`)",
       "parallel.zero_on_device", "no: CPU chunks' ZeRO runs in host shard actors", "yes",
       [](const job_shape& j) {
         return j.chunks_known && j.r->parallel.zero_on_device && j.r->parallel.zero > 0 &&
                j.r->device != "cuda" && !j.device_chunks;
       },
       [](const job_shape&) {
         return std::string(
             "true needs device chunks (device = \"cuda\"); the CPU engines' ZeRO runs in "
             "host shard actors");
       }},
  };
  return rules;
}

void check_support(const job_shape& job) {
  for (const auto& rule : support_rules()) {
    if (!rule.refused(job)) continue;
    throw recipe_error(rule.key.empty() ? rule.why(job) : "key " + rule.key + ": " + rule.why(job));
  }
}

std::string format_support_table() {
  std::string s = "| a job with | recipe key | CPU | CUDA |\n|---|---|---|---|\n";
  for (const auto& rule : support_rules())
    s += "| " + rule.feature + " | " + (rule.key.empty() ? "—" : "`" + rule.key + "`") + " | " +
         rule.cpu + " | " + rule.cuda + " |\n";
  return s;
}

}  // namespace troupe::engine
