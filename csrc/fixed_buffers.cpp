#include "fixed_buffers.h"

#include <sys/uio.h>

#include <algorithm>
#include <cerrno>

namespace offload {

FixedBufferTable::FixedBufferTable(struct io_uring* ring, unsigned slots) : ring_(ring) {
  int rc = io_uring_register_buffers_sparse(ring_, slots);
  if (rc < 0) {
    error_ = rc;
    return;
  }
  for (unsigned i = slots; i-- > 0;) free_slots_.push_back(i);
}

int FixedBufferTable::slot_for(const void* region, size_t region_length, const void* addr,
                               size_t length) {
  const char* base = static_cast<const char*>(region);
  const char* p = static_cast<const char*>(addr);
  if (p < base || p + length > base + region_length) return -1;
  auto it = slots_by_region_.find(base);
  if (it != slots_by_region_.end()) return it->second.first >= region_length ? static_cast<int>(it->second.second) : -1;
  // The kernel takes at most 1 GiB per fixed buffer (-EFAULT beyond): larger
  // blocks simply go unregistered.
  if (error_ != 0 || free_slots_.empty() || region_length > (size_t{1} << 30)) return -1;
  unsigned slot = free_slots_.back();
  struct iovec iov = {const_cast<char*>(base), region_length};
  __u64 tag = 0;
  int rc = io_uring_register_buffers_update_tag(ring_, slot, &iov, &tag, 1);
  if (rc < 0) {
    // -ENOMEM is RLIMIT_MEMLOCK: stop trying. Anything else concerns this
    // region only. Either way the I/O goes on unregistered.
    if (rc == -ENOMEM) error_ = rc;
    return -1;
  }
  free_slots_.pop_back();
  slots_by_region_[base] = {region_length, slot};
  return static_cast<int>(slot);
}

void FixedBufferTable::forget(const void* base, size_t length) {
  const char* begin = static_cast<const char*>(base);
  const char* end = begin + length;
  for (auto it = slots_by_region_.lower_bound(begin); it != slots_by_region_.end() && it->first < end;) {
    struct iovec empty = {nullptr, 0};
    __u64 tag = 0;
    io_uring_register_buffers_update_tag(ring_, it->second.second, &empty, &tag, 1);
    free_slots_.push_back(it->second.second);
    it = slots_by_region_.erase(it);
  }
}

}  // namespace offload
