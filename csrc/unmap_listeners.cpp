#include "unmap_listeners.h"

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
}  // namespace

void lock_listeners_for_fork() { listeners_mu.lock(); }

void unlock_listeners_after_fork(bool in_child) {
  if (in_child) listeners().clear();
  listeners_mu.unlock();
}

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
