// gmem's device-to-device copy (gmem_copy_async), compiled to PTX at build time and loaded into
// each context by cuda_copy.cpp: cudaMemcpyAsync between ranges mapped from many 2 MiB chunks ran
// up to 1.8x slower on an H200 than between cudaMalloc'd ones, while a kernel ran at the same
// speed on both (gpu/chunk_copy_speed.cu; docs/notes/2026-11-29-copies-run-slower-on-2-mib-chunks.md).
//
// A grid-stride copy: 16-byte words, four in flight a thread, where both ends are 16-byte aligned;
// 4-byte words where both are 4-byte aligned; bytes otherwise. The ranges must not overlap, as
// for cudaMemcpyAsync.
#include <cstddef>

namespace {

template <class Word>
__device__ void copy_words(Word* __restrict__ dst, const Word* __restrict__ src, size_t words) {
  const size_t stride = size_t{gridDim.x} * blockDim.x;
  size_t i = size_t{blockIdx.x} * blockDim.x + threadIdx.x;
  for (; i + 3 * stride < words; i += 4 * stride) {
    const Word a = src[i], b = src[i + stride], c = src[i + 2 * stride], d = src[i + 3 * stride];
    dst[i] = a;
    dst[i + stride] = b;
    dst[i + 2 * stride] = c;
    dst[i + 3 * stride] = d;
  }
  for (; i < words; i += stride) dst[i] = src[i];
}

}  // namespace

extern "C" __global__ void gmem_copy_bytes(char* __restrict__ dst, const char* __restrict__ src,
                                           size_t bytes) {
  const size_t ends = reinterpret_cast<size_t>(dst) | reinterpret_cast<size_t>(src);
  size_t done = 0;
  if (ends % 16 == 0) {
    copy_words(reinterpret_cast<uint4*>(dst), reinterpret_cast<const uint4*>(src), bytes / 16);
    done = bytes / 16 * 16;
  } else if (ends % 4 == 0) {
    copy_words(reinterpret_cast<unsigned*>(dst), reinterpret_cast<const unsigned*>(src), bytes / 4);
    done = bytes / 4 * 4;
  }
  const size_t tail = bytes - done;  // under a word; the whole copy where the ends are unaligned
  const size_t stride = size_t{gridDim.x} * blockDim.x;
  for (size_t i = size_t{blockIdx.x} * blockDim.x + threadIdx.x; i < tail; i += stride)
    dst[done + i] = src[done + i];
}
