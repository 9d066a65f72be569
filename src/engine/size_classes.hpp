// Size classes for small blocks (<= 1 MiB), after mimalloc/jemalloc: 512 B steps up to 16 KiB,
// then 16 classes per doubling (at most 6.25% rounding), up to kSlabLimit. Each class is served from slabs that
// hold a few objects, carved from the large allocator so they pack into shared 2 MiB pages.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>

namespace gmem::detail {

inline constexpr std::size_t kClassStep = 512;
inline constexpr std::size_t kLinearLimit = 16 * 1024;  // 512 B steps up to here
inline constexpr int kLinearClasses = 32;
inline constexpr int kSubClasses = 16;                  // classes per doubling above
inline constexpr int kNumClasses = kLinearClasses + 6 * kSubClasses;  // up to 1 MiB

// The class serving `size` (1 <= size <= 1 MiB).
inline int size_class(std::size_t size) {
  if (size <= kLinearLimit) return static_cast<int>((size + kClassStep - 1) / kClassStep) - 1;
  const int fl = static_cast<int>(std::bit_width(size - 1)) - 1;  // 2^fl < size <= 2^(fl+1)
  const std::size_t step = std::size_t{1} << (fl - 4);
  const std::size_t k = (size - (std::size_t{1} << fl) + step - 1) / step;  // 1..16
  return kLinearClasses + (fl - 14) * kSubClasses + static_cast<int>(k) - 1;
}

inline std::size_t class_size(int cls) {
  if (cls < kLinearClasses) return static_cast<std::size_t>(cls + 1) * kClassStep;
  const int fl = 14 + (cls - kLinearClasses) / kSubClasses;
  const std::size_t k = static_cast<std::size_t>((cls - kLinearClasses) % kSubClasses) + 1;
  return (std::size_t{1} << fl) + k * (std::size_t{1} << (fl - 4));
}

// Slabs of 256 KiB pack the many tiny blocks of a training step. Small blocks above 128 KiB
// would get only one slot per slab, so they take exact ranges from the large allocator
// instead (no class rounding, no stranded slots: slack counts against the 2% budget).
inline constexpr std::size_t kSlabTarget = 256 * 1024;
inline constexpr std::size_t kSlabLimit = kSlabTarget / 2;  // larger small blocks: exact ranges
inline constexpr std::size_t kMaxSlots = kSlabTarget / kClassStep;  // the smallest class's
inline std::uint32_t slab_objects(int cls) {
  return static_cast<std::uint32_t>(kSlabTarget / class_size(cls));
}

}  // namespace gmem::detail
