// A CSV record reader over text in memory (RFC 4180: quoted fields may hold commas, newlines and
// doubled quotes), plus the number parsing the trace readers share. Errors name file and line.
#pragma once

#include <cstdint>
#include <deque>
#include <string>
#include <string_view>
#include <vector>

namespace gmem::trace::detail {

class CsvReader {
 public:
  // Records longer than `max_record_bytes` or with more than `max_fields` fields throw
  // (ReadLimits::max_line, max_fields), before the fields are stored.
  CsvReader(std::string_view text, std::string file, std::size_t max_record_bytes,
            std::size_t max_fields)
      : text_(text), file_(std::move(file)), max_record_bytes_(max_record_bytes), max_fields_(max_fields) {}

  // Reads the next record; false at the end. Blank lines are skipped.
  bool next();
  std::size_t line() const { return line_; }  // 1-based line where the current record starts
  std::size_t size() const { return fields_.size(); }
  std::string_view operator[](std::size_t i) const { return fields_[i]; }
  const std::string& file() const { return file_; }

  // Index of the field named `name` in the current record (the header); throws when absent.
  std::size_t column(std::string_view name) const;
  // Throws unless the current record has at least `count` fields.
  void require_fields(std::size_t count) const;

 private:
  std::string_view quoted_field();  // at an opening quote; leaves pos_ after the closing one
  void check_record_size(std::size_t record_start) const;

  std::string_view text_;
  std::string file_;
  std::size_t max_record_bytes_;
  std::size_t max_fields_;
  std::size_t pos_ = 0;
  std::size_t line_ = 0;
  std::size_t next_line_ = 1;
  std::vector<std::string_view> fields_;
  std::deque<std::string> unescaped_;  // quoted fields that held doubled quotes, this record
};

// Whole-field numbers; `what` names the column in the error.
std::uint64_t parse_u64(std::string_view text, const CsvReader& csv, std::string_view what);
std::int64_t parse_i64(std::string_view text, const CsvReader& csv, std::string_view what);
// "0x7f00..." (or bare hex digits).
std::uint64_t parse_hex(std::string_view text, const CsvReader& csv, std::string_view what);

}  // namespace gmem::trace::detail
