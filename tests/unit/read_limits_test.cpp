// Hostile inputs against trace::ReadLimits: each one is built here (gzip bombs, a header of
// commas, pickles that multiply one object through their memo, an RMM time past 64 bits) and
// must stop with "FILE: exceeds LIMIT (set with --max-...)" quickly and in bounded memory.
// Memory is measured in a forked child (wait4's peak RSS), so that one test's peak cannot hide
// behind another's.
#include <gtest/gtest.h>
#include <zlib.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>

#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include "gmem/error.hpp"
#include "gmem/trace.hpp"
#include "temp_files.hpp"

namespace gmem::trace {
namespace {

using namespace std::string_literals;

// One gzip member holding `text`.
std::string gzip(const std::string& text) {
  z_stream zs{};
  if (deflateInit2(&zs, 9, Z_DEFLATED, 15 + 16, 9, Z_DEFAULT_STRATEGY) != Z_OK) throw std::runtime_error("deflateInit2");
  std::string out(deflateBound(&zs, static_cast<uLong>(text.size())), '\0');
  zs.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(text.data()));
  zs.avail_in = static_cast<uInt>(text.size());
  zs.next_out = reinterpret_cast<Bytef*>(out.data());
  zs.avail_out = static_cast<uInt>(out.size());
  const int rc = deflate(&zs, Z_FINISH);
  out.resize(zs.total_out);
  deflateEnd(&zs);
  if (rc != Z_STREAM_END) throw std::runtime_error("deflate");
  return out;
}

std::string repeat(const std::string& s, std::size_t times) {
  std::string out;
  out.reserve(s.size() * times);
  for (std::size_t i = 0; i < times; ++i) out += s;
  return out;
}

// What happened when a read ran in a child process.
struct ChildRead {
  std::string error;         // BadInputError's message; empty when the read succeeded
  std::size_t events = 0;    // when it succeeded
  double seconds = 0;
  long peak_rss_kib = 0;     // of the child
};

// Runs read_trace(path, limits) in a forked child: its error, time and peak memory.
ChildRead read_in_child(const std::string& path, const ReadLimits& limits) {
  int pipe_fds[2];
  if (::pipe(pipe_fds) != 0) throw std::runtime_error("pipe");
  const auto start = std::chrono::steady_clock::now();
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::close(pipe_fds[0]);
    std::string message;
    try {
      message = "ok " + std::to_string(read_trace(path, limits).events.size());
    } catch (const BadInputError& e) {
      message = std::string("error ") + e.what();
    } catch (const std::exception& e) {
      message = std::string("other ") + e.what();
    }
    const ssize_t written = ::write(pipe_fds[1], message.data(), message.size());
    ::_exit(written == static_cast<ssize_t>(message.size()) ? 0 : 3);
  }
  ::close(pipe_fds[1]);
  std::string message;
  char buf[4096];
  for (ssize_t n; (n = ::read(pipe_fds[0], buf, sizeof buf)) > 0;) message.append(buf, static_cast<std::size_t>(n));
  ::close(pipe_fds[0]);
  int status = 0;
  rusage usage{};
  ::wait4(pid, &status, 0, &usage);
  ChildRead r;
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  r.peak_rss_kib = usage.ru_maxrss;
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "child status " << status;
  if (message.starts_with("ok ")) r.events = std::stoul(message.substr(3));
  else if (message.starts_with("error ")) r.error = message.substr(6);
  else ADD_FAILURE() << "unexpected: " << message;
  return r;
}

// Generous: the child inherits the test process; what is bounded is that it does not grow
// by the gigabytes these inputs used to take.
constexpr long kBoundedRssKib = 400 * 1024;
constexpr double kQuickSeconds = 10;  // sanitizer builds included; these took minutes or forever

class ReadLimitsTest : public testing::TempFiles {
 protected:
  ReadLimitsTest() : TempFiles("gmem_limits_test_") {}
  // Reads `path` in a child and expects the error `FILE[:LINE]: exceeds ...`, quickly and bounded.
  void expect_exceeds(const std::string& path, const ReadLimits& limits, const std::string& where,
                      const std::string& problem) {
    const ChildRead r = read_in_child(path, limits);
    EXPECT_EQ(r.error, path + where + ": " + problem);
    EXPECT_LT(r.seconds, kQuickSeconds);
    EXPECT_LT(r.peak_rss_kib, kBoundedRssKib);
  }
};

const std::string kHeader = "action,addr,size,stream,time_us,user_frame,lib_frame\n";

// gzip of 1 GiB of zeros (1 MB; it used to inflate in full, 2 GB, before "not a trace") and of
// 10 GiB (10 MB; std::bad_alloc after 5 GB): the first line is refused before the rest inflates.
// Concatenated members of 16 MiB each, to build them quickly.
TEST_F(ReadLimitsTest, GzipOfZerosStopsAtTheFirstLine) {
  const std::string member = gzip(std::string(16 << 20, '\0'));
  const std::string one_gib = write("zeros1g.gz", repeat(member, 64));
  expect_exceeds(one_gib, {}, ":1", "exceeds 1048576 bytes in one line (set with --max-line)");
  const std::string ten_gib = write("zeros10g.gz", repeat(member, 640));
  expect_exceeds(ten_gib, {}, ":1", "exceeds 1048576 bytes in one line (set with --max-line)");
}

// A real-looking CSV inflating past --max-bytes stops at the limit, not at the end.
TEST_F(ReadLimitsTest, GzipInflationStopsAtMaxBytes) {
  const std::string rows = gzip(repeat("alloc,4096,512,0,1,,\n", 1 << 20));  // 21 MiB
  const std::string path = write("rows.csv.gz", gzip(kHeader) + repeat(rows, 50));  // ~1 GiB
  ReadLimits limits;
  limits.max_bytes = 8 << 20;
  expect_exceeds(path, limits, "", "exceeds 8.00 MiB of data once gunzipped (set with --max-bytes)");
  // Exactly at the limit still reads; a byte less does not.
  const std::string text = kHeader + repeat("alloc,4096,512,0,1,,\n", 1000);
  const std::string small = write("exact.csv.gz", gzip(text));
  limits.max_bytes = text.size();
  EXPECT_EQ(read_in_child(small, limits).events, 1000u);
  limits.max_bytes -= 1;
  const ChildRead over = read_in_child(small, limits);
  EXPECT_TRUE(over.error.ends_with(" of data once gunzipped (set with --max-bytes)")) << over.error;
}

TEST_F(ReadLimitsTest, PlainFileOverMaxBytes) {
  const std::string path = write("big.csv", kHeader + repeat("alloc,4096,512,0,1,,\n", 100000));
  ReadLimits limits;
  limits.max_bytes = 1 << 20;
  expect_exceeds(path, limits, "", "exceeds 1.00 MiB of data (set with --max-bytes)");
  // A gzip file itself larger than the limit is refused before inflating.
  const std::string gz = write("big.csv.gz", gzip(kHeader) + std::string(2 << 20, 'x'));
  expect_exceeds(gz, limits, "", "exceeds 1.00 MiB of data (set with --max-bytes)");
}

// A header of 100 MB of commas used to be accepted with 0 events at 3.75 GB: the small version.
TEST_F(ReadLimitsTest, HeaderOfCommas) {
  const std::string commas = write("commas.csv", std::string(500'000, ',') + "\n");
  expect_exceeds(commas, {}, ":1", "exceeds 1024 fields in one line (set with --max-fields)");
  const std::string more = write("more_commas.csv", std::string(2 << 20, ',') + "\n");
  ReadLimits limits;
  limits.max_fields = 1 << 30;
  expect_exceeds(more, limits, ":1", "exceeds 1048576 bytes in one line (set with --max-line)");
  limits.max_fields = 100;
  const std::string header = write("wide.csv", kHeader.substr(0, kHeader.size() - 1) + std::string(200, ',') + "\n");
  expect_exceeds(header, limits, ":1", "exceeds 100 fields in one line (set with --max-fields)");
  // A long row after the header, and a long quoted field spanning lines.
  limits = {};
  limits.max_line = 1000;
  const std::string row = write("row.csv", kHeader + "alloc,4096,512,0,1,," + std::string(2000, 'f') + "\n");
  expect_exceeds(row, limits, ":2", "exceeds 1000 bytes in one line (set with --max-line)");
  const std::string quoted =
      write("quoted.csv", kHeader + "alloc,4096,512,0,1,\"" + repeat("a\n", 1000) + "\",\n");
  expect_exceeds(quoted, limits, ":2", "exceeds 1000 bytes in one line (set with --max-line)");
}

TEST_F(ReadLimitsTest, MaxEvents) {
  const std::string path = write("many.csv", kHeader + repeat("alloc,4096,512,0,1,,\n", 1000));
  ReadLimits limits;
  limits.max_events = 100;
  expect_exceeds(path, limits, ":102", "exceeds 100 events (set with --max-events)");
  limits.max_events = 1000;
  EXPECT_EQ(read_trace(path, limits).events.size(), 1000u);
  const std::string rmm = write("many.log", "Thread,Time,Action,Pointer,Size,Stream\n" +
                                                repeat("1,5.0,allocate,0x10,5,0x0\n", 20));
  limits.max_events = 10;
  expect_exceeds(rmm, limits, ":12", "exceeds 10 events (set with --max-events)");
}

// RMM logs: a time of 9223372036855 s overflowed int64 microseconds (UBSan), and Release took it
// wrapped. Out-of-range times are refused with file and line; the largest that fits is read.
TEST_F(ReadLimitsTest, RmmTimeOutOfRange) {
  const std::string head = "Thread,Time,Action,Pointer,Size,Stream\n1,08:07:59.123456,allocate,0x10,5,0x0\n";
  for (const char* time : {"9223372036855", "9223372036854.775808", "99999999999999999999",
                           "2562047788015:59:59", "2562047789:00:00"}) {
    SCOPED_TRACE(time);
    const std::string path = write("late.log", head + "1," + time + ",free,0x10,5,0x0\n");
    try {
      read_trace(path);
      ADD_FAILURE() << "accepted";
    } catch (const BadInputError& e) {
      EXPECT_EQ(std::string(e.what()), path + ":3: time out of range in column 'Time': '" + time +
                                           "' (microseconds must fit in 64 bits)");
    }
  }
  const Trace t = read_trace(write("latest.log", head + "1,9223372036853.999999,free,0x10,5,0x0\n"));
  EXPECT_EQ(t.events.back().time_us, 9223372036853999999);
}

// --- snapshot pickles, written opcode by opcode (protocol 4) ---------------------------------

std::string short_string(const std::string& s) { return "\x8c" + std::string(1, static_cast<char>(s.size())) + s; }
std::string int2(unsigned v) { return std::string("M") + static_cast<char>(v & 0xff) + static_cast<char>(v >> 8); }
std::string put(unsigned char index) { return std::string("q") + static_cast<char>(index); }
std::string get(unsigned char index) { return std::string("h") + static_cast<char>(index); }

// {'action': 'alloc', 'addr': ADDR, 'size': 512, 'stream': 0, 'time_us': 1, 'frames': FRAMES}
std::string event_dict(unsigned addr, const std::string& frames) {
  return "}(" + short_string("action") + short_string("alloc") + short_string("addr") + int2(addr) +
         short_string("size") + int2(512) + short_string("stream") + "K\x00"s + short_string("time_us") +
         "K\x01" + (frames.empty() ? "" : short_string("frames") + frames) + "u";
}

std::string snapshot(const std::string& device_traces) {
  return "\x80\x04}(" + short_string("device_traces") + device_traces + "u.";
}

// One event dict referred to N times in a device list referred to M times: N*M events for
// about 2*(N+M) bytes. The full version (10^5 * 10^5, 400 KB) grew without bound.
TEST_F(ReadLimitsTest, PickleMultiplyingOneEventThroughItsMemo) {
  const auto multiplied = [&](std::size_t n, std::size_t m) {
    const std::string device = "](" + event_dict(4096, "") + put(0) + repeat(get(0), n - 1) + "e" + put(1);
    return write("refs.pickle", snapshot("](" + device + repeat(get(1), m - 1) + "e"));
  };
  ReadLimits limits;
  limits.max_memo_refs = 1000;
  // The 1001st repeated reference is the 1002nd event (the first reached the dict first).
  expect_exceeds(multiplied(10000, 10000), limits, ":1002",
                 "exceeds 1000 repeated references in a snapshot pickle (set with --max-memo-refs)");
  const std::string full = multiplied(100000, 100000);
  EXPECT_LT(std::filesystem::file_size(full), 500'000u);
  // The device list reached again counts too: once per 10^5 events.
  expect_exceeds(full, {}, ":999993",
                 "exceeds 1000000 repeated references in a snapshot pickle (set with --max-memo-refs)");
}

// 10k events sharing one frames list: converting the list once per reference took 46 s for
// 100k frames. Now each reference is a lookup; and a stack longer than --max-frames is refused.
TEST_F(ReadLimitsTest, PickleEventsSharingOneFramesList) {
  // A frame neither user code nor a known library, so that a walk would go through all of them.
  const std::string frame = "}(" + short_string("filename") + short_string("/site-packages/torch/nn/m.py") +
                            short_string("line") + "K\x07" + short_string("name") + short_string("f") + "u";
  const auto shared = [&](std::size_t frames, std::size_t events) {
    std::string list = "](" + frame + put(2) + repeat(get(2), frames - 1) + "e" + put(3);
    std::string device = "](" + event_dict(1, list);
    for (std::size_t i = 1; i < events; ++i) device += event_dict(static_cast<unsigned>(i + 1), get(3));
    return write("frames.pickle", snapshot("](" + device + "ee"));
  };
  const std::string ok = shared(10000, 10000);
  const ChildRead r = read_in_child(ok, {});
  EXPECT_EQ(r.error, "");
  EXPECT_EQ(r.events, 10000u);
  EXPECT_LT(r.seconds, 2.0);  // a walk per event: 10^8 frames
  expect_exceeds(shared(100000, 10), {}, ":1", "exceeds 10000 frames in one stack (set with --max-frames)");
}

TEST_F(ReadLimitsTest, PickleMaxObjects) {
  ReadLimits limits;
  limits.max_objects = 1000;
  // 2000 Nones on the stack, then an empty snapshot.
  expect_exceeds(write("nones.pickle", "\x80\x04" + std::string(2000, 'N') + "}."), limits, "",
                 "exceeds 1000 objects in a pickle (set with --max-objects)");
  expect_exceeds(write("dups.pickle", "\x80\x04N" + std::string(2000, '2') + "}."), limits, "",
                 "exceeds 1000 objects in a pickle (set with --max-objects)");
}

// The real traces read under their defaults (the largest has ~200k events).
TEST(ReadLimits, DefaultsFitTheRealTraces) {
  const Trace t = read_trace(std::string(GMEM_TEST_DATA) + "/gpt2_generate.trace.csv.gz");
  EXPECT_EQ(t.events.size(), 205223u);
  const ReadLimits limits;
  EXPECT_LT(t.events.size() * 10, limits.max_events);
}

}  // namespace
}  // namespace gmem::trace
