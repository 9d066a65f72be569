// A small streaming JSON writer for snapshots and OOM reports (objects, arrays, strings,
// integers, booleans), with commas placed automatically.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>
#include <string_view>
#include <type_traits>

#include "tracking/utf8.hpp"

namespace gmem::detail {

class JsonOut {
 public:
  JsonOut& begin_object() { return open('{'); }
  JsonOut& end_object() { return close('}'); }
  JsonOut& begin_array() { return open('['); }
  JsonOut& end_array() { return close(']'); }

  JsonOut& key(std::string_view name) {
    comma();
    quote(name);
    out_ += ':';
    after_key_ = true;
    return *this;
  }
  JsonOut& value(std::string_view text) {
    comma();
    quote(text);
    return *this;
  }
  JsonOut& value(const char* text) { return value(std::string_view(text)); }
  JsonOut& value(const std::string& text) { return value(std::string_view(text)); }
  JsonOut& value(bool flag) { return raw(flag ? "true" : "false"); }
  template <class Int, class = std::enable_if_t<std::is_integral_v<Int>>>
  JsonOut& value(Int number) {
    return raw(std::to_string(number));
  }
  JsonOut& value(double number) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.17g", number);
    return raw(buf);
  }
  JsonOut& null() { return raw("null"); }

  template <class T>
  JsonOut& field(std::string_view name, const T& v) {
    key(name);
    return value(v);
  }

  std::string take() { return std::move(out_); }

 private:
  JsonOut& open(char bracket) {
    comma();
    out_ += bracket;
    first_ = true;
    return *this;
  }
  JsonOut& close(char bracket) {
    out_ += bracket;
    first_ = false;
    return *this;
  }
  JsonOut& raw(std::string_view text) {
    comma();
    out_ += text;
    return *this;
  }
  void comma() {
    if (after_key_) after_key_ = false;
    else if (!first_ && !out_.empty()) out_ += ',';
    first_ = false;
  }
  void quote(std::string_view raw_text) {
    const std::string text = to_utf8(raw_text);
    out_ += '"';
    for (char c : text) {
      switch (c) {
        case '"': out_ += "\\\""; break;
        case '\\': out_ += "\\\\"; break;
        case '\n': out_ += "\\n"; break;
        case '\t': out_ += "\\t"; break;
        case '\r': out_ += "\\r"; break;
        default:
          if (static_cast<unsigned char>(c) < 0x20) {
            char buf[8];
            std::snprintf(buf, sizeof buf, "\\u%04x", static_cast<unsigned>(c));
            out_ += buf;
          } else {
            out_ += c;
          }
      }
    }
    out_ += '"';
  }

  std::string out_;
  bool first_ = true;
  bool after_key_ = false;
};

}  // namespace gmem::detail
