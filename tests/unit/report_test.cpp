// gmem report's pieces: the envelope keeps every column's low and high (checked against the
// full series), and the report's headline is `gmem summary`'s.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <random>

#include "gmem/summary.hpp"
#include "gmem/trace.hpp"
#include "report/envelope.hpp"
#include "report/html_page.hpp"
#include "report/report_data.hpp"
#include "report/sha256.hpp"

namespace gmem::report {
namespace {

TEST(ReportEnvelope, KeepsEachColumnsLowAndHighInOrder) {
  const Columns columns(0, 100, 10);  // columns of 10
  Envelope e(columns);
  e.set(1, 5);
  e.set(2, 50);
  e.set(3, 1);   // column 0 started at 0, before the first set(): its low came first
  e.set(25, 7);  // column 2; column 1 carries 1
  e.set(31, 100);
  e.set(32, 2);  // column 3: the high, then the low
  e.set(33, 7);
  const std::vector<double> p = e.points();
  ASSERT_EQ(p.size(), 20u);
  EXPECT_EQ(p[0], 0);
  EXPECT_EQ(p[1], 50);
  EXPECT_EQ(p[2], 1);  // column 1: nothing happened, the value carried in
  EXPECT_EQ(p[3], 1);
  EXPECT_EQ(p[4], 1);  // column 2 starts at 1 and rises to 7
  EXPECT_EQ(p[5], 7);
  EXPECT_EQ(p[6], 100);
  EXPECT_EQ(p[7], 2);
  EXPECT_EQ(p[18], 7);  // after the last event: the last value
  EXPECT_EQ(p[19], 7);
}

// Random step series: each column's two points are exactly the lowest and highest value the
// series took in it (including the value carried in from the column before).
TEST(ReportEnvelope, MatchesTheFullSeries) {
  std::mt19937 rng(53);
  for (int round = 0; round < 50; ++round) {
    const std::size_t n = 1 + rng() % 5000, cols = 1 + rng() % 300;
    std::vector<std::pair<double, double>> series;
    double x = 0;
    for (std::size_t i = 0; i < n; ++i) {
      x += (rng() % 4 == 0) ? static_cast<double>(rng() % 1000) : 0.0;  // bursts at one time
      series.emplace_back(x, static_cast<double>(rng() % 100000));
    }
    const Columns columns(0, series.back().first, cols);
    Envelope e(columns);
    for (const auto& [px, v] : series) e.set(px, v);
    const std::vector<double> p = e.points();
    std::vector<double> low(cols, 1e300), high(cols, -1e300);
    double carried = 0;
    std::size_t i = 0;
    for (std::size_t c = 0; c < cols; ++c) {
      low[c] = high[c] = carried;
      while (i < n && columns.of(series[i].first) == c) {
        carried = series[i++].second;
        low[c] = std::min(low[c], carried);
        high[c] = std::max(high[c], carried);
      }
    }
    for (std::size_t c = 0; c < cols; ++c) {
      EXPECT_EQ(std::min(p[2 * c], p[2 * c + 1]), low[c]) << "round " << round << " column " << c;
      EXPECT_EQ(std::max(p[2 * c], p[2 * c + 1]), high[c]) << "round " << round << " column " << c;
    }
  }
}

// FIPS 180-4's examples, a two-block tail, and the CSP form of the empty string's digest.
TEST(ReportSha256, KnownDigests) {
  auto hex = [](std::string_view s) {
    std::string out;
    char buf[3];
    for (std::uint8_t b : sha256(s)) std::snprintf(buf, sizeof buf, "%02x", b), out += buf;
    return out;
  };
  EXPECT_EQ(hex("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(hex("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq"),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  EXPECT_EQ(hex(""), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(hex(std::string(1000000, 'a')), "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
  EXPECT_EQ(csp_hash(""), "'sha256-47DEQpj8HBSa+/TImW+5JCeuQeRkm5NMpJWZG3hSuFU='");
}

TEST(ReportData, HeadlineIsTheSummarys) {
  const trace::Trace t = trace::read_trace(GMEM_TEST_DATA "/leak_losses.trace.csv.gz");
  const TraceSummary s = summarize_trace(t);
  const ReportData r = build_report(t);
  EXPECT_EQ(r.headline.peak_allocated, static_cast<std::uint64_t>(s.stats.allocated_bytes[kAllPools].peak));
  EXPECT_EQ(r.headline.peak_reserved, static_cast<std::uint64_t>(s.stats.reserved_bytes[kAllPools].peak));
  EXPECT_EQ(r.headline.cause, s.options().cause);
  EXPECT_EQ(r.headline.cause_name, "leak");
  EXPECT_NE(r.headline.advice.find("capture.py:66:run"), std::string::npos) << r.headline.advice;
  EXPECT_TRUE(r.headline.has_recorded);
  EXPECT_GE(r.headline.recorded_peak_reserved, r.headline.peak_allocated);
  EXPECT_NE(r.json.find("\"leaks\":[{\"site\":\"capture.py:66:run\""), std::string::npos);
}

// Two runs are overlaid by step: each run's charts on step k at [k, k+1).
TEST(ReportData, StepAxisOnRequest) {
  const trace::Trace t = trace::read_trace(GMEM_TEST_DATA "/leak_losses.trace.csv.gz");
  ReportOptions options;
  EXPECT_EQ(build_report(t, options).json.find("\"step\":{"), std::string::npos);
  options.step_axis = true;
  options.axis = "step";
  const ReportData r = build_report(t, options);
  EXPECT_NE(r.json.find("\"default_axis\":\"step\""), std::string::npos);
  EXPECT_NE(r.json.find("\"step\":{\"x\":[0,"), std::string::npos);
  EXPECT_NE(r.json.find("\"steps_found\":39"), std::string::npos);  // as gmem leaks finds them
}

// Allocated memory by lifetime, against a hand-computed case: steps begin at t=10, 20 and 30.
// A (t=0) is before the first step; B (step 1, never freed) and E (step 2, freed in step 3) are
// kept across steps; C and D are freed in the step that allocated them; F (step 3, never freed)
// is flagged saved for backward. One event a column on the event axis: each column holds the
// state at its highest point (after an alloc; before a free).
TEST(ReportData, AllocatedByLifetime) {
  using trace::Action;
  using trace::Event;
  trace::Trace t;
  t.name = "lifetimes";
  t.frames = {""};
  auto add = [&](Action a, std::uint64_t addr, std::uint64_t size, std::int64_t us) {
    Event e;
    e.action = a, e.addr = addr, e.size = size, e.time_us = us, e.line = t.events.size() + 1;
    t.events.push_back(e);
  };
  add(Action::alloc, 0xA000, 1024, 0);            // A
  add(Action::alloc, 0xB000, 2048, 10);           // B
  add(Action::alloc, 0xC000, 4096, 11);           // C
  add(Action::free_completed, 0xC000, 4096, 12);
  add(Action::alloc, 0xD000, 512, 20);            // D
  add(Action::alloc, 0xE000, 1024, 21);           // E
  add(Action::free_completed, 0xD000, 512, 25);
  add(Action::free_completed, 0xE000, 1024, 31);
  add(Action::alloc, 0xF000, 512, 32);            // F
  t.steps_us = {10, 20, 30};
  t.steps_source = "gmem.step() markers";
  t.saved_for_backward = {0xF000};
  trace::rebuild_history_window(t);
  ReportOptions options;
  options.columns = 9;
  const std::string json = build_report(t, options).json;
  EXPECT_NE(json.find("\"lifetime_names\":[\"before the first step (weights, buffers)\",\"kept across steps "
                      "(optimizer state, caches, leaks)\",\"saved for backward (flagged in the snapshot)\",\"this "
                      "step's (activations, temporaries)\"]"),
            std::string::npos)
      << json.substr(json.find("lifetime_names"), 300);
  const std::size_t event_axis = json.find("\"event\":{");
  ASSERT_NE(event_axis, std::string::npos);
  const std::size_t at = json.find("\"lifetimes\":", event_axis);
  ASSERT_NE(at, std::string::npos);
  EXPECT_EQ(json.substr(at, json.find("]]", at) + 2 - at),
            "\"lifetimes\":[[1024,1024,1024,1024,1024,1024,1024,1024,1024],"
            "[0,2048,2048,2048,2048,3072,3072,3072,2048],"
            "[0,0,0,0,0,0,0,0,512],"
            "[0,0,4096,4096,512,512,512,0,0]]");

  // Each column's highest point as events applied (the zoomed largest blocks), and the blocks the
  // page filters with it, largest first: [size, alloc event, free event (9: never), address, ...].
  const std::size_t applied = json.find("\"peak_applied\":", event_axis);
  EXPECT_EQ(json.substr(applied, json.find(']', applied) + 1 - applied), "\"peak_applied\":[1,2,3,3,5,6,6,7,9]");
  const std::size_t list = json.find("\"blocks\":{\"smaller_left_out\":0,\"list\":[");
  ASSERT_NE(list, std::string::npos);
  std::size_t at_block = list;
  for (const char* block : {"[4096,2,3,49152,", "[2048,1,9,45056,", "[1024,0,9,40960,", "[1024,5,7,57344,",
                            "[512,4,6,53248,", "[512,8,9,61440,"}) {
    const std::size_t found = json.find(block, at_block);
    EXPECT_NE(found, std::string::npos) << block;
    if (found != std::string::npos) at_block = found;
  }

  // Without the flag, F is still in its step (no later step began): this step's. Without steps,
  // no lifetimes at all.
  t.saved_for_backward.clear();
  const std::string unflagged = build_report(t, options).json;
  const std::size_t at2 = unflagged.find("\"lifetimes\":", unflagged.find("\"event\":{"));
  EXPECT_EQ(unflagged.substr(at2, unflagged.find("]]", at2) + 2 - at2),
            "\"lifetimes\":[[1024,1024,1024,1024,1024,1024,1024,1024,1024],"
            "[0,2048,2048,2048,2048,3072,3072,3072,2048],"
            "[0,0,4096,4096,512,512,512,0,512]]");
}

TEST(ReportPage, InlinesEverythingAndEscapesTheData) {
  if (!have_chart_library()) GTEST_SKIP() << missing_chart_library_message();
  ReportData r;
  r.trace_name = "a<b>";
  r.headline.cause = "cause: none: </script><script>alert(1)</script>";
  r.json = "{\"x\":\"</script><!--\"}";
  const std::string page = html_page(r);
  EXPECT_EQ(page.find("</script><script>alert"), std::string::npos);  // escaped in the headline
  EXPECT_NE(page.find("gmem report: a&lt;b&gt;"), std::string::npos);
  EXPECT_NE(page.find("\\u003c/script>\\u003c!--"), std::string::npos);  // the data cannot end its element
  EXPECT_NE(page.find("default-src 'none'; script-src 'sha256-"), std::string::npos);
  EXPECT_EQ(page.find("script-src 'unsafe-inline'"), std::string::npos);  // scripts by hash only
  EXPECT_EQ(page.find(" src="), std::string::npos);  // nothing loaded from elsewhere
  EXPECT_EQ(page.find("<link"), std::string::npos);
  EXPECT_NE(page.find("Permission is hereby granted"), std::string::npos);  // uPlot's MIT license
}

}  // namespace
}  // namespace gmem::report
