// The engine interface: requests in, completions out, chunking and retries
// shared by every backend.
#pragma once
#include <cstddef>
#include <cerrno>
#include <cstdint>
#include <sys/uio.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <vector>

#include "buffer_pool.h"
#include "fault_injector.h"
#include "io_request.h"

namespace offload {

struct EngineOptions {
  uint64_t chunk_bytes = uint64_t{4} << 20;  ///< largest single I/O
  unsigned max_in_flight = 128;              ///< chunk I/Os handed to the backend at once
  /// Bytes handed to the backend at once (at least one chunk always goes).
  /// Deep queues of small I/Os pay; deep queues of large ones made a virtio
  /// disk slower, not faster (BENCHMARKS.md, decisions).
  uint64_t max_in_flight_bytes = uint64_t{128} << 20;
  /// Reads and writes of at most this many bytes on a file opened without
  /// O_DIRECT run in the submitting thread when that is cheaper than handing
  /// them over (see Engine::run_inline); 0: never.
  uint64_t inline_bytes = uint64_t{64} << 10;
};

/// Runs IoRequests asynchronously. Each request is split into chunks of at
/// most `chunk_bytes` (requests of one kind queued side by side in one file
/// share one I/O, up to `chunk_bytes`), up to `max_in_flight` chunks are in the backend at once,
/// short transfers and -EAGAIN/-EINTR are resubmitted, and a 0-byte transfer
/// before the end is an error (-ENODATA for reads, -EIO for writes).
/// Every submitted request completes exactly once: through reap(), or
/// submit_now()'s return value. Nothing here waits for the device except
/// wait(): submit() of a small buffered write does the write itself, into
/// the page cache (`inline_bytes`; the kernel may throttle it when dirty
/// pages pile up). All methods are thread-safe.
class Engine {
 public:
  explicit Engine(const EngineOptions& options);
  virtual ~Engine();
  /// 0, or -EINVAL for options no engine runs with: chunk_bytes must be a
  /// multiple of 4096 up to 1 GiB (0: the default).
  static int check_options(const EngineOptions& options);
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  /// Starts the requests. Returns 0, or -EINVAL (nothing started) if one is
  /// malformed. Staged writes (IoRequest::copy_from) copy the chunks that
  /// start now; the rest are copied as they start, within later calls.
  int submit(const IoRequest* requests, size_t count);
  /// submit() of one request on a file opened without O_DIRECT, reporting a
  /// transfer finished within the call (a small one, run inline) at once:
  /// returns 1 with the result (bytes or -errno) in *result, and that request
  /// never appears in reap(). Returns 0 when it is in flight (reap() reports
  /// it), or -EINVAL. On an O_DIRECT file a small transfer may be tried in
  /// the calling thread, waiting for the device; the result is still right.
  int submit_now(const IoRequest& request, int64_t* result);
  /// Appends the requests that have finished since the last call.
  /// Never blocks.
  void reap(std::vector<IoCompletion>* out);
  /// Blocks until a completion may be ready or `timeout_ms` passes (-1: no
  /// limit). Returns 1 if woken, 0 on timeout, -errno on error. A wake-up is
  /// only a hint: call reap() afterwards.
  int wait(int timeout_ms);
  /// Makes wait() return and event_fd() readable, from any thread: for work
  /// outside the engine (a device copy landing) that the waiter must see.
  void wake() { signal(); }
  /// Readable when completions may be ready; for event loops. Never read it
  /// yourself: reap() drains it.
  int event_fd() const { return event_fd_; }
  /// -errno of the eventfd the constructor could not make (event_fd() < 0).
  int event_fd_error() const { return event_fd_error_; }
  /// Requests submitted and not yet returned by reap().
  size_t pending() const;
  /// Chunks queued behind the in-flight limits: each starts only when an
  /// earlier one has finished and a reap() (or submit()) sees it.
  size_t backlog() const;
  /// The pool that writes submitted with `copy_from` stage through (see
  /// IoRequest); without one such writes are -EINVAL.
  /// `register_blocks`: an io_uring engine registers the staging blocks (their
  /// slabs) as fixed buffers. Call before submitting such writes.
  void set_staging_pool(std::shared_ptr<BufferPool> pool, bool register_blocks);
  /// Bytes copied into staging blocks since the engine was made.
  uint64_t staged_bytes() const;
  /// Chunks written from another chunk's staging block since the engine was made.
  uint64_t merged_writes() const;
  /// Chunks read or written (not staged) inside another chunk's vectored
  /// I/O since the engine was made.
  uint64_t merged_vectored() const;
  const EngineOptions& options() const { return options_; }
  void set_faults(const FaultPlan& plan);
  uint64_t faults_injected() const;
  virtual const char* name() const = 0;

  /// Makes several open files one striped file (RAID-0): its byte v is byte
  /// (v / (unit * n)) * unit + v % unit of files[(v / unit) % n]. Returns the
  /// negative number requests name it by in IoRequest::fd, or -EINVAL (no
  /// files, a negative fd, a unit not a multiple of 4096). Requests on it are
  /// chunked at unit boundaries, so each chunk I/O goes to one file, and all
  /// of them are in flight at once; an fsync of it syncs every file.
  int add_stripes(const std::vector<int>& fds, uint64_t unit);
  /// The file a failed request on a striped file failed on (the first
  /// error), forgotten once asked; -1 for any other request.
  int failed_fd(uint64_t tag);

  /// Blocks until every submitted request has completed (their completions
  /// stay queued for reap()). Backends call this first in their destructor,
  /// so no memory is released while the kernel or a worker may still use it.
  void drain() { drain_for(-1); }
  /// drain() for at most `timeout_ms` (-1: no limit): true once nothing is
  /// in flight, false if something still is when the time is up.
  bool drain_for(int timeout_ms);
  /// Asks the backend to stop the I/O in flight, waiting up to `timeout_ms`
  /// for it to let go: what it stops completes with -ECANCELED (I/O already
  /// at the device runs to its end). Returns 0 once asked, or -ENOTSUP: a
  /// worker thread blocked in a system call cannot be stopped.
  virtual int cancel_in_flight(int timeout_ms) {
    (void)timeout_ms;
    return -ENOTSUP;
  }

 protected:
  struct Request;
  /// One I/O of at most chunk_bytes; `done` bytes of it have been transferred.
  struct Chunk {
    Request* request;
    uint64_t position;  ///< offset within the request
    uint64_t length;
    int fd = -1;        ///< the file this chunk's I/O goes to
    uint64_t base = 0;  ///< its file offset at position (before `done`)
    uint64_t done = 0;
    unsigned retries = 0;
    uint64_t issued_bytes = 0;  ///< counted in in_flight_bytes_ while in the backend

    void* staging = nullptr;  ///< the pool block this chunk is written from, if staged
    size_t staging_capacity = 0;
    const void* staging_region = nullptr;  ///< what to register for it (null: unregistered)
    uint64_t staging_region_length = 0;
    /// Chunks of the requests queued right after this one that go in this
    /// chunk's I/O (the same kind, contiguous in the same file); they
    /// succeed or fail with it. Staged writes: their bytes follow its own in
    /// its staging block. Others: the I/O is vectored (see iovecs()).
    std::vector<Chunk*> merged{};
    uint64_t merged_bytes = 0;
    /// Written from a staging block though its request brings its own
    /// memory: it leads merged chunks of which some are staged, so all of
    /// them are copied into one block.
    bool gather = false;
    std::vector<struct iovec> iov{};  ///< iovecs()'s, kept until the I/O ends

    void* addr() const;
    uint64_t file_offset() const;
    /// The block addr() lies in (for fixed-buffer registration): the staging
    /// block, else the request's region (null if none).
    const void* region() const;
    uint64_t region_length() const;
    bool needs_staging() const;
    /// Bytes of this chunk's I/O still to transfer (merged chunks' included).
    uint64_t remaining() const { return length + merged_bytes - done; }
    /// Whether the I/O spans several memory ranges: merged chunks not staged.
    bool vectored() const { return staging == nullptr && !merged.empty(); }
    /// For a vectored chunk: the memory of its remaining() bytes, one iovec
    /// per chunk from `done` on (valid until the next call).
    const std::vector<struct iovec>& iovecs();
    const IoRequest& io() const;
  };

  // Backend hooks, called with mu_ held.
  /// Queues the chunk's remaining bytes for I/O; returns 0 or -errno.
  virtual int start(Chunk* chunk) = 0;
  /// Makes queued chunks visible to the kernel or the workers.
  virtual void flush() = 0;
  /// Appends finished chunk I/Os with their raw result (bytes or -errno);
  /// `submit_queued`: flush() first.
  virtual void collect(std::vector<std::pair<Chunk*, int64_t>>* finished, bool submit_queued) = 0;

  /// Makes event_fd() readable (for completions found outside the kernel).
  void signal();
  /// The engine's lock, for backends called from outside (unmap listeners).
  std::mutex& lock() { return mu_; }

 private:
  using Clock = std::chrono::steady_clock;
  struct Delayed {
    Chunk* chunk;
    int64_t result;
    Clock::time_point due;
  };

  int validate(const IoRequest& io) const;
  int submit_now_impl(const IoRequest& io, int64_t* result);  ///< submit_now() but release_staging()
  /// Hands finished chunks' staging blocks back to the pool; call without mu_.
  void release_staging();
  int stage(Chunk* chunk);
  /// collect() (flushing first if `submit_queued`), then on_chunk_finished()
  /// for each; never called while finished_scratch_ is being walked.
  void finish_collected(bool submit_queued);
  /// A block of `capacity` from staging_done_, or null.
  void* take_finished_staging(size_t capacity);
  /// Takes the chunks queued right behind `chunk` that continue it in the
  /// same file, of the same kind, into its I/O, up to chunk_bytes in all:
  /// reads and plain writes vectored, writes with any staged one among them
  /// gathered into one staging block.
  void merge_following(Chunk* chunk);
  /// Fails the request of `chunk` and of every chunk merged into it.
  void fail_chunk(Chunk* chunk, int error);
  void queue_request(const IoRequest& io);
  /// Splits a request into chunks, each to one file.
  void chunk_request(Request* request);
  void fail(Request* request, int error, int fd);
  void signal_inline_completions();
  bool run_inline(Chunk* chunk);
  bool transfer_now(const IoRequest& io, int64_t* result);
  void pump();
  void on_chunk_finished(Chunk* chunk, int64_t result, bool delay_allowed);
  void release_due_delays();
  void run_delay_timer();
  void finish_chunk(Chunk* chunk);
  void scribble_failed_read(Chunk* chunk);  ///< an injected read error's memory: no data
  /// The same for bytes [from, to) of the chunk's I/O (merged chunks' included).
  void scribble_read(Chunk* chunk, uint64_t from, uint64_t to);
  /// An injected short write's unreported bytes [from, to): the file gets a pattern there.
  void scribble_written(Chunk* chunk, uint64_t from, uint64_t to);
  void progress_locked();

  EngineOptions options_;
  int event_fd_ = -1;
  int event_fd_error_ = 0;
  mutable std::mutex mu_;
  std::deque<Chunk*> ready_;  ///< chunks waiting for a slot in the backend
  /// Every request submitted and not yet completed, owned here: a chunk
  /// points at its request, and the last chunk to finish erases it.
  std::unordered_map<const Request*, std::unique_ptr<Request>> requests_;
  unsigned in_flight_ = 0;
  uint64_t in_flight_bytes_ = 0;
  size_t pending_ = 0;
  std::vector<IoCompletion> completed_;
  bool finished_inline_ = false;  ///< pump() finished chunks since the last signal
  std::vector<std::pair<Chunk*, int64_t>> finished_scratch_;
  std::shared_ptr<BufferPool> staging_pool_;
  bool register_staging_ = false;
  /// Finished chunks' blocks: reused by stage(), else handed back by release_staging().
  std::vector<std::pair<void*, size_t>> staging_done_;
  uint64_t staged_bytes_ = 0;
  uint64_t merged_writes_ = 0;
  uint64_t merged_vectored_ = 0;
  struct Stripes {
    std::vector<int> fds;
    uint64_t unit;
  };
  std::deque<Stripes> stripes_;  ///< IoRequest::fd -2 - i is stripes_[i]; only ever appended
  std::atomic<size_t> stripe_count_{0};  ///< stripes_.size(), for validate() outside mu_
  std::vector<std::pair<uint64_t, int>> failed_fds_;  ///< tag -> file, for failed striped requests
  FaultInjector faults_;
  // Completions held back by the fault injector (still counted in flight), and
  // the thread that makes event_fd() readable when one falls due.
  std::vector<Delayed> delayed_;
  std::condition_variable delay_cv_;
  std::thread delay_timer_;
  bool stopping_ = false;
};

}  // namespace offload
