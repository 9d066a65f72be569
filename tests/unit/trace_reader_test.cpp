// Reading the real traces in tests/data, and the errors for malformed ones.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <string>

#include <unistd.h>

#include "gmem/error.hpp"
#include "gmem/trace.hpp"
#include "temp_files.hpp"

namespace gmem::trace {
namespace {

std::string data_file(const std::string& name) { return std::string(GMEM_TEST_DATA) + "/" + name; }

using testing::TempFiles;

std::map<Action, std::size_t> count_actions(const Trace& t) {
  std::map<Action, std::size_t> counts;
  for (const Event& e : t.events) ++counts[e.action];
  return counts;
}

// Counts from `zcat FILE | cut -d, -f1 | sort | uniq -c`.
struct Expected {
  const char* file;
  std::size_t allocs, frees_requested, frees_completed, segment_allocs;
};
constexpr Expected kTraces[] = {
    {"resnet50.trace.csv.gz", 4439, 4436, 4436, 102},
    {"gpt2.trace.csv.gz", 9045, 9042, 9042, 154},
    {"deeplab_varsize.trace.csv.gz", 17820, 17820, 17820, 136},
    {"leak_losses.trace.csv.gz", 727, 724, 724, 60},
    {"tiny_leak.trace.csv.gz", 24, 22, 22, 3},
    {"two_streams.trace.csv.gz", 650, 639, 630, 11},
};

TEST(TraceReader, ReadsEveryRealTrace) {
  for (const Expected& x : kTraces) {
    SCOPED_TRACE(x.file);
    const Trace t = read_trace(data_file(x.file));
    auto counts = count_actions(t);
    EXPECT_EQ(counts[Action::alloc], x.allocs);
    EXPECT_EQ(counts[Action::free_requested], x.frees_requested);
    EXPECT_EQ(counts[Action::free_completed], x.frees_completed);
    EXPECT_EQ(counts[Action::segment_alloc], x.segment_allocs);
    EXPECT_EQ(t.events.size(), x.allocs + x.frees_requested + x.frees_completed + x.segment_allocs);
    ASSERT_FALSE(t.frames.empty());
    EXPECT_EQ(t.frames[0], "");
    EXPECT_EQ(t.events.front().line, 2u);  // line 1 is the header
    EXPECT_EQ(t.events.back().line, t.events.size() + 1);
    for (const Event& e : t.events) {
      ASSERT_LT(e.user_frame, t.frames.size());
      ASSERT_LT(e.lib_frame, t.frames.size());
    }
    // Interned: no frame string twice.
    EXPECT_EQ(std::set<std::string>(t.frames.begin(), t.frames.end()).size(), t.frames.size());
  }
}

TEST(TraceReader, KnownFacts) {
  const Trace two = read_trace(data_file("two_streams.trace.csv.gz"));
  std::set<std::uint64_t> streams;
  for (const Event& e : two.events) streams.insert(e.stream);
  EXPECT_EQ(streams.size(), 2u);
  EXPECT_EQ(two.name, "two_streams");

  const Trace tiny = read_trace(data_file("tiny_leak.trace.csv.gz"));
  const Event& first = tiny.events.front();
  EXPECT_EQ(first.action, Action::segment_alloc);
  EXPECT_EQ(first.addr, 140543944294400u);
  EXPECT_EQ(first.size, 2097152u);
  EXPECT_EQ(first.time_us, 1795351077529394);
  EXPECT_EQ(tiny.frames[first.user_frame], "capture2.py:71:run");
  EXPECT_EQ(first.lib_frame, 0u);
  std::size_t at_73 = 0;
  for (const Event& e : tiny.events)
    at_73 += e.action == Action::alloc && tiny.frames[e.user_frame] == "capture2.py:73:run";
  EXPECT_GE(at_73, 10u);  // ten kept outputs, allocated at capture2.py:73

  const Trace gpt2 = read_trace(data_file("gpt2.trace.csv.gz"));
  EXPECT_EQ(gpt2.frames[gpt2.events.front().lib_frame], "transformers/modeling_utils.py:3706:to");
}

TEST(TraceReader, Gpt2LoadsFast) {
  const auto start = std::chrono::steady_clock::now();
  const Trace t = read_trace(data_file("gpt2.trace.csv.gz"));
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(t.events.size(), 27283u);
  EXPECT_LT(seconds, 1.0);
}

TEST(TraceReader, ActionNamesRoundTrip) {
  EXPECT_STREQ(action_name(Action::alloc), "alloc");
  EXPECT_STREQ(action_name(Action::free_completed), "free_completed");
  EXPECT_STREQ(action_name(Action::segment_free), "segment_free");
  EXPECT_STREQ(action_name(Action::oom), "oom");
}

TEST_F(TempFiles, PlainAndGzipReadTheSame) {
  const std::string text = read_file_maybe_gzip(data_file("tiny_leak.trace.csv.gz"));
  ASSERT_TRUE(text.starts_with("action,addr,size,stream,time_us,user_frame,lib_frame\n"));
  const Trace plain = read_trace(write("tiny_leak.csv", text));
  const Trace gz = read_trace(data_file("tiny_leak.trace.csv.gz"));
  EXPECT_EQ(plain.name, "tiny_leak");
  ASSERT_EQ(plain.events.size(), gz.events.size());
  EXPECT_EQ(plain.frames, gz.frames);
  for (std::size_t i = 0; i < plain.events.size(); ++i) {
    EXPECT_EQ(plain.events[i].addr, gz.events[i].addr);
    EXPECT_EQ(plain.events[i].user_frame, gz.events[i].user_frame);
  }
}

TEST_F(TempFiles, ConcatenatedGzipMembers) {
  std::ifstream in(data_file("tiny_leak.trace.csv.gz"), std::ios::binary);
  const std::string gz((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const std::string once = read_file_maybe_gzip(data_file("tiny_leak.trace.csv.gz"));
  EXPECT_EQ(read_file_maybe_gzip(write("twice.gz", gz + gz)), once + once);
}

TEST_F(TempFiles, QuotedFieldsAnyColumnOrderCrlf) {
  const std::string path = write(
      "quoted.csv",
      "extra,lib_frame,user_frame,time_us,stream,size,addr,action\r\n"
      "x,,\"train.py:10:f, g\",5,7,1024,4096,alloc\r\n"
      "\"y\",\"lib/a.py:1:\"\"q\"\"\",\"two\nlines\",6,7,1024,4096,free_completed\r\n");
  const Trace t = read_trace(path);
  ASSERT_EQ(t.events.size(), 2u);
  EXPECT_EQ(t.events[0].action, Action::alloc);
  EXPECT_EQ(t.events[0].addr, 4096u);
  EXPECT_EQ(t.events[0].size, 1024u);
  EXPECT_EQ(t.events[0].stream, 7u);
  EXPECT_EQ(t.events[0].time_us, 5);
  EXPECT_EQ(t.frames[t.events[0].user_frame], "train.py:10:f, g");
  EXPECT_EQ(t.events[0].lib_frame, 0u);
  EXPECT_EQ(t.frames[t.events[1].lib_frame], "lib/a.py:1:\"q\"");
  EXPECT_EQ(t.frames[t.events[1].user_frame], "two\nlines");
  EXPECT_EQ(t.events[1].line, 3u);
}

// Expects `fn` to throw BadInputError for `file` at `line` with `words` in its message.
template <class Fn>
void expect_bad_input(Fn fn, const std::string& file, std::size_t line, const std::string& words) {
  try {
    fn();
    ADD_FAILURE() << "no error for " << file;
  } catch (const BadInputError& e) {
    EXPECT_EQ(e.file(), file);
    EXPECT_EQ(e.line(), line);
    EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(file), std::string::npos) << e.what();
  }
}

constexpr const char* kHeader = "action,addr,size,stream,time_us,user_frame,lib_frame\n";

TEST_F(TempFiles, MissingColumn) {
  const std::string path = write("missing.csv", "action,addr,size,time_us,user_frame,lib_frame\n"
                                                "alloc,4096,512,1,,\n");
  expect_bad_input([&] { read_trace(path); }, path, 1, "missing column 'stream'");
}

TEST_F(TempFiles, BadNumber) {
  const std::string path = write("number.csv", std::string(kHeader) +
                                                   "alloc,4096,512,0,1,,\n"
                                                   "alloc,8192,51x2,0,2,,\n");
  expect_bad_input([&] { read_trace(path); }, path, 3, "bad number in column 'size': '51x2'");
  const std::string empty = write("empty_number.csv", std::string(kHeader) + "alloc,,512,0,1,,\n");
  expect_bad_input([&] { read_trace(empty); }, empty, 2, "column 'addr'");
  const std::string negative = write("negative.csv", std::string(kHeader) + "alloc,4096,-512,0,1,,\n");
  expect_bad_input([&] { read_trace(negative); }, negative, 2, "column 'size'");
}

TEST_F(TempFiles, UnknownAction) {
  const std::string path = write("action.csv", std::string(kHeader) + "alloc,4096,512,0,1,,\n"
                                                                      "\n"
                                                                      "malloc,4096,512,0,1,,\n");
  expect_bad_input([&] { read_trace(path); }, path, 4, "unknown action 'malloc'");
}

TEST_F(TempFiles, TooFewFieldsAndUnterminatedQuote) {
  const std::string short_row = write("short.csv", std::string(kHeader) + "alloc,4096,512\n");
  expect_bad_input([&] { read_trace(short_row); }, short_row, 2, "expected 7 fields, found 3");
  const std::string quote = write("quote.csv", std::string(kHeader) + "alloc,4096,512,0,1,\"a.py:1:f,\n");
  expect_bad_input([&] { read_trace(quote); }, quote, 2, "unterminated quoted field");
}

TEST_F(TempFiles, TruncatedGzip) {
  std::ifstream in(data_file("gpt2.trace.csv.gz"), std::ios::binary);
  const std::string gz((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  for (std::size_t keep : {gz.size() / 2, gz.size() - 4, std::size_t{5}}) {
    const std::string path = write("cut.csv.gz", gz.substr(0, keep));
    expect_bad_input([&] { read_trace(path); }, path, 0, "truncated gzip");
  }
  std::string corrupt = gz;
  for (std::size_t i = 100; i < 200; ++i) corrupt[i] = static_cast<char>(corrupt[i] ^ 0x5a);
  const std::string bad = write("corrupt.csv.gz", corrupt);
  expect_bad_input([&] { read_trace(bad); }, bad, 0, "gzip");
}

TEST_F(TempFiles, NotATraceAndMissingFile) {
  const std::string path = write("other.csv", "a,b,c\n1,2,3\n");
  expect_bad_input([&] { read_trace(path); }, path, 1, "not a trace");
  const std::string empty = write("empty.csv", "");
  expect_bad_input([&] { read_trace(empty); }, empty, 0, "empty");
  const std::string absent = (dir_ / "absent.csv").string();
  expect_bad_input([&] { read_trace(absent); }, absent, 0, "cannot open");
  expect_bad_input([&] { read_trace(dir_.string()); }, dir_.string(), 0, "is a directory, not a trace");
}

// read_trace_stream: what `gmem replay -` reads standard input with. No file name, so the format
// comes from the content alone: gzip CSV, plain CSV and a snapshot pickle read as from the file.
TEST_F(TempFiles, StreamReadsEveryFormatAsTheFile) {
  const std::string plain = write("tiny_leak.csv", read_file_maybe_gzip(data_file("tiny_leak.trace.csv.gz")));
  for (const std::string& path : {data_file("tiny_leak.trace.csv.gz"), plain,
                                  data_file("tiny_leak.snapshot.pickle"),
                                  data_file("leak_losses.trace.csv.gz")}) {
    SCOPED_TRACE(path);
    const Trace from_file = read_trace(path);
    std::FILE* in = std::fopen(path.c_str(), "rb");
    ASSERT_NE(in, nullptr);
    const Trace from_stream = read_trace_stream(in, "<stdin>");
    std::fclose(in);
    EXPECT_EQ(from_stream.path, "<stdin>");
    EXPECT_EQ(from_stream.name, "<stdin>");
    ASSERT_EQ(from_stream.events.size(), from_file.events.size());
    EXPECT_EQ(from_stream.frames, from_file.frames);
    EXPECT_EQ(from_stream.steps_us, from_file.steps_us);
    for (std::size_t i = 0; i < from_file.events.size(); ++i) {
      EXPECT_EQ(from_stream.events[i].addr, from_file.events[i].addr);
      EXPECT_EQ(from_stream.events[i].size, from_file.events[i].size);
      EXPECT_EQ(from_stream.events[i].line, from_file.events[i].line);
    }
  }
}

// Errors name the stream and the line, as for a file.
TEST_F(TempFiles, StreamErrorsNameTheStream) {
  const std::string bad = write("bad.csv", std::string(kHeader) + "alloc,1,512,0,0,,\nmalloc,2,512,0,1,,\n");
  std::FILE* in = std::fopen(bad.c_str(), "rb");
  ASSERT_NE(in, nullptr);
  expect_bad_input([&] { read_trace_stream(in, "<stdin>"); }, "<stdin>", 3, "unknown action 'malloc'");
  std::fclose(in);
  const std::string empty = write("empty.csv", "");
  in = std::fopen(empty.c_str(), "rb");
  ASSERT_NE(in, nullptr);
  expect_bad_input([&] { read_trace_stream(in, "<stdin>"); }, "<stdin>", 0, "empty");
  std::fclose(in);
}

// An endless stream (a hostile or runaway producer) stops at --max-bytes, in bounded memory,
// rather than being read to its end.
TEST(TraceReader, EndlessStreamStopsAtMaxBytes) {
  std::FILE* in = ::popen("yes alloc,1,512,0,0,,", "r");
  ASSERT_NE(in, nullptr);
  ReadLimits limits;
  limits.max_bytes = 1 << 20;
  expect_bad_input([&] { read_trace_stream(in, "<stdin>", limits); }, "<stdin>", 0,
                   "exceeds 1.00 MiB of data (set with --max-bytes)");
  ::pclose(in);
}

}  // namespace
}  // namespace gmem::trace
