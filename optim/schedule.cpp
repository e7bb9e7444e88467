// Learning-rate schedules: factors by step, and the scheduler that applies them.
#include "flatshard/schedule.h"

#include <cmath>

#include <fmt/format.h>

#include "flatshard/errors.h"

namespace flatshard::optim {
namespace {

void check_length(std::int64_t steps, const char* what) {
  if (steps <= 0) {
    throw InvalidArgument(fmt::format(
        "flatshard::optim::{}: the length must be at least one step (got {}); leave the schedule out for "
        "none",
        what, steps));
  }
}

}  // namespace

Schedule::Schedule(Fn factor, std::int64_t length, std::string description)
    : factor_(std::move(factor)), length_(length), description_(std::move(description)) {}

Schedule constant(double factor) {
  return Schedule([factor](std::int64_t) { return factor; }, 0, fmt::format("constant({})", factor));
}

Schedule linear_warmup(std::int64_t steps) {
  check_length(steps, "linear_warmup");
  return Schedule(
      [steps](std::int64_t t) {
        return t >= steps ? 1.0 : static_cast<double>(t + 1) / static_cast<double>(steps);
      },
      steps, fmt::format("linear_warmup({})", steps));
}

Schedule cosine(std::int64_t steps, double floor) {
  check_length(steps, "cosine");
  return Schedule(
      [steps, floor](std::int64_t t) {
        if (t >= steps) return floor;
        const double progress = static_cast<double>(t) / static_cast<double>(steps);
        return floor + (1.0 - floor) * 0.5 * (1.0 + std::cos(M_PI * progress));
      },
      steps, fmt::format("cosine({}, floor {})", steps, floor));
}

Schedule linear_decay(std::int64_t steps, double end) {
  check_length(steps, "linear_decay");
  return Schedule(
      [steps, end](std::int64_t t) {
        if (t >= steps) return end;
        return 1.0 + (end - 1.0) * static_cast<double>(t) / static_cast<double>(steps);
      },
      steps, fmt::format("linear_decay({}, end {})", steps, end));
}

Schedule step_decay(std::int64_t every, double gamma) {
  check_length(every, "step_decay");
  return Schedule([every, gamma](std::int64_t t) { return std::pow(gamma, static_cast<double>(t / every)); },
                  0, fmt::format("step_decay(every {}, gamma {})", every, gamma));
}

Schedule then(Schedule first, Schedule second) {
  if (first.length() <= 0) {
    throw InvalidArgument(fmt::format("flatshard::optim::then: '{}' never ends, so '{}' would never start",
                                      first.description(), second.description()));
  }
  const std::int64_t n = first.length();
  const std::int64_t length = second.length() > 0 ? n + second.length() : 0;
  std::string description = first.description() + " then " + second.description();
  return Schedule([first, second, n](std::int64_t t) { return t < n ? first(t) : second(t - n); }, length,
                  std::move(description));
}

Schedule warmup_then(std::int64_t warmup_steps, Schedule after) {
  return then(linear_warmup(warmup_steps), std::move(after));
}

LRScheduler::LRScheduler(ShardOptimizer& optimizer, Schedule schedule)
    : LRScheduler(optimizer, std::vector<Schedule>(optimizer.num_groups(), schedule)) {}

LRScheduler::LRScheduler(ShardOptimizer& optimizer, std::vector<Schedule> schedules)
    : optimizer_(optimizer), schedules_(std::move(schedules)) {
  if (schedules_.size() != optimizer_.num_groups()) {
    throw InvalidArgument(
        fmt::format("flatshard::optim::LRScheduler: {} schedules for {} parameter groups; "
                    "give one per group, or one for all",
                    schedules_.size(), optimizer_.num_groups()));
  }
  // Note [A schedule's base rate]
  for (std::size_t g = 0; g < optimizer_.num_groups(); ++g) base_lrs_.push_back(optimizer_.initial_lr(g));
  apply();
}

void LRScheduler::step() {
  ++steps_;
  apply();
}

void LRScheduler::restore(std::int64_t steps, std::vector<double> base_lrs) {
  if (base_lrs.size() != base_lrs_.size()) {
    throw InvalidArgument(fmt::format("flatshard::optim::LRScheduler: {} base rates for {} groups",
                                      base_lrs.size(), base_lrs_.size()));
  }
  steps_ = steps;
  base_lrs_ = std::move(base_lrs);
  apply();
}

void LRScheduler::apply() {
  for (std::size_t g = 0; g < base_lrs_.size(); ++g)
    optimizer_.set_lr(g, base_lrs_[g] * schedules_[g](steps_));
}

}  // namespace flatshard::optim
