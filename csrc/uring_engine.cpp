#include "uring_engine.h"

#include <cerrno>

namespace offload {
namespace {
constexpr unsigned kFixedSlots = 1024;  // registered regions per ring (pool blocks, staging slots)
}  // namespace

int UringEngine::create(unsigned entries, const EngineOptions& options,
                        std::unique_ptr<UringEngine>* out) {
  if (entries == 0) return -EINVAL;
  if (int rc = check_options(options)) return rc;
  EngineOptions clamped = options;
  // The CQ holds twice the SQ, so this many in flight can never overflow it.
  if (clamped.max_in_flight > entries) clamped.max_in_flight = entries;
  std::unique_ptr<UringEngine> engine(new UringEngine(clamped));
  if (engine->event_fd() < 0) return engine->event_fd_error();
  int rc = io_uring_queue_init(entries, &engine->ring_, 0);
  if (rc < 0) return rc;
  engine->ring_ready_ = true;
  // The rings are the parent's alone: a forked child gets no mapping of them
  // (so nothing it does can submit on the parent's ring).
  rc = io_uring_ring_dontfork(&engine->ring_);
  if (rc < 0) return rc;
  rc = io_uring_register_eventfd(&engine->ring_, engine->event_fd());
  if (rc < 0) return rc;
  engine->fixed_ = std::make_unique<FixedBufferTable>(&engine->ring_, kFixedSlots);
  add_unmap_listener(engine.get());
  engine->listening_ = true;
  *out = std::move(engine);
  return 0;
}

UringEngine::~UringEngine() {
  if (listening_) remove_unmap_listener(this);
  if (!ring_ready_) return;
  drain();
  io_uring_queue_exit(&ring_);
}

int UringEngine::start(Chunk* c) {
  struct io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
  if (sqe == nullptr) {  // SQ full of unsubmitted entries: push them to the kernel
    flush();
    sqe = io_uring_get_sqe(&ring_);
    if (sqe == nullptr) return -EBUSY;
  }
  const IoRequest& io = c->io();
  if (c->vectored()) {  // requests merged into one I/O, each in its own memory
    const std::vector<struct iovec>& iov = c->iovecs();
    if (io.kind == IoKind::kRead)
      io_uring_prep_readv(sqe, c->fd, iov.data(), static_cast<unsigned>(iov.size()), c->file_offset());
    else
      io_uring_prep_writev(sqe, c->fd, iov.data(), static_cast<unsigned>(iov.size()), c->file_offset());
  } else {
    unsigned length = static_cast<unsigned>(c->remaining());
    int slot = io.kind == IoKind::kFsync || c->region() == nullptr
                   ? -1
                   : fixed_->slot_for(c->region(), c->region_length(), c->addr(), length);
    switch (io.kind) {
      case IoKind::kRead:
        if (slot >= 0)
          io_uring_prep_read_fixed(sqe, c->fd, c->addr(), length, c->file_offset(), slot);
        else
          io_uring_prep_read(sqe, c->fd, c->addr(), length, c->file_offset());
        break;
      case IoKind::kWrite:
        if (slot >= 0)
          io_uring_prep_write_fixed(sqe, c->fd, c->addr(), length, c->file_offset(), slot);
        else
          io_uring_prep_write(sqe, c->fd, c->addr(), length, c->file_offset());
        break;
      case IoKind::kFsync:
        io_uring_prep_fsync(sqe, c->fd, 0);
        break;
    }
  }
  io_uring_sqe_set_data(sqe, c);
  ++unsubmitted_;
  return 0;
}

void UringEngine::flush() {
  // -EINTR/-EAGAIN/-EBUSY leave the SQEs queued; the next reap() flushes again.
  while (unsubmitted_ > 0) {
    int rc = io_uring_submit(&ring_);
    if (rc <= 0) return;
    unsubmitted_ -= static_cast<unsigned>(rc) < unsubmitted_ ? static_cast<unsigned>(rc) : unsubmitted_;
  }
}

void UringEngine::before_unmap(const void* base, size_t length) {
  std::lock_guard<std::mutex> guard(lock());
  fixed_->forget(base, length);
}

std::pair<size_t, int> UringEngine::fixed_buffers() {
  std::lock_guard<std::mutex> guard(lock());
  return {fixed_->registered(), fixed_->error()};
}

int UringEngine::cancel_in_flight(int timeout_ms) {
  {
    std::lock_guard<std::mutex> guard(lock());
    flush();  // only what the kernel has seen can be cancelled
  }
  struct io_uring_sync_cancel_reg reg = {};
  reg.fd = -1;
  reg.flags = IORING_ASYNC_CANCEL_ANY;
  reg.timeout.tv_sec = timeout_ms < 0 ? -1 : timeout_ms / 1000;
  reg.timeout.tv_nsec = timeout_ms < 0 ? -1 : (timeout_ms % 1000) * 1000000LL;
  int rc = io_uring_register_sync_cancel(&ring_, &reg);
  // -ENOENT: nothing left to cancel; -EALREADY: at the device, it finishes on
  // its own; -ETIME: not let go of in time. Either way the caller waits on.
  return rc == -EINVAL || rc == -EOPNOTSUPP ? -ENOTSUP : 0;
}

void UringEngine::collect(std::vector<std::pair<Chunk*, int64_t>>* finished, bool submit_queued) {
  if (submit_queued) flush();
  struct io_uring_cqe* cqe;
  unsigned head, seen = 0;
  io_uring_for_each_cqe(&ring_, head, cqe) {
    finished->emplace_back(static_cast<Chunk*>(io_uring_cqe_get_data(cqe)), cqe->res);
    ++seen;
  }
  io_uring_cq_advance(&ring_, seen);
}

}  // namespace offload
