// Page-aligned memory for O_DIRECT, recycled so reads land in touched pages.
#pragma once
#include <cstddef>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

namespace offload {

/// Hands out page-aligned blocks (mmap) whose size is a multiple of 4096;
/// blocks of 2 MiB and more are 2 MiB aligned and advised MADV_HUGEPAGE. Released
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

  size_t idle_bytes() const;
  size_t live_bytes() const;  ///< handed out and not yet released
  size_t hits() const;        ///< acquires served from the cache

 private:
  static void* map_block(size_t capacity);
  static void unmap_block(void* block, size_t capacity);
  void evict_locked(size_t keep);

  mutable std::mutex mu_;
  size_t idle_limit_;
  size_t idle_bytes_ = 0;
  size_t live_bytes_ = 0;
  size_t hits_ = 0;
  uint64_t clock_ = 0;
  // capacity -> blocks, each with the clock value at release (for eviction).
  std::map<size_t, std::vector<std::pair<void*, uint64_t>>> idle_;
};

}  // namespace offload
