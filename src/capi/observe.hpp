// The C API's observability (include/gmem/gmem_observe.h, implemented in observe_c.cpp): what
// gmem_c.cpp calls to report OOMs and summarise by scope, and the two helpers of gmem_c.cpp that
// observe_c.cpp shares.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "capi/registry.hpp"
#include "common/function_ref.hpp"
#include "gmem/gmem.h"
#include "gmem/summary.hpp"

namespace gmem::capi {

// The engine's malloc (which records into the device's tracker when tracking is on). A failed
// malloc leaves its OOM report (gmem_oom_report_text) and, unless GMEM_OOM_REPORT=0, throws
// with the report appended to the message.
void* observed_malloc(DeviceContext& context, std::size_t size, StreamId stream);

// For memory summaries: live memory by scope when allocations carry scopes, else by call site;
// empty when the device is not tracked.
std::vector<TopAllocation> tracked_top(DeviceContext& context, std::size_t n = 10);
// The summary's cause line from the tracker's leak findings ("" when `context` is not tracked).
std::string tracked_cause(DeviceContext& context, const MemoryStats& stats);

// Defined in gmem_c.cpp: runs `body` turning exceptions into a status and the thread's last
// error, and copies text out as gmem_stats_text does.
gmem_status_t run_guarded(const char* function, FunctionRef<void()> body) noexcept;
void copy_text_out(const std::string& text, char* buf, std::size_t size, std::size_t* needed);
// engine.empty_cache(), saying on stderr, once a process, when calls after every step have made
// it keep memory (EmptyCacheRule), and how to make it give back everything.
void empty_cache(Engine& engine);

}  // namespace gmem::capi
