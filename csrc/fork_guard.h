// Which process an object belongs to. fork() copies memory but not threads:
// an engine made before a fork has no worker threads in the child, and its
// io_uring instance is the parent's. Such an engine must never be driven,
// drained or freed in the child.
#pragma once
#include <cstdint>

namespace offload {

/// A number that changes in every child forked after this library was loaded
/// (pthread_atfork) and nowhere else: record it when creating an object,
/// compare before using it.
uint64_t fork_generation();

}  // namespace offload
