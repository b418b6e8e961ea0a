// The SVG pipeline timeline of one step. See trace_render.hpp.
//
// Layout, top to bottom: title (schedule, shape, step, measured vs theory bubble), legend, one
// row per stage track sorted by (replica, rank) with its name on the left, a thin lane under a
// row for the "collective" spans that serve it (same rank, and same replica when the collective
// track has one), and a time axis in ms from the start of the step's pipeline window. Inside the
// window each row has a light grey background, so every gap between boxes is idle time.
#include "engine/trace/trace_render.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <stdexcept>
#include <vector>

#include "engine/trace/trace_summary.hpp"

namespace troupe::engine::trace {
namespace {

// Colours: light shade for even model chunks, dark for odd ones (Megatron's interleaved figure).
struct shade {
  const char* light;
  const char* dark;
};
constexpr shade forward_colour{"#8db3e8", "#2f62b0"};
constexpr shade backward_colour{"#8fd19e", "#2d8a45"};
constexpr shade weight_colour{"#f6c760", "#b7800b"};
constexpr shade other_colour{"#c8c8c8", "#7a7a7a"};
constexpr const char* collective_colour = "#9b6bcc";
constexpr const char* window_colour = "#e4e4e4";
constexpr const char* text_colour = "#1c1c1c";

// Geometry in px.
constexpr double left_margin = 16, title_y = 24, subtitle_y = 44, line_height = 18;
constexpr double box_height = 22, lane_gap = 2, lane_height = 7, row_gap = 7, replica_gap = 9;
constexpr double right_margin = 24, axis_height = 40;

std::string xml_escape(const std::string& text) {
  std::string out;
  out.reserve(text.size());
  for (const char c : text) {
    switch (c) {
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '&':
        out += "&amp;";
        break;
      case '"':
        out += "&quot;";
        break;
      case '\'':
        out += "&apos;";
        break;
      default:
        out += c;
    }
  }
  return out;
}

std::string num(double value, int decimals = 2) {
  char buf[48];
  std::snprintf(buf, sizeof buf, "%.*f", decimals, value);
  return buf;
}

std::size_t display_width(const std::string& text) {
  std::size_t n = 0;
  for (const unsigned char c : text) n += (c & 0xC0) != 0x80;
  return n;
}

bool is_span(const event& e, const char* category) {
  return e.kind == event_kind::span && e.category == category;
}

struct step_view {
  int step = -1;
  double window_start = 0, window_end = 0;  // µs
  double view_end = 0;                      // window end or the last collective's end
  std::vector<const track*> rows;           // stage tracks by (replica, rank)
  std::vector<const event*> compute;        // on stage tracks, this step
  std::vector<const event*> collectives;    // this step (or no step, inside its time range)
  bool chunks = false;                      // some compute span is on chunk >= 1
  bool weights = false;                     // some W
};

// The last step in which every stage track ran as many B as F (and as many W as B, or none).
std::optional<int> last_complete_step(const trace_file& trace, const std::set<int>& stage_ids) {
  std::map<int, std::map<int, std::array<int, 3>>> counts;  // step -> track -> F, B, W
  for (const auto& e : trace.events) {
    if (!is_span(e, "compute") || e.step < 0 || !stage_ids.count(e.track)) continue;
    auto& c = counts[e.step][e.track];
    c[0] += e.name == "F";
    c[1] += e.name == "B";
    c[2] += e.name == "W";
  }
  for (auto it = counts.rbegin(); it != counts.rend(); ++it) {
    const auto& tracks = it->second;
    if (tracks.size() == stage_ids.size() &&
        std::all_of(tracks.begin(), tracks.end(), [](const auto& entry) {
          const auto& [f, b, w] = entry.second;
          return f == b && (w == 0 || w == b);
        }))
      return it->first;
  }
  return std::nullopt;
}

int choose_step(const trace_file& trace, const std::set<int>& stage_ids,
                const std::map<int, std::pair<double, double>>& windows, int requested) {
  if (windows.empty())
    throw std::invalid_argument("the trace has no compute spans on stage tracks");
  if (requested >= 0) {
    if (windows.count(requested)) return requested;
    const int first = windows.begin()->first, last = windows.rbegin()->first;
    throw std::invalid_argument(
        "step " + std::to_string(requested) + " has no compute spans (the trace has " +
        (first == last ? "only step " + std::to_string(first)
                       : "steps " + std::to_string(first) + " to " + std::to_string(last)) +
        ")");
  }
  return last_complete_step(trace, stage_ids).value_or(windows.rbegin()->first);
}

step_view view_of(const trace_file& trace, int requested) {
  step_view v;
  v.rows = sorted_stage_tracks(trace);
  std::set<int> stage_ids;
  for (const track* t : v.rows) stage_ids.insert(t->id);
  const auto windows = pipeline_windows(trace);
  v.step = choose_step(trace, stage_ids, windows, requested);
  std::tie(v.window_start, v.window_end) = windows.at(v.step);
  // Spans without a step belong to this step from its window start to the next step's.
  double range_end = std::numeric_limits<double>::infinity();
  for (const auto& [step, w] : windows)
    if (w.first > v.window_start) range_end = std::min(range_end, w.first);
  v.view_end = v.window_end;
  const int ranks = std::max(1, trace.meta.ranks);
  for (const auto& e : trace.events) {
    if (is_span(e, "compute") && e.step == v.step && stage_ids.count(e.track)) {
      v.compute.push_back(&e);
      v.chunks |= e.virtual_stage >= ranks;
      v.weights |= e.name == "W";
    } else if (is_span(e, "collective") &&
               (e.step == v.step ||
                (e.step < 0 && e.ts_us >= v.window_start && e.ts_us < range_end))) {
      v.collectives.push_back(&e);
      v.view_end = std::max(v.view_end, e.ts_us + e.dur_us);
    }
  }
  return v;
}

struct canvas {
  std::string svg;
  double width = 0, plot_left = 0, plot_right = 0;
  double t0 = 0, scale = 1;  // x = plot_left + (t - t0) * scale
  double x(double ts_us) const { return plot_left + (ts_us - t0) * scale; }
  void rect(double x, double y, double w, double h, const char* fill, const char* cls,
            const std::string& title = "") {
    svg += "<rect class=\"" + std::string(cls) + "\" x=\"" + num(x) + "\" y=\"" + num(y) +
           "\" width=\"" + num(w) + "\" height=\"" + num(h) + "\" fill=\"" + fill + "\"";
    svg += title.empty() ? "/>\n" : "><title>" + xml_escape(title) + "</title></rect>\n";
  }
  void text(double x, double y, const std::string& content, const char* anchor = "start",
            const char* extra = "") {
    svg += "<text x=\"" + num(x) + "\" y=\"" + num(y) + "\" text-anchor=\"" + anchor + "\"" +
           extra + ">" + xml_escape(content) + "</text>\n";
  }
};

shade colour_of(const std::string& name) {
  if (name == "F") return forward_colour;
  if (name == "B") return backward_colour;
  if (name == "W") return weight_colour;
  return other_colour;
}

std::string percent(double fraction) {
  return fraction < 0 ? std::string("n/a") : num(100 * fraction, 1) + "%";
}

std::string title_of(const trace_file& trace, const step_view& v) {
  const metadata& m = trace.meta;
  return (m.schedule.empty() ? std::string("pipeline") : m.schedule) +
         " · p=" + std::to_string(m.ranks) + " m=" + std::to_string(m.micro_batches) +
         " v=" + std::to_string(m.virtual_stages) + " d=" + std::to_string(m.replicas) +
         " · step " + std::to_string(v.step);
}

// The step's figures, as phrases joined with " · " and wrapped to the image width.
std::vector<std::string> subtitle_lines(const trace_file& trace, const step_view& v, double width) {
  const summary s = summarize_step(trace, v.step);
  std::vector<std::string> parts = {
      "pipeline window " + num((v.window_end - v.window_start) / 1000) + " ms",
      "bubble measured " + percent(s.measured_bubble) + ", theory " +
          percent(trace.meta.theory_bubble)};
  if (s.dp_hidden_fraction >= 0)
    parts.push_back("data-parallel communication " + num(s.dp_comm_us / 1000) + " ms, " +
                    percent(s.dp_hidden_fraction) + " hidden");
  std::vector<std::string> lines;
  for (const auto& part : parts) {
    if (!lines.empty() && 7.0 * double(display_width(lines.back() + " · " + part)) < width)
      lines.back() += " · " + part;
    else
      lines.push_back(part);
  }
  return lines;
}

// Legend items left to right from baseline y, wrapping at the right margin. Returns the y below.
double draw_legend(canvas& c, const step_view& v, double y) {
  double x = left_margin;
  const auto item = [&](const char* fill, const std::string& label) {
    const double width = 17 + 7.0 * double(display_width(label));
    if (x > left_margin && x + width > c.width - right_margin) {
      x = left_margin;
      y += line_height + 2;
    }
    c.rect(x, y - 10, 12, 12, fill, "legend");
    c.text(x + 17, y, label);
    x += width + 22;
  };
  item(forward_colour.light, "F forward");
  item(backward_colour.light, v.weights ? "B backward (input gradient)" : "B backward");
  if (v.weights) item(weight_colour.light, "W weight gradient");
  if (v.chunks) item(forward_colour.dark, "dark: model chunk 1, 3, ...");
  item(window_colour, "idle (inside the pipeline window)");
  if (!v.collectives.empty()) item(collective_colour, "data-parallel collective");
  return y + 16;
}

// A tick step of 1, 2 or 5 times a power of ten giving about `target` ticks over `range`.
double tick_step(double range, double target) {
  const double raw = range / std::max(target, 1.0);
  const double magnitude = std::pow(10.0, std::floor(std::log10(raw)));
  for (const double f : {1.0, 2.0, 5.0, 10.0})
    if (f * magnitude >= raw) return f * magnitude;
  return 10 * magnitude;
}

void draw_axis(canvas& c, double top, double bottom) {
  const double range_ms = (c.plot_right - c.plot_left) / c.scale / 1000;
  const double step = tick_step(range_ms, (c.plot_right - c.plot_left) / 90);
  if (!(step > 0) || !std::isfinite(step)) return;
  const int decimals = step >= 1 ? 0 : int(std::ceil(-std::log10(step) - 1e-9));
  std::string grid, labels;
  for (int i = 0; i * step <= range_ms * (1 + 1e-9); ++i) {
    const double x = c.plot_left + i * step * 1000 * c.scale;
    grid += "<line x1=\"" + num(x) + "\" y1=\"" + num(top) + "\" x2=\"" + num(x) + "\" y2=\"" +
            num(bottom + 4) + "\" stroke=\"#cfcfcf\" stroke-width=\"0.6\"/>\n";
    c.text(x, bottom + 17, num(i * step, decimals), "middle", " class=\"tick\"");
  }
  c.svg = std::move(grid) + c.svg;
  c.svg += "<line x1=\"" + num(c.plot_left) + "\" y1=\"" + num(bottom) + "\" x2=\"" +
           num(c.plot_right) + "\" y2=\"" + num(bottom) +
           "\" stroke=\"#555\" stroke-width=\"1\"/>\n";
  c.text(c.plot_right, bottom + 33, "time since the start of the step's pipeline window (ms)",
         "end", " class=\"tick\"");
}

bool serves(const track* collective, const track& row) {
  return collective && (collective->rank < 0 || collective->rank == row.rank) &&
         (collective->replica < 0 || collective->replica == row.replica);
}

void draw_box(canvas& c, const trace_file& trace, const event& e, double y) {
  const int ranks = std::max(1, trace.meta.ranks);
  const bool dark = e.virtual_stage >= 0 && (e.virtual_stage / ranks) % 2 == 1;
  const shade colour = colour_of(e.name);
  const double x0 = c.x(e.ts_us), w = std::max(c.x(e.ts_us + e.dur_us) - x0, 0.5);
  std::string title = e.name;
  if (e.micro_batch >= 0) title += " micro-batch " + std::to_string(e.micro_batch);
  if (e.virtual_stage >= 0) title += " · virtual stage " + std::to_string(e.virtual_stage);
  title += " · " + num(e.dur_us / 1000, 3) + " ms";
  c.rect(x0, y, w, box_height, dark ? colour.dark : colour.light, "compute", title);
  if (e.micro_batch < 0) return;
  const std::string label = std::to_string(e.micro_batch);
  if (w < 6.5 * double(label.size()) + 3) return;
  c.text(x0 + w / 2, y + box_height / 2 + 4, label, "middle",
         dark ? " class=\"mb on-dark\"" : " class=\"mb\"");
}

}  // namespace

std::string render_svg(const trace_file& trace, const render_options& options) {
  const step_view v = view_of(trace, options.step);
  std::map<int, const track*> by_id;
  for (const auto& t : trace.tracks) by_id[t.id] = &t;

  canvas c;
  c.width = std::max(options.width_px, 400);
  std::size_t longest = 0;
  for (const track* t : v.rows) longest = std::max(longest, display_width(t->name));
  c.plot_left = std::clamp(7.0 * double(longest) + 24, 80.0, 0.35 * c.width);
  c.plot_right = c.width - right_margin;
  c.t0 = v.window_start;
  c.scale = (c.plot_right - c.plot_left) / std::max(v.view_end - v.window_start, 1e-3);

  c.text(left_margin, title_y, title_of(trace, v), "start", " class=\"title\"");
  double line_y = subtitle_y;
  for (const auto& line : subtitle_lines(trace, v, c.width - left_margin - right_margin)) {
    c.text(left_margin, line_y, line);
    line_y += line_height;
  }
  const double rows_top = draw_legend(c, v, line_y + 4) + 8;
  double y = rows_top;
  for (std::size_t i = 0; i < v.rows.size(); ++i) {
    const track& row = *v.rows[i];
    if (i > 0 && row.replica != v.rows[i - 1]->replica) y += replica_gap;
    c.text(c.plot_left - 8, y + box_height / 2 + 4, row.name, "end");
    c.rect(c.x(v.window_start), y, c.x(v.window_end) - c.x(v.window_start), box_height,
           window_colour, "window");
    for (const event* e : v.compute)
      if (e->track == row.id) draw_box(c, trace, *e, y);
    y += box_height;
    bool lane = false;
    for (const event* e : v.collectives) {
      const auto t = by_id.find(e->track);
      if (!serves(t == by_id.end() ? nullptr : t->second, row)) continue;
      const double x0 = c.x(e->ts_us);
      c.rect(x0, y + lane_gap, std::max(c.x(e->ts_us + e->dur_us) - x0, 0.5), lane_height,
             collective_colour, "collective", e->name + " · " + num(e->dur_us / 1000, 3) + " ms");
      lane = true;
    }
    y += (lane ? lane_gap + lane_height : 0) + row_gap;
  }
  draw_axis(c, rows_top - 4, y);

  const double height = y + axis_height;
  std::string out = "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" + num(c.width, 0) +
                    "\" height=\"" + num(height, 0) + "\" viewBox=\"0 0 " + num(c.width, 0) + " " +
                    num(height, 0) + "\">\n";
  out += "<style>text{font-family:'DejaVu Sans',Helvetica,Arial,sans-serif;font-size:12px;fill:" +
         std::string(text_colour) +
         "}.title{font-size:15px;font-weight:bold}.tick{font-size:11px;fill:#555}"
         ".mb{font-size:11px}.on-dark{fill:#ffffff}"
         ".compute,.collective{stroke:#ffffff;stroke-width:0.8}</style>\n";
  out += "<rect x=\"0\" y=\"0\" width=\"100%\" height=\"100%\" fill=\"#ffffff\"/>\n";
  out += c.svg;
  out += "</svg>\n";
  return out;
}

}  // namespace troupe::engine::trace
