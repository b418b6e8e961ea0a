// The report of `troupe bench transport` (transport_bench.hpp): the table and the JSON. No UCX.
#include <algorithm>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>

#include "bench/transport_bench.hpp"

namespace troupe::bench {

std::string human_bytes(std::size_t b) {
  if (b >= (1u << 20) && b % (1u << 20) == 0) return std::to_string(b >> 20) + " MiB";
  if (b >= 1024 && b % 1024 == 0) return std::to_string(b >> 10) + " KiB";
  return std::to_string(b) + " B";
}

std::string goal_text(const transport_row& row) {
  return row.metric == "bandwidth" ? ">= 90% of peer" : "<= 2x peer";
}

std::string format_transport_report(const transport_bench_report& r) {
  std::string out;
  char line[512];  // one row; the header, whose frame text has no bound, is appended as strings
  out += "transport::ucx_transport vs ucx_perftest, same run, same UCX_TLS: " +
         std::to_string(r.repeats) +
         " ucx_perftest runs a row, each between two of ours (ours, peer, ours, ..., peer, ours)\n"
         "figures: the median run of each side; ratio: the median over the peer's runs of (the "
         "mean of our two runs around it / it); pairs: the lowest and highest of those\n"
         "bandwidth frames: " +
         r.frame + "; ucx_perftest sends the same frame size\n" +
         (r.source == "engine"
              ? "tensor: in the write state of ucx_perftest's send buffer, from our own "
                "allocator (--source engine): over shared memory written, in the engine's "
                "payload storage (huge pages where the kernel gives them; ucx_perftest's are "
                "4 KiB); over tcp mapped and never written, as ucx_perftest's tcp sender never "
                "writes its buffer (the kernel sends its zero page)\n"
          : r.source == "written"
              ? "tensor: written in 4 KiB pages on every transport (--source written); "
                "ucx_perftest's tcp sender still sends from a buffer it never wrote\n"
              : "tensor: in the state of ucx_perftest's send buffer (--source as-peer): written "
                "in 4 KiB pages over shared memory; over tcp mapped and never written, as "
                "ucx_perftest's tcp sender never writes its buffer (the kernel sends its zero "
                "page)\n") +
         "latency: one-way = half a round trip of an 8-byte frame, median (mean)\n\n";
  std::snprintf(line, sizeof line, "%-13s %-8s %-15s %-9s %-22s %-22s %6s  %-11s  %-15s %s\n",
                "metric", "size", "transport", "tensor", "ours", "peer (ucx_perftest)", "ratio",
                "pairs", "goal", "");
  out += line;
  for (const auto& row : r.rows) {
    char a[64], b[64];
    if (row.metric == "bandwidth") {
      std::snprintf(a, sizeof a, "%.2f GB/s", row.ours / 1e9);
      std::snprintf(b, sizeof b, "%.2f GB/s", row.peer / 1e9);
    } else {
      std::snprintf(a, sizeof a, "%.2f us (%.2f)", row.ours, row.ours_mean);
      std::snprintf(b, sizeof b, "%.2f us (%.2f)", row.peer, row.peer_mean);
    }
    // The spread of the pairs' ratios: how far the median could move with the host's noise.
    char pairs[32] = "-";
    if (!row.ratios.empty()) {
      const auto [low, high] = std::minmax_element(row.ratios.begin(), row.ratios.end());
      std::snprintf(pairs, sizeof pairs, "%.2f-%.2fx", *low, *high);
    }
    std::snprintf(line, sizeof line, "%-13s %-8s %-15s %-9s %-22s %-22s %5.2fx  %-11s  %-15s %s\n",
                  row.metric.c_str(), human_bytes(row.payload_bytes).c_str(),
                  row.transports.c_str(), row.tensor.empty() ? "-" : row.tensor.c_str(), a,
                  row.peer > 0 ? b : "failed", row.ratio, pairs, goal_text(row).c_str(),
                  row.met ? "met" : "NOT MET");
    out += line;
    if (!row.peer_error.empty()) out += "  " + row.peer_error + "\n";
  }
  out += "\n";
  for (const bool bandwidth : {true, false}) {
    // The spread of ucx_perftest against itself: a verdict closer to its goal than this is
    // within the host's noise.
    double low = 0, high = 0;
    for (const auto& row : r.rows) {
      if ((row.metric == "bandwidth") != bandwidth) continue;
      for (const double x : row.peer_self_ratios) {
        low = low == 0 ? x : std::min(low, x);
        high = std::max(high, x);
      }
    }
    if (high == 0) continue;
    std::snprintf(line, sizeof line,
                  "noise floor, %s rows: each ucx_perftest run / the row's run before it: "
                  "%.2f-%.2fx\n",
                  bandwidth ? "bandwidth" : "latency", low, high);
    out += line;
  }
  if (r.warmup_ours > 0) {
    char warm[160];
    std::snprintf(warm, sizeof warm,
                  "warm-up pair before the first bandwidth row, not counted: ours %.2f GB/s, "
                  "peer %.2f GB/s\n",
                  r.warmup_ours / 1e9, r.warmup_peer / 1e9);
    out += warm;
  }
  if (r.send_zero_copy_checked)
    out += "payload copies on send: 0 (checked: every frame's iov held the tensor's own pointer)\n";
  if (r.receive_views_checked)
    out +=
        "payload copies after receive: 0 (checked: the peer decoded every frame into views of "
        "the buffer UCX wrote)\n";
  if (r.unwritten_resident_bytes == 0)
    out +=
        "unwritten tensors: 0 bytes resident after every run (checked: every send read the "
        "zero page, as ucx_perftest's tcp sender's)\n";
  else if (r.unwritten_resident_bytes > 0)
    out += "unwritten tensors: " + std::to_string(r.unwritten_resident_bytes) +
           " bytes resident after a run: not in the state of ucx_perftest's buffer\n";
  for (const auto& [kind, range] : r.huge_page_bytes) {
    std::string kib = std::to_string(range.first / 1024);
    if (range.second != range.first) (kib += '-') += std::to_string(range.second / 1024);
    out += kind + " tensors: " + kib +
           " KiB of their mapping in huge pages after a run (smaps AnonHugePages)\n";
  }
  for (const auto& [tls, info] : r.transport_info)
    out += "UCX_TLS=" + tls + " -> endpoint lanes: " + info + "\n";
  return out;
}

std::string transport_report_json(const transport_bench_report& r) {
  nlohmann::json rows = nlohmann::json::array();
  for (const auto& row : r.rows) {
    nlohmann::json j = {{"metric", row.metric},
                        {"transports", row.transports},
                        {"payload_bytes", row.payload_bytes},
                        {"frame_bytes", row.frame_bytes},
                        {"frames", row.frames},
                        {"ours", row.ours},
                        {"peer", row.peer},
                        {"unit", row.metric == "bandwidth" ? "bytes/s" : "us one-way, median"},
                        {"statistic", "median run of each side"},
                        {"ours_best", row.ours_best},
                        {"peer_best", row.peer_best},
                        {"ratio", row.ratio},
                        {"ratios", row.ratios},
                        {"peer_self_ratios", row.peer_self_ratios},
                        {"goal", goal_text(row)},
                        {"met", row.met},
                        {"ours_runs", row.ours_runs},
                        {"peer_runs", row.peer_runs}};
    if (!row.tensor.empty()) j["tensor"] = row.tensor;
    if (row.metric != "bandwidth") {
      j["ours_mean"] = row.ours_mean;
      j["peer_mean"] = row.peer_mean;
    }
    if (!row.peer_error.empty()) j["peer_error"] = row.peer_error;
    rows.push_back(j);
  }
  nlohmann::json out = {{"peer", "ucx_perftest"},
                        {"repeats", r.repeats},
                        {"source", r.source},
                        {"frame", r.frame},
                        {"transport_info", r.transport_info},
                        {"rows", rows}};
  if (r.warmup_ours > 0)
    out["warmup_not_counted"] = {{"ours", r.warmup_ours}, {"peer", r.warmup_peer}};
  if (r.unwritten_resident_bytes >= 0)
    out["unwritten_tensor_resident_bytes"] = r.unwritten_resident_bytes;
  for (const auto& [kind, range] : r.huge_page_bytes)
    out["tensor_huge_page_bytes"][kind] = {{"fewest", range.first}, {"most", range.second}};
  if (r.send_zero_copy_checked) out["payload_copies_on_send"] = 0;
  if (r.receive_views_checked) out["payload_copies_after_receive"] = 0;
  return out.dump(2);
}

}  // namespace troupe::bench
