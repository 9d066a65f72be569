/* gmem's C API: allocate and free through libgmem.so, print a statistic. On a machine without a
 * GPU run it with GMEM_DEVICE=sim. */
#include <stdio.h>

#include "gmem/gmem.h"

int main(void) {
  void* ptr = NULL;
  if (gmem_malloc(&ptr, 1 << 20, -1, 0) != GMEM_OK) {
    fprintf(stderr, "gmem_malloc failed: %s\n", gmem_last_error());
    return 1;
  }
  int64_t allocated = 0;
  gmem_stat(-1, "allocated_bytes.all.current", &allocated);
  printf("allocated %lld bytes at %p\n", (long long)allocated, ptr);
  if (gmem_free(ptr) != GMEM_OK || gmem_free(ptr) != GMEM_ERROR_DOUBLE_FREE) return 1;
  printf("second free: %s\n", gmem_last_error());
  return allocated == 1 << 20 ? 0 : 1;
}
