#include "report/html_page.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <stdexcept>
#include <string_view>
#include <vector>

#include "gmem/error.hpp"
#include "gmem/report_assets.hpp"
#include "report/sha256.hpp"

namespace gmem::report {
namespace {

template <std::size_t N>
std::string_view bytes_of(const unsigned char (&array)[N]) {
  return {reinterpret_cast<const char*>(array), N};
}

std::string escape_html(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (char c : text) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      default: out += c;
    }
  }
  return out;
}

// Text inside <script>: "</script" (any case) would end the element early, "<!--" would change
// how it is parsed. In JSON, '<' only occurs in strings, where \u003c means the same; in the
// scripts it is replaced only where those sequences occur (in strings and comments, if at all).
std::string script_safe_json(std::string_view json) {
  std::string out;
  out.reserve(json.size());
  for (char c : json) {
    if (c == '<') out += "\\u003c";
    else out += c;
  }
  return out;
}

std::string script_safe_code(std::string_view code) {
  std::string out(code);
  for (std::size_t at = 0; (at = out.find("</", at)) != std::string::npos; at += 3) out.replace(at, 2, "<\\/");
  for (std::size_t at = 0; (at = out.find("<!--", at)) != std::string::npos; at += 5) out.replace(at, 4, "<\\!--");
  return out;
}

// Where the headline's numbers go, with their exact bytes for tests (data-bytes).
std::string figure(const char* id, const char* label, std::uint64_t bytes) {
  return std::string("<div class=\"figure\"><div class=\"label\">") + label + "</div><div class=\"value\" id=\"" +
         id + "\" data-bytes=\"" + std::to_string(bytes) + "\">" + escape_html(format_bytes(bytes)) +
         "</div></div>\n";
}


// --- the batch-size fit (--fit FIT.json) -----------------------------------------------------

// A JSON value, as much of JSON as Fit.as_dict() writes (json.dumps): enough to check it.
struct JsonValue {
  enum Kind { null, boolean, number, string, array, object } kind = null;
  bool b = false;
  double n = 0;
  std::string s;
  std::vector<JsonValue> items;
  std::map<std::string, JsonValue> fields;
};

class JsonParser {
 public:
  JsonParser(std::string_view text, const std::string& file) : text_(text), file_(file) {}
  JsonValue document() {
    JsonValue v = value(0);
    space();
    if (at_ < text_.size()) fail("text after the JSON value");
    return v;
  }

 private:
  [[noreturn]] void fail(const std::string& problem) const {
    throw BadInputError(file_, 0, "not a batch-size fit's JSON (gmem.fit_batch_size(...).as_dict()): " + problem +
                                      " at byte " + std::to_string(at_));
  }
  void space() {
    while (at_ < text_.size() && (text_[at_] == ' ' || text_[at_] == '\n' || text_[at_] == '\r' || text_[at_] == '\t')) ++at_;
  }
  bool literal(std::string_view word) {
    if (text_.substr(at_, word.size()) != word) return false;
    at_ += word.size();
    return true;
  }
  void expect(char c) {
    space();
    if (at_ >= text_.size() || text_[at_] != c) fail(std::string("expected '") + c + "'");
    ++at_;
  }
  JsonValue value(int depth) {
    if (depth > 32) fail("nested too deep");
    space();
    if (at_ >= text_.size()) fail("unexpected end");
    JsonValue v;
    const char c = text_[at_];
    if (c == '{') {
      v.kind = JsonValue::object;
      ++at_;
      space();
      if (at_ < text_.size() && text_[at_] == '}') return ++at_, v;
      for (;;) {
        space();
        if (at_ >= text_.size() || text_[at_] != '"') fail("expected a key");
        std::string key = string_body();
        expect(':');
        v.fields[key] = value(depth + 1);
        space();
        if (at_ < text_.size() && text_[at_] == ',') { ++at_; continue; }
        expect('}');
        return v;
      }
    }
    if (c == '[') {
      v.kind = JsonValue::array;
      ++at_;
      space();
      if (at_ < text_.size() && text_[at_] == ']') return ++at_, v;
      for (;;) {
        v.items.push_back(value(depth + 1));
        space();
        if (at_ < text_.size() && text_[at_] == ',') { ++at_; continue; }
        expect(']');
        return v;
      }
    }
    if (c == '"') {
      v.kind = JsonValue::string;
      v.s = string_body();
      return v;
    }
    if (literal("null")) return v;
    if (literal("true")) { v.kind = JsonValue::boolean; v.b = true; return v; }
    if (literal("false")) { v.kind = JsonValue::boolean; return v; }
    const std::size_t start = at_;
    while (at_ < text_.size() && std::string_view("+-0123456789.eE").find(text_[at_]) != std::string_view::npos) ++at_;
    const std::string number(text_.substr(start, at_ - start));
    char* end = nullptr;
    v.n = number.empty() ? 0 : std::strtod(number.c_str(), &end);
    if (number.empty() || end != number.c_str() + number.size() || !std::isfinite(v.n)) {
      at_ = start;
      fail("not a JSON value");
    }
    v.kind = JsonValue::number;
    return v;
  }
  std::string string_body() {
    ++at_;  // the opening quote
    std::string out;
    while (at_ < text_.size() && text_[at_] != '"') {
      char c = text_[at_++];
      if (c != '\\') { out += c; continue; }
      if (at_ >= text_.size()) break;
      c = text_[at_++];
      switch (c) {
        case 'n': out += '\n'; break;
        case 't': out += '\t'; break;
        case 'r': out += '\r'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'u': {
          if (at_ + 4 > text_.size()) fail("a short \\u escape");
          unsigned code = 0;
          for (std::size_t k = 0; k < 4; ++k) {
            const char h = text_[at_ + k];
            const int digit = h >= '0' && h <= '9' ? h - '0' : h >= 'a' && h <= 'f' ? h - 'a' + 10 : h >= 'A' && h <= 'F' ? h - 'A' + 10 : -1;
            if (digit < 0) fail("a bad \\u escape");
            code = code * 16 + static_cast<unsigned>(digit);
          }
          at_ += 4;
          // Surrogates (characters beyond the BMP) show as U+FFFD: only notes are text here.
          const unsigned cp = code >= 0xD800 && code < 0xE000 ? 0xFFFD : code;
          if (cp < 0x80) out += static_cast<char>(cp);
          else if (cp < 0x800) out += static_cast<char>(0xC0 | (cp >> 6)), out += static_cast<char>(0x80 | (cp & 0x3F));
          else out += static_cast<char>(0xE0 | (cp >> 12)), out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F)),
                      out += static_cast<char>(0x80 | (cp & 0x3F));
          break;
        }
        default: out += c;  // \" \\ \/
      }
    }
    if (at_ >= text_.size()) fail("a string without its closing quote");
    ++at_;
    return out;
  }

  std::string_view text_;
  const std::string& file_;
  std::size_t at_ = 0;
};

// The fit's fields, checked: each names the field and what it should have been.
class FitFields {
 public:
  FitFields(const JsonValue& v, const std::string& file, std::string where) : v_(v), file_(file), where_(std::move(where)) {
    if (v.kind != JsonValue::object) fail("", "is not a JSON object");
  }
  [[noreturn]] void fail(const std::string& key, const std::string& problem) const {
    throw BadInputError(file_, 0, "not a batch-size fit's JSON (gmem.fit_batch_size(...).as_dict()): " + where_ +
                                      (key.empty() ? "" : "'" + key + "' ") + problem);
  }
  const JsonValue* get(const std::string& key, bool required) const {
    auto it = v_.fields.find(key);
    if (it == v_.fields.end() || (it->second.kind == JsonValue::null && required)) {
      if (required) fail(key, it == v_.fields.end() ? "is missing" : "is null");
      return nullptr;
    }
    return it->second.kind == JsonValue::null ? nullptr : &it->second;
  }
  // A byte count (or a batch size): a whole number >= 0; nullptr/absent as -1 where optional.
  double count(const std::string& key, bool required = true) const {
    const JsonValue* x = get(key, required);
    if (!x) return -1;
    if (x->kind != JsonValue::number || x->n < 0 || x->n != std::floor(x->n) || x->n > 1.8e19)
      fail(key, "should be a whole number >= 0");
    return x->n;
  }
  double number(const std::string& key) const {
    const JsonValue* x = get(key, false);
    if (x && x->kind != JsonValue::number) fail(key, "should be a number");
    return x ? x->n : 0;
  }
  std::string text(const std::string& key) const {
    const JsonValue* x = get(key, false);
    if (x && x->kind != JsonValue::string) fail(key, "should be a string");
    return x ? x->s : "";
  }
  int flag(const std::string& key) const {  // -1: null or absent
    const JsonValue* x = get(key, false);
    if (x && x->kind != JsonValue::boolean) fail(key, "should be true, false or null");
    return x ? x->b : -1;
  }
  const std::vector<JsonValue>& list(const std::string& key, bool required) const {
    static const std::vector<JsonValue> none;
    const JsonValue* x = get(key, required);
    if (x && x->kind != JsonValue::array) fail(key, "should be a list");
    return x ? x->items : none;
  }

 private:
  const JsonValue& v_;
  const std::string& file_;
  std::string where_;
};

std::string bytes_cell(double bytes) {
  if (bytes < 0) return "<td class=\"num\"></td>";
  const auto b = static_cast<std::uint64_t>(bytes);
  return "<td class=\"num\" data-bytes=\"" + std::to_string(b) + "\">" + escape_html(format_bytes(b)) + "</td>";
}

}  // namespace

std::string fit_section(std::string_view json, const std::string& file) {
  const JsonValue doc = JsonParser(json, file).document();
  const FitFields fit(doc, file, "");
  const double b = fit.count("batch_size");
  const double budget = fit.count("budget"), resident = fit.count("resident"), step_fixed = fit.count("step_fixed");
  const double per_sample = fit.count("per_sample"), overhead = fit.count("overhead", false);
  const double saved = fit.count("saved_per_sample", false);
  const double predicted = fit.count("predicted_peak", false), measured = fit.count("measured_peak", false);
  const double limit = fit.count("limit", false), device_total = fit.count("device_total", false);
  const double held_outside = fit.count("held_outside", false), ranks = fit.count("ranks", false);
  const std::string method = fit.text("method");
  const int affine = fit.flag("affine");
  const double seconds = fit.number("seconds");
  if (saved > per_sample) fit.fail("saved_per_sample", "is more than per_sample");
  std::vector<std::string> notes;
  for (const JsonValue& n : fit.list("notes", false)) {
    if (n.kind != JsonValue::string) fit.fail("notes", "should be a list of strings");
    notes.push_back(n.s);
  }
  const std::vector<JsonValue>& steps = fit.list("steps", true);
  const std::string bs = std::to_string(static_cast<std::uint64_t>(b));

  std::string where;
  if (limit > 0 && device_total > 0 && limit < device_total) where = "gmem's limit " + format_bytes(static_cast<std::uint64_t>(limit));
  else if (device_total > 0) where = "the device's " + format_bytes(static_cast<std::uint64_t>(device_total));
  if (held_outside > 0) where += (where.empty() ? "" : ", ") + format_bytes(static_cast<std::uint64_t>(held_outside)) + " held outside gmem";
  if (ranks > 1) where = "the tightest of " + std::to_string(static_cast<std::uint64_t>(ranks)) + " ranks" + (where.empty() ? "" : "; this rank: " + where);

  std::string html = "<section id=\"fit-section\"><h2>Batch-size fit</h2>\n<p id=\"fit-pick\" data-batch-size=\"" + bs +
                     "\" data-budget=\"" + std::to_string(static_cast<std::uint64_t>(budget)) + "\">Batch size <b>" + bs +
                     "</b> fits in <b>" + escape_html(format_bytes(static_cast<std::uint64_t>(budget))) + "</b>" +
                     (where.empty() ? "" : " (" + escape_html(where) + ")") + (method == "predicted" ? "; the line's pick, verified" : method == "searched" ? "; found by a search" :
                      method.empty() ? "" : "; " + escape_html(method)) +
                     (affine == 1 ? "; the peak is affine in the batch" : affine == 0 ? "; the peak is not affine in the batch" : "") +
                     ".</p>\n<table id=\"fit-parts\"><tr><th>part of the peak</th><th class=\"num\">bytes</th><th class=\"num\">at " +
                     bs + "</th></tr>\n";
  auto part = [&](const char* id, const char* name, double bytes, double at) {
    html += std::string("<tr id=\"") + id + "\"><td>" + name + "</td>" + bytes_cell(bytes) + bytes_cell(at) + "</tr>\n";
  };
  part("fit-resident", "resident: weights, optimizer state", resident, -1);
  part("fit-step-fixed", "per step: gradients, workspaces", step_fixed, -1);
  part("fit-per-sample", "per sample", per_sample, per_sample * b);
  if (saved >= 0) {
    part("fit-saved", "&nbsp;&nbsp;saved for backward", saved, saved * b);
    part("fit-temporaries", "&nbsp;&nbsp;temporaries at the peak", per_sample - saved, (per_sample - saved) * b);
  }
  if (overhead >= 0) part("fit-overhead", "gmem's overhead (reserved &minus; allocated)", overhead, -1);
  html += "</table>\n";
  if (predicted >= 0) {
    html += "<p id=\"fit-peak\" data-predicted=\"" + std::to_string(static_cast<std::uint64_t>(predicted)) + "\"" +
            (measured >= 0 ? " data-measured=\"" + std::to_string(static_cast<std::uint64_t>(measured)) + "\"" : "") +
            ">Peak allocated at " + bs + ": predicted " + escape_html(format_bytes(static_cast<std::uint64_t>(predicted)));
    if (measured >= 0 && predicted > 0) {
      char error[32];
      std::snprintf(error, sizeof error, "%+.1f%%", 100 * (measured - predicted) / predicted);
      html += ", measured " + escape_html(format_bytes(static_cast<std::uint64_t>(measured))) + " (" + error + ")";
    }
    html += ".</p>\n";
  }
  char took[32];
  std::snprintf(took, sizeof took, "%.1f s", seconds);
  html += "<table id=\"fit-steps\"><caption>" + std::to_string(steps.size()) + " steps run, " + took +
          ":</caption><tr><th class=\"num\">batch size</th><th>kind</th><th>outcome</th><th class=\"num\">peak allocated</th></tr>\n";
  for (std::size_t i = 0; i < steps.size(); ++i) {
    const FitFields step(steps[i], file, "steps[" + std::to_string(i) + "]: ");
    const double sb = step.count("batch_size");
    const int ok = step.flag("ok");
    if (ok < 0) step.fail("ok", "is missing");
    html += "<tr><td class=\"num\">" + std::to_string(static_cast<std::uint64_t>(sb)) + "</td><td>" +
            escape_html(step.text("kind")) + "</td><td>" + (ok ? "ran" : "out of memory") + "</td>" +
            (ok ? bytes_cell(step.count("peak_allocated")) : std::string("<td class=\"num\"></td>")) + "</tr>\n";
  }
  html += "</table>\n";
  for (const std::string& n : notes) html += "<p class=\"hint\">note: " + escape_html(n) + "</p>\n";
  return html + "</section>\n";
}

namespace {
}  // namespace

bool have_chart_library() { return assets::kHaveChartLibrary; }

std::string missing_chart_library_message() {
  return "this gmem was built without its chart library (uPlot, from npm), so it cannot write "
         "reports. Install Node.js and npm (Debian: apt-get install nodejs npm), run `npm ci` in "
         "gmem's repository (package-lock.json pins the library), then build again (cmake -S . -B "
         "build && cmake --build build): the build embeds node_modules/uplot into the gmem binary.";
}

// The ranks of one job: each one's peaks and cause, and the imbalance as `gmem summary --ranks`
// gives it (peak reserved in gmem's replay: the rank with the most, over the mean of all).
std::string ranks_table(const ReportData& first, const std::vector<ReportData>& others) {
  std::vector<const ReportData*> ranks{&first};
  for (const ReportData& r : others) ranks.push_back(&r);
  std::size_t top = 0;
  std::uint64_t total = 0, lowest = ranks[0]->headline.peak_reserved;
  for (std::size_t r = 0; r < ranks.size(); ++r) {
    if (ranks[r]->headline.peak_reserved > ranks[top]->headline.peak_reserved) top = r;
    total += ranks[r]->headline.peak_reserved;
    lowest = std::min(lowest, ranks[r]->headline.peak_reserved);
  }
  const double mean = static_cast<double>(total) / static_cast<double>(ranks.size());
  const double imbalance = mean > 0 ? static_cast<double>(ranks[top]->headline.peak_reserved) / mean : 1.0;
  char ratio[32];
  std::snprintf(ratio, sizeof ratio, "%.2f", imbalance);
  std::string html = "<section id=\"ranks-section\"><h2>Ranks</h2>\n<p id=\"imbalance\" data-peak-rank=\"" +
                     std::to_string(top) + "\" data-imbalance=\"" + std::to_string(imbalance) + "\">Rank " +
                     std::to_string(top) + " peaks at " + escape_html(format_bytes(ranks[top]->headline.peak_reserved)) +
                     " reserved, " + ratio + "&times; the mean over ranks, " +
                     escape_html(format_bytes(ranks[top]->headline.peak_reserved - lowest)) +
                     " above the lowest.</p>\n<table id=\"ranks\"><tr><th>rank</th><th>trace</th>"
                     "<th class=\"num\">peak allocated</th><th class=\"num\">peak reserved</th><th>cause</th></tr>\n";
  for (std::size_t r = 0; r < ranks.size(); ++r) {
    const Headline& h = ranks[r]->headline;
    html += "<tr><td class=\"num\">" + std::to_string(r) + "</td><td class=\"site\">" + escape_html(ranks[r]->trace_name) +
            "</td><td class=\"num\" data-bytes=\"" + std::to_string(h.peak_allocated) + "\">" +
            escape_html(format_bytes(h.peak_allocated)) + "</td><td class=\"num\">" +
            escape_html(format_bytes(h.peak_reserved)) + "</td><td>" + escape_html(h.cause) + "</td></tr>\n";
  }
  return html + "</table><p class=\"hint\">The timeline overlays every rank's allocated memory step by "
                "step (x: steps).</p></section>\n";
}

std::string html_page(const ReportData& data, const std::vector<ReportData>& others, bool ranks,
                      const std::string& fit_html) {
  const ReportData* compare = !ranks && others.size() == 1 ? &others[0] : nullptr;
  if (!have_chart_library()) throw std::runtime_error(missing_chart_library_message());
  const Headline& h = data.headline;
  // The two scripts, exactly as they go between their tags: the policy allows them by hash.
  const std::string chart_script = "\n/*! " + script_safe_code(bytes_of(assets::kChartLicense)) + " */\n" +
                                   script_safe_code(bytes_of(assets::kChartJs)) + "\n";
  const std::string page_script = "\n" + script_safe_code(bytes_of(assets::kPageJs)) + "\n";
  std::string page;
  page.reserve(data.json.size() + 128 * 1024);
  page += "<!doctype html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n";
  // Nothing may be fetched: no sources at all but the page's own two scripts (by hash: nothing
  // else runs, injected or not), inline styles and data: images (uPlot draws on canvases). A
  // report that tried to fetch would log a violation (the tests look).
  page += "<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; script-src " +
          csp_hash(chart_script) + " " + csp_hash(page_script) +
          "; style-src 'unsafe-inline'; img-src data:; base-uri 'none'; form-action 'none'\">\n";
  page += "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n";
  page += "<title>gmem report: " + escape_html(data.trace_name) + "</title>\n";
  page += "<style>\n";
  page += bytes_of(assets::kChartCss);
  page += "\n</style>\n<style>\n";
  page += bytes_of(assets::kPageCss);
  page += "\n</style>\n</head>\n<body>\n<header>\n";
  page += "<h1>gmem report: <span id=\"trace\">" + escape_html(data.trace_name) + "</span></h1>\n";
  page += "<div class=\"headline\">\n";
  page += figure("peak-allocated", "peak allocated", h.peak_allocated);
  page += figure("peak-reserved", "peak reserved, gmem's replay", h.peak_reserved);
  if (h.has_recorded) {
    page += figure("recorded-peak-reserved", "peak reserved, recorded allocator", h.recorded_peak_reserved);
  } else {
    page += "<div class=\"figure\"><div class=\"label\">peak reserved, recorded allocator</div>"
            "<div class=\"value none\" id=\"recorded-peak-reserved\">not in the trace</div></div>\n";
  }
  page += "</div>\n<p class=\"cause cause-" + escape_html(h.cause_name.substr(0, h.cause_name.find(' '))) +
          "\" id=\"cause\">" + escape_html(h.cause) + "</p>\n";
  if (!h.advice.empty()) page += "<p class=\"advice\" id=\"advice\">First: " + escape_html(h.advice) + "</p>\n";
  if (compare) {
    const Headline& c = compare->headline;
    page += "<p class=\"compare\" id=\"compare\">Compared with <b>" + escape_html(compare->trace_name) +
            "</b>: peak allocated <span id=\"compare-peak-allocated\" data-bytes=\"" + std::to_string(c.peak_allocated) +
            "\">" + escape_html(format_bytes(c.peak_allocated)) + "</span>, peak reserved (gmem's replay) " +
            escape_html(format_bytes(c.peak_reserved)) + "; " + escape_html(c.cause) + "</p>\n";
  }
  page += "<p class=\"meta\" id=\"meta\"></p>\n</header>\n<main>\n";
  page += "<section><h2>Memory over time <span id=\"axis\" class=\"axis\"></span></h2>"
          "<div id=\"timeline\" class=\"chart\"></div>\n"
          "<p class=\"hint\">Drag across the chart to zoom: the tables below follow the range. "
          "Double-click to zoom out. Lines: <span class=\"k step\">step boundaries</span> "
          "<span class=\"k oom\">out of memory</span> <span class=\"k leak\">a leak begins</span> "
          "<span class=\"k peak\">peak allocated</span></p></section>\n";
  page += "<section><h2><span id=\"stack-title\">Allocated memory by site</span> <span id=\"stack-by\" "
          "class=\"axis\"></span></h2><p class=\"hint\" id=\"stack-note\"></p><div id=\"sites-chart\" class=\"chart\"></div>\n"
          "<p class=\"range\" id=\"range\"></p><table id=\"sites\"></table></section>\n";
  if (ranks && !others.empty()) page += ranks_table(data, others);
  if (compare)
    page += "<section id=\"compare-section\"><h2>Two runs, site by site</h2><p class=\"hint\">The most each "
            "site held at any time in either run, largest difference first.</p><table id=\"site-diff\"></table></section>\n";
  page += "<section><h2>Leak findings</h2><table id=\"leaks\"></table></section>\n";
  page += "<section><h2 id=\"largest-title\">Largest live blocks at the peak</h2><p class=\"hint\">Click a row for its stack.</p>"
          "<table id=\"largest\"></table><pre id=\"stack\" class=\"stack\"></pre></section>\n";
  page += "<section><h2>Summary</h2><pre id=\"summary\"></pre></section>\n";
  page += fit_html + "</main>\n";
  page += "<footer>Written by gmem " GMEM_VERSION " with " + std::string(assets::kChartLibrary) +
          " inlined (its license below). Nothing is fetched when this page is viewed.\n"
          "<details><summary>uPlot's license (MIT)</summary><pre id=\"license\">" +
          escape_html(bytes_of(assets::kChartLicense)) + "</pre></details></footer>\n";
  page += "<script type=\"application/json\" id=\"gmem-data\">";
  if (!others.empty()) {  // the other runs as the first's "others" member ("compare": a second run)
    page += script_safe_json(std::string_view(data.json).substr(0, data.json.rfind('}')));
    page += std::string(",\"ranks\":") + (ranks ? "true" : "false") + ",\"others\":[";
    for (std::size_t i = 0; i < others.size(); ++i) page += (i ? "," : "") + script_safe_json(others[i].json);
    page += "]}";
  } else {
    page += script_safe_json(data.json);
  }
  page += "</script>\n<script>" + chart_script + "</script>\n<script>" + page_script + "</script>\n</body>\n</html>\n";
  return page;
}

}  // namespace gmem::report
