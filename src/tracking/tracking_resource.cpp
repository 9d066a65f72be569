#include "gmem/tracker.hpp"

namespace gmem {

TrackingResource::TrackingResource(Engine& engine, Tracker& tracker)
    : engine_(engine), tracker_(tracker) {
  engine_.set_listener(&tracker_);
}

TrackingResource::~TrackingResource() { engine_.set_listener(nullptr); }

void* TrackingResource::allocate(std::size_t bytes, StreamId stream) {
  void* ptr = engine_.malloc(bytes, stream);
  try {
    // The engine rounds every block to kAlignment (BlockInfo::size).
    tracker_.on_malloc(ptr, (bytes + kAlignment - 1) / kAlignment * kAlignment, bytes, stream);
  } catch (...) {  // host memory exhausted while growing the tracker: do not leak the block
    engine_.free(ptr);
    throw;
  }
  return ptr;
}

void TrackingResource::deallocate(void* ptr) {
  tracker_.on_free(ptr);  // first: a malloc reusing the address on another thread comes after
  engine_.free(ptr);
}

}  // namespace gmem
