// `troupe ckpt ls|verify|export`: what a checkpoint directory holds (docs/checkpoints.md).
//   ls DIR                  every step directory under DIR (a checkpoint.dir), newest first:
//                           committed or torn, whether it verifies, step, tokens, mesh; one
//                           that does not verify is named with its problem
//   verify DIR              verifies DIR (one step directory) or every committed checkpoint
//                           under it (torn ones are named too); exit 1 if one does not,
//                           naming the file
//   export CHECKPOINT OUT   Hugging Face GPT-2 weights (safetensors) of a checkpoint (a step
//                           directory, or the newest that verifies under a checkpoint.dir);
//                           OUT must not exist
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <string>

#include "engine/model/gpt_weights.hpp"
#include "engine/training/checkpoint.hpp"
#include "engine/training/recipe.hpp"
#include "tools/commands.hpp"

namespace troupe::tools {
namespace {

namespace fs = std::filesystem;

bool is_step_dir(const fs::path& p) { return p.filename().string().starts_with("step-"); }

std::string describe(const engine::checkpoint_state& s) {
  const auto& m = s.mesh;
  std::string mesh = "pp " + std::to_string(m.pp) + " x dp " + std::to_string(m.dp);
  if (m.tp > 1) mesh += " x tp " + std::to_string(m.tp);
  if (m.zero > 0) mesh += ", zero " + std::to_string(m.zero);
  return std::to_string(s.tokens) + " tokens, " + mesh + ", schedule " + s.schedule;
}

int list(const fs::path& root) {
  std::error_code ec;
  if (!fs::is_directory(root, ec)) {
    std::fprintf(stderr, "troupe ckpt: %s is not a directory\n", root.c_str());
    return exit_bad_input;
  }
  const auto all = engine::list_checkpoints(root);
  if (all.empty()) std::printf("%s: no checkpoints\n", root.c_str());
  for (const auto& e : all) {
    if (!e.committed) {
      std::printf(
          "%s  step %d  torn (no manifest: never loaded, not counted toward checkpoint.keep)\n",
          e.dir.filename().c_str(), e.step);
      continue;
    }
    const std::string problem = engine::verify_checkpoint(e.dir);
    if (!problem.empty()) {
      std::printf("%s  step %d  DAMAGED (never loaded, not counted toward checkpoint.keep): %s\n",
                  e.dir.filename().c_str(), e.step, problem.c_str());
      continue;
    }
    std::printf("%s  step %d  ok  %s\n", e.dir.filename().c_str(), e.step,
                describe(engine::read_checkpoint_state(e.dir)).c_str());
  }
  return exit_ok;
}

int verify(const fs::path& where) {
  std::error_code ec;
  if (!fs::is_directory(where, ec)) {
    std::fprintf(stderr, "troupe ckpt: %s is not a directory\n", where.c_str());
    return exit_bad_input;
  }
  std::vector<fs::path> dirs;
  if (is_step_dir(where)) {
    dirs.push_back(where);
  } else {
    for (const auto& e : engine::list_checkpoints(where)) {
      if (e.committed)
        dirs.push_back(e.dir);
      else  // a write that was cut short: never loaded, not a damaged checkpoint
        std::printf("%s: torn (no manifest: never loaded, not counted toward checkpoint.keep)\n",
                    e.dir.c_str());
    }
  }
  if (dirs.empty()) {
    std::fprintf(stderr, "troupe ckpt: no committed checkpoint in %s\n", where.c_str());
    return exit_failure;
  }
  int bad = 0;
  for (const auto& d : dirs) {
    const std::string problem = engine::verify_checkpoint(d);
    if (problem.empty()) {
      std::printf("%s: ok\n", d.c_str());
    } else {
      std::printf("%s: %s\n", d.c_str(), problem.c_str());
      ++bad;
    }
  }
  return bad ? exit_failure : exit_ok;
}

int export_weights(const fs::path& from, const fs::path& out) {
  std::error_code ec;
  if (fs::exists(out, ec)) {
    std::fprintf(stderr, "troupe ckpt: %s exists; not overwritten\n", out.c_str());
    return exit_bad_input;
  }
  fs::path dir;
  try {
    dir = engine::find_checkpoint(
        from, [](const std::string& s) { std::fprintf(stderr, "troupe ckpt: %s\n", s.c_str()); });
  } catch (const std::exception& e) {
    std::fprintf(stderr, "troupe ckpt: %s\n", e.what());
    return exit_bad_input;
  }
  if (engine::checkpoint_format(dir) == engine::checkpoint_parts_version) {
    // Parts (format 2): put together for the model its trainer state names, written whole.
    try {
      const auto state = engine::read_checkpoint_state(dir);
      const auto model =
          state.model ? *state.model
                      : engine::parse_recipe(state.recipe_text,
                                             (dir / "trainer_state.json").string(), state.overrides)
                            .model;
      engine::gpt_chunk whole(model, engine::chunk_range::whole(model));
      const auto values =
          engine::load_checkpoint_tensors(dir, "model", model, engine::chunk_range::whole(model));
      std::copy(values.begin(), values.end(), whole.params());
      engine::save_hf_weights(whole, out);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "troupe ckpt: %s\n", e.what());
      return exit_failure;
    }
    std::printf("wrote %s (Hugging Face GPT-2 weights of %s)\n", out.c_str(), dir.c_str());
    return exit_ok;
  }
  // model.safetensors is Hugging Face GPT-2 layout already; copied through a temporary name.
  const fs::path tmp = out.string() + ".tmp";
  fs::copy_file(dir / "model.safetensors", tmp, fs::copy_options::overwrite_existing, ec);
  if (!ec) fs::rename(tmp, out, ec);
  if (ec) {
    fs::remove(tmp);
    std::fprintf(stderr, "troupe ckpt: %s: %s\n", out.c_str(), ec.message().c_str());
    return exit_failure;
  }
  std::printf("wrote %s (Hugging Face GPT-2 weights of %s)\n", out.c_str(), dir.c_str());
  return exit_ok;
}

}  // namespace

std::function<int()> add_ckpt_command(CLI::App& app) {
  struct options {
    std::string dir, out;
  };
  auto opts = std::make_shared<options>();
  auto* cmd = app.add_subcommand("ckpt", "List, verify or export checkpoints");
  cmd->require_subcommand(1);
  auto* ls = cmd->add_subcommand("ls", "List the checkpoints of a checkpoint directory");
  ls->add_option("dir", opts->dir, "A checkpoint directory (the recipe's checkpoint.dir)")
      ->required();
  auto* ver = cmd->add_subcommand(
      "verify", "Verify a checkpoint (a step directory) or every one of a checkpoint directory");
  ver->add_option("dir", opts->dir, "A step directory, or a checkpoint directory")->required();
  auto* exp = cmd->add_subcommand("export",
                                  "Write a checkpoint's weights as Hugging Face GPT-2 safetensors");
  exp->add_option("checkpoint", opts->dir,
                  "A step directory, or a checkpoint directory (its newest that verifies)")
      ->required();
  exp->add_option("out", opts->out, "The safetensors file to write (must not exist)")->required();
  return [opts, ls, ver, exp]() -> int {
    if (ls->parsed()) return list(opts->dir);
    if (ver->parsed()) return verify(opts->dir);
    if (exp->parsed()) return export_weights(opts->dir, opts->out);
    return exit_bad_input;
  };
}

}  // namespace troupe::tools
