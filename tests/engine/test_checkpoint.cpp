// Checkpoints on disk (engine/training/checkpoint.hpp): a written checkpoint verifies and reads
// back exactly; the manifest commits it (a write stopped at any point leaves the previous one
// loadable and the torn one unloadable); flipped bits, truncated, missing or swapped files and
// unknown versions are named with their checksums and passed over for the previous one; the
// newest `keep` stay; the assembler puts pieces and tensor shards back together.
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "engine/model/gpt_weights.hpp"
#include "engine/training/checkpoint.hpp"

namespace troupe::engine {
namespace {

namespace fs = std::filesystem;

struct temp_root {
  fs::path path;
  temp_root() {
    char tmpl[] = "/tmp/troupe-ckpt-XXXXXX";
    path = ::mkdtemp(tmpl);
  }
  ~temp_root() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

gpt_config tiny_model() {
  gpt_config c;
  c.vocab_size = 61;
  c.padded_vocab_size = 64;
  c.context = 16;
  c.layers = 2;
  c.heads = 2;
  c.width = 16;
  return c;
}

// Whole-model tensors with values depending on (seed, role, name, index); padded vocabulary
// rows zero, as training keeps them.
checkpoint_tensors make_tensors(const gpt_config& c, int seed) {
  checkpoint_tensors t;
  gpt_chunk whole(c, chunk_range::whole(c));
  named_tensors* maps[] = {&t.params, &t.exp_avg, &t.exp_avg_sq};
  for (int r = 0; r < 3; ++r) {
    for (const auto& p : whole.parameters()) {
      auto& v = (*maps[r])[p.name];
      v.resize(static_cast<std::size_t>(p.numel));
      for (std::size_t i = 0; i < v.size(); ++i)
        v[i] = static_cast<float>(
                   std::sin(seed * 7.0 + r * 3.0 + double(i) * 0.37 + double(p.name.size()))) *
               (r == 2 ? 1e-3f : 1.0f);
      if (p.name == "transformer.wte.weight")
        std::fill(v.begin() + c.vocab_size * c.width, v.end(), 0.0f);
    }
  }
  return t;
}

checkpoint_state make_state(int step) {
  checkpoint_state s;
  s.step = step;
  s.tokens = 4096LL * step;
  s.micro_batches = 8LL * step;
  s.guard.scale = 32768;
  s.guard.good_steps = 3;
  s.guard.skips_in_a_row = 1;
  s.guard.loss = {{1.5, std::numeric_limits<double>::quiet_NaN(), 0.1 + 0.2}, 2, 3};
  s.guard.grad_norm = {{std::numeric_limits<double>::infinity(), -0.0, 1e-300}, 1, 2};
  s.schedule = "1f1b";
  s.mesh = {2, 3, 1, 2, 1, 4, 2, 5};
  s.recipe_text = "steps = 10\n[model]\nlayers = 2\n";
  s.overrides = {"optimizer.lr=3e-4"};
  return s;
}

bool same_bits(double a, double b) { return std::memcmp(&a, &b, sizeof a) == 0; }

void flip_bit(const fs::path& path, std::size_t at) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(static_cast<std::streamoff>(at));
  char c = 0;
  f.read(&c, 1);
  c = static_cast<char>(c ^ 0x10);
  f.seekp(static_cast<std::streamoff>(at));
  f.write(&c, 1);
}

std::vector<std::string> said;
auto recorder() {
  said.clear();
  return [](const std::string& s) { said.push_back(s); };
}

// Each tensor file loads as the stage of each range would hold it: `t`'s values.
void loads_at(const fs::path& dir, const gpt_config& c, const checkpoint_tensors& t,
              const std::vector<chunk_range>& ranges) {
  const named_tensors* maps[] = {&t.params, &t.exp_avg, &t.exp_avg_sq};
  const char* files[] = {"model", "exp_avg", "exp_avg_sq"};
  for (int r = 0; r < 3; ++r) {
    for (const auto& range : ranges) {
      const auto flat = load_checkpoint_tensors(dir, files[r], c, range);
      gpt_chunk st(c, range);
      for (const auto& p : st.parameters()) {
        INFO(files[r] << " " << p.name);
        const auto& want = maps[r]->at(p.name);
        CHECK(std::equal(want.begin(), want.end(), flat.begin() + p.offset));
      }
    }
  }
}

TEST_CASE("a checkpoint reads back exactly what was written", "[checkpoint]") {
  temp_root root;
  const auto c = tiny_model();
  const auto t = make_tensors(c, 1);
  auto s = make_state(12);
  s.model = c;
  write_checkpoint(root.path, c, t, s, 2);
  const auto dir = checkpoint_dir(root.path, 12);
  CHECK(dir.filename() == "step-00000012");
  CHECK(verify_checkpoint(dir).empty());
  CHECK(find_checkpoint(root.path, recorder()) == dir);
  CHECK(said.empty());

  const auto got = read_checkpoint_state(dir);
  CHECK(got.step == 12);
  CHECK(got.tokens == s.tokens);
  CHECK(got.micro_batches == s.micro_batches);
  CHECK(got.guard.scale == s.guard.scale);
  CHECK(got.guard.good_steps == 3);
  CHECK(got.guard.skips_in_a_row == 1);
  REQUIRE(got.guard.loss.values.size() == 3);
  for (std::size_t i = 0; i < 3; ++i) {
    CHECK(same_bits(got.guard.loss.values[i], s.guard.loss.values[i]));
    CHECK(same_bits(got.guard.grad_norm.values[i], s.guard.grad_norm.values[i]));
  }
  CHECK(got.guard.loss.next == 2);
  CHECK(got.guard.grad_norm.count == 2);
  CHECK(got.schedule == "1f1b");
  CHECK(got.mesh.dp == 3);
  CHECK(got.mesh.micro_batch == 5);
  CHECK(got.recipe_text == s.recipe_text);
  CHECK(got.overrides == s.overrides);
  REQUIRE(got.model.has_value());
  CHECK(std::tie(got.model->vocab_size, got.model->padded_vocab_size, got.model->layers,
                 got.model->width) ==
        std::tie(c.vocab_size, c.padded_vocab_size, c.layers, c.width));

  // Each tensor file is a Hugging Face GPT-2 file, loadable by any stage of any layout.
  check_hf_weights(c, dir / "model.safetensors");
  loads_at(dir, c, t, {chunk_range::whole(c), partition_layers(c, 2)[1]});
}

// Format 2 (a job of several processes): each stage writes its own part, the commit lists them.
// Stages of two pipeline ranges; the first range's moments split between two ZeRO replicas.
TEST_CASE("a checkpoint of parts reads back exactly, at any range", "[checkpoint]") {
  temp_root root;
  const auto c = tiny_model();
  const auto t = make_tensors(c, 4);
  const auto ranges = partition_layers(c, 2);
  using role = checkpoint_assembler::role;
  const named_tensors* maps[] = {&t.params, &t.exp_avg, &t.exp_avg_sq};
  auto write_parts = [&](int step, const std::string& skip) {
    const auto dir = prepare_checkpoint_dir(root.path, step);
    std::vector<checkpoint_file> parts;
    for (int rank = 0; rank < 2; ++rank) {
      const gpt_chunk st(c, ranges[static_cast<std::size_t>(rank)]);
      for (int lane = 0; lane < (rank == 0 ? 2 : 1); ++lane) {
        std::vector<checkpoint_piece> pieces;
        for (const auto& p : st.parameters()) {
          if (p.name == skip) continue;
          for (int r = 0; r < 3; ++r) {
            const auto& v = maps[r]->at(p.name);
            const auto n = static_cast<std::int64_t>(v.size());
            if (r == 0 && lane == 0) pieces.push_back({role::parameter, p.name, 0, 0, v.data(), n});
            if (r > 0 && rank == 0) {  // half each
              const std::int64_t at = lane == 0 ? 0 : n / 2, len = lane == 0 ? n / 2 : n - n / 2;
              pieces.push_back({static_cast<role>(r), p.name, 0, at, v.data() + at, len});
            } else if (r > 0) {
              pieces.push_back({static_cast<role>(r), p.name, 0, 0, v.data(), n});
            }
          }
        }
        const auto name = checkpoint_part_name(rank, lane);
        parts.push_back(write_checkpoint_part(dir, name, pieces));
        CHECK(parts.back().bytes == fs::file_size(dir / name));
      }
    }
    auto state = make_state(step);  // its recipe's model is the one saved: verify checks it
    state.recipe_text =
        "[model]\nvocab_size = 61\npadded_vocab_size = 64\ncontext = 16\nlayers = 2\n"
        "heads = 2\nwidth = 16\n[data]\nformat = \"shards\"\n[batch]\nseq_len = 16\n";
    state.overrides.clear();
    commit_checkpoint_parts(root.path, parts, state, 3);
    return dir;
  };
  const auto dir = write_parts(5, "");
  CHECK(fs::exists(dir / "part-000-001.safetensors"));
  CHECK(verify_checkpoint(dir).empty());
  CHECK(find_checkpoint(root.path, recorder()) == dir);
  CHECK(read_checkpoint_state(dir).step == 5);
  const auto whole = read_checkpoint_tensors(dir, c);
  CHECK(whole.params == t.params);
  CHECK(whole.exp_avg == t.exp_avg);
  CHECK(whole.exp_avg_sq == t.exp_avg_sq);
  loads_at(dir, c, t, {chunk_range::whole(c), ranges[0], ranges[1]});
  // A flipped bit in a part is named, with both checksums; the previous checkpoint is taken.
  const auto later = write_parts(6, "");
  flip_bit(later / "part-000-001.safetensors", 300);
  CHECK_THAT(verify_checkpoint(later), Catch::Contains("part-000-001.safetensors") &&
                                           Catch::Contains("xxh64") &&
                                           Catch::Contains("the manifest says"));
  CHECK(find_checkpoint(root.path, recorder()) == dir);
  // Parts that leave a tensor out: named by verify (from the parts' headers) and when loaded;
  // the previous checkpoint is taken.
  const auto partial = write_parts(7, "transformer.h.1.attn.c_proj.bias");
  CHECK_THAT(verify_checkpoint(partial),
             Catch::Contains("transformer.h.1.attn.c_proj.bias") && Catch::Contains("never sent"));
  CHECK_THROWS_WITH(
      read_checkpoint_tensors(partial, c),
      Catch::Contains("transformer.h.1.attn.c_proj.bias") && Catch::Contains("never sent"));
  CHECK(find_checkpoint(root.path, recorder()) == dir);
  // A piece at an offset past any tensor: refused, named.
  const auto hostile = prepare_checkpoint_dir(root.path, 9);
  const float one = 1;
  const auto bad = write_checkpoint_part(
      hostile, checkpoint_part_name(0, 0),
      {{role::parameter, "transformer.wte.weight", 0, 9223372036854775807LL, &one, 1}});
  commit_checkpoint_parts(root.path, {bad}, make_state(9), 5);
  CHECK_THAT(verify_checkpoint(hostile), Catch::Contains("outside"));
  CHECK_THROWS_WITH(read_checkpoint_tensors(hostile, c), Catch::Contains("outside"));
  // A part its stage says it wrote, which is not there, is not committed.
  CHECK_THROWS_WITH(
      commit_checkpoint_parts(root.path, {{"part-001-000.safetensors", 10, 0}}, make_state(10), 5),
      Catch::Contains("part-001-000.safetensors") && Catch::Contains("missing"));
  // A committed step is never written over; a commit stopped before its manifest is torn.
  CHECK_THROWS_WITH(prepare_checkpoint_dir(root.path, 5), Catch::Contains("there already"));
  const auto torn = prepare_checkpoint_dir(root.path, 8);
  CHECK_THROWS(
      commit_checkpoint_parts(root.path, {}, make_state(8), 5, [](const std::string& point) {
        if (point == "before manifest") throw std::runtime_error("stopped");
      }));
  CHECK_FALSE(fs::exists(torn / "manifest.json"));
  CHECK(find_checkpoint(root.path, recorder()) == dir);
}

TEST_CASE("the newest `keep` committed checkpoints stay", "[checkpoint]") {
  temp_root root;
  const auto c = tiny_model();
  for (int step : {2, 4, 6, 8})
    write_checkpoint(root.path, c, make_tensors(c, step), make_state(step), 2);
  const auto all = list_checkpoints(root.path);
  REQUIRE(all.size() == 2);
  CHECK(all[0].step == 8);
  CHECK(all[1].step == 6);
  CHECK(all[0].committed);
  // A verified checkpoint of the same step is never replaced.
  CHECK_THROWS_WITH(write_checkpoint(root.path, c, make_tensors(c, 9), make_state(8), 2),
                    Catch::Contains("step-00000008") && Catch::Contains("already"));
  CHECK(verify_checkpoint(checkpoint_dir(root.path, 8)).empty());
}

TEST_CASE("a write stopped at any point leaves the previous checkpoint loadable", "[checkpoint]") {
  const auto c = tiny_model();
  // Every point a write passes, from a complete write.
  std::vector<std::string> points;
  {
    temp_root root;
    write_checkpoint(root.path, c, make_tensors(c, 1), make_state(4), 3);
    write_checkpoint(root.path, c, make_tensors(c, 2), make_state(8), 1,
                     [&](const std::string& p) { points.push_back(p); });
  }
  REQUIRE(points.size() >= 6);
  for (std::size_t stop = 0; stop < points.size(); ++stop) {
    DYNAMIC_SECTION("stopped at " << points[stop]) {
      temp_root root;
      write_checkpoint(root.path, c, make_tensors(c, 1), make_state(4), 1);
      struct stopped {};
      std::size_t at = 0;
      try {
        write_checkpoint(root.path, c, make_tensors(c, 2), make_state(8), 1,
                         [&](const std::string&) {
                           if (at++ == stop) throw stopped{};
                         });
      } catch (const stopped&) {
      }
      const bool committed = points[stop] == "committed" || points[stop].starts_with("removed");
      const auto found = find_checkpoint(root.path, recorder());
      CHECK(found == checkpoint_dir(root.path, committed ? 8 : 4));
      CHECK(verify_checkpoint(found).empty());
      if (!committed) {  // the torn one is never loaded, and the next write replaces it
        CHECK_FALSE(verify_checkpoint(checkpoint_dir(root.path, 8)).empty());
        write_checkpoint(root.path, c, make_tensors(c, 2), make_state(8), 1);
        CHECK(find_checkpoint(root.path, recorder()) == checkpoint_dir(root.path, 8));
        CHECK(list_checkpoints(root.path).size() == 1);
      }
    }
  }
}

TEST_CASE("a damaged checkpoint is named and passed over for the previous one", "[checkpoint]") {
  const auto c = tiny_model();
  temp_root root;
  write_checkpoint(root.path, c, make_tensors(c, 1), make_state(4), 5);
  write_checkpoint(root.path, c, make_tensors(c, 2), make_state(8), 5);
  const auto newest = checkpoint_dir(root.path, 8), older = checkpoint_dir(root.path, 4);
  const auto model = newest / "model.safetensors";
  const auto keep = fs::temp_directory_path() / ("troupe-ckpt-keep-" + std::to_string(::getpid()));
  fs::copy_file(model, keep, fs::copy_options::overwrite_existing);
  auto restore = [&] { fs::copy_file(keep, model, fs::copy_options::overwrite_existing); };

  auto expect_fallback = [&](const std::string& what) {
    const std::string problem = verify_checkpoint(newest);
    INFO(problem);
    CHECK_THAT(problem, Catch::Contains(what));
    CHECK(problem.find('\n') == std::string::npos);
    CHECK(find_checkpoint(root.path, recorder()) == older);
    REQUIRE(said.size() == 2);
    CHECK_THAT(said[0], Catch::Contains("step-00000008") && Catch::Contains(what));
    CHECK_THAT(said[1], Catch::Contains("falling back to step-00000004"));
    CHECK_THROWS_WITH(find_checkpoint(newest, recorder()), Catch::Contains(what));
  };
  SECTION("a flipped bit") {
    flip_bit(model, fs::file_size(model) - 5);
    expect_fallback("model.safetensors: xxh64 ");
    CHECK_THAT(verify_checkpoint(newest), Catch::Contains("the manifest says"));
  }
  SECTION("a flipped bit in the header") {
    flip_bit(model, 20);
    expect_fallback("model.safetensors: xxh64");
  }
  SECTION("a truncated file") {
    fs::resize_file(model, fs::file_size(model) - 100);
    expect_fallback("model.safetensors: ");
    CHECK_THAT(verify_checkpoint(newest), Catch::Contains("truncated"));
  }
  SECTION("a missing file") {
    fs::remove(newest / "exp_avg_sq.safetensors");
    expect_fallback("exp_avg_sq.safetensors: missing");
  }
  SECTION("a file swapped in from another checkpoint") {
    fs::copy_file(older / "exp_avg.safetensors", newest / "exp_avg.safetensors",
                  fs::copy_options::overwrite_existing);
    expect_fallback("exp_avg.safetensors: xxh64");
  }
  SECTION("an unknown format version") {
    std::ifstream in(newest / "manifest.json");
    std::string text((std::istreambuf_iterator<char>(in)), {});
    const auto at = text.find("\"version\": 1");
    REQUIRE(at != std::string::npos);
    text.replace(at, 12, "\"version\": 7");
    std::ofstream(newest / "manifest.json", std::ios::trunc) << text;
    expect_fallback("format version 7 (this Troupe reads 1 and 2)");
  }
  SECTION("no manifest: torn") {
    fs::remove(newest / "manifest.json");
    CHECK(find_checkpoint(root.path, recorder()) == older);
    CHECK(said.empty());  // a torn write is not a damaged checkpoint
  }
  restore();
  fs::remove(keep);
  SECTION("nothing verifies") {
    for (auto step : {4, 8}) flip_bit(checkpoint_dir(root.path, step) / "model.safetensors", 100);
    CHECK_THROWS_WITH(find_checkpoint(root.path, recorder()),
                      Catch::Contains("no committed checkpoint") && Catch::Contains("verifies"));
  }
}

TEST_CASE("the assembler puts pieces and tensor shards back together", "[checkpoint]") {
  const auto c = tiny_model();
  const auto want = make_tensors(c, 3);
  using role = checkpoint_assembler::role;
  SECTION("pieces of every size, some twice, in any order") {
    checkpoint_assembler a(c, 1);
    std::mt19937 rng(7);
    for (const auto& [name, v] : want.exp_avg) {
      std::int64_t at = 0;
      const auto n = static_cast<std::int64_t>(v.size());
      while (at < n) {
        const std::int64_t len = std::min<std::int64_t>(n - at, 1 + rng() % 97);
        a.add(role::exp_avg, name, 0, at, v.data() + at, len);
        if (rng() % 3 == 0) a.add(role::exp_avg, name, 0, at, v.data() + at, len);
        at += len;
      }
    }
    for (const auto& [name, v] : want.params)
      a.add(role::parameter, name, 0, 0, v.data(), static_cast<std::int64_t>(v.size()));
    for (const auto& [name, v] : want.exp_avg_sq)
      a.add(role::exp_avg_sq, name, 0, 0, v.data(), static_cast<std::int64_t>(v.size()));
    const auto got = a.finish();
    CHECK(got.exp_avg == want.exp_avg);
    CHECK(got.params == want.params);
  }
  SECTION("a piece missing is named") {
    checkpoint_assembler a(c, 1);
    for (const auto& [name, v] : want.params) {
      const auto n = static_cast<std::int64_t>(v.size());
      a.add(role::parameter, name, 0, 0, v.data(),
            name == "transformer.h.1.mlp.c_fc.weight" ? n - 3 : n);
    }
    CHECK_THROWS_WITH(a.finish(), Catch::Contains("transformer.h.1.mlp.c_fc.weight") &&
                                      Catch::Contains("never sent"));
    CHECK_THROWS_WITH(a.add(role::parameter, "no.such", 0, 0, nullptr, 0),
                      Catch::Contains("no.such"));
  }
  SECTION("whole tensors taken, not copied; a piece or a second copy copied") {
    checkpoint_assembler a(c, 1);
    std::map<std::string, const float*> storage;
    for (const auto& [name, v] : want.params) {
      std::vector<float> whole = v;
      storage[name] = whole.data();
      a.add(role::parameter, name, 0, 0, std::move(whole));
      std::vector<float> again = v;  // the tied wte's second copy: equal values, copied in
      if (name == "transformer.wte.weight") a.add(role::parameter, name, 0, 0, std::move(again));
    }
    for (const auto& [name, v] : want.exp_avg) {
      const auto half = static_cast<std::ptrdiff_t>(v.size() / 2);
      a.add(role::exp_avg, name, 0, 0, std::vector<float>(v.begin(), v.begin() + half));
      a.add(role::exp_avg, name, 0, half, std::vector<float>(v.begin() + half, v.end()));
    }
    for (const auto& [name, v] : want.exp_avg_sq)
      a.add(role::exp_avg_sq, name, 0, 0, v.data(), static_cast<std::int64_t>(v.size()));
    const auto got = a.finish();
    CHECK(got.params == want.params);
    CHECK(got.exp_avg == want.exp_avg);
    CHECK(got.exp_avg_sq == want.exp_avg_sq);
    for (const auto& [name, v] : got.params) CHECK(v.data() == storage.at(name));
  }
  SECTION("tensor shards' slices") {
    const int tp = 2;
    checkpoint_assembler a(c, tp);
    for (int j = 0; j < tp; ++j) {
      for (const auto& p : chunk_parameter_layout(c, chunk_range::whole(c), {j, tp})) {
        const named_tensors* maps[] = {&want.params, &want.exp_avg, &want.exp_avg_sq};
        for (int r = 0; r < 3; ++r) {
          std::vector<float> slice(static_cast<std::size_t>(p.numel));
          take_shard(p, {j, tp}, maps[r]->at(p.name).data(), slice.data());
          a.add(static_cast<role>(r), p.name, j, 0, slice.data(), p.numel);
        }
      }
    }
    const auto got = a.finish();
    CHECK(got.params == want.params);
    CHECK(got.exp_avg == want.exp_avg);
    CHECK(got.exp_avg_sq == want.exp_avg_sq);
  }
}

}  // namespace
}  // namespace troupe::engine
