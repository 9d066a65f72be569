// Scopes: named regions of a program ("train/forward", "model.transformer.h.3.mlp") that the
// allocations made inside them are tagged with, so that summaries, snapshots and OOM reports can
// say which part of the program holds memory.
//
// Scopes nest per thread. Each distinct path is interned once into a small id, so entering a
// scope costs one hash lookup, leaving it a pop, and the tracker's hot path reads one integer.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace gmem {

using ScopeId = std::uint32_t;  // 0: outside every scope

namespace scopes {

// This thread's innermost scope (0 when none). Cheap: one thread-local read.
ScopeId current() noexcept;

// Enters `name` inside the current scope: path "outer/name". Empty names are rejected
// (Error(invalid_argument)): they would make paths ambiguous.
void push(std::string_view name);

// Enters a module scope (a dotted module path, as gmem.torch.track_modules gives it). A module
// scope replaces an enclosing module scope instead of nesting in it, so that the path reads
// "train/model.encoder.layer.0" rather than "train/model/model.encoder/model.encoder.layer.0".
void push_module(std::string_view module_path);

// Leaves the innermost scope; does nothing when the thread is in none.
void pop() noexcept;

// Scopes this thread is in, and a way back to an earlier depth: hooks that may fire unbalanced
// (a backward hook that never comes) restore the depth they saw instead of popping blindly.
std::size_t depth() noexcept;
void pop_to(std::size_t depth) noexcept;

// The full path of `id` ("" for 0, "?" for an id never handed out).
std::string path(ScopeId id);

// Interns `path` as a scope id without entering it ("" gives 0). For tests and tools.
ScopeId intern(std::string_view path);

}  // namespace scopes

// Enters a scope for its lifetime: `gmem::Scope scope("forward");`.
class Scope {
 public:
  explicit Scope(std::string_view name) : depth_(scopes::depth()) { scopes::push(name); }
  ~Scope() { scopes::pop_to(depth_); }
  Scope(const Scope&) = delete;
  Scope& operator=(const Scope&) = delete;

 private:
  std::size_t depth_;
};

}  // namespace gmem
