// Error messages, byte formatting, the flattened statistics (PyTorch's names) and the pointer map.
#include <gtest/gtest.h>

#include <map>
#include <set>

#include "gmem/error.hpp"
#include "common/pointer_map.hpp"
#include "gmem/stats.hpp"

namespace gmem {
namespace {

TEST(FormatBytes, PicksTheLargestWholeUnit) {
  EXPECT_EQ(format_bytes(0), "0 B");
  EXPECT_EQ(format_bytes(512), "512 B");
  EXPECT_EQ(format_bytes(1023), "1023 B");
  EXPECT_EQ(format_bytes(1024), "1.00 KiB");
  EXPECT_EQ(format_bytes(1536), "1.50 KiB");
  EXPECT_EQ(format_bytes(std::uint64_t{2} << 20), "2.00 MiB");
  EXPECT_EQ(format_bytes(1320702444), "1.23 GiB");
  EXPECT_EQ(format_bytes(std::uint64_t{80} << 30), "80.00 GiB");
  EXPECT_EQ(format_bytes((std::uint64_t{1} << 20) - 1), "1.00 MiB");  // not "1024.00 KiB"
  EXPECT_EQ(format_bytes(std::uint64_t{3} << 40), "3.00 TiB");
}

TEST(Errors, NameEveryCode) {
  EXPECT_STREQ(errc_name(Errc::out_of_memory), "out_of_memory");
  EXPECT_STREQ(errc_name(Errc::double_free), "double_free");
  EXPECT_STREQ(errc_name(Errc::bad_input), "bad_input");
}

TEST(Errors, DeviceErrorNamesTheCallAndCode) {
  const DeviceError error("cuMemMap", 1, "range not reserved");
  EXPECT_STREQ(error.what(), "cuMemMap failed (code 1): range not reserved");
  EXPECT_EQ(error.call(), "cuMemMap");
  EXPECT_EQ(error.result(), 1);
  EXPECT_EQ(error.code(), Errc::device_error);
  EXPECT_FALSE(error.device_out_of_memory());

  const DeviceError oom = DeviceError::out_of_memory("cuMemCreate", 2, "no memory");
  EXPECT_STREQ(oom.what(), "cuMemCreate failed (code 2): no memory");
  EXPECT_TRUE(oom.device_out_of_memory());
  EXPECT_EQ(oom.result(), 2);
}

TEST(Errors, OutOfMemoryMessageCarriesEveryNumber) {
  OomInfo info;
  info.requested = std::size_t{3} << 30;
  info.stream = 0xabc0;
  info.limit = std::size_t{10} << 30;
  info.device_total = std::size_t{80} << 30;
  info.device_free = std::size_t{512} << 20;
  info.reserved = std::size_t{9} << 30;
  info.allocated = 1536;
  info.largest_free_range = std::size_t{2} << 20;
  info.reason = "limit";
  const OutOfMemoryError error(info);
  EXPECT_EQ(error.code(), Errc::out_of_memory);
  EXPECT_EQ(error.info().requested, info.requested);
  EXPECT_STREQ(error.what(),
               "out of memory: tried to allocate 3.00 GiB on stream 0xabc0; gmem holds 9.00 GiB "
               "reserved (1.50 KiB allocated), largest free range 2.00 MiB, limit 10.00 GiB, "
               "device total 80.00 GiB with 512.00 MiB free (limit)");
  EXPECT_EQ(std::string(error.what()).find('\n'), std::string::npos);
}

TEST(Errors, BadInputNamesFileAndLine) {
  const BadInputError with_line("trace.csv.gz", 42, "expected 7 columns, found 3");
  EXPECT_STREQ(with_line.what(), "trace.csv.gz:42: expected 7 columns, found 3");
  EXPECT_EQ(with_line.file(), "trace.csv.gz");
  EXPECT_EQ(with_line.line(), 42u);
  EXPECT_EQ(with_line.code(), Errc::bad_input);
  const BadInputError whole_file("snap.pickle", 0, "not a pickle");
  EXPECT_STREQ(whole_file.what(), "snap.pickle: not a pickle");
}

TEST(Stats, FlattensUnderPyTorchNames) {
  MemoryStats stats;
  stats.allocated_bytes[kAllPools].increase(4096);
  stats.allocated_bytes[kAllPools].decrease(1024);
  stats.reserved_bytes[kLargePool].increase(2 << 20);
  stats.inactive_split[kSmallPool].increase(3);
  stats.num_ooms = 5;
  stats.num_sync_all_streams = 6;
  stats.granularity = 2 << 20;
  stats.small_slack_bytes = 77;

  const auto flat = stats.flatten();
  std::map<std::string, std::int64_t> by_name(flat.begin(), flat.end());
  EXPECT_EQ(by_name.size(), flat.size()) << "names must be unique";
  EXPECT_EQ(flat.size(), 9u * 3 * 4 + 5 + 33);
  EXPECT_EQ(flat.front().first, "allocated_bytes.all.current");

  EXPECT_EQ(by_name.at("allocated_bytes.all.current"), 3072);
  EXPECT_EQ(by_name.at("allocated_bytes.all.peak"), 4096);
  EXPECT_EQ(by_name.at("allocated_bytes.all.allocated"), 4096);
  EXPECT_EQ(by_name.at("allocated_bytes.all.freed"), 1024);
  EXPECT_EQ(by_name.at("allocated_bytes.small_pool.current"), 0);
  EXPECT_EQ(by_name.at("reserved_bytes.large_pool.current"), 2 << 20);
  EXPECT_EQ(by_name.at("reserved_bytes.all.current"), 0);
  EXPECT_EQ(by_name.at("inactive_split.small_pool.peak"), 3);
  EXPECT_EQ(by_name.at("num_ooms"), 5);
  EXPECT_EQ(by_name.at("num_sync_all_streams"), 6);
  EXPECT_EQ(by_name.at("gmem.granularity"), 2 << 20);
  EXPECT_EQ(by_name.at("gmem.small_slack_bytes"), 77);

  for (const char* name : {"requested_bytes", "active_bytes", "inactive_split_bytes", "allocation",
                           "active", "segment"}) {
    for (const char* pool : {"all", "small_pool", "large_pool"}) {
      for (const char* metric : {"current", "peak", "allocated", "freed"}) {
        const std::string key = std::string(name) + "." + pool + "." + metric;
        EXPECT_EQ(by_name.count(key), 1u) << key;
      }
    }
  }
  for (const char* name : {"num_alloc_retries", "num_device_alloc", "num_device_free",
                           "gmem.num_maps", "gmem.num_unmaps", "gmem.num_stitches",
                           "gmem.chunks_held", "gmem.chunks_mapped", "gmem.memory_limit",
                           "gmem.largest_free_range", "gmem.device_total_bytes", "gmem.device_free_bytes",
                           "gmem.outside_bytes", "gmem.free_mapped_bytes",
                           "gmem.free_unmapped_bytes", "gmem.partial_page_bytes",
                           "gmem.small_slack_bytes", "gmem.pending_free_bytes"}) {
    EXPECT_EQ(by_name.count(name), 1u) << name;
  }
}

}  // namespace
}  // namespace gmem

namespace gmem {
namespace {

TEST(PointerMap, FindsWhatWasInsertedAndNeverTheEmptyKey) {
  detail::PointerMap<int> map;
  map.insert(0x1000, 7);
  ASSERT_NE(map.find(0x1000), nullptr);
  EXPECT_EQ(*map.find(0x1000), 7);
  EXPECT_EQ(map.find(0x2000), nullptr);
  EXPECT_EQ(map.find(0), nullptr) << "0 marks an empty slot: it is never a key";
  int taken = 0;
  EXPECT_TRUE(map.take(0x1000, taken));
  EXPECT_EQ(taken, 7);
  EXPECT_EQ(map.find(0x1000), nullptr);
}

}  // namespace
}  // namespace gmem
