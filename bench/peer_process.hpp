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

// A file of Troupe's checkout that a benchmark runs (a peer script: "bench/x.py"), found
// wherever the checkout lies: under $TROUPE_SOURCE_DIR, under the running program's folder or
// one above it (build/tools/troupe, or a copy of the program beside the checkout's files), under
// the source folder the program was built from, or under the working directory. Throws
// std::runtime_error naming the file and where it looked.
std::string source_file(const std::string& relative);

}  // namespace troupe::bench
