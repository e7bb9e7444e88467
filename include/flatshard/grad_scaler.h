// Dynamic loss scaling for fp16 training over shards (torch.amp.GradScaler's rule).
//
//   flatshard::optim::GradScaler scaler(fsdp);
//   scaler.scale(loss).backward();
//   scaler.unscale(opt);            // optional: before clipping
//   fsdp.clip_grad_norm(1.0);
//   scaler.step(opt);               // skipped on every rank when any rank's gradients overflowed
//   scaler.update();
//
// The loss is multiplied by the scale so that small fp16 gradients do not flush to zero;
// the fp32 shard gradients are divided by it before the step. A NaN or Inf in any rank's
// shard gradients (one small collective) skips the step on every rank and halves the
// scale; after growth_interval clean steps in a row the scale doubles. Its state is saved
// in checkpoints (checkpoint::SaveOptions::scaler). See docs/optimizers.md.
//
// With FullyShardOptions::nonfinite_grads = Skip the wrapper drops an overflowed step's
// gradients itself; the scaler counts that step as an overflow (skipped, the scale backed
// off). nonfinite_grads = Raise is refused: loss scaling overflows by design.
#pragma once

#include <cstdint>

#include <ATen/core/Tensor.h>

#include "flatshard/optim.h"

namespace flatshard {
class FullyShardBase;
}

namespace flatshard::optim {

struct GradScalerOptions {
  double init_scale = 65536.0;
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  std::int64_t growth_interval = 2000;
};

class GradScaler {
 public:
  // Warns (once) that it is not needed when the wrapper computes in bf16 or fp32.
  explicit GradScaler(FullyShardBase& fsdp, const GradScalerOptions& options = {});
  // loss * scale.
  at::Tensor scale(const at::Tensor& loss) const;
  // Divides the optimizer's shard gradients by the scale and finds, on every rank, whether
  // any rank's hold NaN or Inf. A collective; at most once between two update()s, and not
  // after step() (InvalidArgument, as torch.amp refuses it: a second call would divide the
  // gradients by the scale twice).
  void unscale(ShardOptimizer& optimizer);
  // Unscales (if not yet) and steps the optimizer unless gradients overflowed. Returns
  // whether it stepped. Called again before update(), it throws InvalidArgument.
  bool step(ShardOptimizer& optimizer);
  // Halves the scale after an overflow; multiplies it by growth_factor after
  // growth_interval clean steps in a row. Call once per step, after step().
  void update();

  double scale() const { return scale_; }
  std::int64_t growth_tracker() const { return growth_tracker_; }  // clean steps in a row
  std::int64_t skipped_steps() const { return skipped_steps_; }
  // For loading.
  void restore(double scale, std::int64_t growth_tracker);

 private:
  void unscale_gradients(ShardOptimizer& optimizer);

  FullyShardBase& fsdp_;
  GradScalerOptions options_;
  double scale_;
  std::int64_t growth_tracker_ = 0;
  std::int64_t skipped_steps_ = 0;
  std::int64_t wrapper_skips_ = 0;  // the wrapper's skipped_steps() when last unscaled
  bool unscaled_ = false;           // this step's gradients were unscaled
  bool found_inf_ = false;          // ... and some rank's held NaN or Inf
  bool stepped_ = false;            // step() ran since the last update()
};

}  // namespace flatshard::optim
