// See peer_process.hpp.
#include "bench/peer_process.hpp"

#include <array>
#include <cstdio>
#include <memory>

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

}  // namespace troupe::bench
