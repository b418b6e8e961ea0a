// `troupe trace render`: the pipeline timeline as SVG - one row per stage track (replica, rank),
// time to the right, F/B/W boxes coloured with their micro-batch number, idle time visible,
// data-parallel collectives on a thin lane under each stage row.
//
// Invariants: the output is one self-contained SVG document (no external fonts, styles or
// scripts) starting with "<svg" and ending with "</svg>\n"; every compute span of the step is
// one <rect class="compute">; all text from the trace is XML-escaped.
#pragma once

#include <string>

#include "engine/trace/trace.hpp"

namespace troupe::engine::trace {

struct render_options {
  int step = -1;  // the step to draw; -1: the last complete step
  int width_px = 1400;
};

// A step is complete when every stage track has compute spans in it and, on each, as many B as
// F (and as many W as B, or none). Throws std::invalid_argument when the trace has no compute
// spans on stage tracks, or when options.step names a step without any (the message lists the
// steps there are).
std::string render_svg(const trace_file& trace, const render_options& options = {});

}  // namespace troupe::engine::trace
