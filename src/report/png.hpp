// A report's timeline as a PNG, for CI logs and issues: headless Chromium opens the page in its
// timeline-only view (#only-timeline) and takes a screenshot.
#pragma once

#include <string>

namespace gmem::report {

// The Chromium to run: $GMEM_CHROMIUM, else chromium, chromium-browser, google-chrome or
// google-chrome-stable on PATH; "" when none is.
std::string find_chromium();

// Writes `png` from the report page `html`. Returns false after saying why on stderr (no
// Chromium installed: how to get one; Chromium failed: its status).
bool write_timeline_png(const std::string& html, const std::string& png);

}  // namespace gmem::report
