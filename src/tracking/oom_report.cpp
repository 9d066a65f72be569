// OOM reports: the cause from the evidence (diagnose(), shared with the summary and `gmem leaks`),
// the breakdowns from the live allocations, advice by cause.
#include "gmem/oom_report.hpp"

#include <algorithm>
#include <cstdio>
#include <unordered_map>

#include "common/json.hpp"
#include "gmem/causes.hpp"

namespace gmem {
namespace {

constexpr std::size_t kTop = 10;

std::size_t minus(std::size_t a, std::size_t b) { return a > b ? a - b : 0; }

std::vector<UsageGroup> group_by(const std::vector<LiveAllocation>& live,
                                 std::string (*key_of)(const LiveAllocation&)) {
  std::unordered_map<std::string, UsageGroup> groups;
  for (const LiveAllocation& a : live) {
    UsageGroup& g = groups[key_of(a)];
    g.bytes += a.size;
    ++g.count;
  }
  std::vector<UsageGroup> out;
  for (auto& [key, g] : groups) {
    g.key = key;
    out.push_back(std::move(g));
  }
  std::sort(out.begin(), out.end(), [](const UsageGroup& a, const UsageGroup& b) {
    return a.bytes != b.bytes ? a.bytes > b.bytes : a.key < b.key;
  });
  if (out.size() > kTop) out.resize(kTop);
  return out;
}

std::string scope_key(const LiveAllocation& a) {
  return a.scope != 0 ? scopes::path(a.scope) : std::string("<no scope>");
}
std::string site_key(const LiveAllocation& a) { return site_of(0, a.frames); }

}  // namespace

OomReport build_oom_report(const OomInfo& info, const std::vector<LiveAllocation>& live,
                           const std::vector<LeakFinding>& leaks, bool tracked, std::uint64_t steps) {
  OomReport r;
  r.info = info;
  r.free_in_gmem = minus(info.reserved, info.allocated);
  r.steps = steps;
  if (steps > 0)
    for (const LiveAllocation& a : live)
      if (a.step == steps) r.step_bytes += a.size;
  r.tracked = tracked;
  r.leak_suspects = leaks;
  if (r.leak_suspects.size() > kTop) r.leak_suspects.resize(kTop);
  bool any_scope = false;
  for (const LiveAllocation& a : live) any_scope = any_scope || a.scope != 0;
  if (any_scope) r.by_scope = group_by(live, scope_key);
  if (tracked) r.by_site = group_by(live, site_key);
  std::vector<const LiveAllocation*> largest;
  for (const LiveAllocation& a : live) largest.push_back(&a);
  const std::size_t n = std::min(kTop, largest.size());
  std::partial_sort(largest.begin(), largest.begin() + static_cast<std::ptrdiff_t>(n), largest.end(),
                    [](const LiveAllocation* x, const LiveAllocation* y) {
                      return x->size != y->size ? x->size > y->size : x->addr < y->addr;
                    });
  for (std::size_t k = 0; k < n; ++k) {
    const LiveAllocation& a = *largest[k];
    r.largest.push_back(OomAllocation{a.addr, a.size, a.step,
                                      a.scope != 0 ? scopes::path(a.scope) : std::string(),
                                      a.frames != 0 || a.scope != 0 ? site_of(a.scope, a.frames)
                                                                    : std::string()});
  }
  CauseEvidence evidence;
  evidence.requested = info.requested;
  evidence.allocated = info.allocated;
  evidence.reserved = info.reserved;
  evidence.limit = info.limit;
  evidence.device_total = info.device_total;
  evidence.device_free = info.device_free;
  evidence.largest_free_range = info.largest_free_range;
  evidence.steps = steps;
  evidence.step_bytes = r.step_bytes;
  evidence.leaks = r.leak_suspects;
  Diagnosis d = diagnose(evidence);
  r.cause = d.name;
  r.explanation = std::move(d.evidence);
  r.held_outside = d.held_outside;
  r.advice = std::move(d.advice);
  return r;
}

OomReport build_oom_report(const OomInfo& info, const Tracker* tracker) {
  if (tracker == nullptr) return build_oom_report(info, {}, {}, false);
  TrackerState state = tracker->state();
  return build_oom_report(info, state.live, tracker->leak_suspects(), true, state.step);
}

namespace {

std::string hex(std::uintptr_t v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "0x%jx", static_cast<std::uintmax_t>(v));
  return buf;
}

std::string padded_bytes(std::size_t bytes) {
  std::string s = format_bytes(bytes);
  return std::string(s.size() < 12 ? 12 - s.size() : 0, ' ') + s;
}

void groups_text(std::string& out, const char* title, const std::vector<UsageGroup>& groups) {
  if (groups.empty()) return;
  out += title;
  for (const UsageGroup& g : groups)
    out += "  " + padded_bytes(g.bytes) + "  " + std::to_string(g.count) +
           (g.count == 1 ? " block   " : " blocks  ") + g.key + "\n";
}

}  // namespace

std::string to_text(const OomReport& r) {
  const OomInfo& i = r.info;
  std::string out = "gmem: out of memory: tried to allocate " + format_bytes(i.requested) +
                    " on stream " + hex(i.stream) + "\n";
  out += "  cause: " + r.cause + ": " + r.explanation + "\n";
  out += "  gmem: limit " + format_bytes(i.limit) + ", " + format_bytes(i.reserved) +
         " reserved, " + format_bytes(i.allocated) + " allocated, " +
         format_bytes(r.free_in_gmem) + " free inside gmem (largest free range " +
         format_bytes(i.largest_free_range) + ", reclaimable " + format_bytes(i.reclaimable) +
         ")\n";
  if (i.device_total > 0)
    out += "  device: " + format_bytes(i.device_total) + " total, " +
           format_bytes(i.device_free) + " free, " + format_bytes(r.held_outside) +
           " held outside gmem (CUDA context, NCCL, other processes)\n";
  groups_text(out, "Live memory by scope:\n", r.by_scope);
  groups_text(out, "Live memory by site:\n", r.by_site);
  if (!r.largest.empty()) {
    out += "Largest live allocations:\n";
    for (const OomAllocation& a : r.largest) {
      out += "  " + padded_bytes(a.size) + "  " + hex(a.addr) + "  step " + std::to_string(a.step);
      if (!a.scope.empty()) out += "  " + a.scope;
      if (!a.site.empty() && a.site != a.scope) out += "  " + a.site;
      out += "\n";
    }
  }
  if (!r.leak_suspects.empty()) {
    out += "Leak suspects (memory kept alive grows step after step):\n";
    for (const LeakFinding& f : r.leak_suspects)
      out += "  " + f.site + ": +" + format_bytes(static_cast<std::uint64_t>(f.bytes_per_step)) +
             " per step over " + std::to_string(f.periods) + " steps (" +
             format_bytes(static_cast<std::uint64_t>(f.surviving_bytes)) + " kept" +
             (f.graph_bytes > 0 ? ", " + format_bytes(static_cast<std::uint64_t>(f.graph_bytes)) +
                                      " of it saved for a backward pass that never used it"
                                : std::string()) +
             ")\n";
  }
  if (!r.tracked)
    out += "(enable tracking, gmem.enable_tracking() or gmem_tracking_enable(), to see who holds "
           "the memory)\n";
  out += "What to do:\n";
  for (const std::string& line : r.advice) out += "  - " + line + "\n";
  return out;
}

std::string to_json(const OomReport& r) {
  const OomInfo& i = r.info;
  json::Writer j;
  j.begin_object();
  j.key("request").begin_object();
  j.field("size", i.requested).field("stream", i.stream).end_object();
  j.field("limit", i.limit);
  j.key("device").begin_object();
  j.field("total", i.device_total).field("free", i.device_free);
  j.field("held_outside_gmem", r.held_outside).end_object();
  j.field("reserved", i.reserved).field("allocated", i.allocated);
  j.field("free_in_gmem", r.free_in_gmem).field("largest_free_range", i.largest_free_range);
  j.field("reclaimable", i.reclaimable).field("reason", i.reason);
  j.field("cause", r.cause).field("explanation", r.explanation).field("tracked", r.tracked);
  j.field("steps", r.steps).field("step_bytes", r.step_bytes);
  auto groups = [&](const char* name, const std::vector<UsageGroup>& list) {
    j.key(name).begin_array();
    for (const UsageGroup& g : list)
      j.begin_object().field("key", g.key).field("bytes", g.bytes).field("count", g.count).end_object();
    j.end_array();
  };
  groups("by_scope", r.by_scope);
  groups("by_site", r.by_site);
  j.key("largest").begin_array();
  for (const OomAllocation& a : r.largest)
    j.begin_object().field("addr", a.addr).field("size", a.size).field("step", a.step)
        .field("scope", a.scope).field("site", a.site).end_object();
  j.end_array();
  j.key("leak_suspects").begin_array();
  for (const LeakFinding& f : r.leak_suspects)
    j.begin_object().field("site", f.site).field("bytes_per_step", f.bytes_per_step)
        .field("surviving_bytes", f.surviving_bytes).field("steps", f.periods)
        .field("graph_bytes", f.graph_bytes).end_object();
  j.end_array();
  j.key("advice").begin_array();
  for (const std::string& line : r.advice) j.value(line);
  j.end_array();
  j.end_object();
  return j.take();
}

}  // namespace gmem
