// The optimizers over shards: which parameter owns which shard elements, their groups
// and step counts (ShardOptimizer), and the SGD and Adam steps over runs of a shard.
#include <ATen/ATen.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <map>

#include "flatshard/errors.h"
#include "flatshard/fully_shard.h"
#include "flatshard/optim.h"
#include "optim/step_kernels.h"

namespace flatshard::optim {

// --- filters -------------------------------------------------------------------------------

ParamFilter operator||(ParamFilter a, ParamFilter b) {
  return ParamFilter(
      [a, b](const std::string& n, const std::vector<std::int64_t>& s) { return a(n, s) || b(n, s); });
}
ParamFilter operator&&(ParamFilter a, ParamFilter b) {
  return ParamFilter(
      [a, b](const std::string& n, const std::vector<std::int64_t>& s) { return a(n, s) && b(n, s); });
}
ParamFilter operator!(ParamFilter a) {
  return ParamFilter([a](const std::string& n, const std::vector<std::int64_t>& s) { return !a(n, s); });
}

ParamFilter names_containing(std::vector<std::string> parts) {
  return ParamFilter([parts](const std::string& name, const std::vector<std::int64_t>&) {
    return std::any_of(parts.begin(), parts.end(),
                       [&](const std::string& p) { return name.find(p) != std::string::npos; });
  });
}

ParamFilter dims_below(int dims) {
  return ParamFilter([dims](const std::string&, const std::vector<std::int64_t>& shape) {
    return static_cast<int>(shape.size()) < dims;
  });
}

ParamFilter biases_norms_embeddings() { return dims_below(2) || names_containing({"emb", "wte", "wpe"}); }

// --- which parameter owns which elements ---------------------------------------------------

// Note [Runs of a shard]
// A shard is this rank's slice of each segment of a flat buffer. Each parameter owns the
// elements of it that fall in the shard (a piece per segment slice it crosses) and the
// padding up to the next piece, whose values and gradients are zero whatever steps them.
// A step walks the pieces of the parameters that got a gradient and steps each run of
// adjacent pieces that share a group and a step count with one kernel call.
struct ShardOptimizer::Layout {
  struct Piece {
    std::int64_t offset = 0;
    std::int64_t numel = 0;
    std::size_t param = 0;    // index in the shard's layout
    std::size_t segment = 0;  // of the flat buffer
  };
  struct Shard {
    std::vector<std::string> names;   // by parameter, layout order
    std::vector<std::size_t> group;   // by parameter
    std::vector<std::int64_t> steps;  // by parameter
    std::vector<Piece> pieces;        // by offset
    std::size_t segments = 1;         // of the flat buffer
  };
  std::int64_t version = -1;
  std::vector<std::pair<std::string, ParamFilter>> filters;  // groups 1.. (0 is the default)
  std::string who;
  std::vector<Shard> shards;
};

ShardOptimizer::~ShardOptimizer() = default;

namespace {

void check_shards(const std::vector<at::Tensor>& shards) {
  for (const auto& s : shards) {
    if (!s.defined() || s.scalar_type() != at::kFloat || !s.is_contiguous() ||
        !(s.device().is_cpu() || s.device().is_cuda())) {
      throw InvalidArgument(
          "flatshard::optim: shards must be contiguous fp32 CPU or CUDA tensors (FullyShard::shards())");
    }
    if (s.is_cuda()) kernels::cuda_kernels("optim");  // throws when flatshard::cuda is not linked
  }
}

}  // namespace

ShardOptimizer::ShardOptimizer(std::vector<at::Tensor> shards)
    : shards_(std::move(shards)), group_names_{"default"}, layout_(std::make_unique<Layout>()) {
  check_shards(shards_);
  for (const auto& s : shards_) {
    Layout::Shard l;
    l.names = {""};
    l.group = {0};
    l.steps = {0};
    l.pieces = {{0, s.numel(), 0}};
    layout_->shards.push_back(std::move(l));
  }
}

ShardOptimizer::ShardOptimizer(FullyShardBase& fsdp,
                               const std::vector<std::pair<std::string, ParamFilter>>& groups,
                               const char* who)
    : shards_(fsdp.shards()), group_names_{"default"}, fsdp_(&fsdp), layout_(std::make_unique<Layout>()) {
  check_shards(shards_);
  layout_->filters = groups;
  layout_->who =
      fmt::format("flatshard::optim::{} (rank {}/{})", who, fsdp.world().rank(), fsdp.world().world_size());
  for (const auto& [name, filter] : groups) {
    if (std::find(group_names_.begin(), group_names_.end(), name) != group_names_.end()) {
      throw InvalidArgument(
          fmt::format("{}: two groups are named '{}'; give each group its own name", layout_->who, name));
    }
    group_names_.push_back(name);
  }
  refresh_layout();
  std::vector<bool> chosen(groups.size() + 1, false);
  for (const auto& s : layout_->shards) {
    for (std::size_t g : s.group) chosen[g] = true;
  }
  for (std::size_t g = 1; g < chosen.size(); ++g) {
    if (!chosen[g]) {
      throw InvalidArgument(fmt::format(
          "{}: group '{}' chooses no parameter of the model; check its filter against the parameters' names "
          "(Module::named_parameters()) or leave the group out",
          layout_->who, group_names_[g]));
    }
  }
}

void ShardOptimizer::refresh_layout() {
  if (!fsdp_ || fsdp_->layout_version() == layout_->version) return;
  // Steps by name survive a new layout (the replicated strategies' bucket rebuild).
  std::map<std::string, std::int64_t> steps;
  for (const auto& s : layout_->shards) {
    for (std::size_t p = 0; p < s.names.size(); ++p) steps[s.names[p]] = s.steps[p];
  }
  const auto layouts = fsdp_->layout();
  const int rank = fsdp_->shard_group().rank;
  layout_->shards.clear();
  for (const auto& l : layouts) {
    Layout::Shard s;
    for (const auto& p : l.params) {
      s.names.push_back(p.name);
      std::size_t group = 0;
      for (std::size_t g = 0; g < layout_->filters.size(); ++g) {
        if (!layout_->filters[g].second(p.name, p.shape)) continue;
        if (group != 0) {
          throw InvalidArgument(
              fmt::format("{}: parameter '{}' is chosen by groups '{}' and '{}'; a parameter belongs to one "
                          "group: narrow "
                          "one filter (e.g. with && !other)",
                          layout_->who, p.name, group_names_[group], group_names_[g + 1]));
        }
        group = g + 1;
      }
      s.group.push_back(group);
      auto it = steps.find(p.name);
      s.steps.push_back(it == steps.end() ? 0 : it->second);
    }
    s.segments = l.segments.size();
    for (std::size_t k_seg = 0; k_seg < l.segments.size(); ++k_seg) {
      const auto& seg = l.segments[k_seg];
      const std::int64_t lo = seg.offset + rank * seg.slice, hi = lo + seg.slice;
      const std::size_t first = s.pieces.size();
      for (std::size_t k = 0; k < l.params.size(); ++k) {
        const auto& p = l.params[k];
        const std::int64_t b = std::max(lo, p.offset), e = std::min(hi, p.offset + p.numel);
        if (b < e) s.pieces.push_back({seg.shard_offset + (b - lo), e - b, k, k_seg});
      }
      std::sort(s.pieces.begin() + static_cast<std::ptrdiff_t>(first), s.pieces.end(),
                [](const Layout::Piece& a, const Layout::Piece& b) { return a.offset < b.offset; });
      for (std::size_t k = first; k < s.pieces.size(); ++k) {  // padding goes with the piece before it
        const std::int64_t end =
            k + 1 < s.pieces.size() ? s.pieces[k + 1].offset : seg.shard_offset + seg.slice;
        s.pieces[k].numel = end - s.pieces[k].offset;
      }
    }
    layout_->shards.push_back(std::move(s));
  }
  layout_->version = fsdp_->layout_version();
}

void ShardOptimizer::step() {
  if (fsdp_ && fsdp_->backward_failed()) {  // Note [A backward that failed]
    throw InvalidArgument(fmt::format(
        "flatshard::optim::step (rank {}/{}): the last backward failed midway and its gradients are partial; "
        "call zero_grad() (or run the next forward) before stepping",
        fsdp_->comm().rank(), fsdp_->comm().world_size()));
  }
  if (fsdp_) fsdp_->wait_for_shard_reads();  // an evaluation forward's copies may still read them
  for (std::size_t i = 0; i < shards_.size(); ++i) step_shard(i);
}

void ShardOptimizer::step_shard(std::size_t i) {
  const at::Tensor& grad = shards_[i].grad();
  if (!grad.defined()) return;
  refresh_layout();
  auto& s = layout_->shards[i];
  static const std::vector<char> kEvery;
  const std::vector<char>& got = fsdp_ ? fsdp_->params_with_grad(i) : kEvery;
  auto stepped = [&](std::size_t p) { return got.empty() || got[p] != 0; };
  ensure_state(i);
  const auto g = grad.contiguous();
  // Note [The bf16 copy of an offloaded master] (sharding/flat_param.cpp): the kernels
  // write the master through raw pointers, so each run bumps its version, as an ATen
  // in-place write would, and says when the bf16 copy was written alongside.
  const at::Tensor copy = fsdp_ && writes_bf16_copies() ? fsdp_->bf16_copy_for_step(i) : at::Tensor();
  auto* copy_data = copy.defined() ? reinterpret_cast<std::uint16_t*>(copy.data_ptr()) : nullptr;
  auto step_and_mark = [&](Run& r) {
    r.bf16_copy = copy_data ? copy_data + r.offset : nullptr;
    step_run(i, g, r);
    shards_[i].unsafeGetTensorImpl()->bump_version();
    if (copy_data) fsdp_->bf16_copy_written(i);
  };
  // Runs never cross a segment, and each segment is reported once stepped (Note
  // [Gathers behind the step] in sharding/replicated.cpp).
  std::size_t reported = 0;
  auto report_until = [&](std::size_t segment) {
    for (; fsdp_ && reported < segment; ++reported) fsdp_->segment_stepped(i, reported);
  };
  Run run;
  bool open = false;
  std::size_t run_segment = 0;
  for (const auto& piece : s.pieces) {
    if (!stepped(piece.param)) continue;
    const std::size_t group = s.group[piece.param];
    const std::int64_t step = s.steps[piece.param] + 1;
    if (open && run_segment == piece.segment && run.offset + run.numel == piece.offset &&
        run.group == group && run.step == step) {
      run.numel += piece.numel;
      continue;
    }
    if (open) step_and_mark(run);
    report_until(piece.segment);
    run = {piece.offset, piece.numel, group, step};
    run_segment = piece.segment;
    open = true;
  }
  if (open) step_and_mark(run);
  report_until(s.segments);
  for (std::size_t p = 0; p < s.steps.size(); ++p) {
    if (stepped(p)) ++s.steps[p];
  }
}

double ShardOptimizer::initial_lr(std::size_t group) {
  initial_lrs_.resize(num_groups());
  auto& saved = initial_lrs_.at(group);
  if (!saved) saved = lr(group);
  return *saved;
}

std::optional<double> ShardOptimizer::saved_initial_lr(std::size_t group) const {
  return group < initial_lrs_.size() ? initial_lrs_[group] : std::nullopt;
}

void ShardOptimizer::set_initial_lr(std::size_t group, double lr) {
  initial_lrs_.resize(num_groups());
  initial_lrs_.at(group) = lr;
}

void ShardOptimizer::zero_grad() {
  // Abandons a failed backward (Note [A backward that failed]) and drops what backwards
  // under no_sync accumulated (Note [zero_grad after no_sync]).
  if (fsdp_) fsdp_->zero_grad();
  for (auto& s : shards_) s.mutable_grad().reset();
}

const std::string& ShardOptimizer::group_name(std::size_t group) const { return group_names_.at(group); }

std::size_t ShardOptimizer::group_of(const std::string& param) const {
  for (const auto& s : layout_->shards) {
    for (std::size_t p = 0; p < s.names.size(); ++p) {
      if (s.names[p] == param) return s.group[p];
    }
  }
  throw InvalidArgument(fmt::format("flatshard::optim: no parameter is named '{}'", param));
}

std::int64_t ShardOptimizer::steps(std::size_t i, const std::string& param) const {
  const auto& s = layout_->shards.at(i);
  if (!fsdp_) return s.steps[0];
  for (std::size_t p = 0; p < s.names.size(); ++p) {
    if (s.names[p] == param) return s.steps[p];
  }
  throw InvalidArgument(fmt::format("flatshard::optim: shard {} has no parameter '{}'", i, param));
}

std::int64_t ShardOptimizer::steps(std::size_t i) const {
  const auto& s = layout_->shards.at(i);
  return s.steps.empty() ? 0 : *std::max_element(s.steps.begin(), s.steps.end());
}

void ShardOptimizer::set_steps(std::size_t i, const std::string& param, std::int64_t steps) {
  refresh_layout();
  auto& s = layout_->shards.at(i);
  if (!fsdp_) {
    s.steps[0] = steps;
    return;
  }
  for (std::size_t p = 0; p < s.names.size(); ++p) {
    if (s.names[p] == param) {
      s.steps[p] = steps;
      return;
    }
  }
  throw InvalidArgument(fmt::format("flatshard::optim: shard {} has no parameter '{}'", i, param));
}

// --- hyperparameters by name ---------------------------------------------------------------

namespace {

template <typename Options>
std::vector<std::pair<std::string, ParamFilter>> filters_of(const std::vector<ParamGroup<Options>>& groups) {
  std::vector<std::pair<std::string, ParamFilter>> out;
  for (const auto& g : groups) out.emplace_back(g.name, g.params);
  return out;
}

template <typename Options>
std::vector<Options> options_of(const Options& defaults, const std::vector<ParamGroup<Options>>& groups) {
  std::vector<Options> out{defaults};
  for (const auto& g : groups) out.push_back(g.options);
  return out;
}

double value_of(const std::map<std::string, double>& values, const std::string& name, const char* who) {
  auto it = values.find(name);
  if (it == values.end()) {
    throw InvalidArgument(fmt::format("flatshard::optim::{}: hyperparameter '{}' is missing", who, name));
  }
  return it->second;
}

void check_lr(double lr, const char* who) {
  if (!(lr >= 0))
    throw InvalidArgument(fmt::format("flatshard::optim::{}: lr must be >= 0 (got {})", who, lr));
}

// What torch.optim refuses with ValueError: a negative rate, momentum or weight decay; a
// negative eps (Adam's). torch leaves dampening unchecked: so does this.
void check_non_negative(double value, const char* name, const char* who) {
  if (!(value >= 0))
    throw InvalidArgument(fmt::format("flatshard::optim::{}: {} must be >= 0 (got {})", who, name, value));
}

void check_sgd(const SGDOptions& o) {
  check_lr(o.lr, "SGD");
  check_non_negative(o.momentum, "momentum", "SGD");
  check_non_negative(o.weight_decay, "weight_decay", "SGD");
  if (o.nesterov && (o.momentum <= 0 || o.dampening != 0)) {
    throw InvalidArgument("flatshard::optim::SGD: nesterov needs momentum > 0 and dampening == 0");
  }
}

}  // namespace

// --- SGD ------------------------------------------------------------------------------------

SGD::SGD(std::vector<at::Tensor> shards, const SGDOptions& options)
    : ShardOptimizer(std::move(shards)), options_{options}, momentum_(shards_.size()) {
  check_sgd(options);
}

SGD::SGD(FullyShardBase& fsdp, const SGDOptions& options, std::vector<ParamGroup<SGDOptions>> groups)
    : ShardOptimizer(fsdp, filters_of(groups), "SGD"),
      options_(options_of(options, groups)),
      momentum_(shards_.size()) {
  // One momentum buffer per shard: a group without momentum leaves zeros in its part.
  for (const auto& o : options_) check_sgd(o);
}

bool SGD::has_momentum() const {
  return std::any_of(options_.begin(), options_.end(), [](const SGDOptions& o) { return o.momentum != 0; });
}

void SGD::set_lr(std::size_t group, double lr) {
  check_lr(lr, "SGD");
  options_.at(group).lr = lr;
}

std::map<std::string, double> SGD::hyperparameters(std::size_t group) const {
  const auto& o = options_.at(group);
  return {{"lr", o.lr},
          {"momentum", o.momentum},
          {"dampening", o.dampening},
          {"weight_decay", o.weight_decay},
          {"nesterov", o.nesterov ? 1.0 : 0.0}};
}

void SGD::set_hyperparameters(std::size_t group, const std::map<std::string, double>& v) {
  SGDOptions o;
  o.lr = value_of(v, "lr", "SGD");
  o.momentum = value_of(v, "momentum", "SGD");
  o.dampening = value_of(v, "dampening", "SGD");
  o.weight_decay = value_of(v, "weight_decay", "SGD");
  o.nesterov = value_of(v, "nesterov", "SGD") != 0;
  check_sgd(o);
  options_.at(group) = o;
}

void SGD::ensure_state(std::size_t i) {
  if (has_momentum() && !momentum_[i].defined()) momentum_[i] = at::zeros_like(shards_[i]);
}

void SGD::step_run(std::size_t i, const at::Tensor& grad, const Run& run) {
  const auto& o = options_[run.group];
  kernels::SgdHyper h;
  h.lr = static_cast<float>(o.lr);
  h.momentum = static_cast<float>(o.momentum);
  h.dampening = static_cast<float>(o.dampening);
  h.weight_decay = static_cast<float>(o.weight_decay);
  h.nesterov = o.nesterov;
  h.first_step = run.step == 1;
  float* param = shards_[i].data_ptr<float>() + run.offset;
  const float* g = grad.data_ptr<float>() + run.offset;
  float* momentum = o.momentum != 0 ? momentum_[i].data_ptr<float>() + run.offset : nullptr;
  if (shards_[i].is_cuda()) {
    kernels::cuda_kernels("optim::SGD").sgd_step(param, g, momentum, run.numel, h, nullptr);
  } else {
    kernels::sgd_step(param, g, momentum, run.numel, h, run.bf16_copy);
  }
}

std::vector<std::pair<std::string, at::Tensor>> SGD::named_state(std::size_t i) const {
  if (!has_momentum()) return {};
  return {{"momentum_buffer", momentum_[i]}};
}

std::vector<std::string> SGD::state_names() const {
  if (!has_momentum()) return {};
  return {"momentum_buffer"};
}

at::Tensor SGD::mutable_state(std::size_t i, const std::string& name) {
  if (name != "momentum_buffer" || !has_momentum()) {
    throw InvalidArgument(fmt::format("flatshard::optim::SGD{}: has no state '{}'",
                                      has_momentum() ? "" : " (without momentum)", name));
  }
  ensure_state(i);
  return momentum_[i];
}

std::int64_t SGD::state_bytes() const {
  std::int64_t b = 0;
  for (const auto& m : momentum_) b += m.defined() ? static_cast<std::int64_t>(m.nbytes()) : 0;
  return b;
}

// --- Adam and AdamW -------------------------------------------------------------------------

namespace {

AdamOptions as_adam(const AdamWOptions& o) { return {o.lr, o.beta1, o.beta2, o.eps, o.weight_decay}; }

std::vector<ParamGroup<AdamOptions>> as_adam(std::vector<ParamGroup<AdamWOptions>> groups) {
  std::vector<ParamGroup<AdamOptions>> out;
  for (auto& g : groups) out.push_back({std::move(g.name), std::move(g.params), as_adam(g.options)});
  return out;
}

void check_adam(const AdamOptions& o, const char* who) {
  check_lr(o.lr, who);
  check_non_negative(o.eps, "eps", who);
  check_non_negative(o.weight_decay, "weight_decay", who);
  if (!(o.beta1 >= 0 && o.beta1 < 1 && o.beta2 >= 0 && o.beta2 < 1)) {
    throw InvalidArgument(
        fmt::format("flatshard::optim::{}: betas must be in [0, 1) (got {}, {})", who, o.beta1, o.beta2));
  }
}

}  // namespace

Adam::Adam(std::vector<at::Tensor> shards, const AdamOptions& options)
    : ShardOptimizer(std::move(shards)),
      options_{options},
      exp_avg_(shards_.size()),
      exp_avg_sq_(shards_.size()) {
  check_adam(options, "Adam");
}

Adam::Adam(std::vector<at::Tensor> shards, const AdamWOptions& options)
    : Adam(std::move(shards), as_adam(options)) {
  decoupled_ = true;
}

Adam::Adam(FullyShardBase& fsdp, const AdamOptions& options, std::vector<ParamGroup<AdamOptions>> groups)
    : ShardOptimizer(fsdp, filters_of(groups), "Adam"),
      options_(options_of(options, groups)),
      exp_avg_(shards_.size()),
      exp_avg_sq_(shards_.size()) {
  for (const auto& o : options_) check_adam(o, "Adam");
}

Adam::Adam(FullyShardBase& fsdp, const AdamWOptions& options, std::vector<ParamGroup<AdamWOptions>> groups)
    : Adam(fsdp, as_adam(options), as_adam(std::move(groups))) {
  decoupled_ = true;
}

void Adam::set_lr(std::size_t group, double lr) {
  check_lr(lr, "Adam");
  options_.at(group).lr = lr;
}

std::map<std::string, double> Adam::hyperparameters(std::size_t group) const {
  const auto& o = options_.at(group);
  return {
      {"lr", o.lr}, {"beta1", o.beta1}, {"beta2", o.beta2}, {"eps", o.eps}, {"weight_decay", o.weight_decay}};
}

void Adam::set_hyperparameters(std::size_t group, const std::map<std::string, double>& v) {
  AdamOptions o;
  o.lr = value_of(v, "lr", "Adam");
  o.beta1 = value_of(v, "beta1", "Adam");
  o.beta2 = value_of(v, "beta2", "Adam");
  o.eps = value_of(v, "eps", "Adam");
  o.weight_decay = value_of(v, "weight_decay", "Adam");
  check_adam(o, "Adam");
  options_.at(group) = o;
}

void Adam::ensure_state(std::size_t i) {
  if (exp_avg_[i].defined()) return;
  exp_avg_[i] = at::zeros_like(shards_[i]);
  exp_avg_sq_[i] = at::zeros_like(shards_[i]);
}

void Adam::step_run(std::size_t i, const at::Tensor& grad, const Run& run) {
  const auto& o = options_[run.group];
  kernels::AdamHyper h;
  h.lr = o.lr;
  h.beta1 = o.beta1;
  h.beta2 = o.beta2;
  h.eps = o.eps;
  h.weight_decay = o.weight_decay;
  h.decoupled_weight_decay = decoupled_;
  h.step = run.step;
  float* param = shards_[i].data_ptr<float>() + run.offset;
  const float* g = grad.data_ptr<float>() + run.offset;
  float* m = exp_avg_[i].data_ptr<float>() + run.offset;
  float* v = exp_avg_sq_[i].data_ptr<float>() + run.offset;
  if (shards_[i].is_cuda()) {
    kernels::cuda_kernels("optim::Adam").adam_step(param, g, m, v, run.numel, h, nullptr);
  } else {
    kernels::adam_step(param, g, m, v, run.numel, h, run.bf16_copy);
  }
}

std::vector<std::pair<std::string, at::Tensor>> Adam::named_state(std::size_t i) const {
  return {{"exp_avg", exp_avg_[i]}, {"exp_avg_sq", exp_avg_sq_[i]}};
}

at::Tensor Adam::mutable_state(std::size_t i, const std::string& name) {
  if (name != "exp_avg" && name != "exp_avg_sq") {
    throw InvalidArgument(fmt::format("flatshard::optim::Adam: has no state '{}'", name));
  }
  ensure_state(i);
  return name == "exp_avg" ? exp_avg_[i] : exp_avg_sq_[i];
}

std::int64_t Adam::state_bytes() const {
  std::int64_t b = 0;
  for (std::size_t i = 0; i < shards_.size(); ++i) {
    if (exp_avg_[i].defined()) b += static_cast<std::int64_t>(exp_avg_[i].nbytes() + exp_avg_sq_[i].nbytes());
  }
  return b;
}

}  // namespace flatshard::optim
