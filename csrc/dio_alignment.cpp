#include "dio_alignment.h"

#include <fcntl.h>
#include <linux/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>

namespace offload {

int dio_alignment(int fd, DioAlignment* out) {
  *out = {};
#if defined(STATX_DIOALIGN) && defined(SYS_statx)
  struct statx st = {};
  if (syscall(SYS_statx, fd, "", AT_EMPTY_PATH, STATX_DIOALIGN, &st) != 0) return -errno;
  if (st.stx_mask & STATX_DIOALIGN) {
    out->memory = st.stx_dio_mem_align;
    out->offset = st.stx_dio_offset_align;
  }
#else
  (void)fd;
#endif
  return 0;
}

}  // namespace offload
