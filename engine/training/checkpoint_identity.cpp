// Which checkpoint a process resumes. See checkpoint_identity.hpp.
#include "engine/training/checkpoint_identity.hpp"

#include <xxhash.h>

#include <cinttypes>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <stdexcept>
#include <vector>

namespace troupe::engine {

std::string checkpoint_identity(const std::filesystem::path& step_dir) {
  const auto path = step_dir / "manifest.json";
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error(path.string() + ": cannot read");
  const std::vector<char> bytes{std::istreambuf_iterator<char>(in),
                                std::istreambuf_iterator<char>()};
  if (in.bad()) throw std::runtime_error(path.string() + ": cannot read");
  char hash[17];
  std::snprintf(hash, sizeof hash, "%016" PRIx64, XXH64(bytes.data(), bytes.size(), 0));
  return step_dir.filename().string() + " (manifest xxh64 " + hash + ")";
}

}  // namespace troupe::engine
