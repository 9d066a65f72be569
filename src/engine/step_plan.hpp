// Planned step layouts (behind Engine::mark_step): the range mallocs of a training step, recorded
// with when each was freed, and placed offline when a step with the same first request (a shape)
// comes back, so that blocks whose lifetimes overlap never share bytes and blocks that follow one
// another reuse the same addresses. That step's mallocs then take the planned offsets (in a
// virtual range of their own, the plan region) as long as each request matches the plan (same
// size at the same ordinal). Plans are followed only once shapes take turns (below).
//
// A step that follows no plan may still be laid out as an earlier one: a step of a shape seen
// before takes, block by block, the sizes of the largest step of its shape recorded (its
// cover), where each is at least its own, so that best fit lays it out as it laid out that
// step, on that step's pages (already mapped) at that step's moments. So a program whose steps
// differ only in a length drawn per step (FSDP2 over random lengths: every step begins with the
// same all-gather, and no two steps lay out alike) uses the pages of its largest step in every
// step, holding no more than that step held, and maps nothing once its largest has run. Blocks
// are matched by their place among all the step's mallocs, slab slots included (tick): at a
// short length a few blocks fall under the slab limit, which would shift every range malloc
// after them. A step that does not fit its cover keeps it when it is smaller, and replaces it
// when it is at least as large, or when the step before did not fit either (the program
// changed) (docs/notes/2026-11-28-steps-laid-out-as-their-largest.md).
//
// Why: best fit in one shared range gives the same pages, within one step, to blocks of different
// lifetimes, and a fixed chunk per page then needs up to 1.09 times the pages in use at once
// (docs/notes/2026-11-23-shapes-taking-turns.md). A plan whose blocks' lifetimes never overlap at the
// same address needs only its extent, one chunk per page, and a repeated step maps nothing.
//
// Knows offsets and ordinals only, no pages or devices: Backing asks it where a malloc goes, and
// Placement tells it what was freed.
#pragma once

#include <array>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <future>
#include <optional>
#include <unordered_map>
#include <utility>
#include <vector>

#include "gmem/device.hpp"

namespace gmem::detail {

// The greedy offline placement: largest first (ties: earliest), each at the lowest offset free
// over its whole lifetime among those placed before it. `start`/`end`: the step's clock (mallocs
// and frees counted) when the block was taken and given back; end > start.
struct PlanBlock {
  std::size_t size;
  std::uint32_t start, end;
  std::size_t offset = 0;  // out
};
// Places `blocks` (offsets written in); returns the extent (the highest end).
std::size_t place_offline(std::vector<PlanBlock>& blocks);

class StepPlanner {
 public:
  static constexpr std::size_t kOnline = ~std::size_t{0};  // not planned: placed online

  // `background`: plan a record on a thread of its own as soon as it closes (below); without it,
  // every plan is made when its shape comes back, on the caller's thread. Either way the same
  // plans are made, from the same records, and followed from the same steps.
  explicit StepPlanner(bool background = true) : background_(background) {}
  // A planner that follows covers only, never a plan (Placement's for a second stream).
  static StepPlanner covers_only() {
    StepPlanner planner(false);
    planner.plans_ = false;
    return planner;
  }

  // Whether steps have been marked: until then the planner records nothing.
  bool active() const { return active_; }
  // Whether the step running is a warm-up, whose clashes say nothing about the chunks the
  // program needs (known from the step's first range malloc on):
  // - the first step of its shape, in a program whose shapes recur: its online layout is not
  //   seen again (the shape's next step follows a plan). Where new shapes are the norm (steps
  //   that began one made more than half of the range mallocs of the last 64 steps), plans do
  //   not pay and the online layouts are what the program runs: not a warm-up. The first 64
  //   steps count as recurring (a program's first steps are mostly new shapes either way);
  // - the first step on a plan just made: its pages of the plan region get their chunks.
  bool warm_up() const { return first_on_plan_ || (first_of_shape_ && shapes_recur()); }
  // Whether a plan is being made in the background (for tests: they wait until none is).
  bool planning() const;

  // A step ends (and the next begins). Its record stays open until the next step's first range
  // malloc (request), so that frees in between count as its own; then it is kept as its
  // shape's record (planned when the shape comes back), unless it ran its plan exactly.
  // `mapped_bytes`: what the step mapped (the engine counts its maps). A shape that came back
  // and still maps is one whose online layout does not repeat; once such steps have mapped as
  // much as a plan would map once (below), plans are followed even if no shape takes turns.
  void mark_step(std::size_t mapped_bytes = 0);

  // The next range malloc of the step, of `bytes`: where the plan puts it in the plan region
  // (`offset`, or kOnline), and, placed online, the range it takes (`slot`: its cover's block's
  // size where the step fits its cover, else `bytes`). Records it either way; `taken` follows
  // once it has an address.
  struct Ticket {
    std::uint64_t step;  // the step it was requested in
    std::uint32_t ordinal;
    std::size_t offset;
    std::size_t slot;
  };
  Ticket request(std::size_t bytes);
  // A malloc of the planned stream that takes no range of its own (a slab's slot): it counts
  // among the step's mallocs (a cover's blocks are matched by that count). O(1).
  void tick() { ++asked_; }
  // At the step's first range malloc: the blocks of the plan the step begins on, if that plan
  // was made for this step (warm_up's second case: its pages of the plan region get their
  // chunks now), in the order the step takes them; empty otherwise.
  struct PlannedBlock {
    std::size_t offset, size;
    std::uint32_t ordinal;  // its range malloc's, in the step (recorded() counts them)
  };
  std::vector<PlannedBlock> blocks_of_new_plan() const;
  // Whether the step follows a plan (it began on one and has not left it).
  bool following() const { return plan_ != nullptr; }
  // At the step's first range malloc, while no plan has been followed yet: where steps keep
  // beginning new shapes (this one and the two before it), the bytes of the plan region the
  // first plan will want mapped: the most that any step recorded so far held at once in blocks
  // it freed itself, which a plan's extent is at least (and, placed offline, about exactly).
  // 0 otherwise. MapAhead maps that much of the region early, while these steps run.
  std::size_t extent_to_map_early() const {
    const bool varying = first_of_shape_ && (new_shapes_ & 1) && shapes_.size() >= 3;
    return !taking_turns_ && varying && shapes_recur() && step_.size() == 1 ? largest_peak_ : 0;
  }
  // The block of `ticket` got address `addr` (wherever it went); `planned`: at its planned
  // offset. A malloc's slow path releases the engine's lock at times, so other mallocs, frees
  // and marks may come between a request and its `taken`: the ticket says which record.
  // Returns the block's ordinal in the step's record (kNotRecorded: long-lived, not recorded),
  // which its free hands back to released().
  std::uint32_t taken(const Ticket& ticket, DevicePtr addr, bool planned) noexcept;
  // A planned block could not take its offset (the range was not free): the lifetimes did not
  // hold, so the step is planned again at its end.
  void conflict() { exact_ = false; ++stats_.conflicts; }
  // The block at `addr` was freed (any block; only this step's are recorded), with the ordinal
  // taken() returned for it: O(1), no lookup. A stale ordinal (the block is an earlier step's)
  // never matches: the step's record of that ordinal is a live block at another address.
  void released(DevicePtr addr, std::uint32_t ordinal) {
    if (ordinal >= addr_of_.size() || addr_of_[ordinal] != addr) return;
    step_[ordinal].end = clock_++;
    addr_of_[ordinal] = kNotTaken;
  }
  static constexpr std::uint32_t kNotRecorded = ~std::uint32_t{0};  // an ordinal of no record

  struct Stats {
    std::uint64_t steps = 0;       // steps marked
    std::uint64_t plans = 0;       // plans made
    std::uint64_t hits = 0;        // mallocs placed at a planned offset
    std::uint64_t mismatches = 0;  // steps whose requests left their plan
    std::uint64_t conflicts = 0;   // planned offsets found taken
    std::uint64_t followed = 0;    // steps that began on a plan
    std::uint64_t ahead = 0;       // plans made in the background (collected, or waited for)
    std::uint64_t covered = 0;     // steps that fit their cover to the end
    std::uint64_t wait_ns = 0;     // spent by mallocs making plans, or waiting for one
    std::size_t extent = 0;        // the largest plan's extent
  };
  const Stats& stats() const { return stats_; }
  std::size_t shapes() const { return shapes_.size(); }  // records and plans held
  std::size_t recorded() const { return step_.size(); }  // range mallocs of the step recorded

  // The most range mallocs one step records (a Llama step with checkpointing has 3,800). A
  // program that stops marking (an evaluation loop after training) would otherwise grow the
  // open step's record with every malloc it makes; a step beyond it is not planned.
  static constexpr std::size_t kMaxStepMallocs = std::size_t{1} << 17;

 private:
  struct Plan {
    std::vector<std::size_t> sizes;    // by ordinal
    std::vector<std::size_t> offsets;  // by ordinal: kOnline for blocks alive at the step's end
  };
  struct Recorded {
    std::size_t size;
    std::uint32_t start, end;  // end: kAlive until freed in the step
    std::uint32_t asked;       // its place among all the step's mallocs, slab slots included
  };
  static constexpr std::uint32_t kAlive = ~std::uint32_t{0};

  bool active_ = false;
  // The step being recorded, and the plan it follows (nullptr: none, or left at a mismatch).
  std::vector<Recorded> step_;
  // By ordinal: where this step's block is while it lives (kNotTaken before taken() and once
  // freed). Its capacity stays from step to step: recording allocates nothing in steady state.
  static constexpr DevicePtr kNotTaken = ~DevicePtr{0};
  std::vector<DevicePtr> addr_of_;
  std::uint32_t clock_ = 0;
  std::uint64_t step_number_ = 0;  // steps marked so far
  const Plan* plan_ = nullptr;
  bool exact_ = true;  // the step has followed its plan so far
  // Not on a plan: the record whose block sizes the step takes (its shape's cover), nullptr
  // where none or once a block did not fit; the cover's next block; the step's mallocs so far,
  // slab slots included (from its mark).
  const std::vector<Recorded>* cover_ = nullptr;
  std::uint32_t next_ = 0;
  std::uint32_t asked_ = 0;
  // The cover's block at the step's `asked`-th malloc, of `bytes`, from next_ on: its index, or
  // kNoBlock where none is there or it is smaller (covered's O(1) amortized: next_ only moves on).
  std::uint32_t fit(std::size_t bytes, std::uint32_t asked);
  static constexpr std::uint32_t kNoBlock = ~std::uint32_t{0};
  bool too_long_ = false;  // the step made more than kMaxStepMallocs range mallocs
  // Marked, but its record still open (until the next step's first range malloc), and whether
  // it ran its plan exactly (then the plan stays as it is).
  bool closing_ = false;
  bool record_exact_ = false;
  bool record_covered_ = false;  // it fit its cover to the end
  bool first_of_shape_ = false;  // the step running is the first of its shape
  bool first_on_plan_ = false;   // the step running is the first on its shape's plan
  // The last 64 steps: which began a new shape (bit 0 the latest) and how many range mallocs
  // each made (by step number, modulo 64), with the sums over them. Steps are weighed by their
  // mallocs: a program that marks twice an iteration (an optimizer each for its sparse and its
  // dense parameters, as DLRM trains) has a short step that always recurs beside a long one
  // that never does, and counted by steps its shapes passed for recurring: its clashes were
  // never counted, and it remapped ~55 pages a step to its 150th (docs/notes/2026-11-25-held-out-traces-a-fifth-batch-shapes-new-every-step-two-optimizers.md).
  static constexpr std::uint64_t kRecentSteps = 64;
  std::uint64_t new_shapes_ = 0;
  std::array<std::uint32_t, kRecentSteps> mallocs_by_step_{};
  std::uint64_t recent_mallocs_ = 0, recent_new_mallocs_ = 0;
  // A plan and its extent, made from a record (place_offline: O(n^2) in the step's blocks).
  struct Made {
    Plan plan;
    std::size_t extent = 0;
  };
  static Made make_plan(const std::vector<Recorded>& record);
  // The most bytes the record's blocks freed within the step held at once: a plan's extent is at
  // least that. O(n) in the record; weighed at every mark, so it counts in `changes` (a buffer
  // kept from step to step: a mark allocates nothing once steps stop growing).
  static std::size_t peak_of(const std::vector<Recorded>& record, std::vector<std::int64_t>& changes);
  std::vector<std::int64_t> peak_changes_;
  std::size_t largest_peak_ = 0;  // of the records kept so far (extent_to_map_early)
  // Plans by the size of their step's first range malloc (each shape's first request differs
  // where shapes take turns: an activation's size depends on the length), with how many steps
  // began with it.
  struct Shape {
    std::uint32_t steps = 0;
    bool planned = false;
    Plan plan;
    std::vector<Recorded> record;  // its last step, until planned
    std::uint64_t generation = 0;  // which record (records_ when it was kept)
    std::size_t peak = 0;          // the record's (peak_of)
    bool missed = false;           // the last step that did not fit the record left it as it was
    std::optional<Made> made;      // made in the background from the current record
  };
  void plan(Shape& shape);  // from its record: made in the background, or here
  void close_step();        // the step's record ends (at the next step's first range malloc)
  // At close_step, for a shape whose record is not planned: whether its record stays (the step's
  // own dropped) as the shape's cover, or the step's is kept (keeps_cover in step_plan.cpp).
  bool keeps_cover(Shape& shape, std::size_t peak);  // `peak`: the step's (peak_of)
  // Plans in the background: a Llama step of 3,800 range mallocs takes 5-14 ms to place
  // (docs/notes/2026-11-24-plans-made-in-the-background.md), which held up the start of the step that came back to its shape, with the
  // GPU idle behind it. So once shapes take turns (and recur: not where most steps begin a new
  // shape), a record is placed on another thread as soon as it closes, while the program runs
  // on, one thread at a time (a record closing while one runs is planned when its shape comes
  // back, as before); when shapes start taking turns, the records kept so far go as one batch.
  // A plan is collected when its shape comes back (waiting for it there if it is not done). A
  // thread owns copies of its records and its results' shared states, so the planner never waits
  // for one to end. (Threads may outlive the engine: libgmem.so is never unloaded while one
  // runs, as nothing dlcloses it.)
  struct Pending {
    std::size_t shape = 0;
    std::uint64_t generation = 0;
    std::future<Made> made;
  };
  void plan_in_background(const std::vector<std::size_t>& keys);
  // Steps that began a new shape made at most half of the last 64 steps' range mallocs.
  bool shapes_recur() const {
    return step_number_ < kRecentSteps || recent_new_mallocs_ * 2 <= recent_mallocs_;
  }
  void note_step_made(std::size_t mallocs);  // at a mark: the step's mallocs and whether new
  // Moves the plans made in the background into their shapes (if they still hold the records
  // they were made from); `wait_for`: the shape whose plan to wait for, if one is under way.
  void collect(const Shape* wait_for);
  bool background_;
  bool plans_ = true;  // plans may be followed (else covers only: taking_turns_ stays false)
  std::vector<Pending> pending_;
  std::uint64_t records_ = 0;  // records kept so far (a Shape's generation)
  // At most kMaxShapes, each holding one step's record or plan: a program whose steps never
  // repeat would otherwise keep a record of every step. Beyond it the planner starts afresh.
  static constexpr std::size_t kMaxShapes = 256;
  std::unordered_map<std::size_t, Shape> shapes_;
  // Plans are followed once shapes take turns (a shape comes back after another one ran), or
  // once the online layout of shapes seen before keeps moving: kMovingSteps such steps in a row
  // mapped pages, and together they mapped as much as the largest step held at once
  // (largest_peak_: about what its plan's extent maps, once). A single shape's online layout
  // usually repeats by itself and settles (best fit depends on the free ranges alone), and
  // moving it to the plan region costs a map of every page the plan uses; but where blocks of
  // different lifetimes share pages it keeps moving for dozens of steps and settles only on
  // chunks bought for it (BERT masked-LM, 16 x 512, on an H200: 180 maps a step for 20 steps,
  // then 1.07 times its peak). Remapping until it has cost what the plan costs, then planning,
  // never pays more than twice what the better of the two would have. kMovingSteps: a layout
  // still moving after the clash rule let its pages buy chunks (at a page's fourth clash,
  // ClashRule::kClashesToBuy) will not settle cheaply online; one that settles by then (most
  // do: resnet50, prefetch_train, moe) stays online, where it costs no plan region.
  bool taking_turns_ = false;
  static constexpr std::uint32_t kMovingSteps = 4;
  std::uint32_t moving_steps_ = 0;  // steps in a row of shapes seen before that mapped pages
  std::size_t moved_bytes_ = 0;     // what those steps mapped
  std::size_t last_shape_ = 0;  // the first request of the last step
  Stats stats_;
};

}  // namespace gmem::detail
