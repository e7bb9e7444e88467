// Dynamic loss scaling over shards.
#include "flatshard/grad_scaler.h"

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include "flatshard/errors.h"
#include "flatshard/fully_shard.h"
#include "optim/clip.h"
#include "src/logging.h"

namespace flatshard::optim {

GradScaler::GradScaler(FullyShardBase& fsdp, const GradScalerOptions& options)
    : fsdp_(fsdp), options_(options), scale_(options.init_scale) {
  const auto who = fmt::format("flatshard::optim::GradScaler (rank {}/{})", fsdp.world().rank(),
                               fsdp.world().world_size());
  if (!(options.init_scale > 0) || !(options.growth_factor > 1) || !(options.backoff_factor > 0) ||
      !(options.backoff_factor < 1) || options.growth_interval < 1) {
    throw InvalidArgument(fmt::format(
        "{}: needs init_scale > 0, growth_factor > 1, 0 < backoff_factor < 1 and growth_interval >= 1 (got "
        "{}, "
        "{}, {}, {})",
        who, options.init_scale, options.growth_factor, options.backoff_factor, options.growth_interval));
  }
  if (fsdp.nonfinite_grads() == NonFiniteGrads::Raise) {
    throw InvalidArgument(fmt::format(
        "{}: the wrapper raises on NaN/Inf gradients (FullyShardOptions::nonfinite_grads = Raise), but loss "
        "scaling overflows by design now and then; set nonfinite_grads to Skip (the scaler backs off on the "
        "steps the wrapper drops) or Ignore (the scaler finds overflows itself)",
        who));
  }
  wrapper_skips_ = fsdp.skipped_steps();
  const at::ScalarType dtype = fsdp.param_dtype();
  if (dtype != at::kHalf) {
    log::at(
        log::Level::Warn,
        "{}: the model computes in {}, whose range is fp32's: loss scaling is not needed (it only costs a "
        "collective per step); drop the scaler, or set MixedPrecision::param = at::kHalf",
        who, c10::toString(dtype));
  }
}

at::Tensor GradScaler::scale(const at::Tensor& loss) const { return loss * scale_; }

void GradScaler::unscale(ShardOptimizer& optimizer) {
  if (unscaled_) {
    throw InvalidArgument(fmt::format(
        "flatshard::optim::GradScaler (rank {}/{}): unscale() {} since the last update(): this step's "
        "gradients are already unscaled; call unscale() at most once per step, before step(), and update() "
        "after each step()",
        fsdp_.world().rank(), fsdp_.world().world_size(),
        stepped_ ? "is called after step()" : "was already called"));
  }
  unscale_gradients(optimizer);
}

void GradScaler::unscale_gradients(ShardOptimizer& optimizer) {
  if (fsdp_.steps_in_backward()) {
    throw InvalidArgument(fmt::format(
        "flatshard::optim::GradScaler (rank {}/{}): the optimizer steps inside backward (step_in_backward), "
        "on gradients still scaled and before any rank could be checked for overflow; turn step_in_backward "
        "off to scale the loss",
        fsdp_.world().rank(), fsdp_.world().world_size()));
  }
  // The wrapper dropped this step's gradients for NaN/Inf (NonFiniteGrads::Skip): an
  // overflow, seen by every rank alike, with nothing left to unscale or check.
  const std::int64_t wrapper_skips = fsdp_.skipped_steps();
  found_inf_ = wrapper_skips != wrapper_skips_;
  wrapper_skips_ = wrapper_skips;
  if (found_inf_) {
    unscaled_ = true;
    return;
  }
  std::vector<at::Tensor> grads;
  at::NoGradGuard no_grad;
  const double inverse = 1.0 / scale_;
  for (const auto& s : optimizer.shards()) {
    if (!s.grad().defined()) continue;
    s.grad().mul_(inverse);
    grads.push_back(s.grad());
  }
  found_inf_ = !nonfinite_ranks(grads, fsdp_.comm()).empty();
  unscaled_ = true;
}

bool GradScaler::step(ShardOptimizer& optimizer) {
  if (stepped_) {  // the next step's gradients would not be unscaled (as torch.amp refuses it)
    throw InvalidArgument(fmt::format(
        "flatshard::optim::GradScaler (rank {}/{}): step() was already called since the last update(); call "
        "update() after each step()",
        fsdp_.world().rank(), fsdp_.world().world_size()));
  }
  if (!unscaled_) unscale_gradients(optimizer);
  if (found_inf_) {
    stepped_ = true;
    ++skipped_steps_;
    log::at(log::Level::Info, "GradScaler: gradients overflowed at scale {}: the step is skipped", scale_);
    return false;
  }
  optimizer.step();
  stepped_ = true;
  return true;
}

void GradScaler::update() {
  if (!unscaled_) {  // as torch.amp's "No inf checks were recorded prior to update"
    throw InvalidArgument(fmt::format(
        "flatshard::optim::GradScaler (rank {}/{}): update() found no unscale() or step() since the last "
        "update(): step through the scaler (scaler.step(optimizer)); optimizer.step() alone steps gradients "
        "still multiplied by the scale",
        fsdp_.world().rank(), fsdp_.world().world_size()));
  }
  if (found_inf_) {
    scale_ *= options_.backoff_factor;
    growth_tracker_ = 0;
  } else if (++growth_tracker_ >= options_.growth_interval) {
    scale_ *= options_.growth_factor;
    growth_tracker_ = 0;
  }
  unscaled_ = false;
  found_inf_ = false;
  stepped_ = false;
}

void GradScaler::restore(double scale, std::int64_t growth_tracker) {
  if (!(scale > 0))
    throw InvalidArgument(fmt::format("flatshard::optim::GradScaler: scale must be > 0 (got {})", scale));
  scale_ = scale;
  growth_tracker_ = growth_tracker;
  wrapper_skips_ = fsdp_.skipped_steps();
  unscaled_ = false;
  found_inf_ = false;
  stepped_ = false;
}

}  // namespace flatshard::optim
