// What the tracker's hot path reads from the calling thread: its scope and its call site. One
// thread-local struct, so a malloc pays for a single TLS lookup.
#pragma once

#include <cstdint>
#include <vector>

#include "gmem/scope.hpp"

namespace gmem::detail {

struct ScopeEntry {
  ScopeId id;
  ScopeId parent;  // what a child's path is built on (a module scope's enclosing non-module)
  bool module;
};

struct ThreadContext {
  ScopeId scope = 0;        // innermost scope
  std::uint32_t frames = 0; // FramesId of the call site the Python layer last set (0: none)
  std::vector<ScopeEntry> stack;
};

inline ThreadContext& thread_context() noexcept {
  thread_local ThreadContext context;
  return context;
}

}  // namespace gmem::detail
