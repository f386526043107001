#include "unmap_listeners.h"

#include <pthread.h>

#include <algorithm>
#include <mutex>
#include <vector>

namespace offload {

namespace {
std::mutex listeners_mu;
std::vector<UnmapListener*>& listeners() {
  static std::vector<UnmapListener*> all;
  return all;
}

// A forked child has none of the parent's engines: its pool must not tell
// them (and through them the parent's ring) about its own unmaps. The lock
// is held across fork() so the child never inherits it taken.
void before_fork() { listeners_mu.lock(); }
void in_parent() { listeners_mu.unlock(); }
void in_child() {
  listeners().clear();
  listeners_mu.unlock();
}
struct ForkHandlers {
  ForkHandlers() { pthread_atfork(before_fork, in_parent, in_child); }
} fork_handlers;
}  // namespace

void add_unmap_listener(UnmapListener* listener) {
  std::lock_guard<std::mutex> lock(listeners_mu);
  listeners().push_back(listener);
}

void remove_unmap_listener(UnmapListener* listener) {
  std::lock_guard<std::mutex> lock(listeners_mu);
  auto& all = listeners();
  all.erase(std::remove(all.begin(), all.end(), listener), all.end());
}

void notify_before_unmap(const void* base, size_t length) {
  std::lock_guard<std::mutex> lock(listeners_mu);
  for (UnmapListener* listener : listeners()) listener->before_unmap(base, length);
}

}  // namespace offload
