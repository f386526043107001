// Page-aligned memory for O_DIRECT, recycled so reads land in touched pages.
#pragma once
#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace offload {

/// Faults in [block, block + length) (page aligned) now, so that later I/O into
/// it does not: with `small_pages`, first advises MADV_NOHUGEPAGE, since a
/// fresh huge page may wait on compaction (0.4-0.7 GB/s measured here after
/// the page cache was dropped, against 3.3 GB/s for 4 KiB pages). Returns 0
/// or -errno from madvise. Meant to run on a thread of its own.
int prefault(void* block, size_t length, bool small_pages);

/// Hands out page-aligned blocks whose size is a multiple of 4096, all backed
/// by 2 MiB pages advised MADV_HUGEPAGE: blocks of 2 MiB and more are their
/// own 2 MiB-aligned mapping, smaller ones are carved out of 2 MiB slabs (a
/// slab is unmapped once none of its blocks is live or cached). Released
/// blocks are kept (up to `idle_limit` bytes, most recent first) and handed
/// out again for a request of the same rounded size, so their pages are
/// already faulted in. Thread-safe.
class BufferPool {
 public:
  explicit BufferPool(size_t idle_limit) : idle_limit_(idle_limit) {}
  ~BufferPool();
  BufferPool(const BufferPool&) = delete;
  BufferPool& operator=(const BufferPool&) = delete;

  /// The rounded size acquire(size) gives.
  static size_t capacity_for(size_t size);
  /// A block of capacity_for(size) bytes, or nullptr when memory is exhausted.
  void* acquire(size_t size);
  /// Returns a block from acquire(); it is cached or freed.
  void release(void* block, size_t capacity);
  /// Frees every cached block.
  void trim();
  void set_idle_limit(size_t bytes);

  /// The capacity of the live (handed out, not released) block starting at
  /// `block`, or 0 if no such block.
  size_t live_capacity(const void* block) const;
  size_t idle_bytes() const;
  size_t live_bytes() const;  ///< handed out and not yet released
  size_t hits() const;        ///< acquires served from the cache

 private:
  struct Slab {
    uint32_t in_use;  ///< blocks live or cached (not spare)
  };
  void* acquire_block(size_t size);
  static void* map_block(size_t capacity);
  /// Frees a block that is neither live nor cached any more.
  void drop_locked(void* block, size_t capacity);
  void evict_locked(size_t keep);

  mutable std::mutex mu_;
  size_t idle_limit_;
  size_t idle_bytes_ = 0;
  size_t live_bytes_ = 0;
  size_t hits_ = 0;
  uint64_t clock_ = 0;
  // capacity -> blocks with the clock value at release, oldest first: the oldest
  // idle block overall is the front of one of these (a handful of size classes),
  // so eviction does not scan every idle block.
  std::map<size_t, std::deque<std::pair<void*, uint64_t>>> idle_;
  std::unordered_map<const void*, size_t> live_;  ///< block -> capacity
  std::map<uintptr_t, Slab> slabs_;               ///< 2 MiB slab base -> use count
  std::map<size_t, std::vector<void*>> spare_;    ///< carved, never or no longer cached
};

}  // namespace offload
