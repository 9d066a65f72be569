#include "analysis/sites.hpp"

namespace gmem::analysis {
namespace {

const std::string& frame(const trace::Trace& trace, std::uint32_t index) {
  static const std::string none;
  return index < trace.frames.size() ? trace.frames[index] : none;
}

}  // namespace

std::string site_of(const trace::Trace& trace, const trace::Event& event) {
  if (!frame(trace, event.user_frame).empty()) return frame(trace, event.user_frame);
  if (!frame(trace, event.lib_frame).empty()) return frame(trace, event.lib_frame);
  if (!frame(trace, event.scope).empty()) return "scope " + frame(trace, event.scope);
  return trace.frames.size() > 1 ? "<backward>" : "<unknown>";
}

std::string innermost_site_of(const trace::Trace& trace, const trace::Event& event) {
  if (!frame(trace, event.lib_frame).empty()) return frame(trace, event.lib_frame);
  return site_of(trace, event);
}

std::string stack_of(const trace::Trace& trace, const trace::Event& event) {
  // The library frame is the inner one: the user's line called into the library.
  std::string stack = frame(trace, event.lib_frame);
  const std::string& user = frame(trace, event.user_frame);
  if (!user.empty()) stack += (stack.empty() ? "" : "\n") + user;
  const std::string& scope = frame(trace, event.scope);
  if (!scope.empty()) stack += (stack.empty() ? "" : "\n") + ("scope " + scope);
  return stack;
}

}  // namespace gmem::analysis
