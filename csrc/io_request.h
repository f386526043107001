// One I/O request as the engines see it: no tensors, no Python.
#pragma once
#include <cstdint>

namespace offload {

enum class IoKind : uint8_t { kRead = 0, kWrite = 1, kFsync = 2 };

/// A transfer between memory and a file. The memory at [addr, addr + length)
/// must stay valid until the request's completion has been reaped: the engine
/// never owns it.
struct IoRequest {
  uint64_t tag = 0;        ///< returned unchanged in the completion
  IoKind kind = IoKind::kRead;
  int fd = -1;
  void* addr = nullptr;
  uint64_t length = 0;
  uint64_t offset = 0;     ///< file offset
  /// Writes only, with `addr` null: the engine writes `copy_length` bytes
  /// copied from here, zero-filled up to `length`. Each chunk is copied into
  /// a block of the engine's staging pool just before its I/O starts, and the
  /// block goes back once the chunk is done, so the copies overlap the I/O of
  /// earlier chunks and the memory touched is bounded by what is in flight.
  /// The source must stay valid until the completion is reaped.
  const void* copy_from = nullptr;
  uint64_t copy_length = 0;
  /// Optional: the BufferPool block `addr` lies in (its address and
  /// capacity). An io_uring engine registers the mapping it lies in
  /// (BufferPool::region_of: a block under 2 MiB shares its slab's) as a
  /// fixed buffer the first time, and uses fixed reads/writes inside it from
  /// then on.
  const void* region = nullptr;
  uint64_t region_length = 0;
};

/// The outcome of one request: `result` is the full length on success (0 for
/// fsync) or -errno. A request never completes partially.
struct IoCompletion {
  uint64_t tag;
  int64_t result;
};

}  // namespace offload
