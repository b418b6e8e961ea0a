// Trace files: Chrome trace-event JSON in and out. See trace.hpp.
//
// Layout of a written file (one event per line, so it greps and diffs):
//   {"traceEvents":[
//   {"ph":"M","name":"process_name",...},
//   {"ph":"M","name":"thread_name","tid":3,"args":{"name":..,"role":..,"rank":..,"replica":..}},
//   {"ph":"M","name":"thread_sort_index","tid":3,"args":{"sort_index":..}},
//   {"ph":"X","cat":"compute","name":"F","tid":3,"ts":..,"dur":..,"args":{"step":..}},
//   ...],
//   "displayTimeUnit":"ms",
//   "otherData":{"format":"troupe-trace","version":1,"schedule":..,...}}
// Invariants: the track list comes back in the order of its thread_name events and the events
// in file order; only args that are >= 0 are written, and absent args read back as -1.
#include "engine/trace/trace.hpp"

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <stdexcept>
#include <tuple>

namespace troupe::engine::trace {
namespace {

using json = nlohmann::ordered_json;

constexpr const char* format_id = "troupe-trace";
constexpr int format_version = 1;
constexpr int process_id = 1;

std::string dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

// Perfetto orders threads by sort index: coordinator and schedule first, then loaders, then
// stages by (replica, rank), then collectives by rank.
int role_order(const std::string& role) {
  static const std::map<std::string, int> order = {
      {"coordinator", 0}, {"schedule", 1}, {"loader", 2}, {"stage", 3}, {"collective", 4}};
  const auto it = order.find(role);
  return it == order.end() ? 5 : it->second;
}

std::map<int, int> sort_indices(const std::vector<track>& tracks) {
  std::vector<const track*> sorted;
  sorted.reserve(tracks.size());
  for (const auto& t : tracks) sorted.push_back(&t);
  std::stable_sort(sorted.begin(), sorted.end(), [](const track* a, const track* b) {
    return std::tuple(role_order(a->role), a->replica, a->rank, a->id) <
           std::tuple(role_order(b->role), b->replica, b->rank, b->id);
  });
  std::map<int, int> index;
  for (std::size_t i = 0; i < sorted.size(); ++i) index[sorted[i]->id] = static_cast<int>(i);
  return index;
}

const char* phase_of(event_kind kind) {
  switch (kind) {
    case event_kind::span:
      return "X";
    case event_kind::instant:
      return "i";
    case event_kind::flow_out:
      return "s";
    case event_kind::flow_in:
      return "f";
  }
  return "X";
}

json event_json(const event& e) {
  json j = {{"ph", phase_of(e.kind)}, {"cat", e.category}, {"name", e.name},
            {"pid", process_id},      {"tid", e.track},    {"ts", e.ts_us}};
  switch (e.kind) {
    case event_kind::span:
      j["dur"] = e.dur_us;
      break;
    case event_kind::instant:
      j["s"] = "t";
      break;
    case event_kind::flow_out:
      j["id"] = e.flow_id;
      break;
    case event_kind::flow_in:
      j["id"] = e.flow_id;
      j["bp"] = "e";
      break;
  }
  json args = json::object();
  if (e.step >= 0) args["step"] = e.step;
  if (e.micro_batch >= 0) args["micro_batch"] = e.micro_batch;
  if (e.virtual_stage >= 0) args["stage"] = e.virtual_stage;
  if (e.bytes >= 0) args["bytes"] = e.bytes;
  if (!args.empty()) j["args"] = std::move(args);
  return j;
}

json metadata_json(const metadata& m) {
  return {{"format", format_id},
          {"version", format_version},
          {"schedule", m.schedule},
          {"ranks", m.ranks},
          {"micro_batches", m.micro_batches},
          {"virtual_stages", m.virtual_stages},
          {"replicas", m.replicas},
          {"theory_bubble", m.theory_bubble},
          {"plan", m.plan}};
}

std::string to_text(const trace_file& trace) {
  std::string out = "{\"traceEvents\":[\n";
  out += dump({{"ph", "M"},
               {"name", "process_name"},
               {"pid", process_id},
               {"args", {{"name", "troupe " + trace.meta.schedule}}}});
  const auto sort_index = sort_indices(trace.tracks);
  for (const auto& t : trace.tracks) {
    out += ",\n";
    out += dump(
        {{"ph", "M"},
         {"name", "thread_name"},
         {"pid", process_id},
         {"tid", t.id},
         {"args", {{"name", t.name}, {"role", t.role}, {"rank", t.rank}, {"replica", t.replica}}}});
    out += ",\n";
    out += dump({{"ph", "M"},
                 {"name", "thread_sort_index"},
                 {"pid", process_id},
                 {"tid", t.id},
                 {"args", {{"sort_index", sort_index.at(t.id)}}}});
  }
  for (const auto& e : trace.events) {
    out += ",\n";
    out += dump(event_json(e));
  }
  out += "\n],\n\"displayTimeUnit\":\"ms\",\n\"otherData\":";
  out += dump(metadata_json(trace.meta));
  out += "}\n";
  return out;
}

// --- reading -------------------------------------------------------------------------------

// nlohmann's messages start with "[json.exception.type_error.302] "; the tag helps no reader.
std::string without_tag(const std::string& what) {
  const auto close = what.find("] ");
  return what.rfind("[json.exception.", 0) == 0 && close != std::string::npos
             ? what.substr(close + 2)
             : what;
}

// Thrown while parsing; read_json prefixes the file name.
struct format_error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

int arg_int(const json& e, const char* key) {
  const auto args = e.find("args");
  if (args == e.end() || !args->is_object()) return -1;
  return args->value(key, -1);
}

std::uint64_t flow_id_of(const json& e, const std::string& where) {
  const auto& id = e.at("id");
  if (id.is_number_unsigned()) return id.get<std::uint64_t>();
  if (id.is_string()) {
    try {
      return std::stoull(id.get<std::string>(), nullptr, 0);
    } catch (const std::exception&) {
    }
  }
  throw format_error(where + ": flow id is not an unsigned integer: " + dump(id));
}

event_kind kind_of(const std::string& ph, const std::string& where) {
  if (ph == "X") return event_kind::span;
  if (ph == "i" || ph == "I") return event_kind::instant;
  if (ph == "s") return event_kind::flow_out;
  if (ph == "f") return event_kind::flow_in;
  throw format_error(where + ": unsupported event phase \"" + ph + "\"");
}

metadata read_metadata(const json& root) {
  const auto other = root.find("otherData");
  if (other == root.end() || !other->is_object())
    throw format_error("not a troupe trace (no otherData object)");
  const std::string format = other->value("format", std::string());
  if (format != format_id)
    throw format_error("not a troupe trace (otherData.format is \"" + format + "\", expected \"" +
                       format_id + "\")");
  const int version = other->value("version", -1);
  if (version != format_version)
    throw format_error("unsupported trace version " + std::to_string(version) +
                       " (this troupe reads " + std::to_string(format_version) + ")");
  metadata m;
  m.schedule = other->value("schedule", m.schedule);
  m.ranks = other->value("ranks", m.ranks);
  m.micro_batches = other->value("micro_batches", m.micro_batches);
  m.virtual_stages = other->value("virtual_stages", m.virtual_stages);
  m.replicas = other->value("replicas", m.replicas);
  m.theory_bubble = other->value("theory_bubble", m.theory_bubble);
  m.plan = other->value("plan", m.plan);
  return m;
}

trace_file parse_trace(const json& root) {
  if (!root.is_object()) throw format_error("not a trace-event object (top level is not {...})");
  const auto events = root.find("traceEvents");
  if (events == root.end()) throw format_error("no traceEvents array");
  if (!events->is_array()) throw format_error("traceEvents is not an array");
  trace_file trace;
  trace.meta = read_metadata(root);
  std::set<int> named;                // tracks with a thread_name event
  std::vector<std::size_t> index_of;  // trace.events[k] is traceEvents[index_of[k]]
  for (std::size_t i = 0; i < events->size(); ++i) {
    const json& e = (*events)[i];
    const std::string where = "traceEvents[" + std::to_string(i) + "]";
    if (!e.is_object()) throw format_error(where + " is not an object");
    try {
      const std::string ph = e.at("ph").get<std::string>();
      if (ph == "M") {
        if (e.value("name", std::string()) != "thread_name") continue;
        const int id = e.at("tid").get<int>();
        if (!named.insert(id).second)
          throw format_error(where + ": a second thread_name for track " + std::to_string(id));
        track& t = trace.tracks.emplace_back();
        t.id = id;
        const json& args = e.at("args");
        t.name = args.at("name").get<std::string>();
        t.role = args.value("role", std::string());
        t.rank = args.value("rank", -1);
        t.replica = args.value("replica", -1);
        continue;
      }
      event ev;
      ev.kind = kind_of(ph, where);
      ev.track = e.at("tid").get<int>();
      ev.category = e.value("cat", std::string());
      ev.name = e.value("name", std::string());
      ev.ts_us = e.at("ts").get<double>();
      if (ev.kind == event_kind::span) {
        ev.dur_us = e.at("dur").get<double>();
        if (!(ev.dur_us >= 0))
          throw format_error(where + " (" + ev.name + "): negative or invalid duration");
      }
      if (ev.kind == event_kind::flow_out || ev.kind == event_kind::flow_in)
        ev.flow_id = flow_id_of(e, where);
      ev.step = arg_int(e, "step");
      ev.micro_batch = arg_int(e, "micro_batch");
      ev.virtual_stage = arg_int(e, "stage");
      if (const auto args = e.find("args"); args != e.end() && args->is_object())
        ev.bytes = args->value("bytes", std::int64_t{-1});
      trace.events.push_back(std::move(ev));
      index_of.push_back(i);
    } catch (const json::exception& x) {
      throw format_error(where + ": " + without_tag(x.what()));
    }
  }
  for (std::size_t k = 0; k < trace.events.size(); ++k) {
    const event& ev = trace.events[k];
    if (!named.count(ev.track))
      throw format_error("traceEvents[" + std::to_string(index_of[k]) + "] (" + ev.category + " " +
                         ev.name + ") names unknown track " + std::to_string(ev.track));
  }
  return trace;
}

}  // namespace

void write_json(const trace_file& trace, const std::filesystem::path& path) {
  const std::string text = to_text(trace);
  std::filesystem::path tmp = path;
  tmp += ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) throw std::runtime_error(path.string() + ": cannot open for writing");
    out.write(text.data(), static_cast<std::streamsize>(text.size()));
    out.close();
    if (!out) {
      std::error_code ec;
      std::filesystem::remove(tmp, ec);
      throw std::runtime_error(path.string() + ": write failed");
    }
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec) {
    std::filesystem::remove(tmp, ec);
    throw std::runtime_error(path.string() + ": cannot rename the temporary file into place");
  }
}

trace_file read_json(const std::filesystem::path& path) {
  const std::string file = path.string();
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) throw std::runtime_error(file + ": no such file");
  if (std::filesystem::is_directory(path, ec))
    throw std::runtime_error(file + ": is a directory, not a trace file");
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error(file + ": cannot open for reading");
  json root;
  try {
    root = json::parse(in);
  } catch (const json::exception& e) {
    throw std::runtime_error(file + ": invalid JSON: " + without_tag(e.what()));
  }
  try {
    return parse_trace(root);
  } catch (const format_error& e) {
    throw std::runtime_error(file + ": " + e.what());
  } catch (const json::exception& e) {
    throw std::runtime_error(file + ": malformed trace: " + without_tag(e.what()));
  }
}

}  // namespace troupe::engine::trace
