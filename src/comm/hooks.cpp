// The communication hooks of include/flatshard/comm_hooks.h. Each runs its compression on
// the calling thread when a bucket is ready, its collectives on the communicator's
// streams, and its decompression when the engine finishes the bucket. Every rank runs
// the same code on the same gathered data, so every rank ends with the same bits.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/core/Event.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <mutex>
#include <random>
#include <unordered_set>
#include <vector>

#include <fmt/format.h>

#include "flatshard/comm_hooks.h"
#include "flatshard/errors.h"
#include "src/comm/hook_kernels.h"

namespace flatshard::hooks {
namespace kernels {

void quantize(const at::Tensor& x, std::int64_t chunk, const at::Tensor& codes, const at::Tensor& scales,
              Form form) {
  const std::int64_t numel = x.numel(), chunks = (numel + chunk - 1) / chunk;
  if (form == Form::TensorOps) {
    at::Tensor rows = at::zeros({chunks * chunk}, x.options());
    rows.narrow(0, 0, numel).copy_(x);
    rows = rows.view({chunks, chunk});
    // Divided by a tensor, not a scalar: a device divides by a host scalar as a product
    // with its reciprocal, which can differ from the host's quotient in the last bit.
    at::Tensor scale = rows.abs().amax(1).div_(at::scalar_tensor(127.0f, x.options()));  // NaN if one is
    const at::Tensor divisor = at::where(scale > 0, scale, 1.0f).unsqueeze(1);
    scales.copy_(scale);
    codes.view({chunks, chunk}).copy_(rows.div_(divisor).round_().clamp_(-127, 127).nan_to_num_(0));
    return;
  }
  const float* v = x.data_ptr<float>();
  auto* q = codes.data_ptr<std::int8_t>();
  float* s = scales.data_ptr<float>();
  for (std::int64_t c = 0; c < chunks; ++c) {
    const std::int64_t begin = c * chunk, n = std::min(chunk, numel - begin);
    float largest = 0;
    bool nan = false;
    for (std::int64_t i = 0; i < n; ++i) {
      const float a = std::fabs(v[begin + i]);
      largest = std::max(largest, a);
      nan |= std::isnan(a);
    }
    const float scale = nan ? std::numeric_limits<float>::quiet_NaN() : largest / 127.0f;
    const float divisor = scale > 0 ? scale : 1.0f;
    s[c] = scale;
    for (std::int64_t i = 0; i < n; ++i) {
      const float r = std::nearbyint(v[begin + i] / divisor);
      q[begin + i] = std::isnan(r) ? 0 : static_cast<std::int8_t>(std::min(127.0f, std::max(-127.0f, r)));
    }
    for (std::int64_t i = n; i < chunk; ++i) q[begin + i] = 0;
  }
}

void average_dequantized(const at::Tensor& all_codes, const at::Tensor& all_scales, int world,
                         std::int64_t chunk, const at::Tensor& out, Form form) {
  const std::int64_t numel = out.numel(), chunks = all_scales.numel() / world;
  if (form == Form::TensorOps) {
    const at::Tensor codes = all_codes.view({world, chunks, chunk});
    const at::Tensor scales = all_scales.view({world, chunks, 1});
    at::Tensor sum = codes[0].to(at::kFloat).mul_(scales[0]);
    for (int r = 1; r < world; ++r) sum.add_(codes[r].to(at::kFloat).mul_(scales[r]));  // rank 0's first
    out.copy_(
        sum.view({-1}).narrow(0, 0, numel).div_(at::scalar_tensor(static_cast<float>(world), sum.options())));
    return;
  }
  float* o = out.data_ptr<float>();
  const auto* all = all_codes.data_ptr<std::int8_t>();
  const float* s = all_scales.data_ptr<float>();
  for (std::int64_t c = 0; c < chunks; ++c) {
    const std::int64_t begin = c * chunk, n = std::min(chunk, numel - begin);
    for (int r = 0; r < world; ++r) {  // rank 0's first, on every rank
      const std::int8_t* q = all + (r * chunks + c) * chunk;
      const float scale = s[r * chunks + c];
      if (r == 0) {
        for (std::int64_t i = 0; i < n; ++i) o[begin + i] = static_cast<float>(q[i]) * scale;
      } else {
        for (std::int64_t i = 0; i < n; ++i) o[begin + i] += static_cast<float>(q[i]) * scale;
      }
    }
    for (std::int64_t i = 0; i < n; ++i) o[begin + i] /= static_cast<float>(world);
  }
}

// On the host, a radix select on the magnitudes' bits (non-negative floats order as their
// bits do): one pass counts the top 15 bits; a second takes every value above the bin the
// k-th falls in and selects the rest among that bin's. Two passes over the bucket, where
// at::topk costs many. On a device, at::topk.
at::Tensor largest_magnitudes(const at::Tensor& x, std::int64_t k, Form form) {
  if (form == Form::TensorOps)
    return std::get<1>(at::topk(x.abs(), k, 0, /*largest=*/true, /*sorted=*/false));
  const float* v = x.data_ptr<float>();
  const std::int64_t n = x.numel();
  auto magnitude = [v](std::int64_t i) {
    std::uint32_t bits;
    std::memcpy(&bits, v + i, sizeof(bits));
    return bits & 0x7fffffffu;
  };
  std::vector<std::int64_t> counts(std::size_t{1} << 15, 0);
  for (std::int64_t i = 0; i < n; ++i) ++counts[magnitude(i) >> 16];
  std::int64_t bin = static_cast<std::int64_t>(counts.size()) - 1, above = 0;
  while (above + counts[bin] < k) above += counts[bin--];
  at::Tensor out = at::empty({k}, at::kLong);
  std::int64_t* chosen = out.data_ptr<std::int64_t>();
  std::int64_t taken = 0;
  std::vector<std::pair<std::uint32_t, std::int64_t>> ties;  // the k-th's bin: (magnitude, position)
  ties.reserve(static_cast<std::size_t>(counts[bin]));
  for (std::int64_t i = 0; i < n; ++i) {
    const std::uint32_t m = magnitude(i);
    const auto b = static_cast<std::int64_t>(m >> 16);
    if (b > bin) {
      chosen[taken++] = i;
    } else if (b == bin) {
      ties.emplace_back(m, i);
    }
  }
  const auto rest = static_cast<std::ptrdiff_t>(k - taken);
  std::nth_element(ties.begin(), ties.begin() + rest - 1, ties.end(),
                   [](const auto& a, const auto& b) { return a.first > b.first; });
  for (std::ptrdiff_t j = 0; j < rest; ++j) chosen[taken++] = ties[j].second;
  return out;
}

// The host's index_add_ adds in order, rank 0's values first; a device's adds with atomics,
// so there one index_add_ a rank (each rank's positions distinct, nothing collides), in
// rank order.
void average_scattered(const at::Tensor& all_values, const at::Tensor& all_index, int world,
                       const at::Tensor& out, Form form) {
  out.zero_();
  if (form == Form::TensorOps) {
    const std::int64_t k = all_values.numel() / world;
    for (int r = 0; r < world; ++r)
      out.index_add_(0, all_index.narrow(0, r * k, k), all_values.narrow(0, r * k, k));
    out.div_(at::scalar_tensor(static_cast<float>(world), out.options()));  // a quotient, as the host's
  } else {
    out.index_add_(0, all_index, all_values);
    out.div_(static_cast<float>(world));
  }
}

}  // namespace kernels

namespace {

CollectiveOptions on(StreamRole role) {
  CollectiveOptions o;
  o.stream = role;
  return o;
}

// Note [A hook's two halves on a device]
// A hook's reduce runs on the stream current when its bucket is ready: what it compresses,
// and its collectives' buffers, are allocated and written there (the caching allocator
// keeps a block for the stream it was made on). Its finish runs when the engine finishes
// the bucket, after Work::wait() made the stream current there wait for the collectives,
// and that may be another stream. So the finish runs on the first stream, which first
// waits for the finishing one (and through it for the collectives), and the finishing
// stream then waits for the finish. On the host, and where the two streams are one, the
// finish runs as it is.
std::function<void()> on_first_stream(const at::Tensor& like, std::function<void()> finish) {
  if (like.is_cpu() || !finish) return finish;
  const c10::Stream first = c10::impl::VirtualGuardImpl(like.device().type()).getStream(like.device());
  return [first, finish = std::move(finish)]() {
    const c10::Stream finishing = c10::impl::VirtualGuardImpl(first.device_type()).getStream(first.device());
    if (finishing == first) return finish();
    c10::Event waited(first.device_type());
    waited.record(finishing);
    waited.block(first);
    {
      const c10::StreamGuard guard(first);
      finish();
    }
    c10::Event done(first.device_type());
    done.record(first);
    done.block(finishing);
  };
}

class AllReduceHook final : public CommHook {
 public:
  std::string describe() const override { return "all_reduce"; }
  HookWork reduce(Communicator& comm, const GradBucket& bucket) override {
    return {{comm.all_reduce(bucket.buffer, ReduceOp::Avg, on(StreamRole::AllReduce))}, nullptr};
  }
};

class LowPrecisionHook final : public CommHook {
 public:
  explicit LowPrecisionHook(at::ScalarType dtype) : dtype_(dtype) {}
  std::string describe() const override { return fmt::format("low_precision({})", c10::toString(dtype_)); }
  HookWork reduce(Communicator& comm, const GradBucket& bucket) override {
    // Divided first: a sum of fp16 gradients over many ranks could overflow.
    at::Tensor wire = bucket.buffer.to(at::kFloat).div_(comm.world_size()).to(dtype_);
    Work work = comm.all_reduce(wire, ReduceOp::Sum, on(StreamRole::AllReduce));
    at::Tensor buffer = bucket.buffer;
    return {{work}, on_first_stream(wire, [buffer, wire]() mutable { buffer.copy_(wire); })};
  }

 private:
  at::ScalarType dtype_;
};

// Note [8-bit chunks]
// Each chunk of chunk_numel values is sent as int8 codes round(v / scale), clamped to
// [-127, 127], with scale = its largest magnitude / 127 (a chunk of zeros: scale 0, codes
// 0). The codes and scales of every rank are all-gathered and every rank averages the
// dequantized values, code * scale. A chunk holding a NaN gets a NaN scale, and one holding
// an infinity an infinite one, so its average is NaN on every rank (its codes are 0 where
// v / scale is NaN): a non-finite gradient is not rounded into a finite one. On the host one
// pass over the bucket quantizes it (a chunk's maximum, then its codes, while the chunk is
// in cache), one dequantizes and averages; on a device, tensor operations do the same.
class QuantizeHook final : public CommHook {
 public:
  explicit QuantizeHook(std::int64_t chunk_numel) : chunk_numel_(chunk_numel) {}
  std::string describe() const override { return fmt::format("quantize_8bit(chunk_numel={})", chunk_numel_); }
  HookWork reduce(Communicator& comm, const GradBucket& bucket) override {
    const std::int64_t numel = bucket.buffer.numel(), chunk = chunk_numel_;
    const std::int64_t chunks = (numel + chunk - 1) / chunk;
    const int world = comm.world_size(), rank = comm.rank();
    const at::Tensor x = bucket.buffer.to(at::kFloat).contiguous();
    const auto form = kernels::form_for(x);
    at::Tensor all_codes = at::empty({world * chunks * chunk}, x.options().dtype(at::kChar));
    at::Tensor all_scales = at::empty({world * chunks}, x.options());
    at::Tensor my_codes = all_codes.narrow(0, rank * chunks * chunk, chunks * chunk);
    at::Tensor my_scales = all_scales.narrow(0, rank * chunks, chunks);
    kernels::quantize(x, chunk, my_codes, my_scales, form);
    const auto gather = on(StreamRole::AllGather);
    std::vector<Work> works = {comm.all_gather(all_codes, my_codes, gather),
                               comm.all_gather(all_scales, my_scales, gather)};
    at::Tensor buffer = bucket.buffer;
    return {std::move(works), on_first_stream(x, [=]() mutable {
              at::Tensor out =
                  buffer.scalar_type() == at::kFloat ? buffer : at::empty({numel}, all_scales.options());
              kernels::average_dequantized(all_codes, all_scales, world, chunk, out, form);
              if (!out.is_same(buffer)) buffer.copy_(out);
            })};
  }

 private:
  std::int64_t chunk_numel_;
};

// Error feedback's residuals, by bucket (Note [Error feedback]).
class Residuals {
 public:
  // The gradient to compress: this step's plus what earlier steps did not send.
  // The residual's own buffer is reused for it (a new one each step would be a gradient's
  // worth of memory allocated and faulted in): it leaves the map until keep() returns it.
  at::Tensor corrected(const GradBucket& bucket) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = residuals_.find(bucket.index);
      if (it != residuals_.end() && it->second.numel() == bucket.buffer.numel()) {
        at::Tensor x = std::move(it->second);
        residuals_.erase(it);
        if (x.device() != bucket.buffer.device()) x = x.to(bucket.buffer.device());  // loaded
        return x.add_(bucket.buffer);
      }
    }
    return bucket.buffer.to(at::kFloat, /*non_blocking=*/false, /*copy=*/true);
  }
  void keep(int index, at::Tensor residual) {
    std::lock_guard<std::mutex> lock(mutex_);
    residuals_[index] = std::move(residual);
  }
  std::map<std::string, at::Tensor> state() const {
    std::lock_guard<std::mutex> lock(mutex_);
    std::map<std::string, at::Tensor> out;
    for (const auto& [index, r] : residuals_) out[fmt::format("residual.{}", index)] = r;
    return out;
  }
  void load(const std::map<std::string, at::Tensor>& state) {
    std::lock_guard<std::mutex> lock(mutex_);
    residuals_.clear();
    for (const auto& [name, t] : state) {
      if (name.rfind("residual.", 0) == 0) residuals_[std::stoi(name.substr(9))] = t.to(at::kFloat).clone();
    }
  }

 private:
  mutable std::mutex mutex_;
  std::map<int, at::Tensor> residuals_;
};

// Note [Error feedback]
// A sparsifier sends k of a bucket's n values. With error feedback the values it did not
// send are kept, per bucket, and added to the bucket's next gradient before it chooses
// again (EF-SGD): every gradient value is applied eventually, and the residual is part of
// the training state (CommHook::state, saved in checkpoints).
class SparsifyHook final : public CommHook {
 public:
  SparsifyHook(const SparsifyOptions& options, bool top) : options_(options), top_(top) {}
  std::string describe() const override {
    return top_ ? fmt::format("top_k(ratio={}, error_feedback={})", options_.ratio, options_.error_feedback)
                : fmt::format("random_k(ratio={}, error_feedback={}, seed={})", options_.ratio,
                              options_.error_feedback, options_.seed);
  }

  HookWork reduce(Communicator& comm, const GradBucket& bucket) override {
    const std::int64_t numel = bucket.buffer.numel();
    const int world = comm.world_size(), rank = comm.rank();
    if (numel == 0) return {{}, nullptr};
    at::Tensor x = options_.error_feedback ? residuals_.corrected(bucket) : bucket.buffer.to(at::kFloat);
    x = x.contiguous();
    const auto form = kernels::form_for(x);
    const std::int64_t k =
        std::min<std::int64_t>(numel, std::max<std::int64_t>(1, std::ceil(options_.ratio * numel)));
    at::Tensor buffer = bucket.buffer;
    // random_k's positions are drawn on the host; a device gets them from page-locked memory
    // without the host waiting for the stream (the caching host allocator keeps the block
    // until the copy is done).
    at::Tensor index = top_ ? kernels::largest_magnitudes(x, k, form)
                       : x.is_cpu()
                           ? drawn(numel, k, bucket)
                           : drawn(numel, k, bucket).pin_memory().to(x.device(), /*non_blocking=*/true);
    at::Tensor values = x.index_select(0, index);
    if (options_.error_feedback) residuals_.keep(bucket.index, x.index_fill_(0, index, 0));
    if (!top_) {  // every rank sends the same positions: their values are simply averaged
      Work work = comm.all_reduce(values, ReduceOp::Avg, on(StreamRole::AllReduce));
      return {{work}, on_first_stream(x, [=]() mutable {
                buffer.zero_();
                buffer.index_copy_(0, index, values.to(buffer.scalar_type()));
              })};
    }
    at::Tensor all_values = at::empty({world * k}, x.options());
    at::Tensor all_index = at::empty({world * k}, x.options().dtype(at::kInt));
    all_values.narrow(0, rank * k, k).copy_(values);
    all_index.narrow(0, rank * k, k).copy_(index);
    const auto gather = on(StreamRole::AllGather);
    std::vector<Work> works = {comm.all_gather(all_values, all_values.narrow(0, rank * k, k), gather),
                               comm.all_gather(all_index, all_index.narrow(0, rank * k, k), gather)};
    return {std::move(works), on_first_stream(x, [=]() mutable {
              at::Tensor out =
                  buffer.scalar_type() == at::kFloat ? buffer : at::empty({numel}, all_values.options());
              kernels::average_scattered(all_values, all_index, world, out, form);
              if (!out.is_same(buffer)) buffer.copy_(out);
            })};
  }

  std::map<std::string, at::Tensor> state() const override { return residuals_.state(); }
  void load_state(const std::map<std::string, at::Tensor>& state) override { residuals_.load(state); }

 private:
  // k distinct positions every rank draws alike: from the seed, the step and the bucket.
  at::Tensor drawn(std::int64_t numel, std::int64_t k, const GradBucket& bucket) const {
    const std::uint64_t seed = options_.seed * 0x9E3779B97F4A7C15ull ^
                               (static_cast<std::uint64_t>(bucket.step) << 20) ^
                               static_cast<std::uint64_t>(bucket.index);
    // Floyd's sampling: k distinct positions, uniformly, in O(k) draws (a permutation of
    // the whole bucket costs a draw per element), in increasing order.
    std::mt19937_64 random(seed);
    std::unordered_set<std::int64_t> chosen;
    chosen.reserve(static_cast<std::size_t>(2 * k));
    for (std::int64_t j = numel - k; j < numel; ++j) {
      const std::int64_t t = std::uniform_int_distribution<std::int64_t>(0, j)(random);
      if (!chosen.insert(t).second) chosen.insert(j);
    }
    std::vector<std::int64_t> sorted(chosen.begin(), chosen.end());
    std::sort(sorted.begin(), sorted.end());
    return at::tensor(sorted, at::kLong);
  }

  SparsifyOptions options_;
  bool top_;
  Residuals residuals_;
};

// Note [PowerSGD on the device]
// PowerSGD's factors live where the gradients do: on a GPU its products, its QR and its
// collectives run on the device, on the stream backward runs on (each op follows the
// ones before it there; a collective waits for that stream's work and the stream for the
// collective). Its second round, when the engine finishes the bucket, runs on the stream
// its first did (Note [A hook's two halves on a device]). Q's first values are drawn on
// the host, alike on every rank, and copied over; a Q or a residual loaded from a
// checkpoint is moved to the gradients' device when first used.
class PowerSGDHook final : public CommHook {
 public:
  explicit PowerSGDHook(const PowerSGDOptions& options) : options_(options) {}
  std::string describe() const override {
    return fmt::format("power_sgd(rank={}, start_step={}, warm_start={}, error_feedback={}, seed={})",
                       options_.rank, options_.start_step, options_.warm_start, options_.error_feedback,
                       options_.seed);
  }

  HookWork reduce(Communicator& comm, const GradBucket& bucket) override {
    if (bucket.step < options_.start_step) {
      return {{comm.all_reduce(bucket.buffer, ReduceOp::Avg, on(StreamRole::AllReduce))}, nullptr};
    }
    at::Tensor m = options_.error_feedback ? residuals_.corrected(bucket) : bucket.buffer.to(at::kFloat);
    // The matrices worth compressing, and the rest (sent whole, in one vector).
    std::vector<Matrix> matrices;
    std::vector<std::pair<std::int64_t, std::int64_t>> plain;  // (offset, numel) in the bucket
    for (std::size_t i = 0; i < bucket.params.size(); ++i) {
      const auto& p = bucket.params[i];
      if (i == 0 && p.offset > 0) plain.emplace_back(0, p.offset);  // values of no named parameter
      std::int64_t numel = 1;
      for (auto d : p.shape) numel *= d;
      const std::int64_t end = i + 1 < bucket.params.size() ? bucket.params[i + 1].offset : m.numel();
      at::Tensor flat = m.narrow(0, p.offset, numel);
      const std::int64_t rows = p.shape.empty() ? 1 : p.shape[0], cols = rows == 0 ? 0 : numel / rows;
      const std::int64_t r = std::min<std::int64_t>({options_.rank, rows, cols});
      if (p.shape.size() >= 2 && r > 0 && (rows + cols) * r < rows * cols) {
        matrices.push_back({flat.view({rows, cols}), r, p.offset});
      } else {
        plain.emplace_back(p.offset, numel);
      }
      if (end > p.offset + numel) plain.emplace_back(p.offset + numel, end - p.offset - numel);  // padding
    }
    if (bucket.params.empty()) plain.emplace_back(0, m.numel());
    // P = M Q for every matrix, in one buffer, averaged with the plain values.
    std::int64_t p_numel = 0, plain_numel = 0;
    for (const auto& x : matrices) p_numel += x.m.size(0) * x.rank;
    for (const auto& [offset, numel] : plain) plain_numel += numel;
    at::Tensor wire = at::empty({p_numel + plain_numel}, m.options());
    std::int64_t at_p = 0;
    for (const auto& x : matrices) {
      at::Tensor q = start_q(bucket.index, bucket.step, x);
      at::Tensor p = wire.narrow(0, at_p, x.m.size(0) * x.rank).view({x.m.size(0), x.rank});
      at::mm_out(p, x.m, q);
      at_p += x.m.size(0) * x.rank;
    }
    for (const auto& [offset, numel] : plain) {
      wire.narrow(0, at_p, numel).copy_(m.narrow(0, offset, numel));
      at_p += numel;
    }
    Work first = comm.all_reduce(wire, ReduceOp::Avg, on(StreamRole::AllReduce));
    at::Tensor buffer = bucket.buffer;
    const int index = bucket.index;
    // Q's round needs P orthonormalized: it runs when the engine finishes the bucket, on
    // the all-gather stream (buckets finish in bucket order on every rank, so that
    // stream sees the same ops in the same order everywhere). On a device it runs on the
    // stream the first round did (Note [A hook's two halves on a device]).
    return {{first},
            on_first_stream(m, [this, &comm, buffer, m, wire, matrices, plain, p_numel, index]() mutable {
              std::int64_t at = 0;
              std::vector<at::Tensor> ps;
              std::int64_t q_numel = 0;
              for (const auto& x : matrices) {
                at::Tensor p = wire.narrow(0, at, x.m.size(0) * x.rank).view({x.m.size(0), x.rank});
                ps.push_back(std::get<0>(at::linalg_qr(p, "reduced")));
                at += x.m.size(0) * x.rank;
                q_numel += x.m.size(1) * x.rank;
              }
              at::Tensor q_wire = at::empty({q_numel}, m.options());
              at = 0;
              for (std::size_t i = 0; i < matrices.size(); ++i) {
                const auto& x = matrices[i];
                at::Tensor q = q_wire.narrow(0, at, x.m.size(1) * x.rank).view({x.m.size(1), x.rank});
                at::mm_out(q, x.m.t(), ps[i]);
                at += x.m.size(1) * x.rank;
              }
              if (q_numel > 0) comm.all_reduce(q_wire, ReduceOp::Avg, on(StreamRole::AllGather)).wait();
              // P Q^T straight into the bucket when it is fp32 (M is read no more: Q's round is
              // done), and M - P Q^T left in M's own buffer as the residual.
              const bool direct = buffer.scalar_type() == at::kFloat;
              at::Tensor out = direct ? buffer : at::empty_like(m);
              at = 0;
              for (std::size_t i = 0; i < matrices.size(); ++i) {
                const auto& x = matrices[i];
                at::Tensor q = q_wire.narrow(0, at, x.m.size(1) * x.rank).view({x.m.size(1), x.rank});
                at += x.m.size(1) * x.rank;
                at::Tensor approx = out.narrow(0, x.offset, x.m.numel()).view_as(x.m);
                at::mm_out(approx, ps[i], q.t());
                if (options_.error_feedback) x.m.sub_(approx);
                if (options_.warm_start) keep_q(index, x.offset, q.clone());
              }
              // The plain values, averaged, back where they came from; sent whole, they leave
              // nothing over.
              at = p_numel;
              for (const auto& [offset, numel] : plain) {
                out.narrow(0, offset, numel).copy_(wire.narrow(0, at, numel));
                if (options_.error_feedback) m.narrow(0, offset, numel).zero_();
                at += numel;
              }
              if (options_.error_feedback) residuals_.keep(index, m);
              if (!direct) buffer.copy_(out);
            })};
  }

  std::map<std::string, at::Tensor> state() const override {
    auto out = residuals_.state();
    std::lock_guard<std::mutex> lock(mutex_);
    for (const auto& [key, q] : qs_) out[fmt::format("q.{}.{}", key.first, key.second)] = q;
    return out;
  }
  void load_state(const std::map<std::string, at::Tensor>& state) override {
    residuals_.load(state);
    std::lock_guard<std::mutex> lock(mutex_);
    qs_.clear();
    for (const auto& [name, t] : state) {
      if (name.rfind("q.", 0) != 0) continue;
      const auto dot = name.find('.', 2);
      qs_[{std::stoi(name.substr(2, dot - 2)), std::stoll(name.substr(dot + 1))}] = t.to(at::kFloat).clone();
    }
  }

 private:
  struct Matrix {
    at::Tensor m;  // a view of the corrected gradient
    std::int64_t rank;
    std::int64_t offset;  // in the bucket
  };

  // Q of the previous step (warm start), or one drawn alike on every rank: without warm
  // start a new one every step, as PyTorch reseeds every step (a fixed Q would weigh the same
  // directions less on every step).
  at::Tensor start_q(int index, std::int64_t step, const Matrix& x) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = qs_.find({index, x.offset});
      if (options_.warm_start && it != qs_.end() && it->second.size(0) == x.m.size(1) &&
          it->second.size(1) == x.rank) {
        if (it->second.device() != x.m.device()) it->second = it->second.to(x.m.device());  // loaded
        return it->second;
      }
    }
    const std::uint64_t fresh = options_.warm_start ? 0 : static_cast<std::uint64_t>(step) * 104729;
    auto generator =
        at::make_generator<at::CPUGeneratorImpl>(options_.seed * 1000003 + index * 7919 + x.offset + fresh);
    return at::randn({x.m.size(1), x.rank}, generator).to(x.m.device());
  }
  void keep_q(int index, std::int64_t offset, at::Tensor q) {
    std::lock_guard<std::mutex> lock(mutex_);
    qs_[{index, offset}] = std::move(q);
  }

  PowerSGDOptions options_;
  Residuals residuals_;
  mutable std::mutex mutex_;
  std::map<std::pair<int, std::int64_t>, at::Tensor> qs_;  // by (bucket, offset in it)
};

}  // namespace

std::shared_ptr<CommHook> all_reduce() { return std::make_shared<AllReduceHook>(); }

std::shared_ptr<CommHook> low_precision(const LowPrecisionOptions& options) {
  if (options.dtype != at::kBFloat16 && options.dtype != at::kHalf) {
    throw InvalidArgument(fmt::format("flatshard::hooks::low_precision: dtype is bf16 or fp16, not {}",
                                      c10::toString(options.dtype)));
  }
  return std::make_shared<LowPrecisionHook>(options.dtype);
}

std::shared_ptr<CommHook> quantize_8bit(const QuantizeOptions& options) {
  if (options.chunk_numel <= 0) {
    throw InvalidArgument(fmt::format("flatshard::hooks::quantize_8bit: chunk_numel must be positive, not {}",
                                      options.chunk_numel));
  }
  return std::make_shared<QuantizeHook>(options.chunk_numel);
}

namespace {
void check_ratio(const char* who, double ratio) {
  if (!(ratio > 0 && ratio <= 1)) {
    throw InvalidArgument(fmt::format(
        "flatshard::hooks::{}: ratio is the fraction of each bucket sent, in (0, 1], not {}", who, ratio));
  }
}
}  // namespace

std::shared_ptr<CommHook> top_k(const SparsifyOptions& options) {
  check_ratio("top_k", options.ratio);
  return std::make_shared<SparsifyHook>(options, /*top=*/true);
}

std::shared_ptr<CommHook> power_sgd(const PowerSGDOptions& options) {
  if (options.rank <= 0 || options.start_step < 0) {
    throw InvalidArgument(fmt::format(
        "flatshard::hooks::power_sgd: rank must be positive and start_step at least 0, not {} and {}",
        options.rank, options.start_step));
  }
  return std::make_shared<PowerSGDHook>(options);
}

std::shared_ptr<CommHook> random_k(const SparsifyOptions& options) {
  check_ratio("random_k", options.ratio);
  return std::make_shared<SparsifyHook>(options, /*top=*/false);
}

std::shared_ptr<CommHook> parse(const std::string& spec) {
  const auto colon = spec.find(':');
  const std::string name = spec.substr(0, colon);
  const std::string rest = colon == std::string::npos ? "" : spec.substr(colon + 1);
  const auto bad = [&] {
    return InvalidArgument(fmt::format(
        "flatshard::hooks::parse: '{}' is not a hook; use none, all_reduce, bf16, fp16, int8[:CHUNK_NUMEL], "
        "top_k:RATIO, random_k:RATIO or power_sgd:RANK[:START_STEP]",
        spec));
  };
  try {
    if (name == "none" && rest.empty()) return nullptr;
    if (name == "all_reduce" && rest.empty()) return all_reduce();
    if (name == "bf16" && rest.empty()) return low_precision({at::kBFloat16});
    if (name == "fp16" && rest.empty()) return low_precision({at::kHalf});
    if (name == "int8")
      return quantize_8bit({rest.empty() ? QuantizeOptions{}.chunk_numel : std::stoll(rest)});
    if ((name == "top_k" || name == "random_k") && !rest.empty()) {
      SparsifyOptions o;
      o.ratio = std::stod(rest);
      return name == "top_k" ? top_k(o) : random_k(o);
    }
    if (name == "power_sgd" && !rest.empty()) {
      PowerSGDOptions o;
      const auto second = rest.find(':');
      o.rank = std::stoi(rest.substr(0, second));
      if (second != std::string::npos) o.start_step = std::stoll(rest.substr(second + 1));
      return power_sgd(o);
    }
  } catch (const std::logic_error&) {  // stoi and friends
    throw bad();
  }
  throw bad();
}

}  // namespace flatshard::hooks
