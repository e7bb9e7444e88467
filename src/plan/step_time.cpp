// The step-time model (include/flatshard/step_time.h): each strategy's step, simulated unit
// by unit on a compute stream and the links, as the engine schedules it.
#include "flatshard/step_time.h"

#include "src/plan/compute_stream.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <utility>
#include <vector>

#include <fmt/format.h>

namespace flatshard::plan {

// --- shapes ------------------------------------------------------------------------------

std::int64_t TransformerShape::layer_params() const {
  const std::int64_t d = dim;
  if (!llama) return 12 * d * d + 10 * d;  // qkv 3d², proj d²+d, fc 4d²+4d, out 4d²+d, two LayerNorms 4d
  const std::int64_t kv = (kv_heads > 0 ? kv_heads : heads) * head_dim();
  return d * d + 2 * d * kv + d * d + 3 * d * ffn + 2 * d;  // q, k and v, o, SwiGLU, two RMSNorms
}

std::int64_t TransformerShape::root_params() const {
  const std::int64_t d = dim;
  const std::int64_t head = tied ? 0 : vocab * d;
  if (!llama) return vocab * d + context * d + 2 * d + head;  // wte, wpe, ln_f, head (no bias)
  return vocab * d + d + head;                                // embed_tokens, norm, lm_head
}

double TransformerShape::forward_flops_per_token(std::int64_t seq) const {
  // Embedding lookups are no matmuls: the token embedding (unless it is the head too) and
  // GPT's learned positions are left out.
  const double weights = static_cast<double>(params() - vocab * dim - (llama ? 0 : context * dim)) +
                         (tied ? static_cast<double>(vocab * dim) : 0);
  return 2 * weights + 4.0 * layers * heads * static_cast<double>(head_dim()) * static_cast<double>(seq);
}

ModelShape TransformerShape::model_shape() const {
  ModelShape s;
  s.root_numel = root_params();
  s.unit_numels.assign(static_cast<std::size_t>(layers), layer_params());
  s.largest_param_numel = std::max(vocab * dim, llama ? dim * ffn : 4 * dim * dim);
  return s;
}

TransformerShape gpt(int layers, std::int64_t dim, int heads, std::int64_t vocab, std::int64_t context) {
  TransformerShape m;
  m.name = fmt::format("gpt-{}x{}", layers, dim);
  m.layers = layers;
  m.dim = dim;
  m.heads = heads;
  m.vocab = vocab;
  m.context = context;
  return m;
}

TransformerShape gpt_1b() {
  auto m = gpt(18, 2048, 16, 32768, 1024);
  m.name = "gpt-1b";
  return m;
}

TransformerShape llama3_8b() {
  TransformerShape m;
  m.name = "llama3-8b";
  m.llama = true;
  m.layers = 32;
  m.dim = 4096;
  m.heads = 32;
  m.kv_heads = 8;
  m.ffn = 14336;
  m.vocab = 128256;
  return m;
}

TransformerShape llama3_70b() {
  TransformerShape m = llama3_8b();
  m.name = "llama3-70b";
  m.layers = 80;
  m.dim = 8192;
  m.heads = 64;
  m.ffn = 28672;
  return m;
}

TransformerShape named_model(const std::string& name) {
  if (name == "gpt-1b") return gpt_1b();
  if (name == "llama3-8b") return llama3_8b();
  if (name == "llama3-70b") return llama3_70b();
  throw std::invalid_argument(
      fmt::format("no model named '{}': gpt-1b, llama3-8b, llama3-70b (or --gpt L,D,H,V,C)", name));
}

// Note [The H100 cluster's figures]
// - flops: 530 TFLOP/s of bf16 per GPU: the throughput at which this model reproduces what
//   FlatShard's full shard measured on an H100 SXM 80GB at world 1 (the 1.04B GPT, 16
//   sequences of 1,024 tokens, 79,736 tokens/s, docs/cuda.md): `flatshard-plan --cluster 1x1
//   --model gpt-1b --seq 1024 --batch 16 --calibrate-ms 205.5`. A calibration on the device,
//   not the datasheet.
// - peak_flops: 989 TFLOP/s, the datasheet's dense bf16 peak (for MFU).
// - memory_bandwidth: 2.7 TB/s, 80% of HBM3's 3.35 TB/s, for the fused optimizer step.
// - intra: NVLink 4 within an 8-GPU node; nccl-tests' all-gather and reduce-scatter bus
//   bandwidth at large sizes is about 360 GB/s; 3 µs per ring step.
// - inter: 400 Gb/s RDMA per GPU (one NIC per GPU), about 45 GB/s of bus bandwidth once
//   the protocol's overhead is paid; 8 µs per ring step.
// - pcie: PCIe 5 x16 between each GPU and its host, 55 GB/s each way with page-locked
//   memory (what CUDA's bandwidth test typically shows of the 64 GB/s), 10 µs per copy.
// - host_bandwidth: 129 GB/s for the optimizer's step on the host: what reproduces
//   FlatShard's offloaded full shard on that H100 (the 1.04B GPT, 4 sequences of 1,024
//   tokens, bf16 copies sent, 16 host threads: 363.9 ms per step, docs/cuda.md), with
//   the throughput above. A calibration too.
// None of these was measured across machines here: docs/scaling.md shows what each
// changes.
Cluster h100_cluster(int nodes, int per_node) {
  Cluster c;
  c.name = fmt::format("{}x{} H100", nodes, per_node);
  c.nodes = nodes;
  c.per_node = per_node;
  c.flops = 530e12;
  c.peak_flops = 989e12;
  c.memory_bandwidth = 2.7e12;
  c.intra = {360e9, 3e-6};
  c.inter = {45e9, 8e-6};
  c.pcie = {55e9, 10e-6};
  c.host_bandwidth = 129e9;
  return c;
}

// Note [Activations from the shapes]
// Per layer and token, in 2-byte activations (twice that in fp32), with attention that
// keeps no score matrix (flash or memory-efficient attention, as SDPA picks): the
// attention's inputs and outputs, about 18 x dim bytes (Korthikanti et al.'s count without
// the s² terms and dropout masks), and the MLP's, 4 x its hidden width for GPT's GELU
// (input of the second matmul and the GELU's input) or 8 x for Llama's SwiGLU (gate, up,
// their activation and product). Full recomputation keeps each layer's input (2 x dim) and
// one layer's whole set; selective keeps half. The loss adds the logits: 2-byte logits, their
// fp32 copy and its gradient, 10 x vocab bytes per token. An estimate within tens of
// percent: measure_activation_bytes gives the exact figure for a model at hand.
std::int64_t estimate_activation_bytes(const TransformerShape& m, const TimeOptions& o) {
  const double tokens = static_cast<double>(o.sequences) * static_cast<double>(o.sequence_length);
  const double scale = o.param_bytes / 2.0;
  const double hidden = m.llama ? 8.0 * static_cast<double>(m.ffn) : 16.0 * static_cast<double>(m.dim);
  const double layer = (18.0 * static_cast<double>(m.dim) + hidden) * tokens * scale;
  double layers = m.layers * layer;
  if (o.recompute == Recompute::Selective) layers /= 2;
  if (o.recompute == Recompute::Full)
    layers = m.layers * 2.0 * static_cast<double>(m.dim) * tokens * scale + layer;
  return static_cast<std::int64_t>(layers + 10.0 * static_cast<double>(m.vocab) * tokens);
}

// --- the simulation ----------------------------------------------------------------------

namespace {

using sim::ComputeStream;
using sim::Cost;
using sim::Lane;

enum class Collective { AllGather, ReduceScatter, AllReduce };

// A ring collective of `bytes` (the whole, gathered or unreduced size) over `ranks`.
// `beside`: the link's figures as it runs beside compute (Note [Collectives beside
// compute]), or nullptr.
Cost cost(Collective c, double bytes, int ranks, const Link& link, const Link* beside = nullptr) {
  if (ranks <= 1 || bytes <= 0) return {};
  const double steps = c == Collective::AllReduce ? 2.0 * (ranks - 1) : ranks - 1.0;
  const double moved = bytes * steps / ranks;
  const double cpu = moved / link.bus_bandwidth;  // the work of moving its bytes, the cores free
  if (beside) {  // never faster than with the cores free (a faster reading is noise)
    const double waits = steps * std::max(beside->latency, link.latency);
    return {moved / std::min(beside->bus_bandwidth, link.bus_bandwidth) + waits, waits, cpu};
  }
  const double latency = steps * link.latency;
  return {cpu + latency, latency};
}

// What a step's compute waits on, to name what limits it.
struct Waits {
  double gathers = 0, reductions = 0;
  double host = 0;  // offloaded, stepping in backward: for the host's step after the last copy
};

}  // namespace

StepTime predict_time(const TransformerShape& m, const Cluster& c, const TimeOptions& o) {
  const int n = c.world();
  if (n < 1 || c.flops <= 0) throw std::invalid_argument("predict_time: a cluster needs devices and flops");
  if (o.sharding_work_s < 0 || c.collective_compute_share < 0 || c.collective_compute_share > 1)
    throw std::invalid_argument(
        "predict_time: sharding_work_s is 0 or more, collective_compute_share 0 to 1");
  if (c.intra_beside_compute.bus_bandwidth < 0 || c.intra_beside_compute.latency < 0)
    throw std::invalid_argument("predict_time: intra_beside_compute's bandwidth and latency are 0 or more");
  const bool sharded = o.strategy == Strategy::FullShard || o.strategy == Strategy::ShardGradOp ||
                       o.strategy == Strategy::HybridShard;
  int group = n;  // ranks a unit is sharded over
  if (o.strategy == Strategy::HybridShard) group = o.shard_group_size > 0 ? o.shard_group_size : c.per_node;
  if (group < 1 || n % group != 0)
    throw std::invalid_argument(
        fmt::format("predict_time: a shard group of {} does not divide {} ranks", group, n));
  const int replicas = n / group;
  // A group of consecutive ranks stays on a node's links while it fits in one; replica
  // groups (one rank of each shard group) cross nodes when there are several.
  const Link& group_link = group <= c.per_node ? c.intra : c.inter;
  const Link& replica_link = n <= c.per_node ? c.intra : c.inter;
  Lane intra{&c.intra}, inter{&c.inter};
  ComputeStream compute{c.collective_compute_share, {&intra, &inter}};
  auto lane_of = [&](const Link& l) -> Lane& { return &l == &c.intra ? intra : inter; };
  // Note [Collectives beside compute]
  // On a CPU host whose cores the ranks' compute fills, a collective issued while its rank
  // goes on computing runs slower than the same collective with the cores free: at every
  // ring step its communicator thread waits for a core that a compute thread holds, and it
  // moves bytes on a share of the cores. Cluster::intra_beside_compute gives the link so
  // measured (bench_collectives --beside-compute: every rank's compute thread busy), and a
  // collective takes those figures when it starts on its link before its rank's compute
  // runs out (`busy_until`: its issue plus the compute still to run after it, at the full
  // rate): a gather issued ahead of the unit that needs it, a reduction with backward still
  // to run, a bucket reduced before the last, ZeRO-1's gathers behind the steps still to
  // run. The gather that compute waits for next, and what starts once compute is done (the
  // end of backward, a queue that outlasts it), run on free cores. The compute it takes is
  // still the CPU's work of moving its bytes at the free link's rate (Note [Collectives on
  // the compute's cores]), spread over its longer time. Only the intra-node link: across
  // nodes a collective's pace is the network's. On a GPU NCCL's kernels hold their SMs: no
  // preset sets it.
  auto beside = [&](const Link& l, const Lane& lane, double issued, double busy_until) -> const Link* {
    const bool overlaps = std::max(issued, lane.free_at) < busy_until;
    return overlaps && &l == &c.intra && c.intra_beside_compute.bus_bandwidth > 0 ? &c.intra_beside_compute
                                                                                  : nullptr;
  };
  constexpr double kComputeGoesOn = std::numeric_limits<double>::infinity();
  // Note [Offload in the step-time model]: offloaded, the device holds no shard. Each
  // gather first copies this rank's shard from the host (its bf16 copy, or the fp32 master),
  // each reduced gradient shard is copied to the host (fp32), each direction a queue of its
  // own beside the collectives, and the host steps the masters at its memory's bandwidth:
  // after backward, or (stepping in backward, sharded strategies) unit by unit as each
  // gradient lands, one after another on the host. DDP and ZeRO-1 copy each reduced bucket
  // to the host, step after backward bucket by bucket, and copy each stepped bucket back
  // (ZeRO-1 then gathers it).
  if (o.offload && (c.pcie.bus_bandwidth <= 0 || c.host_bandwidth <= 0))
    throw std::invalid_argument("predict_time: offload needs the cluster's pcie link and host bandwidth");
  Lane h2d{&c.pcie}, d2h{&c.pcie}, host;
  const double send_bytes = o.offload_bf16_copy ? o.param_bytes : 4;
  const double host_per_param =
      12 + 2.0 * o.optimizer_state_bytes + (o.offload_bf16_copy && o.param_bytes < 4 ? o.param_bytes : 0);
  auto copy = [&](Lane& lane, double issued, double bytes) {
    return lane.run(issued, Cost{bytes / c.pcie.bus_bandwidth + c.pcie.latency, c.pcie.latency});
  };
  auto host_step = [&](double issued, double elements) {
    return host.run(issued, Cost{elements * host_per_param / c.host_bandwidth, 0});
  };

  const double tokens = static_cast<double>(o.sequences) * static_cast<double>(o.sequence_length);
  const double hd = static_cast<double>(m.head_dim());
  const double attention = 4.0 * m.heads * hd * static_cast<double>(o.sequence_length) * tokens;  // one layer
  double layer_fwd = (2.0 * static_cast<double>(m.layer_params()) * tokens + attention) / c.flops;
  double head_fwd = 2.0 * static_cast<double>(m.vocab * m.dim) * tokens / c.flops;
  double layer_bwd = 2 * layer_fwd;
  if (o.recompute == Recompute::Full) layer_bwd += layer_fwd;
  if (o.recompute == Recompute::Selective)
    layer_bwd += static_cast<double>(m.layer_params()) * tokens / c.flops;
  const double layer_bytes = static_cast<double>(m.layer_params());
  const double root_bytes = static_cast<double>(m.root_params());

  StepTime t;
  t.forward_s = m.layers * layer_fwd + head_fwd;
  t.backward_s = m.layers * layer_bwd + 2 * head_fwd;
  Waits waits;
  double now = 0;  // the compute stream

  // Each unit's gradient reduction: reduce-scatter within the shard group, then (hybrid)
  // all-reduce of the shard across replicas. Returns when it is done. Each link's queue
  // keeps its collectives in the order issued; a unit's all-reduce across nodes holds up
  // the next unit's reduce-scatter only through compute's wait for it (Note [One
  // reduce-scatter in flight], below), never a gather on the node's links. Offloaded, the
  // copy to the host starts as the reduction ends, where the engine starts it when it
  // finishes the reduction at the next unit's (not modelled).
  double landed = 0;          // offload: when the last gradient shard reached the host
  double last_reduction = 0;  // when the last unit's collectives of its reduction completed
  auto reduce_unit = [&](double issued, double elements, double busy_until) {
    Lane& rs = lane_of(group_link);
    double done = rs.run(issued, cost(Collective::ReduceScatter, elements * o.reduce_bytes, group, group_link,
                                      beside(group_link, rs, issued, busy_until)));
    if (replicas > 1) {
      Lane& ar = lane_of(replica_link);
      done = ar.run(done, cost(Collective::AllReduce, elements * o.reduce_bytes / group, replicas,
                               replica_link, beside(replica_link, ar, done, busy_until)));
    }
    last_reduction = done;
    if (o.offload) {
      done = copy(d2h, done, elements / group * 4);
      landed = std::max(landed, done);
      if (o.step_in_backward) done = host_step(done, elements / group);
    }
    return done;
  };

  if (sharded) {
    // Note [The sharded path's own work]
    // Beside the model's compute, each rank's compute stream copies its shard of each unit into
    // the unit's gather buffer (twice under full shard), adds each reduced gradient into its
    // gradient shard and runs the units' hooks. On a GPU that is a few milliseconds at HBM's
    // bandwidth; on a CPU a fifth to three quarters of the compute. TimeOptions::sharding_work_s gives
    // it for the whole model's shard (one rank alone, its step less DDP's, measured); a rank
    // of a shard group of g spends 1/g of it, in proportion to each unit's compute.
    const double work = o.sharding_work_s / group;
    t.engine_s = work;
    const double model_compute = t.forward_s + t.backward_s;
    const double stretch = model_compute > 0 ? 1 + work / model_compute : 1;
    layer_fwd *= stretch;
    layer_bwd *= stretch;
    head_fwd *= stretch;
    if (model_compute <= 0) now = compute.run(now, work);  // no compute to spread it over
    // Forward: the root is gathered first and kept; unit k's gather is issued when unit
    // k - prefetch starts (units 0..prefetch at once): `prefetch` units ahead.
    Lane& gl = lane_of(group_link);
    // A gather ahead of the unit compute needs next overlaps compute; that unit's does not.
    auto gather = [&](double issued, double elements, bool ahead) {
      if (o.offload) issued = copy(h2d, issued, elements / group * send_bytes);
      return gl.run(issued, cost(Collective::AllGather, elements * o.param_bytes, group, group_link,
                                 beside(group_link, gl, issued, ahead ? kComputeGoesOn : issued)));
    };
    const double root_ready = gather(0, root_bytes, false);
    std::vector<double> ready(m.layers), start(m.layers);
    int issued = 0;
    // Units up to `last`, issued at `at` while unit `current` is the one compute needs next.
    auto issue_until = [&](int last, double at, int current) {
      for (; issued <= std::min(last, m.layers - 1); ++issued)
        ready[issued] = gather(at, layer_bytes, issued != current);
    };
    issue_until(o.prefetch, 0, 0);
    if (root_ready > now) waits.gathers += root_ready - now;
    now = std::max(now, root_ready);
    for (int k = 0; k < m.layers; ++k) {
      issue_until(k + o.prefetch, now, k);
      if (ready[k] > now) waits.gathers += ready[k] - now;
      start[k] = now = std::max(now, ready[k]);
      now = compute.run(now, layer_fwd);
    }
    now = compute.run(now, 3 * head_fwd);  // the head's forward and backward (the root stays gathered)
    // Backward: full shard gathers each unit again (shard-grad-op kept them); each unit's
    // reduction is issued when its backward ends, one after another.
    const bool regather = o.strategy != Strategy::ShardGradOp;
    double reduced = 0;
    // Note [One reduce-scatter in flight] (sharding/gradients.cpp): before a unit's
    // gradients are reduced, compute waits for the previous unit's reduction (its
    // reduce-scatter and, hybrid, its all-reduce across replicas), so at most one is out.
    auto wait_for_last_reduction = [&] {
      if (last_reduction > now) waits.reductions += last_reduction - now;
      now = std::max(now, last_reduction);
    };
    int next = m.layers - 1;
    auto issue_back = [&](int last, double at, int current) {
      for (; regather && next >= std::max(last, 0); --next)
        ready[next] = gather(at, layer_bytes, next != current);
    };
    issue_back(m.layers - 1 - o.prefetch, now, m.layers - 1);
    for (int k = m.layers - 1; k >= 0; --k) {
      issue_back(k - o.prefetch, now, k);
      if (regather) {
        if (ready[k] > now) waits.gathers += ready[k] - now;
        now = std::max(now, ready[k]);
      }
      now = compute.run(now, layer_bwd);
      wait_for_last_reduction();
      reduced = std::max(reduced, reduce_unit(now, layer_bytes, now + k * layer_bwd));
    }
    wait_for_last_reduction();
    reduced =
        std::max(reduced, reduce_unit(now, root_bytes, now));  // the root's, after the embedding's backward
    // Waiting for the reductions (and offloaded, their copies to the host), then for what
    // the host still has to step.
    const double communicated = o.offload && o.step_in_backward ? std::min(reduced, landed) : reduced;
    if (communicated > now) waits.reductions += communicated - now;
    now = std::max(now, communicated);
    if (reduced > now) waits.host += reduced - now;
    now = std::max(now, reduced);
    // The optimizer steps this rank's shard: fp32 master read and written, the gradient
    // read, the state read and written.
    const double shard = static_cast<double>(m.params()) / group;
    if (!o.offload) {
      t.optimizer_s = shard * (12 + 2 * o.optimizer_state_bytes) / c.memory_bandwidth;
      now = compute.run(now, t.optimizer_s);
    } else if (o.step_in_backward) {
      t.optimizer_s = host.busy;  // within the waits above
    } else {
      now = host_step(now, shard);
      t.optimizer_s = host.busy;
    }
  } else {
    // DDP and ZeRO-1: forward needs no communication; backward fills buckets in reverse
    // order and reduces each when full (all-reduce; ZeRO-1 reduce-scatter).
    const bool zero1 = o.strategy == Strategy::ShardOptimizerState;
    const Link& link = n <= c.per_node ? c.intra : c.inter;
    Lane& lane = lane_of(link);
    // Note [ZeRO-1's bucket gradients]
    // DDP's gradients land in the parameters' own flat buffer. ZeRO-1's buckets (over two
    // ranks or more) hold gradients apart from the master shard: each backward a bucket's
    // buffer is zero-filled when its first gradient arrives, every gradient is added into
    // it (read, read, write) rather than kept as it was made, and the buffer is freed once
    // reduce-scattered: four passes over each parameter in the compute dtype, at the
    // memory's bandwidth, in backward's order. A few milliseconds per billion parameters
    // on a GPU; on a CPU about a tenth of the compute.
    const double grad_passes = zero1 && n > 1 ? 4.0 * o.param_bytes / c.memory_bandwidth : 0;  // s per param
    t.engine_s = static_cast<double>(m.params()) * grad_passes;
    // The head's gradients come first (with the final norm's), the embeddings' last.
    const double head_elements =
        static_cast<double>(m.tied ? 0 : m.vocab * m.dim) + 2.0 * static_cast<double>(m.dim);
    // Forward, the head's backward and its gradients.
    now = compute.run(now, t.forward_s + 2 * head_fwd + head_elements * grad_passes);
    const double bucket_elements = static_cast<double>(o.bucket_bytes) / o.reduce_bytes;
    double pending = head_elements;
    double reduced = 0;
    std::vector<double> buckets;
    const double owned = zero1 ? n : 1;  // a bucket's share this rank steps
    // Note [Queued bucket reductions] (sharding/replicated.cpp): DDP's fp32 gradients live
    // in one persistent buffer and its buckets queue; otherwise (ZeRO-1, a compute dtype
    // under fp32 masters, offload) each bucket's buffer is freed when its reduction is
    // finished, and compute waits for the last bucket's before it issues the next.
    const bool one_in_flight = zero1 || o.param_bytes < 4 || o.offload;
    // Bucket by bucket, issued at `now`; `remaining`: backward's compute still to run.
    auto flush = [&](double remaining) {
      if (pending <= 0) return;
      buckets.push_back(pending);
      if (one_in_flight && reduced > now) {
        waits.reductions += reduced - now;
        now = reduced;
      }
      const double issued = std::max(now, reduced);
      const double busy_until = now + remaining;
      reduced =
          lane.run(issued, cost(zero1 ? Collective::ReduceScatter : Collective::AllReduce,
                                pending * o.reduce_bytes, n, link, beside(link, lane, issued, busy_until)));
      if (o.offload) landed = copy(d2h, reduced, pending / owned * 4);  // behind its reduction
      pending = 0;
    };
    const double layer_back = layer_bwd + layer_bytes * grad_passes;
    const double embeddings_back = (root_bytes - head_elements) * grad_passes;
    if (pending >= bucket_elements) flush(m.layers * layer_back + embeddings_back);
    for (int k = m.layers - 1; k >= 0; --k) {
      now = compute.run(now, layer_back);
      pending += layer_bytes;
      if (pending >= bucket_elements) flush(k * layer_back + embeddings_back);
    }
    pending += root_bytes - head_elements;
    now = compute.run(now, embeddings_back);  // the embeddings'
    flush(0);
    reduced = std::max(reduced, landed);
    if (reduced > now) waits.reductions += reduced - now;
    now = std::max(now, reduced);
    const double per_param = 12 + 2 * o.optimizer_state_bytes;
    if (o.offload) {
      // The host steps bucket by bucket; each stepped bucket goes back to the device (and
      // under ZeRO-1 is gathered from there).
      double back = now;
      for (double b : buckets) {
        now = host_step(now, b / owned);
        back = copy(h2d, std::max(now, back), b / owned * send_bytes);
        if (zero1) back = lane.run(back, cost(Collective::AllGather, b * o.param_bytes, n, link));
      }
      t.optimizer_s = host.busy;
      if (back > now) waits.gathers += back - now;
      now = std::max(now, back);
    } else if (!zero1) {
      t.optimizer_s = static_cast<double>(m.params()) * per_param / c.memory_bandwidth;
      now = compute.run(now, t.optimizer_s);
    } else {
      // Note [Gathers behind the step]: each bucket's slice is gathered as soon as it is stepped.
      double gathered = now;
      double steps_left = 0;  // the steps' compute still to run after each gather's issue
      for (double b : buckets) steps_left += b / n * per_param / c.memory_bandwidth;
      for (double b : buckets) {
        const double step = b / n * per_param / c.memory_bandwidth;
        t.optimizer_s += step;
        steps_left -= step;
        now = compute.run(now, step);
        const double issued = std::max(now, gathered);
        gathered = lane.run(issued, cost(Collective::AllGather, b * o.param_bytes, n, link,
                                         beside(link, lane, issued, now + steps_left)));
      }
      if (gathered > now) waits.gathers += gathered - now;
      now = std::max(now, gathered);
    }
  }

  t.step_s = now;
  t.communication_s = intra.busy + inter.busy;
  t.copies_s = h2d.busy + d2h.busy;
  t.exposed_s = waits.gathers + waits.reductions;  // the compute stream's waits
  t.contended_s = compute.contended;
  t.tokens_per_s = tokens / t.step_s;
  const double model_flops = 3 * m.forward_flops_per_token(o.sequence_length) * tokens;
  t.mfu = c.peak_flops > 0 ? model_flops / t.step_s / c.peak_flops : 0;
  const double latency = intra.latency + inter.latency;
  // The host's step after backward is time the devices idle; stepping in backward, only
  // what is left of it after the last gradient landed.
  const double host_idle = o.step_in_backward ? waits.host : host.busy;  // the devices' idle time for it
  if (o.offload && host_idle > 0.2 * t.step_s && host_idle > t.exposed_s)
    t.limit = "host step";
  else if (t.contended_s >= 0.05 * t.step_s && t.contended_s > t.exposed_s)
    t.limit = "contention";  // compute slowed by the collectives beside it, more than it waits for them
  else if (t.exposed_s < 0.05 * t.step_s)
    t.limit = "compute";
  else if (o.offload && t.copies_s > t.communication_s)
    t.limit = "host copies";
  else if (latency > 0.5 * t.communication_s)
    t.limit = "latency";
  else
    t.limit = waits.gathers >= waits.reductions ? "gathers" : "reductions";
  return t;
}

// --- every strategy on a cluster ----------------------------------------------------------

std::vector<StrategyPlan> plan_cluster(const TransformerShape& model, const Cluster& cluster,
                                       const TimeOptions& base, std::int64_t device_bytes) {
  const int n = cluster.world();
  const std::int64_t activations = estimate_activation_bytes(model, base);
  std::vector<StrategyPlan> rows;
  auto add = [&](const std::string& name, Strategy s, int group) {
    StrategyPlan r;
    r.name = name;
    r.options = base;
    r.options.strategy = s;
    r.options.shard_group_size = group;
    const bool replicated = s == Strategy::NoShard || s == Strategy::ShardOptimizerState;
    PlanOptions m;
    m.strategy = s == Strategy::HybridShard ? Strategy::FullShard : s;
    m.world_size = n;
    m.shard_group_size = group;
    m.param_bytes = base.param_bytes;
    m.optimizer_state_bytes = base.optimizer_state_bytes;
    m.prefetch = base.prefetch;
    m.recompute = base.recompute == Recompute::Full;
    m.cpu_offload = base.offload;
    m.offload_bf16_copy = base.offload_bf16_copy;
    m.step_in_backward = base.step_in_backward && !replicated;
    m.build_into_shards = !replicated;
    m.activation_bytes = activations;
    r.memory = predict(model.model_shape(), m);
    r.time = predict_time(model, cluster, r.options);
    r.fits = r.memory.peak <= device_bytes;
    rows.push_back(std::move(r));
  };
  add("full shard", Strategy::FullShard, 0);
  add("shard-grad-op", Strategy::ShardGradOp, 0);
  for (int g = cluster.per_node; g < n; g *= 2) {
    if (n % g == 0) add(fmt::format("hybrid (groups of {})", g), Strategy::HybridShard, g);
  }
  add("ZeRO-1", Strategy::ShardOptimizerState, 0);
  add("DDP", Strategy::NoShard, 0);
  return rows;
}

const StrategyPlan* fastest_that_fits(const std::vector<StrategyPlan>& plans) {
  const StrategyPlan* best = nullptr;
  for (const auto& p : plans) {
    if (p.fits && (!best || p.time.tokens_per_s > best->time.tokens_per_s)) best = &p;
  }
  return best;
}

}  // namespace flatshard::plan
