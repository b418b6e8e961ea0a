// `troupe trace summary FILE [--json] [--skip-steps N]` and
// `troupe trace render FILE -o OUT.svg [--step N] [--width PX]`: read a trace written by
// `troupe train --trace` (docs/trace.md).
// Exit 2 with one line on stderr naming the file at fault when nothing could be done: an
// unreadable or malformed trace, no steps left to summarise, a step the trace does not hold, an
// output that would overwrite the input or cannot be written. The SVG is written atomically
// (OUT.tmp, then rename); the input is only ever read.
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <stdexcept>
#include <string>

#include "engine/trace/trace.hpp"
#include "engine/trace/trace_render.hpp"
#include "engine/trace/trace_summary.hpp"
#include "tools/commands.hpp"

namespace troupe::tools {
namespace {

namespace fs = std::filesystem;
namespace trace = engine::trace;

struct trace_options {
  std::string file;
  bool json_output = false;
  int skip_steps = 0;
  std::string output;
  int step = -1;
  int width_px = 1400;
};

int bad_input(const std::string& message) {
  std::fprintf(stderr, "troupe trace: %s\n", message.c_str());
  return exit_bad_input;
}

bool same_file(const fs::path& a, const fs::path& b) {
  std::error_code ec;
  if (fs::exists(a, ec) && fs::exists(b, ec)) return fs::equivalent(a, b, ec);
  return fs::weakly_canonical(a, ec) == fs::weakly_canonical(b, ec);
}

// Writes text to path through path.tmp; returns an empty string or what went wrong.
std::string write_atomically(const fs::path& path, const std::string& text) {
  fs::path tmp = path;
  tmp += ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) return "cannot open " + tmp.string() + " for writing";
    out.write(text.data(), static_cast<std::streamsize>(text.size()));
    out.close();
    if (!out) {
      std::error_code ec;
      fs::remove(tmp, ec);
      return "write failed";
    }
  }
  std::error_code ec;
  fs::rename(tmp, path, ec);
  if (ec) {
    fs::remove(tmp, ec);
    return "cannot rename " + tmp.string() + " into place: " + ec.message();
  }
  return "";
}

int run_summary(const trace_options& o) {
  trace::trace_file t;
  try {
    t = trace::read_json(o.file);
  } catch (const std::runtime_error& e) {
    return bad_input(e.what());
  }
  const trace::summary s = trace::summarize(t, o.skip_steps);
  if (s.steps == 0)
    return bad_input(o.file + ": no steps with compute spans" +
                     (s.skipped_steps > 0
                          ? " after skipping " + std::to_string(o.skip_steps) + " (the trace has " +
                                std::to_string(s.skipped_steps) + ")"
                          : std::string()));
  const std::string text =
      o.json_output ? trace::summary_json(s, t.meta) + "\n" : trace::format_summary(s, t.meta);
  std::fputs(text.c_str(), stdout);
  return exit_ok;
}

int run_render(const trace_options& o) {
  const fs::path input = o.file, output = o.output;
  fs::path tmp = output;
  tmp += ".tmp";
  if (same_file(input, output) || same_file(input, tmp))
    return bad_input(o.output + ": would overwrite the input trace; choose another output");
  trace::trace_file t;
  try {
    t = trace::read_json(input);
  } catch (const std::runtime_error& e) {
    return bad_input(e.what());
  }
  std::string svg;
  try {
    svg = trace::render_svg(t, {o.step, o.width_px});
  } catch (const std::invalid_argument& e) {
    return bad_input(o.file + ": " + e.what());
  }
  if (const std::string problem = write_atomically(output, svg); !problem.empty())
    return bad_input(o.output + ": " + problem);
  std::printf("wrote %s\n", o.output.c_str());
  return exit_ok;
}

}  // namespace

std::function<int()> add_trace_command(CLI::App& app) {
  auto opts = std::make_shared<trace_options>();
  auto* cmd = app.add_subcommand("trace", "Read a trace written by `troupe train --trace`");
  cmd->require_subcommand(1);

  auto* summary = cmd->add_subcommand(
      "summary", "Per-stage busy/idle time, measured vs theoretical bubble, DP overlap");
  summary->add_option("file", opts->file, "Trace JSON file")->required();
  summary->add_flag("--json", opts->json_output, "Print one JSON object");
  summary->add_option("--skip-steps", opts->skip_steps, "Leave out the first N steps (warm-up)")
      ->check(CLI::NonNegativeNumber);

  auto* render = cmd->add_subcommand("render", "Draw one step's pipeline timeline as SVG");
  render->add_option("file", opts->file, "Trace JSON file")->required();
  render->add_option("-o,--output", opts->output, "SVG file to write")->required();
  render
      ->add_option(
          "--step", opts->step,
          "Step to draw, as the trace counts them, from 0 (default: the last complete one)")
      ->check(CLI::NonNegativeNumber);
  render->add_option("--width", opts->width_px, "Image width in px")->check(CLI::Range(400, 20000));

  return [opts, summary]() { return summary->parsed() ? run_summary(*opts) : run_render(*opts); };
}

}  // namespace troupe::tools
