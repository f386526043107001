// Page-aligned memory for O_DIRECT, recycled so reads land in touched pages.
#pragma once
#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

namespace offload {

/// Faults in [block, block + length) (page aligned) now, so that later I/O into
/// it does not: with `small_pages`, first advises MADV_NOHUGEPAGE, since a
/// fresh huge page may wait on compaction (slower to fault in than 4 KiB
/// pages after the page cache was dropped). Returns 0
/// or -errno from madvise. Meant to run on a thread of its own.
int prefault(void* block, size_t length, bool small_pages);

/// Gives back to the kernel the pages wholly inside [address, address +
/// length) (MADV_DONTNEED): their contents are gone, the range stays mapped
/// and reads as zeros. For memory about to be freed by its owner, so that
/// the free has nothing left to unmap. Returns the bytes discarded, or
/// -errno from madvise (EINVAL for locked memory, which is left as it is).
int64_t discard_pages(void* address, size_t length);

/// Hands out page-aligned blocks whose size is a multiple of 4096, all backed
/// by 2 MiB pages advised MADV_HUGEPAGE: blocks of 2 MiB and more are their
/// own 2 MiB-aligned mapping, smaller ones are carved out of 2 MiB slabs (a
/// slab is unmapped once none of its blocks is live or cached). Released
/// blocks are kept (up to `idle_limit` bytes, most recent first) and handed
/// out again for a request of the same rounded size, so their pages are
/// already faulted in. Blocks pushed out of that cache are lazily freed
/// (MADV_FREE: the kernel takes their pages back only under memory pressure,
/// and until then reusing them costs no page faults), up to `lazy_limit`
/// bytes; beyond it they are unmapped. A lazily freed block is write-touched
/// page by page when handed out again, which cancels the lazy free: data the
/// device then writes into it (DMA dirties no page table entry) can never be
/// discarded. Given a huge-page limit, new blocks come first from the
/// system's reserved huge pages (MAP_HUGETLB, /proc/sys/vm/nr_hugepages), up
/// to that many bytes mapped at once: memory the kernel set aside, which
/// faults in fast even on a VM that returns freed memory to its host (where
/// never-touched memory is slow; BENCHMARKS.md). Without free reserved pages the block
/// comes from ordinary memory as above. Reserved blocks are unmapped rather
/// than lazily freed (the kernel cannot reclaim them anyway). Thread-safe.
class BufferPool {
 public:
  explicit BufferPool(size_t idle_limit, size_t lazy_limit = 0);
  ~BufferPool();
  BufferPool(const BufferPool&) = delete;
  BufferPool& operator=(const BufferPool&) = delete;

  /// The rounded size acquire(size) gives.
  static size_t capacity_for(size_t size);
  /// The mapping a block of `capacity` lies in: itself, or for a block under
  /// 2 MiB its slab (what to register with io_uring once for all its blocks).
  static std::pair<void*, size_t> region_of(void* block, size_t capacity);
  /// A block of capacity_for(size) bytes, or nullptr when memory is exhausted.
  /// `*fresh` (when given) says whether it was never used before: its pages
  /// are not faulted in yet.
  void* acquire(size_t size, bool* fresh = nullptr);
  /// Returns a block from acquire(); it is cached or freed.
  void release(void* block, size_t capacity);
  /// Makes one block of each size ready for acquire(): new ones are faulted
  /// in now (on huge pages where the system gives them), then all go to the
  /// caches as if released (beyond the idle limit: lazily freed). Returns the
  /// bytes faulted in, or -ENOMEM. For memory known to be needed soon, paid
  /// for up front (or on a thread of the caller's) rather than inside I/O.
  int64_t warm(const std::vector<size_t>& sizes);
  /// Says `count` reads of `size` bytes are expected (written tensors',
  /// whose memory the writes just freed): provision() makes a block ready
  /// for each unless the caches hold one already. An acquire of that size
  /// meets one.
  void expect(size_t size, size_t count = 1);
  /// Faults in a new block for one of the reads expect() announced that the
  /// caches cannot serve, and caches it (lazily freed; idle if under 2 MiB,
  /// since lazily freeing part of a huge page splits it): on a VM that hands
  /// freed memory back to its host a few seconds later, memory faulted in
  /// now is likely the memory just freed, still backed, and the read then
  /// lands in it at disk speed. Never pushes out other cached blocks: stops
  /// where the lazy limit (or the idle limit, the smaller) would be passed,
  /// and does nothing with a huge-page limit set (reserved pages fault in
  /// fast). Not counted in fresh_bytes() (nothing is handed out). Returns
  /// its bytes (0: nothing to do), or -ENOMEM.
  int64_t provision();
  /// Notes that the live block at `block` was faulted in on 4 KiB pages
  /// (prefault() with `small_pages`; blocks of 2 MiB and more only). This
  /// disk-facing memory splits large O_DIRECT requests on a disk with few
  /// segments a request; once the block is idle, collapse_one() can put it
  /// back on huge pages.
  void mark_small_pages(void* block);
  /// Puts one idle block marked by mark_small_pages() back on huge pages:
  /// drops its io_uring registrations (pinned pages do not move), advises
  /// MADV_HUGEPAGE and collapses it (MADV_COLLAPSE, Linux 6.1+: the kernel
  /// copies it into new huge pages). The block is out of the caches
  /// meanwhile, so no acquire gets it; it goes back as the most recently
  /// released. Returns its bytes, 0 when no idle block is marked, or -errno,
  /// the block as it was: EAGAIN (pages busy, as during a fork) leaves it
  /// marked for a later call, up to three times; other errors drop its
  /// mark, and after EINVAL (a kernel that cannot collapse) nothing more is
  /// tried. A trim() meanwhile leaves it cached. Meant for a helper thread
  /// while the pool is quiet: on a VM it costs about what faulting new
  /// huge pages costs (BENCHMARKS.md).
  int64_t collapse_one();
  /// Frees every cached block.
  void trim();
  void set_idle_limit(size_t bytes);
  void set_lazy_limit(size_t bytes);
  /// Bytes of reserved huge pages the pool may hold mapped at once (0, the
  /// default: none). Applies to blocks mapped from now on.
  void set_huge_page_limit(size_t bytes);

  /// The capacity of the live (handed out, not released) block starting at
  /// `block`, or 0 if no such block.
  size_t live_capacity(const void* block) const;
  size_t idle_bytes() const;
  size_t live_bytes() const;  ///< handed out and not yet released
  size_t hits() const;        ///< acquires served from the cache
  size_t lazy_bytes() const;  ///< lazily freed blocks kept for reuse
  size_t lazy_hits() const;   ///< acquires served from lazily freed blocks
  size_t fresh_bytes() const; ///< bytes handed out in blocks never used before
  size_t provisioned_bytes() const; ///< bytes faulted in by provision()
  size_t huge_page_bytes() const; ///< reserved huge pages mapped now (live or cached)
  size_t small_page_bytes() const; ///< blocks marked by mark_small_pages(), live or idle
  size_t small_page_idle_bytes() const; ///< of those, idle: what collapse_one() works on
  size_t collapsed_bytes() const;  ///< bytes collapse_one() put back on huge pages
  /// Calls of acquire() and release() so far: unchanged over a while means quiet.
  uint64_t activity() const;
  /// fork() handlers (registered once by this library): before it, take the
  /// lock of every pool (and the unmap listeners'); after it, in the parent
  /// and in the child, give them back.
  static void before_fork();
  static void after_fork(bool in_child);
  /// For tests: holds this pool's lock for `milliseconds`, as a thread inside
  /// one of its calls does (what a fork() meanwhile must wait out).
  void hold_lock(unsigned milliseconds);

 private:
  struct Slab {
    uint32_t in_use;  ///< blocks live or cached (not spare)
  };
  /// A block leaving the caches: lazily freed, or memory to unmap. Done by
  /// finish() once the lock is released.
  struct Retired {
    void* block;
    size_t length;    ///< bytes to unmap (a whole slab for the last block of one)
    size_t capacity;  ///< the block's
    bool lazy;        ///< MADV_FREE it and keep it, rather than unmap
  };
  /// A block from the caches, else new (`*fresh`); with `cached` false
  /// always new, and not counted as handed out (for provision()).
  void* acquire_block(size_t size, bool* fresh, bool cached = true);
  /// A new 2 MiB-aligned mapping of at least `capacity` bytes: reserved huge
  /// pages while the limit allows and the system has them, else ordinary.
  void* map_block(size_t capacity);
  /// The length a block's mapping was made with, forgetting it if it was
  /// reserved huge pages (their mapping must be unmapped whole): `capacity`
  /// for an ordinary one.
  size_t unmap_length_locked(void* block, size_t capacity);
  bool reserved_locked(void* block, size_t capacity) const;
  /// Gives back a block that is neither live nor cached any more.
  void drop_locked(void* block, size_t capacity, std::vector<Retired>* retired);
  void retire_locked(void* block, size_t capacity, bool lazy_ok, std::vector<Retired>* retired);
  void evict_locked(size_t keep, bool lazy_ok, std::vector<Retired>* retired);
  void evict_lazy_locked(size_t keep, std::vector<Retired>* retired);
  void met_locked(size_t capacity);  ///< an acquire of `capacity`: one expected read fewer
  void finish(std::vector<Retired>* retired);
  /// capacity -> blocks with the clock value at release, oldest first.
  using Cache = std::map<size_t, std::deque<std::pair<void*, uint64_t>>>;
  /// Takes the most recently released block of `capacity` from `from`, or nullptr.
  void* take_locked(Cache* from, size_t capacity);
  /// Takes the least recently released block of any size, subtracting its
  /// capacity from `*bytes`; {nullptr, 0} when empty.
  std::pair<void*, size_t> pop_oldest_locked(Cache* cache, size_t* bytes);

  mutable std::mutex mu_;
  size_t idle_limit_;
  size_t lazy_limit_;
  size_t idle_bytes_ = 0;
  size_t lazy_bytes_ = 0;
  size_t live_bytes_ = 0;
  size_t hits_ = 0;
  size_t lazy_hits_ = 0;
  size_t fresh_bytes_ = 0;
  size_t provisioned_bytes_ = 0;
  std::map<size_t, size_t> expected_;  ///< capacity -> reads expect() announced, not yet met
  size_t huge_page_limit_ = 0;
  size_t huge_page_bytes_ = 0;
  uint64_t clock_ = 0;
  Cache idle_;
  Cache lazy_;  ///< the same, MADV_FREE'd
  std::unordered_map<const void*, size_t> live_;  ///< block -> capacity
  std::map<uintptr_t, Slab> slabs_;               ///< 2 MiB slab base -> use count
  std::map<size_t, std::vector<void*>> spare_;    ///< carved, never or no longer cached
  std::unordered_map<const void*, size_t> reserved_;  ///< reserved huge-page mapping -> its length
  struct SmallPages {
    size_t capacity;
    unsigned busy = 0;  ///< collapses refused with EAGAIN so far (retried up to kCollapseTries)
  };
  std::unordered_map<const void*, SmallPages> small_pages_;  ///< blocks mark_small_pages() marked
  size_t collapsed_bytes_ = 0;
  uint64_t activity_ = 0;
  bool collapse_refused_ = false;  ///< MADV_COLLAPSE gave EINVAL: not on this kernel
};

}  // namespace offload
