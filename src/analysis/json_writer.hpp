// A minimal JSON writer for the analysis reports: objects, arrays, strings escaped, numbers.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>
#include <string_view>

namespace gmem::analysis {

class JsonWriter {
 public:
  JsonWriter& begin_object() { return open('{'); }
  JsonWriter& end_object() { return close('}'); }
  JsonWriter& begin_array() { return open('['); }
  JsonWriter& end_array() { return close(']'); }

  JsonWriter& key(std::string_view name) {
    separate();
    quote(name);
    out_ += ':';
    after_key_ = true;
    return *this;
  }
  JsonWriter& value(std::string_view text) {
    separate();
    quote(text);
    return *this;
  }
  JsonWriter& value(const char* text) { return value(std::string_view(text)); }
  JsonWriter& value(std::int64_t number) { return raw(std::to_string(number)); }
  JsonWriter& value(std::uint64_t number) { return raw(std::to_string(number)); }
  JsonWriter& value(double number) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.6g", number);
    return raw(buf);
  }
  JsonWriter& value(bool flag) { return raw(flag ? "true" : "false"); }

  template <class T>
  JsonWriter& field(std::string_view name, T v) {
    key(name);
    return value(v);
  }

  const std::string& str() const { return out_; }

 private:
  JsonWriter& open(char bracket) {
    separate();
    out_ += bracket;
    first_ = true;
    return *this;
  }
  JsonWriter& close(char bracket) {
    out_ += bracket;
    first_ = false;
    return *this;
  }
  JsonWriter& raw(std::string_view text) {
    separate();
    out_ += text;
    return *this;
  }
  // A comma before every element but the first of its object or array, and none after a key.
  void separate() {
    if (after_key_) {
      after_key_ = false;
    } else if (!first_ && !out_.empty()) {
      out_ += ',';
    }
    first_ = false;
  }
  void quote(std::string_view text) {
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

}  // namespace gmem::analysis
