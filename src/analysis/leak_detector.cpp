// LeakDetector: per site, the bytes that survive step boundaries, and the trend of those bytes.
#include <algorithm>
#include <unordered_map>
#include <utility>

#include "analysis/leak_trend.hpp"
#include "gmem/leaks.hpp"

namespace gmem {
namespace {

struct Live {
  std::uint64_t size = 0;
  std::uint32_t site = 0;
  std::uint32_t stack = 0;
  std::size_t step = 0;  // the step it was allocated in
  std::int64_t time_us = 0;
  bool saved = false;    // saved for a backward pass that has not used it
};

struct Site {
  std::string name;
  // Live bytes by age: allocated in this step, in the previous one, or earlier.
  std::int64_t current = 0, previous = 0, older = 0;
  // S(k), recorded only where it changes: (boundary k, bytes allocated before step k-1 and still
  // live at boundary k). Run-length encoded so that a long run costs nothing for quiet sites.
  std::vector<std::pair<std::size_t, std::int64_t>> changes;
  std::int64_t recorded() const { return changes.empty() ? 0 : changes.back().second; }
};

// Interns strings: sites and stacks repeat for every step.
class Interner {
 public:
  std::uint32_t id(std::string_view text) {
    auto it = ids_.find(std::string(text));
    if (it != ids_.end()) return it->second;
    const auto id = static_cast<std::uint32_t>(texts_.size());
    texts_.emplace_back(text);
    ids_.emplace(texts_.back(), id);
    return id;
  }
  const std::string& text(std::uint32_t id) const { return texts_[id]; }

 private:
  std::unordered_map<std::string, std::uint32_t> ids_;
  std::vector<std::string> texts_;
};

}  // namespace

class LeakDetector::Impl {
 public:
  explicit Impl(LeakOptions options) : options_(options) {}

  void alloc(std::uint64_t addr, std::uint64_t size, std::string_view site, std::int64_t time_us,
             std::string_view stack) {
    free(addr);  // an address reused without a free: the free was missed
    const std::uint32_t site_id = site_names_.id(site);
    if (site_id == sites_.size()) sites_.push_back(Site{std::string(site), 0, 0, 0, {}});
    sites_[site_id].current += static_cast<std::int64_t>(size);
    live_[addr] = Live{size, site_id, stacks_.id(stack), step_, time_us};
  }

  void free(std::uint64_t addr) {
    auto it = live_.find(addr);
    if (it == live_.end()) return;
    const Live& block = it->second;
    Site& site = sites_[block.site];
    const auto size = static_cast<std::int64_t>(block.size);
    if (block.step == step_) {
      site.current -= size;
    } else if (block.step + 1 == step_) {
      site.previous -= size;
    } else {
      site.older -= size;
    }
    live_.erase(it);
  }

  void step(std::int64_t time_us) {
    ++step_;
    step_times_.push_back(time_us);
    for (Site& site : sites_) {
      site.older += site.previous;
      site.previous = site.current;
      site.current = 0;
      if (site.older != site.recorded()) site.changes.emplace_back(step_, site.older);
    }
  }

  void saved(std::uint64_t addr, bool saved) {
    if (auto it = live_.find(addr); it != live_.end()) it->second.saved = saved;
  }
  void backward() { backward_runs_ = true; }

  std::size_t steps() const { return step_; }
  std::size_t live_count() const { return live_.size(); }

  std::vector<LeakFinding> findings() const {
    std::vector<LeakFinding> out;
    std::vector<std::int64_t> step_growth;
    std::vector<std::size_t> index(sites_.size(), kNoFinding);  // site id -> its finding
    for (std::uint32_t id = 0; id < sites_.size(); ++id) {
      LeakFinding finding;
      std::int64_t growth = 0;
      if (judge(sites_[id], finding, growth)) {
        index[id] = out.size();
        finding.backward_runs = backward_runs_;
        out.push_back(std::move(finding));
        step_growth.push_back(growth);
      }
    }
    fill_samples(index, step_growth, out);
    std::sort(out.begin(), out.end(), [](const LeakFinding& a, const LeakFinding& b) {
      return a.bytes_per_step != b.bytes_per_step ? a.bytes_per_step > b.bytes_per_step
                                                  : a.site < b.site;
    });
    return out;
  }

 private:
  // Is the site's S(k) growing up to the last boundary? Fills the trend part of `finding`;
  // `step_growth` gets the usual growth of a step that grew.
  bool judge(const Site& site, LeakFinding& finding, std::int64_t& step_growth) const {
    std::vector<analysis::Growth> diffs;
    if (!analysis::changes_since_last_drop(site.changes, options_.drop_tolerance, diffs)) return false;
    const std::optional<analysis::Trend> trend = analysis::find_trend(diffs, step_, options_);
    if (!trend) return false;
    finding.site = site.name;
    finding.surviving_bytes = trend->grown;
    finding.bytes_per_step = trend->grown / static_cast<std::int64_t>(trend->periods);
    finding.first_step = trend->first >= 2 ? trend->first - 2 : 0;  // S(k) first holds step k-2's
    finding.periods = trend->periods;
    finding.growing_periods = trend->growing;
    step_growth = trend->usual;
    return true;
  }

  // One pass over the live blocks for every finding: its sample, the oldest live block of the
  // leak (allocated in a step the trend covers, and no larger than a step's growth: a one-off
  // workspace allocated in the same step is not the leak), and its bytes saved for a backward.
  static constexpr std::size_t kNoFinding = ~std::size_t{0};
  void fill_samples(const std::vector<std::size_t>& index,
                    const std::vector<std::int64_t>& step_growth,
                    std::vector<LeakFinding>& findings) const {
    if (findings.empty()) return;
    struct Oldest {
      const Live* block = nullptr;
      std::uint64_t addr = 0;
    };
    std::vector<Oldest> oldest(findings.size());
    for (const auto& [addr, block] : live_) {
      const std::size_t k = index[block.site];
      if (k == kNoFinding) continue;
      LeakFinding& finding = findings[k];
      if (block.step < finding.first_step || block.step + 2 > step_) continue;  // not kept (yet)
      if (block.saved) finding.graph_bytes += static_cast<std::int64_t>(block.size);
      if (static_cast<std::int64_t>(block.size) > step_growth[k]) continue;
      Oldest& o = oldest[k];
      if (!o.block || block.time_us < o.block->time_us ||
          (block.time_us == o.block->time_us && addr < o.addr))
        o = Oldest{&block, addr};
    }
    for (std::size_t k = 0; k < findings.size(); ++k) {
      LeakFinding& finding = findings[k];
      if (const Live* block = oldest[k].block) {
        finding.sample = LeakSample{oldest[k].addr, block->size, block->time_us, stacks_.text(block->stack)};
        finding.first_seen_us = block->time_us;
      } else if (finding.first_step >= 1 && finding.first_step <= step_times_.size()) {
        finding.first_seen_us = step_times_[finding.first_step - 1];  // the step's start
      }
    }
  }

  LeakOptions options_;
  Interner site_names_, stacks_;
  std::vector<Site> sites_;  // indexed by site id
  std::unordered_map<std::uint64_t, Live> live_;
  std::vector<std::int64_t> step_times_;  // step_times_[k-1]: time of boundary k
  std::size_t step_ = 0;
  bool backward_runs_ = false;
};

LeakDetector::LeakDetector(LeakOptions options) : impl_(std::make_unique<Impl>(options)) {}
LeakDetector::~LeakDetector() = default;
LeakDetector::LeakDetector(LeakDetector&&) noexcept = default;
LeakDetector& LeakDetector::operator=(LeakDetector&&) noexcept = default;

void LeakDetector::on_alloc(std::uint64_t addr, std::uint64_t size, std::string_view site,
                            std::int64_t time_us, std::string_view stack) {
  impl_->alloc(addr, size, site, time_us, stack);
}
void LeakDetector::on_free(std::uint64_t addr) { impl_->free(addr); }
void LeakDetector::on_saved(std::uint64_t addr, bool saved) { impl_->saved(addr, saved); }
void LeakDetector::on_backward() { impl_->backward(); }
void LeakDetector::on_step(std::int64_t time_us) { impl_->step(time_us); }
std::size_t LeakDetector::steps() const { return impl_->steps(); }
std::size_t LeakDetector::live_count() const { return impl_->live_count(); }
std::vector<LeakFinding> LeakDetector::findings() const { return impl_->findings(); }

}  // namespace gmem
