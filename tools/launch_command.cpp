// `troupe launch` (being written).
#include "tools/commands.hpp"

namespace troupe::tools {

std::function<int()> add_launch_command(CLI::App& app) {
  app.add_subcommand("launch", "Start N local processes of one job (being written)");
  return [] { return exit_failure; };
}

}  // namespace troupe::tools
