// The recipe comparison and the set-aside of newer checkpoints on resume. See resume_check.hpp.
#include "engine/training/resume_check.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <stdexcept>

#include "engine/training/metrics.hpp"

namespace troupe::engine {
namespace {

bool named(const std::vector<std::string>& allowed, const std::string& key) {
  return std::find(allowed.begin(), allowed.end(), key) != allowed.end();
}

std::string joined(const std::vector<std::string>& parts) {
  std::string s;
  for (const auto& p : parts) s += (s.empty() ? "" : ", ") + p;
  return s;
}

void sync_directory(const std::filesystem::path& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY);
  if (fd < 0) return;
  ::fsync(fd);
  ::close(fd);
}

}  // namespace

std::int64_t global_batch_tokens(const recipe& r) {
  return std::int64_t{r.micro_batches_per_step()} * r.batch.micro_batch * r.batch.seq_len;
}

resume_review review_resume(const recipe& saved, const recipe& now, int step,
                            const std::vector<std::string>& allowed) {
  const auto before = recipe_keys(saved), after = recipe_keys(now);
  for (const auto& name : allowed) {
    if (name == global_batch_key) continue;
    const auto it = std::find_if(after.begin(), after.end(),
                                 [&](const recipe_key& k) { return k.name == name; });
    if (it == after.end()) throw recipe_error("--allow-change: unknown key " + name);
    if (it->cls != key_class::trajectory)
      throw recipe_error("--allow-change " + name + ": a " + key_class_name(it->cls) +
                         " key, not a trajectory key (docs/checkpoints.md)");
  }
  resume_review out;
  std::vector<std::string> refused;
  bool batch_key_allowed = false;  // an allowed batch key changes the global batch by itself
  for (std::size_t i = 0; i < after.size(); ++i) {
    const auto& was = before[i];
    const auto& is = after[i];
    if (was.value == is.value || is.name == "steps") continue;
    const std::string change = is.name + " " + was.value + " -> " + is.value;
    switch (is.cls) {
      case key_class::model:
        throw recipe_error("key " + is.name + ": the checkpoint's model has " + was.value +
                           ", the recipe " + is.value + ": a resume cannot change the model");
      case key_class::trajectory:
        if (!named(allowed, is.name)) {
          refused.push_back(is.name + " (" + was.value + " -> " + is.value + ")");
        } else {
          out.allowed.push_back({step, is.name, was.value, is.value});
          batch_key_allowed |= is.name.starts_with("batch.");
        }
        break;
      case key_class::mesh:
        out.mesh.push_back(change);
        break;
      case key_class::free:
        out.free.push_back(change);
        break;
    }
  }
  const auto tokens_before = global_batch_tokens(saved), tokens_after = global_batch_tokens(now);
  if (tokens_before != tokens_after) {
    const std::string from = std::to_string(tokens_before), to = std::to_string(tokens_after);
    if (named(allowed, global_batch_key) || batch_key_allowed)
      out.allowed.push_back({step, global_batch_key, from, to});
    else
      refused.push_back(std::string(global_batch_key) + " (" + from + " -> " + to +
                        " tokens per step)");
  }
  if (!refused.empty())
    throw recipe_error("resuming after step " + std::to_string(step) +
                       " would change the run's trajectory: " + joined(refused) +
                       "; name them with --allow-change to change them, or resume with the "
                       "checkpoint's recipe");
  return out;
}

std::optional<recipe> saved_recipe(const checkpoint_state& state,
                                   const std::filesystem::path& dir) {
  if (state.recipe_text.empty() && state.overrides.empty()) return std::nullopt;
  try {
    return parse_recipe(state.recipe_text, (dir / "trainer_state.json").string() + ": recipe",
                        state.overrides);
  } catch (const recipe_error& e) {
    throw recipe_error(std::string("the checkpoint's recipe does not parse: ") + e.what());
  }
}

std::vector<checkpoint_entry> newer_checkpoints(const std::filesystem::path& root, int step) {
  std::vector<checkpoint_entry> out;
  for (const auto& e : list_checkpoints(root))
    if (e.step > step && e.committed && verify_checkpoint(e.dir).empty()) out.push_back(e);
  return out;
}

std::filesystem::path set_aside_checkpoints(const std::filesystem::path& root,
                                            const std::vector<checkpoint_entry>& newer, int step) {
  namespace fs = std::filesystem;
  const fs::path aside = root / set_aside_name(root, step);
  std::error_code ec;
  fs::create_directory(aside, ec);
  if (ec) throw std::runtime_error(aside.string() + ": cannot create: " + ec.message());
  for (const auto& e : newer) {
    fs::rename(e.dir, aside / e.dir.filename(), ec);
    if (ec)
      throw std::runtime_error(e.dir.string() + ": cannot move into " + aside.string() + ": " +
                               ec.message());
  }
  sync_directory(aside);
  sync_directory(root);
  return aside;
}

}  // namespace troupe::engine
