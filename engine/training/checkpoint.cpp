// Checkpoints on disk. See checkpoint.hpp and docs/checkpoints.md.
#include "engine/training/checkpoint.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <future>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <stdexcept>

#include "engine/model/gpt_weights.hpp"
#include "engine/model/safetensors.hpp"
#include "engine/training/checkpoint_internal.hpp"
#include "engine/training/recipe.hpp"

namespace troupe::engine {
namespace fs = std::filesystem;
using json = nlohmann::json;
namespace ckpt_internal {

const char* const tensor_files[] = {"model", "exp_avg", "exp_avg_sq"};

std::runtime_error ckpt_error(const fs::path& path, const std::string& what) {
  return std::runtime_error(path.string() + ": " + what);
}

std::string hex64(std::uint64_t x) {
  char text[17];
  std::snprintf(text, sizeof text, "%016" PRIx64, x);
  return text;
}

std::pair<std::uint64_t, std::uint64_t> size_and_hash(const fs::path& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw ckpt_error(path, std::string("cannot open: ") + std::strerror(errno));
  XXH64_state_t* st = XXH64_createState();
  XXH64_reset(st, 0);
  std::vector<char> buf(1 << 20);
  std::uint64_t size = 0;
  for (;;) {
    const ssize_t n = ::read(fd, buf.data(), buf.size());
    if (n < 0) {
      if (errno == EINTR) continue;
      const std::string err = std::strerror(errno);
      XXH64_freeState(st);
      ::close(fd);
      throw ckpt_error(path, "cannot read: " + err);
    }
    if (n == 0) break;
    XXH64_update(st, buf.data(), static_cast<std::size_t>(n));
    size += static_cast<std::uint64_t>(n);
  }
  const std::uint64_t h = XXH64_digest(st);
  XXH64_freeState(st);
  ::close(fd);
  return {size, h};
}

void fsync_dir(const fs::path& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) throw ckpt_error(dir, std::string("cannot open: ") + std::strerror(errno));
  const int rc = ::fsync(fd);
  ::close(fd);
  if (rc != 0) throw ckpt_error(dir, std::string("fsync failed: ") + std::strerror(errno));
}

file_digest write_text(const fs::path& path, const std::string& text) {
  std::vector<std::byte> bytes(text.size());
  std::memcpy(bytes.data(), text.data(), text.size());
  return write_file_atomically(path, bytes);
}

std::string read_text(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw ckpt_error(path, "cannot read");
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// Doubles as their bit patterns: exact, and NaN and infinities survive JSON.
std::uint64_t bits(double x) {
  std::uint64_t u;
  std::memcpy(&u, &x, 8);
  return u;
}
double from_bits(std::uint64_t u) {
  double x;
  std::memcpy(&x, &u, 8);
  return x;
}

json window_json(const outlier_detector::state& w) {
  json values = json::array();
  for (double v : w.values) values.push_back(bits(v));
  return {{"values_bits", values}, {"next", w.next}, {"count", w.count}};
}
outlier_detector::state window_from(const json& j) {
  outlier_detector::state w;
  for (const auto& v : j.at("values_bits")) w.values.push_back(from_bits(v.get<std::uint64_t>()));
  w.next = j.at("next").get<std::size_t>();
  w.count = j.at("count").get<std::size_t>();
  return w;
}

json state_json(const checkpoint_state& s) {
  const auto& m = s.mesh;
  json out = {
      {"step", s.step},
      {"tokens", s.tokens},
      {"micro_batches", s.micro_batches},
      {"guard",
       {{"scale_bits", bits(s.guard.scale)},
        {"scale", s.guard.scale},
        {"good_steps", s.guard.good_steps},
        {"skips_in_a_row", s.guard.skips_in_a_row},
        {"loss_window", window_json(s.guard.loss)},
        {"grad_norm_window", window_json(s.guard.grad_norm)}}},
      {"schedule", s.schedule},
      {"mesh",
       {{"pp", m.pp},
        {"dp", m.dp},
        {"tp", m.tp},
        {"zero", m.zero},
        {"virtual_stages", m.virtual_stages},
        {"micro_batches", m.micro_batches},
        {"grad_accum", m.grad_accum},
        {"micro_batch", m.micro_batch}}},
      {"recipe", s.recipe_text},
      {"overrides", s.overrides},
      {"recipe_changes", json::array()},
  };
  for (const auto& c : s.recipe_changes)
    out["recipe_changes"].push_back(
        {{"step", c.step}, {"key", c.key}, {"from", c.from}, {"to", c.to}});
  if (s.model)
    out["model"] = {
        {"vocab_size", s.model->vocab_size}, {"padded_vocab_size", s.model->padded_vocab_size},
        {"context", s.model->context},       {"layers", s.model->layers},
        {"heads", s.model->heads},           {"width", s.model->width}};
  return out;
}

checkpoint_state state_from(const json& j) {
  checkpoint_state s;
  s.step = j.at("step").get<int>();
  s.tokens = j.at("tokens").get<std::int64_t>();
  s.micro_batches = j.at("micro_batches").get<std::int64_t>();
  const auto& g = j.at("guard");
  s.guard.scale = from_bits(g.at("scale_bits").get<std::uint64_t>());
  s.guard.good_steps = g.at("good_steps").get<int>();
  s.guard.skips_in_a_row = g.at("skips_in_a_row").get<int>();
  s.guard.loss = window_from(g.at("loss_window"));
  s.guard.grad_norm = window_from(g.at("grad_norm_window"));
  s.schedule = j.at("schedule").get<std::string>();
  const auto& m = j.at("mesh");
  s.mesh = {m.at("pp").get<int>(),
            m.at("dp").get<int>(),
            m.at("tp").get<int>(),
            m.at("zero").get<int>(),
            m.at("virtual_stages").get<int>(),
            m.at("micro_batches").get<int>(),
            m.at("grad_accum").get<int>(),
            m.at("micro_batch").get<int>()};
  s.recipe_text = j.at("recipe").get<std::string>();
  s.overrides = j.at("overrides").get<std::vector<std::string>>();
  if (j.contains("recipe_changes"))
    for (const auto& c : j.at("recipe_changes"))
      s.recipe_changes.push_back({c.at("step").get<int>(), c.at("key").get<std::string>(),
                                  c.at("from").get<std::string>(), c.at("to").get<std::string>()});
  if (j.contains("model")) {
    const auto& g = j.at("model");
    s.model = gpt_config{g.at("vocab_size").get<int>(), g.at("padded_vocab_size").get<int>(),
                         g.at("context").get<int>(),    g.at("layers").get<int>(),
                         g.at("heads").get<int>(),      g.at("width").get<int>()};
    s.model->validate();
  }
  return s;
}

int step_of(const std::string& name) {
  if (name.size() != 13 || !name.starts_with("step-")) return -1;
  int step = 0;
  for (char c : name.substr(5)) {
    if (c < '0' || c > '9') return -1;
    step = step * 10 + (c - '0');
  }
  return step;
}

std::string manifest_checksum(const json& manifest) {
  json m = manifest;
  m.erase("checksum");
  const std::string text = m.dump();
  return hex64(XXH64(text.data(), text.size(), 0));
}

}  // namespace ckpt_internal
using namespace ckpt_internal;

checkpoint_state parse_checkpoint_state(const std::string& text) {
  return state_from(json::parse(text));
}

checkpoint_assembler::checkpoint_assembler(const gpt_config& model, int tp)
    : model_(model), tp_(tp) {
  check_tensor_parallel(model, tp);  // tp >= 1 dividing the model (a checkpoint's mesh may lie)
  for (int j = 0; j < tp; ++j) {
    auto& l = layouts_.emplace_back();
    for (const auto& p : chunk_parameter_layout(model, chunk_range::whole(model), {j, tp})) {
      l.emplace(p.name, p);
      if (p.name == "transformer.wte.weight") l.emplace(checkpoint_head_copy, p);
    }
  }
}

std::int64_t checkpoint_assembler::slice_numel(const std::string& name, int shard,
                                               std::int64_t offset, std::int64_t n) const {
  if (shard < 0 || shard >= tp_)
    throw std::runtime_error("checkpoint: tensor shard " + std::to_string(shard) + " of " +
                             std::to_string(tp_));
  const auto& layout = layouts_[static_cast<std::size_t>(shard)];
  const auto it = layout.find(name);
  if (it == layout.end()) throw std::runtime_error("checkpoint: no parameter " + name);
  const std::int64_t numel = it->second.numel;
  if (offset < 0 || n < 0 || offset > numel || n > numel - offset)
    throw std::runtime_error("checkpoint: " + name + ": " + std::to_string(n) + " values from " +
                             std::to_string(offset) + " run outside its " + std::to_string(numel));
  return numel;
}

void checkpoint_assembler::add(role r, const std::string& name, int shard, std::int64_t offset,
                               const float* values, std::int64_t n) {
  const std::int64_t numel = slice_numel(name, shard, offset, n);
  auto& s = slices_[{r, name, shard}];
  if (s.values.empty()) s.values.assign(static_cast<std::size_t>(numel), 0.0f);
  std::copy(values, values + n, s.values.begin() + offset);
  s.covered.emplace_back(offset, n);
}

void checkpoint_assembler::add(role r, const std::string& name, int shard, std::int64_t offset,
                               std::vector<float>&& values) {
  const auto n = static_cast<std::int64_t>(values.size());
  const std::int64_t numel = slice_numel(name, shard, offset, n);
  auto& s = slices_[{r, name, shard}];
  if (s.values.empty() && offset == 0 && n == numel) {
    s.values = std::move(values);
    s.covered.emplace_back(0, n);
    return;
  }
  add(r, name, shard, offset, values.data(), n);
}

void checkpoint_assembler::cover(role r, const std::string& name, int shard, std::int64_t offset,
                                 std::int64_t n) {
  slice_numel(name, shard, offset, n);
  slices_[{r, name, shard}].covered.emplace_back(offset, n);
}

std::vector<parameter_info> checkpoint_assembler::tensors(
    const std::set<std::string>& names) const {
  // The head's copy of wte, when any stage sent one.
  bool head_copy = false;
  for (const auto& [key, s] : slices_)
    head_copy = head_copy || std::get<1>(key) == checkpoint_head_copy;
  std::vector<parameter_info> out;
  for (const auto& p : chunk_parameter_layout(model_, chunk_range::whole(model_))) {
    if (names.empty() || names.count(p.name)) out.push_back(p);
    if (head_copy && p.name == "transformer.wte.weight" &&
        (names.empty() || names.count(checkpoint_head_copy))) {
      out.push_back(p);
      out.back().name = checkpoint_head_copy;
    }
  }
  return out;
}

void checkpoint_assembler::check_covered(int only, const std::set<std::string>& names) const {
  for (int r = 0; r < 3; ++r) {
    if (only >= 0 && r != only) continue;
    for (const auto& p : tensors(names)) {
      for (int j = 0; j < tp_; ++j) {
        const auto it = slices_.find({r, p.name, j});
        const auto& info = layouts_[static_cast<std::size_t>(j)].at(p.name);
        auto covered = it == slices_.end() ? decltype(it->second.covered){} : it->second.covered;
        std::sort(covered.begin(), covered.end());
        std::int64_t reach = 0;
        for (const auto& [o, n] : covered) {
          if (o > reach) break;
          reach = std::max(reach, o + n);
        }
        if (reach < info.numel)
          throw std::runtime_error(std::string("checkpoint: ") + tensor_files[r] + " of " + p.name +
                                   (tp_ > 1 ? " shard " + std::to_string(j) : "") +
                                   ": elements from " + std::to_string(reach) + " never sent");
      }
    }
  }
}

checkpoint_tensors checkpoint_assembler::finish(int only, const std::set<std::string>& names) {
  check_covered(only, names);
  checkpoint_tensors out;
  named_tensors* maps[] = {&out.params, &out.exp_avg, &out.exp_avg_sq};
  for (int r = 0; r < 3; ++r) {
    if (only >= 0 && r != only) continue;
    for (const auto& p : tensors(names)) {
      auto& dst = (*maps[r])[p.name];
      if (tp_ > 1) dst.assign(static_cast<std::size_t>(p.numel), 0.0f);
      for (int j = 0; j < tp_; ++j) {
        auto& slice = slices_.at({r, p.name, j});
        const auto& info = layouts_[static_cast<std::size_t>(j)].at(p.name);
        if (static_cast<std::int64_t>(slice.values.size()) != info.numel)
          throw std::logic_error("checkpoint: " + p.name + " covered, never given");
        if (tp_ == 1)  // the one shard is the tensor: taken, not copied
          dst = std::move(slice.values);
        else
          put_shard(info, {j, tp_}, slice.values.data(), dst.data());
      }
    }
  }
  return out;
}

fs::path checkpoint_dir(const fs::path& root, int step) {
  char name[32];
  std::snprintf(name, sizeof name, "step-%08d", step);
  return root / name;
}

fs::path prepare_checkpoint_dir(const fs::path& root, int step, const checkpoint_say& say) {
  std::error_code ec;
  fs::create_directories(root, ec);
  if (ec) throw ckpt_error(root, "cannot create: " + ec.message());
  const fs::path dir = checkpoint_dir(root, step);
  // A committed checkpoint of this step that verifies is never replaced; a torn or corrupt one
  // (the run resumed from an older one after it failed to verify) is.
  if (fs::exists(dir / "manifest.json", ec)) {
    const std::string problem = verify_checkpoint(dir);
    if (problem.empty())
      throw ckpt_error(
          dir, "a committed checkpoint of step " + std::to_string(step) + " is there already");
    if (say) say("replacing " + dir.string() + ", which does not verify: " + problem);
  } else if (fs::exists(dir, ec) && say) {
    say("replacing " + dir.string() + ", torn (no manifest: never committed)");
  }
  fs::remove_all(dir, ec);
  if (ec) throw ckpt_error(dir, "cannot remove a torn checkpoint: " + ec.message());
  fs::create_directory(dir, ec);
  if (ec) throw ckpt_error(dir, "cannot create: " + ec.message());
  return dir;
}

namespace {

// trainer_state.json, then the manifest listing `files` and it (the commit), then rotation.
std::vector<checkpoint_left_alone> commit(const fs::path& root, json files,
                                          const checkpoint_state& state, int version, int keep,
                                          const checkpoint_hook& hook) {
  auto point = [&](const std::string& p) {
    if (hook) hook(p);
  };
  const fs::path dir = checkpoint_dir(root, state.step);
  const auto d = write_text(dir / "trainer_state.json", state_json(state).dump(1) + "\n");
  files.push_back({{"name", "trainer_state.json"}, {"bytes", d.bytes}, {"xxh64", hex64(d.xxh64)}});
  point("wrote trainer_state.json");
  fsync_dir(dir);
  point("before manifest");
  json manifest = {{"magic", checkpoint_magic},
                   {"version", version},
                   {"manifest_version", manifest_revision},
                   {"step", state.step},
                   {"files", files}};
  manifest["checksum"] = manifest_checksum(manifest);
  write_text(dir / "manifest.json", manifest.dump(1) + "\n");
  fsync_dir(dir);
  fsync_dir(root);
  remember_verified(dir);  // its files' checksums were taken as they were written
  point("committed");
  return rotate_checkpoints(root, dir, keep, point);
}

}  // namespace

std::vector<checkpoint_left_alone> write_checkpoint(const fs::path& root, const gpt_config& model,
                                                    const checkpoint_tensors& tensors,
                                                    const checkpoint_state& state, int keep,
                                                    const checkpoint_hook& hook,
                                                    const checkpoint_say& say) {
  auto point = [&](const std::string& p) {
    if (hook) hook(p);
  };
  const fs::path dir = prepare_checkpoint_dir(root, state.step, say);
  json files = json::array();
  auto add = [&](const std::string& name, file_digest d) {
    files.push_back({{"name", name}, {"bytes", d.bytes}, {"xxh64", hex64(d.xxh64)}});
    point("wrote " + name);
  };
  // Each tensor file streamed from the assembled tensors (hashed as written, nothing copied
  // whole): Hugging Face GPT-2's names and layout, as save_hf_weights writes them. The three
  // files are written at once, each on a thread: hashing and copying into the page cache take
  // a core each, so one file after another would take three times as long.
  const named_tensors* maps[] = {&tensors.params, &tensors.exp_avg, &tensors.exp_avg_sq};
  const auto layout = chunk_parameter_layout(model, chunk_range::whole(model));
  std::vector<std::future<file_digest>> writes;
  for (int i = 0; i < 3; ++i) {
    const auto& values = *maps[i];
    std::map<std::string, safetensors_tensor> out;
    for (const auto& p : layout) {
      const auto it = values.find(p.name);
      if (it == values.end() || static_cast<std::int64_t>(it->second.size()) != p.numel)
        throw std::logic_error(std::string("checkpoint: ") + tensor_files[i] + " tensor " + p.name +
                               (it == values.end() ? " is missing" : " has another size"));
      out[p.name] = hf_tensor(model, p, it->second.data());
    }
    const fs::path path = dir / (std::string(tensor_files[i]) + ".safetensors");
    writes.push_back(std::async(std::launch::async, [path, out = std::move(out)] {
      return write_safetensors(path, out, {{"format", "pt"}});
    }));
  }
  std::exception_ptr failed;  // the first file's error, once every write has ended
  for (int i = 0; i < 3; ++i) {
    try {
      add(std::string(tensor_files[i]) + ".safetensors", writes[static_cast<std::size_t>(i)].get());
    } catch (...) {
      if (!failed) failed = std::current_exception();
    }
  }
  if (failed) std::rethrow_exception(failed);
  if (tensors.params.count(checkpoint_head_copy)) {  // the head's copy of wte, HF's wte layout
    const std::string base = checkpoint_head_copy;
    const kernels::shape_t shape = {model.vocab_size, model.width};
    const auto bytes = static_cast<std::size_t>(model.vocab_size) * model.width * sizeof(float);
    std::map<std::string, safetensors_tensor> out;
    const std::pair<const char*, const named_tensors*> parts[] = {
        {"", &tensors.params},
        {".exp_avg", &tensors.exp_avg},
        {".exp_avg_sq", &tensors.exp_avg_sq}};
    for (const auto& [suffix, map] : parts) {
      const auto& v = map->at(base);
      out[base + suffix] = safetensors_tensor{"F32", shape, v.data(), bytes};
    }
    add("lm_head.safetensors",
        write_safetensors(dir / "lm_head.safetensors", out, {{"format", "pt"}}));
  }
  return commit(root, std::move(files), state, checkpoint_format_version, keep, hook);
}

std::string checkpoint_part_name(int rank, int lane) {
  char name[48];
  std::snprintf(name, sizeof name, "part-%03d-%03d.safetensors", rank, lane);
  return name;
}

checkpoint_file write_checkpoint_part(const fs::path& dir, const std::string& name,
                                      const std::vector<checkpoint_piece>& pieces) {
  std::map<std::string, safetensors_tensor> out;
  for (const auto& p : pieces) {
    if (p.role < 0 || p.role > 2 || p.n < 0 || p.offset < 0 ||
        p.name.find('/') != std::string::npos)
      throw std::logic_error("checkpoint: a malformed piece of " + p.name);
    const std::string key = std::string(tensor_files[p.role]) + "/" + p.name + "/" +
                            std::to_string(p.shard) + "/" + std::to_string(p.offset);
    const auto [it, fresh] = out.emplace(
        key, safetensors_tensor{"F32", {p.n}, p.values, static_cast<std::size_t>(p.n) * 4});
    if (!fresh) throw std::logic_error("checkpoint: the piece " + key + " twice in one part");
  }
  const auto d = write_safetensors(dir / name, out, {{"format", "troupe-part"}});
  fsync_dir(dir);  // the rename, on a file system where another process commits
  return {name, d.bytes, d.xxh64};
}

std::vector<checkpoint_left_alone> commit_checkpoint_parts(
    const fs::path& root, const std::vector<checkpoint_file>& parts, const checkpoint_state& state,
    int keep, const checkpoint_hook& hook) {
  // Every part listed is there, once, as its stage said: a stage that wrote elsewhere (another
  // file system) must not commit a checkpoint that cannot load, nor remove older ones.
  const fs::path dir = checkpoint_dir(root, state.step);
  json files = json::array();
  std::set<std::string> names;
  for (const auto& p : parts) {
    std::error_code ec;
    if (!p.name.starts_with("part-") || p.name.find('/') != std::string::npos ||
        !names.insert(p.name).second)
      throw ckpt_error(dir / p.name, "not a part of its own");
    const auto size = fs::file_size(dir / p.name, ec);
    if (ec || size != p.bytes)
      throw ckpt_error(
          dir / p.name,
          ec ? "missing: its stage wrote it where this process does not see it (is "
               "checkpoint.dir on a file system every process shares?)"
             : std::to_string(size) + " bytes, its stage wrote " + std::to_string(p.bytes));
    files.push_back({{"name", p.name}, {"bytes", p.bytes}, {"xxh64", hex64(p.xxh64)}});
  }
  return commit(root, std::move(files), state, checkpoint_parts_version, keep, hook);
}

namespace {

// The manifest's format version and file names (each a plain name in dir).
std::pair<int, std::vector<std::string>> manifest_files(const fs::path& dir) {
  const fs::path path = dir / "manifest.json";
  std::pair<int, std::vector<std::string>> out;
  try {
    const json m = json::parse(read_text(path));
    for (const auto& f : m.at("files")) out.second.push_back(f.at("name").get<std::string>());
    out.first = m.at("version").get<int>();
  } catch (const std::exception& e) {
    throw ckpt_error(path, std::string("unreadable manifest: ") + e.what());
  }
  for (const auto& name : out.second)
    if (name.empty() || name.find('/') != std::string::npos || name == "." || name == "..")
      throw ckpt_error(path, "a file entry outside the checkpoint (" + name + ")");
  return out;
}

// A part's tensor name ROLE/NAME/SHARD/OFFSET (SHARD and OFFSET decimal digits); false for
// anything else.
struct piece_key {
  int role = -1;
  std::string name;
  int shard = 0;
  std::int64_t offset = 0;
};
bool parse_piece_key(const std::string& key, piece_key& k) {
  const auto a1 = key.find('/'), a3 = key.rfind('/');
  if (a1 == std::string::npos || a3 == a1) return false;
  const auto a2 = key.rfind('/', a3 - 1);
  if (a2 == a1 || a2 + 1 >= a3 || a3 + 1 >= key.size()) return false;
  k.role = -1;
  for (int r = 0; r < 3; ++r)
    if (key.compare(0, a1, tensor_files[r]) == 0 && std::strlen(tensor_files[r]) == a1) k.role = r;
  k.name = key.substr(a1 + 1, a2 - a1 - 1);
  auto number = [&](std::size_t from, std::size_t to, auto& value) {
    for (std::size_t i = from; i < to; ++i)
      if (key[i] < '0' || key[i] > '9') return false;
    const auto [end, ec] = std::from_chars(key.data() + from, key.data() + to, value);
    return ec == std::errc() && end == key.data() + to;
  };
  return k.role >= 0 && !k.name.empty() && number(a2 + 1, a3, k.shard) &&
         number(a3 + 1, key.size(), k.offset);
}

// Format 2: every piece of the parts as `f(file, key, entry)` (its header read, not its data).
template <class F>
void for_each_part_piece(const fs::path& dir, F f) {
  for (const auto& name : manifest_files(dir).second) {
    if (!name.starts_with("part-")) continue;
    const safetensors_file file(dir / name);
    for (const auto& [key, entry] : file.entries()) {
      piece_key k;
      if (!parse_piece_key(key, k))
        throw ckpt_error(file.path(), "a tensor not named ROLE/NAME/SHARD/OFFSET: " + key);
      try {
        f(file, key, k, entry);
      } catch (const std::exception& e) {
        throw ckpt_error(file.path(), e.what());
      }
    }
  }
}

// Format 2: the parts' pieces of role `only` (-1: every role) and of the tensors `names` (all
// if empty) put together; the others are not read.
checkpoint_tensors assemble_parts(const fs::path& dir, const gpt_config& model, int only,
                                  const std::set<std::string>& names = {}) {
  checkpoint_assembler a(model, read_checkpoint_state(dir).mesh.tp);
  for_each_part_piece(dir, [&](const safetensors_file& file, const std::string& key,
                               const piece_key& k, const safetensors_entry&) {
    if ((only >= 0 && k.role != only) || (!names.empty() && !names.count(k.name))) return;
    const auto t = file.read_f32(key);
    a.add(static_cast<checkpoint_assembler::role>(k.role), k.name, k.shard, k.offset, t.f32(),
          t.numel());
  });
  try {
    return a.finish(only, names);
  } catch (const std::exception& e) {
    throw ckpt_error(dir, e.what());
  }
}

}  // namespace

std::string ckpt_internal::check_parts_cover(const fs::path& dir) {
  try {
    const auto state = read_checkpoint_state(dir);
    const auto model = state.model
                           ? *state.model
                           : parse_recipe(state.recipe_text, (dir / "trainer_state.json").string(),
                                          state.overrides)
                                 .model;
    checkpoint_assembler a(model, state.mesh.tp);
    for_each_part_piece(dir, [&](const safetensors_file&, const std::string&, const piece_key& k,
                                 const safetensors_entry& e) {
      if (e.dtype != "F32" || e.shape.size() != 1)
        throw std::runtime_error("a piece not 1-D F32: " + k.name);
      a.cover(static_cast<checkpoint_assembler::role>(k.role), k.name, k.shard, k.offset,
              e.shape[0]);
    });
    a.check_covered();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

int checkpoint_format(const fs::path& dir) { return manifest_files(dir).first; }

void check_checkpoint_model(const fs::path& dir, const gpt_config& model) {
  const auto [version, listed] = manifest_files(dir);
  if (version == checkpoint_parts_version)
    assemble_parts(dir, model, checkpoint_assembler::parameter);
  else if (std::find(listed.begin(), listed.end(), "model.safetensors") == listed.end())
    throw ckpt_error(dir / "manifest.json", "lists no model.safetensors");
  else
    check_hf_weights(model, dir / "model.safetensors");
}

checkpoint_tensors read_checkpoint_tensors(const fs::path& dir, const gpt_config& model) {
  if (manifest_files(dir).first == checkpoint_parts_version) return assemble_parts(dir, model, -1);
  checkpoint_tensors out;
  named_tensors* maps[] = {&out.params, &out.exp_avg, &out.exp_avg_sq};
  const auto whole = chunk_range::whole(model);
  const auto layout = chunk_parameter_layout(model, whole);
  for (int r = 0; r < 3; ++r) {
    const auto flat = load_checkpoint_tensors(dir, tensor_files[r], model, whole);
    for (const auto& p : layout)
      (*maps[r])[p.name].assign(flat.begin() + p.offset, flat.begin() + p.offset + p.numel);
  }
  return out;
}

std::vector<float> load_checkpoint_tensors(const fs::path& dir, const std::string& which,
                                           const gpt_config& model, const chunk_range& range,
                                           tensor_shard shard) {
  gpt_chunk st(model, range, shard);
  const auto [version, listed] = manifest_files(dir);
  if (version == checkpoint_parts_version) {
    int role = -1;
    for (int r = 0; r < 3; ++r)
      if (which == tensor_files[r]) role = r;
    if (role < 0) throw std::logic_error("checkpoint: no tensor file " + which);
    std::set<std::string> names = {checkpoint_head_copy};  // the chunk's tensors alone
    for (const auto& p : st.parameters()) names.insert(p.name);
    auto t = assemble_parts(dir, model, role, names);
    const named_tensors& values = role == 0 ? t.params : role == 1 ? t.exp_avg : t.exp_avg_sq;
    for (const auto& p : st.parameters()) {
      // A head range without the embedding takes the head's own copy of wte, where saved.
      const bool head_copy = range.head && !range.embedding && p.name == "transformer.wte.weight" &&
                             values.count(checkpoint_head_copy);
      const auto& whole = values.at(head_copy ? std::string(checkpoint_head_copy) : p.name);
      take_shard(p, st.shard(), whole.data(), st.params() + p.offset);
    }
    return {st.params(), st.params() + st.parameter_count()};
  }
  // Only the files the manifest lists are opened: one dropped in beside them is never read.
  auto lists = [&files = listed](const std::string& name) {  // (clang 14: no binding captured)
    return std::find(files.begin(), files.end(), name) != files.end();
  };
  if (!lists(which + ".safetensors"))
    throw ckpt_error(dir / "manifest.json", "lists no " + which + ".safetensors");
  load_hf_weights(st, dir / (which + ".safetensors"));
  if (range.head && !range.embedding && lists("lm_head.safetensors")) {
    const safetensors_file file(dir / "lm_head.safetensors");
    const std::string name =
        std::string(checkpoint_head_copy) + (which == "model" ? "" : "." + which);
    if (!file.contains(name)) throw ckpt_error(file.path(), "no tensor " + name);
    const auto t = file.read_f32(name);
    for (const auto& p : st.parameters()) {
      if (p.name != "transformer.wte.weight") continue;
      const std::int64_t rows = model.vocab_size * model.width;
      if (t.numel() != rows) throw ckpt_error(file.path(), "tensor " + name + " of another shape");
      std::vector<float> whole(static_cast<std::size_t>(kernels::shape_numel(p.full_shape)), 0.0f);
      std::copy(t.f32(), t.f32() + rows, whole.begin());
      take_shard(p, st.shard(), whole.data(), st.params() + p.offset);
    }
  }
  return {st.params(), st.params() + st.parameter_count()};
}

}  // namespace troupe::engine
