// The trace formats gmem reads; read_trace picks one from the file's content. Each parser fills
// `trace.events` and `trace.frames` and throws BadInputError naming `trace.path` and the line.
#pragma once

#include <optional>
#include <string_view>

#include "gmem/trace.hpp"

namespace gmem::trace::detail {

// PyTorch's event names ("alloc", "free_completed", ...); nullopt for anything else.
std::optional<Action> parse_action(std::string_view name);

// CSV with a header naming action,addr,size,stream,time_us,user_frame,lib_frame (any order).
void read_pytorch_csv(std::string_view text, Trace& trace);
// RMM's logging_resource_adaptor log: Thread,Time,Action,Pointer,Size,Stream.
void read_rmm_csv(std::string_view text, Trace& trace);
// torch.cuda.memory._snapshot() pickled (_dump_snapshot): its device_traces.
void read_snapshot_pickle(std::string_view bytes, Trace& trace);

}  // namespace gmem::trace::detail
