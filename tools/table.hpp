// A plain text table for the commands' human output: columns sized to their widest cell, text
// left-aligned and numbers right-aligned.
#pragma once

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

namespace gmem::cli {

class Table {
 public:
  // `right[i]`: column i is right-aligned (numbers).
  Table(std::vector<std::string> header, std::vector<bool> right)
      : right_(std::move(right)) { rows_.push_back(std::move(header)); }

  void add(std::vector<std::string> row) { rows_.push_back(std::move(row)); }

  // The width of the widest line print() writes.
  std::size_t width() const {
    std::size_t total = 0;
    for (std::size_t w : column_widths()) total += w + 2;
    return total ? total - 2 : 0;
  }

  // Keeps the table within `columns` characters by shortening column `shrink`'s cells (a text
  // column, such as a trace's name) to no fewer than `min_width`, ending them with "~" where cut:
  // a terminal wraps a wider line into an unreadable one.
  void fit(std::size_t columns, std::size_t shrink, std::size_t min_width = 12) {
    const std::size_t total = width();
    if (total <= columns) return;
    const std::vector<std::size_t> widths = column_widths();
    if (shrink >= widths.size()) return;
    const std::size_t over = total - columns;
    const std::size_t keep = std::max(min_width, widths[shrink] > over ? widths[shrink] - over : 0);
    for (auto& row : rows_)
      if (shrink < row.size() && row[shrink].size() > keep) row[shrink] = row[shrink].substr(0, keep - 1) + "~";
  }

  void print(std::FILE* out) const {
    const std::vector<std::size_t> width = column_widths();
    for (const auto& row : rows_) {
      std::string line;
      for (std::size_t i = 0; i < row.size(); ++i) {
        const std::string pad(width[i] - row[i].size(), ' ');
        const bool right = i < right_.size() && right_[i];
        line += right ? pad + row[i] : row[i] + (i + 1 < row.size() ? pad : "");
        if (i + 1 < row.size()) line += "  ";
      }
      std::fprintf(out, "%s\n", line.c_str());
    }
  }

 private:
  std::vector<std::size_t> column_widths() const {
    std::vector<std::size_t> width;
    for (const auto& row : rows_)
      for (std::size_t i = 0; i < row.size(); ++i) {
        if (width.size() <= i) width.push_back(0);
        width[i] = std::max(width[i], row[i].size());
      }
    return width;
  }

  std::vector<bool> right_;
  std::vector<std::vector<std::string>> rows_;
};

}  // namespace gmem::cli
