// io_uring fixed (registered) buffers: registered lazily, unregistered before
// the memory behind them is unmapped.
#pragma once
#include <liburing.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <vector>

#include "unmap_listeners.h"

namespace offload {

/// The fixed-buffer slots of one ring. A region (a whole pool block) is
/// registered the first time an I/O inside it starts, and used for every
/// later I/O inside it. Registration pins pages and counts against
/// RLIMIT_MEMLOCK: when the kernel refuses (-ENOMEM, or a kernel without
/// sparse tables), registration stops and I/O goes on unregistered.
/// Not thread-safe: the owning engine calls it with its lock held.
class FixedBufferTable {
 public:
  FixedBufferTable(struct io_uring* ring, unsigned slots);
  /// The slot of the region holding [addr, addr + length), registering
  /// [region, region + region_length) now if needed; -1 to go unregistered.
  int slot_for(const void* region, size_t region_length, const void* addr, size_t length);
  /// Unregisters every region inside [base, base + length).
  void forget(const void* base, size_t length);
  int error() const { return error_; }  ///< the -errno that stopped registration, or 0
  size_t registered() const { return slots_by_region_.size(); }

 private:
  struct io_uring* ring_;
  int error_ = 0;
  std::map<const char*, std::pair<size_t, unsigned>> slots_by_region_;  // base -> (length, slot)
  std::vector<unsigned> free_slots_;
};

}  // namespace offload
