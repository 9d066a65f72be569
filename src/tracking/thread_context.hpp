// What the tracker's hot path reads from the calling thread: its scope and its call site, in one
// small thread-local struct, so that a malloc pays for a single TLS lookup.
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

// Read on every tracked malloc: plain data, so that the thread_local needs no constructor guard.
struct ThreadContext {
  ScopeId scope;          // innermost scope (0: none)
  std::uint32_t frames;   // FramesId of the call site the Python layer last set (0: none)
};

// initial-exec: in libgmem.so (dlopen'ed by PyTorch) the default model makes every read a call
// to __tls_get_addr; these 8 bytes fit the static TLS space glibc keeps for such libraries.
// Not in sanitizer builds: linked into an executable, the linker rewrites the access into a form
// that leaves UBSan's null check testing stale flags (GCC 12), a false "null pointer" report.
#ifdef GMEM_SANITIZED
#define GMEM_TLS_MODEL
#else
#define GMEM_TLS_MODEL [[gnu::tls_model("initial-exec")]]
#endif
inline ThreadContext& thread_context() noexcept {
  GMEM_TLS_MODEL thread_local ThreadContext context{0, 0};
  return context;
}

// The scope stack behind ThreadContext::scope (only scope entry and exit touch it).
inline std::vector<ScopeEntry>& scope_stack() noexcept {
  thread_local std::vector<ScopeEntry> stack;
  return stack;
}

}  // namespace gmem::detail
