// SHA-256 (FIPS 180-4), for the page's Content-Security-Policy: each inline script is allowed by
// its hash ('sha256-BASE64'), so that no other script, injected or not, runs in a report.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>

namespace gmem::report {

std::array<std::uint8_t, 32> sha256(std::string_view data);

// The CSP source for a script whose text is exactly `script`: 'sha256-<base64 of its digest>'.
std::string csp_hash(std::string_view script);

}  // namespace gmem::report
