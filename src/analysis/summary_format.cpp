// format_summary / summary_json: PyTorch's memory_summary() table, then gmem's own section.
#include <algorithm>
#include <cstdio>
#include <map>
#include <sstream>
#include <string>

#include "common/json.hpp"
#include "gmem/causes.hpp"
#include "gmem/engine.hpp"
#include "gmem/error.hpp"
#include "gmem/summary.hpp"

namespace gmem {
namespace {

constexpr int kWidth = 75;  // inside the | borders, as PyTorch's

// PyTorch's _format_size: the unit is chosen by `scale` (the column's "all pools" value), or by
// the value itself when it is larger (a pool's peak can exceed all's: peaks are reached at
// different times), so that it always fits its 10 columns.
std::string format_size(std::int64_t bytes, std::int64_t scale) {
  static const char* units[] = {"B  ", "KiB", "MiB", "GiB", "TiB", "PiB"};
  int unit = 0;
  double s = static_cast<double>(std::max(scale, bytes));
  while (unit < 5 && s >= 768 * 1024) {
    bytes /= 1024;
    s /= 1024;
    ++unit;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, "%6lld %s", static_cast<long long>(bytes), units[unit]);
  return buf;
}

// PyTorch's _format_count.
std::string format_count(std::int64_t count, std::int64_t scale) {
  static const char* units[] = {" ", "K", "M"};
  int unit = 0;
  double s = static_cast<double>(std::max(scale, count));
  while (unit < 2 && s >= 750 * 1000) {
    count /= 1000;
    s /= 1000;
    ++unit;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, "%7lld %s ", static_cast<long long>(count), units[unit]);
  return buf;
}

std::string pad(std::string text, std::size_t width) {
  text.resize(width, ' ');
  return text;
}

// Sites too long for their column lose their start: the end names the file, line and function.
std::string pad_site(const std::string& site, std::size_t width) {
  return pad(site.size() > width ? "..." + site.substr(site.size() - (width - 3)) : site, width);
}

std::string centered(const std::string& text) {
  const std::size_t left = text.size() < kWidth ? (kWidth - text.size()) / 2 : 0;
  return pad(std::string(left, ' ') + text, kWidth);
}

class Table {
 public:
  void rule(char c) { lines_.push_back(std::string(kWidth, c)); }
  void line(std::string text) { lines_.push_back(pad(std::move(text), kWidth)); }
  std::string str() const {
    std::string out;
    for (const std::string& l : lines_) out += "|" + l + "|\n";
    return out;
  }

 private:
  std::vector<std::string> lines_;
};

using Formatter = std::string (*)(std::int64_t, std::int64_t);

void metric_rows(Table& table, const PoolStats& pools, const char* name, Formatter format,
                 bool abbreviated) {
  table.rule('-');
  const Stat& all = pools[kAllPools];
  const std::pair<StatPool, const char*> rows[] = {
      {kAllPools, name}, {kLargePool, "      from large pool"}, {kSmallPool, "      from small pool"}};
  for (const auto& [pool, label] : rows) {
    if (abbreviated && pool != kAllPools) break;
    const Stat& s = pools[pool];
    table.line(" " + pad(label, 21) + " | " + format(s.current, all.current) + " | " +
               format(s.peak, all.peak) + " | " + format(s.allocated, all.allocated) + " | " +
               format(s.freed, all.freed) + " ");
  }
}

std::string percent(std::int64_t part, std::int64_t whole) {
  if (whole <= 0) return "";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%5.1f%%", 100.0 * static_cast<double>(part) / static_cast<double>(whole));
  return buf;
}

void gmem_rows(Table& table, const MemoryStats& stats, const std::vector<TopAllocation>& top) {
  const std::int64_t reserved = stats.reserved_bytes[kAllPools].current;
  const std::int64_t unallocated = reserved - stats.allocated_bytes[kAllPools].current;
  auto row = [&](const char* label, std::int64_t bytes, const std::string& text) {
    table.line(" " + pad(label, 21) + " | " + format_size(bytes, std::max(unallocated, reserved)) +
               " | " + text);
  };
  table.rule('=');
  table.line(centered("gmem: reserved but not allocated, by cause"));
  table.rule('-');
  row("Reserved - allocated", unallocated, percent(unallocated, reserved) + " of reserved");
  row("  free pages, mapped", stats.free_mapped_bytes, percent(stats.free_mapped_bytes, unallocated));
  row("  chunks not mapped", stats.free_unmapped_bytes, percent(stats.free_unmapped_bytes, unallocated));
  row("  partial pages", stats.partial_page_bytes, percent(stats.partial_page_bytes, unallocated));
  row("  small-class slack", stats.small_slack_bytes, percent(stats.small_slack_bytes, unallocated));
  row("  held for streams", stats.pending_free_bytes, percent(stats.pending_free_bytes, unallocated));
  row("Largest free range", stats.largest_free_range, "mapped, ready for one allocation");
  table.line(" " + pad("Chunks held / mapped", 21) + " | " + std::to_string(stats.chunks_held) + " / " +
             std::to_string(stats.chunks_mapped) + ", " + format_bytes(static_cast<std::uint64_t>(stats.granularity)) +
             " each");
  // The table's "GPU reserved chunks" counts the small pool's slabs as well as the chunks.
  table.line(" " + pad("Reserved chunks", 21) + " | " + std::to_string(stats.segment[kAllPools].current) +
             " = " + std::to_string(stats.segment[kLargePool].current) + " chunks + " +
             std::to_string(stats.segment[kSmallPool].current) + " small-pool slabs");
  table.line(" " + pad("Maps / unmaps", 21) + " | " + std::to_string(stats.num_maps) + " / " +
             std::to_string(stats.num_unmaps) + ", stitched mallocs: " + std::to_string(stats.num_stitches));
  // What those calls cost the program's host thread: where it grows step after step, the layout
  // has not settled.
  char cost[96];
  std::snprintf(cost, sizeof cost, "%.1f ms in calls, %.1f ms waiting for streams",
                static_cast<double>(stats.device_call_us) / 1e3,
                static_cast<double>(stats.stream_wait_us) / 1e3);
  table.line(" " + pad("Driver time", 21) + " | " + cost);
  if (top.empty()) return;
  table.rule('=');
  table.line(" " + pad("Top " + std::to_string(top.size()) + " sites by live bytes", 46) +
             " |  Live size | Allocs ");
  table.rule('-');
  std::int64_t scale = 0;
  for (const TopAllocation& t : top) scale = std::max(scale, t.bytes);
  for (const TopAllocation& t : top) {
    char count[16];
    std::snprintf(count, sizeof count, "%6lld", static_cast<long long>(t.count));
    table.line(" " + pad_site(t.site, 46) + " | " + format_size(t.bytes, scale) + " | " + count);
  }
}

// Text as table lines of at most `width` columns, broken between words.
void wrapped(Table& table, const std::string& text, std::size_t width) {
  std::string line;
  std::istringstream words(text);
  for (std::string word; words >> word;) {
    if (!line.empty() && line.size() + 1 + word.size() > width) {
      table.line(" " + line);
      line = "  ";
    }
    line += (line.empty() || line == "  " ? "" : " ") + word;
  }
  if (!line.empty()) table.line(" " + line);
}

}  // namespace

std::string summary_cause(const MemoryStats& stats, const std::vector<LeakFinding>& leaks, std::uint64_t steps) {
  CauseEvidence e;
  e.allocated = static_cast<std::size_t>(stats.allocated_bytes[kAllPools].current);
  e.reserved = static_cast<std::size_t>(stats.reserved_bytes[kAllPools].current);
  e.stranded = static_cast<std::size_t>(stats.partial_page_bytes + stats.small_slack_bytes);
  e.steps = steps;
  e.leaks = leaks;
  const Diagnosis d = diagnose(e);
  return "cause: " + d.name + ": " + d.evidence;
}

std::vector<TopAllocation> top_sites(const std::vector<std::pair<std::string, std::int64_t>>& live,
                                     std::size_t n) {
  std::map<std::string, TopAllocation> by_site;
  for (const auto& [site, bytes] : live) {
    TopAllocation& t = by_site[site];
    t.site = site;
    t.bytes += bytes;
    t.count += 1;
    t.largest = std::max(t.largest, bytes);
  }
  std::vector<TopAllocation> top;
  for (auto& entry : by_site) top.push_back(std::move(entry.second));
  std::sort(top.begin(), top.end(), [](const TopAllocation& a, const TopAllocation& b) {
    return a.bytes != b.bytes ? a.bytes > b.bytes : a.site < b.site;
  });
  if (top.size() > n) top.resize(n);
  return top;
}

std::string format_summary(const MemoryStats& stats, const std::vector<TopAllocation>& top,
                           const SummaryOptions& options) {
  Table table;
  table.rule('=');
  table.line(centered("gmem memory summary, device " + options.device));
  if (!options.note.empty()) table.line(centered(options.note));
  if (!options.history.empty()) {
    table.rule('-');
    wrapped(table, options.history, kWidth - 2);
  }
  table.rule('-');
  table.line(pad("  OOMs: " + std::to_string(stats.num_ooms), 37) + " | " +
             "Alloc retries: " + std::to_string(stats.num_alloc_retries));
  table.rule('=');
  table.line("        Metric         | Cur Usage  | Peak Usage | Tot Alloc  | Tot Freed  ");
  const bool brief = options.abbreviated;
  metric_rows(table, stats.allocated_bytes, "Allocated memory", format_size, brief);
  metric_rows(table, stats.active_bytes, "Active memory", format_size, brief);
  metric_rows(table, stats.requested_bytes, "Requested memory", format_size, brief);
  metric_rows(table, stats.reserved_bytes, "GPU reserved memory", format_size, brief);
  metric_rows(table, stats.inactive_split_bytes, "Non-releasable memory", format_size, brief);
  metric_rows(table, stats.allocation, "Allocations", format_count, brief);
  metric_rows(table, stats.active, "Active allocs", format_count, brief);
  metric_rows(table, stats.segment, "GPU reserved chunks", format_count, brief);
  metric_rows(table, stats.inactive_split, "Non-releasable allocs", format_count, brief);
  gmem_rows(table, stats, top);
  if (!options.cause.empty()) {
    table.rule('=');
    wrapped(table, options.cause, kWidth - 2);
  }
  table.rule('=');
  return table.str();
}

std::string summary_json(const MemoryStats& stats, const std::vector<TopAllocation>& top,
                         const SummaryOptions& options) {
  json::Writer w;
  w.begin_object().field("device", std::string_view(options.device)).field("note", std::string_view(options.note));
  w.field("cause", std::string_view(options.cause));
  w.field("history", std::string_view(options.history));
  w.key("stats").begin_object();
  for (const auto& [name, value] : stats.flatten()) w.field(name, value);
  w.end_object();
  const std::int64_t unallocated = stats.reserved_bytes[kAllPools].current - stats.allocated_bytes[kAllPools].current;
  w.key("reserved_unallocated")
      .begin_object()
      .field("total", unallocated)
      .field("free_mapped", stats.free_mapped_bytes)
      .field("free_unmapped", stats.free_unmapped_bytes)
      .field("partial_pages", stats.partial_page_bytes)
      .field("small_slack", stats.small_slack_bytes)
      .field("held_for_streams", stats.pending_free_bytes)
      .end_object();
  w.field("largest_free_range", stats.largest_free_range);
  w.key("top").begin_array();
  for (const TopAllocation& t : top)
    w.begin_object()
        .field("site", std::string_view(t.site))
        .field("bytes", t.bytes)
        .field("count", t.count)
        .field("largest", t.largest)
        .end_object();
  w.end_array().end_object();
  return w.str() + "\n";
}

std::string memory_summary(const Engine& engine, const std::vector<TopAllocation>& top, bool abbreviated) {
  SummaryOptions options;
  options.device = engine.device().name() + " " + std::to_string(engine.device().index());
  options.abbreviated = abbreviated;
  return format_summary(engine.detailed_stats(), top, options);
}

}  // namespace gmem
