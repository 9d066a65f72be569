// The observability C API (include/gmem/gmem_observe.h): one tracker per device, switched on
// with gmem_tracking_enable; scopes and frames per thread; snapshots and OOM reports.
#include "gmem/gmem_observe.h"

#include <atomic>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "capi/observe.hpp"
#include "common/json.hpp"
#include "gmem/error.hpp"
#include "gmem/leaks.hpp"
#include "gmem/oom_report.hpp"
#include "gmem/scope.hpp"
#include "gmem/snapshot.hpp"
#include "gmem/tracker.hpp"

namespace gmem::capi {
namespace {

// The context's tracker slot, read by queries while another thread may switch tracking on or
// off: always through atomic_ref. (Mallocs and frees do not read it: the engine records into
// the attached tracker itself.)
std::atomic_ref<Tracker*> slot(DeviceContext& context) {
  return std::atomic_ref<Tracker*>(context.tracker);
}

// Trackers are never destroyed: a thread may still be reading one that tracking has just been
// switched away from. (Each enable after a disable makes a new one.)
struct Observers {
  std::mutex mutex;
  std::vector<std::unique_ptr<Tracker>> trackers;
  std::map<int, OomReport> oom_reports;  // the last per device
  int last_oom_device = -1;
};

Observers& observers() {
  static Observers* const instance = new Observers;  // outlives static destructors, as the engines
  return *instance;
}

bool append_report_to_error() {
  const char* value = std::getenv("GMEM_OOM_REPORT");
  return value == nullptr || std::string(value) != "0";
}

OomReport report_for(DeviceContext& context, const OomInfo& info) {
  if (const Tracker* tracker = slot(context).load(std::memory_order_acquire))
    return build_oom_report(info, tracker);
  std::vector<LiveAllocation> live;  // untracked: the engine's blocks, without scopes or sites
  context.engine->for_each_block([&](const BlockInfo& b) {
    LiveAllocation a;
    a.addr = reinterpret_cast<std::uintptr_t>(b.ptr);
    a.size = b.size;
    a.requested = b.requested;
    a.stream = b.stream;
    live.push_back(a);
  });
  return build_oom_report(info, live, {}, false);
}

// The report without its first line, which repeats what the error message already says.
std::string report_tail(const OomReport& report) {
  const std::string text = to_text(report);
  const std::size_t newline = text.find('\n');
  return newline == std::string::npos ? std::string() : text.substr(newline + 1);
}

const char* text_or_empty(const char* text) { return text != nullptr ? text : ""; }

template <class Visit>
void for_each_tracker(Visit visit) {
  for_each_context([&](DeviceContext& context) {
    if (Tracker* tracker = slot(context).load(std::memory_order_acquire)) visit(*tracker);
  });
}

std::string oom_report(int device, bool json) {
  Observers& o = observers();
  std::lock_guard lock(o.mutex);
  const int index = device == -1 ? o.last_oom_device : context(device).index;
  auto it = o.oom_reports.find(index);
  if (it == o.oom_reports.end()) return {};
  return json ? to_json(it->second) : to_text(it->second);
}

// The tracker's findings as `gmem leaks` reports a trace's: steps from gmem_step, times from when
// tracking began.
LeakReport live_leaks(int device) {
  DeviceContext& context = gmem::capi::context(device);
  const Tracker* tracker = slot(context).load(std::memory_order_acquire);
  if (tracker == nullptr)
    throw Error(Errc::invalid_argument, "device " + std::to_string(context.index) +
                                            " is not tracked: enable tracking first "
                                            "(gmem_tracking_enable, gmem.enable_tracking())");
  LeakReport report;
  report.trace_name = "device " + std::to_string(context.index);
  report.leaks = tracker->leak_suspects();
  report.periods = tracker->current_step();
  report.period_source = "gmem.step() markers";
  report.steps_marked = true;
  report.start_us = tracker->started_us();
  report.looked_at = "the allocations since tracking began (" + std::to_string(tracker->live_count()) +
                     " live now)";
  return report;
}

// leaks_json's object with "text" added: one report, two forms.
std::string live_leaks_json(int device) {
  const LeakReport report = live_leaks(device);
  std::string body = leaks_json(report);
  json::Writer text;
  text.begin_object().field("text", format_leaks(report));
  return text.str() + "," + body.substr(1);
}

}  // namespace

void* observed_malloc(DeviceContext& context, std::size_t size, StreamId stream) {
  try {
    return context.engine->malloc(size, stream);
  } catch (const OutOfMemoryError& e) {
    OomReport report = report_for(context, e.info());
    const std::string tail = report_tail(report);
    {
      Observers& o = observers();
      std::lock_guard lock(o.mutex);
      o.oom_reports[context.index] = std::move(report);
      o.last_oom_device = context.index;
    }
    if (!append_report_to_error()) throw;
    throw Error(Errc::out_of_memory, std::string(e.what()) + "\n" + tail);
  }
}

std::vector<TopAllocation> tracked_top(DeviceContext& context, std::size_t n) {
  const Tracker* tracker = slot(context).load(std::memory_order_acquire);
  if (tracker == nullptr) return {};
  std::vector<UsageGroup> groups = tracker->usage_by_scope(n);
  if (groups.size() == 1 && groups[0].key == "<no scope>") groups = tracker->usage_by_site(n);
  std::vector<TopAllocation> top;
  for (const UsageGroup& g : groups)
    top.push_back(TopAllocation{g.key, static_cast<std::int64_t>(g.bytes),
                                static_cast<std::int64_t>(g.count), 0});
  return top;
}

std::string tracked_cause(DeviceContext& context, const MemoryStats& stats) {
  const Tracker* tracker = slot(context).load(std::memory_order_acquire);
  if (tracker == nullptr) return {};
  return summary_cause(stats, tracker->leak_suspects(), tracker->current_step());
}

}  // namespace gmem::capi

using gmem::capi::copy_text_out;
using gmem::capi::run_guarded;

extern "C" {

gmem_status_t gmem_tracking_enable(int device, size_t history_capacity, int stacks) {
  return run_guarded("gmem_tracking_enable", [&] {
    if (stacks < GMEM_STACKS_THREAD || stacks > GMEM_STACKS_PYTHON)
      throw gmem::Error(gmem::Errc::invalid_argument,
                        "stacks must be GMEM_STACKS_THREAD (0), _CPP (1) or _PYTHON (2), not " +
                            std::to_string(stacks));
    gmem::capi::DeviceContext& context = gmem::capi::context(device);
    gmem::capi::Observers& o = gmem::capi::observers();
    std::lock_guard lock(o.mutex);
    if (gmem::capi::slot(context).load() != nullptr) return;
    gmem::TrackerOptions options;
    if (history_capacity != 0) options.history_capacity = history_capacity;
    options.capture_backtrace = stacks == GMEM_STACKS_CPP;
    options.capture_python = stacks == GMEM_STACKS_PYTHON;
    o.trackers.push_back(std::make_unique<gmem::Tracker>(*context.engine, options));
    gmem::capi::slot(context).store(o.trackers.back().get(), std::memory_order_release);
  });
}

gmem_status_t gmem_python_stacks_skip(const char* prefix) {
  return run_guarded("gmem_python_stacks_skip", [&] {
    gmem::frames::skip_python_files(prefix != nullptr ? prefix : "");
  });
}

gmem_status_t gmem_tracking_disable(int device) {
  return run_guarded("gmem_tracking_disable", [&] {
    gmem::capi::DeviceContext& context = gmem::capi::context(device);
    std::lock_guard lock(gmem::capi::observers().mutex);
    if (gmem::Tracker* tracker = gmem::capi::slot(context).load()) tracker->detach();
    gmem::capi::slot(context).store(nullptr, std::memory_order_release);
  });
}

int gmem_tracking_enabled(int device) {
  int enabled = -1;
  run_guarded("gmem_tracking_enabled", [&] {
    enabled = gmem::capi::slot(gmem::capi::context(device)).load() != nullptr ? 1 : 0;
  });
  return enabled;
}

gmem_status_t gmem_scope_push(const char* name) {
  return run_guarded("gmem_scope_push",
                     [&] { gmem::scopes::push(gmem::capi::text_or_empty(name)); });
}

gmem_status_t gmem_scope_push_module(const char* module_path) {
  return run_guarded("gmem_scope_push_module",
                     [&] { gmem::scopes::push_module(gmem::capi::text_or_empty(module_path)); });
}

gmem_status_t gmem_scope_pop(void) {
  gmem::scopes::pop();
  return GMEM_OK;
}

size_t gmem_scope_depth(void) { return gmem::scopes::depth(); }

gmem_status_t gmem_scope_pop_to(size_t depth) {
  gmem::scopes::pop_to(depth);
  return GMEM_OK;
}

gmem_status_t gmem_set_frames(const char* frames) {
  return run_guarded("gmem_set_frames",
                     [&] { gmem::frames::set_current(gmem::capi::text_or_empty(frames)); });
}

uint32_t gmem_current_frames(void) { return gmem::frames::current(); }

gmem_status_t gmem_restore_frames(uint32_t id) {
  gmem::frames::set_current(static_cast<gmem::FramesId>(id));
  return GMEM_OK;
}

gmem_status_t gmem_step(void) {
  return run_guarded("gmem_step",
                     [] { gmem::capi::for_each_tracker([](gmem::Tracker& t) { t.step(); }); });
}

int gmem_graph_saved(const void* ptr, int saved) {
  int marked = -1;
  run_guarded("gmem_graph_saved", [&] {
    gmem_engine* owner = gmem::capi::likely_owner(ptr);
    gmem::capi::DeviceContext* context = owner != nullptr ? owner->context : nullptr;
    gmem::Tracker* tracker =
        context != nullptr ? gmem::capi::slot(*context).load(std::memory_order_acquire) : nullptr;
    marked = tracker != nullptr &&
                     tracker->mark_saved(reinterpret_cast<std::uintptr_t>(ptr), saved != 0) ? 1 : 0;
  });
  return marked;
}

gmem_status_t gmem_graph_backward(void) {
  return run_guarded("gmem_graph_backward",
                     [] { gmem::capi::for_each_tracker([](gmem::Tracker& t) { t.note_backward(); }); });
}

gmem_status_t gmem_annotate(const char* text) {
  return run_guarded("gmem_annotate", [&] {
    const std::string note = gmem::capi::text_or_empty(text);
    gmem::capi::for_each_tracker([&](gmem::Tracker& t) { t.annotate(note); });
  });
}

gmem_status_t gmem_snapshot_json(int device, char* buf, size_t size, size_t* needed) {
  return run_guarded("gmem_snapshot_json", [&] {
    gmem::capi::DeviceContext& context = gmem::capi::context(device);
    const gmem::Tracker* tracker = gmem::capi::slot(context).load(std::memory_order_acquire);
    copy_text_out(gmem::snapshot_json(gmem::take_snapshot(*context.engine, tracker)), buf, size,
                  needed);
  });
}

gmem_status_t gmem_snapshot_pickle(int device, const char* path) {
  return run_guarded("gmem_snapshot_pickle", [&] {
    if (path == nullptr || *path == '\0')
      throw gmem::Error(gmem::Errc::invalid_argument, "path is NULL or empty");
    gmem::capi::DeviceContext& context = gmem::capi::context(device);
    const gmem::Tracker* tracker = gmem::capi::slot(context).load(std::memory_order_acquire);
    gmem::write_snapshot_pickle(gmem::take_snapshot(*context.engine, tracker), path);
  });
}

gmem_status_t gmem_oom_report_text(int device, char* buf, size_t size, size_t* needed) {
  return run_guarded("gmem_oom_report_text", [&] {
    copy_text_out(gmem::capi::oom_report(device, false), buf, size, needed);
  });
}

gmem_status_t gmem_oom_report_json(int device, char* buf, size_t size, size_t* needed) {
  return run_guarded("gmem_oom_report_json", [&] {
    copy_text_out(gmem::capi::oom_report(device, true), buf, size, needed);
  });
}

gmem_status_t gmem_leaks_text(int device, char* buf, size_t size, size_t* needed) {
  return run_guarded("gmem_leaks_text", [&] {
    copy_text_out(gmem::format_leaks(gmem::capi::live_leaks(device)), buf, size, needed);
  });
}

gmem_status_t gmem_top_sites_json(int device, size_t n, char* buf, size_t size, size_t* needed) {
  return run_guarded("gmem_top_sites_json", [&] {
    gmem::capi::DeviceContext& context = gmem::capi::context(device);
    const gmem::Tracker* tracker = gmem::capi::slot(context).load(std::memory_order_acquire);
    gmem::json::Writer w;
    w.begin_array();
    if (tracker != nullptr)
      for (const gmem::UsageGroup& g : tracker->usage_by_site(n))
        w.begin_object()
            .field("site", std::string_view(g.key))
            .field("bytes", std::uint64_t{g.bytes})
            .field("count", std::uint64_t{g.count})
            .end_object();
    w.end_array();
    copy_text_out(w.str(), buf, size, needed);
  });
}

gmem_status_t gmem_live_blocks_json(int device, const char* site, char* buf, size_t size,
                                    size_t* needed) {
  // For the Python layer's holder search (python/gmem/holders.py): the live blocks without the
  // history a snapshot carries, which costs a second to turn into Python objects.
  return run_guarded("gmem_live_blocks_json", [&] {
    gmem::capi::DeviceContext& context = gmem::capi::context(device);
    const gmem::Tracker* tracker = gmem::capi::slot(context).load(std::memory_order_acquire);
    const std::string_view wanted = site != nullptr ? site : "";
    gmem::json::Writer w;
    w.begin_object().field("tracked", tracker != nullptr);
    w.key("blocks").begin_array();
    if (tracker != nullptr) {
      const gmem::TrackerState state = tracker->state();
      std::map<std::uint64_t, std::string> sites;  // (scope, frames) -> site, made once each
      for (const gmem::LiveAllocation& a : state.live) {
        const std::uint64_t key = (std::uint64_t{a.scope} << 32) | a.frames;
        auto it = sites.find(key);
        if (it == sites.end()) it = sites.emplace(key, gmem::site_of(a.scope, a.frames)).first;
        if (!wanted.empty() && it->second != wanted) continue;
        w.begin_object()
            .field("address", std::uint64_t{a.addr})
            .field("size", std::uint64_t{a.size})
            .field("step", std::uint64_t{a.step})
            .field("site", std::string_view(it->second))
            .field("saved_for_backward", a.saved_for_backward)
            .end_object();
      }
      w.end_array().field("step", std::uint64_t{state.step});
    } else {
      context.engine->for_each_block([&](const gmem::BlockInfo& b) {
        if (!wanted.empty()) return;
        w.begin_object()
            .field("address", std::uint64_t{reinterpret_cast<std::uintptr_t>(b.ptr)})
            .field("size", std::uint64_t{b.size})
            .end_object();
      });
      w.end_array();
    }
    w.end_object();
    copy_text_out(w.str(), buf, size, needed);
  });
}

gmem_status_t gmem_leaks_json(int device, char* buf, size_t size, size_t* needed) {
  return run_guarded("gmem_leaks_json", [&] {
    copy_text_out(gmem::capi::live_leaks_json(device), buf, size, needed);
  });
}

}  // extern "C"
