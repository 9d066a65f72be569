// The one JSON writer (CLI output, analysis reports, snapshots, OOM reports): objects, arrays,
// escaped strings, numbers.
//
//   json::Writer w;
//   w.begin_object().field("trace", name).field("events", n).end_object();
//   std::puts(w.str().c_str());
//
// Commas are placed automatically; it does not check that objects are well nested.
#pragma once

#include <charconv>
#include <cmath>
#include <concepts>
#include <cstdint>
#include <cstdio>
#include <string>
#include <string_view>
#include <utility>

#include "common/utf8.hpp"

namespace gmem::json {

// Appends `text` as a JSON string literal (quotes and escapes included). JSON must be UTF-8:
// invalid sequences (file names, symbols from outside) become U+FFFD.
inline void append_quoted(std::string& out, std::string_view text) {
  if (!detail::valid_utf8(text)) {
    append_quoted(out, detail::to_utf8(text));
    return;
  }
  out += '"';
  for (char c : text) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", static_cast<unsigned>(c));
          out += buf;
        } else {
          out += c;  // UTF-8 passes through unchanged
        }
    }
  }
  out += '"';
}

class Writer {
 public:
  Writer& begin_object() { return open('{'); }
  Writer& end_object() { return close('}'); }
  Writer& begin_array() { return open('['); }
  Writer& end_array() { return close(']'); }

  Writer& key(std::string_view name) {
    separate();
    append_quoted(out_, name);
    out_ += ':';
    after_key_ = true;
    return *this;
  }

  Writer& value(std::string_view text) {
    separate();
    append_quoted(out_, text);
    return *this;
  }
  Writer& value(const char* text) { return value(std::string_view(text)); }
  Writer& value(const std::string& text) { return value(std::string_view(text)); }
  Writer& value(bool flag) { return raw(flag ? "true" : "false"); }
  Writer& value(std::nullptr_t) { return raw("null"); }
  template <std::integral T>
    requires(!std::same_as<T, bool>)
  Writer& value(T number) {
    char buf[24];
    auto end = std::to_chars(buf, buf + sizeof buf, number).ptr;
    return raw(std::string_view(buf, static_cast<std::size_t>(end - buf)));
  }
  // Shortest text that reads back as the same double; JSON has no NaN or infinity: null.
  Writer& value(double number) {
    if (!std::isfinite(number)) return raw("null");
    char buf[32];
    auto end = std::to_chars(buf, buf + sizeof buf, number).ptr;
    return raw(std::string_view(buf, static_cast<std::size_t>(end - buf)));
  }

  template <class T>
  Writer& field(std::string_view name, const T& v) {
    key(name);
    return value(v);
  }

  // Inserts already formatted JSON (a nested document written by another Writer).
  Writer& raw(std::string_view json) {
    separate();
    out_ += json;
    return *this;
  }

  const std::string& str() const { return out_; }
  std::string take() { return std::move(out_); }
  void clear() {
    out_.clear();
    first_ = true;
    after_key_ = false;
  }

 private:
  Writer& open(char bracket) {
    separate();
    out_ += bracket;
    first_ = true;
    return *this;
  }
  Writer& close(char bracket) {
    out_ += bracket;
    first_ = false;
    after_key_ = false;
    return *this;
  }
  // A comma before every element but the first of its object or array; none right after a key.
  void separate() {
    if (after_key_) {
      after_key_ = false;
    } else if (!first_) {
      out_ += ',';
    }
    first_ = false;
  }

  std::string out_;
  bool first_ = true;
  bool after_key_ = false;
};

}  // namespace gmem::json
