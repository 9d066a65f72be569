#include "tracking/clock.hpp"

#include <thread>

namespace gmem::detail {
namespace {

using namespace std::chrono;

struct Reference {
  std::uint64_t tick;
  std::int64_t steady_ns;
  std::int64_t wall_ns;
};

std::int64_t steady_now() {
  return duration_cast<nanoseconds>(steady_clock::now().time_since_epoch()).count();
}

const Reference& reference() noexcept {
  static const Reference origin{
      ticks(), steady_now(),
      duration_cast<nanoseconds>(system_clock::now().time_since_epoch()).count()};
  return origin;
}

}  // namespace

void tick_origin() noexcept { (void)reference(); }

TickClock TickClock::make() {
  const Reference& origin = reference();
  TickClock clock;
  clock.tick0_ = origin.tick;
  clock.wall0_ = origin.wall_ns;
#ifdef GMEM_HAVE_TSC
  constexpr std::int64_t kMinSpan = 5'000'000;  // 5 ms: the rate to better than 0.01%
  while (steady_now() - origin.steady_ns < kMinSpan) std::this_thread::yield();
  const std::uint64_t tick = ticks();
  const std::int64_t steady = steady_now();
  clock.ns_per_tick_ = static_cast<double>(steady - origin.steady_ns) /
                       static_cast<double>(tick - origin.tick);
#endif  // else ticks() is the steady clock in ns: a rate of 1
  return clock;
}

std::int64_t TickClock::wall_ns(std::uint64_t tick) const noexcept {
  // Signed: a tick read just before the reference was taken comes out slightly earlier.
  const auto delta = static_cast<double>(static_cast<std::int64_t>(tick - tick0_));
  return wall0_ + static_cast<std::int64_t>(delta * ns_per_tick_);
}

}  // namespace gmem::detail
