#include "buffer_pool.h"

#include "unmap_listeners.h"

#include <pthread.h>
#include <sys/mman.h>

#include <cerrno>

#include <algorithm>
#include <chrono>
#include <thread>

namespace offload {
namespace {
constexpr size_t kPage = 4096;
constexpr size_t kHugePage = size_t{2} << 20;
constexpr unsigned kCollapseTries = 3;  // a block's MADV_COLLAPSE refused with EAGAIN this often: left as it is
#ifndef MADV_COLLAPSE
constexpr int MADV_COLLAPSE = 25;  // Linux 6.1; glibc before 2.37 does not name it (an older kernel: EINVAL)
#endif
}  // namespace

int prefault(void* block, size_t length, bool small_pages) {
  // A hugetlb mapping refuses the advice (EINVAL) unless the range is whole
  // huge pages: its page size is fixed anyway, so it is faulted in as it is.
  if (small_pages && madvise(block, length, MADV_NOHUGEPAGE) != 0 && errno != EINVAL) return -errno;
#ifdef MADV_POPULATE_WRITE
  if (madvise(block, length, MADV_POPULATE_WRITE) == 0) return 0;  // Linux 5.14+: one call
#endif
  volatile char* p = static_cast<volatile char*>(block);
  for (size_t i = 0; i < length; i += kPage) p[i] = p[i];  // a write fault per page; keeps contents
  return 0;
}

int64_t discard_pages(void* address, size_t length) {
  uintptr_t start = (reinterpret_cast<uintptr_t>(address) + kPage - 1) & ~(kPage - 1);
  uintptr_t end = (reinterpret_cast<uintptr_t>(address) + length) & ~(kPage - 1);
  if (end <= start) return 0;
  if (madvise(reinterpret_cast<void*>(start), end - start, MADV_DONTNEED) != 0) return -errno;
  return static_cast<int64_t>(end - start);
}

namespace {
std::mutex pools_mu;  // guards pools()
std::vector<BufferPool*>& pools() {
  static std::vector<BufferPool*> all;
  return all;
}
}  // namespace

BufferPool::BufferPool(size_t idle_limit, size_t lazy_limit) : idle_limit_(idle_limit), lazy_limit_(lazy_limit) {
  std::lock_guard<std::mutex> lock(pools_mu);
  pools().push_back(this);
}

BufferPool::~BufferPool() {
  trim();
  std::lock_guard<std::mutex> lock(pools_mu);
  auto& all = pools();
  all.erase(std::remove(all.begin(), all.end(), this), all.end());
}

// fork() copies memory, not threads: a lock another thread holds at that
// moment stays taken in the child for good, and the child's first use of
// the pool (a new Offloader, a checkpoint load) would hang. So fork() waits
// until it can take every lock the pool uses, in the order calls take them
// (the unmap listeners' before any pool's: a listener takes an engine's
// lock, and an engine calls the pool with its own held), and gives them
// back on both sides.
void BufferPool::before_fork() {
  lock_listeners_for_fork();
  pools_mu.lock();
  for (BufferPool* pool : pools()) pool->mu_.lock();
}

void BufferPool::after_fork(bool in_child) {
  for (BufferPool* pool : pools()) pool->mu_.unlock();
  pools_mu.unlock();
  unlock_listeners_after_fork(in_child);
}

namespace {
struct ForkHandlers {
  ForkHandlers() {
    pthread_atfork(BufferPool::before_fork, [] { BufferPool::after_fork(false); },
                   [] { BufferPool::after_fork(true); });
  }
} fork_handlers;
}  // namespace

void BufferPool::hold_lock(unsigned milliseconds) {
  std::lock_guard<std::mutex> lock(mu_);
  std::this_thread::sleep_for(std::chrono::milliseconds(milliseconds));
}

size_t BufferPool::capacity_for(size_t size) {
  if (size == 0) size = 1;
  return (size + kPage - 1) / kPage * kPage;
}

std::pair<void*, size_t> BufferPool::region_of(void* block, size_t capacity) {
  if (capacity >= kHugePage) return {block, capacity};
  return {reinterpret_cast<void*>(reinterpret_cast<uintptr_t>(block) & ~(kHugePage - 1)), kHugePage};
}

void* BufferPool::map_block(size_t capacity) {
  size_t length = (capacity + kHugePage - 1) / kHugePage * kHugePage;
  bool try_reserved = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (huge_page_bytes_ + length <= huge_page_limit_) {
      huge_page_bytes_ += length;  // claimed now, so concurrent maps stay within the limit
      try_reserved = true;
    }
  }
  if (try_reserved) {
    // A private hugetlb mapping takes its pages from the reserved pool at
    // mmap time (ENOMEM here, never SIGBUS later) and is 2 MiB aligned.
    void* p = mmap(nullptr, length, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_HUGETLB, -1, 0);
    std::lock_guard<std::mutex> lock(mu_);
    if (p != MAP_FAILED) {
      reserved_[p] = length;
      return p;
    }
    huge_page_bytes_ -= length;
  }
  // 2 MiB aligned and advised MADV_HUGEPAGE: O_DIRECT into huge-page
  // buffers gives the device physically contiguous segments, so a disk with
  // few segments a request does not split it (BENCHMARKS.md, decisions). The
  // price is a slower first touch, paid once per block, since blocks are
  // recycled. Over-map, then trim to an aligned window.
  size_t span = capacity + kHugePage;
  void* raw = mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED) return nullptr;
  uintptr_t start = reinterpret_cast<uintptr_t>(raw);
  uintptr_t aligned = (start + kHugePage - 1) & ~(kHugePage - 1);
  if (aligned > start) munmap(raw, aligned - start);
  uintptr_t end = start + span, aligned_end = aligned + capacity;
  if (end > aligned_end) munmap(reinterpret_cast<void*>(aligned_end), end - aligned_end);
  void* p = reinterpret_cast<void*>(aligned);
  madvise(p, capacity, MADV_HUGEPAGE);  // advisory: without THP it changes nothing
  return p;
}

size_t BufferPool::unmap_length_locked(void* block, size_t capacity) {
  auto it = reserved_.find(block);
  if (it == reserved_.end()) return capacity;
  size_t length = it->second;
  huge_page_bytes_ -= length;
  reserved_.erase(it);
  return length;
}

bool BufferPool::reserved_locked(void* block, size_t capacity) const {
  return reserved_.count(region_of(block, capacity).first) != 0;
}

void BufferPool::drop_locked(void* block, size_t capacity, std::vector<Retired>* retired) {
  if (capacity >= kHugePage) {
    auto small = small_pages_.find(block);
    if (small != small_pages_.end()) small_pages_.erase(small);  // unmapped: the address may come back
    retired->push_back({block, unmap_length_locked(block, capacity), capacity, false});
    return;
  }
  uintptr_t base = reinterpret_cast<uintptr_t>(block) & ~(kHugePage - 1);
  auto slab = slabs_.find(base);
  std::vector<void*>& spare = spare_[capacity];
  spare.push_back(block);
  if (--slab->second.in_use > 0) return;
  // Every block of the slab is spare: give the whole slab back.
  uintptr_t end = base + kHugePage;
  spare.erase(std::remove_if(spare.begin(), spare.end(),
                             [&](void* p) {
                               auto a = reinterpret_cast<uintptr_t>(p);
                               return a >= base && a < end;
                             }),
              spare.end());
  if (spare.empty()) spare_.erase(capacity);
  slabs_.erase(slab);
  void* slab_block = reinterpret_cast<void*>(base);
  retired->push_back({slab_block, unmap_length_locked(slab_block, kHugePage), kHugePage, false});
}

void BufferPool::finish(std::vector<Retired>* retired) {
  // Outside the lock: listeners (io_uring engines) take their own locks, and
  // an engine may call the pool with its lock held.
  while (!retired->empty()) {
    Retired r = retired->back();
    retired->pop_back();
    auto [region, region_length] = region_of(r.block, r.capacity);
    if (!r.lazy) {
      notify_before_unmap(r.block, r.length);  // io_uring registrations must not outlive it
      munmap(r.block, r.length);
      continue;
    }
    // A registration pins the pages, and pinned pages are never reclaimed.
    notify_before_unmap(region, region_length);
    bool freed = madvise(r.block, r.capacity, MADV_FREE) == 0;  // Linux 4.5+
    std::lock_guard<std::mutex> lock(mu_);
    if (!freed) {
      drop_locked(r.block, r.capacity, retired);
      continue;
    }
    lazy_[r.capacity].emplace_back(r.block, ++clock_);
    lazy_bytes_ += r.capacity;
    evict_lazy_locked(lazy_limit_, retired);
  }
}

void* BufferPool::take_locked(Cache* from, size_t capacity) {
  auto it = from->find(capacity);
  if (it == from->end() || it->second.empty()) return nullptr;
  void* p = it->second.back().first;
  it->second.pop_back();
  if (it->second.empty()) from->erase(it);
  return p;
}

void* BufferPool::acquire_block(size_t size, bool* fresh, bool cached) {
  size_t capacity = capacity_for(size);
  size_t handed_out = cached ? capacity : 0;  // provision() hands nothing out
  *fresh = false;
  void* lazy = nullptr;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (cached) met_locked(capacity);
    if (void* p = cached ? take_locked(&idle_, capacity) : nullptr) {
      idle_bytes_ -= capacity;
      live_bytes_ += capacity;
      ++hits_;
      return p;
    }
    lazy = cached ? take_locked(&lazy_, capacity) : nullptr;
    if (lazy != nullptr) {
      lazy_bytes_ -= capacity;
      live_bytes_ += capacity;
      ++lazy_hits_;
    } else {
      auto spare = spare_.find(capacity);
      if (spare != spare_.end() && !spare->second.empty()) {
        void* p = spare->second.back();
        spare->second.pop_back();
        ++slabs_[reinterpret_cast<uintptr_t>(p) & ~(kHugePage - 1)].in_use;
        live_bytes_ += handed_out;
        fresh_bytes_ += handed_out;
        *fresh = true;
        return p;
      }
    }
  }
  if (lazy != nullptr) {
    // A write to each page cancels MADV_FREE for it (a page already taken
    // back faults in zeroed). Without it, data DMA'd into a clean page could
    // be dropped by the kernel later.
    volatile char* p = static_cast<volatile char*>(lazy);
    for (size_t i = 0; i < capacity; i += kPage) p[i] = p[i];
    return lazy;
  }
  *fresh = true;
  if (capacity >= kHugePage) {
    void* p = map_block(capacity);
    if (p != nullptr) {
      std::lock_guard<std::mutex> lock(mu_);
      live_bytes_ += handed_out;
      fresh_bytes_ += handed_out;
    }
    return p;
  }
  // Small blocks are carved out of a 2 MiB huge-page slab, so each is
  // physically contiguous, as above.
  char* slab = static_cast<char*>(map_block(kHugePage));
  if (slab == nullptr) return nullptr;
  std::lock_guard<std::mutex> lock(mu_);
  uint32_t blocks = static_cast<uint32_t>(kHugePage / capacity);
  slabs_[reinterpret_cast<uintptr_t>(slab)] = Slab{1};
  std::vector<void*>& spare = spare_[capacity];
  for (uint32_t i = blocks; i-- > 1;) spare.push_back(slab + i * capacity);
  live_bytes_ += handed_out;
  fresh_bytes_ += handed_out;
  return slab;
}

void* BufferPool::acquire(size_t size, bool* fresh) {
  bool is_fresh = false;
  void* block = acquire_block(size, &is_fresh);
  if (fresh != nullptr) *fresh = is_fresh;
  std::lock_guard<std::mutex> lock(mu_);
  ++activity_;
  if (block != nullptr) live_[block] = capacity_for(size);
  return block;
}

void BufferPool::mark_small_pages(void* block) {
  std::lock_guard<std::mutex> lock(mu_);
  auto live = live_.find(block);
  if (collapse_refused_ || live == live_.end() || live->second < kHugePage || reserved_locked(block, live->second))
    return;
  small_pages_.emplace(block, SmallPages{live->second});
}

int64_t BufferPool::collapse_one() {
  void* block = nullptr;
  size_t capacity = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (collapse_refused_ || small_pages_.empty()) return 0;
    for (auto it = idle_.lower_bound(kHugePage); it != idle_.end(); ++it) {
      auto& blocks = it->second;
      auto marked = std::find_if(blocks.begin(), blocks.end(), [&](auto& b) { return small_pages_.count(b.first); });
      if (marked == blocks.end()) continue;
      block = marked->first;
      capacity = it->first;
      blocks.erase(marked);
      if (blocks.empty()) idle_.erase(it);
      break;
    }
    if (block == nullptr) return 0;
    idle_bytes_ -= capacity;  // out of every cache, and not live: nobody else sees it now
  }
  notify_before_unmap(block, capacity);  // registrations pin the pages, which then cannot move
  int rc = 0;
  if (madvise(block, capacity, MADV_HUGEPAGE) != 0 || madvise(block, capacity, MADV_COLLAPSE) != 0) rc = -errno;
  std::vector<Retired> retired;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto mark = small_pages_.find(block);
    if (rc == -EAGAIN && mark != small_pages_.end() && ++mark->second.busy < kCollapseTries) {
      // busy for now (a fork copying the page tables, say): tried again later
    } else if (mark != small_pages_.end()) {  // collapsed, or left as it is for good
      small_pages_.erase(mark);
    }
    if (rc == -EINVAL) {  // this kernel cannot: forget every mark
      collapse_refused_ = true;
      small_pages_.clear();
    }
    if (rc == 0) collapsed_bytes_ += capacity;
    idle_[capacity].emplace_back(block, ++clock_);
    idle_bytes_ += capacity;
    evict_locked(idle_limit_, true, &retired);  // the limit may have changed meanwhile
  }
  finish(&retired);
  return rc < 0 ? rc : static_cast<int64_t>(capacity);
}

size_t BufferPool::live_capacity(const void* block) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = live_.find(block);
  return it == live_.end() ? 0 : it->second;
}

int64_t BufferPool::warm(const std::vector<size_t>& sizes) {
  std::vector<std::pair<void*, size_t>> blocks;
  int64_t faulted = 0;
  int rc = 0;
  for (size_t size : sizes) {
    bool fresh = false;
    void* block = acquire(size, &fresh);
    if (block == nullptr) {
      rc = -ENOMEM;
      break;
    }
    size_t capacity = capacity_for(size);
    blocks.emplace_back(block, capacity);
    if (fresh) {
      prefault(block, capacity, false);  // advice only fails on a kernel without it: then touched anyway
      faulted += static_cast<int64_t>(capacity);
    }
  }
  for (auto& [block, capacity] : blocks) release(block, capacity);
  return rc < 0 ? rc : faulted;
}

void BufferPool::expect(size_t size, size_t count) {
  if (count == 0) return;
  std::lock_guard<std::mutex> lock(mu_);
  expected_[capacity_for(size)] += count;
}

void BufferPool::met_locked(size_t capacity) {
  auto it = expected_.find(capacity);
  if (it != expected_.end() && --it->second == 0) expected_.erase(it);
}

int64_t BufferPool::provision() {
  size_t capacity = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (huge_page_limit_ > 0) return 0;
    size_t limit = std::min(lazy_limit_, idle_limit_);
    for (auto& [wanted, reads] : expected_) {
      auto idle = idle_.find(wanted);
      auto lazy = lazy_.find(wanted);
      size_t cached = (idle == idle_.end() ? 0 : idle->second.size()) + (lazy == lazy_.end() ? 0 : lazy->second.size());
      // Blocks under 2 MiB share a huge page with others: lazily freeing one
      // would split it, and reads into split pages ran at half speed. They
      // wait in the idle cache instead.
      bool room = wanted < kHugePage ? limit > 0 && idle_bytes_ + wanted <= idle_limit_
                                     : lazy_bytes_ + wanted <= limit;
      if (cached < reads && room) {
        capacity = wanted;
        break;
      }
    }
  }
  if (capacity == 0) return 0;
  bool fresh = false;
  void* block = acquire_block(capacity, &fresh, false);
  if (block == nullptr) return -ENOMEM;
  // A huge page at a time: the advice holds the process's mmap lock while
  // it faults, and a write beside it (torch unmapping a written tensor's
  // memory) waits for that lock. Whole 64 MiB blocks at once cut first
  // writes by a third on this VM; 2 MiB steps left them unchanged.
  for (size_t at = 0; at < capacity; at += kHugePage)
    prefault(static_cast<char*>(block) + at, std::min(kHugePage, capacity - at), false);
  std::vector<Retired> retired;
  {
    std::lock_guard<std::mutex> lock(mu_);
    provisioned_bytes_ += capacity;
    if (capacity < kHugePage) {
      idle_[capacity].emplace_back(block, ++clock_);
      idle_bytes_ += capacity;
    } else {
      retire_locked(block, capacity, true, &retired);
    }
  }
  finish(&retired);
  return static_cast<int64_t>(capacity);
}

void BufferPool::release(void* block, size_t capacity) {
  std::vector<Retired> retired;
  {
    std::lock_guard<std::mutex> lock(mu_);
    live_.erase(block);
    live_bytes_ -= capacity;
    ++activity_;
    if (capacity > idle_limit_) {
      retire_locked(block, capacity, true, &retired);
    } else {
      idle_[capacity].emplace_back(block, ++clock_);
      idle_bytes_ += capacity;
      evict_locked(idle_limit_, true, &retired);
    }
  }
  finish(&retired);
}

void BufferPool::retire_locked(void* block, size_t capacity, bool lazy_ok, std::vector<Retired>* retired) {
  // Reserved huge pages are never reclaimed by the kernel: unmapping gives
  // them back to the reserved pool, where the next mapping finds them.
  if (lazy_ok && capacity <= lazy_limit_ && !reserved_locked(block, capacity)) {
    retired->push_back({block, capacity, capacity, true});  // lazily freed by finish()
  } else {
    drop_locked(block, capacity, retired);
  }
}

std::pair<void*, size_t> BufferPool::pop_oldest_locked(Cache* cache, size_t* bytes) {
  // The oldest block is the front of one size class's deque (a handful of
  // classes), so eviction does not scan every block.
  auto oldest = cache->end();
  uint64_t best = UINT64_MAX;
  for (auto it = cache->begin(); it != cache->end(); ++it) {
    if (it->second.front().second < best) best = it->second.front().second, oldest = it;
  }
  if (oldest == cache->end()) return {nullptr, 0};
  void* block = oldest->second.front().first;
  size_t capacity = oldest->first;
  oldest->second.pop_front();
  if (oldest->second.empty()) cache->erase(oldest);
  *bytes -= capacity;
  return {block, capacity};
}

void BufferPool::evict_locked(size_t keep, bool lazy_ok, std::vector<Retired>* retired) {
  // Evict the least recently released blocks until the cache fits.
  while (idle_bytes_ > keep) {
    auto [block, capacity] = pop_oldest_locked(&idle_, &idle_bytes_);
    if (block == nullptr) break;
    retire_locked(block, capacity, lazy_ok, retired);
  }
}

void BufferPool::evict_lazy_locked(size_t keep, std::vector<Retired>* retired) {
  while (lazy_bytes_ > keep) {
    auto [block, capacity] = pop_oldest_locked(&lazy_, &lazy_bytes_);
    if (block == nullptr) break;
    drop_locked(block, capacity, retired);
  }
}

void BufferPool::trim() {
  std::vector<Retired> retired;
  {
    std::lock_guard<std::mutex> lock(mu_);
    evict_locked(0, false, &retired);
    evict_lazy_locked(0, &retired);
  }
  finish(&retired);
}

void BufferPool::set_idle_limit(size_t bytes) {
  std::vector<Retired> retired;
  {
    std::lock_guard<std::mutex> lock(mu_);
    idle_limit_ = bytes;
    evict_locked(idle_limit_, true, &retired);
  }
  finish(&retired);
}

void BufferPool::set_lazy_limit(size_t bytes) {
  std::vector<Retired> retired;
  {
    std::lock_guard<std::mutex> lock(mu_);
    lazy_limit_ = bytes;
    evict_lazy_locked(lazy_limit_, &retired);
  }
  finish(&retired);
}

size_t BufferPool::idle_bytes() const { std::lock_guard<std::mutex> l(mu_); return idle_bytes_; }
size_t BufferPool::live_bytes() const { std::lock_guard<std::mutex> l(mu_); return live_bytes_; }
size_t BufferPool::hits() const { std::lock_guard<std::mutex> l(mu_); return hits_; }
size_t BufferPool::lazy_bytes() const { std::lock_guard<std::mutex> l(mu_); return lazy_bytes_; }
size_t BufferPool::lazy_hits() const { std::lock_guard<std::mutex> l(mu_); return lazy_hits_; }
size_t BufferPool::huge_page_bytes() const { std::lock_guard<std::mutex> l(mu_); return huge_page_bytes_; }

void BufferPool::set_huge_page_limit(size_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  huge_page_limit_ = bytes;
}

size_t BufferPool::small_page_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  size_t bytes = 0;
  for (auto& [block, mark] : small_pages_) bytes += mark.capacity;
  return bytes;
}
size_t BufferPool::collapsed_bytes() const { std::lock_guard<std::mutex> l(mu_); return collapsed_bytes_; }
uint64_t BufferPool::activity() const { std::lock_guard<std::mutex> l(mu_); return activity_; }

size_t BufferPool::small_page_idle_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  size_t bytes = 0;
  for (auto it = idle_.lower_bound(kHugePage); it != idle_.end(); ++it)
    for (auto& [block, clock] : it->second) bytes += small_pages_.count(block) ? it->first : 0;
  return bytes;
}

size_t BufferPool::fresh_bytes() const { std::lock_guard<std::mutex> l(mu_); return fresh_bytes_; }
size_t BufferPool::provisioned_bytes() const { std::lock_guard<std::mutex> l(mu_); return provisioned_bytes_; }

}  // namespace offload
