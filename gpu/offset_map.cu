// A question for the CUDA driver alone (no gmem): may cuMemMap map part of a physical
// allocation, at a nonzero offset? cuda.h (13.0) describes the offset ("maps bytes of memory
// represented by handle starting from byte offset") but its parameter note still says "currently
// must be zero". If it may, one large chunk could be created once and its 2 MiB pieces aliased one
// by one (docs/notes/left-to-do.md: chunks of several sizes). Creates a 64 MiB chunk, maps it
// whole, writes a distinct value into each 2 MiB piece, then maps pieces 1 and 17 on their own
// elsewhere, reads them back through the alias, writes through the alias and reads through the
// whole mapping; also times 32 piece maps + set-access against 32 chunks of 2 MiB.
// Build and run on a GPU machine:
//   nvcc -O2 -o offset_map gpu/offset_map.cu -lcuda && ./offset_map
#include <cuda.h>
#include <cuda_runtime.h>
#include <chrono>
#include <cstdio>
#include <vector>
#define CK(x) do { CUresult r_ = (x); if (r_ != CUDA_SUCCESS) { const char* n; cuGetErrorName(r_, &n); std::printf("%s -> %s (line %d)\n", #x, n, __LINE__); return 1; } } while (0)
static double now_us() { return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now().time_since_epoch()).count(); }
int main() {
  cudaSetDevice(0); cudaFree(nullptr);
  CUmemAllocationProp prop = {};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED; prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE; prop.location.id = 0;
  CUmemAccessDesc acc = {}; acc.location = prop.location; acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  const size_t piece = 2 << 20, pieces = 32, big = piece * pieces;
  CUmemGenericAllocationHandle h; CK(cuMemCreate(&h, big, &prop, 0));
  CUdeviceptr whole, alias;
  CK(cuMemAddressReserve(&whole, big, 0, 0, 0));
  CK(cuMemAddressReserve(&alias, big, 0, 0, 0));
  CK(cuMemMap(whole, big, 0, h, 0)); CK(cuMemSetAccess(whole, big, &acc, 1));
  for (size_t k = 0; k < pieces; ++k) CK(cuMemsetD32(whole + k * piece, 1000 + k, piece / 4));
  CK(cuCtxSynchronize());
  bool ok = true;
  for (size_t k : {size_t{1}, size_t{17}}) {
    const CUresult r = cuMemMap(alias + k * piece, piece, k * piece, h, 0);
    const char* name; cuGetErrorName(r, &name);
    std::printf("cuMemMap(piece %zu at offset %zu MiB) -> %s\n", k, k * piece >> 20, name);
    if (r != CUDA_SUCCESS) { ok = false; continue; }
    CK(cuMemSetAccess(alias + k * piece, piece, &acc, 1));
    unsigned first = 0, last = 0;
    CK(cuMemcpyDtoH(&first, alias + k * piece, 4));
    CK(cuMemcpyDtoH(&last, alias + (k + 1) * piece - 4, 4));
    std::printf("  read through the alias: %u %u (expected %zu)\n", first, last, 1000 + k);
    ok = ok && first == 1000 + k && last == 1000 + k;
    CK(cuMemsetD32(alias + k * piece, 7000 + k, piece / 4)); CK(cuCtxSynchronize());
    CK(cuMemcpyDtoH(&first, whole + k * piece, 4));
    std::printf("  written through the alias, read through the whole mapping: %u (expected %zu)\n", first, 7000 + k);
    ok = ok && first == 7000 + k;
    CK(cuMemUnmap(alias + k * piece, piece));
  }
  std::printf("pieces of one allocation mapped alone: %s\n", ok ? "yes" : "no");
  if (ok) {  // the price: 32 piece maps + set-access, against 32 separate 2 MiB chunks
    for (int round = 0; round < 2; ++round) {
      double t = now_us();
      for (size_t k = 0; k < pieces; ++k) { CK(cuMemMap(alias + k * piece, piece, k * piece, h, 0)); CK(cuMemSetAccess(alias + k * piece, piece, &acc, 1)); }
      const double pieces_us = (now_us() - t) / pieces;
      for (size_t k = 0; k < pieces; ++k) CK(cuMemUnmap(alias + k * piece, piece));
      std::vector<CUmemGenericAllocationHandle> small(pieces);
      for (auto& s : small) CK(cuMemCreate(&s, piece, &prop, 0));
      t = now_us();
      for (size_t k = 0; k < pieces; ++k) { CK(cuMemMap(alias + k * piece, piece, 0, small[k], 0)); CK(cuMemSetAccess(alias + k * piece, piece, &acc, 1)); }
      const double chunks_us = (now_us() - t) / pieces;
      for (size_t k = 0; k < pieces; ++k) CK(cuMemUnmap(alias + k * piece, piece));
      for (auto& s : small) CK(cuMemRelease(s));
      std::printf("round %d: map + set_access per 2 MiB: piece of a 64 MiB chunk %.1f us, own 2 MiB chunk %.1f us\n", round, pieces_us, chunks_us);
    }
  }
  CK(cuMemUnmap(whole, big)); CK(cuMemRelease(h));
  CK(cuMemAddressFree(whole, big)); CK(cuMemAddressFree(alias, big));
  return 0;
}
