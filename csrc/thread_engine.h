// The thread-pool backend: pread/pwrite on worker threads.
#pragma once
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>
#include <vector>

#include "engine.h"

namespace offload {

/// For machines where io_uring is blocked. Each worker takes a chunk, makes
/// one pread/pwrite/fsync call and posts the raw result; the engine's common
/// code resubmits short transfers exactly as for io_uring. Workers touch only
/// the chunk queue, never Python.
class ThreadEngine final : public Engine {
 public:
  /// Starts `threads` workers (0: one). Returns 0, or -errno: -EINVAL for
  /// options no engine runs with, the eventfd's error (EMFILE, ENOMEM).
  static int create(unsigned threads, const EngineOptions& options, std::unique_ptr<ThreadEngine>* out);
  ~ThreadEngine() override;
  const char* name() const override { return "threads"; }

 protected:
  int start(Chunk* chunk) override;
  void flush() override {}
  void collect(std::vector<std::pair<Chunk*, int64_t>>* finished, bool submit_queued) override;

 private:
  ThreadEngine(unsigned threads, const EngineOptions& options);
  void work();

  std::mutex queue_mu_;
  std::condition_variable queue_cv_;
  std::deque<Chunk*> queue_;
  std::vector<std::pair<Chunk*, int64_t>> done_;
  bool stopping_ = false;
  std::vector<std::thread> workers_;
};

}  // namespace offload
