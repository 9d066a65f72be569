// The pickle reader, the snapshot pickle and RMM log trace readers.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>

#include <unistd.h>

#include "gmem/error.hpp"
#include "gmem/trace.hpp"
#include "temp_files.hpp"
#include "trace/formats.hpp"
#include "trace/pickle.hpp"
#include "trace/replay.hpp"

namespace gmem {
namespace {

using pickle::Value;

template <std::size_t N>
std::string bytes(const char (&literal)[N]) { return std::string(literal, N - 1); }

// pickle.dumps({'ints': [0, 1, -1, 255, 256, 65535, 65536, -2**31, 2**31, 2**40, -2**40,
//   2**63-1, -2**63], 'f': 1.5, 'neg': -0.25, 's': 'héllo', 'b': b'\x00y', 'n': None, 't': True,
//   'fa': False, 'tup': (1, 'a'), 'sh1': shared, 'sh2': shared, 'set': {3}, 'empty': {}},
//   protocol=4) with shared = [1, 2], by Python 3.11.
const std::string kProtocol4 = bytes(
    "\x80\x04\x95\xd2\x00\x00\x00\x00\x00\x00\x00\x7d\x94\x28\x8c\x04\x69\x6e\x74\x73\x94\x5d\x94\x28\x4b\x00\x4b\x01\x4a\xff\xff\xff\xff\x4b\xff\x4d\x00\x01\x4d\xff\xff\x4a\x00\x00\x01\x00\x4a\x00\x00\x00\x80\x8a\x05\x00\x00\x00\x80\x00\x8a\x06\x00\x00\x00\x00\x00\x01\x8a\x06\x00\x00\x00\x00\x00\xff\x8a\x08\xff\xff\xff\xff\xff\xff\xff\x7f\x8a\x08\x00\x00\x00\x00\x00\x00\x00\x80\x65\x8c\x01\x66\x94\x47\x3f\xf8\x00\x00\x00\x00\x00\x00\x8c\x03\x6e\x65\x67\x94\x47\xbf\xd0\x00\x00\x00\x00\x00\x00\x8c\x01\x73\x94\x8c\x06\x68\xc3\xa9\x6c\x6c\x6f\x94\x8c\x01\x62\x94\x43\x02\x00\x79\x94\x8c\x01\x6e\x94\x4e\x8c\x01\x74\x94\x88\x8c\x02\x66\x61\x94\x89\x8c\x03\x74\x75\x70\x94\x4b\x01\x8c\x01\x61\x94\x86\x94\x8c\x03\x73\x68\x31\x94\x5d\x94\x28\x4b\x01\x4b\x02\x65\x8c\x03\x73\x68\x32\x94\x68\x10\x8c\x03\x73\x65\x74\x94\x8f\x94\x28\x4b\x03\x90\x8c\x05\x65\x6d\x70\x74\x79\x94\x7d\x94\x75\x2e");

TEST(Pickle, Protocol4Data) {
  const pickle::Document doc = pickle::parse(kProtocol4, "p4");
  const Value& v = doc.root();
  ASSERT_TRUE(v.is_dict());
  const std::vector<std::int64_t> ints = {0, 1, -1, 255, 256, 65535, 65536, -2147483648LL, 2147483648LL,
                                          1LL << 40, -(1LL << 40), INT64_MAX, INT64_MIN};
  const pickle::List& list = v.get("ints")->as_list();
  ASSERT_EQ(list.size(), ints.size());
  for (std::size_t i = 0; i < ints.size(); ++i) EXPECT_EQ(list[i].as_int(), ints[i]) << i;
  EXPECT_EQ(v.get("f")->as_float(), 1.5);
  EXPECT_EQ(v.get("neg")->as_float(), -0.25);
  EXPECT_EQ(v.get("s")->as_string(), "h\xc3\xa9llo");
  EXPECT_EQ(v.get("b")->kind(), Value::Kind::bytes);
  EXPECT_EQ(v.get("b")->as_string(), std::string("\0y", 2));
  EXPECT_TRUE(v.get("n")->is_none());
  EXPECT_TRUE(v.get("t")->as_bool());
  EXPECT_FALSE(v.get("fa")->as_bool());
  EXPECT_EQ(v.get("tup")->kind(), Value::Kind::tuple);
  EXPECT_EQ(v.get("tup")->as_list().at(1).as_string(), "a");
  EXPECT_EQ(v.get("set")->kind(), Value::Kind::set);
  EXPECT_EQ(v.get("set")->as_list().at(0).as_int(), 3);
  EXPECT_TRUE(v.get("empty")->as_dict().empty());
  // One list referred to twice is one object, as in Python.
  EXPECT_EQ(&v.get("sh1")->as_list(), &v.get("sh2")->as_list());
  EXPECT_EQ(v.get("sh2")->as_list().size(), 2u);
  EXPECT_EQ(v.get("absent"), nullptr);
  EXPECT_THROW(v.get("s")->as_int(), std::logic_error);
}

TEST(Pickle, Protocol2And0) {
  // pickle.dumps({'ints': [0, -1, 2**40, -2**63], 'f': 1.5, 's': 'héllo', 'n': None, 't': True,
  //   'tup': (1, 'a'), 'sh1': shared, 'sh2': shared}, protocol=2)
  const pickle::Document doc2 = pickle::parse(bytes(
      "\x80\x02\x7d\x71\x00\x28\x58\x04\x00\x00\x00\x69\x6e\x74\x73\x71\x01\x5d\x71\x02\x28\x4b\x00\x4a\xff\xff\xff\xff\x8a\x06\x00\x00\x00\x00\x00\x01\x8a\x08\x00\x00\x00\x00\x00\x00\x00\x80\x65\x58\x01\x00\x00\x00\x66\x71\x03\x47\x3f\xf8\x00\x00\x00\x00\x00\x00\x58\x01\x00\x00\x00\x73\x71\x04\x58\x06\x00\x00\x00\x68\xc3\xa9\x6c\x6c\x6f\x71\x05\x58\x01\x00\x00\x00\x6e\x71\x06\x4e\x58\x01\x00\x00\x00\x74\x71\x07\x88\x58\x03\x00\x00\x00\x74\x75\x70\x71\x08\x4b\x01\x58\x01\x00\x00\x00\x61\x71\x09\x86\x71\x0a\x58\x03\x00\x00\x00\x73\x68\x31\x71\x0b\x5d\x71\x0c\x28\x4b\x01\x4b\x02\x65\x58\x03\x00\x00\x00\x73\x68\x32\x71\x0d\x68\x0c\x75\x2e"),
      "p2");
  const Value& v2 = doc2.root();
  EXPECT_EQ(v2.get("ints")->as_list().at(2).as_int(), 1LL << 40);
  EXPECT_EQ(v2.get("ints")->as_list().at(3).as_int(), INT64_MIN);
  EXPECT_EQ(v2.get("s")->as_string(), "h\xc3\xa9llo");
  EXPECT_EQ(&v2.get("sh1")->as_list(), &v2.get("sh2")->as_list());

  // pickle.dumps([1, -2, {3: 4.5}, (), [10**12]], protocol=0)
  const pickle::Document doc0 = pickle::parse("(lp0\nI1\naI-2\na(dp1\nI3\nF4.5\nsa(ta(lp2\nL1000000000000L\naa.", "p0");
  const pickle::List& l = doc0.root().as_list();
  ASSERT_EQ(l.size(), 5u);
  EXPECT_EQ(l[1].as_int(), -2);
  EXPECT_EQ(l[2].as_dict().at(0).first.as_int(), 3);
  EXPECT_EQ(l[2].as_dict().at(0).second.as_float(), 4.5);
  EXPECT_EQ(l[3].kind(), Value::Kind::tuple);
  EXPECT_EQ(l[4].as_list().at(0).as_int(), 1000000000000LL);
}

TEST(Pickle, CyclesAreHarmless) {
  // x = []; x.append(x); pickle.dumps(x, protocol=2)
  const pickle::Document doc = pickle::parse(bytes("\x80\x02]q\x00" "h\x00" "a."), "cycle");
  const pickle::List& x = doc.root().as_list();
  ASSERT_EQ(x.size(), 1u);
  EXPECT_EQ(&x[0].as_list(), &x);
}

void expect_pickle_error(const std::string& data, const std::string& words) {
  try {
    pickle::parse(data, "bad.pickle");
    ADD_FAILURE() << "accepted";
  } catch (const BadInputError& e) {
    EXPECT_EQ(e.file(), "bad.pickle");
    EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
  }
}

TEST(Pickle, RejectsCodeAndBrokenData) {
  // pickle.dumps(collections.OrderedDict(a=1), protocol=2): GLOBAL + REDUCE
  expect_pickle_error(bytes("\x80\x02\x63\x63\x6f\x6c\x6c\x65\x63\x74\x69\x6f\x6e\x73\x0a\x4f\x72\x64\x65\x72\x65\x64\x44\x69\x63\x74\x0a\x71\x00\x29\x52\x71\x01\x58\x01\x00\x00\x00\x61\x71\x02\x4b\x01\x73\x2e"),
                      "byte 2: GLOBAL opcode");
  // The same at protocol 4: STACK_GLOBAL
  expect_pickle_error(bytes("\x80\x04\x95\x29\x00\x00\x00\x00\x00\x00\x00\x8c\x0b\x63\x6f\x6c\x6c\x65\x63\x74\x69\x6f\x6e\x73\x94\x8c\x0b\x4f\x72\x64\x65\x72\x65\x64\x44\x69\x63\x74\x94\x93\x94\x29\x52\x94\x8c\x01\x61\x94\x4b\x01\x73\x2e"),
                      "STACK_GLOBAL");
  expect_pickle_error(bytes("\x80\x02)}R."), "REDUCE");
  expect_pickle_error(bytes("\x80\x02)}b."), "BUILD");
  expect_pickle_error(bytes("\x80\x02)\x81."), "NEWOBJ");
  expect_pickle_error(bytes("(ios\nsystem\n."), "INST");
  expect_pickle_error(bytes("\x80\x04(o."), "OBJ");
  expect_pickle_error(kProtocol4.substr(0, 100), "truncated");
  expect_pickle_error(bytes("\x80\x02K\x01"), "truncated");  // no STOP
  expect_pickle_error(bytes("\x80\x02h\x05."), "memo entry 5");
  expect_pickle_error(bytes("\x80\x02K\x01K\x02K\x03s."), "SETITEM expects a dict, found int");
  expect_pickle_error(bytes("\x80\x02" "e."), "no MARK");
  expect_pickle_error(bytes("\x80\x02\xff."), "unknown opcode 0xff");
  // 2**64 does not fit
  expect_pickle_error(bytes("\x80\x04\x95\x0c\x00\x00\x00\x00\x00\x00\x00\x8a\x09\x00\x00\x00\x00\x00\x00\x00\x00\x01."),
                      "64 bits");
}

std::string data_file(const std::string& name) { return std::string(GMEM_TEST_DATA) + "/" + name; }

TEST(SnapshotPickle, SameEventsAsTheCsvOfTheSameRun) {
  const trace::Trace snap = trace::read_trace(data_file("tiny_leak.snapshot.pickle"));
  const trace::Trace csv = trace::read_trace(data_file("tiny_leak.trace.csv.gz"));
  EXPECT_EQ(snap.name, "tiny_leak");
  ASSERT_EQ(snap.events.size(), csv.events.size());
  for (std::size_t i = 0; i < csv.events.size(); ++i) {
    SCOPED_TRACE("event " + std::to_string(i));
    const trace::Event& a = snap.events[i];
    const trace::Event& b = csv.events[i];
    EXPECT_EQ(a.action, b.action);
    EXPECT_EQ(a.addr, b.addr);
    EXPECT_EQ(a.size, b.size);
    EXPECT_EQ(a.stream, b.stream);
    EXPECT_EQ(a.time_us, b.time_us);
    EXPECT_EQ(snap.frames[a.user_frame], csv.frames[b.user_frame]);
    EXPECT_EQ(snap.frames[a.lib_frame], csv.frames[b.lib_frame]);
    EXPECT_EQ(a.line, i + 1);  // the record's position in device_traces
  }
  const trace::ReplayResult r = trace::replay(snap);
  EXPECT_FALSE(r.failed) << r.failure;
  EXPECT_EQ(r.live_at_end, 2u);
}

std::string file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

TEST(SnapshotPickle, DamagedFilesGiveErrorsNotCrashes) {
  const std::string good = file_bytes(data_file("tiny_leak.snapshot.pickle"));
  for (std::size_t keep = 0; keep < good.size(); keep += 13)
    EXPECT_THROW(pickle::parse(good.substr(0, keep), "cut"), BadInputError) << keep;
  std::uint32_t seed = 12345;
  for (int round = 0; round < 300; ++round) {
    std::string bad = good;
    for (int flips = 0; flips < 3; ++flips) {
      seed = seed * 1664525u + 1013904223u;
      bad[seed % bad.size()] = static_cast<char>(seed >> 24);
    }
    trace::Trace t;
    t.path = "mutated";
    t.frames.emplace_back();
    try {
      trace::detail::read_snapshot_pickle(bad, t, trace::ReadLimits{});  // may still be a valid snapshot
    } catch (const BadInputError& e) {
      EXPECT_EQ(e.file(), "mutated");
    }
  }
}

// The files a test writes go in its own directory, removed after the test; path_: the last.
class TempFile : public gmem::testing::TempFiles {
 protected:
  TempFile() : TempFiles("gmem_pickle_test_") {}
  const std::string& write(const std::string& name, const std::string& content) {
    path_ = TempFiles::write(name, content);
    return path_;
  }
  void expect_error(std::size_t line, const std::string& words) {
    try {
      trace::read_trace(path_);
      ADD_FAILURE() << "accepted";
    } catch (const BadInputError& e) {
      EXPECT_EQ(e.file(), path_);
      EXPECT_EQ(e.line(), line);
      EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
    }
  }
  std::string path_;
};

TEST_F(TempFile, SnapshotEventErrorsNameTheRecord) {
  // {'device_traces': [[{'action': 'alloc', 'addr': 4096, 'size': 512, 'stream': 0,
  //   'time_us': 1, 'frames': []}, {same without 'addr'}]]}, protocol=4
  write("missing_addr.pickle", bytes("\x80\x04\x95\x7f\x00\x00\x00\x00\x00\x00\x00\x7d\x94\x8c\x0d\x64\x65\x76\x69\x63\x65\x5f\x74\x72\x61\x63\x65\x73\x94\x5d\x94\x5d\x94\x28\x7d\x94\x28\x8c\x06\x61\x63\x74\x69\x6f\x6e\x94\x8c\x05\x61\x6c\x6c\x6f\x63\x94\x8c\x04\x61\x64\x64\x72\x94\x4d\x00\x10\x8c\x04\x73\x69\x7a\x65\x94\x4d\x00\x02\x8c\x06\x73\x74\x72\x65\x61\x6d\x94\x4b\x00\x8c\x07\x74\x69\x6d\x65\x5f\x75\x73\x94\x4b\x01\x8c\x06\x66\x72\x61\x6d\x65\x73\x94\x5d\x94\x75\x7d\x94\x28\x68\x05\x68\x06\x68\x08\x4d\x00\x02\x68\x09\x4b\x00\x68\x0a\x4b\x02\x68\x0b\x5d\x94\x75\x65\x61\x73\x2e"));
  expect_error(2, "missing 'addr'");
  // one event with 'action': 'launch'
  write("launch.pickle", bytes("\x80\x04\x95\x66\x00\x00\x00\x00\x00\x00\x00\x7d\x94\x8c\x0d\x64\x65\x76\x69\x63\x65\x5f\x74\x72\x61\x63\x65\x73\x94\x5d\x94\x5d\x94\x7d\x94\x28\x8c\x06\x61\x63\x74\x69\x6f\x6e\x94\x8c\x06\x6c\x61\x75\x6e\x63\x68\x94\x8c\x04\x61\x64\x64\x72\x94\x4d\x00\x10\x8c\x04\x73\x69\x7a\x65\x94\x4d\x00\x02\x8c\x06\x73\x74\x72\x65\x61\x6d\x94\x4b\x00\x8c\x07\x74\x69\x6d\x65\x5f\x75\x73\x94\x4b\x01\x8c\x06\x66\x72\x61\x6d\x65\x73\x94\x5d\x94\x75\x61\x61\x73\x2e"));
  expect_error(1, "unknown action 'launch'");
  write("list.pickle", bytes("\x80\x02]q\x00."));  // a list, not the snapshot dict
  expect_error(0, "not the dict");
  write("truncated.pickle", kProtocol4.substr(0, 60));
  expect_error(0, "truncated pickle");
}

TEST_F(TempFile, GraphTrackingOfAForeignShapeIsRefused) {
  // {'device_traces': [[]], 'gmem_graphs': 'oops'}, protocol=4
  write("graphs_not_dict.pickle", bytes("\x80\x04\x95\x2f\x00\x00\x00\x00\x00\x00\x00\x7d\x94\x28\x8c\x0d\x64\x65\x76\x69\x63\x65\x5f\x74\x72\x61\x63\x65\x73\x94\x5d\x94\x5d\x94\x61\x8c\x0b\x67\x6d\x65\x6d\x5f\x67\x72\x61\x70\x68\x73\x94\x8c\x04\x6f\x6f\x70\x73\x94\x75\x2e"));
  expect_error(0, "'gmem_graphs' is a str, not a dict");
  // ... 'gmem_graphs': {'backward_runs': True, 'saved_for_backward': [4096, 'x']}
  write("graphs_bad_addr.pickle", bytes("\x80\x04\x95\x5d\x00\x00\x00\x00\x00\x00\x00\x7d\x94\x28\x8c\x0d\x64\x65\x76\x69\x63\x65\x5f\x74\x72\x61\x63\x65\x73\x94\x5d\x94\x5d\x94\x61\x8c\x0b\x67\x6d\x65\x6d\x5f\x67\x72\x61\x70\x68\x73\x94\x7d\x94\x28\x8c\x0d\x62\x61\x63\x6b\x77\x61\x72\x64\x5f\x72\x75\x6e\x73\x94\x88\x8c\x12\x73\x61\x76\x65\x64\x5f\x66\x6f\x72\x5f\x62\x61\x63\x6b\x77\x61\x72\x64\x94\x5d\x94\x28\x4d\x00\x10\x8c\x01\x78\x94\x65\x75\x75\x2e"));
  expect_error(0, "lists an address that is not a non-negative int");
  // ... 'gmem_graphs': {'backward_runs': 3}
  write("graphs_bad_runs.pickle", bytes("\x80\x04\x95\x3d\x00\x00\x00\x00\x00\x00\x00\x7d\x94\x28\x8c\x0d\x64\x65\x76\x69\x63\x65\x5f\x74\x72\x61\x63\x65\x73\x94\x5d\x94\x5d\x94\x61\x8c\x0b\x67\x6d\x65\x6d\x5f\x67\x72\x61\x70\x68\x73\x94\x7d\x94\x8c\x0d\x62\x61\x63\x6b\x77\x61\x72\x64\x5f\x72\x75\x6e\x73\x94\x4b\x03\x73\x75\x2e"));
  expect_error(0, "'backward_runs' that is not a bool");
}

TEST_F(TempFile, RmmLog) {
  write("rmm.csv",
        "Thread,Time,Action,Pointer,Size,Stream\n"
        "140573312345856,08:07:59.123456,allocate,0x7f8a40000000,1024,0x0\n"
        "140573312345856,08:07:59.2,allocate,0x7f8a40000400,2048,0x7f8a38001020\n"
        "140573312345857,08:08:00.000001,free,0x7f8a40000000,1024,0x0\n"
        "140573312345857,1634567890.5,deallocate,0x7f8a40000400,2048,0x7f8a38001020\n");
  const trace::Trace t = trace::read_trace(path_);
  ASSERT_EQ(t.events.size(), 4u);
  EXPECT_EQ(t.events[0].action, trace::Action::alloc);
  EXPECT_EQ(t.events[0].addr, 0x7f8a40000000u);
  EXPECT_EQ(t.events[0].size, 1024u);
  EXPECT_EQ(t.events[0].stream, 0u);
  EXPECT_EQ(t.events[0].time_us, ((8 * 60 + 7) * 60 + 59) * 1000000LL + 123456);
  EXPECT_EQ(t.events[1].time_us, ((8 * 60 + 7) * 60 + 59) * 1000000LL + 200000);
  EXPECT_EQ(t.events[1].stream, 0x7f8a38001020u);
  EXPECT_EQ(t.events[2].action, trace::Action::free_completed);
  EXPECT_EQ(t.events[3].action, trace::Action::free_completed);
  EXPECT_EQ(t.events[3].time_us, 1634567890500000LL);
  EXPECT_EQ(t.events[3].line, 5u);
  const trace::ReplayResult r = trace::replay(t);
  EXPECT_FALSE(r.failed) << r.failure;
  EXPECT_EQ(r.mallocs, 2u);
  EXPECT_EQ(r.frees, 2u);
  EXPECT_EQ(r.peak_allocated, 3072u);
}

TEST_F(TempFile, RmmLogErrors) {
  const std::string header = "Thread,Time,Action,Pointer,Size,Stream\n";
  write("rmm_ptr.csv", header + "1,08:07:59.1,allocate,0x7f8a40000000,1024,0x0\n"
                                "1,08:07:59.2,allocate,0xZZ,1024,0x0\n");
  expect_error(3, "bad number in column 'Pointer': '0xZZ'");
  write("rmm_action.csv", header + "1,08:07:59.1,reallocate,0x10,1024,0x0\n");
  expect_error(2, "unknown action 'reallocate'");
  write("rmm_time.csv", header + "1,yesterday,allocate,0x10,1024,0x0\n");
  expect_error(2, "bad time");
  write("rmm_column.csv", "Thread,Time,Action,Pointer,Stream\n1,1.0,allocate,0x10,0x0\n");
  expect_error(1, "missing column 'Size'");
}

}  // namespace
}  // namespace gmem
