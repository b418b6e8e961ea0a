// Checkpoints that cannot be lost or mixed up (engine/training/checkpoint.hpp): rotation counts
// only checkpoints that verify and leaves every directory that does not (corrupt, foreign, torn)
// in place, keeping the one just committed and the newest that verifies; the manifest is the
// whole truth (an unlisted file fails verification and is never loaded, a manifest edited by
// hand or a trainer state of another step fails); manifests of the previous version still
// verify and load.
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "engine/model/gpt_weights.hpp"
#include "engine/training/checkpoint.hpp"
#include "engine/training/checkpoint_internal.hpp"
#include "tests/data/temp_dir.hpp"

namespace troupe::engine {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

using temp_root = data::test::temp_dir;

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

// Values depending on (seed, role, index); with head_copy, the head's own copy of wte too.
checkpoint_tensors tensors(int seed, bool head_copy = false) {
  const auto c = model();
  checkpoint_tensors t;
  gpt_chunk whole(c, chunk_range::whole(c));
  named_tensors* maps[] = {&t.params, &t.exp_avg, &t.exp_avg_sq};
  for (int r = 0; r < 3; ++r)
    for (const auto& p : whole.parameters()) {
      auto& v = (*maps[r])[p.name];
      v.resize(static_cast<std::size_t>(p.numel));
      for (std::size_t i = 0; i < v.size(); ++i)
        v[i] = static_cast<float>(std::sin(seed * 5.0 + r + double(i) * 0.3));
      if (p.name == "transformer.wte.weight") {
        std::fill(v.begin() + c.vocab_size * c.width, v.end(), 0.0f);
        if (head_copy) (*maps[r])[checkpoint_head_copy] = std::vector<float>(v.size(), 7.0f);
      }
    }
  return t;
}

checkpoint_state state(int step) {
  checkpoint_state s;
  s.step = step;
  s.tokens = 64LL * step;
  s.schedule = "1f1b";
  s.recipe_text = "steps = 10\n";
  return s;
}

std::vector<checkpoint_left_alone> write(const fs::path& root, int step, int keep) {
  return write_checkpoint(root, model(), tensors(step), state(step), keep);
}

fs::path dir_of(const fs::path& root, int step) { return checkpoint_dir(root, step); }

void flip_bit(const fs::path& path, std::size_t at) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(static_cast<std::streamoff>(at));
  char c = 0;
  f.read(&c, 1);
  c = static_cast<char>(c ^ 0x10);
  f.seekp(static_cast<std::streamoff>(at));
  f.write(&c, 1);
}

json read_json(const fs::path& path) {
  std::ifstream in(path);
  return json::parse(in);
}
void write_json(const fs::path& path, const json& j) {
  std::ofstream(path, std::ios::trunc) << j.dump(1) << "\n";
}

// The manifest's checksum of itself made right again after an edit (as a careful forger would).
void reseal(const fs::path& dir) {
  auto m = read_json(dir / "manifest.json");
  m["checksum"] = ckpt_internal::manifest_checksum(m);
  write_json(dir / "manifest.json", m);
}

bool names(const std::vector<checkpoint_left_alone>& left, int step, const std::string& what) {
  for (const auto& l : left)
    if (l.dir.filename() == checkpoint_dir("", step).filename() &&
        l.problem.find(what) != std::string::npos)
      return true;
  return false;
}

TEST_CASE("rotation counts only checkpoints that verify and removes none that does not",
          "[checkpoint][rotation]") {
  temp_root root;
  const auto& r = root.path();
  write(r, 4, 1);
  std::vector<checkpoint_left_alone> left;
  SECTION("a corrupt newer checkpoint") {
    write(r, 12, 9);
    flip_bit(dir_of(r, 12) / "exp_avg.safetensors", 200);
    left = write(r, 8, 1);
    CHECK(names(left, 12, "exp_avg.safetensors: xxh64"));
    CHECK(fs::exists(dir_of(r, 12) / "exp_avg.safetensors"));
  }
  SECTION("a foreign directory named like a later step, with a manifest") {
    fs::copy(dir_of(r, 4), dir_of(r, 20));  // another step's checkpoint under a later name
    fs::create_directory(dir_of(r, 30));
    std::ofstream(dir_of(r, 30) / "manifest.json") << "{\"files\": []}\n";
    left = write(r, 8, 1);
    CHECK(names(left, 20, "the manifest is of step 4, its directory step-00000020"));
    CHECK(names(left, 30, "not a Troupe checkpoint manifest"));
    CHECK(fs::exists(dir_of(r, 20) / "model.safetensors"));
    CHECK(fs::exists(dir_of(r, 30) / "manifest.json"));
  }
  SECTION("torn directories, older and newer") {
    for (int step : {2, 16}) {
      fs::create_directory(dir_of(r, step));
      std::ofstream(dir_of(r, step) / "model.safetensors") << "half";
    }
    left = write(r, 8, 1);
    CHECK(names(left, 2, "missing (the checkpoint was not committed)"));
    CHECK(names(left, 16, "missing (the checkpoint was not committed)"));
    CHECK(fs::exists(dir_of(r, 2) / "model.safetensors"));
    CHECK(fs::exists(dir_of(r, 16) / "model.safetensors"));
  }
  // In every case: the one just committed stays and is what a resume takes; the older verified
  // one beyond keep = 1 is gone.
  CHECK(left.size() >= 1);
  CHECK(verify_checkpoint(dir_of(r, 8)).empty());
  CHECK_FALSE(fs::exists(dir_of(r, 4)));
  CHECK(find_checkpoint(r, {}) == dir_of(r, 8));
}

TEST_CASE("rotation keeps the newest that verifies besides the one just committed",
          "[checkpoint][rotation]") {
  temp_root root;
  const auto& r = root.path();
  write(r, 4, 9);
  write(r, 10, 9);  // a later checkpoint that verifies (a run resumed from an older one)
  const auto left = write(r, 8, 1);
  CHECK(left.empty());
  CHECK(verify_checkpoint(dir_of(r, 10)).empty());
  CHECK(verify_checkpoint(dir_of(r, 8)).empty());
  CHECK_FALSE(fs::exists(dir_of(r, 4)));
}

TEST_CASE("keep = 2 counts only checkpoints that verify", "[checkpoint][rotation]") {
  temp_root root;
  const auto& r = root.path();
  for (int step : {2, 4, 6}) write(r, step, 9);
  fs::resize_file(dir_of(r, 6) / "model.safetensors", 100);  // corrupt
  fs::copy(dir_of(r, 4), dir_of(r, 7));                      // foreign
  const auto left = write(r, 8, 2);
  CHECK(left.size() == 2);
  CHECK(names(left, 6, "model.safetensors: 100 bytes"));
  CHECK(names(left, 7, "its directory step-00000007"));
  // Verified: 8 and 4 are the newest two; 2 goes; 6 and 7 stay.
  CHECK(verify_checkpoint(dir_of(r, 4)).empty());
  CHECK_FALSE(fs::exists(dir_of(r, 2)));
  CHECK(fs::exists(dir_of(r, 6)));
  CHECK(fs::exists(dir_of(r, 7)));
  // A removal cut short (renamed, not yet removed) is finished by the next rotation.
  fs::create_directory(r / "step-00000003.removed");
  write(r, 9, 2);
  CHECK_FALSE(fs::exists(r / "step-00000003.removed"));
  CHECK_FALSE(fs::exists(dir_of(r, 4)));
  CHECK(fs::exists(dir_of(r, 6)));
}

TEST_CASE("a directory of the step being written is replaced, and named, when it does not verify",
          "[checkpoint][rotation]") {
  temp_root root;
  const auto& r = root.path();
  write(r, 8, 9);
  fs::resize_file(dir_of(r, 8) / "exp_avg.safetensors", 10);
  std::vector<std::string> said;
  write_checkpoint(r, model(), tensors(8), state(8), 1, {},
                   [&](const std::string& s) { said.push_back(s); });
  REQUIRE(said.size() == 1);
  CHECK_THAT(said[0], Catch::Contains("replacing ") && Catch::Contains("step-00000008") &&
                          Catch::Contains("exp_avg.safetensors: 10 bytes"));
  CHECK(verify_checkpoint(dir_of(r, 8)).empty());
}

TEST_CASE("the manifest is the whole truth", "[checkpoint][manifest]") {
  temp_root root;
  const auto& r = root.path();
  write(r, 4, 9);
  const auto dir = dir_of(r, 4);
  REQUIRE(verify_checkpoint(dir).empty());

  SECTION("an unlisted file fails verification and is never loaded") {
    // Another checkpoint's head copy of wte (all 7s), dropped in beside the listed files.
    write_checkpoint(r / "other", model(), tensors(1, true), state(4), 1);
    fs::copy_file(dir_of(r / "other", 4) / "lm_head.safetensors", dir / "lm_head.safetensors");
    const auto problem = verify_checkpoint(dir);
    CHECK_THAT(problem, Catch::Contains("lm_head.safetensors: not listed in the manifest"));
    CHECK_THROWS_WITH(find_checkpoint(dir, {}), Catch::Contains("lm_head.safetensors"));
    const auto c = model();
    const auto head = partition_layers(c, 2)[1];  // a head range without the embedding
    REQUIRE((head.head && !head.embedding));
    const auto flat = load_checkpoint_tensors(dir, "model", c, head);
    gpt_chunk st(c, head);
    const auto want = tensors(4).params.at("transformer.wte.weight");
    int checked = 0;
    for (const auto& p : st.parameters())
      if (p.name == "transformer.wte.weight")
        checked += std::equal(want.begin(), want.end(), flat.begin() + p.offset) ? 1 : -1;
    CHECK(checked == 1);  // the head's wte is the listed model's, not the dropped-in copy
  }
  SECTION("a manifest edited by hand") {
    auto m = read_json(dir / "manifest.json");
    m["step"] = 5;
    write_json(dir / "manifest.json", m);
    CHECK_THAT(verify_checkpoint(dir), Catch::Contains("manifest.json: its content hashes to") &&
                                           Catch::Contains("(edited or corrupt)"));
    reseal(dir);  // its checksum made to match: the step still disagrees with its directory
    CHECK_THAT(verify_checkpoint(dir),
               Catch::Contains("the manifest is of step 5, its directory step-00000004"));
  }
  SECTION("a trainer state of another step") {
    auto s = read_json(dir / "trainer_state.json");
    s["step"] = 6;
    write_json(dir / "trainer_state.json", s);
    CHECK_THAT(verify_checkpoint(dir),
               Catch::Contains("trainer_state.json: ") && Catch::Contains("the manifest says"));
    CHECK_THROWS_WITH(read_checkpoint_state(dir), Catch::Contains("trainer_state.json"));
    // Listed with its new size and checksum, the manifest resealed: the steps still disagree.
    auto m = read_json(dir / "manifest.json");
    const auto [bytes, hash] = ckpt_internal::size_and_hash(dir / "trainer_state.json");
    for (auto& f : m["files"])
      if (f["name"] == "trainer_state.json") {
        f["bytes"] = bytes;
        f["xxh64"] = ckpt_internal::hex64(hash);
      }
    write_json(dir / "manifest.json", m);
    reseal(dir);
    CHECK_THAT(verify_checkpoint(dir),
               Catch::Contains("trainer_state.json: step 6, the manifest says 4"));
  }
  CHECK(write(r, 8, 1).size() == 1);  // rotation does not count it, nor remove it
  CHECK(fs::exists(dir / "manifest.json"));
}

TEST_CASE("a checkpoint of the previous manifest version verifies and loads",
          "[checkpoint][manifest]") {
  temp_root root;
  const auto& r = root.path();
  write(r, 4, 9);
  const auto dir = dir_of(r, 4);
  auto m = read_json(dir / "manifest.json");
  REQUIRE(m.at("manifest_version") == 2);
  m.erase("manifest_version");  // as manifest version 1 wrote it: no checksum of itself
  m.erase("checksum");
  write_json(dir / "manifest.json", m);
  CHECK(verify_checkpoint(dir).empty());
  CHECK(find_checkpoint(r, {}) == dir);
  CHECK(read_checkpoint_state(dir).step == 4);
  const auto t = read_checkpoint_tensors(dir, model());
  CHECK(t.params == tensors(4).params);
  CHECK(t.exp_avg_sq == tensors(4).exp_avg_sq);
  // Its files are still checked against it.
  flip_bit(dir / "trainer_state.json", 10);
  CHECK_THAT(verify_checkpoint(dir), Catch::Contains("trainer_state.json: xxh64"));
}

}  // namespace
}  // namespace troupe::engine
