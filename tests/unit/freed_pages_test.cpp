// FreedPages: the list stitching scans for free chunks. A scan closes the gaps it walked over,
// so dropped entries are never walked twice and the list keeps its oldest-first order.
#include "engine/freed_pages.hpp"

#include <gtest/gtest.h>

#include <vector>

namespace gmem::detail {
namespace {

std::vector<PageId> entries(const FreedPages& list) {
  std::vector<PageId> out;
  for (std::size_t k = list.begin(); k < list.end(); ++k)
    if (list.at(k) != kNoPage) out.push_back(list.at(k));
  return out;
}

TEST(FreedPages, ClosingGapsKeepsOrderAndFollowsTheTrackedEntry) {
  std::vector<Page> pages(8);
  FreedPages list;
  for (PageId id = 0; id < 8; ++id) list.add(id, pages[id]);
  list.add(3, pages[3]);  // listed once only
  ASSERT_EQ(list.listed(), 8u);
  for (std::size_t k : {1, 2, 4}) list.drop(k, pages[k]);  // holes in the middle
  EXPECT_EQ(pages[2].listed, 0u);
  const std::size_t tracked = list.close_gaps_before(6, 5);
  EXPECT_EQ(list.at(tracked), 5u);
  EXPECT_EQ(list.end() - list.begin(), 5u);  // the walked part holds no holes any more
  EXPECT_EQ(entries(list), (std::vector<PageId>{0, 3, 5, 6, 7}));
  EXPECT_EQ(list.listed(), 5u);
  // Untracked: the tracked index comes back unchanged (end()).
  EXPECT_EQ(list.close_gaps_before(list.end(), list.end()), list.end());
  EXPECT_EQ(entries(list), (std::vector<PageId>{0, 3, 5, 6, 7}));
}

TEST(FreedPages, ADroppedEntryIsWalkedOnce) {
  // Many entries dropped at the front of the list: after one scan closes the gaps, the next
  // scan starts at the first live entry.
  std::vector<Page> pages(3000);
  FreedPages list;
  for (PageId id = 0; id < pages.size(); ++id) list.add(id, pages[id]);
  for (std::size_t k = 1; k < 2000; ++k) list.drop(k, pages[k]);  // entry 0 stays: holes, no head move
  list.close_gaps_before(2500, list.end());
  EXPECT_EQ(list.end() - list.begin(), 1001u);
  EXPECT_EQ(list.at(list.begin()), 0u);
  EXPECT_EQ(list.at(list.begin() + 1), 2000u);
  list.sweep();  // two thirds dropped: compacts
  EXPECT_EQ(list.begin(), 0u);
  EXPECT_EQ(entries(list).size(), 1001u);
}

}  // namespace
}  // namespace gmem::detail
