// LeakReport for people and as JSON.
#include <sstream>

#include "common/json.hpp"
#include "gmem/error.hpp"
#include "gmem/leaks.hpp"

namespace gmem {
namespace {

std::string bytes(std::int64_t n) {
  return n < 0 ? "-" + format_bytes(static_cast<std::uint64_t>(-n)) : format_bytes(static_cast<std::uint64_t>(n));
}

}  // namespace

std::string format_leaks(const LeakReport& report) {
  std::ostringstream out;
  out << "Leaks in " << report.trace_name << ": " << report.periods << " step boundaries";
  if (report.periods > 0) out << " (from " << report.period_source << ")";
  out << "\n";
  if (report.leaks.empty()) {
    out << "No leaks found: no site keeps more memory alive step after step.\n";
    return out.str();
  }
  out << report.leaks.size() << (report.leaks.size() == 1 ? " site keeps" : " sites keep")
      << " more memory alive every step:\n";
  for (const LeakFinding& leak : report.leaks) {
    out << "\n" << leak.site << "\n"
        << "  grows " << bytes(leak.bytes_per_step) << " a step since step " << leak.first_step
        << " (grew in " << leak.growing_periods << " of " << leak.periods << " steps); "
        << bytes(leak.surviving_bytes) << " survive\n";
    if (leak.sample.size > 0) {
      out << "  first leaked block still live: " << bytes(static_cast<std::int64_t>(leak.sample.size))
          << " at 0x" << std::hex << leak.sample.addr << std::dec << ", allocated at "
          << leak.sample.time_us << " us\n";
      std::istringstream frames(leak.sample.stack);
      for (std::string frame; std::getline(frames, frame);) out << "    " << frame << "\n";
    }
  }
  return out.str();
}

std::string leaks_json(const LeakReport& report) {
  json::Writer w;
  w.begin_object()
      .field("trace", std::string_view(report.trace_name))
      .field("periods", std::uint64_t{report.periods})
      .field("period_source", std::string_view(report.period_source));
  w.key("leaks").begin_array();
  for (const LeakFinding& leak : report.leaks) {
    w.begin_object()
        .field("site", std::string_view(leak.site))
        .field("bytes_per_step", leak.bytes_per_step)
        .field("surviving_bytes", leak.surviving_bytes)
        .field("first_seen_us", leak.first_seen_us)
        .field("first_step", std::uint64_t{leak.first_step})
        .field("periods", std::uint64_t{leak.periods})
        .field("growing_periods", std::uint64_t{leak.growing_periods});
    w.key("sample")
        .begin_object()
        .field("addr", leak.sample.addr)
        .field("size", leak.sample.size)
        .field("time_us", leak.sample.time_us)
        .field("stack", std::string_view(leak.sample.stack))
        .end_object();
    w.end_object();
  }
  w.end_array().end_object();
  return w.str() + "\n";
}

}  // namespace gmem
