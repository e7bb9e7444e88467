// Learning-rate schedules over a ShardOptimizer's groups.
//
//   flatshard::optim::LRScheduler sched(opt, flatshard::optim::warmup_then(100, cosine(9900, 0.1)));
//   for (...) { ...; opt.step(); sched.step(); opt.zero_grad(); }
//
// A Schedule is a factor by step (counting from 0): each group's learning rate is its
// base rate times the factor, as torch's LambdaLR. The base rate is the group's lr when the
// optimizer's first scheduler was made (ShardOptimizer::initial_lr, PyTorch's
// initial_lr), also for a second scheduler or one made after a load.
// The scheduler's state (its step and the base rates) is saved in checkpoints
// (checkpoint::SaveOptions::scheduler). See docs/optimizers.md.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "flatshard/optim.h"

namespace flatshard::optim {

class Schedule {
 public:
  using Fn = std::function<double(std::int64_t step)>;
  // `length`: the steps it spans before it holds its last value (0: it never settles).
  Schedule(Fn factor, std::int64_t length, std::string description);
  double operator()(std::int64_t step) const { return factor_(step); }
  std::int64_t length() const { return length_; }
  const std::string& description() const { return description_; }

 private:
  Fn factor_;
  std::int64_t length_;
  std::string description_;
};

// Always `factor`.
Schedule constant(double factor = 1.0);
// (step + 1) / steps for the first `steps` steps, then 1 (the first step is not at 0).
Schedule linear_warmup(std::int64_t steps);
// Half a cosine from 1 to `floor` over `steps` steps, then `floor`.
Schedule cosine(std::int64_t steps, double floor = 0.0);
// A straight line from 1 to `end` over `steps` steps, then `end`.
Schedule linear_decay(std::int64_t steps, double end = 0.0);
// gamma ^ (step / every): multiplied by gamma every `every` steps (torch's StepLR).
Schedule step_decay(std::int64_t every, double gamma);
// `first` for its length, then `second` from its own step 0 (first must settle).
Schedule then(Schedule first, Schedule second);
// linear_warmup(warmup_steps), then `after`.
Schedule warmup_then(std::int64_t warmup_steps, Schedule after);

class LRScheduler {
 public:
  // One schedule for every group.
  LRScheduler(ShardOptimizer& optimizer, Schedule schedule);
  // One schedule per group (in group order).
  LRScheduler(ShardOptimizer& optimizer, std::vector<Schedule> schedules);
  // After optimizer.step(): the next step's learning rates.
  void step();
  // Steps taken (step() calls, and those of a loaded checkpoint).
  std::int64_t steps() const { return steps_; }
  double lr(std::size_t group) const { return optimizer_.lr(group); }
  const std::vector<double>& base_lrs() const { return base_lrs_; }
  // For loading: the step and base rates; sets the optimizer's rates to match.
  void restore(std::int64_t steps, std::vector<double> base_lrs);

 private:
  void apply();
  ShardOptimizer& optimizer_;
  std::vector<Schedule> schedules_;  // by group
  std::vector<double> base_lrs_;     // by group
  std::int64_t steps_ = 0;
};

}  // namespace flatshard::optim
