// `troupe`: the command line. Subcommands: train, launch, bench, trace, sample, ckpt.
#include <cstdio>
#include <exception>
#include <string>

#include "tools/commands.hpp"

int main(int argc, char** argv) {
  CLI::App app{"troupe: trains transformer language models as a system of actors"};
  app.require_subcommand(1);
  std::function<int()> run;
  auto train = troupe::tools::add_train_command(app);
  auto bench = troupe::tools::add_bench_command(app);
  auto trace = troupe::tools::add_trace_command(app);
  auto launch = troupe::tools::add_launch_command(app);
  auto ckpt = troupe::tools::add_ckpt_command(app);
  auto sample = troupe::tools::add_sample_command(app);
  // An unknown first word: CLI11 would only say that a subcommand is required.
  if (argc > 1 && argv[1][0] != '-') {
    try {
      app.get_subcommand(argv[1]);
    } catch (const CLI::OptionNotFound&) {
      std::fprintf(stderr,
                   "troupe: unknown command '%s' (train, launch, bench, trace, sample or ckpt)\n",
                   argv[1]);
      return troupe::tools::exit_bad_input;
    }
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);  // --help
    // One line naming the option at fault (CLI11's own report adds a "Run with --help" line).
    std::string what = e.what();
    for (char& c : what)
      if (c == '\n') c = ' ';
    std::fprintf(stderr, "troupe: %s\n", what.c_str());
    return troupe::tools::exit_bad_input;
  }
  try {
    if (app.got_subcommand("train")) return train();
    if (app.got_subcommand("bench")) return bench();
    if (app.got_subcommand("trace")) return trace();
    if (app.got_subcommand("launch")) return launch();
    if (app.got_subcommand("ckpt")) return ckpt();
    if (app.got_subcommand("sample")) return sample();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "troupe: error: %s\n", e.what());
    return troupe::tools::exit_failure;
  }
  return troupe::tools::exit_bad_input;
}
