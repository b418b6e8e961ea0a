// What checkpoint.cpp (writing, loading) and checkpoint_verify.cpp (verification, rotation,
// resume) share: file helpers, the manifest's self-checksum and the rotation after a commit.
// Internal to engine/training; users include checkpoint.hpp.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "engine/training/checkpoint.hpp"

namespace troupe::engine::ckpt_internal {

// The manifest's own revision (its "manifest_version"): 2 adds "checksum", the xxh64 of the
// manifest without that key (nlohmann's compact dump, keys sorted). A manifest without the key
// is revision 1 and has no checksum.
constexpr int manifest_revision = 2;

std::runtime_error ckpt_error(const std::filesystem::path& path, const std::string& what);
std::string hex64(std::uint64_t x);
// The file's size and xxh64, read from disk.
std::pair<std::uint64_t, std::uint64_t> size_and_hash(const std::filesystem::path& path);
std::string read_text(const std::filesystem::path& path);
// step-00000012 -> 12; -1 for anything else.
int step_of(const std::string& name);
// The manifest's "checksum": xxh64 (hex) of its JSON without the "checksum" key.
std::string manifest_checksum(const nlohmann::json& manifest);
// Format 2: "" or the problem, when the parts' pieces (their headers) leave an element of the
// model its trainer state names uncovered.
std::string check_parts_cover(const std::filesystem::path& dir);
// Records that dir, as it is now, verified in full (its files' checksums were computed as they
// were written), so that rotation does not hash it again.
void remember_verified(const std::filesystem::path& dir);
// After the commit of `committed` under root: the verified checkpoints beyond the newest `keep`
// go (never `committed`, never the newest that verifies); directories that do not verify stay
// and are returned with their problem. `point` sees "removed step-..." after each removal.
std::vector<checkpoint_left_alone> rotate_checkpoints(
    const std::filesystem::path& root, const std::filesystem::path& committed, int keep,
    const std::function<void(const std::string&)>& point);

}  // namespace troupe::engine::ckpt_internal
