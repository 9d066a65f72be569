#include "report/html_page.hpp"

#include <algorithm>
#include <cstdio>
#include <stdexcept>
#include <string_view>

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

std::string html_page(const ReportData& data, const std::vector<ReportData>& others, bool ranks) {
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
  page += "<section><h2>Allocated memory by site</h2><div id=\"sites-chart\" class=\"chart\"></div>\n"
          "<p class=\"range\" id=\"range\"></p><table id=\"sites\"></table></section>\n";
  if (ranks && !others.empty()) page += ranks_table(data, others);
  if (compare)
    page += "<section id=\"compare-section\"><h2>Two runs, site by site</h2><p class=\"hint\">The most each "
            "site held at any time in either run, largest difference first.</p><table id=\"site-diff\"></table></section>\n";
  page += "<section><h2>Leak findings</h2><table id=\"leaks\"></table></section>\n";
  page += "<section><h2>Largest live blocks at the peak</h2><p class=\"hint\">Click a row for its stack.</p>"
          "<table id=\"largest\"></table><pre id=\"stack\" class=\"stack\"></pre></section>\n";
  page += "<section><h2>Summary</h2><pre id=\"summary\"></pre></section>\n</main>\n";
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
