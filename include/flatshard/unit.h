// Unit boundaries, declared in the model's type.
//
// LibTorch modules have no forward hooks, so a model says where its sharding units are
// by declaring members as flatshard::Unit<M> instead of M:
//
//   struct GPTImpl : torch::nn::Module {
//     std::vector<flatshard::Unit<Block>> blocks;   // Block is a TORCH_MODULE holder
//     ...
//       blocks.emplace_back(cfg);
//       register_module("h" + std::to_string(i), blocks.back());
//   };
//
// A Unit<M> *is* an M (its module type derives from M's), so parameter names,
// parameters() and state-dict keys are exactly those of the plain model. Calling it
// runs M's forward; when an engine is attached it also runs the unit's pre-forward
// (gather) and post-forward (reshard, backward hooks) steps. With no engine it is a
// plain pass-through. For a torch::nn::Sequential, see SequentialUnits
// (sequential_units.h), which needs no edits to the model.
#pragma once

#include <memory>
#include <optional>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include <ATen/core/grad_mode.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include "flatshard/recompute.h"

namespace flatshard {

namespace sharding {
class FlatParamGroup;
}

// What an engine does around a unit's forward. Implemented by the engines.
class UnitHooks {
 public:
  virtual ~UnitHooks() = default;
  virtual void pre_forward() = 0;
  // Called with every tensor the unit's forward returned; returns them (possibly
  // wrapped for the backward hooks) in the same order.
  virtual std::vector<at::Tensor> post_forward(std::vector<at::Tensor> outputs) = 0;
  // The dtype the unit's floating-point tensor arguments are cast to before its forward
  // (MixedPrecision::cast_forward_inputs); nullopt: none.
  virtual std::optional<at::ScalarType> input_dtype() const { return std::nullopt; }
  // Called after pre_forward with the tensors the unit's forward is about to get (after
  // the cast): the engine learns from their gradients when the unit's backward is done
  // (Note [Partly frozen units]).
  virtual void watch_inputs(const std::vector<at::Tensor>& /*inputs*/) {}
};

// A sharding unit: the parameters of `unit_modules()` (recursively, minus those of any
// nested unit) are flattened, sharded and gathered together.
class UnitBase {
 public:
  virtual ~UnitBase() = default;
  virtual std::vector<torch::nn::Module*> unit_modules() = 0;
  void attach(UnitHooks* hooks) { hooks_ = hooks; }
  UnitHooks* hooks() const { return hooks_; }
  // Activation recomputation (recompute.h): keep only the unit's inputs from forward and
  // run its forward again in backward.
  void set_recompute(bool on) { recompute_ = on; }
  bool recomputes() const { return recompute_; }
  // The unit's shard, made as it was built (build.h), until a wrapper adopts it.
  const std::shared_ptr<sharding::FlatParamGroup>& built_shard() const { return built_; }
  void set_built_shard(std::shared_ptr<sharding::FlatParamGroup> shard) { built_ = std::move(shard); }
  // Throws InvalidArgument when the unit holds a built shard and no wrapper runs it.
  void check_runnable() const;

 private:
  UnitHooks* hooks_ = nullptr;  // the engine's, while one is attached
  bool recompute_ = false;
  std::shared_ptr<sharding::FlatParamGroup> built_;
};

// Modules that declare units (Unit<M> declares itself; SequentialUnits its groups).
class UnitProvider {
 public:
  virtual ~UnitProvider() = default;
  virtual std::vector<UnitBase*> provided_units() = 0;
};

namespace detail {

inline std::vector<at::Tensor> tensors_of(const at::Tensor& t) { return {t}; }
inline std::vector<at::Tensor> tensors_of(const std::vector<at::Tensor>& v) { return v; }
template <typename... T>
std::vector<at::Tensor> tensors_of(const std::tuple<T...>& t) {
  std::vector<at::Tensor> out;
  std::apply([&](const auto&... x) { (out.push_back(x), ...); }, t);
  return out;
}

inline at::Tensor rebuild(const at::Tensor&, std::vector<at::Tensor>& v) { return v[0]; }
inline std::vector<at::Tensor> rebuild(const std::vector<at::Tensor>&, std::vector<at::Tensor>& v) {
  return v;
}
template <typename... T>
std::tuple<T...> rebuild(const std::tuple<T...>&, std::vector<at::Tensor>& v) {
  std::size_t i = 0;
  return std::tuple<T...>{(static_cast<void>(sizeof(T)), v[i++])...};
}

// Recomputation of a forward with arbitrary arguments: the tensor arguments become the
// recomputed function's inputs (in order); the others are kept as they were passed.
template <typename T>
decltype(auto) substitute(const T& arg, const std::vector<at::Tensor>&, std::size_t&) {
  return arg;
}
inline at::Tensor substitute(const at::Tensor&, const std::vector<at::Tensor>& tensors, std::size_t& next) {
  return tensors[next++];
}
template <typename T>
void collect_tensor(const T&, std::vector<at::Tensor>&) {}
inline void collect_tensor(const at::Tensor& t, std::vector<at::Tensor>& out) { out.push_back(t); }

// Every tensor among a forward's arguments: tensors, optional tensors, vectors of tensors.
template <typename T>
void tensor_arguments(const T&, std::vector<at::Tensor>&) {}
inline void tensor_arguments(const at::Tensor& t, std::vector<at::Tensor>& out) {
  if (t.defined()) out.push_back(t);
}
inline void tensor_arguments(const std::optional<at::Tensor>& t, std::vector<at::Tensor>& out) {
  if (t) tensor_arguments(*t, out);
}
inline void tensor_arguments(const std::vector<at::Tensor>& v, std::vector<at::Tensor>& out) {
  for (const auto& t : v) tensor_arguments(t, out);
}

// Note [Casting forward inputs]
// Under mixed precision, the floating-point tensors passed to the wrapper's forward and to
// each unit's are cast to the compute dtype before the call, as FSDP2 does
// (MixedPrecisionPolicy.cast_forward_inputs): an fp32 batch of features, or an activation
// that an fp32 buffer promoted to fp32 between units, would otherwise meet bf16 weights in
// a matrix product and fail. Tensors, optional tensors and vectors of tensors are cast;
// integer tensors (token ids, labels) and other arguments pass as they are. The cast is an autograd op, so
// the gradient goes back in the caller's dtype.
inline at::Tensor cast_floating(const at::Tensor& t, at::ScalarType dtype) {
  return t.defined() && t.is_floating_point() && t.scalar_type() != dtype ? t.to(dtype) : t;
}
inline std::optional<at::Tensor> cast_floating(const std::optional<at::Tensor>& t, at::ScalarType dtype) {
  return t ? std::optional<at::Tensor>(cast_floating(*t, dtype)) : t;
}
inline std::vector<at::Tensor> cast_floating(const std::vector<at::Tensor>& v, at::ScalarType dtype) {
  std::vector<at::Tensor> out;
  out.reserve(v.size());
  for (const auto& t : v) out.push_back(cast_floating(t, dtype));
  return out;
}
template <typename T>
const T& cast_floating(const T& x, at::ScalarType) {
  return x;
}

// Calls f(args...), with the floating-point tensors among them cast to `dtype` when set.
template <typename F, typename... Args>
auto call_with_inputs_cast(std::optional<at::ScalarType> dtype, F&& f, Args&&... args) {
  if (!dtype) return f(std::forward<Args>(args)...);
  std::tuple<std::decay_t<Args>...> cast{cast_floating(args, *dtype)...};
  return std::apply([&](auto&... a) { return f(a...); }, cast);
}

// A unit's constructor has run: an active BuildIntoShards (build.h) shards it now.
void unit_constructed(UnitBase& unit);
struct ConstructedNotice {
  explicit ConstructedNotice(UnitBase& unit) { unit_constructed(unit); }
};

template <typename M, typename = void>
struct ImplOf {
  using type = M;  // already a module type
};
template <typename M>
struct ImplOf<M, std::void_t<typename M::ContainedType>> {
  using type = typename M::ContainedType;  // a TORCH_MODULE holder
};

}  // namespace detail

template <typename Impl>
class UnitImpl : public Impl, public UnitBase, public UnitProvider {
 public:
  using Impl::Impl;

  std::vector<torch::nn::Module*> unit_modules() override { return {this}; }
  std::vector<UnitBase*> provided_units() override { return {this}; }

  // Outputs may be a Tensor, a std::vector<Tensor> or a std::tuple of Tensors.
  template <typename... Args>
  auto forward(Args&&... args) {
    UnitHooks* h = hooks();
    if (h == nullptr) {
      check_runnable();
      return run(std::forward<Args>(args)...);
    }
    h->pre_forward();
    // Note [Casting forward inputs]
    auto out = detail::call_with_inputs_cast(
        h->input_dtype(),
        [this, h](auto&&... a) {
          std::vector<at::Tensor> inputs;
          (detail::tensor_arguments(a, inputs), ...);
          h->watch_inputs(inputs);
          return run(std::forward<decltype(a)>(a)...);
        },
        std::forward<Args>(args)...);
    auto wrapped = h->post_forward(detail::tensors_of(out));
    return detail::rebuild(out, wrapped);
  }

 private:
  template <typename... Args>
  auto run(Args&&... args) {
    using Out = decltype(Impl::forward(std::forward<Args>(args)...));
    if (!recomputes() || !at::GradMode::is_enabled()) return Impl::forward(std::forward<Args>(args)...);
    std::vector<at::Tensor> inputs;
    (detail::collect_tensor(args, inputs), ...);
    auto kept = std::make_shared<std::tuple<std::decay_t<Args>...>>(std::forward<Args>(args)...);
    RecomputeForward again = [this, kept](const std::vector<at::Tensor>& tensors) {
      std::size_t next = 0;
      // A braced list evaluates left to right: tensors are taken in argument order.
      auto call = std::apply(
          [&](const auto&... a) {
            return std::tuple<std::decay_t<Args>...>{detail::substitute(a, tensors, next)...};
          },
          *kept);
      return detail::tensors_of(std::apply([this](auto&... a) { return Impl::forward(a...); }, call));
    };
    auto outputs = recompute(again, inputs, this->parameters(/*recurse=*/true));
    return detail::rebuild(Out{}, outputs);
  }

  // Initialised after Impl's constructor has run: the unit is complete.
  detail::ConstructedNotice constructed_{*this};
};

template <typename M>
class Unit : public torch::nn::ModuleHolder<UnitImpl<typename detail::ImplOf<M>::type>> {
 public:
  using Holder = torch::nn::ModuleHolder<UnitImpl<typename detail::ImplOf<M>::type>>;
  using Holder::Holder;

  // ModuleHolder's operator() deduces the return type from a non-template forward;
  // the unit's forward is a template.
  template <typename... Args>
  auto operator()(Args&&... args) {
    return this->get()->forward(std::forward<Args>(args)...);
  }
};

}  // namespace flatshard
