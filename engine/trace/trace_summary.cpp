// Busy/idle per stage, measured bubble, DP hiding and collective/compute overlap from a trace.
// See trace_summary.hpp for the definitions; docs/trace.md for why they are measured this way.
#include "engine/trace/trace_summary.hpp"

#include <algorithm>
#include <cstdio>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <tuple>
#include <utility>

namespace troupe::engine::trace {
namespace {

using json = nlohmann::ordered_json;
using interval = std::pair<double, double>;  // [start, end) in µs

bool is_span(const event& e, const char* category) {
  return e.kind == event_kind::span && e.category == category;
}

// Length of the union of the intervals, each clipped to [lo, hi].
double covered(std::vector<interval> spans, double lo, double hi) {
  for (auto& s : spans) s = {std::max(s.first, lo), std::min(s.second, hi)};
  std::sort(spans.begin(), spans.end());
  double total = 0, end = lo;
  for (const auto& [a, b] : spans) {
    const double from = std::max(a, end);
    if (b > from) {
      total += b - from;
      end = b;
    }
  }
  return total;
}

// The sorted, disjoint union of the intervals (empty ones dropped).
std::vector<interval> merged(std::vector<interval> spans) {
  std::sort(spans.begin(), spans.end());
  std::vector<interval> out;
  for (const auto& s : spans) {
    if (s.second <= s.first) continue;
    if (!out.empty() && s.first <= out.back().second)
      out.back().second = std::max(out.back().second, s.second);
    else
      out.push_back(s);
  }
  return out;
}

// Length of [lo, hi) covered by a sorted, disjoint union.
double covered_by(const std::vector<interval>& u, double lo, double hi) {
  auto it = std::upper_bound(u.begin(), u.end(), lo,
                             [](double v, const interval& i) { return v < i.second; });
  double total = 0;
  for (; it != u.end() && it->first < hi; ++it)
    total += std::min(it->second, hi) - std::max(it->first, lo);
  return total;
}

// Whether a collective track (nullptr: unknown, serves every stage) serves a stage track: same
// pipeline rank, and same replica when the collective track has one.
bool serves(const track* collective, const track& stage) {
  if (!collective) return true;
  return (collective->rank < 0 || collective->rank == stage.rank) &&
         (collective->replica < 0 || collective->replica == stage.replica);
}

// The step a span without a step field belongs to: the last step whose window starts at or
// before it (the first step for spans before every window).
int step_at(const std::map<int, interval>& windows, double ts) {
  int found = windows.empty() ? -1 : windows.begin()->first;
  double best = -1e300;
  for (const auto& [step, w] : windows)
    if (w.first <= ts && w.first >= best) {
      best = w.first;
      found = step;
    }
  return found;
}

// DP figures (see the header): communication per track holding collective spans; exposed
// communication per (collective track, step) is the SHORTEST dp wait among the stage tracks it
// serves: the replica that finishes compute last waits only for the reductions that were not
// done by then, while earlier replicas also wait for it (load imbalance, not communication).
void add_data_parallel(summary& s, const trace_file& trace, const std::vector<const track*>& stages,
                       const std::function<bool(const event&)>& counts) {
  std::set<int> stage_ids;
  for (const track* t : stages) stage_ids.insert(t->id);
  std::map<int, double> comm_by_track;
  std::map<std::pair<int, int>, double> wait_by_stage_step;
  std::set<int> steps;
  for (const auto& e : trace.events) {
    if (is_span(e, "collective") && counts(e)) {
      comm_by_track[e.track] += e.dur_us;
      s.dp_comm_us += e.dur_us;
    } else if (is_span(e, "wait") && e.name == "dp" && stage_ids.count(e.track) && counts(e)) {
      wait_by_stage_step[{e.track, e.step}] += e.dur_us;
      steps.insert(e.step);
      s.dp_wait_us += e.dur_us;
    }
  }
  std::map<int, const track*> by_id;
  for (const auto& t : trace.tracks) by_id[t.id] = &t;
  for (const auto& [id, comm] : comm_by_track) {
    const auto it = by_id.find(id);
    const track* collective = it == by_id.end() ? nullptr : it->second;
    for (int step : steps) {
      // Per pipeline rank served: the shortest wait over its replicas; then the mean over ranks.
      std::map<int, double> shortest;
      for (const track* t : stages) {
        if (!serves(collective, *t)) continue;
        const auto w = wait_by_stage_step.find({t->id, step});
        const double v = w == wait_by_stage_step.end() ? 0 : w->second;
        const auto [it, fresh] = shortest.emplace(t->rank, v);
        if (!fresh) it->second = std::min(it->second, v);
      }
      double sum = 0;
      for (const auto& [r, v] : shortest) sum += v;
      if (!shortest.empty()) s.dp_exposed_us += sum / static_cast<double>(shortest.size());
    }
  }
  if (s.dp_comm_us > 0)
    s.dp_hidden_fraction = std::clamp(1 - s.dp_exposed_us / s.dp_comm_us, 0.0, 1.0);
}

// Overlap per collective span name (see the header): each counted collective span against the
// merged compute of the stage tracks its track serves, compute of any step.
void add_overlap(summary& s, const trace_file& trace, const std::vector<const track*>& stages,
                 const std::function<bool(const event&)>& counts) {
  std::map<int, std::vector<interval>> compute_by_track;
  for (const auto& e : trace.events)
    if (is_span(e, "compute")) compute_by_track[e.track].push_back({e.ts_us, e.ts_us + e.dur_us});
  std::map<int, const track*> by_id;
  for (const auto& t : trace.tracks) by_id[t.id] = &t;
  std::map<int, std::vector<interval>> served_compute;  // collective track -> merged compute
  std::map<std::string, collective_overlap> by_name;
  std::map<std::string, double> first_start;
  for (const auto& e : trace.events) {
    if (!is_span(e, "collective") || !counts(e)) continue;
    auto served = served_compute.find(e.track);
    if (served == served_compute.end()) {
      const auto it = by_id.find(e.track);
      const track* collective = it == by_id.end() ? nullptr : it->second;
      std::vector<interval> compute;
      for (const track* t : stages) {
        if (!serves(collective, *t)) continue;
        const auto c = compute_by_track.find(t->id);
        if (c != compute_by_track.end())
          compute.insert(compute.end(), c->second.begin(), c->second.end());
      }
      served = served_compute.emplace(e.track, merged(std::move(compute))).first;
    }
    collective_overlap& o = by_name[e.name];
    o.name = e.name;
    ++o.spans;
    o.total_us += e.dur_us;
    o.hidden_us += covered_by(served->second, e.ts_us, e.ts_us + e.dur_us);
    const auto [first, fresh] = first_start.try_emplace(e.name, e.ts_us);
    if (!fresh) first->second = std::min(first->second, e.ts_us);
  }
  for (auto& [name, o] : by_name) s.overlap.push_back(std::move(o));
  std::sort(s.overlap.begin(), s.overlap.end(), [&](const auto& a, const auto& b) {
    return std::pair(first_start.at(a.name), a.name) < std::pair(first_start.at(b.name), b.name);
  });
}

summary summarize_steps(const trace_file& trace, const std::set<int>& counted) {
  summary s;
  s.theory_bubble = trace.meta.theory_bubble;
  const auto stages = sorted_stage_tracks(trace);
  std::map<int, std::size_t> position;  // track id -> index in s.stages
  std::set<int> stage_ids;
  for (const track* t : stages) {
    position[t->id] = s.stages.size();
    stage_ids.insert(t->id);
    stage_summary st;
    st.track = t->id;
    st.name = t->name;
    st.rank = t->rank;
    st.replica = t->replica;
    s.stages.push_back(st);
  }
  const auto windows = pipeline_windows(trace);
  const auto counts = [&](const event& e) {
    return counted.count(e.step >= 0 ? e.step : step_at(windows, e.ts_us)) > 0;
  };

  // Compute: busy per (step, stage track), F/B/W counts and times.
  std::map<std::pair<int, std::size_t>, std::vector<interval>> busy_spans;
  for (const auto& e : trace.events) {
    if (!is_span(e, "compute") || e.step < 0 || !counted.count(e.step)) continue;
    const auto pos = position.find(e.track);
    if (pos == position.end()) continue;
    busy_spans[{e.step, pos->second}].push_back({e.ts_us, e.ts_us + e.dur_us});
    stage_summary& st = s.stages[pos->second];
    if (e.name == "F") {
      ++st.forward_count;
      st.forward_us += e.dur_us;
    } else if (e.name == "B") {
      ++st.backward_count;
      st.backward_us += e.dur_us;
    } else if (e.name == "W") {
      ++st.weight_count;
      st.weight_us += e.dur_us;
    }
  }
  double busy_total = 0;
  for (const auto& [step, w] : windows) {
    if (!counted.count(step)) continue;
    ++s.steps;
    s.window_us += w.second - w.first;
    for (std::size_t i = 0; i < s.stages.size(); ++i) {
      const auto it = busy_spans.find({step, i});
      const double busy = it == busy_spans.end() ? 0 : covered(it->second, w.first, w.second);
      s.stages[i].busy_us += busy;
      s.stages[i].idle_us += (w.second - w.first) - busy;
      busy_total += busy;
    }
  }
  if (s.steps == 0)
    s.measured_bubble = -1;
  else if (s.window_us > 0)
    s.measured_bubble = 1 - busy_total / (double(s.stages.size()) * s.window_us);

  add_data_parallel(s, trace, stages, counts);
  add_overlap(s, trace, stages, counts);
  return s;
}

std::set<int> all_steps(const trace_file& trace) {
  std::set<int> steps;
  for (const auto& [step, w] : pipeline_windows(trace)) steps.insert(step);
  return steps;
}

std::string format(const char* fmt, double value) {
  char buf[64];
  std::snprintf(buf, sizeof buf, fmt, value);
  return buf;
}

std::string percent(double fraction) {
  return fraction < 0 ? std::string("n/a") : format("%.1f%%", 100 * fraction);
}

// Columns in characters, not bytes: names hold "·".
std::size_t display_width(const std::string& text) {
  std::size_t n = 0;
  for (const unsigned char c : text) n += (c & 0xC0) != 0x80;
  return n;
}

std::string pad_right(const std::string& text, std::size_t width) {
  const std::size_t w = display_width(text);
  return text + std::string(w < width ? width - w : 0, ' ');
}

std::string mean_ms(double total_us, int count) {
  return count == 0 ? std::string("-") : format("%.3f", total_us / count / 1000);
}

std::string shape_text(const metadata& meta) {
  std::string text = "schedule " + (meta.schedule.empty() ? std::string("?") : meta.schedule) +
                     ", p=" + std::to_string(meta.ranks) +
                     ", m=" + std::to_string(meta.micro_batches) +
                     ", v=" + std::to_string(meta.virtual_stages);
  if (meta.replicas > 1) text += ", d=" + std::to_string(meta.replicas);
  return text;
}

json or_null(double value) { return value < 0 ? json(nullptr) : json(value); }

}  // namespace

std::vector<const track*> sorted_stage_tracks(const trace_file& trace) {
  std::vector<const track*> stages;
  for (const auto& t : trace.tracks)
    if (t.role == "stage") stages.push_back(&t);
  std::stable_sort(stages.begin(), stages.end(), [](const track* a, const track* b) {
    return std::tuple(a->replica, a->rank, a->id) < std::tuple(b->replica, b->rank, b->id);
  });
  return stages;
}

std::map<int, std::pair<double, double>> pipeline_windows(const trace_file& trace) {
  std::set<int> stage_ids;
  for (const auto& t : trace.tracks)
    if (t.role == "stage") stage_ids.insert(t.id);
  std::map<int, interval> windows;
  for (const auto& e : trace.events) {
    if (!is_span(e, "compute") || e.step < 0 || !stage_ids.count(e.track)) continue;
    const auto [it, fresh] = windows.try_emplace(e.step, e.ts_us, e.ts_us + e.dur_us);
    if (!fresh) {
      it->second.first = std::min(it->second.first, e.ts_us);
      it->second.second = std::max(it->second.second, e.ts_us + e.dur_us);
    }
  }
  return windows;
}

summary summarize(const trace_file& trace, int skip_steps) {
  std::set<int> counted = all_steps(trace);
  int skipped = 0;
  while (skipped < skip_steps && !counted.empty()) {
    counted.erase(counted.begin());
    ++skipped;
  }
  summary s = summarize_steps(trace, counted);
  s.skipped_steps = skipped;
  return s;
}

summary summarize_step(const trace_file& trace, int step) { return summarize_steps(trace, {step}); }

std::string format_summary(const summary& s, const metadata& meta) {
  std::string out;
  if (s.steps == 0) {
    out += "steps: none with compute spans";
    if (s.skipped_steps > 0) out += " after skipping " + std::to_string(s.skipped_steps);
    return out + "\n";
  }
  char line[256];
  out += "steps: " + std::to_string(s.steps);
  if (s.skipped_steps > 0) out += " (" + std::to_string(s.skipped_steps) + " skipped)";
  out += format(", pipeline window %.3f ms per step\n", s.window_us / s.steps / 1000);
  std::size_t name_width = 5;
  for (const auto& st : s.stages) name_width = std::max(name_width, display_width(st.name));
  std::snprintf(line, sizeof line, "%9s %9s %5s %8s %5s %8s %5s %8s\n", "busy ms", "idle ms", "F",
                "mean ms", "B", "mean ms", "W", "mean ms");
  out += pad_right("stage", name_width) + "  " + line;
  for (const auto& st : s.stages) {
    std::snprintf(line, sizeof line, "%9.3f %9.3f %5d %8s %5d %8s %5d %8s\n", st.busy_us / 1000,
                  st.idle_us / 1000, st.forward_count,
                  mean_ms(st.forward_us, st.forward_count).c_str(), st.backward_count,
                  mean_ms(st.backward_us, st.backward_count).c_str(), st.weight_count,
                  mean_ms(st.weight_us, st.weight_count).c_str());
    out += pad_right(st.name, name_width) + "  " + line;
  }
  out += "bubble: measured " + percent(s.measured_bubble) + " · theory " +
         percent(s.theory_bubble) + " (" + shape_text(meta) + ")\n";
  if (s.dp_comm_us > 0) {
    std::snprintf(line, sizeof line, "dp communication: %.2f ms, exposed %.2f ms, hidden %s\n",
                  s.dp_comm_us / 1000, s.dp_exposed_us / 1000,
                  percent(s.dp_hidden_fraction).c_str());
    out += line;
  } else if (s.dp_wait_us > 0) {
    out += format("dp communication: none recorded (dp waits %.2f ms)\n", s.dp_wait_us / 1000);
  } else {
    out += "dp communication: none\n";
  }
  if (!s.overlap.empty()) {
    out += "overlap:";
    for (std::size_t i = 0; i < s.overlap.size(); ++i) {
      const auto& o = s.overlap[i];
      std::snprintf(line, sizeof line, "%s %s %.2f ms, %s hidden%s", i == 0 ? "" : ";",
                    o.name.c_str(), o.total_us / 1000, percent(o.hidden_fraction()).c_str(),
                    i == 0 ? " behind compute" : "");
      out += line;
    }
    out += "\n";
  }
  return out;
}

std::string summary_json(const summary& s, const metadata& meta) {
  json stages = json::array();
  for (const auto& st : s.stages) {
    stages.push_back({{"track", st.track},
                      {"name", st.name},
                      {"rank", st.rank},
                      {"replica", st.replica},
                      {"busy_us", st.busy_us},
                      {"idle_us", st.idle_us},
                      {"forward_count", st.forward_count},
                      {"forward_us", st.forward_us},
                      {"backward_count", st.backward_count},
                      {"backward_us", st.backward_us},
                      {"weight_count", st.weight_count},
                      {"weight_us", st.weight_us}});
  }
  json overlap = json::array();
  for (const auto& o : s.overlap) {
    overlap.push_back({{"name", o.name},
                       {"spans", o.spans},
                       {"total_us", o.total_us},
                       {"hidden_us", o.hidden_us},
                       {"hidden_fraction", or_null(o.hidden_fraction())}});
  }
  const json j = {{"schedule", meta.schedule},
                  {"ranks", meta.ranks},
                  {"micro_batches", meta.micro_batches},
                  {"virtual_stages", meta.virtual_stages},
                  {"replicas", meta.replicas},
                  {"steps", s.steps},
                  {"skipped_steps", s.skipped_steps},
                  {"window_us", s.window_us},
                  {"measured_bubble", or_null(s.measured_bubble)},
                  {"theory_bubble", or_null(s.theory_bubble)},
                  {"dp_comm_us", s.dp_comm_us},
                  {"dp_exposed_us", s.dp_exposed_us},
                  {"dp_wait_us", s.dp_wait_us},
                  {"dp_hidden_fraction", or_null(s.dp_hidden_fraction)},
                  {"overlap", overlap},
                  {"stages", stages}};
  return j.dump(2, ' ', false, json::error_handler_t::replace);
}

}  // namespace troupe::engine::trace
