// libFuzzer target: the wire decoder (messages/wire_codec.hpp) on arbitrary frames. Every input
// must either decode or be refused with wire::wire_error; anything else (a crash, a sanitizer
// report, another exception) is a finding. Limits are a job's (a small pipeline's).
// With FUZZ_WRITE_SEEDS=DIR it writes frames of valid messages into DIR as the seed corpus.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>

#include "engine/training/recipe.hpp"
#include "messages/aligned_buffer.hpp"
#include "messages/wire_codec.hpp"

namespace {

const troupe::messages::wire::limits& job_limits() {
  static const auto lim = [] {
    troupe::engine::recipe r;
    r.model.vocab_size = r.model.padded_vocab_size = 256;
    r.model.layers = 4;
    r.model.width = 64;
    r.model.heads = 4;
    r.model.context = 64;
    r.parallel.pp = 2;
    r.parallel.dp = 2;
    r.parallel.micro_batches = 4;
    r.checkpoint.every = 10;
    return troupe::messages::wire::limits_for(r);
  }();
  return lim;
}

void write_seeds(const std::string& dir) {
  namespace m = troupe::messages;
  const auto floats = [](std::size_t n) {
    return std::make_shared<m::payload<float>>(std::vector<float>(n, 0.5f));
  };
  std::vector<m::wire::body> bodies = {
      m::heartbeat{},
      m::tied_grad{3, 1, floats(16)},
      m::snapshot_request{7, true},
      m::stage_snapshot{1,
                        0,
                        {{"transformer.wpe.weight", std::vector<float>(8, 1.0f)}},
                        {{m::tensor_role::exp_avg, "transformer.wte.weight", 4, {1, 2, 3}}}},
      m::error_report{2, "a peer was lost"},
      m::ring_chunk{1, 0, 2, 1, 0, 1, floats(9), 0},
      m::tensor_exchange{4, 1, m::tensor_exchange::op::sum_f32, floats(8), ""},
  };
  int i = 0;
  for (const auto& b : bodies) {
    const auto f = m::wire::encode({5, 1, 0, false, b});
    std::ofstream out(dir + "/seed-" + std::to_string(i++), std::ios::binary);
    for (const auto& [p, n] : f.iov) out.write(static_cast<const char*>(p), static_cast<long>(n));
  }
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  if (const char* dir = std::getenv("FUZZ_WRITE_SEEDS")) {
    write_seeds(dir);
    std::exit(0);
  }
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  namespace wire = troupe::messages::wire;
  auto buf = troupe::messages::aligned_buffer::make(size);
  if (size) std::memcpy(buf->data(), data, size);
  try {
    const auto e = wire::decode(buf, size, job_limits());
    (void)wire::kind_name(e.message);
  } catch (const wire::wire_error&) {
  }
  return 0;
}
