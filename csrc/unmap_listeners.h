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

/// fork(): takes the list's lock, so no child inherits it taken; gives it
/// back in the parent, and in the child empties the list first (the child
/// has none of the parent's engines). The buffer pool's fork handlers call
/// these, to take every lock in one order (buffer_pool.cpp).
void lock_listeners_for_fork();
void unlock_listeners_after_fork(bool in_child);

}  // namespace offload
