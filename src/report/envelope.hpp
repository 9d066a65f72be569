// A step-function series (memory over time) downsampled to a fixed number of columns, keeping
// each column's lowest and highest value in the order they happened: a line through the two
// points a column gives draws the same outline as the full series at that width, so a trace of
// millions of events becomes a few thousand points without losing its peaks.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace gmem::report {

// Columns of equal width over [start, end] (times, or event indices).
struct Columns {
  double start = 0;
  double width = 1;
  std::size_t count = 1;

  Columns(double start, double end, std::size_t count);
  std::size_t of(double x) const;  // the column holding x, clamped to the first and last
};

class Envelope {
 public:
  explicit Envelope(const Columns& columns);

  // The series takes `value` at `x`, and keeps it until the next set(). Calls come in x order.
  void set(double x, double value);

  // Two values a column (its low and high, the earlier first), each column's after the last
  // set() carrying the value the series had then. Columns before the first set() hold 0.
  std::vector<double> points() const;

 private:
  struct Column {
    double first = 0, second = 0;  // low and high, in the order they happened
    double low = 0, high = 0;
    bool low_first = true;
    bool touched = false;
  };
  void carry_to(std::size_t column);  // columns up to `column` start at the value carried in

  Columns columns_;
  std::vector<Column> cells_;
  std::size_t current_ = 0;
  double value_ = 0;
};

// The x of Envelope::points(): two a column, at its start and its middle.
std::vector<double> envelope_x(const Columns& columns);

}  // namespace gmem::report
