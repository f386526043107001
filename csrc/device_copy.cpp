#include "device_copy.h"

#include <cstdint>
#include <cstring>

#if defined(__x86_64__)
#include <emmintrin.h>  // SSE2: part of every x86-64
#endif

namespace offload {

#if defined(__x86_64__)
namespace {
constexpr size_t kLine = 64;
// Below this the copy is likely still in the cache when the device reads it,
// and a fence would cost more than the traffic it saves.
constexpr size_t kStreamFrom = 4096;
}  // namespace

void copy_for_device(void* dst, const void* src, size_t n) {
  if (n < kStreamFrom) {
    std::memcpy(dst, src, n);
    return;
  }
  char* d = static_cast<char*>(dst);
  const char* s = static_cast<const char*>(src);
  // Whole destination lines only: a partly written line would leave the
  // write-combining buffer in pieces.
  size_t head = (kLine - reinterpret_cast<uintptr_t>(d) % kLine) % kLine;
  std::memcpy(d, s, head);
  d += head;
  s += head;
  n -= head;
  size_t body = n - n % kLine;
  for (size_t i = 0; i < body; i += kLine) {
    __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i));
    __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 16));
    __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 32));
    __m128i e = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 48), e);
  }
  std::memcpy(d + body, s + body, n - body);
  _mm_sfence();  // non-temporal stores are weakly ordered: in memory before the I/O starts
}
#else
void copy_for_device(void* dst, const void* src, size_t n) { std::memcpy(dst, src, n); }
#endif

}  // namespace offload
