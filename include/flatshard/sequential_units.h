// Splitting a torch::nn::Sequential into units, with no edits to the model.
//
//   torch::nn::Sequential seq(...);
//   flatshard::SequentialUnits model(seq, {.modules_per_unit = 2});
//   model->forward(x);   // runs seq's modules in order, unit hooks around each group
//
// SequentialUnits registers seq's modules under their own names ("0", "1", ...), so
// parameter names and state-dict keys equal those of `seq`. Modules without
// parameters (activations) join the group before them.
#pragma once

#include <memory>
#include <vector>

#include <torch/nn/modules/container/sequential.h>

#include "flatshard/unit.h"

namespace flatshard {

struct SequentialUnitsOptions {
  // Modules with parameters per unit.
  int modules_per_unit = 1;
};

class SequentialUnitsImpl : public torch::nn::Module, public UnitProvider {
 public:
  SequentialUnitsImpl(torch::nn::Sequential sequential, const SequentialUnitsOptions& options = {});
  ~SequentialUnitsImpl() override;
  at::Tensor forward(at::Tensor x);
  std::vector<UnitBase*> provided_units() override;
  std::size_t num_units() const { return groups_.size(); }

 private:
  class Group;
  torch::nn::Sequential sequential_;  // not registered: its modules are, one by one
  std::vector<std::unique_ptr<Group>> groups_;
  std::vector<std::size_t> group_end_;  // groups_[g] covers modules [group_end_[g-1], group_end_[g])
};
TORCH_MODULE(SequentialUnits);

}  // namespace flatshard
