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
  // Whether this forward's inputs are to be watched (watch_inputs); their leaves that
  // require grad are then passed as aliases (Note [Watching a unit's inputs]).
  virtual bool watches_inputs() const { return false; }
  // Called after pre_forward with the tensors the unit's forward is about to get (after
  // the cast and the aliases): the engine learns from their gradients when the unit's
  // backward is done (Note [Partly frozen units]).
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

// Recomputation of a forward with arbitrary arguments: the tensor arguments (tensors,
// optional tensors, vectors of tensors) become the recomputed function's inputs, in order,
// so that their gradients leave through it; the others are kept as they were passed.
template <typename T>
decltype(auto) substitute(const T& arg, const std::vector<at::Tensor>&, std::size_t&) {
  return arg;
}
inline at::Tensor substitute(const at::Tensor&, const std::vector<at::Tensor>& tensors, std::size_t& next) {
  return tensors[next++];
}
inline std::optional<at::Tensor> substitute(const std::optional<at::Tensor>& t,
                                            const std::vector<at::Tensor>& tensors, std::size_t& next) {
  if (!t) return t;
  return tensors[next++];
}
inline std::vector<at::Tensor> substitute(const std::vector<at::Tensor>& v,
                                          const std::vector<at::Tensor>& tensors, std::size_t& next) {
  std::vector<at::Tensor> out;
  out.reserve(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) out.push_back(tensors[next++]);
  return out;
}
template <typename T>
void collect_tensor(const T&, std::vector<at::Tensor>&) {}
inline void collect_tensor(const at::Tensor& t, std::vector<at::Tensor>& out) { out.push_back(t); }
inline void collect_tensor(const std::optional<at::Tensor>& t, std::vector<at::Tensor>& out) {
  if (t) out.push_back(*t);
}
inline void collect_tensor(const std::vector<at::Tensor>& v, std::vector<at::Tensor>& out) {
  out.insert(out.end(), v.begin(), v.end());
}

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

// Note [Watching a unit's inputs]
// A unit that waits for its inputs' gradients (Note [Partly frozen units]) puts a hook on
// each tensor argument that requires grad. A hook on a tensor that autograd made lives in
// the graph and goes with it. One on a leaf would stay on the leaf for good, one more every
// step, and would fire only once every use of the leaf in the whole model is done, keeping
// the unit gathered until then: prefix tuning passes a trained parameter of the root to
// every block, and a batch may require grad. So such a leaf reaches the unit's forward as
// an alias (an autograd view of it): the hook goes on the alias, whose gradient is in once
// this unit's uses are done, and goes with the graph. The leaf's gradient is the same.
struct InputPrep {
  std::optional<at::ScalarType> dtype;  // Note [Casting forward inputs]
  bool alias_leaves = false;
};
inline at::Tensor prepare_input(const at::Tensor& t, const InputPrep& prep) {
  at::Tensor out = prep.dtype ? cast_floating(t, *prep.dtype) : t;
  if (prep.alias_leaves && out.defined() && out.is_leaf() && out.requires_grad()) out = at::alias(out);
  return out;
}
inline std::optional<at::Tensor> prepare_input(const std::optional<at::Tensor>& t, const InputPrep& prep) {
  return t ? std::optional<at::Tensor>(prepare_input(*t, prep)) : t;
}
inline std::vector<at::Tensor> prepare_input(const std::vector<at::Tensor>& v, const InputPrep& prep) {
  std::vector<at::Tensor> out;
  out.reserve(v.size());
  for (const auto& t : v) out.push_back(prepare_input(t, prep));
  return out;
}
template <typename T>
const T& prepare_input(const T& x, const InputPrep&) {
  return x;
}

// Calls f(args...), with the tensors among them prepared (cast, aliased) as `prep` says.
template <typename F, typename... Args>
auto call_with_inputs_prepared(const InputPrep& prep, F&& f, Args&&... args) {
  if (!prep.dtype && !prep.alias_leaves) return f(std::forward<Args>(args)...);
  std::tuple<std::decay_t<Args>...> prepared{prepare_input(args, prep)...};
  return std::apply([&](auto&... a) { return f(a...); }, prepared);
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
    // Note [Casting forward inputs], Note [Watching a unit's inputs]
    auto out = detail::call_with_inputs_prepared(
        detail::InputPrep{h->input_dtype(), h->watches_inputs()},
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
