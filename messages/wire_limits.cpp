// wire::limits_for (wire_codec.hpp): the reader limits of a job, derived from its recipe.
#include <algorithm>
#include <cstdint>
#include <string>

#include "engine/model/gpt_model.hpp"
#include "engine/parallel/pipeline_layout.hpp"
#include "messages/wire_codec.hpp"

namespace troupe::messages::wire {

// Derivation (element counts are floats or int32 tokens, 4 bytes each):
//  - Tensors. The largest payload that legitimately crosses is the largest of: an activation or
//    its gradient, micro_batch x max(context, seq_len) x width; a micro-batch of tokens (smaller);
//    the tied wte (its gradient, tied_grad), padded_vocab x width; the largest parameter tensor of
//    any stage (stage_snapshot sends parameters one tensor each); with dp > 1, a ring chunk,
//    bounded by the largest gradient bucket (bucket_layers transformer blocks of a chunk, or the
//    head block ln_f + tied wte copy, or the embedding block wte + wpe, alignment gaps included:
//    engine::chunk_grad_blocks), whatever number of chunks the ring cuts it into. A checkpoint
//    chunk's sender must cut its pieces to fit the same bound.
//  - Lists. Plan actions: at most 3 per (virtual stage, micro-batch), so pp x v x m x 3 in all.
//    Parameter names: those of the rank with most parameters. Trace events per batch (an actor
//    flushes once per step): at most 8 per action of a rank (wait, compute, flow in, send, flow
//    out, receive...) over grad_accum passes plus v forward actions per evaluation batch, 2 per
//    gradient bucket, 16 more; the data loader's 2 per micro-batch of a step is smaller.
//    Shape dims and tensor pieces are far below these.
//  - Frame. The largest of: one tensor; a stage_snapshot of the rank with most parameter bytes
//    (plus 64 bytes of structure and the name per tensor; with checkpoints, its moments too and
//    64 bytes per piece); a trace batch at 256 bytes per event
//    (11 fields + two short strings); a plan at 16 bytes per action. Plus 64 KiB for the
//    envelope, segment table, far pointers and strings such as error messages.
limits limits_for(const engine::recipe& r) {
  const auto& m = r.model;
  const auto& par = r.parallel;
  const std::int64_t C = m.width;
  const std::int64_t T = std::max(m.context, r.batch.seq_len);
  const auto layout = engine::make_pipeline_layout(m, par.pp, par.virtual_stages, par.layer_split);

  std::int64_t largest_param = 0, largest_bucket = 0, rank_bytes = 0, rank_params = 0;
  for (int rank = 0; rank < par.pp; ++rank) {
    std::int64_t bytes = 0, count = 0;
    for (const auto& range : layout.rank_chunks(rank)) {
      const auto params = engine::chunk_parameter_layout(m, range);
      const auto at = [&params](const std::string& name) {
        return *std::find_if(params.begin(), params.end(),
                             [&name](const auto& p) { return p.name == name; });
      };
      const auto span = [&at](const std::string& first, const std::string& last) {
        return at(last).offset + at(last).numel - at(first).offset;
      };
      for (const auto& p : params) {
        largest_param = std::max(largest_param, p.numel);
        bytes += p.numel * 4 + 64 + static_cast<std::int64_t>(p.name.size());
        ++count;
      }
      const auto h = [](int l) { return "transformer.h." + std::to_string(l) + "."; };
      const int layers = range.last_layer - range.first_layer;
      const int per_bucket = std::min(par.bucket_layers, layers);
      for (int l = range.first_layer; l + per_bucket <= range.last_layer && per_bucket > 0; ++l)
        largest_bucket = std::max(
            largest_bucket, span(h(l) + "ln_1.weight", h(l + per_bucket - 1) + "mlp.c_proj.bias"));
      if (range.head)
        largest_bucket =
            std::max(largest_bucket, span("transformer.ln_f.weight", "transformer.ln_f.bias") +
                                         (range.embedding ? 0 : m.padded_vocab_size * C));
      if (range.embedding)
        largest_bucket =
            std::max(largest_bucket, span("transformer.wte.weight", "transformer.wpe.weight"));
    }
    rank_bytes = std::max(rank_bytes, bytes);
    rank_params = std::max(rank_params, count);
  }

  const std::int64_t tensor =
      std::max({std::int64_t{r.batch.micro_batch} * T * C, std::int64_t{m.padded_vocab_size} * C,
                largest_param, par.dp > 1 ? largest_bucket : 0});
  const std::int64_t v = par.virtual_stages, mb = par.micro_batches;
  const std::int64_t actions = std::int64_t{par.pp} * v * mb * 3;
  const std::int64_t buckets = m.layers + 2 * std::int64_t{par.pp} * v;
  const std::int64_t events =
      8 * (3 * v * mb * r.batch.grad_accum + v * r.eval_batches) + 2 * buckets + 16;
  // A checkpoint's snapshot (checkpoint.every > 0) carries the moments too: three times the
  // parameter bytes, and (ZeRO) pieces of at most one per parameter and bucket per role.
  const std::int64_t snapshot = r.checkpoint.every > 0 ? 3 * rank_bytes : rank_bytes;
  const std::int64_t pieces = r.checkpoint.every > 0 ? 3 * (rank_params + buckets) : rank_params;
  const std::int64_t list = std::max({actions, pieces, events, std::int64_t{64}});
  const std::int64_t frame =
      std::max({tensor * 4, snapshot + pieces * 64, events * 256, actions * 16}) +
      (std::int64_t{64} << 10);

  limits lim;
  lim.max_frame_bytes = static_cast<std::uint64_t>(frame);
  lim.max_tensor_elements = static_cast<std::uint64_t>(tensor);
  lim.max_list_elements = static_cast<std::uint32_t>(
      std::min<std::int64_t>(list, std::numeric_limits<std::uint32_t>::max()));
  lim.max_nesting = 16;
  return lim;
}

}  // namespace troupe::messages::wire
