// The report as one HTML file: the data (report_data.hpp), the page's script and style, and the
// chart library with its license, all inline, under a Content-Security-Policy that lets the page
// fetch nothing: it opens offline, from a mail attachment or a CI artifact.
#pragma once

#include <string>
#include <string_view>

#include "report/report_data.hpp"

namespace gmem::report {

// This build embeds the chart library (cmake/gmem_report.cmake found node_modules/uplot).
bool have_chart_library();
// What to do when it does not: npm ci in the repository, then build again.
std::string missing_chart_library_message();

// The page for one trace's report. With `others` (built with ReportOptions::step_axis, as `data`),
// their memory is overlaid on data's step by step: one other is a second run compared site by
// site; with `ranks`, `data` and `others` are the ranks of one job, rank 0 first, in a table with
// their imbalance. Throws std::runtime_error without the chart library.
// `fit_html`: the batch-size fit's section (fit_section), placed under the summary.
std::string html_page(const ReportData& data, const std::vector<ReportData>& others = {}, bool ranks = false,
                      const std::string& fit_html = "");

// The batch-size fit's table (gmem.fit_batch_size's Fit.as_dict() as JSON, from `file`): the
// pick, the budget, the parts of the peak, predicted and measured peak, the steps run. Throws
// BadInputError naming `file` and the problem when it is not such a JSON object.
std::string fit_section(std::string_view json, const std::string& file);

}  // namespace gmem::report
