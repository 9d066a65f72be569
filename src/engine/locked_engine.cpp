// LockedEngine (locked_engine.hpp): what needs Engine::Impl, out of line so that tracking does not
// include engine_impl.hpp.
#include "engine/locked_engine.hpp"

#include "engine/engine_impl.hpp"

namespace gmem::detail {

LockedEngine::LockedEngine(Engine& engine)
    : engine_(Engine::Impl::of(engine)), mutex_(engine_.mutex_), live_(engine_.live_) {
  mutex_.lock();
}

bool LockedEngine::has_observer() const noexcept { return engine_.observer_ != nullptr; }

void LockedEngine::attach(EngineObserver* observer) { engine_.attach(observer); }

std::vector<std::pair<DevicePtr, DevicePtr>> LockedEngine::mapped_ranges() const {
  return engine_.mapped_ranges();
}

}  // namespace gmem::detail
