#include "engine.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/uio.h>  // preadv2, RWF_NOWAIT
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "device_copy.h"

namespace offload {
namespace {
// A device that keeps answering EAGAIN is reported rather than retried forever.
constexpr unsigned kMaxRetries = 10000;
// Bytes pump() copies into staging blocks before it hands them to the device;
// while the device has less than that to do, it gets them every MiB copied.
constexpr uint64_t kFlushAfterCopying = uint64_t{8} << 20;
constexpr uint64_t kFlushWhileStarved = uint64_t{1} << 20;
// Memory ranges of one vectored I/O (IOV_MAX is 1024).
constexpr size_t kMaxIovecs = 256;

/// A file opened without O_DIRECT: small transfers on it may run inline.
bool is_page_cache_fd(int fd) {
  int flags = fcntl(fd, F_GETFL);
  return flags >= 0 && !(flags & O_DIRECT);
}

/// One transfer in the calling thread: pwrite, or a read only from the page
/// cache (preadv2 RWF_NOWAIT: EAGAIN when not cached). Bytes, or -errno.
int64_t transfer_here(IoKind kind, int fd, void* addr, uint64_t length, uint64_t offset) {
  ssize_t rc;
  if (kind == IoKind::kWrite) {
    rc = pwrite(fd, addr, length, static_cast<off_t>(offset));
  } else {
#ifdef RWF_NOWAIT
    struct iovec iov = {addr, static_cast<size_t>(length)};
    rc = preadv2(fd, &iov, 1, static_cast<off_t>(offset), RWF_NOWAIT);
#else
    errno = EAGAIN;
    rc = -1;
#endif
  }
  return rc < 0 ? -static_cast<int64_t>(errno) : static_cast<int64_t>(rc);
}
}  // namespace

struct Engine::Request {
  IoRequest io;
  std::vector<Chunk> chunks;
  size_t unfinished;  ///< chunks not yet finished
  int error = 0;      ///< first error, negative
  int error_fd = -1;  ///< the file it happened on
};

void* Engine::Chunk::addr() const {
  if (staging != nullptr) return static_cast<char*>(staging) + done;
  return static_cast<char*>(request->io.addr) + position + done;
}
const void* Engine::Chunk::region() const { return staging != nullptr ? staging_region : request->io.region; }
uint64_t Engine::Chunk::region_length() const {
  return staging != nullptr ? staging_region_length : request->io.region_length;
}
const std::vector<struct iovec>& Engine::Chunk::iovecs() {
  iov.clear();
  uint64_t skip = done;
  auto add = [&](const Chunk* part) {
    if (skip >= part->length) {
      skip -= part->length;
      return;
    }
    char* base = static_cast<char*>(part->request->io.addr) + part->position + skip;
    iov.push_back({base, static_cast<size_t>(part->length - skip)});
    skip = 0;
  };
  add(this);
  for (const Chunk* part : merged) add(part);
  return iov;
}
bool Engine::Chunk::needs_staging() const {
  return staging == nullptr && (request->io.copy_from != nullptr || gather);
}
uint64_t Engine::Chunk::file_offset() const { return base + done; }
const IoRequest& Engine::Chunk::io() const { return request->io; }

int Engine::check_options(const EngineOptions& options) {
  if (options.chunk_bytes % 4096 != 0 || options.chunk_bytes > (uint64_t{1} << 30)) return -EINVAL;
  return 0;
}

Engine::Engine(const EngineOptions& options) : options_(options) {
  if (options_.chunk_bytes == 0) options_.chunk_bytes = uint64_t{4} << 20;
  if (options_.max_in_flight == 0) options_.max_in_flight = 1;
  event_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (event_fd_ < 0) event_fd_error_ = -errno;
}

Engine::~Engine() {
  release_staging();  // the backend drained: nothing is in flight
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  delay_cv_.notify_all();
  if (delay_timer_.joinable()) delay_timer_.join();
  if (event_fd_ >= 0) close(event_fd_);
}

void Engine::run_delay_timer() {
  std::unique_lock<std::mutex> lock(mu_);
  Clock::time_point signalled_up_to = Clock::time_point::min();
  while (!stopping_) {
    bool any = false;
    Clock::time_point next = Clock::time_point::max();
    for (const Delayed& d : delayed_) {
      if (d.due > signalled_up_to && d.due < next) next = d.due, any = true;
    }
    if (!any) {
      delay_cv_.wait(lock);
      continue;
    }
    if (delay_cv_.wait_until(lock, next) == std::cv_status::timeout) {
      signalled_up_to = next;  // reap() releases it; wake whoever watches the eventfd
      signal();
    }
  }
}

void Engine::release_due_delays() {
  if (delayed_.empty()) return;
  Clock::time_point now = Clock::now();
  std::vector<Delayed> due;
  for (size_t i = 0; i < delayed_.size();) {
    if (delayed_[i].due <= now) {
      due.push_back(delayed_[i]);
      delayed_[i] = delayed_.back();
      delayed_.pop_back();
    } else {
      ++i;
    }
  }
  for (const Delayed& d : due) on_chunk_finished(d.chunk, d.result, false);
}

void Engine::signal() {
  uint64_t one = 1;
  ssize_t unused = write(event_fd_, &one, sizeof one);
  (void)unused;  // the counter saturating is the only failure, and it stays readable
}

int Engine::add_stripes(const std::vector<int>& fds, uint64_t unit) {
  if (fds.empty() || unit == 0 || unit % 4096 != 0) return -EINVAL;
  for (int fd : fds) {
    if (fd < 0) return -EINVAL;
  }
  std::lock_guard<std::mutex> lock(mu_);
  stripes_.push_back(Stripes{fds, unit});
  stripe_count_.store(stripes_.size());
  return -2 - static_cast<int>(stripes_.size() - 1);
}

int Engine::failed_fd(uint64_t tag) {
  std::lock_guard<std::mutex> lock(mu_);
  for (size_t i = 0; i < failed_fds_.size(); ++i) {
    if (failed_fds_[i].first == tag) {
      int fd = failed_fds_[i].second;
      failed_fds_[i] = failed_fds_.back();
      failed_fds_.pop_back();
      return fd;
    }
  }
  return -1;
}

void Engine::fail(Request* r, int error, int fd) {
  if (r->error != 0) return;
  r->error = error;
  r->error_fd = fd;
}

int Engine::validate(const IoRequest& io) const {
  if (io.fd < -1 && static_cast<size_t>(-2 - static_cast<int64_t>(io.fd)) >= stripe_count_.load()) return -EBADF;
  if (io.copy_from != nullptr) {  // staged: by this engine, through its pool
    if (io.kind != IoKind::kWrite || io.copy_length > io.length || io.addr != nullptr) return -EINVAL;
    return staging_pool_ == nullptr ? -EINVAL : 0;
  }
  if (io.kind != IoKind::kFsync && io.length > 0 && io.addr == nullptr) return -EINVAL;
  return 0;
}

void Engine::set_staging_pool(std::shared_ptr<BufferPool> pool, bool register_blocks) {
  std::lock_guard<std::mutex> lock(mu_);
  staging_pool_ = std::move(pool);
  register_staging_ = register_blocks;
}

uint64_t Engine::staged_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return staged_bytes_;
}

uint64_t Engine::merged_writes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return merged_writes_;
}

uint64_t Engine::merged_vectored() const {
  std::lock_guard<std::mutex> lock(mu_);
  return merged_vectored_;
}

void* Engine::take_finished_staging(size_t capacity) {
  for (size_t i = staging_done_.size(); i-- > 0;) {
    if (staging_done_[i].second == capacity) {
      void* block = staging_done_[i].first;
      staging_done_[i] = staging_done_.back();
      staging_done_.pop_back();
      return block;
    }
  }
  return nullptr;
}

// A staged write's chunk, about to start: copy its bytes (and those of the
// chunks merged into it, one after another) into a pool block, zero-filled
// past each source, which it is written from. Returns 0 or -ENOMEM.
int Engine::stage(Chunk* c) {
  uint64_t total = c->length + c->merged_bytes;
  size_t capacity = BufferPool::capacity_for(total);
  // A block a chunk finished with since the last release_staging(): reused
  // here, so a wave of chunks started from within one reap() needs no new one.
  void* block = take_finished_staging(capacity);
  if (block == nullptr && in_flight_ > 0) {
    // Before taking a new block, take what the device has finished since:
    // a new block may cost page faults of memory the host must back again
    // (on a VM that reports freed memory to it, ~10 ms a 4 MiB block, in
    // which the device writes several), and the device idles while the
    // thread that feeds it faults.
    finish_collected(false);  // submits stay batched (see pump())
    block = take_finished_staging(capacity);
  }
  if (block == nullptr) block = staging_pool_->acquire(total);
  if (block == nullptr) return -ENOMEM;
  c->staging = block;
  c->staging_capacity = capacity;
  if (register_staging_) {
    auto [region, length] = BufferPool::region_of(block, c->staging_capacity);
    c->staging_region = region;
    c->staging_region_length = length;
  }
  char* to = static_cast<char*>(block);
  auto copy_in = [&](const Chunk* part) {
    const IoRequest& io = part->io();
    const char* from = static_cast<const char*>(io.copy_from != nullptr ? io.copy_from : io.addr);
    uint64_t copy = part->length;  // a write of its own memory: all of it
    if (io.copy_from != nullptr) {
      copy = io.copy_length > part->position ? io.copy_length - part->position : 0;
      if (copy > part->length) copy = part->length;
    }
    copy_for_device(to, from + part->position, copy);
    std::memset(to + copy, 0, part->length - copy);
    staged_bytes_ += copy;
    to += part->length;
  };
  copy_in(c);
  for (const Chunk* part : c->merged) copy_in(part);
  return 0;
}

// Small requests side by side in the file (a vector call on small tensors)
// go to the device as one I/O each chunk_bytes: a 64 KiB request costs the
// device and the kernel nearly what a 4 MiB one does. Staged writes share a
// staging block (plain writes among them are copied in too); others become
// one vectored I/O (at most kMaxIovecs memory ranges). Small transfers on a
// page-cache file are left alone: they run inline, cheaper than any I/O
// handed over (run_inline).
void Engine::merge_following(Chunk* c) {
  // Not a chunk started before (retried: a staged one has its block filled).
  if (ready_.empty() || c->done != 0 || c->staging != nullptr || !c->merged.empty() ||
      c->io().kind == IoKind::kFsync)
    return;
  bool staged = c->needs_staging();
  bool checked_fd = staged;
  uint64_t total = c->remaining(), end = c->file_offset() + total;
  while (!ready_.empty()) {
    Chunk* next = ready_.front();
    if (next->staging != nullptr || next->io().kind != c->io().kind || next->fd != c->fd || next->done != 0 ||
        next->file_offset() != end || next->request->error != 0 || total + next->length > options_.chunk_bytes ||
        (in_flight_ > 0 && in_flight_bytes_ + total + next->length > options_.max_in_flight_bytes))
      break;
    if (!checked_fd) {
      if (options_.inline_bytes != 0 && is_page_cache_fd(c->fd)) return;
      checked_fd = true;
    }
    if (next->needs_staging() && !staged) {
      // A staged write behind plain ones (torch memory that happened to be
      // aligned, among tensors that were not): the whole group is copied
      // into one block rather than cut in two I/Os.
      c->gather = staged = true;
    }
    if (!staged && c->merged.size() + 1 >= kMaxIovecs) break;
    ready_.pop_front();
    c->merged.push_back(next);
    c->merged_bytes += next->length;
    total += next->length;
    end += next->length;
  }
  (staged ? merged_writes_ : merged_vectored_) += c->merged.size();
}

void Engine::fail_chunk(Chunk* c, int error) {
  fail(c->request, error, c->fd);
  for (Chunk* part : c->merged) fail(part->request, error, c->fd);
}

void Engine::release_staging() {
  std::vector<std::pair<void*, size_t>> done;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (staging_done_.empty()) return;
    done.swap(staging_done_);
  }
  for (auto& [block, capacity] : done) staging_pool_->release(block, capacity);
}

int Engine::submit(const IoRequest* requests, size_t count) {
  for (size_t i = 0; i < count; ++i) {
    if (int rc = validate(requests[i])) return rc;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (size_t i = 0; i < count; ++i) queue_request(requests[i]);
    pump();
    if (!ready_.empty()) {
      // At the in-flight cap: make room from what has finished, or the device idles
      // until the caller next reaps (a long vector call submits for a while).
      progress_locked();
      if (!completed_.empty()) signal();  // progress_locked() consumed the wake-up
    }
    signal_inline_completions();
  }
  release_staging();
  return 0;
}

int Engine::submit_now(const IoRequest& io, int64_t* result) {
  int rc = submit_now_impl(io, result);
  release_staging();
  return rc;
}

int Engine::submit_now_impl(const IoRequest& io, int64_t* result) {
  if (int rc = validate(io)) return rc;
  std::lock_guard<std::mutex> lock(mu_);
  if (transfer_now(io, result)) return 1;
  queue_request(io);
  pump();
  int finished = 0;
  // Tags are the caller's: if it reuses one, whichever request finished is
  // reported, which it cannot tell apart anyway.
  for (size_t i = completed_.size(); i-- > 0;) {
    if (completed_[i].tag == io.tag) {
      *result = completed_[i].result;
      completed_.erase(completed_.begin() + static_cast<std::ptrdiff_t>(i));
      --pending_;
      finished = 1;
      break;
    }
  }
  if (completed_.empty()) finished_inline_ = false;  // only ours finished: nobody to wake
  signal_inline_completions();
  return finished;
}

// submit_now's common case without the request bookkeeping: one small
// transfer, whole in one syscall. Anything else (faults being injected,
// requests waiting, a short or failed transfer, an uncached read) returns
// false and takes the usual route, which starts it over and reports it.
// The caller promised a page-cache file (no fcntl here: it cost ~5% of a
// 4 KiB pair); on an O_DIRECT one the syscall fails on unaligned memory and
// the usual route reports it, or waits for the device in this thread.
bool Engine::transfer_now(const IoRequest& io, int64_t* result) {
  if (faults_.enabled() || !ready_.empty() || io.copy_from != nullptr || io.kind == IoKind::kFsync || io.fd < 0 ||
      io.length == 0 || io.length > options_.inline_bytes || io.length > options_.chunk_bytes)
    return false;
  int64_t rc = transfer_here(io.kind, io.fd, io.addr, io.length, io.offset);
  if (rc != static_cast<int64_t>(io.length)) return false;
  *result = rc;
  return true;
}

// Whoever watches the eventfd: completions finished in pump() are waiting.
void Engine::signal_inline_completions() {
  if (finished_inline_) signal();
  finished_inline_ = false;
}

void Engine::queue_request(const IoRequest& io) {
  ++pending_;
  if (io.kind != IoKind::kFsync && io.length == 0) {
    completed_.push_back({io.tag, 0});
    signal();
    return;
  }
  auto owned = std::make_unique<Request>(Request{io, {}, 0, 0});
  Request* request = owned.get();
  requests_.emplace(request, std::move(owned));
  if (io.region_length != 0) {  // a pool block: register the mapping it lies in
    auto [region, length] = BufferPool::region_of(const_cast<void*>(io.region), io.region_length);
    request->io.region = region;
    request->io.region_length = length;
  }
  chunk_request(request);
  request->unfinished = request->chunks.size();
  for (Chunk& c : request->chunks) ready_.push_back(&c);
}

void Engine::chunk_request(Request* request) {
  const IoRequest& io = request->io;
  const Stripes* stripes = io.fd < -1 ? &stripes_[static_cast<size_t>(-2 - io.fd)] : nullptr;
  if (io.kind == IoKind::kFsync) {  // one chunk per file
    if (stripes == nullptr) {
      request->chunks.push_back(Chunk{request, 0, 0, io.fd, 0});
    } else {
      for (int fd : stripes->fds) request->chunks.push_back(Chunk{request, 0, 0, fd, 0});
    }
    return;
  }
  uint64_t chunk = options_.chunk_bytes;
  request->chunks.reserve((io.length + chunk - 1) / chunk + (stripes != nullptr ? 1 : 0));
  for (uint64_t pos = 0; pos < io.length;) {
    uint64_t n = io.length - pos < chunk ? io.length - pos : chunk;
    uint64_t v = io.offset + pos;
    if (stripes == nullptr) {
      request->chunks.push_back(Chunk{request, pos, n, io.fd, v});
    } else {
      uint64_t unit = stripes->unit, files = stripes->fds.size();
      uint64_t in_unit = unit - v % unit;  // a chunk never crosses into the next file
      if (n > in_unit) n = in_unit;
      uint64_t stripe = v / unit;
      request->chunks.push_back(Chunk{request, pos, n, stripes->fds[stripe % files],
                                      stripe / files * unit + v % unit});
    }
    pos += n;
  }
}

// Small page-cache transfers are cheaper as a syscall here than handed over.
// A buffered 4 KiB pwrite costs ~2 us; io_uring punts it to an io-wq worker
// on file systems without non-blocking buffered writes (ext4), and the thread
// engine to a pool thread: a cross-CPU wake-up each, which costs several
// times the write itself. Reads run here only when
// the page cache holds them (RWF_NOWAIT); otherwise the backend takes them.
// A buffered write can still block here on dirty-page throttling; that is
// why only small transfers qualify. Returns true when the chunk finished here
// (its result handled as if the backend had reported it).
bool Engine::run_inline(Chunk* c) {
  const IoRequest& io = c->io();
  if (io.kind == IoKind::kFsync || c->vectored() || c->remaining() > options_.inline_bytes ||
      !is_page_cache_fd(c->fd))
    return false;
  int64_t result = transfer_here(io.kind, c->fd, c->addr(), c->remaining(), c->file_offset());
  // Not cached (EAGAIN), or no RWF_NOWAIT here: the backend reads it, and
  // reports any real error itself.
  if (io.kind == IoKind::kRead && result < 0) return false;
  ++in_flight_;
  c->issued_bytes = c->remaining();
  in_flight_bytes_ += c->issued_bytes;
  on_chunk_finished(c, result, true);
  return true;
}

void Engine::pump() {
  bool started = false, finished_here = false;
  uint64_t copied = 0;                     // staged since the last flush
  uint64_t at_device = in_flight_bytes_;   // handed to the device and not reaped (some may be done)
  while (in_flight_ < options_.max_in_flight && !ready_.empty()) {
    Chunk* c = ready_.front();
    if (in_flight_ > 0 && in_flight_bytes_ + c->remaining() > options_.max_in_flight_bytes) break;
    ready_.pop_front();
    // A sibling failed: don't start more I/O for it (unless other requests'
    // bytes ride in this chunk's I/O).
    if (c->request->error != 0 && c->merged.empty()) {
      finish_chunk(c);
      continue;
    }
    merge_following(c);
    bool staged = c->needs_staging();
    if (staged) {
      if (int rc = stage(c)) {
        fail_chunk(c, rc);
        finish_chunk(c);
        continue;
      }
      // stage() may have collected what finished (a thread engine's chunks
      // start before a flush: some of `copied` may be among them).
      at_device = in_flight_bytes_ > copied ? in_flight_bytes_ - copied : 0;
    }
    if (options_.inline_bytes != 0 && run_inline(c)) {
      finished_here = true;
      continue;
    }
    int rc = start(c);
    if (rc < 0) {
      fail_chunk(c, rc);
      finish_chunk(c);
      continue;
    }
    ++in_flight_;
    c->issued_bytes = c->remaining();
    in_flight_bytes_ += c->issued_bytes;
    started = true;
    // Staged chunks go to the device every 8 MiB copied (about a
    // millisecond), not after the whole wave: holding them back until the
    // last copy ran kept the device idle for as long as the copies took (a
    // whole window's, 128 MiB, on a vector write). Not after each chunk:
    // a submit of its own for every 1 MiB chunk slowed the helper that
    // faults in read buffers beside the writes (a fresh process's first
    // reads then ran slower), and 64 KiB ones would cost more than they save.
    // But while the device has less than 8 MiB to do (none, after a disk that
    // completes everything in flight at once), every MiB copied goes to it.
    if (staged) {
      copied += c->issued_bytes;
      if (copied >= (at_device < kFlushAfterCopying ? kFlushWhileStarved : kFlushAfterCopying)) {
        flush();
        at_device += copied;
        started = false;
        copied = 0;
      }
    }
  }
  if (started) flush();
  if (finished_here) finished_inline_ = true;  // submit() signals; reap() returns them anyway
}

void Engine::on_chunk_finished(Chunk* c, int64_t result, bool delay_allowed) {
  if (delay_allowed) {
    if (int ms = faults_.delay_ms()) {
      delayed_.push_back({c, result, Clock::now() + std::chrono::milliseconds(ms)});
      if (!delay_timer_.joinable()) delay_timer_ = std::thread([this] { run_delay_timer(); });
      delay_cv_.notify_all();
      return;
    }
  }
  --in_flight_;
  in_flight_bytes_ -= c->issued_bytes;
  Request* r = c->request;
  const int64_t transferred = result;
  result = faults_.apply(result);
  if (result == -EAGAIN || result == -EINTR) {
    if (++c->retries < kMaxRetries) {
      ready_.push_front(c);
      return;
    }
  }
  if (result < 0) {
    if (transferred >= 0 && r->io.kind == IoKind::kRead) scribble_failed_read(c);  // injected
    fail_chunk(c, static_cast<int>(result));
  } else if (r->io.kind == IoKind::kFsync) {
    // nothing to count
  } else if (result == 0) {
    fail_chunk(c, r->io.kind == IoKind::kRead ? -ENODATA : -EIO);
  } else {
    if (result < transferred) {  // injected short transfer
      uint64_t from = c->done + static_cast<uint64_t>(result), to = c->done + static_cast<uint64_t>(transferred);
      if (r->io.kind == IoKind::kRead) scribble_read(c, from, to);
      else scribble_written(c, from, to);
    }
    c->done += static_cast<uint64_t>(result);
    if (c->remaining() > 0) {  // short transfer: go on from where it stopped
      ready_.push_front(c);
      return;
    }
  }
  finish_chunk(c);
}

// An injected read error leaves what a real one may: the memory the read
// was filling holds no data (here a pattern, not the bytes that did arrive),
// so that callers that use it anyway fail their tests. An injected short
// read does the same to the bytes it leaves unreported, which the engine
// must read again. An injected short write leaves those bytes of the file
// holding a pattern, which the engine must write again.
void Engine::scribble_failed_read(Chunk* c) { scribble_read(c, 0, c->length + c->merged_bytes); }

void Engine::scribble_read(Chunk* c, uint64_t from, uint64_t to) {
  uint64_t at = 0;  // where `part` starts in the chunk's I/O
  auto scribble = [&](Chunk* part) {
    uint64_t begin = std::max(from, at), end = std::min(to, at + part->length);
    if (begin < end)
      std::memset(static_cast<char*>(part->request->io.addr) + part->position + (begin - at), 0xE5, end - begin);
    at += part->length;
  };
  scribble(c);
  for (Chunk* part : c->merged) scribble(part);
}

void Engine::scribble_written(Chunk* c, uint64_t from, uint64_t to) {
  // Aligned memory and (for O_DIRECT) whole blocks: a short result keeps the
  // alignment. Best effort: if the file refuses, the bytes stay as written.
  const uint64_t length = to - from, capacity = (length + 4095) & ~uint64_t{4095};
  void* pattern = nullptr;
  if (length == 0 || posix_memalign(&pattern, 4096, capacity) != 0) return;
  std::memset(pattern, 0xE5, capacity);
  for (uint64_t at = 0; at < length;) {
    ssize_t n = pwrite(c->fd, static_cast<char*>(pattern) + at, length - at, static_cast<off_t>(c->base + from + at));
    if (n <= 0) break;
    at += static_cast<uint64_t>(n);
  }
  std::free(pattern);
}

void Engine::finish_chunk(Chunk* c) {
  if (c->staging != nullptr) {  // handed back once mu_ is released (the pool may call listeners)
    staging_done_.emplace_back(c->staging, c->staging_capacity);
    c->staging = nullptr;
  }
  if (!c->merged.empty()) {  // they finish first: the last chunk of c's request frees c
    std::vector<Chunk*> merged;
    merged.swap(c->merged);
    c->merged_bytes = 0;
    for (Chunk* part : merged) finish_chunk(part);
  }
  Request* r = c->request;
  if (--r->unfinished > 0) return;
  int64_t result = r->error != 0 ? r->error
                   : r->io.kind == IoKind::kFsync ? 0
                                                  : static_cast<int64_t>(r->io.length);
  completed_.push_back({r->io.tag, result});
  if (r->error != 0 && r->io.fd < -1) failed_fds_.emplace_back(r->io.tag, r->error_fd);
  requests_.erase(r);
}

void Engine::finish_collected(bool submit_queued) {
  finished_scratch_.clear();
  collect(&finished_scratch_, submit_queued);
  for (auto& [chunk, result] : finished_scratch_) on_chunk_finished(chunk, result, true);
}

void Engine::progress_locked() {
  uint64_t counter;  // one read takes the whole count and zeroes it (not EFD_SEMAPHORE)
  ssize_t drained = read(event_fd_, &counter, sizeof counter);
  (void)drained;  // EAGAIN: nothing was signalled
  finish_collected(true);
  release_due_delays();
  pump();
  finished_inline_ = false;  // the caller takes completed_ or signals for it
}

void Engine::reap(std::vector<IoCompletion>* out) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    progress_locked();
    pending_ -= completed_.size();
    out->insert(out->end(), completed_.begin(), completed_.end());
    completed_.clear();
  }
  release_staging();
}

int Engine::wait(int timeout_ms) {
  struct pollfd p = {event_fd_, POLLIN, 0};
  int rc = poll(&p, 1, timeout_ms);
  if (rc < 0) return errno == EINTR ? 1 : -errno;
  return rc > 0 ? 1 : 0;
}

bool Engine::drain_for(int timeout_ms) {
  const auto deadline = Clock::now() + std::chrono::milliseconds(timeout_ms < 0 ? 0 : timeout_ms);
  bool drained = false;
  for (;;) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      progress_locked();
      drained = in_flight_ == 0 && ready_.empty();
      if (drained && !completed_.empty()) signal();  // progress_locked() consumed the wake-up
    }
    release_staging();
    if (drained) return true;
    int slice = 100;
    if (timeout_ms >= 0) {
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
      if (left <= 0) return false;
      if (left < slice) slice = static_cast<int>(left);
    }
    wait(slice);
  }
}

size_t Engine::pending() const {
  std::lock_guard<std::mutex> lock(mu_);
  return pending_;
}

size_t Engine::backlog() const {
  std::lock_guard<std::mutex> lock(mu_);
  return ready_.size();
}

void Engine::set_faults(const FaultPlan& plan) {
  std::lock_guard<std::mutex> lock(mu_);
  faults_.set_plan(plan);
}

uint64_t Engine::faults_injected() const {
  std::lock_guard<std::mutex> lock(mu_);
  return faults_.injected();
}

}  // namespace offload
