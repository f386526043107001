// The io_uring backend (liburing).
#pragma once
#include <liburing.h>

#include <memory>
#include <vector>

#include "engine.h"

namespace offload {

/// Chunks become io_uring read/write/fsync SQEs. The engine's eventfd is
/// registered with io_uring_register_eventfd (not the _async variant, which
/// misses completions that finish inline during submission).
class UringEngine final : public Engine {
 public:
  /// Sets up a ring of `entries` SQEs. Returns 0 or -errno: -EPERM when
  /// io_uring is forbidden (seccomp, kernel.io_uring_disabled), -ENOSYS when
  /// the kernel or a filter does not know it, -ENOMEM when RLIMIT_MEMLOCK is
  /// too low for the ring.
  static int create(unsigned entries, const EngineOptions& options,
                    std::unique_ptr<UringEngine>* out);
  ~UringEngine() override;
  const char* name() const override { return "uring"; }

 protected:
  int start(Chunk* chunk) override;
  void flush() override;
  void collect(std::vector<std::pair<Chunk*, int64_t>>* finished) override;
  int register_regions(const std::vector<std::pair<void*, size_t>>& regions) override;

 private:
  /// The fixed-buffer slot whose region holds [addr, addr + length), or -1.
  int fixed_slot(const void* addr, uint64_t length) const;
  std::vector<std::pair<const char*, size_t>> fixed_;
  explicit UringEngine(const EngineOptions& options) : Engine(options) {}
  struct io_uring ring_;
  bool ring_ready_ = false;
  unsigned unsubmitted_ = 0;
};

}  // namespace offload
