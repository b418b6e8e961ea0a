// `troupe trace summary|render`: placeholder, being written.
#include "tools/commands.hpp"

namespace troupe::tools {

std::function<int()> add_trace_command(CLI::App& app) {
  app.add_subcommand("trace", "read a trace written by `troupe train --trace`");
  return [] { return exit_bad_input; };
}

}  // namespace troupe::tools
