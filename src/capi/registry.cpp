#include "capi/registry.hpp"

#include <array>
#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <initializer_list>
#include <map>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "common/byte_count.hpp"
#include "gmem/error.hpp"
#include "gmem/forwarding_device.hpp"
#include "gmem/sim_device.hpp"
#ifdef GMEM_HAVE_CUDA
#include "gmem/cuda_device.hpp"
#endif

namespace gmem::capi {
namespace {

constexpr int kMaxDevices = 64;

// Which engine's address space holds a pointer: gmem_free gets no device argument, and a pool's
// pointer must find its pool.
class AddressBook {
 public:
  void add(DevicePtr base, std::size_t size, gmem_engine* owner) {
    std::unique_lock lock(mutex_);
    ranges_[base] = Range{base + size, owner};
  }
  void remove(DevicePtr base) {
    std::unique_lock lock(mutex_);
    ranges_.erase(base);
  }
  gmem_engine* find(DevicePtr ptr) const {
    std::shared_lock lock(mutex_);
    auto next = ranges_.upper_bound(ptr);
    if (next == ranges_.begin()) return nullptr;
    --next;
    return ptr < next->second.end ? next->second.owner : nullptr;
  }

 private:
  struct Range {
    DevicePtr end;
    gmem_engine* owner;
  };
  mutable std::shared_mutex mutex_;
  std::map<DevicePtr, Range> ranges_;
};

// One engine's view of its device: forwards every call, recording the ranges the engine reserves
// in the address book under the engine. `views` counts the views alive (owner()'s shortcut).
class RecordingDevice final : public ForwardingDevice {
 public:
  RecordingDevice(Device& inner, AddressBook& book, gmem_engine& owner, std::atomic<int>& views)
      : ForwardingDevice(inner), book_(book), owner_(owner), views_(views) {
    views_.fetch_add(1, std::memory_order_release);
  }
  ~RecordingDevice() override { views_.fetch_sub(1, std::memory_order_release); }

  DevicePtr reserve_address(std::size_t size, std::size_t alignment) override {
    const DevicePtr base = inner().reserve_address(size, alignment);
    book_.add(base, size, &owner_);
    return base;
  }
  void release_address(DevicePtr base, std::size_t size) override {
    inner().release_address(base, size);
    book_.remove(base);
  }

 private:
  AddressBook& book_;
  gmem_engine& owner_;
  std::atomic<int>& views_;
};

enum class Backend { cuda, segment, sim };

Backend backend_from_environment() {
  const char* value = std::getenv("GMEM_DEVICE");
  const std::string name = value != nullptr ? value : "";
  if (name.empty() || name == "cuda") return Backend::cuda;
  if (name == "segment") return Backend::segment;
  if (name == "sim") return Backend::sim;
  throw Error(Errc::invalid_argument,
              "GMEM_DEVICE='" + name + "' is not one of: cuda, segment, sim");
}

SimDeviceOptions sim_options_from_environment() {
  SimDeviceOptions options;
  options.name = "simulated (GMEM_DEVICE=sim)";
  const char* value = std::getenv("GMEM_SIM_CAPACITY");
  if (value == nullptr || *value == '\0') return options;
  char* end = nullptr;
  errno = 0;
  const unsigned long long bytes = std::strtoull(value, &end, 10);
  if (errno != 0 || *end != '\0' || bytes == 0 || *value == '-') {
    throw Error(Errc::invalid_argument,
                std::string("GMEM_SIM_CAPACITY='") + value + "' is not a positive byte count");
  }
  options.capacity = static_cast<std::size_t>(bytes);
  return options;
}

// GMEM_PAGE_SIZE: EngineOptions::page_size, a byte count (8M, 8MiB, 8388608); unset or empty: 0,
// the device's granularity. The engine checks the value itself.
std::size_t page_size_from_environment() {
  const char* value = std::getenv("GMEM_PAGE_SIZE");
  if (value == nullptr || *value == '\0') return 0;
  const auto bytes = parse_byte_count(value);
  if (!bytes || *bytes > SIZE_MAX)
    throw Error(Errc::invalid_argument, std::string("GMEM_PAGE_SIZE='") + value +
                                            "' is not a byte count (e.g. 8M, 8MiB or 8388608)");
  return static_cast<std::size_t>(*bytes);
}

// A yes-or-no setting named by one of `choices` (a word and what it means) in the environment
// variable `name`; unset or empty: `unset`. Any other word is refused, naming the choices.
bool choice_from_environment(const char* name,
                             std::initializer_list<std::pair<std::string_view, bool>> choices,
                             bool unset) {
  const char* value = std::getenv(name);
  if (value == nullptr || *value == '\0') return unset;
  std::string listed;
  for (const auto& [word, meaning] : choices) {
    if (word == value) return meaning;
    listed += (listed.empty() ? "" : ", ") + std::string(word);
  }
  throw Error(Errc::invalid_argument,
              std::string(name) + "='" + value + "' is not one of: " + listed);
}

// GMEM_EMPTY_CACHE: "strict" makes every empty_cache() give back everything
// (EngineOptions::strict_empty_cache); unset, empty or "auto": the default rule.
bool strict_empty_cache_from_environment() {
  return choice_from_environment("GMEM_EMPTY_CACHE", {{"auto", false}, {"strict", true}}, false);
}

// GMEM_STREAM_HANDOVERS: "0" or "off" turns EngineOptions::stream_handovers off; unset, empty,
// "1" or "on": on.
bool stream_handovers_from_environment() {
  return choice_from_environment("GMEM_STREAM_HANDOVERS",
                                 {{"on", true}, {"off", false}, {"1", true}, {"0", false}}, true);
}

// GMEM_MAP_AHEAD: "1" or "on" turns EngineOptions::map_ahead on, "0" or "off" off; unset or
// empty: on for a GPU, off for the simulated device (whose runs then repeat exactly).
bool map_ahead_from_environment(bool simulated) {
  return choice_from_environment("GMEM_MAP_AHEAD",
                                 {{"on", true}, {"off", false}, {"1", true}, {"0", false}}, !simulated);
}

class Registry {
 public:
  Registry() : backend_(backend_from_environment()) {}

  DeviceContext& get(int device) {
    if (device < -1) throw bad_ordinal(device);
    if (device == -1) device = current_device();
    if (device >= kMaxDevices) throw bad_ordinal(device);
    if (DeviceContext* found = by_index_[device].load(std::memory_order_acquire)) return *found;

    std::lock_guard lock(create_mutex_);
    if (DeviceContext* found = by_index_[device].load(std::memory_order_acquire)) return *found;
    auto context = std::make_unique<DeviceContext>();
    context->index = device;
    Opened opened = open_device(device);
    opened.options.page_size = page_size_from_environment();
    opened.options.strict_empty_cache = strict_empty_cache_from_environment();
    opened.options.stream_handovers = stream_handovers_from_environment();
    opened.options.map_ahead = map_ahead_from_environment(backend_ == Backend::sim);
    context->device = std::move(opened.device);
    context->view = std::make_unique<RecordingDevice>(*context->device, book_, context->handle, views_);
    try {
      context->engine = std::make_unique<Engine>(*context->view, opened.options);
    } catch (const Error& e) {
      if (opened.options.page_size == 0) throw;
      throw Error(e.code(), std::string("GMEM_PAGE_SIZE: ") + e.what());
    }
    context->handle.context = context.get();
    context->handle.engine = context->engine.get();
    DeviceContext* created = context.release();  // kept for the life of the process
    in_order_.push_back(created);
    if (in_order_.size() == 1) first_.store(created, std::memory_order_release);
    by_index_[device].store(created, std::memory_order_release);
    return *created;
  }

  gmem_engine* owner(const void* ptr) const { return book_.find(reinterpret_cast<DevicePtr>(ptr)); }

  gmem_engine* likely_owner(const void* ptr) {
    const int views = views_.load(std::memory_order_acquire);
    if (views == 0) return nullptr;
    // One engine in use, the first device's (a pool's engine needs its device's first): that
    // engine tells a foreign pointer apart itself. A pointer of a pool made meanwhile cannot be
    // freed before the malloc that returned it, made after the pool's view counted.
    if (views == 1) {
      DeviceContext* first = first_.load(std::memory_order_acquire);
      if (first != nullptr) return &first->handle;
    }
    return owner(ptr);
  }

  std::unique_ptr<Device> pool_view(DeviceContext& context, gmem_engine& pool) {
    return std::make_unique<RecordingDevice>(*context.device, book_, pool, views_);
  }

  void for_each(const std::function<void(DeviceContext&)>& visit) {
    std::vector<DeviceContext*> contexts;
    {
      std::lock_guard lock(create_mutex_);
      contexts = in_order_;
    }
    for (DeviceContext* context : contexts) visit(*context);
  }

 private:
  int current_device() const {
#ifdef GMEM_HAVE_CUDA
    if (backend_ != Backend::sim) return CudaDevice::current_device();
#endif
    return 0;
  }

  Error bad_ordinal(int device) const {
    if (backend_ == Backend::sim) {
      return Error(Errc::invalid_argument, "device " + std::to_string(device) +
                                               " does not exist: GMEM_DEVICE=sim simulates "
                                               "one device, 0");
    }
    return Error(Errc::invalid_argument, "device " + std::to_string(device) + " does not exist");
  }

  struct Opened {
    std::unique_ptr<Device> device;
    EngineOptions options;
  };

  Opened open_device(int device) const {
    if (backend_ == Backend::sim) {
      if (device != 0) throw bad_ordinal(device);
      return {std::make_unique<SimulatedDevice>(sim_options_from_environment()), {}};
    }
#ifdef GMEM_HAVE_CUDA
    const int count = CudaDevice::device_count();
    if (device >= count) {
      throw Error(Errc::invalid_argument, "device " + std::to_string(device) +
                                              " does not exist: " + std::to_string(count) +
                                              " CUDA device(s) present");
    }
    if (backend_ == Backend::cuda && CudaDevice::supports_vmm(device)) {
      return {std::make_unique<CudaDevice>(device), {}};
    }
    // Without VMM every arena is committed memory: grow in small segments rather than
    // reserving twice the device up front.
    EngineOptions options;
    options.address_space = CudaSegmentDevice::kArenaSize;
    return {std::make_unique<CudaSegmentDevice>(device), options};
#else
    throw DeviceError("open device", 0,
                      "gmem was built without CUDA; set GMEM_DEVICE=sim for the simulated device");
#endif
  }

  const Backend backend_;
  std::mutex create_mutex_;
  std::array<std::atomic<DeviceContext*>, kMaxDevices> by_index_{};
  std::vector<DeviceContext*> in_order_;
  std::atomic<DeviceContext*> first_{nullptr};
  std::atomic<int> views_{0};  // RecordingDevices alive: one per device engine and per pool
  AddressBook book_;
};

Registry& registry() {
  static Registry* const instance = new Registry;  // deliberately never destroyed
  return *instance;
}

}  // namespace

DeviceContext& context(int device) { return registry().get(device); }
gmem_engine* owner(const void* ptr) { return registry().owner(ptr); }
gmem_engine* likely_owner(const void* ptr) { return registry().likely_owner(ptr); }
std::unique_ptr<Device> pool_view(DeviceContext& context, gmem_engine& pool) {
  return registry().pool_view(context, pool);
}
void for_each_context(const std::function<void(DeviceContext&)>& visit) {
  registry().for_each(visit);
}

}  // namespace gmem::capi
