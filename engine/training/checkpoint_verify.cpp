// Verifying checkpoints (the manifest is the whole truth), finding the one to resume from, and
// the rotation after a commit, which counts only checkpoints that verify and never removes one
// that does not (see the invariants in checkpoint.hpp and docs/checkpoints.md). CAF-free.
#include <xxhash.h>

#include <algorithm>
#include <cstring>
#include <mutex>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "engine/training/checkpoint.hpp"
#include "engine/training/checkpoint_internal.hpp"

namespace troupe::engine {
namespace fs = std::filesystem;
using json = nlohmann::json;
using namespace ckpt_internal;

namespace {

struct listed_file {
  std::string name;
  std::uint64_t bytes = 0;
  std::string xxh64;
};
struct manifest_view {
  int version = 0, step = 0;
  std::vector<listed_file> files;
  std::uint64_t hash = 0;  // xxh64 of the manifest file's bytes (the verification cache's key)
};

// The manifest on its own: magic, format version, its checksum of itself (manifest version 2),
// its step against the directory's name, a well-formed file list holding what the format
// needs. "" or the one-line problem.
std::string read_manifest(const fs::path& dir, manifest_view& out) {
  const fs::path mpath = dir / "manifest.json";
  std::error_code ec;
  if (!fs::exists(mpath, ec))
    return mpath.string() + ": missing (the checkpoint was not committed)";
  json m;
  try {
    const std::string text = read_text(mpath);
    out.hash = XXH64(text.data(), text.size(), 0);
    m = json::parse(text);
  } catch (const std::exception& e) {
    return mpath.string() + ": not a manifest (" + e.what() + ")";
  }
  if (!m.is_object() || m.value("magic", std::string()) != checkpoint_magic)
    return mpath.string() + ": not a Troupe checkpoint manifest (magic)";
  if (!m.contains("version") || !m["version"].is_number_integer() ||
      (m["version"].get<int>() != checkpoint_format_version &&
       m["version"].get<int>() != checkpoint_parts_version))
    return mpath.string() + ": format version " +
           (m.contains("version") ? m["version"].dump() : std::string("missing")) +
           " (this Troupe reads " + std::to_string(checkpoint_format_version) + " and " +
           std::to_string(checkpoint_parts_version) + ")";
  out.version = m["version"].get<int>();
  if (m.contains("manifest_version")) {  // absent: manifest version 1, without a checksum
    const json& r = m["manifest_version"];
    if (!r.is_number_integer() || r.get<int>() != manifest_revision)
      return mpath.string() + ": manifest version " + r.dump() + " (this Troupe reads 1 and " +
             std::to_string(manifest_revision) + ")";
    if (!m.contains("checksum") || !m["checksum"].is_string())
      return mpath.string() + ": no checksum of itself";
    const std::string want = m["checksum"].get<std::string>(), got = manifest_checksum(m);
    if (want != got)
      return mpath.string() + ": its content hashes to " + got + ", its checksum says " + want +
             " (edited or corrupt)";
  }
  const int dir_step = step_of(dir.filename().string());
  if (!m.contains("step") || !m["step"].is_number_integer()) return mpath.string() + ": no step";
  out.step = m["step"].get<int>();
  if (dir_step >= 0 && out.step != dir_step)
    return mpath.string() + ": the manifest is of step " + std::to_string(out.step) +
           ", its directory " + dir.filename().string() + " (renamed or copied)";
  if (!m.contains("files") || !m["files"].is_array()) return mpath.string() + ": no file list";
  const bool parts = out.version == checkpoint_parts_version;
  std::vector<std::string> required =
      parts ? std::vector<std::string>{"trainer_state.json"}
            : std::vector<std::string>{"model.safetensors", "exp_avg.safetensors",
                                       "exp_avg_sq.safetensors", "trainer_state.json"};
  int part_files = 0;
  std::set<std::string> names;
  for (const auto& f : m["files"]) {
    if (!f.is_object() || !f.contains("name") || !f["name"].is_string() || !f.contains("bytes") ||
        !f["bytes"].is_number_unsigned() || !f.contains("xxh64") || !f["xxh64"].is_string())
      return mpath.string() + ": a malformed file entry";
    const std::string name = f["name"].get<std::string>();
    if (name.empty() || name.find('/') != std::string::npos || name == ".." || name == "." ||
        name == "manifest.json")
      return mpath.string() + ": a file entry outside the checkpoint (" + name + ")";
    if (!names.insert(name).second) return mpath.string() + ": lists " + name + " twice";
    std::erase(required, name);
    part_files += name.starts_with("part-") ? 1 : 0;
    out.files.push_back({name, f["bytes"].get<std::uint64_t>(), f["xxh64"].get<std::string>()});
  }
  if (!required.empty()) return mpath.string() + ": lists no " + required.front();
  if (parts && part_files == 0) return mpath.string() + ": lists no part file";
  return "";
}

std::string size_problem(const fs::path& path, std::uint64_t size, std::uint64_t want) {
  return path.string() + ": " + std::to_string(size) + " bytes, the manifest says " +
         std::to_string(want) + " (truncated or replaced)";
}

// Without reading the tensor files: every listed file there at its listed size, nothing
// unlisted in the directory, and the trainer state (hashed, small) of the manifest's step.
std::string check_structure(const fs::path& dir, const manifest_view& m) {
  std::error_code ec;
  std::set<std::string> listed = {"manifest.json"};
  for (const auto& f : m.files) {
    listed.insert(f.name);
    const fs::path path = dir / f.name;
    const auto size = fs::file_size(path, ec);
    if (ec) return path.string() + ": missing";
    if (size != f.bytes) return size_problem(path, size, f.bytes);
  }
  for (const auto& entry : fs::directory_iterator(dir, ec))
    if (!listed.count(entry.path().filename().string()))
      return entry.path().string() +
             ": not listed in the manifest (a checkpoint holds only the files its manifest lists)";
  if (ec) return dir.string() + ": cannot list: " + ec.message();
  try {
    read_checkpoint_state(dir);
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

// Every listed file's size and xxh64 as read from disk; then, in parts, their coverage.
std::string check_contents(const fs::path& dir, const manifest_view& m) {
  for (const auto& f : m.files) {
    const fs::path path = dir / f.name;
    std::uint64_t size = 0, hash = 0;
    try {
      std::tie(size, hash) = size_and_hash(path);
    } catch (const std::exception& e) {
      return e.what();
    }
    if (size != f.bytes) return size_problem(path, size, f.bytes);
    if (hex64(hash) != f.xxh64)
      return path.string() + ": xxh64 " + hex64(hash) + ", the manifest says " + f.xxh64 +
             " (corrupt or replaced)";
  }
  if (m.version == checkpoint_parts_version) return check_parts_cover(dir);
  return "";
}

// A checkpoint rotation is removing: renamed STEP + this, then removed.
constexpr const char* removed_suffix = ".removed";

// The checkpoints this process has verified in full, by directory, the xxh64 of the manifest
// and the listed files' modification times (a file rewritten in place is hashed again).
std::mutex verified_mutex;
std::set<std::string> verified_dirs;

std::string cache_key(const fs::path& dir, const manifest_view& m) {
  std::error_code ec;
  const auto abs = fs::absolute(dir, ec);
  std::string key = (ec ? dir : abs).lexically_normal().string();
  key += '\n';
  key += hex64(m.hash);
  for (const auto& f : m.files) {
    key += ' ';
    key += std::to_string(fs::last_write_time(dir / f.name, ec).time_since_epoch().count());
  }
  return key;
}

bool verified_before(const fs::path& dir, const manifest_view& m) {
  std::lock_guard lock(verified_mutex);
  return verified_dirs.count(cache_key(dir, m)) > 0;
}

void remember(const fs::path& dir, const manifest_view& m) {
  std::lock_guard lock(verified_mutex);
  verified_dirs.insert(cache_key(dir, m));
}

}  // namespace

void ckpt_internal::remember_verified(const fs::path& dir) {
  manifest_view m;
  if (read_manifest(dir, m).empty()) remember(dir, m);
}

std::string verify_checkpoint(const fs::path& dir) {
  manifest_view m;
  if (std::string problem = read_manifest(dir, m); !problem.empty()) return problem;
  if (std::string problem = check_structure(dir, m); !problem.empty()) return problem;
  if (std::string problem = check_contents(dir, m); !problem.empty()) return problem;
  remember(dir, m);
  return "";
}

std::string verify_checkpoint_cached(const fs::path& dir) {
  manifest_view m;
  if (std::string problem = read_manifest(dir, m); !problem.empty()) return problem;
  if (std::string problem = check_structure(dir, m); !problem.empty()) return problem;
  if (verified_before(dir, m)) return "";
  if (std::string problem = check_contents(dir, m); !problem.empty()) return problem;
  remember(dir, m);
  return "";
}

std::vector<checkpoint_left_alone> ckpt_internal::rotate_checkpoints(
    const fs::path& root, const fs::path& committed, int keep,
    const std::function<void(const std::string&)>& point) {
  std::vector<checkpoint_left_alone> left;
  int verified = 0;
  for (const auto& e : list_checkpoints(root)) {
    const bool ours = e.dir.filename() == committed.filename();
    const std::string problem = ours ? "" : verify_checkpoint_cached(e.dir);
    if (!problem.empty()) {  // torn, corrupt or foreign: never counted, never removed here
      left.push_back({e.dir, problem});
      continue;
    }
    // The newest that verifies is the first counted; the one just committed always stays.
    if (++verified <= std::max(keep, 1) || ours) continue;
    // Renamed out of the listing first, so that a removal cut short leaves no half-removed
    // checkpoint: only a STEP.removed directory, which the next rotation finishes removing.
    const fs::path gone = root / (e.dir.filename().string() + removed_suffix);
    std::error_code ec;
    fs::rename(e.dir, gone, ec);
    if (ec) throw ckpt_error(e.dir, "cannot remove: " + ec.message());
    fs::remove_all(gone, ec);
    if (ec) throw ckpt_error(gone, "cannot remove: " + ec.message());
    if (point) point("removed " + e.dir.filename().string());
  }
  // Removals a killed process began (the renamed directories of checkpoints that verified).
  std::error_code ec;
  std::vector<fs::path> unfinished;
  for (const auto& d : fs::directory_iterator(root, ec)) {
    const std::string name = d.path().filename().string();
    if (name.size() > std::strlen(removed_suffix) && name.ends_with(removed_suffix) &&
        step_of(name.substr(0, name.size() - std::strlen(removed_suffix))) >= 0)
      unfinished.push_back(d.path());
  }
  for (const auto& d : unfinished) fs::remove_all(d, ec);
  return left;
}

std::vector<checkpoint_entry> list_checkpoints(const fs::path& root) {
  std::vector<checkpoint_entry> out;
  std::error_code ec;
  if (!fs::is_directory(root, ec)) return out;
  for (const auto& d : fs::directory_iterator(root, ec)) {
    if (!d.is_directory(ec)) continue;
    const int step = step_of(d.path().filename().string());
    if (step < 0) continue;
    out.push_back({d.path(), step, fs::exists(d.path() / "manifest.json", ec)});
  }
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.step > b.step; });
  return out;
}

fs::path find_checkpoint(const fs::path& where,
                         const std::function<void(const std::string&)>& say) {
  std::error_code ec;
  if (step_of(where.filename().string()) >= 0 && fs::is_directory(where, ec)) {
    const std::string problem = verify_checkpoint(where);
    if (!problem.empty()) throw std::runtime_error("cannot resume: " + problem);
    return where;
  }
  if (!fs::is_directory(where, ec))
    throw std::runtime_error("cannot resume: " + where.string() + " is not a directory");
  std::string passed;
  for (const auto& e : list_checkpoints(where)) {
    if (!e.committed) continue;  // torn: never loaded
    const std::string problem = verify_checkpoint(e.dir);
    if (problem.empty()) {
      if (!passed.empty() && say) say("falling back to " + e.dir.filename().string());
      return e.dir;
    }
    if (say) say("checkpoint " + e.dir.filename().string() + " is unusable: " + problem);
    passed = e.dir.filename().string();
  }
  throw std::runtime_error("cannot resume: no committed checkpoint in " + where.string() +
                           (passed.empty() ? "" : " verifies"));
}

checkpoint_state read_checkpoint_state(const fs::path& dir) {
  const fs::path path = dir / "trainer_state.json";
  manifest_view m;
  if (std::string problem = read_manifest(dir, m); !problem.empty())
    throw std::runtime_error(problem);
  const auto listed = std::find_if(m.files.begin(), m.files.end(),
                                   [](const auto& f) { return f.name == "trainer_state.json"; });
  const std::string text = read_text(path);  // checked as read: what is parsed is what hashed
  const std::string hash = hex64(XXH64(text.data(), text.size(), 0));
  if (text.size() != listed->bytes)
    throw std::runtime_error(size_problem(path, text.size(), listed->bytes));
  if (hash != listed->xxh64)
    throw ckpt_error(
        path, "xxh64 " + hash + ", the manifest says " + listed->xxh64 + " (corrupt or replaced)");
  checkpoint_state state;
  try {
    state = parse_checkpoint_state(text);
  } catch (const std::exception& e) {
    throw ckpt_error(path, std::string("unreadable trainer state: ") + e.what());
  }
  if (state.step != m.step)
    throw ckpt_error(path, "step " + std::to_string(state.step) + ", the manifest says " +
                               std::to_string(m.step));
  return state;
}

}  // namespace troupe::engine
