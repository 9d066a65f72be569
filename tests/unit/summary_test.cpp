// The memory summary: its table shows the engine's numbers, its JSON every statistic, the top
// sites add up, and a trace summary stops where it says (end, peak) with the trace's own numbers.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <sstream>
#include <string>
#include <unordered_map>

#include "gmem/engine.hpp"
#include "gmem/sim_device.hpp"
#include "gmem/summary.hpp"
#include "gmem/trace.hpp"

namespace gmem {
namespace {

std::string data(const std::string& name) { return std::string(GMEM_TEST_DATA) + "/" + name + ".trace.csv.gz"; }

// A value as PyTorch's table prints it ("  1234 KiB", "    12 K "): the number and its unit's
// power of 1024 (sizes) or 1000 (counts).
struct Shown {
  std::int64_t number;
  int power;
};

Shown parse_cell(const std::string& cell, bool size) {
  std::istringstream in(cell);
  Shown shown{0, 0};
  std::string unit;
  in >> shown.number >> unit;
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  const char* counts[] = {"", "K", "M"};
  for (int i = 0; i < (size ? 5 : 3); ++i)
    if (unit == (size ? units[i] : counts[i])) shown.power = i;
  return shown;
}

std::int64_t scaled(std::int64_t value, Shown shown, bool size) {
  for (int i = 0; i < shown.power; ++i) value /= size ? 1024 : 1000;
  return value;
}

// The row of `table` that starts with `label`, split into its four value cells.
std::vector<std::string> row(const std::string& table, const std::string& label, int occurrence = 0) {
  std::istringstream lines(table);
  for (std::string line; std::getline(lines, line);) {
    if (line.rfind("| " + label, 0) != 0 || occurrence-- > 0) continue;
    std::vector<std::string> cells;
    std::istringstream parts(line);
    for (std::string cell; std::getline(parts, cell, '|');) cells.push_back(cell);
    return {cells.begin() + 2, cells.begin() + 6};  // "", label, current, peak, allocated, freed
  }
  return {};
}

MemoryStats busy_engine_stats() {
  SimulatedDevice device;
  Engine engine(device);
  std::vector<void*> blocks;
  for (std::size_t i = 1; i <= 300; ++i) blocks.push_back(engine.malloc(i * 4099 % (3 << 20) + 1));
  for (std::size_t i = 0; i < blocks.size(); i += 3) engine.free(blocks[i]);
  blocks.push_back(engine.malloc(std::size_t{40} << 20));
  return engine.stats();
}

TEST(Summary, TableShowsTheEngineStatsUnderPyTorchsNames) {
  const MemoryStats stats = busy_engine_stats();
  const std::string table = format_summary(stats);
  const std::pair<const char*, const PoolStats*> sizes[] = {
      {"Allocated memory", &stats.allocated_bytes},    {"Active memory", &stats.active_bytes},
      {"Requested memory", &stats.requested_bytes},    {"GPU reserved memory", &stats.reserved_bytes},
      {"Non-releasable memory", &stats.inactive_split_bytes}};
  const std::pair<const char*, const PoolStats*> counts[] = {
      {"Allocations", &stats.allocation}, {"Active allocs", &stats.active},
      {"GPU reserved chunks", &stats.segment}, {"Non-releasable allocs", &stats.inactive_split}};
  // The "all" row, then large and small pools: the nth "from large pool" row belongs to metric n.
  auto check = [&](const char* label, const PoolStats& pools, bool size, int metric) {
    const std::pair<StatPool, std::vector<std::string>> rows[] = {
        {kAllPools, row(table, label)},
        {kLargePool, row(table, "      from large pool", metric)},
        {kSmallPool, row(table, "      from small pool", metric)}};
    for (const auto& [pool, cells] : rows) {
      ASSERT_EQ(cells.size(), 4u) << label << "\n" << table;
      const Stat& s = pools[pool];
      const std::int64_t values[] = {s.current, s.peak, s.allocated, s.freed};
      for (int c = 0; c < 4; ++c) {
        const Shown shown = parse_cell(cells[static_cast<std::size_t>(c)], size);
        EXPECT_EQ(shown.number, scaled(values[c], shown, size)) << label << " pool " << pool << " column " << c;
      }
    }
  };
  int metric = 0;
  for (const auto& [label, pools] : sizes) check(label, *pools, true, metric++);
  for (const auto& [label, pools] : counts) check(label, *pools, false, metric++);
  EXPECT_GT(stats.allocated_bytes[kAllPools].current, 0);
  std::istringstream lines(table);
  for (std::string line; std::getline(lines, line);) EXPECT_EQ(line.size(), 77u) << line;
}

TEST(Summary, MemorySummaryOfAnEngineNamesItsDevice) {
  SimDeviceOptions options;
  options.name = "sim-h100";
  SimulatedDevice device(options);
  Engine engine(device);
  void* block = engine.malloc(std::size_t{3} << 20);
  const std::string text = memory_summary(engine, {{"model.py:1:f", 3 << 20, 1, 3 << 20}});
  EXPECT_NE(text.find("device sim-h100 0"), std::string::npos) << text;
  const auto cells = row(text, "Allocated memory");
  ASSERT_EQ(cells.size(), 4u);
  EXPECT_EQ(parse_cell(cells[0], true).number, 3072);  // KiB
  EXPECT_NE(text.find("model.py:1:f"), std::string::npos);
  EXPECT_EQ(row(memory_summary(engine, {}, true), "      from large pool").size(), 0u);  // abbreviated
  engine.free(block);
}

TEST(Summary, JsonHasEveryStatisticAndTheCausesAddUp) {
  const MemoryStats stats = busy_engine_stats();
  const std::string json = summary_json(stats, top_sites({{"a.py:1:f", 512}}));
  for (const auto& [name, value] : stats.flatten())
    EXPECT_NE(json.find("\"" + name + "\":" + std::to_string(value)), std::string::npos) << name;
  const std::int64_t unallocated = stats.reserved_bytes[kAllPools].current - stats.allocated_bytes[kAllPools].current;
  EXPECT_NE(json.find("\"reserved_unallocated\":{\"total\":" + std::to_string(unallocated)), std::string::npos);
  EXPECT_EQ(stats.free_mapped_bytes + stats.free_unmapped_bytes + stats.partial_page_bytes + stats.small_slack_bytes +
                stats.pending_free_bytes,
            unallocated);
  EXPECT_NE(json.find("\"top\":[{\"site\":\"a.py:1:f\",\"bytes\":512,\"count\":1,\"largest\":512}]"), std::string::npos);
}

TEST(Summary, TopSitesGroupSortAndAddUp) {
  const std::vector<std::pair<std::string, std::int64_t>> live = {
      {"b", 100}, {"a", 300}, {"c", 50}, {"a", 200}, {"d", 400}, {"c", 60}};
  const auto all = top_sites(live, 10);
  ASSERT_EQ(all.size(), 4u);
  EXPECT_EQ(all[0].site, "a");
  EXPECT_EQ(all[0].bytes, 500);
  EXPECT_EQ(all[0].count, 2);
  EXPECT_EQ(all[0].largest, 300);
  std::int64_t total = 0, blocks = 0;
  for (std::size_t i = 0; i < all.size(); ++i) {
    total += all[i].bytes;
    blocks += all[i].count;
    if (i > 0) EXPECT_GE(all[i - 1].bytes, all[i].bytes);
  }
  EXPECT_EQ(total, 1110);
  EXPECT_EQ(blocks, 6);
  const auto two = top_sites(live, 2);
  ASSERT_EQ(two.size(), 2u);
  EXPECT_EQ(two[1].site, "d");
  const std::string table = format_summary(MemoryStats{}, two);
  EXPECT_NE(table.find("Top 2 sites"), std::string::npos);
}

// Allocated memory (rounded to 512 B, freed at free_completed) after each event, from the trace.
std::vector<std::int64_t> allocated_curve(const trace::Trace& t) {
  std::unordered_map<std::uint64_t, std::int64_t> live;
  std::int64_t allocated = 0;
  std::vector<std::int64_t> curve;
  for (const trace::Event& e : t.events) {
    if (e.action == trace::Action::alloc) {
      live[e.addr] = static_cast<std::int64_t>((e.size + 511) / 512 * 512);
      allocated += live[e.addr];
    } else if (e.action == trace::Action::free_completed) {
      allocated -= live[e.addr];
      live.erase(e.addr);
    }
    curve.push_back(allocated);
  }
  return curve;
}

std::int64_t sum(const std::vector<TopAllocation>& top) {
  std::int64_t total = 0;
  for (const TopAllocation& t : top) total += t.bytes;
  return total;
}

TEST(TraceSummary, AtTheEndMatchesTheTraceAndTheTopSitesHoldEverything) {
  const trace::Trace t = trace::read_trace(data("leak_losses"));
  const std::vector<std::int64_t> curve = allocated_curve(t);
  const TraceSummary s = summarize_trace(t, SummaryPoint::end, 1000);
  EXPECT_EQ(s.events, t.events.size());
  EXPECT_EQ(s.stats.allocated_bytes[kAllPools].current, curve.back());
  EXPECT_EQ(s.stats.allocated_bytes[kAllPools].peak, *std::max_element(curve.begin(), curve.end()));
  EXPECT_EQ(sum(s.top), s.stats.allocated_bytes[kAllPools].current);
}

TEST(TraceSummary, AtThePeakStopsWhereAllocatedPeaks) {
  for (const char* name : {"gpt2", "tiny_leak"}) {
    const trace::Trace t = trace::read_trace(data(name));
    const std::vector<std::int64_t> curve = allocated_curve(t);
    const std::int64_t peak = *std::max_element(curve.begin(), curve.end());
    const TraceSummary s = summarize_trace(t, SummaryPoint::peak, 1000);
    EXPECT_LT(s.events, t.events.size()) << name;
    EXPECT_EQ(curve[s.events - 1], peak) << name;
    EXPECT_EQ(s.stats.allocated_bytes[kAllPools].current, peak) << name;
    EXPECT_GE(s.stats.reserved_bytes[kAllPools].current, peak) << name;
    EXPECT_EQ(sum(s.top), peak) << name;  // every live byte belongs to one site
    const TraceSummary ten = summarize_trace(t, SummaryPoint::peak);
    EXPECT_LE(ten.top.size(), 10u);
    EXPECT_LE(sum(ten.top), peak);
    for (std::size_t i = 0; i < ten.top.size(); ++i) EXPECT_EQ(ten.top[i].bytes, s.top[i].bytes) << name;
  }
}

TEST(TraceSummary, TinyLeakAtItsPeakIsHeldByTheKeptOutputsLine) {
  const TraceSummary s = summarize_trace(trace::read_trace(data("tiny_leak")), SummaryPoint::peak);
  ASSERT_FALSE(s.top.empty());
  EXPECT_EQ(s.top[0].site, "capture2.py:73:run");
  const std::string table = format_summary(s.stats, s.top, s.options());
  EXPECT_NE(table.find("tiny_leak at peak allocated"), std::string::npos);
  EXPECT_NE(table.find("capture2.py:73:run"), std::string::npos);
}

// The summary decides the cause as OOM reports and `gmem leaks` do, from the whole trace's leak test.
TEST(TraceSummary, EndsWithTheCause) {
  const TraceSummary leaking = summarize_trace(trace::read_trace(data("leak_losses")));
  EXPECT_TRUE(leaking.options().cause.starts_with("cause: leak: capture.py:66:run keeps +5.00 MiB a step"))
      << leaking.options().cause;
  EXPECT_NE(format_summary(leaking.stats, leaking.top, leaking.options()).find("| cause: leak: capture.py:66:run"),
            std::string::npos);
  const TraceSummary clean = summarize_trace(trace::read_trace(data("resnet50")));
  EXPECT_TRUE(clean.options().cause.starts_with("cause: none: no site keeps more memory alive"))
      << clean.options().cause;
}

// Totals are the sums of their parts, in every trace of tests/data, at its end and at its peak:
// every pooled statistic's all-pools current, total allocated and total freed are the pools' sums;
// reserved - allocated splits into its four causes; the reserved chunks are the chunks held plus the
// small pool's slabs. (The table prints these numbers; its cells are rounded down each.)
TEST(TraceSummary, TotalsAreTheSumsOfTheirPartsInEveryTrace) {
  std::size_t traces = 0;
  for (const auto& entry : std::filesystem::directory_iterator(GMEM_TEST_DATA)) {
    const std::string path = entry.path().string();
    if (!path.ends_with(".trace.csv.gz") && !path.ends_with(".pickle")) continue;
    ++traces;
    const trace::Trace t = trace::read_trace(path);
    for (SummaryPoint at : {SummaryPoint::end, SummaryPoint::peak}) {
      const MemoryStats st = summarize_trace(t, at).stats;
      const std::string where = t.name + (at == SummaryPoint::end ? " at its end" : " at its peak");
      for (const auto* pooled : {&st.allocated_bytes, &st.requested_bytes, &st.active_bytes, &st.reserved_bytes,
                                 &st.inactive_split_bytes, &st.allocation, &st.active, &st.segment,
                                 &st.inactive_split}) {
        const PoolStats& p = *pooled;
        EXPECT_EQ(p[kAllPools].current, p[kSmallPool].current + p[kLargePool].current) << where;
        EXPECT_EQ(p[kAllPools].allocated, p[kSmallPool].allocated + p[kLargePool].allocated) << where;
        EXPECT_EQ(p[kAllPools].freed, p[kSmallPool].freed + p[kLargePool].freed) << where;
      }
      EXPECT_EQ(st.reserved_bytes[kAllPools].current - st.allocated_bytes[kAllPools].current,
                st.free_mapped_bytes + st.free_unmapped_bytes + st.partial_page_bytes + st.small_slack_bytes +
                    st.pending_free_bytes)
          << where;
      EXPECT_EQ(st.segment[kLargePool].current, st.chunks_held) << where;
      EXPECT_EQ(st.reserved_bytes[kAllPools].current, st.chunks_held * st.granularity) << where;
      const std::string table = format_summary(st);
      EXPECT_NE(table.find("| " + std::to_string(st.segment[kAllPools].current) + " = " +
                           std::to_string(st.chunks_held) + " chunks + " +
                           std::to_string(st.segment[kSmallPool].current) + " small-pool slabs"),
                std::string::npos)
          << where << "\n" << table;
    }
  }
  EXPECT_GE(traces, 10u);
}

}  // namespace
}  // namespace gmem
