#include "fault_injector.h"

namespace offload {

void FaultInjector::set_plan(const FaultPlan& plan) {
  plan_ = plan;
  rng_.seed(plan.seed);
  enabled_ = (plan.error_rate > 0 && !plan.errnos.empty()) || plan.short_rate > 0 ||
             (plan.delay_rate > 0 && plan.delay_ms > 0);
}

int FaultInjector::delay_ms() {
  if (!enabled_ || plan_.delay_rate <= 0 || plan_.delay_ms <= 0) return 0;
  std::uniform_real_distribution<double> coin(0.0, 1.0);
  if (coin(rng_) >= plan_.delay_rate) return 0;
  ++injected_;
  return plan_.delay_ms;
}

int64_t FaultInjector::apply(int64_t result) {
  if (!enabled_ || result < 0) return result;
  std::uniform_real_distribution<double> coin(0.0, 1.0);
  if (plan_.error_rate > 0 && !plan_.errnos.empty() && coin(rng_) < plan_.error_rate) {
    ++injected_;
    return -plan_.errnos[rng_() % plan_.errnos.size()];
  }
  constexpr int64_t kBlock = 4096;
  if (plan_.short_rate > 0 && result > kBlock && coin(rng_) < plan_.short_rate) {
    ++injected_;
    // A whole number of blocks, strictly fewer bytes than were transferred.
    uint64_t whole_blocks_below = static_cast<uint64_t>((result - 1) / kBlock);
    return static_cast<int64_t>(1 + rng_() % whole_blocks_below) * kBlock;
  }
  return result;
}

}  // namespace offload
