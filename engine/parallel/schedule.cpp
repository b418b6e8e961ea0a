// Pipeline schedules as pure functions: the action-token notation, the four built-in plans
// (GPipe, 1F1B, Megatron's interleaved 1F1B, ZB-H1) and the thread-safe registry that builds
// and checks plans by name. See schedule.hpp for the invariants and docs/schedules.md for why.
#include "engine/parallel/schedule.hpp"

#include <algorithm>
#include <charconv>
#include <map>
#include <mutex>
#include <stdexcept>
#include <utility>

#include "engine/parallel/schedule_sim.hpp"

namespace troupe::engine {

namespace {

char kind_letter(action_kind kind) {
  switch (kind) {
    case action_kind::forward:
      return 'F';
    case action_kind::backward:
      return 'B';
    case action_kind::weight:
      return 'W';
  }
  return '?';
}

[[noreturn]] void bad_token(std::string_view token, const std::string& why) {
  throw std::invalid_argument("bad pipeline action token '" + std::string(token) + "': " + why +
                              " (expected <virtual stage><F|B|W><micro-batch>, e.g. 0F1)");
}

// Parses a non-empty run of at most 9 decimal digits (no sign), so the value fits an int.
int parse_index(std::string_view token, std::string_view digits, const char* what) {
  if (digits.empty()) bad_token(token, std::string("missing ") + what);
  if (digits.size() > 9) bad_token(token, std::string(what) + " too large");
  if (digits.find_first_not_of("0123456789") != std::string_view::npos) {
    bad_token(token, std::string(what) + " is not a number");
  }
  int value = 0;
  const auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), value);
  if (ec != std::errc() || end != digits.data() + digits.size()) {
    bad_token(token, std::string(what) + " is not a number");
  }
  return value;
}

bool is_space(char c) { return c == ' ' || c == '\t' || c == '\r' || c == ','; }

// Splits a line into tokens on whitespace (and commas, as in torchtitan's CSV files).
std::vector<std::string_view> split_tokens(std::string_view line) {
  std::vector<std::string_view> tokens;
  size_t i = 0;
  while (i < line.size()) {
    while (i < line.size() && is_space(line[i])) ++i;
    size_t j = i;
    while (j < line.size() && !is_space(line[j])) ++j;
    if (j > i) tokens.push_back(line.substr(i, j - i));
    i = j;
  }
  return tokens;
}

// Drops a leading "rank N:" (the index is ignored; lines are taken in order).
std::string_view strip_rank_prefix(std::string_view line) {
  const size_t first = line.find_first_not_of(" \t");
  if (first == std::string_view::npos || line.substr(first, 4) != "rank") return line;
  const size_t colon = line.find(':', first);
  if (colon == std::string_view::npos) return line;
  return line.substr(colon + 1);
}

void require_basic_shape(const schedule_shape& shape, const char* schedule) {
  if (shape.ranks < 1 || shape.micro_batches < 1 || shape.virtual_stages < 1) {
    throw std::invalid_argument(
        std::string(schedule) +
        " needs ranks >= 1, micro_batches >= 1 and virtual_stages >= 1 (got "
        "p=" +
        std::to_string(shape.ranks) + ", m=" + std::to_string(shape.micro_batches) +
        ", v=" + std::to_string(shape.virtual_stages) + ")");
  }
}

void require_one_chunk(const schedule_shape& shape, const char* schedule) {
  require_basic_shape(shape, schedule);
  if (shape.virtual_stages != 1) {
    throw std::invalid_argument(std::string(schedule) + " needs virtual_stages == 1 (got v=" +
                                std::to_string(shape.virtual_stages) +
                                "); use interleaved_1f1b for several chunks per rank");
  }
}

pipeline_plan empty_plan(const char* name, const schedule_shape& shape, bool split) {
  pipeline_plan plan;
  plan.name = name;
  plan.shape = shape;
  plan.split_backward = split;
  plan.ranks.resize(static_cast<size_t>(shape.ranks));
  return plan;
}

pipeline_action forward(int k, int mb) { return {action_kind::forward, k, mb}; }
pipeline_action backward(int k, int mb) { return {action_kind::backward, k, mb}; }
pipeline_action weight(int k, int mb) { return {action_kind::weight, k, mb}; }

// Warmup forwards of the non-interleaved 1F1B family on rank r: the number of micro-batches
// that must enter the pipeline before rank r's first backward can possibly be ready.
int warmup_1f1b(const schedule_shape& shape, int rank) {
  return std::min(shape.ranks - rank - 1, shape.micro_batches);
}

}  // namespace

std::string to_token(const pipeline_action& a) {
  return std::to_string(a.virtual_stage) + kind_letter(a.kind) + std::to_string(a.micro_batch);
}

pipeline_action parse_token(std::string_view token) {
  const size_t at = token.find_first_of("FBW");
  if (at == std::string_view::npos) bad_token(token, "no F, B or W");
  pipeline_action a;
  a.kind = token[at] == 'F'   ? action_kind::forward
           : token[at] == 'B' ? action_kind::backward
                              : action_kind::weight;
  a.virtual_stage = parse_index(token, token.substr(0, at), "virtual stage");
  a.micro_batch = parse_index(token, token.substr(at + 1), "micro-batch");
  return a;
}

std::string format_plan(const pipeline_plan& plan) {
  std::string out;
  for (size_t r = 0; r < plan.ranks.size(); ++r) {
    out += "rank " + std::to_string(r) + ":";
    for (const pipeline_action& a : plan.ranks[r]) {
      out += ' ';
      out += to_token(a);
    }
    out += "\n";
  }
  return out;
}

pipeline_plan parse_plan(std::string_view text, const schedule_shape& shape,
                         const std::string& name) {
  pipeline_plan plan;
  plan.name = name;
  plan.shape = shape;
  size_t pos = 0;
  while (pos <= text.size()) {
    size_t eol = text.find('\n', pos);
    if (eol == std::string_view::npos) eol = text.size();
    std::string_view line = text.substr(pos, eol - pos);
    pos = eol + 1;
    if (const size_t hash = line.find('#'); hash != std::string_view::npos) {
      line = line.substr(0, hash);
    }
    const std::string_view body = strip_rank_prefix(line);
    const std::vector<std::string_view> tokens = split_tokens(body);
    // A line that is blank after the comment is dropped; "rank N:" alone is an empty rank.
    if (tokens.empty() && body.size() == line.size()) continue;
    std::vector<pipeline_action>& actions = plan.ranks.emplace_back();
    for (std::string_view token : tokens) {
      actions.push_back(parse_token(token));
      if (actions.back().kind == action_kind::weight) plan.split_backward = true;
    }
  }
  return plan;
}

pipeline_plan plan_gpipe(const schedule_shape& shape) {
  require_one_chunk(shape, "gpipe");
  pipeline_plan plan = empty_plan("gpipe", shape, false);
  for (int r = 0; r < shape.ranks; ++r) {
    for (int j = 0; j < shape.micro_batches; ++j) plan.ranks[r].push_back(forward(r, j));
    for (int j = 0; j < shape.micro_batches; ++j) plan.ranks[r].push_back(backward(r, j));
  }
  return plan;
}

pipeline_plan plan_1f1b(const schedule_shape& shape) {
  require_one_chunk(shape, "1f1b");
  pipeline_plan plan = empty_plan("1f1b", shape, false);
  const int m = shape.micro_batches;
  for (int r = 0; r < shape.ranks; ++r) {
    std::vector<pipeline_action>& out = plan.ranks[r];
    const int warmup = warmup_1f1b(shape, r);
    for (int j = 0; j < warmup; ++j) out.push_back(forward(r, j));
    for (int j = 0; j + warmup < m; ++j) {  // steady: one forward, one backward
      out.push_back(forward(r, j + warmup));
      out.push_back(backward(r, j));
    }
    for (int j = m - warmup; j < m; ++j) out.push_back(backward(r, j));  // cooldown
  }
  return plan;
}

// Megatron-LM's interleaved schedule. Rank r walks m*v "virtual micro-batches" k; k picks the
// chunk (k % (p*v)) / p and the micro-batch (k / (p*v)) * p + k % p, so micro-batches go
// through each chunk in groups of p; backwards walk the chunks in reverse order.
pipeline_plan plan_interleaved_1f1b(const schedule_shape& shape) {
  require_basic_shape(shape, "interleaved_1f1b");
  const int p = shape.ranks, m = shape.micro_batches, v = shape.virtual_stages;
  if (v < 2) {
    throw std::invalid_argument("interleaved_1f1b needs virtual_stages >= 2 (got v=" +
                                std::to_string(v) + "); use 1f1b for one chunk per rank");
  }
  if (m % p != 0) {
    throw std::invalid_argument("interleaved_1f1b needs micro_batches % ranks == 0 (got m=" +
                                std::to_string(m) + ", p=" + std::to_string(p) + ")");
  }
  pipeline_plan plan = empty_plan("interleaved_1f1b", shape, false);
  const int total = m * v;
  const auto micro_batch = [&](int k) { return (k / (p * v)) * p + k % p; };
  const auto chunk = [&](int k, bool fwd) {
    const int c = (k % (p * v)) / p;
    return fwd ? c : v - 1 - c;
  };
  for (int r = 0; r < p; ++r) {
    std::vector<pipeline_action>& out = plan.ranks[r];
    const int warmup = std::min((p - r - 1) * 2 + (v - 1) * p, total);
    const auto fwd = [&](int k) { out.push_back(forward(chunk(k, true) * p + r, micro_batch(k))); };
    const auto bwd = [&](int k) {
      out.push_back(backward(chunk(k, false) * p + r, micro_batch(k)));
    };
    for (int k = 0; k < warmup; ++k) fwd(k);
    for (int k = 0; k + warmup < total; ++k) {
      fwd(k + warmup);
      bwd(k);
    }
    for (int k = total - warmup; k < total; ++k) bwd(k);
  }
  return plan;
}

// ZB-H1 (Qi et al. 2024): 1F1B with the backward split into B (input gradient) and W (weight
// gradient). Rank r delays each W by r backwards, so every rank holds at most p micro-batches
// (the first rank's 1F1B peak) and the delayed W passes fill the cooldown bubbles.
pipeline_plan plan_forward_only(const schedule_shape& shape) {
  pipeline_plan plan;
  plan.name = "forward-only";
  plan.shape = shape;
  plan.ranks.resize(static_cast<std::size_t>(shape.ranks));
  for (int r = 0; r < shape.ranks; ++r)
    for (int j = 0; j < shape.micro_batches; ++j)
      for (int c = 0; c < shape.virtual_stages; ++c)
        plan.ranks[static_cast<std::size_t>(r)].push_back(
            {action_kind::forward, c * shape.ranks + r, j});
  return plan;
}

pipeline_plan plan_zb_h1(const schedule_shape& shape) {
  require_one_chunk(shape, "zb_h1");
  pipeline_plan plan = empty_plan("zb_h1", shape, true);
  const int m = shape.micro_batches;
  for (int r = 0; r < shape.ranks; ++r) {
    std::vector<pipeline_action>& out = plan.ranks[r];
    const int warmup = warmup_1f1b(shape, r);
    int backwards = 0, weights = 0;
    const auto next_backward = [&] {
      out.push_back(backward(r, backwards++));
      if (backwards - weights > r) out.push_back(weight(r, weights++));
    };
    for (int j = 0; j < warmup; ++j) out.push_back(forward(r, j));
    for (int j = warmup; j < m; ++j) {
      out.push_back(forward(r, j));
      next_backward();
    }
    while (backwards < m) next_backward();
    while (weights < m) out.push_back(weight(r, weights++));
  }
  return plan;
}

// ---- registry -----------------------------------------------------------------------------

namespace {

struct schedule_registry {
  std::mutex mutex;
  std::map<std::string, schedule_fn> schedules{
      {"gpipe", plan_gpipe},
      {"1f1b", plan_1f1b},
      {"interleaved_1f1b", plan_interleaved_1f1b},
      {"zb_h1", plan_zb_h1},
  };
};

schedule_registry& registry() {
  static schedule_registry instance;
  return instance;
}

std::string join_names(const std::vector<std::string>& names) {
  std::string out;
  for (const std::string& n : names) out += (out.empty() ? "" : ", ") + n;
  return out;
}

}  // namespace

void register_schedule(const std::string& name, schedule_fn fn) {
  if (name.empty()) throw std::invalid_argument("register_schedule: empty schedule name");
  if (!fn)
    throw std::invalid_argument("register_schedule: schedule '" + name + "' has no function");
  schedule_registry& reg = registry();
  const std::lock_guard lock(reg.mutex);
  reg.schedules[name] = std::move(fn);
}

bool has_schedule(const std::string& name) {
  schedule_registry& reg = registry();
  const std::lock_guard lock(reg.mutex);
  return reg.schedules.count(name) != 0;
}

std::vector<std::string> schedule_names() {
  schedule_registry& reg = registry();
  const std::lock_guard lock(reg.mutex);
  std::vector<std::string> names;
  for (const auto& entry : reg.schedules) names.push_back(entry.first);
  return names;  // std::map keeps them sorted
}

pipeline_plan make_plan(const std::string& name, const schedule_shape& shape) {
  schedule_fn fn;
  {
    schedule_registry& reg = registry();
    const std::lock_guard lock(reg.mutex);
    const auto it = reg.schedules.find(name);
    if (it != reg.schedules.end()) fn = it->second;
  }
  // The function runs outside the lock: a user schedule may itself call make_plan.
  if (!fn) {
    throw std::invalid_argument("unknown pipeline schedule '" + name +
                                "' (known: " + join_names(schedule_names()) + ")");
  }
  try {
    pipeline_plan plan = fn(shape);
    if (plan.name.empty()) plan.name = name;
    const schedule_shape& got = plan.shape;
    if (got.ranks != shape.ranks || got.micro_batches != shape.micro_batches ||
        got.virtual_stages != shape.virtual_stages) {
      throw std::invalid_argument(
          "returned a plan for another shape (p=" + std::to_string(got.ranks) + ", m=" +
          std::to_string(got.micro_batches) + ", v=" + std::to_string(got.virtual_stages) + ")");
    }
    check_plan(plan);
    return plan;
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument("schedule '" + name + "': " + e.what());
  }
}

}  // namespace troupe::engine
