// Safetensors and Hugging Face GPT-2 weights: write/read round trips (F32, I32, BF16,
// metadata), corrupt files refused with the file name, save/load round trip with a padded
// vocabulary, HF name handling (prefix, attn.bias buffers, missing/extra/misshapen tensors,
// tied lm_head), the stage left untouched after a failed load, Conv1D orientation, and
// pipeline stages loading their slice of a whole-model file.
#include <catch2/catch.hpp>

#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>

#include "engine/model/gpt_weights.hpp"
#include "engine/model/safetensors.hpp"
#include "tests/engine/engine_test_util.hpp"

using namespace troupe::engine;
using namespace troupe::engine::test;
namespace kernels = troupe::kernels;
namespace fs = std::filesystem;

namespace {

std::string read_bytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// A safetensors file from a raw header text and data bytes.
std::string raw_safetensors(const std::string& header, const std::string& data) {
  std::string out(8, '\0');
  const std::uint64_t n = header.size();
  std::memcpy(out.data(), &n, 8);
  return out + header + data;
}

gpt_chunk make_model(const gpt_config& cfg, std::uint64_t seed) {
  gpt_chunk s(cfg, chunk_range::whole(cfg));
  s.init_gpt2(seed);
  randomize_params(s, seed, 0.0f);  // padded rows stay 0 (they are not saved)
  return s;
}

}  // namespace

TEST_CASE("safetensors round trip: F32, I32, metadata, layout", "[weights][safetensors]") {
  temp_dir dir;
  const auto path = dir / "t.safetensors";
  const std::vector<float> a = {1.5f, -2.0f, 3.25f, 0.0f, 1e-30f, -7.0f};
  const std::vector<std::int32_t> b = {7, -1, 2147483647, -2147483647 - 1};
  const std::vector<float> empty;
  write_safetensors(path,
                    {{"alpha", {"F32", {2, 3}, a.data(), a.size() * 4}},
                     {"beta", {"I32", {4}, b.data(), b.size() * 4}},
                     {"gamma", {"F32", {0, 5}, empty.data(), 0}}},
                    {{"format", "pt"}, {"note", "hello"}});
  CHECK_FALSE(fs::exists(dir / "t.safetensors.tmp"));

  // Layout: 8-byte length, JSON header padded so the data starts 8-byte aligned.
  const std::string bytes = read_bytes(path);
  std::uint64_t header_len = 0;
  std::memcpy(&header_len, bytes.data(), 8);
  CHECK((8 + header_len) % 8 == 0);
  CHECK(bytes.size() == 8 + header_len + a.size() * 4 + b.size() * 4);
  const auto header = nlohmann::json::parse(bytes.substr(8, header_len));
  CHECK(header["alpha"]["dtype"] == "F32");
  CHECK(header["__metadata__"]["note"] == "hello");

  const safetensors_file f(path);
  CHECK(f.path() == path);
  CHECK(f.entries().size() == 3);
  CHECK(f.contains("alpha"));
  CHECK_FALSE(f.contains("__metadata__"));
  CHECK(f.metadata() == std::map<std::string, std::string>{{"format", "pt"}, {"note", "hello"}});
  CHECK(f.at("alpha").dtype == "F32");
  CHECK(f.at("alpha").shape == kernels::shape_t{2, 3});
  CHECK(f.at("alpha").nbytes == 24);
  CHECK(f.at("beta").dtype == "I32");
  const auto ta = f.read_f32("alpha");
  CHECK(ta.shape() == kernels::shape_t{2, 3});
  CHECK(tensor_values(ta) == a);
  CHECK(f.read_i32("beta") == b);
  CHECK(f.read_f32("gamma").numel() == 0);
  // Wrong-kind reads and unknown names are refused naming the tensor.
  CHECK_THROWS_WITH(f.read_f32("beta"), Catch::Contains("beta") && Catch::Contains("I32"));
  CHECK_THROWS_WITH(f.read_i32("alpha"), Catch::Contains("alpha"));
  CHECK_THROWS_WITH(f.at("delta"), Catch::Contains("delta") && Catch::Contains("t.safetensors"));

  // Rewriting replaces the file atomically.
  write_safetensors(path, {{"only", {"F32", {1}, a.data(), 4}}});
  const safetensors_file g(path);
  CHECK(g.entries().size() == 1);
  CHECK(g.metadata().empty());

  // A writer refuses a size that does not match shape and dtype.
  CHECK_THROWS_WITH(write_safetensors(dir / "bad.safetensors", {{"x", {"F32", {3}, a.data(), 8}}}),
                    Catch::Contains("x"));
  CHECK_FALSE(fs::exists(dir / "bad.safetensors"));
}

TEST_CASE("safetensors BF16 and F16 are converted to f32", "[weights][safetensors]") {
  temp_dir dir;
  const std::vector<float> v = {1.0f, -0.5f, 3.140625f, 65504.0f};
  std::vector<std::uint16_t> bf(v.size()), hf(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) {
    bf[i] = kernels::f32_to_bf16(v[i]);
    hf[i] = kernels::f32_to_f16(v[i]);
  }
  write_safetensors(dir / "h.safetensors",
                    {{"bf", {"BF16", {4}, bf.data(), 8}}, {"hf", {"F16", {2, 2}, hf.data(), 8}}});
  const safetensors_file f(dir / "h.safetensors");
  const auto tb = tensor_values(f.read_f32("bf"));
  const auto th = tensor_values(f.read_f32("hf"));
  for (std::size_t i = 0; i < v.size(); ++i) {
    CHECK(tb[i] == kernels::bf16_to_f32(bf[i]));
    CHECK(th[i] == v[i]);  // exactly representable in f16
  }
  CHECK(tb[0] == 1.0f);
  CHECK(tb[1] == -0.5f);
}

TEST_CASE("corrupt safetensors files are refused naming the file", "[weights][safetensors]") {
  temp_dir dir;
  const std::vector<float> a = {1, 2, 3, 4};
  const auto good = dir / "good.safetensors";
  write_safetensors(good, {{"w", {"F32", {4}, a.data(), 16}}});
  const std::string bytes = read_bytes(good);

  auto expect_refused = [&](const std::string& name, const std::string& content,
                            const std::string& also) {
    const auto p = dir / name;
    write_file(p, content);
    INFO("case " << name);
    const std::string msg = error_message<std::runtime_error>([&] { safetensors_file f(p); });
    CHECK_THAT(msg, Catch::Contains(p.string()));
    if (!also.empty()) CHECK_THAT(msg, Catch::Contains(also));
    CHECK(msg.find('\n') == std::string::npos);
  };

  {
    std::string huge = bytes;
    const std::uint64_t len = 1ull << 40;
    std::memcpy(huge.data(), &len, 8);
    expect_refused("huge-header-length.safetensors", huge, "header length");
  }
  {
    std::string past = bytes;
    std::uint64_t len = 0;
    std::memcpy(&len, past.data(), 8);
    len = bytes.size() - 8 + 1;  // one byte beyond the file
    std::memcpy(past.data(), &len, 8);
    expect_refused("header-past-end.safetensors", past, "header length");
  }
  expect_refused("short.safetensors", std::string(5, '\0'), "");
  expect_refused("bad-json.safetensors", raw_safetensors("{\"w\": {\"dtype\": \"F32\",,}", ""),
                 "JSON");
  expect_refused("not-object.safetensors", raw_safetensors("[1, 2, 3]", ""), "");
  expect_refused(
      "offsets-beyond.safetensors",
      raw_safetensors(R"({"w":{"dtype":"F32","shape":[4],"data_offsets":[0,1000]}})", "0123"), "w");
  expect_refused(
      "offsets-reversed.safetensors",
      raw_safetensors(R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[4,0]}})", "01234567"),
      "w");
  expect_refused(
      "size-mismatch.safetensors",
      raw_safetensors(R"({"w":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", "01234567"),
      "w");
  expect_refused("unknown-dtype.safetensors",
                 raw_safetensors(R"({"w":{"dtype":"Q4","shape":[1],"data_offsets":[0,1]}})", "0"),
                 "Q4");
  expect_refused("missing-field.safetensors",
                 raw_safetensors(R"({"w":{"dtype":"F32","shape":[1]}})", "0123"), "w");

  const auto missing = dir / "does-not-exist.safetensors";
  CHECK_THROWS_WITH(safetensors_file(missing), Catch::Contains(missing.string()));
}

TEST_CASE("a negative dimension in a safetensors header is refused naming the file",
          "[weights][safetensors]") {
  // safetensors.hpp: "every offset, size and dtype is validated and any error names the file
  // and tensor".
  temp_dir dir;
  const auto p = dir / "negative-dim.safetensors";
  write_file(p,
             raw_safetensors(R"({"w":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})", "0123"));
  const std::string msg = error_message<std::runtime_error>([&] { safetensors_file f(p); });
  CHECK_THAT(msg, Catch::Contains(p.string()) && Catch::Contains("w"));
}

TEST_CASE("save_hf_weights then load_hf_weights reproduces the parameters", "[weights]") {
  temp_dir dir;
  const gpt_config cfg = tiny_config(2);  // vocab 11 padded to 16
  gpt_chunk src = make_model(cfg, 5);
  const auto path = dir / "model.safetensors";
  save_hf_weights(src, path);
  CHECK_FALSE(fs::exists(dir / "model.safetensors.tmp"));

  // The file is in Hugging Face layout.
  {
    const safetensors_file f(path);
    CHECK(f.metadata().at("format") == "pt");
    CHECK(f.entries().size() == src.parameters().size());
    CHECK(f.at("transformer.wte.weight").shape == kernels::shape_t{11, 8});
    CHECK(f.at("transformer.h.0.attn.c_attn.weight").shape == kernels::shape_t{8, 24});
    CHECK(f.at("transformer.h.1.mlp.c_fc.weight").shape == kernels::shape_t{8, 32});
    CHECK(f.at("transformer.h.1.mlp.c_proj.weight").shape == kernels::shape_t{32, 8});
    CHECK(f.at("transformer.ln_f.bias").shape == kernels::shape_t{8});
    const auto expect = hf_from_chunk(src);
    for (const auto& [name, t] : expect) {
      INFO(name);
      CHECK(tensor_values(f.read_f32(name)) == t.values);
    }
  }

  gpt_chunk dst(cfg, chunk_range::whole(cfg));
  dst.init_gpt2(77);
  // Garbage in the padded rows of the destination: loading zeroes them.
  auto wte = dst.param("transformer.wte.weight");
  for (std::int64_t i = std::int64_t{cfg.vocab_size} * cfg.width; i < wte.numel(); ++i) {
    wte.f32()[i] = 9.0f;
  }
  load_hf_weights(dst, path);
  for (const auto& p : src.parameters()) {
    INFO(p.name);
    CHECK(tensor_values(dst.param(p.name)) == tensor_values(src.param(p.name)));
  }
  CHECK_NOTHROW(check_hf_weights(cfg, path));
}

TEST_CASE("Hugging Face names: prefix optional, attention buffers ignored", "[weights][hf]") {
  temp_dir dir;
  const gpt_config cfg = tiny_config(2);
  gpt_chunk src = make_model(cfg, 6);

  SECTION("without the transformer. prefix") {
    write_hf(dir / "noprefix.safetensors", hf_from_chunk(src, false));
    gpt_chunk dst(cfg, chunk_range::whole(cfg));
    load_hf_weights(dst, dir / "noprefix.safetensors");
    CHECK(snapshot_params(dst) == snapshot_params(src));
  }
  SECTION("with h.N.attn.bias and attn.masked_bias buffers") {
    auto t = hf_from_chunk(src, false);
    t["h.0.attn.bias"] = {{1, 1, 8, 8}, std::vector<float>(64, 1.0f)};
    t["h.1.attn.bias"] = {{1, 1, 8, 8}, std::vector<float>(64, 1.0f)};
    t["h.1.attn.masked_bias"] = {{}, {-1e4f}};
    write_hf(dir / "buffers.safetensors", t);
    gpt_chunk dst(cfg, chunk_range::whole(cfg));
    load_hf_weights(dst, dir / "buffers.safetensors");
    CHECK(snapshot_params(dst) == snapshot_params(src));
    CHECK_NOTHROW(check_hf_weights(cfg, dir / "buffers.safetensors"));
  }
  SECTION("tied lm_head.weight equal to wte is accepted") {
    auto t = hf_from_chunk(src);
    t["lm_head.weight"] = t.at("transformer.wte.weight");
    write_hf(dir / "tied.safetensors", t);
    gpt_chunk dst(cfg, chunk_range::whole(cfg));
    load_hf_weights(dst, dir / "tied.safetensors");
    CHECK(snapshot_params(dst) == snapshot_params(src));
  }
  SECTION("bf16 input is converted") {
    write_hf(dir / "bf16.safetensors", hf_from_chunk(src), true);
    gpt_chunk dst(cfg, chunk_range::whole(cfg));
    load_hf_weights(dst, dir / "bf16.safetensors");
    for (const auto& p : src.parameters()) {
      const auto want = tensor_values(src.param(p.name));
      const auto got = tensor_values(dst.param(p.name));
      INFO(p.name);
      REQUIRE(want.size() == got.size());
      for (std::size_t i = 0; i < want.size(); ++i) {
        REQUIRE(got[i] == kernels::bf16_to_f32(kernels::f32_to_bf16(want[i])));
      }
    }
  }
}

TEST_CASE("bad Hugging Face files are refused naming the tensor; the stage is untouched",
          "[weights][hf]") {
  temp_dir dir;
  const gpt_config cfg = tiny_config(2);
  gpt_chunk src = make_model(cfg, 7);
  gpt_chunk dst(cfg, chunk_range::whole(cfg));
  dst.init_gpt2(123);
  const auto before = snapshot_params(dst);

  auto refused = [&](const std::string& file, const hf_tensors& t) {
    const auto p = dir / file;
    write_hf(p, t);
    const std::string msg = error_message([&] { load_hf_weights(dst, p); });
    CHECK_THAT(msg, Catch::Contains(p.string()));
    CHECK(msg.find('\n') == std::string::npos);
    CHECK(snapshot_params(dst) == before);
    // check_hf_weights refuses the same file with the same message.
    CHECK(error_message([&] { check_hf_weights(cfg, p); }) == msg);
    return msg;
  };

  SECTION("a missing tensor is named") {
    auto t = hf_from_chunk(src);
    t.erase("transformer.h.1.mlp.c_proj.bias");
    CHECK_THAT(refused("missing.safetensors", t),
               Catch::Contains("transformer.h.1.mlp.c_proj.bias"));
  }
  SECTION("an extra unknown tensor is named") {
    auto t = hf_from_chunk(src);
    t["transformer.h.0.attn.rotary.weight"] = {{2}, {1, 2}};
    CHECK_THAT(refused("extra.safetensors", t),
               Catch::Contains("transformer.h.0.attn.rotary.weight"));
  }
  SECTION("a layer the model does not have is named") {
    auto t = hf_from_chunk(src);
    t["transformer.h.2.ln_1.weight"] = {{8}, std::vector<float>(8, 1.0f)};
    CHECK_THAT(refused("extra-layer.safetensors", t),
               Catch::Contains("transformer.h.2.ln_1.weight"));
  }
  SECTION("a wrongly shaped tensor is named with both shapes") {
    auto t = hf_from_chunk(src);
    // c_attn stored [out, in] instead of Conv1D's [in, out].
    t["transformer.h.0.attn.c_attn.weight"].shape = {24, 8};
    CHECK_THAT(refused("shape.safetensors", t),
               Catch::Contains("transformer.h.0.attn.c_attn.weight") &&
                   Catch::Contains("[24, 8]") && Catch::Contains("[8, 24]"));
  }
  SECTION("a padded wte is refused (files hold the real vocabulary only)") {
    auto t = hf_from_chunk(src);
    auto& wte = t["transformer.wte.weight"];
    wte.shape = {16, 8};
    wte.values.resize(16 * 8, 0.0f);
    CHECK_THAT(refused("padded.safetensors", t), Catch::Contains("transformer.wte.weight") &&
                                                     Catch::Contains("[16, 8]") &&
                                                     Catch::Contains("[11, 8]"));
  }
  SECTION("an lm_head.weight that differs from wte is refused") {
    auto t = hf_from_chunk(src);
    t["lm_head.weight"] = t.at("transformer.wte.weight");
    t["lm_head.weight"].values[3] += 1.0f;
    const auto p = dir / "untied.safetensors";
    write_hf(p, t);
    const std::string msg = error_message([&] { load_hf_weights(dst, p); });
    CHECK_THAT(msg, Catch::Contains(p.string()) && Catch::Contains("lm_head.weight"));
    CHECK(snapshot_params(dst) == before);
  }
  SECTION("a tensor present with and without prefix is refused") {
    auto t = hf_from_chunk(src);
    t["ln_f.bias"] = t.at("transformer.ln_f.bias");
    CHECK_THAT(refused("twice.safetensors", t), Catch::Contains("ln_f.bias"));
  }
  SECTION("an integer tensor is refused naming it") {
    auto t = hf_from_chunk(src);
    t.erase("transformer.ln_f.bias");
    const auto p = dir / "int.safetensors";
    std::map<std::string, safetensors_tensor> out;
    for (const auto& [name, v] : t) {
      out[name] = safetensors_tensor{"F32", v.shape, v.values.data(), v.values.size() * 4};
    }
    const std::vector<std::int32_t> ints(8, 1);
    out["transformer.ln_f.bias"] = safetensors_tensor{"I32", {8}, ints.data(), 32};
    write_safetensors(p, out);
    const std::string msg = error_message([&] { load_hf_weights(dst, p); });
    CHECK_THAT(msg, Catch::Contains("transformer.ln_f.bias") && Catch::Contains("I32"));
    CHECK(snapshot_params(dst) == before);
  }
  SECTION("a file for another model size is refused") {
    gpt_config other = cfg;
    other.context = 16;
    gpt_chunk o(other, chunk_range::whole(other));
    o.init_gpt2(1);
    const auto p = dir / "other.safetensors";
    save_hf_weights(o, p);
    const std::string msg = error_message([&] { load_hf_weights(dst, p); });
    CHECK_THAT(msg, Catch::Contains("transformer.wpe.weight"));
    CHECK(snapshot_params(dst) == before);
  }
  SECTION("a missing file is refused naming it") {
    const auto p = dir / "nope.safetensors";
    CHECK_THAT(error_message([&] { load_hf_weights(dst, p); }), Catch::Contains(p.string()));
    CHECK(snapshot_params(dst) == before);
  }
}

TEST_CASE("Conv1D weights are transposed on import", "[weights][hf]") {
  temp_dir dir;
  const gpt_config cfg = tiny_config(1);
  const std::int64_t C = cfg.width;
  gpt_chunk src = make_model(cfg, 8);
  auto t = hf_from_chunk(src);
  // c_attn.weight in the file: [C, 3C], value at [i][j] = 1000 * i + j.
  auto& w = t["transformer.h.0.attn.c_attn.weight"];
  REQUIRE(w.shape == kernels::shape_t{C, 3 * C});
  for (std::int64_t i = 0; i < C; ++i) {
    for (std::int64_t j = 0; j < 3 * C; ++j)
      w.values[std::size_t(i * 3 * C + j)] = float(1000 * i + j);
  }
  // mlp.c_proj.weight in the file: [4C, C], value at [i][j] = -(100 * i + j).
  auto& m = t["transformer.h.0.mlp.c_proj.weight"];
  REQUIRE(m.shape == kernels::shape_t{4 * C, C});
  for (std::int64_t i = 0; i < 4 * C; ++i) {
    for (std::int64_t j = 0; j < C; ++j) m.values[std::size_t(i * C + j)] = -float(100 * i + j);
  }
  write_hf(dir / "conv.safetensors", t);
  gpt_chunk dst(cfg, chunk_range::whole(cfg));
  load_hf_weights(dst, dir / "conv.safetensors");

  const auto p = dst.param("transformer.h.0.attn.c_attn.weight");
  REQUIRE(p.shape() == kernels::shape_t{3 * C, C});
  for (std::int64_t o = 0; o < 3 * C; ++o) {
    for (std::int64_t i = 0; i < C; ++i) {
      INFO("c_attn [" << o << ", " << i << "]");
      REQUIRE(p.f32()[o * C + i] == float(1000 * i + o));
    }
  }
  const auto q = dst.param("transformer.h.0.mlp.c_proj.weight");
  REQUIRE(q.shape() == kernels::shape_t{C, 4 * C});
  for (std::int64_t o = 0; o < C; ++o) {
    for (std::int64_t i = 0; i < 4 * C; ++i) REQUIRE(q.f32()[o * 4 * C + i] == -float(100 * i + o));
  }
  // Biases and non-Conv1D tensors are copied as they are.
  CHECK(tensor_values(dst.param("transformer.h.0.attn.c_attn.bias")) ==
        t.at("transformer.h.0.attn.c_attn.bias").values);
  // And saving transposes back.
  save_hf_weights(dst, dir / "back.safetensors");
  const safetensors_file back(dir / "back.safetensors");
  CHECK(tensor_values(back.read_f32("transformer.h.0.attn.c_attn.weight")) == w.values);
  CHECK(tensor_values(back.read_f32("transformer.h.0.mlp.c_proj.weight")) == m.values);
}

TEST_CASE("pipeline stages load their slice of a whole-model file", "[weights][pipeline]") {
  temp_dir dir;
  const gpt_config cfg = tiny_config(3);
  gpt_chunk whole = make_model(cfg, 9);
  save_hf_weights(whole, dir / "w.safetensors");
  for (const auto& range : partition_layers(cfg, 3)) {
    gpt_chunk s(cfg, range);
    load_hf_weights(s, dir / "w.safetensors");
    for (const auto& p : s.parameters()) {
      INFO(p.name);
      CHECK(tensor_values(s.param(p.name)) == tensor_values(whole.param(p.name)));
    }
  }
  // A file is checked against the whole model even for a partial stage.
  auto t = hf_from_chunk(whole);
  t.erase("transformer.h.0.ln_2.bias");
  write_hf(dir / "partial.safetensors", t);
  gpt_chunk last(cfg, partition_layers(cfg, 3).back());
  CHECK_THROWS_WITH(load_hf_weights(last, dir / "partial.safetensors"),
                    Catch::Contains("transformer.h.0.ln_2.bias"));
}
