#include "thread_engine.h"

#include <unistd.h>

#include <cerrno>

namespace offload {

int ThreadEngine::create(unsigned threads, const EngineOptions& options, std::unique_ptr<ThreadEngine>* out) {
  if (int rc = check_options(options)) return rc;
  std::unique_ptr<ThreadEngine> engine(new ThreadEngine(threads, options));
  if (engine->event_fd() < 0) return engine->event_fd_error();
  *out = std::move(engine);
  return 0;
}

ThreadEngine::ThreadEngine(unsigned threads, const EngineOptions& options) : Engine(options) {
  if (threads == 0) threads = 1;
  for (unsigned i = 0; i < threads; ++i) workers_.emplace_back([this] { work(); });
}

ThreadEngine::~ThreadEngine() {
  drain();
  {
    std::lock_guard<std::mutex> lock(queue_mu_);
    stopping_ = true;
  }
  queue_cv_.notify_all();
  for (auto& t : workers_) t.join();
}

int ThreadEngine::start(Chunk* c) {
  {
    std::lock_guard<std::mutex> lock(queue_mu_);
    queue_.push_back(c);
  }
  queue_cv_.notify_one();
  return 0;
}

void ThreadEngine::collect(std::vector<std::pair<Chunk*, int64_t>>* finished, bool /*submit_queued*/) {
  std::lock_guard<std::mutex> lock(queue_mu_);
  finished->insert(finished->end(), done_.begin(), done_.end());
  done_.clear();
}

void ThreadEngine::work() {
  for (;;) {
    Chunk* c;
    {
      std::unique_lock<std::mutex> lock(queue_mu_);
      queue_cv_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;
      c = queue_.front();
      queue_.pop_front();
    }
    const IoRequest& io = c->io();
    ssize_t rc = 0;
    if (c->vectored()) {  // requests merged into one I/O, each in its own memory
      const std::vector<struct iovec>& iov = c->iovecs();
      int count = static_cast<int>(iov.size());
      rc = io.kind == IoKind::kRead ? preadv(c->fd, iov.data(), count, static_cast<off_t>(c->file_offset()))
                                    : pwritev(c->fd, iov.data(), count, static_cast<off_t>(c->file_offset()));
    } else switch (io.kind) {
      case IoKind::kRead:
        rc = pread(c->fd, c->addr(), c->remaining(), static_cast<off_t>(c->file_offset()));
        break;
      case IoKind::kWrite:
        rc = pwrite(c->fd, c->addr(), c->remaining(), static_cast<off_t>(c->file_offset()));
        break;
      case IoKind::kFsync:
        rc = fsync(c->fd);
        break;
    }
    int64_t result = rc < 0 ? -static_cast<int64_t>(errno) : static_cast<int64_t>(rc);
    {
      std::lock_guard<std::mutex> lock(queue_mu_);
      done_.emplace_back(c, result);
    }
    signal();
  }
}

}  // namespace offload
