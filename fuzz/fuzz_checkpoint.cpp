// libFuzzer target: the checkpoint reader (engine/training/checkpoint.hpp) on hostile files. A
// valid checkpoint of a tiny model is written once in each format (whole-model files; a part per
// stage); each input replaces one of their files (the first byte picks which, the rest is the
// content), then the checkpoint is verified, its trainer state read and its tensors loaded as a
// stage would and put together whole, and the replaced file is also parsed directly, past the
// checksums (the trainer state parsed on its own too). Every input must end in a refusal (an
// exception) or a load; anything else (a crash, a sanitizer report) is a finding. With
// FUZZ_WRITE_SEEDS=DIR it writes each file of the valid checkpoint, behind its selector byte, into
// DIR as the seed corpus.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "engine/model/gpt_weights.hpp"
#include "engine/model/safetensors.hpp"
#include "engine/training/checkpoint.hpp"

namespace {

namespace fs = std::filesystem;
using namespace troupe::engine;

struct target {
  bool parts;  // the checkpoint of format 2
  const char* name;
};
const target files[] = {{false, "manifest.json"},          {false, "trainer_state.json"},
                        {false, "model.safetensors"},      {false, "exp_avg.safetensors"},
                        {false, "lm_head.safetensors"},    {true, "manifest.json"},
                        {true, "trainer_state.json"},      {true, "part-000-000.safetensors"},
                        {true, "part-000-001.safetensors"}};

gpt_config model() {
  gpt_config c;
  c.vocab_size = 30;
  c.padded_vocab_size = 32;
  c.context = 8;
  c.layers = 2;
  c.heads = 2;
  c.width = 8;
  return c;
}

struct fixture {
  fs::path root, dir, pristine, parts_dir, parts_pristine;
  fixture() {
    char tmpl[] = "/tmp/troupe-fuzz-XXXXXX";
    root = ::mkdtemp(tmpl);
    const auto c = model();
    checkpoint_tensors t;
    gpt_chunk whole(c, chunk_range::whole(c));
    named_tensors* maps[] = {&t.params, &t.exp_avg, &t.exp_avg_sq};
    for (auto* m : maps)
      for (const auto& p : whole.parameters()) {
        (*m)[p.name].assign(static_cast<std::size_t>(p.numel), 0.25f);
        if (p.name == "transformer.wte.weight") (*m)[checkpoint_head_copy] = (*m)[p.name];
      }
    checkpoint_state s;
    s.step = 3;
    s.recipe_text =  // the model saved, as verifying format 2 reads it
        "[model]\nvocab_size = 30\npadded_vocab_size = 32\ncontext = 8\nlayers = 2\nheads = 2\n"
        "width = 8\n[data]\nformat = \"shards\"\n[batch]\nseq_len = 8\n";
    s.guard.loss.values.assign(4, 1.0);
    s.guard.grad_norm.values.assign(4, 1.0);
    write_checkpoint(root / "pristine", c, t, s, 1);
    pristine = checkpoint_dir(root / "pristine", 3);
    dir = checkpoint_dir(root / "work", 3);
    // Format 2: two stages' parts, the second holding the moments' second halves.
    parts_pristine = prepare_checkpoint_dir(root / "pristine_parts", 3);
    std::vector<checkpoint_piece> first, second;
    using role = checkpoint_assembler::role;
    for (const auto& [name, v] : t.params) {
      const auto n = static_cast<std::int64_t>(v.size()), half = n / 2;
      first.push_back({role::parameter, name, 0, 0, v.data(), n});
      for (const auto r : {role::exp_avg, role::exp_avg_sq}) {
        const auto& m = r == role::exp_avg ? t.exp_avg.at(name) : t.exp_avg_sq.at(name);
        first.push_back({r, name, 0, 0, m.data(), half});
        second.push_back({r, name, 0, half, m.data() + half, n - half});
      }
    }
    commit_checkpoint_parts(
        root / "pristine_parts",
        {write_checkpoint_part(parts_pristine, "part-000-000.safetensors", first),
         write_checkpoint_part(parts_pristine, "part-000-001.safetensors", second)},
        s, 1);
    parts_dir = checkpoint_dir(root / "work_parts", 3);
  }
  ~fixture() {
    std::error_code ec;
    fs::remove_all(root, ec);
  }
};

fixture& the_fixture() {
  static fixture f;
  return f;
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  if (const char* dir = std::getenv("FUZZ_WRITE_SEEDS")) {
    auto& f = the_fixture();
    for (std::size_t i = 0; i < sizeof files / sizeof *files; ++i) {
      std::ifstream in((files[i].parts ? f.parts_pristine : f.pristine) / files[i].name,
                       std::ios::binary);
      const std::string text((std::istreambuf_iterator<char>(in)), {});
      std::ofstream out(std::string(dir) + "/seed-" + std::to_string(i), std::ios::binary);
      out.put(static_cast<char>(i));
      out << text;
    }
    std::exit(0);
  }
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 1) return 0;
  auto& f = the_fixture();
  std::error_code ec;
  const auto& pick = files[data[0] % (sizeof files / sizeof *files)];
  const fs::path dir = pick.parts ? f.parts_dir : f.dir;
  const fs::path pristine = pick.parts ? f.parts_pristine : f.pristine;
  if (!fs::exists(dir / "manifest.json", ec)) {
    fs::create_directories(dir.parent_path(), ec);
    fs::copy(pristine, dir, fs::copy_options::recursive, ec);
  }
  const std::string name = pick.name;
  struct restore {  // the pristine file back for the next input
    const fs::path &from, &to;
    const std::string& name;
    ~restore() {
      std::error_code ec;
      fs::copy_file(from / name, to / name, fs::copy_options::overwrite_existing, ec);
    }
  } restore_after{pristine, dir, name};
  std::ofstream(dir / name, std::ios::binary | std::ios::trunc)
      .write(reinterpret_cast<const char*>(data + 1), static_cast<std::streamsize>(size - 1));
  const auto c = model();
  auto attempt = [](auto&& fn) {
    try {
      fn();
    } catch (const std::exception&) {
    }
  };
  attempt([&] { (void)verify_checkpoint(dir); });
  attempt([&] { (void)find_checkpoint(dir.parent_path(), {}); });
  attempt([&] { (void)read_checkpoint_state(dir); });
  attempt([&] {  // the trainer state past its checksum
    (void)parse_checkpoint_state(std::string(reinterpret_cast<const char*>(data + 1), size - 1));
  });
  attempt([&] { check_hf_weights(c, dir / name); });
  attempt([&] { check_checkpoint_model(dir, c); });
  attempt([&] { safetensors_file file(dir / name); });
  attempt([&] { (void)read_checkpoint_tensors(dir, c); });
  for (const char* which : {"model", "exp_avg"})
    for (const auto& range : {chunk_range::whole(c), partition_layers(c, 2)[1]})
      attempt([&] { (void)load_checkpoint_tensors(dir, which, c, range, {0, 1}); });
  return 0;
}
