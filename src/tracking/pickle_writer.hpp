// Writes Python pickles of plain data (protocol 4: dicts, lists, 2-tuples, strings, ints, floats,
// bools, None) with the opcodes Python's own pickler uses for them, and only those, because
// PyTorch's memory_viz reads snapshots with a small JavaScript unpickler that knows no others.
//
// Containers are filled in batches of 1000 items (as Python does): a single APPENDS of 100k
// items would overflow the JavaScript unpickler's argument spread. Strings are memoised, so each
// distinct key or file name is written once.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "tracking/string_hash.hpp"
#include "common/utf8.hpp"

namespace gmem::detail {

class PickleWriter {
 public:
  PickleWriter() { out_ += "\x80\x04"; }  // PROTO 4

  // Closes the pickle (STOP) and hands over the bytes. Every container must be closed.
  std::string finish() {
    out_ += '.';
    return std::move(out_);
  }

  PickleWriter& none() { item(); out_ += 'N'; return *this; }
  PickleWriter& boolean(bool v) { item(); out_ += v ? '\x88' : '\x89'; return *this; }

  PickleWriter& integer(std::int64_t v) {
    item();
    write_int(v);
    return *this;
  }
  // A 2-tuple of ints, e.g. PyTorch's segment_pool_id.
  PickleWriter& int_pair(std::int64_t a, std::int64_t b) {
    item();
    write_int(a);
    write_int(b);
    out_ += '\x86';  // TUPLE2
    return *this;
  }
  PickleWriter& unsigned_integer(std::uint64_t v) {
    if (v <= static_cast<std::uint64_t>(INT64_MAX)) return integer(static_cast<std::int64_t>(v));
    item();
    long1(v, false);
    return *this;
  }

  PickleWriter& real(double v) {
    item();
    out_ += 'G';
    std::uint64_t bits;
    std::memcpy(&bits, &v, sizeof bits);
    for (int shift = 56; shift >= 0; shift -= 8) byte(static_cast<std::uint8_t>(bits >> shift));
    return *this;
  }

  PickleWriter& string(std::string_view raw) {
    if (auto it = strings_.find(raw); it != strings_.end()) return get(it->second);
    item();
    const std::string text = to_utf8(raw);
    if (text.size() < 256) {
      out_ += '\x8c';  // SHORT_BINUNICODE
      byte(static_cast<std::uint8_t>(text.size()));
    } else {
      out_ += 'X';  // BINUNICODE
      little(text.size(), 4);
    }
    out_ += text;
    strings_.emplace(std::string(raw), memoize());
    return *this;
  }

  PickleWriter& begin_dict() { return open('}', 'u', 2 * kBatch); }  // EMPTY_DICT ... SETITEMS
  PickleWriter& end_dict() { return close(); }
  PickleWriter& begin_list() { return open(']', 'e', kBatch); }  // EMPTY_LIST ... APPENDS
  PickleWriter& end_list() { return close(); }
  // Memoises the object just written; get() writes it again by reference.
  std::uint32_t memoize() {
    out_ += '\x94';
    return next_memo_++;
  }
  PickleWriter& get(std::uint32_t index) {
    item();
    if (index < 256) {
      out_ += 'h';  // BINGET
      byte(static_cast<std::uint8_t>(index));
    } else {
      out_ += 'j';  // LONG_BINGET
      little(index, 4);
    }
    return *this;
  }

  // Inside a dict: key("name").integer(1).
  PickleWriter& key(std::string_view name) { return string(name); }

 private:
  struct Level {
    char add;           // the opcode that adds the items since the last MARK to the container
    std::size_t limit;  // items a batch holds (a dict's keys and values count apart)
    std::size_t items;  // written since the last MARK
  };
  static constexpr std::size_t kBatch = 1000;

  PickleWriter& open(char opcode, char add, std::size_t limit) {
    item();
    out_ += opcode;
    out_ += '(';  // MARK
    levels_.push_back(Level{add, limit, 0});
    return *this;
  }
  PickleWriter& close() {
    out_ += levels_.back().add;
    levels_.pop_back();
    return *this;
  }
  // Counts an item in the enclosing container, first closing a full batch.
  void item() {
    if (levels_.empty()) return;
    Level& level = levels_.back();
    if (level.items == level.limit) {
      out_ += level.add;
      out_ += '(';
      level.items = 0;
    }
    ++level.items;
  }
  void write_int(std::int64_t v) {
    if (v >= 0 && v < 256) {
      out_ += 'K';  // BININT1
      byte(static_cast<std::uint8_t>(v));
    } else if (v >= 0 && v < 65536) {
      out_ += 'M';  // BININT2
      little(static_cast<std::uint64_t>(v), 2);
    } else if (v >= INT32_MIN && v <= INT32_MAX) {
      out_ += 'J';  // BININT
      little(static_cast<std::uint32_t>(static_cast<std::int32_t>(v)), 4);
    } else {
      long1(static_cast<std::uint64_t>(v), v < 0);
    }
  }

  void byte(std::uint8_t b) { out_ += static_cast<char>(b); }
  void little(std::uint64_t v, int bytes) {
    for (int i = 0; i < bytes; ++i) byte(static_cast<std::uint8_t>(v >> (8 * i)));
  }
  // LONG1: little-endian two's complement, as short as keeps the sign.
  void long1(std::uint64_t v, bool negative) {
    std::uint8_t bytes[9];
    int n = 0;
    for (; n < 8; ++n) bytes[n] = static_cast<std::uint8_t>(v >> (8 * n));
    if (negative) {
      while (n > 1 && bytes[n - 1] == 0xFF && (bytes[n - 2] & 0x80)) --n;
    } else {
      while (n > 1 && bytes[n - 1] == 0 && !(bytes[n - 2] & 0x80)) --n;
      if (bytes[n - 1] & 0x80) bytes[n++] = 0;  // keep it positive
    }
    out_ += '\x8a';
    byte(static_cast<std::uint8_t>(n));
    for (int i = 0; i < n; ++i) byte(bytes[i]);
  }

  std::string out_;
  std::vector<Level> levels_;
  std::uint32_t next_memo_ = 0;
  std::unordered_map<std::string, std::uint32_t, StringHash, std::equal_to<>> strings_;
};

}  // namespace gmem::detail
