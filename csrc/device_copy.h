// Copies into memory that a device reads next, not the CPU.
#pragma once
#include <cstddef>

namespace offload {

/// Copies `n` bytes from `src` to `dst` (which must not overlap) for a
/// device to read by DMA: a staging block an O_DIRECT write is about to go
/// from. On x86-64 the bulk goes with non-temporal stores, which write whole
/// cache lines to memory without first reading them into the cache, and
/// without evicting what the cache holds: a third less memory traffic than
/// memcpy for bytes the CPU will not read again (BENCHMARKS.md, "Staging
/// copies that bypass the cache"). Returns once every byte is visible to a
/// device (a store fence), so the caller may hand `dst` to the kernel at
/// once. Small copies, and other architectures, use memcpy.
void copy_for_device(void* dst, const void* src, size_t n);

}  // namespace offload
