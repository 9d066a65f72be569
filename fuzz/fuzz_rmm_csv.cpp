// The RMM log reader on any text (no format detection in front of it).
#include "fuzz_limits.hpp"
#include "trace/formats.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  return gmem::fuzz::run_reader([&] {
    gmem::trace::Trace trace;
    trace.path = "fuzz";
    trace.frames.emplace_back();
    gmem::trace::detail::read_rmm_csv(gmem::fuzz::as_text(data, size), trace, gmem::fuzz::fuzz_limits());
  });
}
