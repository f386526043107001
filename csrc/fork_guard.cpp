#include "fork_guard.h"

#include <pthread.h>

#include <atomic>

namespace offload {
namespace {
std::atomic<uint64_t> generation{0};

void in_child() { generation.fetch_add(1, std::memory_order_relaxed); }

struct Registration {
  Registration() { pthread_atfork(nullptr, nullptr, in_child); }
} registration;
}  // namespace

uint64_t fork_generation() { return generation.load(std::memory_order_relaxed); }

}  // namespace offload
