// Who must hear of memory before it is unmapped (io_uring engines holding
// registrations of it). No liburing here: the buffer pool builds without it.
#pragma once
#include <cstddef>

namespace offload {

/// Told before memory is unmapped, so registrations never outlive it.
class UnmapListener {
 public:
  virtual void before_unmap(const void* base, size_t length) = 0;

 protected:
  ~UnmapListener() = default;
};

/// The process-wide list of listeners (the io_uring engines); empty again in
/// a forked child.
void add_unmap_listener(UnmapListener* listener);
void remove_unmap_listener(UnmapListener* listener);  ///< waits for a call in progress
void notify_before_unmap(const void* base, size_t length);

}  // namespace offload
