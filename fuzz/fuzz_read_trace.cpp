// read_trace on any bytes: gzip or not, format detection, then whichever reader it picks.
#include "fuzz_limits.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  return gmem::fuzz::run_reader(
      [&] { gmem::trace::read_trace_bytes(gmem::fuzz::as_text(data, size), "fuzz", gmem::fuzz::fuzz_limits()); });
}
