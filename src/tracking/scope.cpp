// Scope interning (one process-wide table of paths) and the per-thread scope stack.
#include "gmem/scope.hpp"

#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "gmem/error.hpp"
#include "tracking/string_hash.hpp"
#include "tracking/thread_context.hpp"

namespace gmem::scopes {
namespace {

class ScopeTable {
 public:
  ScopeTable() { paths_.emplace_back(); }  // id 0: no scope

  // The id of path(base) + "/" + name, interned on first use.
  ScopeId child(ScopeId base, std::string_view name) {
    std::lock_guard lock(mutex_);
    thread_local std::string key;
    key.clear();
    if (base != 0 && base < paths_.size()) {
      key += paths_[base];
      key += '/';
    }
    key += name;
    return intern_locked(key);
  }

  ScopeId intern(std::string_view path) {
    if (path.empty()) return 0;
    std::lock_guard lock(mutex_);
    return intern_locked(path);
  }

  std::string path(ScopeId id) {
    std::lock_guard lock(mutex_);
    return id < paths_.size() ? paths_[id] : std::string("?");
  }

 private:
  ScopeId intern_locked(std::string_view path) {
    if (auto it = ids_.find(path); it != ids_.end()) return it->second;
    const auto id = static_cast<ScopeId>(paths_.size());
    paths_.emplace_back(path);
    ids_.emplace(paths_.back(), id);
    return id;
  }

  std::mutex mutex_;
  std::vector<std::string> paths_;  // by id
  std::unordered_map<std::string, ScopeId, detail::StringHash, std::equal_to<>> ids_;
};

ScopeTable& table() {
  static ScopeTable* const instance = new ScopeTable;  // outlives every thread's last scope
  return *instance;
}

void enter(ScopeId id, ScopeId parent, bool module) {
  detail::scope_stack().push_back(detail::ScopeEntry{id, parent, module});
  detail::thread_context().scope = id;
}

void check_name(std::string_view name, const char* what) {
  if (name.empty()) throw Error(Errc::invalid_argument, std::string(what) + ": empty scope name");
}

}  // namespace

ScopeId current() noexcept { return detail::thread_context().scope; }

void push(std::string_view name) {
  check_name(name, "gmem::scopes::push");
  const ScopeId parent = detail::thread_context().scope;
  enter(table().child(parent, name), parent, false);
}

void push_module(std::string_view module_path) {
  check_name(module_path, "gmem::scopes::push_module");
  const std::vector<detail::ScopeEntry>& stack = detail::scope_stack();
  // Inside a module scope, build on what that module was built on: modules replace modules.
  const ScopeId base = !stack.empty() && stack.back().module ? stack.back().parent
                                                             : detail::thread_context().scope;
  enter(table().child(base, module_path), base, true);
}

void pop() noexcept {
  std::vector<detail::ScopeEntry>& stack = detail::scope_stack();
  if (stack.empty()) return;
  stack.pop_back();
  detail::thread_context().scope = stack.empty() ? 0 : stack.back().id;
}

std::size_t depth() noexcept { return detail::scope_stack().size(); }

void pop_to(std::size_t target) noexcept {
  while (depth() > target) pop();
}

std::string path(ScopeId id) { return table().path(id); }

ScopeId intern(std::string_view path) { return table().intern(path); }

}  // namespace gmem::scopes
