// The troupe subcommands. Each registers its options on a CLI11 app and returns an exit code.
#pragma once

#include <CLI/CLI.hpp>
#include <functional>

namespace troupe::tools {

// Exit codes shared by every command.
constexpr int exit_ok = 0;
constexpr int exit_failure = 1;             // the run failed after starting
constexpr int exit_bad_input = 2;           // bad recipe, key, file or argument: nothing was done
constexpr int exit_restarts_exhausted = 3;  // troupe launch: the job failed more often than allowed

// Each returns the function to run when the subcommand was chosen.
std::function<int()> add_train_command(CLI::App& app);
std::function<int()> add_bench_command(CLI::App& app);
std::function<int()> add_trace_command(CLI::App& app);
std::function<int()> add_launch_command(CLI::App& app);
std::function<int()> add_ckpt_command(CLI::App& app);
std::function<int()> add_sample_command(CLI::App& app);

}  // namespace troupe::tools
