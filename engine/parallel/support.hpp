// What a training job cannot combine, as one list. Every refusal of a combination a device
// cannot run (its kernels' limits) comes from here, and so do `troupe train --help-support` and
// the table in docs/support.md (a CLI test checks they are the same), so the documentation
// cannot drift from the code that refuses.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "engine/training/recipe.hpp"

namespace troupe::engine {

// A job as the rules see it: its recipe and how it runs.
struct job_shape {
  const recipe* r = nullptr;
  int processes = 1;           // the job's processes (troupe launch, Slurm, ...)
  bool device_chunks = false;  // stages on device chunks (device "cuda", or host test chunks)
  // Whether the chunks are known (the job is being built); a recipe checked alone does not know
  // whether host test chunks will serve it, so the rules that depend on them wait.
  bool chunks_known = true;
};

struct support_rule {
  std::string feature;                            // what a job asks for: the table's row
  std::string key;                                // the recipe key at fault ("" when the launch is)
  std::string cpu;                                // "yes", or why not
  std::string cuda;                               // the same for device "cuda"
  std::function<bool(const job_shape&)> refused;  // the job asks for it where it is not built
  std::function<std::string(const job_shape&)> why;  // the refusal's text after "key KEY: "
};

const std::vector<support_rule>& support_rules();

// Throws recipe_error ("key KEY: WHY", one line) for the first rule that refuses the job.
void check_support(const job_shape& job);

// The rules as a Markdown table (docs/support.md; `troupe train --help-support`).
std::string format_support_table();

}  // namespace troupe::engine
