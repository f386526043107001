// Deliberate I/O failures, for tests of the error paths on a normal build.
#pragma once
#include <cstdint>
#include <mutex>
#include <random>
#include <vector>

namespace offload {

/// What to do to each finished chunk I/O. Rates are probabilities in [0, 1].
/// The I/O itself has run: the engine overwrites a read's memory when it
/// reports an injected error for it, so that its data does not survive, and
/// the bytes an injected short read leaves unreported, which must be read again,
/// and writes a pattern into the file where an injected short write left bytes
/// unreported, which must be written again.
struct FaultPlan {
  double error_rate = 0;       ///< replace the result with one of `errnos`
  std::vector<int> errnos;     ///< positive errno values (EIO, ENOSPC, EAGAIN...)
  double short_rate = 0;       ///< report only part of the bytes as transferred
  double delay_rate = 0;       ///< hold the completion back for `delay_ms`
  int delay_ms = 0;
  uint64_t seed = 1;
};

/// Rewrites chunk results according to a FaultPlan. Off by default, and a
/// single branch when off. A short result keeps the file offset alignment,
/// so the engine's resubmission of the remainder stays valid for O_DIRECT.
class FaultInjector {
 public:
  void set_plan(const FaultPlan& plan);
  bool enabled() const { return enabled_; }
  /// The result the engine should act on, given the real one.
  int64_t apply(int64_t result);
  /// How long to hold this completion back before acting on it (0: don't).
  int delay_ms();
  uint64_t injected() const { return injected_; }

 private:
  bool enabled_ = false;
  FaultPlan plan_;
  std::mt19937_64 rng_;
  uint64_t injected_ = 0;
};

}  // namespace offload
