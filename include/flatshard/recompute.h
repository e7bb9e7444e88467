// Activation recomputation (activation checkpointing) for units.
//
//   flatshard::set_recompute(*model);       // every Unit<M> / SequentialUnits group
//   model->blocks[3]->set_recompute(true);  // or one unit
//
// A unit marked for recomputation keeps only its inputs from forward (its internals are
// computed without saving anything for backward). In backward, when its output
// gradients arrive, the unit's forward runs again with the random number generators
// restored to their state at the first run (dropout draws the same masks), and the
// gradients of its inputs and parameters come from that second run. Under FullyShard
// the unit is gathered for backward as always before the second run. Works with or
// without an engine attached (DDP, ZeRO-1, plain LibTorch): it is the unit's own
// forward. See docs/recompute.md.
#pragma once

#include <functional>
#include <vector>

#include <ATen/core/Tensor.h>

namespace torch::nn {
class Module;
}

namespace flatshard {

using RecomputeForward = std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)>;

// Runs `forward(inputs)` without keeping its intermediate results, and arranges for
// backward to run it again to produce the gradients of `inputs` and `params` (the
// parameters `forward` uses). Gradients reach the parameters through their usual
// accumulators, so hooks on them (the engines') fire once, in the caller's backward.
// Outside grad mode it is a plain call.
std::vector<at::Tensor> recompute(const RecomputeForward& forward, const std::vector<at::Tensor>& inputs,
                                  const std::vector<at::Tensor>& params);

// Marks (or unmarks) every unit declared in `model` for recomputation; returns how many.
int set_recompute(torch::nn::Module& model, bool on = true);

}  // namespace flatshard
