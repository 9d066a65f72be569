// gmem's engine from C++: allocate, free, stitch under a limit, read the statistics.
// Runs on GPU 0 when gmem was built with CUDA and a GPU is present, else on a simulated device.
#include <cstdio>
#include <memory>
#include <vector>

#include "gmem/engine.hpp"
#include "gmem/sim_device.hpp"
#ifdef GMEM_EXAMPLE_CUDA
#include "gmem/cuda_device.hpp"
#endif

namespace {

std::unique_ptr<gmem::Device> open_device() {
#ifdef GMEM_EXAMPLE_CUDA
  try {
    if (gmem::CudaDevice::device_count() > 0 && gmem::CudaDevice::supports_vmm(0)) {
      return std::make_unique<gmem::CudaDevice>(0);
    }
  } catch (const gmem::DeviceError& e) {
    std::printf("no usable GPU (%s); using a simulated device\n", e.what());
  }
#endif
  return std::make_unique<gmem::SimulatedDevice>();
}

}  // namespace

int main() {
  constexpr std::size_t kMiB = std::size_t{1} << 20;
  const std::unique_ptr<gmem::Device> device = open_device();
  gmem::EngineOptions options;
  options.memory_limit = 64 * kMiB;  // small, so that the 32 MiB request below must stitch
  gmem::Engine engine(*device, options);
  std::printf("device: %s, granularity %s\n", device->name().c_str(),
              gmem::format_bytes(device->granularity()).c_str());

  std::vector<void*> blocks;
  for (int i = 0; i < 16; ++i) blocks.push_back(engine.malloc(4 * kMiB));
  for (int i = 1; i < 16; i += 2) engine.free(blocks[i]);  // 8 separate 4 MiB holes
  void* large = engine.malloc(32 * kMiB);  // no 32 MiB hole exists: gmem remaps the chunks
  try {
    engine.malloc(8 * kMiB);
  } catch (const gmem::OutOfMemoryError& e) {
    std::printf("expected: %s\n", e.what());
  }

  const gmem::MemoryStats stats = engine.stats();
  std::printf("allocated %s, reserved %s, stitches %lld\n",
              gmem::format_bytes(static_cast<std::uint64_t>(stats.allocated_bytes[gmem::kAllPools].current)).c_str(),
              gmem::format_bytes(static_cast<std::uint64_t>(stats.reserved_bytes[gmem::kAllPools].current)).c_str(),
              static_cast<long long>(stats.num_stitches));
  engine.free(large);
  for (int i = 0; i < 16; i += 2) engine.free(blocks[i]);
  engine.empty_cache();
  return stats.num_stitches > 0 ? 0 : 1;
}
