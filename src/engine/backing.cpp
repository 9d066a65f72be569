// Backing: the coordinator: it builds the parts, and gives everything back when it goes.
#include "engine/backing.hpp"

#include <bit>
#include <string>

#include "gmem/error.hpp"

namespace gmem::detail {

namespace {
std::size_t checked_page_size(const Device& device, std::size_t page_size, std::size_t alignment) {
  const std::size_t granularity = device.granularity();
  if (!std::has_single_bit(granularity) || granularity < alignment)
    throw Error(Errc::invalid_argument, "device granularity must be a power of two >= " +
                                            std::to_string(alignment) + ", got " +
                                            std::to_string(granularity));
  if (page_size == 0) return granularity;
  if (!std::has_single_bit(page_size) || page_size < granularity || page_size > Backing::kMaxPageSize)
    throw Error(Errc::invalid_argument,
                "page size " + std::to_string(page_size) + " bytes: must be a power of two from "
                "the device's granularity (" + format_bytes(granularity) + ") to " +
                format_bytes(Backing::kMaxPageSize));
  return page_size;  // every chunk is one page: created, mapped and unmapped whole
}
}  // namespace

Backing::Backing(Device& device, Streams& streams, Accounting& accounting,
                 EngineObserver* const& observer, BackingClient& client, const EngineLock& lock,
                 Options options)
    : device_(device), streams_(streams),
      arenas_(device, streams, client,
              checked_page_size(device, options.page_size, options.alignment)),
      placement_(arenas_), pages_(arenas_, streams),
      calls_(device, pages_, accounting, observer, arenas_.page_shift()),
      chunks_(device, arenas_, pages_, calls_, accounting, observer, client, lock,
              {options.stable_pages, options.handovers}),
      ahead_(options.map_ahead && !options.stable_pages, device, arenas_, placement_, pages_,
             chunks_, calls_, accounting, lock),
      mapper_(device, arenas_, placement_, pages_, chunks_, calls_, ahead_, accounting, lock),
      taker_(arenas_, streams, placement_, pages_, chunks_, mapper_),
      planned_(device, arenas_, placement_, pages_, chunks_, ahead_, accounting, taker_) {}

Backing::~Backing() {
  // Give everything back, live blocks included: the engine owns the memory it handed out.
  const std::size_t page_size = granularity();
  for (std::uint32_t a = 0; a < arenas_.size(); ++a) {
    arenas_[a].pages.for_each_touched([&](std::size_t i, const Page& page) {
      if (!page.mapped()) return;
      try {
        device_.unmap(arenas_.address(page_id(a, static_cast<std::uint32_t>(i))), page_size);
      } catch (...) {  // nothing to report to from a destructor
      }
    });
  }
  arenas_.release_all();
  const ChunkPool& pool = pages_.chunks();
  for (ChunkId id = 0; id < pool.slots(); ++id) {
    if (const ChunkHandle handle = pool.at(id).handle) {
      try { device_.release_chunk(handle); } catch (...) {}
    }
  }
}

void Backing::set_arena_size(std::size_t address_space) {
  // One device's worth of virtual space per arena: a stream rarely needs a second one, and a
  // thousand streams stay within the GPU's address space (2^47 bytes and more).
  arenas_.set_arena_size(address_space ? address_space : chunks_.device_total());
}

}  // namespace gmem::detail
