// `troupe trace render`: the pipeline timeline as SVG - one row per stage track (replica, rank),
// time to the right, F/B/W boxes coloured with their micro-batch number, idle time visible,
// data-parallel collectives on a thin lane under each stage row.
#pragma once

#include <string>

#include "engine/trace.hpp"

namespace troupe::engine::trace {

struct render_options {
  int step = -1;       // the step to draw; -1: the last complete step
  int width_px = 1400;
};

std::string render_svg(const trace_file& trace, const render_options& options = {});

}  // namespace troupe::engine::trace
