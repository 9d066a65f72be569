// Recording a step's range mallocs, placing them offline at its end, and serving the next
// occurrence from the plan (step_plan.hpp says why).
#include "engine/step_plan.hpp"

#include <algorithm>
#include <chrono>
#include <numeric>
#include <thread>
#include <utility>

namespace gmem::detail {

std::size_t place_offline(std::vector<PlanBlock>& blocks) {
  // Largest first: the big blocks take the bottom, the small ones fill the gaps their lifetimes
  // leave. Each goes to the lowest offset where it overlaps (in bytes) no block already placed
  // whose lifetime overlaps its own. The blocks placed so far are kept in offset order, so that
  // one pass over them finds that offset. O(n^2): a step has a few thousand range mallocs, and
  // a shape is planned again only when it did not run its plan exactly.
  std::vector<std::uint32_t> order(blocks.size());
  std::iota(order.begin(), order.end(), 0u);
  std::stable_sort(order.begin(), order.end(), [&](std::uint32_t a, std::uint32_t b) {
    if (blocks[a].size != blocks[b].size) return blocks[a].size > blocks[b].size;
    return blocks[a].start < blocks[b].start;
  });
  struct Placed {
    std::size_t offset, end;
    std::uint32_t start, stop;  // lifetime
  };
  std::vector<Placed> placed;  // by offset
  placed.reserve(blocks.size());
  std::size_t extent = 0;
  for (const std::uint32_t i : order) {
    PlanBlock& b = blocks[i];
    std::size_t offset = 0;
    for (const Placed& o : placed) {
      if (o.offset >= offset + b.size) break;  // the gap below o holds it
      if (o.start < b.end && b.start < o.stop) offset = std::max(offset, o.end);
    }
    b.offset = offset;
    extent = std::max(extent, offset + b.size);
    const Placed mine{offset, offset + b.size, b.start, b.end};
    placed.insert(std::upper_bound(placed.begin(), placed.end(), mine,
                                   [](const Placed& x, const Placed& y) { return x.offset < y.offset; }),
                  mine);
  }
  return extent;
}

void StepPlanner::mark_step(std::size_t mapped_bytes) {
  // The range mallocs of the step ending here: its record, unless it made none (the record
  // still open is then the step before's).
  const std::size_t made = active_ && !closing_ ? step_.size() : 0;
  if (made > 0 && plans_ && !taking_turns_ && !first_of_shape_ && !first_on_plan_) {
    moved_bytes_ += mapped_bytes;
    moving_steps_ = mapped_bytes > 0 ? moving_steps_ + 1 : 0;
    if (moving_steps_ >= kMovingSteps && largest_peak_ > 0 && moved_bytes_ >= largest_peak_)
      taking_turns_ = true;  // plans pay: the shape's next step is planned
  }
  if (!active_) {
    active_ = true;  // the first mark: recording starts with the next step
  } else {
    // The step's record stays open until the next step's first range malloc: the frees between
    // (an optimizer's zero_grad after its step, where gmem.torch marks) are the step's own.
    if (!closing_) {
      record_exact_ = plan_ != nullptr && exact_ && step_.size() == plan_->sizes.size();
      record_covered_ = cover_ != nullptr;
      stats_.covered += record_covered_;
    }
    closing_ = true;
  }
  note_step_made(made);
  ++step_number_;
  ++stats_.steps;
  plan_ = nullptr;
  cover_ = nullptr;
  asked_ = 0;
  first_of_shape_ = false;
  first_on_plan_ = false;
}

void StepPlanner::note_step_made(std::size_t mallocs) {
  const std::size_t slot = step_number_ % kRecentSteps;  // the step kRecentSteps marks ago
  const std::uint32_t gone = mallocs_by_step_[slot];
  recent_mallocs_ -= gone;
  if (new_shapes_ >> (kRecentSteps - 1) & 1) recent_new_mallocs_ -= gone;
  const auto now = static_cast<std::uint32_t>(std::min<std::size_t>(mallocs, kMaxStepMallocs));
  mallocs_by_step_[slot] = now;
  recent_mallocs_ += now;
  if (first_of_shape_) recent_new_mallocs_ += now;
  new_shapes_ = new_shapes_ << 1 | std::uint64_t{first_of_shape_};
}

void StepPlanner::close_step() {
  closing_ = false;
  if (!step_.empty() && !record_exact_) {
    // Not the plan's step, or not exactly: keep what it did, planned when the shape comes back
    // (most one-off shapes never do; planning costs O(n^2) in the step's blocks), or at once in
    // the background where shapes take turns.
    const std::size_t key = step_[0].size;
    const std::size_t peak = peak_of(step_, peak_changes_);
    if (!taking_turns_) largest_peak_ = std::max(largest_peak_, peak);
    Shape& shape = shapes_[key];
    if (!keeps_cover(shape, peak)) {
      shape.peak = peak;
      shape.missed = false;
      shape.record.swap(step_);
      shape.planned = false;
      shape.made.reset();
      shape.generation = ++records_;
      if (background_ && taking_turns_ && shapes_recur() && !planning()) plan_in_background({key});
    }
  }
  step_.clear();
  addr_of_.clear();  // blocks still alive outlive the step: long-lived
  clock_ = 0;
  exact_ = true;
  too_long_ = false;
}

bool StepPlanner::keeps_cover(Shape& shape, std::size_t peak) {
  // A shape's cover is the largest of its steps recorded: a step that fit it leaves it, and so
  // does a smaller one that did not (a block grew past its cover's, or its mallocs came
  // otherwise), once: at least as large, the step is the larger one to cover the next; twice
  // in a row, the program changed. (Planned shapes keep their record as before: a step that left
  // its plan is planned anew.)
  if (shape.planned || shape.record.empty()) return false;
  if (record_covered_) {
    shape.missed = false;
    return true;
  }
  if (shape.missed || peak >= shape.peak) return false;
  shape.missed = true;
  return true;
}

std::size_t StepPlanner::peak_of(const std::vector<Recorded>& record,
                                 std::vector<std::int64_t>& change) {
  std::uint32_t clock = 0;
  for (const Recorded& r : record)
    if (r.end != kAlive) clock = std::max(clock, r.end + 1);
  change.assign(clock + 1, 0);  // by the step's clock
  for (const Recorded& r : record) {
    if (r.end == kAlive) continue;
    change[r.start] += static_cast<std::int64_t>(r.size);
    change[r.end] -= static_cast<std::int64_t>(r.size);
  }
  std::int64_t held = 0, peak = 0;
  for (const std::int64_t c : change) peak = std::max(peak, held += c);
  return static_cast<std::size_t>(peak);
}

StepPlanner::Made StepPlanner::make_plan(const std::vector<Recorded>& record) {
  std::vector<PlanBlock> blocks;
  std::vector<std::uint32_t> index;  // the ordinal of each of `blocks`
  for (std::uint32_t k = 0; k < record.size(); ++k) {
    const Recorded& r = record[k];
    if (r.end == kAlive) continue;  // long-lived: stays online
    blocks.push_back({r.size, r.start, r.end});
    index.push_back(k);
  }
  Made made;
  made.extent = place_offline(blocks);
  for (const Recorded& r : record) made.plan.sizes.push_back(r.size);
  made.plan.offsets.assign(record.size(), kOnline);
  for (std::size_t b = 0; b < blocks.size(); ++b) made.plan.offsets[index[b]] = blocks[b].offset;
  return made;
}

void StepPlanner::plan(Shape& shape) {
  const auto start = std::chrono::steady_clock::now();
  if (!shape.made && !pending_.empty()) collect(&shape);
  stats_.ahead += shape.made.has_value();
  Made made = shape.made ? std::move(*shape.made) : make_plan(shape.record);
  stats_.wait_ns += static_cast<std::uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start)
          .count());
  shape.plan = std::move(made.plan);
  shape.made.reset();
  shape.record = {};
  shape.planned = true;
  ++stats_.plans;
  stats_.extent = std::max(stats_.extent, made.extent);
}

void StepPlanner::plan_in_background(const std::vector<std::size_t>& keys) {
  collect(nullptr);
  try {
    struct Job {
      std::vector<Recorded> record;
      std::promise<Made> made;
    };
    std::vector<Job> jobs;
    std::vector<Pending> pending;
    for (const std::size_t key : keys) {
      const Shape& shape = shapes_.at(key);
      jobs.push_back({shape.record, {}});
      pending.push_back({key, shape.generation, jobs.back().made.get_future()});
    }
    std::thread([jobs = std::move(jobs)]() mutable {
      for (Job& job : jobs) {
        try {
          job.made.set_value(make_plan(job.record));
        } catch (...) {
          job.made.set_exception(std::current_exception());
        }
      }
    }).detach();
    for (Pending& p : pending) pending_.push_back(std::move(p));
  } catch (...) {  // no thread (or no memory): planned when their shapes come back, as before
  }
}

bool StepPlanner::planning() const {
  for (const Pending& p : pending_)
    if (p.made.wait_for(std::chrono::seconds(0)) != std::future_status::ready) return true;
  return false;
}

void StepPlanner::collect(const Shape* wait_for) {
  for (std::size_t k = 0; k < pending_.size();) {
    Pending& p = pending_[k];
    const auto it = shapes_.find(p.shape);
    const bool current = it != shapes_.end() && it->second.generation == p.generation &&
                         !it->second.planned;
    const bool wait = current && &it->second == wait_for;
    if (current && !wait && p.made.wait_for(std::chrono::seconds(0)) != std::future_status::ready) {
      ++k;
      continue;
    }
    // Done, waited for, or made for a record no longer kept (dropped unread: the thread owns
    // the shared state, and dropping the future does not wait for it).
    if (current) {
      try {
        it->second.made = p.made.get();
      } catch (...) {  // what the thread threw (out of memory): made here when the shape comes back
      }
    }
    if (k + 1 != pending_.size()) pending_[k] = std::move(pending_.back());
    pending_.pop_back();
  }
}

StepPlanner::Ticket StepPlanner::request(std::size_t bytes) {
  if (closing_) close_step();
  if (!too_long_ && step_.size() >= kMaxStepMallocs) [[unlikely]] {
    // The step is too long to plan: the rest of it goes online, and its record is dropped.
    too_long_ = true;
    plan_ = nullptr;
    exact_ = false;
    std::vector<Recorded>().swap(step_);
    std::vector<DevicePtr>().swap(addr_of_);
  }
  if (too_long_) [[unlikely]] return Ticket{step_number_, kNotRecorded, kOnline, bytes};
  const auto ordinal = static_cast<std::uint32_t>(step_.size());
  const std::uint32_t asked = asked_++;
  if (ordinal == 0) {
    if (shapes_.size() >= kMaxShapes && !shapes_.contains(bytes)) shapes_.clear();
    Shape& shape = shapes_[bytes];
    if (++shape.steps >= 2 && bytes != last_shape_ && plans_ && !taking_turns_) {
      taking_turns_ = true;
      if (background_) {  // the records kept so far, but this step's own (planned below)
        std::vector<std::size_t> keys;
        for (const auto& [key, other] : shapes_)
          if (key != bytes && !other.planned && !other.record.empty()) keys.push_back(key);
        if (!keys.empty()) plan_in_background(keys);
      }
    }
    first_of_shape_ = shape.steps == 1;
    last_shape_ = bytes;
    if (taking_turns_ && !shape.planned && !shape.record.empty()) {
      plan(shape);
      first_on_plan_ = true;
    }
    plan_ = taking_turns_ && shape.planned ? &shape.plan : nullptr;
    // Online, a step of a shape seen before lays out as its cover did, where it fits. (Across
    // shapes it would not: a shape's first step would lay out as another's online layout, which
    // the other may have left for its plan, and distinct shapes rarely fit one another.)
    cover_ = plan_ == nullptr && !shape.planned && !shape.record.empty() ? &shape.record : nullptr;
    next_ = 0;
    exact_ = plan_ != nullptr;
    stats_.followed += plan_ != nullptr;
  }
  addr_of_.push_back(kNotTaken);  // first: a throw leaves step_ as it was
  try {
    step_.push_back({bytes, clock_++, kAlive, asked});
  } catch (...) {
    addr_of_.pop_back();
    throw;
  }
  Ticket ticket{step_number_, ordinal, kOnline, bytes};
  if (cover_ != nullptr) {
    const std::uint32_t k = fit(bytes, asked);
    if (k != kNoBlock) ticket.slot = (*cover_)[k].size;
    else cover_ = nullptr;  // the rest of the step takes its own sizes
  }
  if (plan_ == nullptr) return ticket;
  if (ordinal >= plan_->sizes.size() || plan_->sizes[ordinal] != bytes) {
    // The step left its plan: the rest of it goes online, and it is planned anew at its end.
    plan_ = nullptr;
    exact_ = false;
    ++stats_.mismatches;
    return ticket;
  }
  ticket.offset = plan_->offsets[ordinal];
  return ticket;
}

std::uint32_t StepPlanner::fit(std::size_t bytes, std::uint32_t asked) {
  const std::vector<Recorded>& cover = *cover_;
  // The cover's next block, where it is the same (as a plan's block matches); else the one made
  // at the same place among its step's mallocs, the cover's blocks before it passed: this step
  // made them in slabs (a shorter length's), or made none.
  if (next_ < cover.size() && cover[next_].size == bytes) return next_++;
  while (next_ < cover.size() && cover[next_].asked < asked) ++next_;
  if (next_ == cover.size() || cover[next_].asked != asked || cover[next_].size < bytes) return kNoBlock;
  return next_++;
}

std::vector<StepPlanner::PlannedBlock> StepPlanner::blocks_of_new_plan() const {
  std::vector<PlannedBlock> blocks;
  if (!first_on_plan_ || plan_ == nullptr || step_.size() != 1) return blocks;
  for (std::uint32_t k = 0; k < plan_->offsets.size(); ++k)
    if (plan_->offsets[k] != kOnline) blocks.push_back({plan_->offsets[k], plan_->sizes[k], k});
  return blocks;
}

std::uint32_t StepPlanner::taken(const Ticket& ticket, DevicePtr addr, bool planned) noexcept {
  stats_.hits += planned;
  // A block whose step was marked over meanwhile outlives it: long-lived, not recorded.
  // So does one whose step's record was dropped meanwhile (too long).
  if (ticket.step != step_number_ || ticket.ordinal >= addr_of_.size()) return kNotRecorded;
  addr_of_[ticket.ordinal] = addr;
  return ticket.ordinal;
}

}  // namespace gmem::detail
