// MemoryStats flattened under PyTorch's names (torch.cuda.memory_stats()), then gmem's own.
#include "gmem/stats.hpp"

#include <algorithm>
#include <iterator>

namespace gmem {

namespace {

using Scalar = std::int64_t MemoryStats::*;
constexpr std::pair<std::string_view, Scalar> kScalars[] = {
    {"num_alloc_retries", &MemoryStats::num_alloc_retries},
    {"num_ooms", &MemoryStats::num_ooms},
    {"num_device_alloc", &MemoryStats::num_device_alloc},
    {"num_device_free", &MemoryStats::num_device_free},
    {"num_sync_all_streams", &MemoryStats::num_sync_all_streams},
    {"gmem.num_maps", &MemoryStats::num_maps},
    {"gmem.num_maps_ahead", &MemoryStats::num_maps_ahead},
    {"gmem.map_ahead_wait_us", &MemoryStats::map_ahead_wait_us},
    {"gmem.num_unmaps", &MemoryStats::num_unmaps},
    {"gmem.num_stitches", &MemoryStats::num_stitches},
    {"gmem.num_stream_handovers", &MemoryStats::num_stream_handovers},
    {"gmem.num_empty_cache", &MemoryStats::num_empty_cache},
    {"gmem.empty_cache_kept_bytes", &MemoryStats::empty_cache_kept_bytes},
    {"gmem.chunks_held", &MemoryStats::chunks_held},
    {"gmem.chunks_mapped", &MemoryStats::chunks_mapped},
    {"gmem.mapped_pages", &MemoryStats::mapped_pages},
    {"gmem.granularity", &MemoryStats::granularity},
    {"gmem.memory_limit", &MemoryStats::memory_limit},
    {"gmem.steps_marked", &MemoryStats::steps_marked},
    {"gmem.plans", &MemoryStats::plans},
    {"gmem.plan_steps_followed", &MemoryStats::plan_steps_followed},
    {"gmem.plan_hits", &MemoryStats::plan_hits},
    {"gmem.plan_mismatches", &MemoryStats::plan_mismatches},
    {"gmem.plan_conflicts", &MemoryStats::plan_conflicts},
    {"gmem.plan_extent_bytes", &MemoryStats::plan_extent_bytes},
    {"gmem.plans_ahead", &MemoryStats::plans_ahead},
    {"gmem.plan_wait_us", &MemoryStats::plan_wait_us},
    {"gmem.device_call_us", &MemoryStats::device_call_us},
    {"gmem.stream_wait_us", &MemoryStats::stream_wait_us},
    {"gmem.largest_free_range", &MemoryStats::largest_free_range},
    {"gmem.device_total_bytes", &MemoryStats::device_total_bytes},
    {"gmem.device_free_bytes", &MemoryStats::device_free_bytes},
    {"gmem.outside_bytes", &MemoryStats::outside_bytes},
    {"gmem.free_mapped_bytes", &MemoryStats::free_mapped_bytes},
    {"gmem.free_unmapped_bytes", &MemoryStats::free_unmapped_bytes},
    {"gmem.partial_page_bytes", &MemoryStats::partial_page_bytes},
    {"gmem.small_slack_bytes", &MemoryStats::small_slack_bytes},
    {"gmem.pending_free_bytes", &MemoryStats::pending_free_bytes},
};

constexpr std::pair<std::string_view, PoolStats MemoryStats::*> kPooled[] = {
    {"allocated_bytes", &MemoryStats::allocated_bytes},
    {"requested_bytes", &MemoryStats::requested_bytes},
    {"active_bytes", &MemoryStats::active_bytes},
    {"reserved_bytes", &MemoryStats::reserved_bytes},
    {"inactive_split_bytes", &MemoryStats::inactive_split_bytes},
    {"allocation", &MemoryStats::allocation},
    {"active", &MemoryStats::active},
    {"segment", &MemoryStats::segment},
    {"inactive_split", &MemoryStats::inactive_split},
};
// Scalars that describe the device, not one engine on it: add_engine() leaves them.
constexpr std::string_view kOfTheDevice[] = {
    "gmem.granularity",       "gmem.memory_limit",       "gmem.device_call_us",
    "gmem.stream_wait_us",    "gmem.device_total_bytes", "gmem.device_free_bytes",
    "gmem.outside_bytes"};
constexpr std::string_view kPoolNames[] = {"all", "small_pool", "large_pool"};  // by StatPool

// Removes `prefix` and a following '.' from the front of `name`.
bool eat(std::string_view& name, std::string_view prefix) {
  if (name.size() <= prefix.size() || !name.starts_with(prefix) || name[prefix.size()] != '.')
    return false;
  name.remove_prefix(prefix.size() + 1);
  return true;
}

}  // namespace

std::optional<std::int64_t> MemoryStats::find(std::string_view name) const {
  for (const auto& [stat, member] : kPooled) {
    std::string_view rest = name;
    if (!eat(rest, stat)) continue;
    for (int pool = kAllPools; pool <= kLargePool; ++pool) {
      std::string_view field = rest;
      if (!eat(field, kPoolNames[pool])) continue;
      const Stat& s = (this->*member)[pool];
      if (field == "current") return s.current;
      if (field == "peak") return s.peak;
      if (field == "allocated") return s.allocated;
      if (field == "freed") return s.freed;
    }
    return std::nullopt;
  }
  for (const auto& [stat, member] : kScalars)
    if (stat == name) return this->*member;
  return std::nullopt;
}

void MemoryStats::add_engine(const MemoryStats& other) {
  for (const auto& [name, member] : kPooled) {
    for (std::size_t pool = 0; pool < 3; ++pool) {
      Stat& to = (this->*member)[pool];
      const Stat& from = (other.*member)[pool];
      to.current += from.current;
      to.peak += from.peak;
      to.allocated += from.allocated;
      to.freed += from.freed;
    }
  }
  for (const auto& [name, member] : kScalars) {
    if (member == &MemoryStats::largest_free_range)  // one range, in one engine: the larger
      largest_free_range = std::max(largest_free_range, other.largest_free_range);
    else if (std::ranges::find(kOfTheDevice, name) == std::end(kOfTheDevice))
      this->*member += other.*member;
  }
  if (device_total_bytes > 0)
    outside_bytes = std::max<std::int64_t>(
        0, device_total_bytes - device_free_bytes - reserved_bytes[kAllPools].current);
}

bool MemoryStats::is_derived(std::string_view name) {
  return name.starts_with("inactive_split") || name == "gmem.largest_free_range" ||
         name.starts_with("gmem.device_") || name == "gmem.outside_bytes";
}

std::vector<std::pair<std::string, std::int64_t>> MemoryStats::flatten() const {
  std::vector<std::pair<std::string, std::int64_t>> out;
  out.reserve(std::size(kPooled) * 3 * 4 + std::size(kScalars));

  for (const auto& [name, member] : kPooled) {
    for (int pool = kAllPools; pool <= kLargePool; ++pool) {
      const Stat& stat = (this->*member)[pool];
      const std::string prefix = std::string(name) + "." + std::string(kPoolNames[pool]) + ".";
      out.emplace_back(prefix + "current", stat.current);
      out.emplace_back(prefix + "peak", stat.peak);
      out.emplace_back(prefix + "allocated", stat.allocated);
      out.emplace_back(prefix + "freed", stat.freed);
    }
  }

  for (const auto& [name, member] : kScalars) out.emplace_back(name, this->*member);
  return out;
}

}  // namespace gmem
