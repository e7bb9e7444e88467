#include "flatshard/recompute.h"

#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <ATen/core/Generator.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/custom_class.h>
#include <torch/nn/module.h>

#include <mutex>
#include <optional>
#include <unordered_set>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "flatshard/errors.h"
#include "flatshard/unit.h"

namespace flatshard {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The generators a forward may draw from: the CPU's, and the default generator of the
// accelerator its tensors live on.
struct RngState {
  at::Tensor cpu;
  std::optional<c10::Device> device;
  at::Tensor on_device;
};

at::Tensor state_of(at::Generator g) {
  std::lock_guard<std::mutex> lock(g.mutex());
  return g.get_state();
}

void restore(at::Generator g, const at::Tensor& state) {
  std::lock_guard<std::mutex> lock(g.mutex());
  g.set_state(state);
}

RngState capture(std::optional<c10::Device> device) {
  RngState s;
  s.cpu = state_of(at::globalContext().defaultGenerator(c10::Device(c10::kCPU)));
  if (device) {
    s.device = device;
    s.on_device = state_of(at::globalContext().defaultGenerator(*device));
  }
  return s;
}

void use_rng(const RngState& s) {
  restore(at::globalContext().defaultGenerator(c10::Device(c10::kCPU)), s.cpu);
  if (s.device) restore(at::globalContext().defaultGenerator(*s.device), s.on_device);
}

std::optional<c10::Device> accelerator_of(at::TensorList a, at::TensorList b) {
  for (at::TensorList list : {a, b}) {
    for (const auto& t : list) {
      if (t.defined() && !t.device().is_cpu() && !t.device().is_meta()) return t.device();
    }
  }
  return std::nullopt;
}

// What backward needs besides the saved inputs.
struct Closure : torch::CustomClassHolder {
  RecomputeForward forward;
  std::vector<at::Tensor> params;  // the parameter objects (their data is swapped by engines)
  std::vector<bool> input_requires_grad;
  RngState rng;
};

// Note [What a recomputed unit may reach]
// Recomputation takes the gradients of the unit's tensor arguments and its own parameters
// (autograd::grad over exactly those). A tensor that requires grad and reaches the re-run
// graph another way (a parameter of the root or of another unit used inside this one, a
// tensor captured by the module rather than passed) would get no gradient and its
// training would silently stop, so backward walks the re-run graph to its leaves and
// refuses any leaf it was not given.
void refuse_unknown_leaves(const std::vector<at::Tensor>& roots, const std::vector<at::Tensor>& known) {
  std::unordered_set<const c10::TensorImpl*> given;
  for (const auto& t : known) given.insert(t.unsafeGetTensorImpl());
  std::unordered_set<const torch::autograd::Node*> seen;
  std::vector<torch::autograd::Node*> stack;
  for (const auto& r : roots) {
    if (r.grad_fn() && seen.insert(r.grad_fn().get()).second) stack.push_back(r.grad_fn().get());
  }
  while (!stack.empty()) {
    torch::autograd::Node* node = stack.back();
    stack.pop_back();
    for (const auto& edge : node->next_edges()) {
      torch::autograd::Node* next = edge.function.get();
      if (next == nullptr || !seen.insert(next).second) continue;
      if (auto* leaf = dynamic_cast<torch::autograd::AccumulateGrad*>(next)) {
        const at::Tensor& v = leaf->variable;
        if (v.defined() && given.count(v.unsafeGetTensorImpl()) == 0) {
          throw InvalidArgument(fmt::format(
              "flatshard::recompute: a recomputed unit's forward used a tensor that requires grad (shape {}) "
              "which is neither one of its parameters nor a tensor passed to its forward (a parameter of the "
              "root "
              "or of another unit, a tensor the module holds, or a tensor passed in a container other than "
              "Tensor, "
              "optional<Tensor> or vector<Tensor>, the argument kinds recomputation takes); its gradient "
              "would be "
              "lost. Pass it to the unit's forward as such an argument, make it a parameter of the unit, or "
              "turn "
              "recomputation off for this unit",
              fmt::join(v.sizes(), "x")));
        }
        continue;
      }
      stack.push_back(next);
    }
  }
}

// Note [Recomputation]
// forward runs the unit under no-grad (custom functions' forward always does), saving
// only the inputs and the generators' states. The unit's parameters are inputs of the
// node too, so its outputs require grad even when its inputs do not, and the
// parameters' gradients leave backward through the node's edges: they reach the
// parameters' own AccumulateGrad nodes in the caller's backward, where the engines'
// hooks fire exactly once. backward runs forward again with grad mode on and the
// generators as they were, takes the gradients of that graph with autograd::grad (which
// accumulates nothing), and puts the generators back as it found them.
class Recompute : public torch::autograd::Function<Recompute> {
 public:
  static variable_list forward(AutogradContext* ctx, const c10::intrusive_ptr<Closure>& closure,
                               at::TensorList inputs, at::TensorList params) {
    closure->rng = capture(accelerator_of(inputs, params));
    for (const auto& t : inputs) closure->input_requires_grad.push_back(t.defined() && t.requires_grad());
    ctx->save_for_backward(inputs.vec());
    ctx->saved_data["closure"] = c10::IValue::make_capsule(closure);
    return closure->forward(inputs.vec());
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    auto closure = c10::static_intrusive_pointer_cast<Closure>(ctx->saved_data["closure"].toCapsule());
    const auto saved = ctx->get_saved_variables();
    std::vector<at::Tensor> inputs;
    for (std::size_t i = 0; i < saved.size(); ++i) {
      auto d = saved[i].defined() ? saved[i].detach() : saved[i];
      if (closure->input_requires_grad[i]) d.requires_grad_(true);
      inputs.push_back(std::move(d));
    }
    variable_list outputs;
    {
      const RngState now = capture(closure->rng.device);
      use_rng(closure->rng);
      at::AutoGradMode grad_on(true);
      try {
        outputs = closure->forward(inputs);
      } catch (...) {
        use_rng(now);
        throw;
      }
      use_rng(now);
    }
    std::vector<at::Tensor> roots, root_grads;
    for (std::size_t i = 0; i < outputs.size() && i < grad_outputs.size(); ++i) {
      if (outputs[i].defined() && outputs[i].requires_grad() && grad_outputs[i].defined()) {
        roots.push_back(outputs[i]);
        root_grads.push_back(grad_outputs[i]);
      }
    }
    std::vector<at::Tensor> wrt;
    std::vector<std::size_t> slot;  // index in the result of each entry of wrt
    const std::size_t first_input = 1, first_param = 1 + inputs.size();
    for (std::size_t i = 0; i < inputs.size(); ++i) {
      if (closure->input_requires_grad[i]) {
        wrt.push_back(inputs[i]);
        slot.push_back(first_input + i);
      }
    }
    for (std::size_t i = 0; i < closure->params.size(); ++i) {
      if (closure->params[i].requires_grad()) {
        wrt.push_back(closure->params[i]);
        slot.push_back(first_param + i);
      }
    }
    // One result per argument of forward: the closure, each input, each parameter.
    variable_list result(first_param + closure->params.size());
    if (roots.empty()) return result;
    refuse_unknown_leaves(roots, wrt);  // Note [What a recomputed unit may reach]
    if (wrt.empty()) return result;
    const auto grads = torch::autograd::grad(roots, wrt, root_grads, /*retain_graph=*/false,
                                             /*create_graph=*/false, /*allow_unused=*/true);
    for (std::size_t k = 0; k < grads.size(); ++k) result[slot[k]] = grads[k];
    return result;
  }
};

}  // namespace

std::vector<at::Tensor> recompute(const RecomputeForward& forward, const std::vector<at::Tensor>& inputs,
                                  const std::vector<at::Tensor>& params) {
  if (!at::GradMode::is_enabled()) return forward(inputs);
  auto closure = c10::make_intrusive<Closure>();
  closure->forward = forward;
  closure->params = params;
  return Recompute::apply(closure, at::TensorList(inputs), at::TensorList(params));
}

int set_recompute(torch::nn::Module& model, bool on) {
  int n = 0;
  for (const auto& m : model.modules(/*include_self=*/true)) {
    if (auto* provider = dynamic_cast<UnitProvider*>(m.get())) {
      for (UnitBase* unit : provider->provided_units()) {
        unit->set_recompute(on);
        ++n;
      }
    }
  }
  return n;
}

}  // namespace flatshard
