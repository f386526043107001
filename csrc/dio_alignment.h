// What O_DIRECT demands of a file.
#pragma once

namespace offload {

struct DioAlignment {
  unsigned memory = 0;  ///< buffer address alignment, 0 when unknown
  unsigned offset = 0;  ///< file offset and length alignment, 0 when unknown
};

/// The file's O_DIRECT alignment from statx(STATX_DIOALIGN) (Linux 6.1+ and
/// file systems that report it). Returns 0 or -errno; {0, 0} when the kernel
/// or file system does not say, in which case 4096 is the safe choice.
int dio_alignment(int fd, DioAlignment* out);

}  // namespace offload
