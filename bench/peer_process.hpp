// Running a peer benchmark (a Python script, a vendor tool) as a shell command and reading the
// one JSON object it prints last.
#pragma once

#include <nlohmann/json.hpp>
#include <optional>
#include <string>

namespace troupe::bench {

// Runs a shell command; its stdout, or nullopt when it cannot start or exits non-zero.
std::optional<std::string> capture_command(const std::string& command);
// The last JSON object ({...} from the last '{') of a command's stdout, or nullopt.
std::optional<nlohmann::json> last_json_object(const std::string& text);

}  // namespace troupe::bench
