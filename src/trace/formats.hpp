// The trace formats gmem reads; read_trace picks one from the file's content. Each parser fills
// `trace.events` and `trace.frames` and throws BadInputError naming `trace.path` and the line.
#pragma once

#include <cstddef>
#include <optional>
#include <string>
#include <string_view>

#include "gmem/trace.hpp"

namespace gmem::trace::detail {

// PyTorch's event names ("alloc", "free_completed", ...); nullopt for anything else.
std::optional<Action> parse_action(std::string_view name);

// Throws BadInputError "FILE[:LINE]: exceeds WHAT (set with OPTION)" for a ReadLimits bound.
[[noreturn]] void exceeds(const std::string& file, std::size_t line, const std::string& what,
                          const char* option);

// Reserves room for the events a CSV of `text_bytes` likely holds (about 60 bytes a line), at
// most limits.max_events: one allocation instead of ~20 reallocations.
void reserve_events(Trace& trace, std::size_t text_bytes, const ReadLimits& limits);
// Throws when `trace` already holds limits.max_events events (before adding one at `line`).
void check_event_count(const Trace& trace, std::size_t line, const ReadLimits& limits);

// CSV with a header naming action,addr,size,stream,time_us,user_frame,lib_frame (any order).
void read_pytorch_csv(std::string_view text, Trace& trace, const ReadLimits& limits);
// RMM's logging_resource_adaptor log: Thread,Time,Action,Pointer,Size,Stream.
void read_rmm_csv(std::string_view text, Trace& trace, const ReadLimits& limits);
// torch.cuda.memory._snapshot() pickled (_dump_snapshot): its device_traces.
void read_snapshot_pickle(std::string_view bytes, Trace& trace, const ReadLimits& limits);

}  // namespace gmem::trace::detail
