// A non-owning reference to a callable, for callbacks that run before the call returns: unlike
// std::function it never allocates (a lambda capturing more than 16 bytes would make
// std::function allocate on every call, and the C API wraps every malloc in one).
#pragma once

#include <memory>
#include <type_traits>
#include <utility>

namespace gmem {

template <class Signature>
class FunctionRef;

template <class R, class... Args>
class FunctionRef<R(Args...)> {
 public:
  // `f` must outlive the FunctionRef: pass it down a call, never keep it.
  template <class F, class = std::enable_if_t<!std::is_same_v<std::decay_t<F>, FunctionRef> &&
                                              std::is_invocable_r_v<R, F&, Args...>>>
  FunctionRef(F&& f) noexcept  // NOLINT(google-explicit-constructor): a lambda converts in a call
      : object_(const_cast<void*>(static_cast<const void*>(std::addressof(f)))),
        call_(&invoke<std::remove_reference_t<F>>) {}

  R operator()(Args... args) const { return call_(object_, std::forward<Args>(args)...); }

 private:
  template <class F>
  static R invoke(void* object, Args... args) {
    return (*static_cast<F*>(object))(std::forward<Args>(args)...);
  }

  void* object_;
  R (*call_)(void*, Args...);
};

}  // namespace gmem
