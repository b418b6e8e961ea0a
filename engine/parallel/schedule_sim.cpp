// The schedule simulator: a structural check of a plan (every action exactly once, on its
// rank, each backward after its forward on that rank), then a list-scheduling run of every
// rank's actions in order against F/B/W costs, reporting deadlocks, makespan, bubbles, held
// activations and pending messages. See schedule_sim.hpp for the dependency rules.
#include "engine/parallel/schedule_sim.hpp"

#include <algorithm>
#include <array>
#include <set>
#include <stdexcept>
#include <string>
#include <utility>

namespace troupe::engine {

namespace {

constexpr size_t kMaxErrors = 50;

void add_error(std::vector<std::string>& errors, std::string message) {
  if (errors.size() < kMaxErrors) {
    errors.push_back(std::move(message));
  } else if (errors.size() == kMaxErrors) {
    errors.push_back("... further errors omitted");
  }
}

// Dense ids for (kind, virtual stage, micro-batch).
struct action_ids {
  int stages = 0, micro_batches = 0;
  size_t size() const { return static_cast<size_t>(3 * stages * micro_batches); }
  size_t operator()(const pipeline_action& a) const {
    return static_cast<size_t>(
        (static_cast<int>(a.kind) * stages + a.virtual_stage) * micro_batches + a.micro_batch);
  }
};

std::string where(int rank, size_t position) {
  return "rank " + std::to_string(rank) + " position " + std::to_string(position);
}

// Where each action was first placed: rank and index in that rank's list (-1: nowhere).
struct placement {
  std::vector<int> rank;
  std::vector<size_t> position;
};

// Range, rank, W-in-non-split and duplicate checks, action by action.
placement check_each_action(const pipeline_plan& plan, const action_ids& ids,
                            std::vector<std::string>& errors) {
  const schedule_shape& shape = plan.shape;
  placement placed{std::vector<int>(ids.size(), -1), std::vector<size_t>(ids.size(), 0)};
  for (int r = 0; r < shape.ranks; ++r) {
    const std::vector<pipeline_action>& actions = plan.ranks[static_cast<size_t>(r)];
    for (size_t i = 0; i < actions.size(); ++i) {
      const pipeline_action& a = actions[i];
      const std::string token = to_token(a);
      if (a.virtual_stage < 0 || a.virtual_stage >= ids.stages || a.micro_batch < 0 ||
          a.micro_batch >= ids.micro_batches) {
        add_error(errors, where(r, i) + ": " + token + " is out of range (virtual stages 0.." +
                              std::to_string(ids.stages - 1) + ", micro-batches 0.." +
                              std::to_string(ids.micro_batches - 1) + ")");
        continue;
      }
      if (a.kind == action_kind::weight && !plan.split_backward) {
        add_error(errors, where(r, i) + ": " + token + " is a W in a non-split plan");
      }
      if (shape.rank_of(a.virtual_stage) != r) {
        add_error(errors, where(r, i) + ": " + token + " is on the wrong rank (virtual stage " +
                              std::to_string(a.virtual_stage) + " runs on rank " +
                              std::to_string(shape.rank_of(a.virtual_stage)) + ")");
      }
      const size_t id = ids(a);
      if (placed.rank[id] >= 0) {
        add_error(errors, where(r, i) + ": duplicate " + token + " (first at " +
                              where(placed.rank[id], placed.position[id]) + ")");
        continue;
      }
      placed.rank[id] = r;
      placed.position[id] = i;
    }
  }
  return placed;
}

// Missing actions, and a B before its F (or a W before its B) on the same rank.
void check_completeness(const pipeline_plan& plan, const action_ids& ids, const placement& placed,
                        std::vector<std::string>& errors) {
  for (int k = 0; k < ids.stages; ++k) {
    for (int j = 0; j < ids.micro_batches; ++j) {
      const pipeline_action f{action_kind::forward, k, j}, b{action_kind::backward, k, j},
          w{action_kind::weight, k, j};
      const int home = plan.shape.rank_of(k);
      const auto expect = [&](const pipeline_action& a) {
        if (placed.rank[ids(a)] < 0) {
          add_error(errors,
                    "missing " + to_token(a) + " (belongs on rank " + std::to_string(home) + ")");
        }
      };
      const auto after = [&](const pipeline_action& later, const pipeline_action& earlier,
                             const char* what) {
        const size_t l = ids(later), e = ids(earlier);
        if (placed.rank[l] >= 0 && placed.rank[l] == placed.rank[e] &&
            placed.position[l] < placed.position[e]) {
          add_error(errors, where(placed.rank[l], placed.position[l]) + ": " + to_token(later) +
                                " comes before its " + what + " " + to_token(earlier) +
                                " (position " + std::to_string(placed.position[e]) + ")");
        }
      };
      expect(f);
      expect(b);
      if (plan.split_backward) expect(w);
      after(b, f, "forward");
      after(w, b, "backward");
    }
  }
}

std::vector<std::string> check_structure(const pipeline_plan& plan) {
  std::vector<std::string> errors;
  const schedule_shape& shape = plan.shape;
  if (shape.ranks < 1 || shape.micro_batches < 1 || shape.virtual_stages < 1) {
    errors.push_back("shape needs ranks, micro_batches and virtual_stages >= 1 (got p=" +
                     std::to_string(shape.ranks) + ", m=" + std::to_string(shape.micro_batches) +
                     ", v=" + std::to_string(shape.virtual_stages) + ")");
    return errors;
  }
  if (plan.ranks.size() != static_cast<size_t>(shape.ranks)) {
    errors.push_back("plan has " + std::to_string(plan.ranks.size()) +
                     " rank lists, the shape has " + std::to_string(shape.ranks) + " ranks");
    return errors;
  }
  const action_ids ids{shape.virtual_stage_count(), shape.micro_batches};
  const placement placed = check_each_action(plan, ids, errors);
  check_completeness(plan, ids, placed, errors);
  return errors;
}

// The actions a must wait for (at most two).
struct dependency_list {
  std::array<pipeline_action, 2> items{};
  int count = 0;
  void add(const pipeline_action& a) { items[static_cast<size_t>(count++)] = a; }
};

dependency_list dependencies(const pipeline_action& a, int virtual_stages) {
  dependency_list deps;
  switch (a.kind) {
    case action_kind::forward:
      if (a.virtual_stage > 0) deps.add({action_kind::forward, a.virtual_stage - 1, a.micro_batch});
      break;
    case action_kind::backward:
      deps.add({action_kind::forward, a.virtual_stage, a.micro_batch});
      if (a.virtual_stage + 1 < virtual_stages)
        deps.add({action_kind::backward, a.virtual_stage + 1, a.micro_batch});
      break;
    case action_kind::weight:
      deps.add({action_kind::backward, a.virtual_stage, a.micro_batch});
      break;
  }
  return deps;
}

// A message from another rank: sent when its producer ends, consumed when a starts.
struct message {
  int receiver = 0;
  double sent = 0, consumed = 0;
};

// Runs every rank's list in order; returns the messages between ranks. Fills the timeline,
// busy times and makespan, or the deadlock report.
class timing_run {
 public:
  timing_run(const pipeline_plan& plan, const action_costs& costs, simulation& out)
      : plan_(plan),
        costs_(costs),
        out_(out),
        ids_{plan.shape.virtual_stage_count(), plan.shape.micro_batches} {}

  std::vector<message> run() {
    const size_t p = plan_.ranks.size();
    end_.assign(ids_.size(), -1.0);
    next_.assign(p, 0);
    clock_.assign(p, 0.0);
    out_.busy.assign(p, 0.0);
    out_.timeline.assign(p, {});
    for (bool progress = true; progress;) {
      progress = false;
      for (size_t r = 0; r < p; ++r) {
        while (next_[r] < plan_.ranks[r].size() && try_start(r)) progress = true;
      }
    }
    for (size_t r = 0; r < p; ++r) {
      if (next_[r] < plan_.ranks[r].size()) report_blocked(r);
      out_.makespan = std::max(out_.makespan, clock_[r]);
    }
    return std::move(messages_);
  }

 private:
  double cost(const pipeline_action& a) const {
    switch (a.kind) {
      case action_kind::forward:
        return costs_.forward;
      case action_kind::backward:
        return plan_.split_backward ? costs_.backward : costs_.backward + costs_.weight;
      case action_kind::weight:
        return costs_.weight;
    }
    return 0;
  }

  // Starts rank r's next action when its inputs are done; false when it must wait.
  bool try_start(size_t r) {
    const pipeline_action& a = plan_.ranks[r][next_[r]];
    const dependency_list deps = dependencies(a, ids_.stages);
    double start = clock_[r];
    for (int d = 0; d < deps.count; ++d) {
      const pipeline_action& dep = deps.items[static_cast<size_t>(d)];
      const double done = end_[ids_(dep)];
      if (done < 0) return false;
      const bool remote = plan_.shape.rank_of(dep.virtual_stage) != static_cast<int>(r);
      start = std::max(start, done + (remote ? costs_.comm_latency : 0.0));
    }
    const double finish = start + cost(a);
    for (int d = 0; d < deps.count; ++d) {
      const pipeline_action& dep = deps.items[static_cast<size_t>(d)];
      if (plan_.shape.rank_of(dep.virtual_stage) != static_cast<int>(r)) {
        messages_.push_back({static_cast<int>(r), end_[ids_(dep)], start});
      }
    }
    end_[ids_(a)] = finish;
    clock_[r] = finish;
    out_.busy[r] += finish - start;
    out_.timeline[r].push_back({a, start, finish});
    ++next_[r];
    return true;
  }

  void report_blocked(size_t r) {
    out_.deadlock = true;
    const pipeline_action& a = plan_.ranks[r][next_[r]];
    std::string line = "rank " + std::to_string(r) + " is blocked at " + to_token(a) + " (action " +
                       std::to_string(next_[r]) + " of " + std::to_string(plan_.ranks[r].size()) +
                       "), waiting for";
    const dependency_list deps = dependencies(a, ids_.stages);
    for (int d = 0; d < deps.count; ++d) {
      const pipeline_action& dep = deps.items[static_cast<size_t>(d)];
      if (end_[ids_(dep)] >= 0) continue;
      line += ' ';
      line += to_token(dep);
      line += " (rank " + std::to_string(plan_.shape.rank_of(dep.virtual_stage)) + ")";
    }
    if (!out_.deadlock_report.empty()) out_.deadlock_report += "; ";
    out_.deadlock_report += line;
  }

  const pipeline_plan& plan_;
  const action_costs& costs_;
  simulation& out_;
  action_ids ids_;
  std::vector<double> end_;  // per action id; -1 until done
  std::vector<size_t> next_;
  std::vector<double> clock_;
  std::vector<message> messages_;
};

// Micro-batch activations held per rank: from an F until the last backward action of that
// (virtual stage, micro-batch), W when split, B otherwise. Depends only on each rank's order.
std::vector<int> peak_in_flight(const pipeline_plan& plan) {
  const action_kind release = plan.split_backward ? action_kind::weight : action_kind::backward;
  std::vector<int> peaks;
  for (const std::vector<pipeline_action>& actions : plan.ranks) {
    int held = 0, peak = 0;
    for (const pipeline_action& a : actions) {
      if (a.kind == action_kind::forward) peak = std::max(peak, ++held);
      if (a.kind == release) --held;
    }
    peaks.push_back(peak);
  }
  return peaks;
}

// Most messages pending at once per receiving rank. At equal times a consumption counts
// before a send, so a message consumed the moment it is sent is never pending.
std::vector<int> peak_link_messages(const std::vector<message>& messages, size_t ranks) {
  std::vector<std::vector<std::pair<double, int>>> events(ranks);
  for (const message& msg : messages) {
    events[static_cast<size_t>(msg.receiver)].emplace_back(msg.sent, +1);
    events[static_cast<size_t>(msg.receiver)].emplace_back(msg.consumed, -1);
  }
  std::vector<int> peaks(ranks, 0);
  for (size_t r = 0; r < ranks; ++r) {
    std::sort(events[r].begin(), events[r].end());
    int pending = 0;
    for (const auto& [time, delta] : events[r]) {
      pending += delta;
      peaks[r] = std::max(peaks[r], pending);
    }
  }
  return peaks;
}

}  // namespace

simulation simulate(const pipeline_plan& plan, const action_costs& costs) {
  if (costs.forward < 0 || costs.backward < 0 || costs.weight < 0 || costs.comm_latency < 0) {
    throw std::invalid_argument("simulate: costs and comm_latency must be >= 0");
  }
  simulation out;
  out.errors = check_structure(plan);
  if (!out.errors.empty()) return out;
  const std::vector<message> messages = timing_run(plan, costs, out).run();
  const size_t p = plan.ranks.size();
  double total_busy = 0;
  for (double b : out.busy) total_busy += b;
  if (out.makespan > 0) {
    out.bubble_fraction = 1.0 - total_busy / (static_cast<double>(p) * out.makespan);
  }
  out.peak_in_flight = peak_in_flight(plan);
  out.peak_link_messages = peak_link_messages(messages, p);
  return out;
}

void check_plan(const pipeline_plan& plan) {
  const simulation sim = simulate(plan);
  const std::string name = "plan '" + plan.name + "'";
  if (!sim.errors.empty()) {
    std::string message = name + ": " + sim.errors.front();
    if (sim.errors.size() > 1) {
      message += " (and " + std::to_string(sim.errors.size() - 1) + " more problems)";
    }
    throw std::invalid_argument(message);
  }
  if (sim.deadlock) throw std::invalid_argument(name + " deadlocks: " + sim.deadlock_report);
}

void check_forward_plan(const pipeline_plan& plan) {
  const auto& sh = plan.shape;
  for (int k = 0; k < sh.ranks; ++k) {
    std::set<std::pair<int, int>> seen;
    for (const auto& a : plan.ranks.at(static_cast<std::size_t>(k))) {
      if (a.kind != action_kind::forward || a.virtual_stage < 0 ||
          a.virtual_stage >= sh.ranks * sh.virtual_stages || a.virtual_stage % sh.ranks != k ||
          a.micro_batch < 0 || a.micro_batch >= sh.micro_batches ||
          !seen.insert({a.virtual_stage, a.micro_batch}).second)
        throw std::invalid_argument("evaluation plan: rank " + std::to_string(k) + " has action " +
                                    to_token(a) +
                                    " (only each chunk's forward of each micro-batch, once)");
    }
    if (static_cast<int>(seen.size()) != sh.virtual_stages * sh.micro_batches)
      throw std::invalid_argument("evaluation plan: rank " + std::to_string(k) + " has " +
                                  std::to_string(seen.size()) + " forwards, expected " +
                                  std::to_string(sh.virtual_stages * sh.micro_batches));
  }
}

}  // namespace troupe::engine
