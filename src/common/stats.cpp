// MemoryStats flattened under PyTorch's names (torch.cuda.memory_stats()), then gmem's own.
#include "gmem/stats.hpp"

namespace gmem {

std::vector<std::pair<std::string, std::int64_t>> MemoryStats::flatten() const {
  std::vector<std::pair<std::string, std::int64_t>> out;
  out.reserve(9 * 3 * 4 + 5 + 12);

  const std::pair<const char*, const PoolStats*> pooled[] = {
      {"allocated_bytes", &allocated_bytes},
      {"requested_bytes", &requested_bytes},
      {"active_bytes", &active_bytes},
      {"reserved_bytes", &reserved_bytes},
      {"inactive_split_bytes", &inactive_split_bytes},
      {"allocation", &allocation},
      {"active", &active},
      {"segment", &segment},
      {"inactive_split", &inactive_split},
  };
  const char* pool_names[] = {"all", "small_pool", "large_pool"};  // indexed by StatPool
  for (const auto& [name, pools] : pooled) {
    for (int pool = kAllPools; pool <= kLargePool; ++pool) {
      const Stat& stat = (*pools)[pool];
      const std::string prefix = std::string(name) + "." + pool_names[pool] + ".";
      out.emplace_back(prefix + "current", stat.current);
      out.emplace_back(prefix + "peak", stat.peak);
      out.emplace_back(prefix + "allocated", stat.allocated);
      out.emplace_back(prefix + "freed", stat.freed);
    }
  }

  out.emplace_back("num_alloc_retries", num_alloc_retries);
  out.emplace_back("num_ooms", num_ooms);
  out.emplace_back("num_device_alloc", num_device_alloc);
  out.emplace_back("num_device_free", num_device_free);
  out.emplace_back("num_sync_all_streams", num_sync_all_streams);

  out.emplace_back("gmem.num_maps", num_maps);
  out.emplace_back("gmem.num_unmaps", num_unmaps);
  out.emplace_back("gmem.num_stitches", num_stitches);
  out.emplace_back("gmem.chunks_held", chunks_held);
  out.emplace_back("gmem.chunks_mapped", chunks_mapped);
  out.emplace_back("gmem.granularity", granularity);
  out.emplace_back("gmem.memory_limit", memory_limit);
  out.emplace_back("gmem.largest_free_range", largest_free_range);
  out.emplace_back("gmem.free_mapped_bytes", free_mapped_bytes);
  out.emplace_back("gmem.free_unmapped_bytes", free_unmapped_bytes);
  out.emplace_back("gmem.partial_page_bytes", partial_page_bytes);
  out.emplace_back("gmem.small_slack_bytes", small_slack_bytes);
  return out;
}

}  // namespace gmem
