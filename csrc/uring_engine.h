// The io_uring backend (liburing).
#pragma once
#include <liburing.h>

#include <memory>
#include <vector>

#include "engine.h"
#include "fixed_buffers.h"

namespace offload {

/// Chunks become io_uring read/write/fsync SQEs. The engine's eventfd is
/// registered with io_uring_register_eventfd (not the _async variant, which
/// misses completions that finish inline during submission). I/O inside a
/// request's `region` uses fixed buffers, registered on first use.
class UringEngine final : public Engine, public UnmapListener {
 public:
  /// Sets up a ring of `entries` SQEs. Returns 0 or -errno: -EPERM when
  /// io_uring is forbidden (seccomp, kernel.io_uring_disabled), -ENOSYS when
  /// the kernel or a filter does not know it, -ENOMEM when RLIMIT_MEMLOCK is
  /// too low for the ring.
  static int create(unsigned entries, const EngineOptions& options,
                    std::unique_ptr<UringEngine>* out);
  ~UringEngine() override;
  const char* name() const override { return "uring"; }
  void before_unmap(const void* base, size_t length) override;
  /// Regions registered now, and the -errno that stopped registration (0: none).
  std::pair<size_t, int> fixed_buffers();
  /// IORING_REGISTER_SYNC_CANCEL of every request on the ring (kernel 6.0+):
  /// those queued or waiting in the kernel complete with -ECANCELED.
  int cancel_in_flight(int timeout_ms) override;

 protected:
  int start(Chunk* chunk) override;
  void flush() override;
  void collect(std::vector<std::pair<Chunk*, int64_t>>* finished, bool submit_queued) override;

 private:
  std::unique_ptr<FixedBufferTable> fixed_;
  bool listening_ = false;
  explicit UringEngine(const EngineOptions& options) : Engine(options) {}
  struct io_uring ring_;
  bool ring_ready_ = false;
  unsigned unsubmitted_ = 0;
};

}  // namespace offload
