#include "report/envelope.hpp"

#include <algorithm>
#include <cmath>

namespace gmem::report {

Columns::Columns(double from, double to, std::size_t n) : start(from), count(std::max<std::size_t>(n, 1)) {
  // A span of 0 (one event, or all at one time) still gets columns of some width.
  width = to > from ? (to - from) / static_cast<double>(count) : 1.0;
}

std::size_t Columns::of(double x) const {
  const double c = std::floor((x - start) / width);
  if (!(c > 0)) return 0;  // also NaN
  return std::min(static_cast<std::size_t>(c), count - 1);
}

Envelope::Envelope(const Columns& columns) : columns_(columns), cells_(columns.count) {}

void Envelope::carry_to(std::size_t column) {
  for (; current_ < column; ++current_) {
    Column& c = cells_[current_];
    if (!c.touched) c = Column{value_, value_, value_, value_, true, true};
  }
  Column& c = cells_[column];
  if (!c.touched) c = Column{value_, value_, value_, value_, true, true};
}

void Envelope::set(double x, double value) {
  const std::size_t column = std::max(columns_.of(x), current_);  // x never goes back
  carry_to(column);
  Column& c = cells_[column];
  if (value < c.low) {
    c.low = value;
    c.low_first = false;  // the high came first
  }
  if (value > c.high) {
    c.high = value;
    c.low_first = true;
  }
  value_ = value;
}

std::vector<double> Envelope::points() const {
  std::vector<double> out;
  out.reserve(cells_.size() * 2);
  for (std::size_t i = 0; i < cells_.size(); ++i) {
    const Column& c = cells_[i];
    if (!c.touched) {
      // After the last set(): the final value; before the first, nothing had been allocated.
      const double v = i > current_ ? value_ : 0.0;
      out.push_back(v);
      out.push_back(v);
      continue;
    }
    out.push_back(c.low_first ? c.low : c.high);
    out.push_back(c.low_first ? c.high : c.low);
  }
  return out;
}

std::vector<double> envelope_x(const Columns& columns) {
  std::vector<double> x;
  x.reserve(columns.count * 2);
  for (std::size_t i = 0; i < columns.count; ++i) {
    x.push_back(columns.start + columns.width * static_cast<double>(i));
    x.push_back(columns.start + columns.width * (static_cast<double>(i) + 0.5));
  }
  return x;
}

}  // namespace gmem::report
