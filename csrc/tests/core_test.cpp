// Tests of the torch-free core on its own: the buffer pool, staged writes
// through each engine, and the locking between engines and the pool. Built
// and run with sanitizers by tests/test_core_cpp.py:
//
//   core_test DIR   (a directory on the file system to test; exits 0 when every check holds)
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "../buffer_pool.h"
#include "../device_copy.h"
#include "../engine.h"
#include "../thread_engine.h"
#ifdef OFFLOAD_HAVE_URING
#include "../fixed_buffers.h"
#include "../uring_engine.h"
#endif

using namespace offload;

namespace {
int failures = 0;

#define CHECK(cond)                                                         \
  do {                                                                      \
    if (!(cond)) {                                                          \
      std::fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
      ++failures;                                                           \
    }                                                                       \
  } while (0)

constexpr size_t kMiB = size_t{1} << 20;

/// Every completion of `engine`, waiting until `count` have arrived.
std::vector<IoCompletion> wait_for(Engine& engine, size_t count) {
  std::vector<IoCompletion> done;
  while (done.size() < count) {
    engine.reap(&done);
    if (done.size() < count) engine.wait(100);
  }
  return done;
}

void pool_keeps_lazily_frees_and_trims() {
  BufferPool pool(4 * kMiB, 8 * kMiB);
  std::vector<void*> blocks;
  for (int i = 0; i < 4; ++i) {
    blocks.push_back(pool.acquire(4 * kMiB));
    CHECK(blocks.back() != nullptr);
    std::memset(blocks.back(), i, 4 * kMiB);
  }
  CHECK(pool.live_bytes() == 16 * kMiB && pool.fresh_bytes() == 16 * kMiB);
  for (void* b : blocks) pool.release(b, 4 * kMiB);
  // One kept as it is, two lazily freed, the oldest unmapped past the lazy limit.
  CHECK(pool.idle_bytes() == 4 * kMiB);
  CHECK(pool.lazy_bytes() == 8 * kMiB);
  void* again = pool.acquire(4 * kMiB);
  CHECK(again == blocks[3] && pool.hits() == 1);
  void* lazy = pool.acquire(4 * kMiB);
  CHECK(lazy == blocks[2] && pool.lazy_hits() == 1);
  CHECK(pool.fresh_bytes() == 16 * kMiB);  // both reused, nothing new
  std::memset(lazy, 9, 4 * kMiB);  // usable memory
  pool.release(again, 4 * kMiB);
  pool.release(lazy, 4 * kMiB);
  pool.trim();
  CHECK(pool.idle_bytes() == 0 && pool.lazy_bytes() == 0 && pool.live_bytes() == 0);

  // Small blocks share 2 MiB slabs; the region to register is the slab.
  void* small = pool.acquire(64 << 10);
  auto [region, length] = BufferPool::region_of(small, 64 << 10);
  CHECK(length == 2 * kMiB && reinterpret_cast<uintptr_t>(region) % (2 * kMiB) == 0);
  CHECK(static_cast<char*>(small) >= static_cast<char*>(region));
  pool.release(small, 64 << 10);
}

/// Collapses racing acquires and releases of the same size: a block being
/// collapsed is in no cache, so nobody gets it twice, and every block keeps
/// the bytes written into it while it was live.
void collapse_races_acquire_and_release() {
  BufferPool pool(64 * kMiB, 0);
  std::atomic<bool> stop{false};
  std::atomic<int> collapsed{0};
  std::thread collapser([&] {
    while (!stop.load()) {
      if (pool.collapse_one() > 0) collapsed.fetch_add(1);
    }
  });
  for (int round = 0; round < 40; ++round) {
    std::vector<void*> blocks;
    for (int i = 0; i < 4; ++i) {
      void* b = pool.acquire(4 * kMiB);
      CHECK(b != nullptr);
      if (b == nullptr) continue;
      prefault(b, 4 * kMiB, true);
      std::memset(b, round * 4 + i, 4 * kMiB);
      pool.mark_small_pages(b);
      blocks.push_back(b);
    }
    for (size_t i = 0; i < blocks.size(); ++i) {
      auto* p = static_cast<unsigned char*>(blocks[i]);
      CHECK(p[0] == static_cast<unsigned char>(round * 4 + i) && p[4 * kMiB - 1] == p[0]);
      pool.release(blocks[i], 4 * kMiB);
    }
  }
  stop.store(true);
  collapser.join();
  while (pool.collapse_one() > 0) collapsed.fetch_add(1);
  CHECK(pool.small_page_idle_bytes() == 0 && pool.live_bytes() == 0);
  // Collapsed where the kernel can (Linux 6.1+), else every mark dropped.
  CHECK(pool.collapsed_bytes() == collapsed.load() * 4 * kMiB);
  std::printf("collapse: %d blocks collapsed\n", collapsed.load());
  pool.trim();
}

/// copy_for_device copies exactly its bytes, whatever the alignment of
/// either end and the length (below, at and past where it streams, a line
/// more or less), and touches nothing around the destination.
void device_copy_is_exact() {
  const size_t lengths[] = {0, 1, 63, 64, 4095, 4096, 4097, 4096 + 64 + 13, kMiB + 5};
  std::vector<unsigned char> src(kMiB + 128);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<unsigned char>(i * 131 + 7);
  bool exact = true;
  for (size_t n : lengths) {
    const size_t step = n > 8192 ? 13 : 3;  // every alignment mod 64 is reached either way
    std::vector<unsigned char> dst(n + 256), guard(n + 256, 0xA5);
    for (size_t to = 0; to < 64; to += step) {
      for (size_t from = 0; from < 64; from += step) {
        std::memset(dst.data(), 0xA5, dst.size());
        unsigned char* out = dst.data() + 64 + to;
        copy_for_device(out, src.data() + from, n);
        bool ok = std::memcmp(out, src.data() + from, n) == 0 &&
                  std::memcmp(dst.data(), guard.data(), 64 + to) == 0 &&
                  std::memcmp(out + n, guard.data(), dst.size() - 64 - to - n) == 0;
        if (!ok) std::fprintf(stderr, "copy_for_device: %zu bytes, to +%zu, from +%zu\n", n, to, from);
        exact = exact && ok;
      }
    }
  }
  CHECK(exact);
}

/// Writes `total` bytes from unaligned memory with engine-staged requests,
/// reads them back into pool blocks, and compares.
void staged_write_round_trip(Engine& engine, const std::shared_ptr<BufferPool>& pool, int fd) {
  const size_t total = 24 * kMiB + 12345;
  std::vector<char> source(total + 3);
  char* unaligned = source.data() + 3;  // not page aligned, as torch's memory is not
  for (size_t i = 0; i < total; ++i) unaligned[i] = static_cast<char>(i * 7 + 1);
  const size_t padded = (total + 4095) / 4096 * 4096;

  IoRequest bad{1, IoKind::kWrite, fd, nullptr, padded, 0, unaligned, total};
  CHECK(engine.submit(&bad, 1) == -EINVAL);  // no staging pool yet
  engine.set_staging_pool(pool, true);

  IoRequest write{2, IoKind::kWrite, fd, nullptr, padded, 0, unaligned, total};
  CHECK(engine.submit(&write, 1) == 0);
  auto done = wait_for(engine, 1);
  CHECK(done.size() == 1 && done[0].tag == 2 && done[0].result == static_cast<int64_t>(padded));
  CHECK(engine.staged_bytes() == total);
  // Staging blocks are back in the pool: nothing stays live.
  CHECK(pool->live_bytes() == 0);

  void* block = pool->acquire(padded);
  IoRequest read{3, IoKind::kRead, fd, block, padded, 0};
  CHECK(engine.submit(&read, 1) == 0);
  done = wait_for(engine, 1);
  CHECK(done.size() == 1 && done[0].result == static_cast<int64_t>(padded));
  CHECK(std::memcmp(block, unaligned, total) == 0);
  bool zero_tail = true;
  for (size_t i = total; i < padded; ++i) zero_tail = zero_tail && static_cast<char*>(block)[i] == 0;
  CHECK(zero_tail);
  pool->release(block, BufferPool::capacity_for(padded));
}

/// An engine hands staging blocks back to the pool while another thread
/// makes the pool evict (which calls every io_uring engine's unmap
/// listener): neither may wait on the other's lock while holding its own.
void staging_and_eviction_never_deadlock(Engine& engine, const std::shared_ptr<BufferPool>& pool, int fd) {
  std::atomic<bool> stop{false};
  std::thread churn([&] {
    while (!stop.load()) {
      void* b = pool->acquire(4 * kMiB);
      if (b != nullptr) pool->release(b, 4 * kMiB);
      pool->set_idle_limit(0);  // every release unmaps or lazily frees: notifies the engines
      pool->set_idle_limit(8 * kMiB);
    }
  });
  std::vector<char> source(8 * kMiB + 100, 'x');
  for (int round = 0; round < 40; ++round) {
    IoRequest write{static_cast<uint64_t>(100 + round), IoKind::kWrite, fd, nullptr, 8 * kMiB, 0,
                    source.data() + 100, 8 * kMiB};
    CHECK(engine.submit(&write, 1) == 0);
    auto done = wait_for(engine, 1);
    CHECK(done.size() == 1 && done[0].result == static_cast<int64_t>(8 * kMiB));
  }
  stop = true;
  churn.join();
}

/// A staged write that finds an earlier one finished but not yet reaped
/// takes that one's staging block, not another from the pool (which, new,
/// would cost page faults while the device waits).
void staged_writes_reuse_finished_blocks(Engine& engine, const std::shared_ptr<BufferPool>& pool, int fd) {
  std::vector<char> source(4 * kMiB + 100, 'y');
  // A wake-up left from earlier requests (a worker signals after its result
  // is queued, so a reap can take the result first) would end the wait below
  // early: let it land, and drain it.
  std::vector<IoCompletion> none;
  engine.wait(200);
  engine.reap(&none);
  CHECK(none.empty());
  IoRequest first{300, IoKind::kWrite, fd, nullptr, 4 * kMiB, 0, source.data() + 100, 4 * kMiB};
  CHECK(engine.submit(&first, 1) == 0);
  CHECK(engine.wait(10000) == 1);  // finished: its completion is ready, not reaped
  const size_t taken = pool->hits() + pool->lazy_hits(), fresh = pool->fresh_bytes();
  IoRequest second{301, IoKind::kWrite, fd, nullptr, 4 * kMiB, 4 * kMiB, source.data() + 100, 4 * kMiB};
  CHECK(engine.submit(&second, 1) == 0);
  CHECK(pool->hits() + pool->lazy_hits() == taken && pool->fresh_bytes() == fresh);
  auto done = wait_for(engine, 2);
  CHECK(done.size() == 2 && done[0].result == static_cast<int64_t>(4 * kMiB) &&
        done[1].result == static_cast<int64_t>(4 * kMiB));
}

#ifdef OFFLOAD_HAVE_URING
/// A registered region serves I/O inside it only: not I/O past its end, nor a
/// longer region at the same address (the kernel pinned only what was
/// registered, and faults the rest), nor anything once forgotten.
void fixed_buffers_serve_their_region_only() {
  struct io_uring ring;
  if (io_uring_queue_init(4, &ring, 0) < 0) {
    std::printf("fixed buffers: no io_uring, skipped\n");
    return;
  }
  {
    FixedBufferTable table(&ring, 4);
    constexpr size_t kPage = 4096;
    void* mem = mmap(nullptr, 4 * kPage, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    CHECK(mem != MAP_FAILED);
    char* base = static_cast<char*>(mem);
    int slot = mem == MAP_FAILED ? -1 : table.slot_for(base, kPage, base, kPage);
    if (slot < 0) {
      std::printf("fixed buffers: registration refused (%d), skipped\n", table.error());
    } else {
      CHECK(table.slot_for(base, kPage, base + 1024, 1024) == slot);
      CHECK(table.slot_for(base, kPage, base + 2048, kPage) == -1);
      CHECK(table.slot_for(base, 4 * kPage, base + kPage, kPage) != slot);
      table.forget(base, 4 * kPage);
      CHECK(table.registered() == 0);
    }
    if (mem != MAP_FAILED) munmap(mem, 4 * kPage);
  }
  io_uring_queue_exit(&ring);
}
#endif

int open_test_file(const std::string& dir, bool direct) {
  std::string path = dir + "/core_test.bin";
  int fd = open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC | (direct ? O_DIRECT : 0), 0600);
  if (fd < 0 && direct) return open_test_file(dir, false);  // a file system without O_DIRECT
  unlink(path.c_str());
  return fd;
}

/// drain_for() gives up when the time is up and reports the end of a drain:
/// a completion held back 300 ms keeps it from draining in 50.
void drain_for_waits_only_as_long_as_asked(Engine& engine, const std::shared_ptr<BufferPool>& pool, int fd) {
  void* block = pool->acquire(kMiB);
  CHECK(block != nullptr);
  if (block == nullptr) return;
  std::memset(block, 7, kMiB);
  FaultPlan held;
  held.delay_rate = 1.0;
  held.delay_ms = 300;
  engine.set_faults(held);
  IoRequest write{41, IoKind::kWrite, fd, block, kMiB, 0};
  CHECK(engine.submit(&write, 1) == 0);
  CHECK(!engine.drain_for(50));
  CHECK(engine.pending() == 1);
  CHECK(engine.drain_for(5000));
  std::vector<IoCompletion> done;
  engine.reap(&done);
  CHECK(done.size() == 1 && done[0].tag == 41 && done[0].result == static_cast<int64_t>(kMiB));
  engine.set_faults(FaultPlan{});
  pool->release(block, BufferPool::capacity_for(kMiB));
}

void run_engine(const char* name, Engine& engine, const std::string& dir) {
  auto pool = std::make_shared<BufferPool>(64 * kMiB, 64 * kMiB);
  int fd = open_test_file(dir, true);
  CHECK(fd >= 0);
  if (fd < 0) return;
  staged_write_round_trip(engine, pool, fd);
  staging_and_eviction_never_deadlock(engine, pool, fd);
  staged_writes_reuse_finished_blocks(engine, pool, fd);
  drain_for_waits_only_as_long_as_asked(engine, pool, fd);
  engine.drain();
  close(fd);
  std::printf("%s engine: done\n", name);
}
}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s DIR\n", argv[0]);
    return 2;
  }
  std::string dir = argv[1];
  device_copy_is_exact();
  pool_keeps_lazily_frees_and_trims();
  collapse_races_acquire_and_release();
  EngineOptions options;
  {
    std::unique_ptr<ThreadEngine> engine;
    CHECK(ThreadEngine::create(4, options, &engine) == 0);
    if (engine) run_engine("threads", *engine, dir);
    EngineOptions odd = options;
    odd.chunk_bytes = 1000;  // not a multiple of 4096: refused, not rounded
    std::unique_ptr<ThreadEngine> refused;
    CHECK(ThreadEngine::create(1, odd, &refused) == -EINVAL && !refused);
    odd.chunk_bytes = uint64_t{2} << 30;
    CHECK(ThreadEngine::create(1, odd, &refused) == -EINVAL);
  }
#ifdef OFFLOAD_HAVE_URING
  fixed_buffers_serve_their_region_only();
  std::unique_ptr<UringEngine> uring;
  int rc = UringEngine::create(64, options, &uring);
  if (rc == 0) {
    run_engine("uring", *uring, dir);
  } else {
    std::printf("uring engine: unavailable (%d), skipped\n", rc);
  }
#endif
  std::printf("%d failed checks\n", failures);
  return failures == 0 ? 0 : 1;
}
