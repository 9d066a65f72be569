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

  void print(std::FILE* out) const {
    std::vector<std::size_t> width;
    for (const auto& row : rows_)
      for (std::size_t i = 0; i < row.size(); ++i) {
        if (width.size() <= i) width.push_back(0);
        width[i] = std::max(width[i], row[i].size());
      }
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
  std::vector<bool> right_;
  std::vector<std::vector<std::string>> rows_;
};

}  // namespace gmem::cli
