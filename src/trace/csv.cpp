#include "trace/csv.hpp"

#include <charconv>

#include "gmem/error.hpp"
#include "trace/formats.hpp"

namespace gmem::trace::detail {

bool CsvReader::next() {
  fields_.clear();
  unescaped_.clear();
  // Skip blank lines (a trailing newline, CRLF leftovers).
  while (pos_ < text_.size() && (text_[pos_] == '\n' || text_[pos_] == '\r')) {
    if (text_[pos_] == '\n') ++next_line_;
    ++pos_;
  }
  if (pos_ >= text_.size()) return false;
  line_ = next_line_;
  const std::size_t record_start = pos_;
  for (;;) {
    if (fields_.size() == max_fields_)
      exceeds(file_, line_, std::to_string(max_fields_) + " fields in one line", "--max-fields");
    if (pos_ < text_.size() && text_[pos_] == '"') {
      fields_.push_back(quoted_field());
    } else {
      const std::size_t start = pos_;
      while (pos_ < text_.size() && text_[pos_] != ',' && text_[pos_] != '\n') ++pos_;
      std::size_t end = pos_;
      if (end > start && text_[end - 1] == '\r') --end;
      fields_.push_back(text_.substr(start, end - start));
    }
    check_record_size(record_start);
    if (pos_ >= text_.size()) return true;
    if (text_[pos_] == '\n') {
      ++pos_;
      ++next_line_;
      return true;
    }
    if (text_[pos_] == ',') {
      ++pos_;
      continue;
    }
    if (text_[pos_] == '\r' && pos_ + 1 < text_.size() && text_[pos_ + 1] == '\n') {
      pos_ += 2;
      ++next_line_;
      return true;
    }
    throw BadInputError(file_, next_line_, "unexpected character after a quoted field");
  }
}

void CsvReader::check_record_size(std::size_t record_start) const {
  if (pos_ - record_start > max_record_bytes_)
    exceeds(file_, line_, std::to_string(max_record_bytes_) + " bytes in one line", "--max-line");
}

std::string_view CsvReader::quoted_field() {
  const std::size_t start = ++pos_;
  bool doubled = false;
  for (;;) {
    const std::size_t quote = text_.find('"', pos_);
    if (quote == std::string_view::npos)
      throw BadInputError(file_, line_, "unterminated quoted field");
    for (std::size_t i = pos_; i < quote; ++i)
      if (text_[i] == '\n') ++next_line_;
    pos_ = quote + 1;
    if (pos_ < text_.size() && text_[pos_] == '"') {  // "" stands for one quote
      doubled = true;
      ++pos_;
      continue;
    }
    std::string_view raw = text_.substr(start, quote - start);
    if (!doubled) return raw;
    std::string& out = unescaped_.emplace_back();
    for (std::size_t i = 0; i < raw.size(); ++i) {
      out += raw[i];
      if (raw[i] == '"') ++i;
    }
    return out;
  }
}

std::size_t CsvReader::column(std::string_view name) const {
  for (std::size_t i = 0; i < fields_.size(); ++i)
    if (fields_[i] == name) return i;
  throw BadInputError(file_, line_, "missing column '" + std::string(name) + "' in the header");
}

void CsvReader::require_fields(std::size_t count) const {
  if (fields_.size() < count)
    throw BadInputError(file_, line_, "expected " + std::to_string(count) + " fields, found " +
                                          std::to_string(fields_.size()));
}

namespace {
template <class T>
T parse_number(std::string_view text, const CsvReader& csv, std::string_view what, int base) {
  T value{};
  const char* first = text.data();
  const char* last = first + text.size();
  auto [end, ec] = std::from_chars(first, last, value, base);
  if (text.empty() || ec != std::errc{} || end != last)
    throw BadInputError(csv.file(), csv.line(),
                        "bad number in column '" + std::string(what) + "': '" + std::string(text) +
                            "'");
  return value;
}
}  // namespace

std::uint64_t parse_u64(std::string_view text, const CsvReader& csv, std::string_view what) {
  return parse_number<std::uint64_t>(text, csv, what, 10);
}

std::int64_t parse_i64(std::string_view text, const CsvReader& csv, std::string_view what) {
  return parse_number<std::int64_t>(text, csv, what, 10);
}

std::uint64_t parse_hex(std::string_view text, const CsvReader& csv, std::string_view what) {
  std::string_view digits = text;
  if (digits.starts_with("0x") || digits.starts_with("0X")) digits.remove_prefix(2);
  if (digits.empty() || digits.front() == '+' || digits.front() == '-')
    return parse_number<std::uint64_t>(text, csv, what, 16);  // reports `text` as bad
  std::uint64_t value{};
  auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), value, 16);
  if (ec != std::errc{} || end != digits.data() + digits.size())
    return parse_number<std::uint64_t>(text, csv, what, 16);
  return value;
}

}  // namespace gmem::trace::detail
