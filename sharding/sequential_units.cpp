#include "flatshard/sequential_units.h"

#include "flatshard/errors.h"
#include "flatshard/recompute.h"

namespace flatshard {

// A run of the Sequential's modules sharded as one unit.
class SequentialUnitsImpl::Group final : public UnitBase {
 public:
  std::vector<torch::nn::Module*> unit_modules() override { return modules; }
  std::vector<torch::nn::Module*> modules;
};

SequentialUnitsImpl::SequentialUnitsImpl(torch::nn::Sequential sequential,
                                         const SequentialUnitsOptions& options)
    : sequential_(std::move(sequential)) {
  if (options.modules_per_unit < 1)
    throw InvalidArgument("SequentialUnits: modules_per_unit must be at least 1");
  const auto children = sequential_->named_children();
  int with_params = 0;
  for (std::size_t i = 0; i < children.size(); ++i) {
    const auto& item = children[i];
    register_module(item.key(), item.value());
    const bool has_params = !item.value()->parameters(/*recurse=*/true).empty();
    // A new group starts at every modules_per_unit-th module with parameters.
    if (groups_.empty() || (has_params && with_params % options.modules_per_unit == 0 && with_params > 0 &&
                            !groups_.back()->modules.empty())) {
      if (!groups_.empty()) group_end_.push_back(i);
      groups_.push_back(std::make_unique<Group>());
    }
    if (has_params) ++with_params;
    groups_.back()->modules.push_back(item.value().get());
  }
  group_end_.push_back(children.size());
  // Under BuildIntoShards each group is sharded now (the Sequential was built whole).
  for (auto& g : groups_) detail::unit_constructed(*g);
}

SequentialUnitsImpl::~SequentialUnitsImpl() = default;

std::vector<UnitBase*> SequentialUnitsImpl::provided_units() {
  std::vector<UnitBase*> out;
  for (auto& g : groups_) out.push_back(g.get());
  return out;
}

at::Tensor SequentialUnitsImpl::forward(at::Tensor x) {
  auto module = sequential_->begin();
  std::size_t i = 0;
  for (std::size_t g = 0; g < groups_.size(); ++g) {
    UnitHooks* hooks = groups_[g]->hooks();
    if (hooks) {
      hooks->pre_forward();
      // Note [Casting forward inputs], Note [Watching a unit's inputs]
      x = detail::prepare_input(x, detail::InputPrep{hooks->input_dtype(), hooks->watches_inputs()});
      hooks->watch_inputs({x});
    } else {
      groups_[g]->check_runnable();
    }
    const std::size_t first = i;
    if (groups_[g]->recomputes() && at::GradMode::is_enabled()) {
      auto begin = module;
      const std::size_t end = group_end_[g];
      std::vector<at::Tensor> params;
      for (auto* m : groups_[g]->modules) {
        for (auto& p : m->parameters(/*recurse=*/true)) params.push_back(p);
      }
      RecomputeForward run = [begin, first, end](const std::vector<at::Tensor>& in) {
        auto y = in[0];
        auto it = begin;
        for (std::size_t k = first; k < end; ++k, ++it) y = it->forward(y);
        return std::vector<at::Tensor>{y};
      };
      x = recompute(run, {x}, params)[0];
      for (; i < end; ++i) ++module;
    } else {
      for (; i < group_end_[g]; ++i, ++module) x = module->forward(x);
    }
    if (hooks) x = hooks->post_forward({x})[0];
  }
  return x;
}

}  // namespace flatshard
