// Where a trace allocation came from, as people read it.
#pragma once

#include <string>

#include "gmem/trace.hpp"

namespace gmem::analysis {

// The site of an allocation: its user frame ("capture.py:66:run"), else its library frame, else
// its gmem scope ("scope model.1", from gmem's snapshots), else "<backward>" (PyTorch records no
// Python frame on the autograd thread), or "<unknown>" in a trace that records no frames at all
// (RMM logs).
std::string site_of(const trace::Trace& trace, const trace::Event& event);

// The innermost frame: the library frame when there is one (the layer), else as site_of. For
// "which part of the model holds memory" (summaries), where site_of answers "which line of mine".
std::string innermost_site_of(const trace::Trace& trace, const trace::Event& event);

// Its frames, innermost first, one a line, then its scope ("scope model.1"); "" when none.
std::string stack_of(const trace::Trace& trace, const trace::Event& event);

}  // namespace gmem::analysis
