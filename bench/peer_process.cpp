// See peer_process.hpp.
#include "bench/peer_process.hpp"

#include <array>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <stdexcept>
#include <system_error>
#include <vector>

namespace troupe::bench {

std::optional<std::string> capture_command(const std::string& command) {
  std::unique_ptr<FILE, int (*)(FILE*)> pipe(::popen(command.c_str(), "r"), ::pclose);
  if (!pipe) return std::nullopt;
  std::string out;
  std::array<char, 4096> buf{};
  while (std::fgets(buf.data(), buf.size(), pipe.get())) out += buf.data();
  const int status = ::pclose(pipe.release());
  if (status != 0) return std::nullopt;
  return out;
}

std::optional<nlohmann::json> last_json_object(const std::string& text) {
  const auto at = text.find_last_of('{');
  if (at == std::string::npos) return std::nullopt;
  try {
    return nlohmann::json::parse(text.substr(at));
  } catch (const nlohmann::json::exception&) {
    return std::nullopt;
  }
}

std::string source_file(const std::string& relative) {
  namespace fs = std::filesystem;
  std::vector<fs::path> roots;
  if (const char* dir = std::getenv("TROUPE_SOURCE_DIR"); dir && *dir) roots.emplace_back(dir);
  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (!ec)
    for (fs::path dir = exe.parent_path(); !dir.empty() && roots.size() < 8;
         dir = dir.parent_path()) {
      roots.push_back(dir);
      if (dir == dir.root_path()) break;
    }
  roots.emplace_back(TROUPE_SOURCE_DIR);
  roots.push_back(fs::current_path(ec));
  std::string looked;
  for (const auto& root : roots) {
    const fs::path file = root / relative;
    if (fs::is_regular_file(file, ec)) return file.string();
    looked += (looked.empty() ? "" : ", ") + root.string();
  }
  throw std::runtime_error(relative + " not found under " + looked +
                           " (set TROUPE_SOURCE_DIR to Troupe's checkout)");
}

}  // namespace troupe::bench
