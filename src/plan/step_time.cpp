// The step-time model (include/flatshard/step_time.h): each strategy's step, simulated unit
// by unit on a compute stream and the links, as the engine schedules it.
#include "flatshard/step_time.h"

#include "src/plan/compute_stream.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <set>
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
// one layer's whole set; selective keeps half. The loss adds the logits: the logits in the
// parameters' dtype, the fp32 log-probabilities the cross-entropy keeps and their fp32
// gradient, (2 + 8) x vocab bytes per token in bf16 and (4 + 8) in fp32. An estimate within
// tens of percent: measure_activation_bytes gives the exact figure for a model at hand.
std::int64_t estimate_activation_bytes(const TransformerShape& m, const TimeOptions& o) {
  const double tokens = static_cast<double>(o.sequences) * static_cast<double>(o.sequence_length);
  const double scale = o.param_bytes / 2.0;
  const double hidden = m.llama ? 8.0 * static_cast<double>(m.ffn) : 16.0 * static_cast<double>(m.dim);
  const double layer = (18.0 * static_cast<double>(m.dim) + hidden) * tokens * scale;
  double layers = m.layers * layer;
  if (o.recompute == Recompute::Selective) layers /= 2;
  if (o.recompute == Recompute::Full)
    layers = m.layers * 2.0 * static_cast<double>(m.dim) * tokens * scale + layer;
  const double logits = (o.param_bytes + 8.0) * static_cast<double>(m.vocab) * tokens;
  return static_cast<std::int64_t>(layers + logits);
}

HookModel parse_hook_model(const std::string& spec) {
  using K = HookModel::Kind;
  HookModel h;
  const auto colon = spec.find(':');
  const std::string name = spec.substr(0, colon);
  const std::string rest = colon == std::string::npos ? "" : spec.substr(colon + 1);
  auto bad = [&] {
    return std::invalid_argument(
        fmt::format("no hook '{}': none, all_reduce, bf16, fp16, int8[:CHUNK], top_k:RATIO, random_k:RATIO, "
                    "power_sgd:RANK[:START_STEP]",
                    spec));
  };
  auto number = [&](const std::string& text, double& out) {
    std::size_t used = 0;
    try {
      out = std::stod(text, &used);
    } catch (const std::exception&) {
      throw bad();
    }
    if (used != text.size() || !(out > 0) || out > 1e9) throw bad();
  };
  double x = 0;
  if ((name == "none" || name == "all_reduce" || name == "bf16" || name == "fp16") && !rest.empty())
    throw bad();
  if (name == "none") {
    h.kind = K::None;
  } else if (name == "all_reduce") {
    h.kind = K::AllReduce;
  } else if (name == "bf16" || name == "fp16") {
    h.kind = K::LowPrecision;
  } else if (name == "int8") {
    h.kind = K::Int8;
    if (!rest.empty()) {
      number(rest, x);
      if (x != std::floor(x)) throw bad();
      h.chunk = static_cast<int>(x);
    }
  } else if (name == "top_k" || name == "random_k") {
    h.kind = name == "top_k" ? K::TopK : K::RandomK;
    number(rest, x);
    if (x > 1) throw bad();
    h.ratio = x;
  } else if (name == "power_sgd") {
    h.kind = K::PowerSGD;
    const auto second = rest.find(':');
    number(rest.substr(0, second), x);
    if (x != std::floor(x)) throw bad();
    h.rank = static_cast<int>(x);
    if (second != std::string::npos) {
      const std::string start = rest.substr(second + 1);
      if (start.empty() || start.find_first_not_of("0123456789") != std::string::npos) throw bad();
    }
  } else {
    throw bad();
  }
  return h;
}

// --- the simulation ----------------------------------------------------------------------

bool groups_fit_nodes(const Cluster& c, int group) {
  return group >= 1 && (c.world() <= c.per_node || c.per_node % group == 0 || group % c.per_node == 0);
}

namespace {

using sim::ComputeStream;
using sim::Cost;
using sim::Lane;

// NeighborExchange: `bytes` to each ring neighbour (once at 2 ranks), a ring step each.
enum class Collective { AllGather, ReduceScatter, AllReduce, NeighborExchange };

// A ring collective of `bytes` (the whole, gathered or unreduced size) over `ranks`.
// `beside`: the link's figures as it runs beside compute (Note [Collectives beside
// compute]), or nullptr.
Cost cost(Collective c, double bytes, int ranks, const Link& link, const Link* beside = nullptr) {
  if (ranks <= 1 || bytes <= 0) return {};
  const bool exchange = c == Collective::NeighborExchange;
  const double steps = c == Collective::AllReduce ? 2.0 * (ranks - 1)
                       : exchange                 ? (ranks > 2 ? 2 : 1)
                                                  : ranks - 1.0;
  const double moved = exchange ? bytes * steps : bytes * steps / ranks;
  // An all-reduce at its own bus bandwidth where the link has one (Link::
  // all_reduce_bus_bandwidth); beside compute, the link's figure there in the same ratio.
  const double own = c == Collective::AllReduce && link.all_reduce_bus_bandwidth > 0 && link.bus_bandwidth > 0
                         ? link.all_reduce_bus_bandwidth / link.bus_bandwidth
                         : 1.0;
  const double cpu = moved / (link.bus_bandwidth * own);  // the work of moving its bytes, the cores free
  if (beside) {  // never faster than with the cores free (a faster reading is noise)
    const double waits = steps * std::max(beside->latency, link.latency);
    return {moved / (std::min(beside->bus_bandwidth, link.bus_bandwidth) * own) + waits, waits, cpu};
  }
  const double latency = steps * link.latency;
  return {cpu + latency, latency};
}

// Note [Rings across nodes]
// NCCL runs a collective over ranks of several nodes as several rings side by side (its
// channels), each leaving a node through another NIC: on rail-optimized nodes with a NIC per
// device, the ranks of one node send across nodes together. A ring over `ranks` ranks
// `stride` apart (1: consecutive ranks, a shard group or the world; the group size: one rank
// of each group, hybrid's replicas) that holds k ranks on each node therefore moves bytes at
// k times one device's inter-node bandwidth, up to the intra-node link's; its steps wait for
// the network (the inter-node latency). So a world of 8-GPU H100 nodes with 400 Gb/s per GPU
// reads about 8 x 45 = 360 GB/s, NVLink's pace (nccl-tests across two such nodes report
// 350-450 GB/s for an all-reduce), while hybrid's replicas of node-sized groups, one rank per
// node, read one NIC's 45 GB/s (every hop of their rings goes from node to node). Groups
// must not straddle nodes (a ring that is part of a
// node and part of another is not modelled: plan_cluster and flatshard-plan refuse it).
Link ring_link(const Cluster& c, int ranks, int stride) {
  if (ranks * stride <= c.per_node) return c.intra;
  const int k = stride >= c.per_node ? 1 : std::min(ranks, c.per_node / stride);
  if (k == 1) return c.inter;  // every hop from node to node: NVLink takes no part
  Link l;
  l.bus_bandwidth = std::min(c.intra.bus_bandwidth, k * c.inter.bus_bandwidth);
  l.latency = std::max(c.intra.latency, c.inter.latency);
  if (c.intra.all_reduce_bus_bandwidth > 0 || c.inter.all_reduce_bus_bandwidth > 0) {
    const auto own = [](const Link& x) {
      return x.all_reduce_bus_bandwidth > 0 ? x.all_reduce_bus_bandwidth : x.bus_bandwidth;
    };
    l.all_reduce_bus_bandwidth = std::min(own(c.intra), k * own(c.inter));
  }
  return l;
}

// Decentralized training's exchange over nodes (no ring: Note [Rings across nodes]): each
// rank sends `bytes` to both ring neighbours at once. With one rank per node both cross
// nodes on its one NIC; with several, a rank at a node's edge sends one neighbour's share
// on its NIC and the other's on NVLink, side by side, and the rest stay within the node.
Cost exchange_across_nodes(const Cluster& c, double bytes, int ranks) {
  if (c.per_node == 1) return cost(Collective::NeighborExchange, bytes, ranks, c.inter);
  const Cost nic = cost(Collective::NeighborExchange, bytes, 2, c.inter);
  const Cost nvlink = cost(Collective::NeighborExchange, bytes, 2, c.intra);
  return nic.seconds >= nvlink.seconds ? nic : nvlink;
}

// A parameter as PowerSGD views it: an a x b matrix (b = 1: a vector, averaged whole).
struct Tensor2 {
  double a = 0, b = 1;
};

// One decoder layer's parameters in the order the model registers them (models/gpt.h,
// models/llama.h): the order of its flat buffer, and of the shards cut from it.
std::vector<Tensor2> layer_tensors(const TransformerShape& m) {
  const auto d = static_cast<double>(m.dim);
  if (!m.llama)  // ln1, qkv (no bias), proj, ln2, fc, out
    return {{d}, {d}, {3 * d, d}, {d, d}, {d}, {d}, {d}, {4 * d, d}, {4 * d}, {d, 4 * d}, {d}};
  const auto kv = static_cast<double>((m.kv_heads > 0 ? m.kv_heads : m.heads) * m.head_dim());
  const auto f = static_cast<double>(m.ffn);  // q, k, v, o, gate, up, down, the two RMSNorms
  return {{d, d}, {kv, d}, {kv, d}, {d, d}, {f, d}, {f, d}, {d, f}, {d}, {d}};
}

// A bucket's values as a hook sees them (Note [Communication algorithms in the step-time
// model]).
struct Part {
  double elements = 0;
  double whole = 0;     // PowerSGD: sent as they are (vectors, matrices too small to gain)
  double p = 0, q = 0;  // PowerSGD: the values of P (a x r) and Q (b x r) of the compressed matrices
  void add(const Tensor2& t, int rank) {
    elements += t.a * t.b;
    if (t.b > 1 && rank * (t.a + t.b) < t.a * t.b) {
      p += t.a * rank;
      q += t.b * rank;
    } else {
      whole += t.a * t.b;
    }
  }
  void add(const Part& o) {
    elements += o.elements;
    whole += o.whole;
    p += o.p;
    q += o.q;
  }
};

Part part_of(const std::vector<Tensor2>& tensors, int rank) {
  Part part;
  for (const auto& t : tensors) part.add(t, rank);
  return part;
}

// Under HybridShard the hook gets each unit's shard (Note [Hooks across shard groups] in
// sharding/averaging.cpp): a matrix is compressed only where it lies wholly in the shard,
// and the pieces the shard's edges cut are sent as they are. The ranks of a shard group
// step together, so the shard that sends the most sets the pace.
Part worst_shard(const std::vector<Tensor2>& tensors, int group, int rank) {
  double total = 0;
  for (const auto& t : tensors) total += t.a * t.b;
  const double size = total / group;
  Part worst;
  auto sent = [](const Part& p) { return p.whole + p.p + p.q; };
  for (int s = 0; s < group; ++s) {
    const double lo = s * size, hi = lo + size;
    Part part;
    double at = 0;
    for (const auto& t : tensors) {
      const double begin = at, end = at + t.a * t.b;
      at = end;
      const double inside = std::min(end, hi) - std::max(begin, lo);
      if (inside <= 0) continue;
      if (begin >= lo && end <= hi) {
        part.add(t, rank);
      } else {
        part.elements += inside;
        part.whole += inside;
      }
    }
    if (s == 0 || sent(part) > sent(worst)) worst = part;
  }
  return worst;
}

// Note [Communication algorithms in the step-time model]
// A hook (comm_hooks.h, src/comm/hooks.cpp) reduces each bucket in the engine's place: it
// compresses on the compute stream when the bucket is ready, runs its collectives on the
// bucket's link, and writes the average when the engine finishes the bucket (at the next
// bucket's launch, waiting for it where one is in flight, or at the end of backward). What
// crosses the wire follows each hook's code (n values in a bucket, N ranks): bf16/fp16 an
// all-reduce of 2n bytes; int8 two all-gathers, each rank's n codes and a 4-byte scale per
// chunk; top-k two all-gathers, each rank's k = ratio n values and their int32 indices;
// random-k an all-reduce of k values; PowerSGD an all-reduce of P (a x r per compressed
// matrix) with the values it sends whole, then, inside the bucket's finish (which waits
// for it), one of Q (b x r). Its work is counted in bytes moved per value at the device's
// memory bandwidth, as the hooks' code moves them on an fp32 bucket, plus PowerSGD's
// matmuls at its throughput:
// - bf16/fp16: divide (8) and cast (6) to compress, the cast back (6) to finish;
// - int8: one pass quantizes (5: read, codes written; each chunk's maximum in cache), and
//   the finish reads every rank's codes (N) and writes the average (4);
// - top-k: error feedback's add (12), the radix select's two passes (8); the finish zero
//   fills the sum (4), divides it (8) and copies it into the bucket (8), and per value
//   received from each rank widens its index (12) and adds it (20);
// - random-k: error feedback's add (12) and, per value sent, 32 (the draw, the select, the
//   residual's zeros); the finish zero fills the bucket (4) and scatters the k (16 each);
// - PowerSGD: error feedback's add over the bucket (12); per value of its compressed
//   matrices M read for MQ (4) and MᵀP (4), PQᵀ written (4) and the residual M - PQᵀ (12);
//   per value sent whole its copies to and from the wire (16) and its residual zeroed (4);
//   2r FLOPs for each of MQ, MᵀP and PQᵀ, and 2ar² for P's QR.
// On a CPU torch's kernels and the hooks' loops run well below the memory's bandwidth:
// TimeOptions::hook_work_s, measured, scales all of it. Staleness (Note [Bounded
// staleness] in sharding/averaging.cpp) copies each bucket (a read and a write in the
// reduction dtype) and reduces the copy; the engine finishes, in its place, the same
// bucket's reduction of s steps before and copies its average back (this rank's slice
// under ZeRO-1). The model runs s + 8 steps on the same links and reports the last: where
// the links keep up, no step waits; where they do not, the step is the links' time.
// Decentralized training (Note [Decentralized training] in sharding/replicated.cpp)
// averages no gradient: every k-th step the fp32 parameters go to each ring neighbour
// (one send at 2 ranks, two from 3), issued as the step starts and waited for at the end
// of backward, then averaged (two adds and a division: 32 bytes per parameter); the model
// runs k steps and reports their mean.
struct Round {
  Collective op = Collective::AllReduce;
  double bytes = 0;  // the whole: gathered or unreduced
};
struct BucketCost {
  double compress = 0;  // compute before its first collectives are issued
  Round first, also;    // issued together (int8's codes and scales, top-k's values and indices)
  double between = 0;   // PowerSGD: compute once the first is finished, before the second
  Round second;         // PowerSGD's Q, waited for within the finish
  double finish = 0;    // compute once its collectives are finished
};

BucketCost bucket_cost(const HookModel& h, const Part& b, int ranks, double reduce_bytes, bool zero1,
                       const Cluster& c) {
  using K = HookModel::Kind;
  const double n = b.elements, bw = c.memory_bandwidth, N = ranks;
  BucketCost k;
  switch (h.kind) {
    case K::None:
      k.first = {zero1 ? Collective::ReduceScatter : Collective::AllReduce, n * reduce_bytes};
      break;
    case K::AllReduce: k.first = {Collective::AllReduce, n * reduce_bytes}; break;
    case K::LowPrecision:
      k.compress = 14 * n / bw;
      k.first = {Collective::AllReduce, 2 * n};
      k.finish = 6 * n / bw;
      break;
    case K::Int8:
      k.compress = 5 * n / bw;
      k.first = {Collective::AllGather, N * n};
      k.also = {Collective::AllGather, N * 4 * std::ceil(n / h.chunk)};
      k.finish = (N + 4) * n / bw;
      break;
    case K::TopK: {
      const double values = std::ceil(h.ratio * n);
      k.compress = 20 * n / bw;
      k.first = {Collective::AllGather, N * 4 * values};
      k.also = {Collective::AllGather, N * 4 * values};
      k.finish = (20 * n + 32 * N * values) / bw;
      break;
    }
    case K::RandomK: {
      const double values = std::ceil(h.ratio * n);
      k.compress = (12 * n + 32 * values) / bw;
      k.first = {Collective::AllReduce, 4 * values};
      k.finish = (4 * n + 16 * values) / bw;
      break;
    }
    case K::PowerSGD: {
      const double m = n - b.whole, w = b.whole, r = h.rank;
      k.compress = (12 * n + 4 * m + 8 * w) / bw + 2 * r * m / c.flops;
      k.first = {Collective::AllReduce, 4 * (b.p + w)};
      k.between = 4 * m / bw + (2 * r * m + 2 * r * b.p) / c.flops;
      k.second = {Collective::AllReduce, 4 * b.q};
      k.finish = (16 * m + 12 * w) / bw + 2 * r * m / c.flops;
      break;
    }
  }
  return k;
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
  if (c.intra.all_reduce_bus_bandwidth < 0 || c.inter.all_reduce_bus_bandwidth < 0)
    throw std::invalid_argument("predict_time: a link's all_reduce_bus_bandwidth is 0 or more");
  if (c.intra_beside_compute.bus_bandwidth < 0 || c.intra_beside_compute.latency < 0)
    throw std::invalid_argument("predict_time: intra_beside_compute's bandwidth and latency are 0 or more");
  const bool sharded = o.strategy == Strategy::FullShard || o.strategy == Strategy::ShardGradOp ||
                       o.strategy == Strategy::HybridShard;
  int group = n;  // ranks a unit is sharded over
  if (o.strategy == Strategy::HybridShard) group = o.shard_group_size > 0 ? o.shard_group_size : c.per_node;
  if (group >= 1 && n % group == 0 && !groups_fit_nodes(c, group))
    throw std::invalid_argument(fmt::format(
        "predict_time: shard groups of {} would straddle nodes of {} devices (Note [Rings across nodes])",
        group, c.per_node));
  if (group < 1 || n % group != 0)
    throw std::invalid_argument(
        fmt::format("predict_time: a shard group of {} does not divide {} ranks", group, n));
  const int replicas = n / group;
  const bool replicated = o.strategy == Strategy::NoShard || o.strategy == Strategy::ShardOptimizerState;
  const bool hooked = o.hook.kind != HookModel::Kind::None;
  if (o.staleness < 0 || o.decentralized_every < 0 || o.hook_work_s < 0)
    throw std::invalid_argument("predict_time: staleness, decentralized_every and hook_work_s are 0 or more");
  if (hooked && !replicated && !(o.strategy == Strategy::HybridShard && replicas > 1))
    throw std::invalid_argument(
        "predict_time: a hook reduces the replicated strategies' buckets or hybrid's all-reduce across "
        "two or more shard groups");
  if (o.staleness > 0 && !replicated)
    throw std::invalid_argument("predict_time: staleness is NoShard's and ShardOptimizerState's");
  if (o.staleness > 8)
    throw std::invalid_argument("predict_time: staleness is at most 8 (FullyShardOptions::kMaxStaleness)");
  if (o.decentralized_every > 0 &&
      (o.strategy != Strategy::NoShard || hooked || o.staleness > 0 || o.offload))
    throw std::invalid_argument(
        "predict_time: decentralized training is NoShard's, with neither a hook, staleness nor offload");
  if (hooked && o.offload) throw std::invalid_argument("predict_time: a hook with offload is not modelled");
  if (o.first_bucket_bytes <= 0 || o.bucket_bytes <= 0)
    throw std::invalid_argument("predict_time: first_bucket_bytes and bucket_bytes are above 0");
  if (o.peer_lag_s < 0 || o.peer_lag_interval_s <= 0)
    throw std::invalid_argument("predict_time: peer_lag_s is 0 or more, peer_lag_interval_s above 0");
  // A group of consecutive ranks stays on a node's links while it fits in one; replica
  // groups (one rank of each shard group) cross nodes when there are several (Note [Rings
  // across nodes]).
  const Link group_ring = ring_link(c, group, 1);
  const Link replica_ring = ring_link(c, n / group, group);
  const Link world_ring = ring_link(c, n, 1);
  const Link& group_link = group <= c.per_node ? c.intra : group_ring;
  const Link& replica_link = n <= c.per_node ? c.intra : replica_ring;
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

  // The hook's view of the model's gradients (Note [Communication algorithms in the
  // step-time model]): a layer's, the head's with the final norm's (first in backward), the
  // embeddings' (last); under HybridShard a unit's shard.
  const int hook_rank = o.hook.kind == HookModel::Kind::PowerSGD ? o.hook.rank : 1;
  const auto d = static_cast<double>(m.dim);
  const Part layer_part = part_of(layer_tensors(m), hook_rank);
  Part head_part;  // the final norm's vectors, then the head
  head_part.whole = head_part.elements = m.llama ? d : 2 * d;
  if (!m.tied) head_part.add(Tensor2{static_cast<double>(m.vocab), d}, hook_rank);
  std::vector<Tensor2> embeddings{{static_cast<double>(m.vocab), d}};
  if (!m.llama) embeddings.push_back({static_cast<double>(m.context), d});
  Part embeddings_part = part_of(embeddings, hook_rank);
  // The root's own count: what the parts above leave of it is sent as it is.
  embeddings_part.whole +=
      static_cast<double>(m.root_params()) - head_part.elements - embeddings_part.elements;
  embeddings_part.elements = static_cast<double>(m.root_params()) - head_part.elements;
  // Measured hook work (TimeOptions::hook_work_s) scales the passes: the whole model as one
  // bucket on one rank is what bench_modes --hook-work 1 times.
  double hook_scale = 1;
  if (hooked && o.hook_work_s > 0) {
    Part all = head_part;
    for (int k = 0; k < m.layers; ++k) all.add(layer_part);
    all.add(embeddings_part);
    const BucketCost alone = bucket_cost(o.hook, all, 1, o.reduce_bytes, false, c);
    const double modelled = alone.compress + alone.between + alone.finish;
    if (modelled > 0) hook_scale = o.hook_work_s / modelled;
  }
  auto hook_cost = [&](const Part& b, int ranks, bool zero1) {
    // One rank alone reduces nothing: the engine skips its buckets' reductions and the hook.
    BucketCost k = bucket_cost(ranks > 1 ? o.hook : HookModel{}, b, ranks, o.reduce_bytes, zero1, c);
    k.compress *= hook_scale;
    k.between *= hook_scale;
    k.finish *= hook_scale;
    return k;
  };
  Part layer_shard, root_shard;
  if (o.strategy == Strategy::HybridShard && hooked) {
    layer_shard = worst_shard(layer_tensors(m), group, hook_rank);
    std::vector<Tensor2> root = embeddings;
    root.push_back({m.llama ? d : 2 * d});
    if (!m.tied) root.push_back({static_cast<double>(m.vocab), d});
    root_shard = worst_shard(root, group, hook_rank);
  }

  StepTime t;
  t.forward_s = m.layers * layer_fwd + head_fwd;
  t.backward_s = m.layers * layer_bwd + 2 * head_fwd;
  Waits waits;
  double now = 0;  // the compute stream
  // What the step reports counts from here: the replicated strategies run several steps
  // under staleness and decentralized training and report the mean of the last `window`.
  double window_begin = 0, busy0 = 0, latency0 = 0, copies0 = 0, host0 = 0, contended0 = 0;
  int window = 1;

  // Each unit's gradient reduction: reduce-scatter within the shard group, then (hybrid)
  // all-reduce of the shard across replicas. Returns when it is done. Each link's queue
  // keeps its collectives in the order issued; a unit's all-reduce across nodes holds up
  // the next unit's reduce-scatter only through compute's wait for it (Note [One
  // reduce-scatter in flight], below), never a gather on the node's links. Offloaded, the
  // copy to the host starts as the reduction ends, where the engine starts it when it
  // finishes the reduction at the next unit's (not modelled).
  double landed = 0;          // offload: when the last gradient shard reached the host
  double last_reduction = 0;  // when the last unit's collectives of its reduction completed
  // Note [Communication algorithms in the step-time model], under HybridShard (Note [Hooks
  // across shard groups] in sharding/averaging.cpp): when the next unit's gradients are
  // reduced, the engine finishes the hook running (waits for its rounds; PowerSGD's second
  // within its finish), then waits for the last unit's reduce-scatter and starts its hook,
  // whose rounds run beside the next unit's backward. At the end of backward the last
  // unit's (the root's) hook runs at once.
  const Part* hook_due = nullptr;  // its reduce-scatter in flight, its hook not started
  BucketCost running{};            // the hook started, and when its first rounds end
  double running_done = -1;
  bool running_last = false;  // the root's hook at the end of backward: its wait is a meeting
  auto wait_for_reduction = [&](double done) {  // compute waits for a reduction to be done
    if (done > now) waits.reductions += done - now;
    now = std::max(now, done);
  };
  // Note [Ranks drifting apart]
  // Ranks doing the same work between two meetings do not finish it together: each one's
  // pace jitters (the kernel's scheduling, caches, the memory shared with its peers), and a
  // round every rank must issue starts when the last one issues it. A round issued ahead of
  // its wait hides the lag behind the rank's own compute; one issued and waited for at once
  // does not. In the engine there are two such rounds:
  // - a hook's second round (PowerSGD's Q, inside the bucket's finish): under HybridShard
  //   once per unit, mid-backward, where bench/wait_trace.py finds three quarters of that
  //   round's stalls before the last rank's issue on this CPU;
  // - the last round of backward (the root's reduction; the last bucket's, or its hook's
  //   first round), which every rank waits for as soon as it has issued it: the step ends
  //   when the last rank's backward does, plus that round. Under staleness (rounds issued
  //   steps before) and decentralized training (an exchange issued at the step's start,
  //   no buckets) the end of backward waits for nothing issued there, and nothing is added.
  // Jitter accumulates as independent noise does, so the last rank's lag grows as the
  // square root of the time since the ranks last met: TimeOptions::peer_lag_s after
  // peer_lag_interval_s (bench_desync measures it: the same work between barriers). The
  // ranks meet where a rank has waited for such a round; under the sharded strategies
  // also at the step's start (the root's gather, waited for at once), and under ZeRO-1 at
  // its end (the gathers behind the optimizer's step). DDP's ranks meet at neither: from
  // backward's last round to the next lies the optimizer's step, forward and backward, so
  // DDP's step is taken after one step more, its lag counted from the step before. The
  // other waits, which the lag is not put on, are not counted as meetings.
  double met = 0;
  auto lag_at = [&](double issued) {
    if (n < 2) return 0.0;  // one rank meets no one
    return o.peer_lag_s * std::sqrt(std::max(0.0, issued - met) / o.peer_lag_interval_s);
  };
  auto at_once = [&](Lane& lane, double issued, Cost cost_of) {  // issued and waited for at once
    wait_for_reduction(lane.run(issued + lag_at(issued), cost_of));
    met = now;
  };
  auto finish_running_hook = [&] {
    if (running_done < 0) return;
    wait_for_reduction(running_done);
    running_done = -1;
    if (running_last) met = now;
    if (running.second.bytes > 0) {
      now = compute.run(now, running.between);
      t.engine_s += running.between;
      at_once(lane_of(replica_link), now,
              cost(running.second.op, running.second.bytes, replicas, replica_link));
    }
    now = compute.run(now, running.finish);
    t.engine_s += running.finish;
  };
  // Starts the hook of the unit whose reduce-scatter was waited for; `busy_until`: when
  // backward's compute runs out.
  // `last`: the end of backward's, which starts when the last rank issues it.
  auto start_hook = [&](double busy_until, bool last) {
    if (!hook_due) return;
    running = hook_cost(*hook_due, replicas, false);
    hook_due = nullptr;
    now = compute.run(now, running.compress);
    t.engine_s += running.compress;
    Lane& ar = lane_of(replica_link);
    running_done = now;
    running_last = last;
    const double issued = last ? now + lag_at(now) : now;
    for (const Round& round : {running.first, running.also}) {
      if (round.bytes > 0)
        running_done = ar.run(issued, cost(round.op, round.bytes, replicas, replica_link,
                                           beside(replica_link, ar, issued, busy_until)));
    }
  };
  // `shard`: the unit's shard as a hook across the groups sees it.
  auto reduce_unit = [&](double issued, double elements, double busy_until, const Part& shard) {
    Lane& rs = lane_of(group_link);
    double done = rs.run(issued, cost(Collective::ReduceScatter, elements * o.reduce_bytes, group, group_link,
                                      beside(group_link, rs, issued, busy_until)));
    if (replicas > 1 && hooked) {
      hook_due = &shard;  // run when it is finished
    } else if (replicas > 1) {
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
    // `busy_until`: when backward's compute runs out (a hook started here runs beside it).
    auto wait_for_last_reduction = [&](double busy_until, bool last = false) {
      finish_running_hook();
      wait_for_reduction(last_reduction);
      start_hook(busy_until, last);
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
      wait_for_last_reduction(now + k * layer_bwd);
      reduced = std::max(reduced, reduce_unit(now, layer_bytes, now + k * layer_bwd, layer_shard));
    }
    wait_for_last_reduction(now);
    // The root's, after the embedding's backward: the last round of backward, which starts
    // when the last rank issues it (Note [Ranks drifting apart]); under a hook across the
    // groups, its hook's first round is.
    const double root_issued = hooked && replicas > 1 ? now : now + lag_at(now);
    reduced = std::max(reduced, reduce_unit(root_issued, root_bytes, now, root_shard));
    if (hook_due) {  // the end of backward: the last hook running, then the root's at once
      wait_for_last_reduction(now, true);
      finish_running_hook();
    }
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
    // order and reduces each when full (all-reduce; ZeRO-1 reduce-scatter; or the hook's
    // rounds). Under staleness the model runs s + 8 steps on the same links, under
    // decentralized training k (Note [Communication algorithms in the step-time model]).
    const bool zero1 = o.strategy == Strategy::ShardOptimizerState;
    const Link& link = n <= c.per_node ? c.intra : world_ring;
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
    const double params = static_cast<double>(m.params());
    // The head's gradients come first (with the final norm's), the embeddings' last.
    const double head_elements = head_part.elements;
    // Note [The first bucket]
    // The engine fills buckets in the order gradients arrive, in the compute dtype's bytes:
    // the first up to first_bucket_bytes, the rest up to bucket_bytes, a parameter larger
    // than the bucket in one of its own (sharding/buckets.cpp). An untied head at least as
    // large as the first bucket is the first bucket alone (the model puts the final norm's
    // vectors with it, the engine in the next), reduced beside the whole backward: with
    // DDP's 1 MiB and the small GPT's 4 MiB head through 1 Gb/s, 30 ms of its step. A
    // smaller head shares the first bucket with the norm and the last layer's first
    // parameters, at most first_bucket_bytes; the model counts those with the bucket after
    // it.
    const double bucket_elements = static_cast<double>(o.bucket_bytes) / o.param_bytes;
    const double first_bucket_elements = static_cast<double>(o.first_bucket_bytes) / o.param_bytes;
    const double owned = zero1 ? n : 1;  // a bucket's share this rank steps
    // Note [Queued bucket reductions] (sharding/replicated.cpp): DDP's fp32 gradients live
    // in one persistent buffer and its buckets queue; otherwise (ZeRO-1, a compute dtype
    // under fp32 masters, offload) each bucket's buffer is freed when its reduction is
    // finished, and compute waits for the last bucket's before it issues the next.
    const bool one_in_flight = zero1 || o.param_bytes < 4 || o.offload;
    const bool decentralized = o.decentralized_every > 0;
    window = decentralized ? o.decentralized_every : 1;
    // Note [Ranks drifting apart]: DDP's lag spans the optimizer's step of the step before.
    const bool lag_spans_steps = !zero1 && o.staleness == 0 && !decentralized && n > 1 && o.peer_lag_s > 0;
    const int steps = o.staleness > 0 ? o.staleness + 8 : window + (lag_spans_steps ? 1 : 0);
    // A bucket's reduction as the engine keeps it until it finishes it.
    struct Reduction {
      BucketCost cost;
      double done = 0, landed = 0;  // its first round; offloaded, its copy to the host
      double elements = 0;
      bool finished = false;
      bool last = false;  // backward's last, issued when the last rank does: its wait is a meeting
    };
    std::vector<std::vector<Reduction>> issued(steps);
    const double layer_back = layer_bwd + layer_bytes * grad_passes;
    const double embeddings_back = (root_bytes - head_elements) * grad_passes;
    const double staleness_copy =
        o.staleness > 0 ? 2.0 * o.reduce_bytes / c.memory_bandwidth : 0;  // s per value
    double engine = 0;  // the hook's, staleness's and decentralized training's work in the window
    for (int step = 0; step < steps; ++step) {
      if (!lag_spans_steps || step == 0) met = now;  // Note [Ranks drifting apart]
      if (step == steps - window) {                  // what the step reports starts here
        window_begin = now;
        waits = Waits{};
        engine = 0;
        busy0 = intra.busy + inter.busy;
        latency0 = intra.latency + inter.latency;
        copies0 = h2d.busy + d2h.busy;
        host0 = host.busy;
        contended0 = compute.contended;
      }
      const double backward_end =
          now + t.forward_s + t.backward_s + params * grad_passes;  // at the full rate
      // Decentralized training: every k-th step (the window's last) the parameters go to the
      // ring neighbours from the step's start, beside forward and backward.
      double exchanged = 0;
      if (decentralized && step == steps - 1 && n > 1)
        exchanged = lane.run(now, n <= c.per_node ? cost(Collective::NeighborExchange, 4 * params, n, link,
                                                         beside(link, lane, now, backward_end))
                                                  : exchange_across_nodes(c, 4 * params, n));
      // Forward, the head's backward and its gradients.
      now = compute.run(now, t.forward_s + 2 * head_fwd + head_elements * grad_passes);
      std::vector<Reduction>& mine = issued[step];
      // The reductions this step finishes: its own, or under staleness those of s steps before.
      std::vector<Reduction>* due = step >= o.staleness ? &issued[step - o.staleness] : nullptr;
      // The engine finishes a bucket: waits for its collectives, runs the hook's finish
      // (PowerSGD's second round within it, waited for), and under staleness copies the
      // average back into the bucket (this rank's slice under ZeRO-1).
      auto finish = [&](Reduction& r) {
        wait_for_reduction(r.done);
        if (r.last) met = now;
        if (r.cost.second.bytes > 0) {
          now = compute.run(now, r.cost.between);
          engine += r.cost.between;
          at_once(
              lane, now,
              cost(r.cost.second.op, r.cost.second.bytes, n, link, beside(link, lane, now, backward_end)));
        }
        const double work = r.cost.finish + r.elements / owned * staleness_copy;
        now = compute.run(now, work);
        engine += work;
        r.finished = true;
      };
      Part pending = head_part;
      std::vector<double> buckets;
      // Bucket by bucket, issued at `now`; `remaining`: backward's compute still to run.
      // Backward's last bucket, waited for at once (no staleness), starts when the last rank
      // issues it (Note [Ranks drifting apart]).
      auto flush = [&](double remaining) {
        if (pending.elements <= 0) return;
        buckets.push_back(pending.elements);
        if (!decentralized) {
          // Before launching bucket b the engine finishes the buckets before it: the last one
          // (one in flight, waiting for it), or those already complete (queued).
          if (due) {
            for (std::size_t j = 0; j < std::min(buckets.size() - 1, due->size()); ++j) {
              Reduction& r = (*due)[j];
              if (!r.finished && (one_in_flight || r.done <= now)) finish(r);
            }
          }
          Reduction r;
          r.cost = hook_cost(pending, n, zero1);
          const double work = pending.elements * staleness_copy + r.cost.compress;
          now = compute.run(now, work);
          engine += work;
          r.elements = pending.elements;
          r.last = remaining <= 0 && o.staleness == 0;
          const double at = r.last ? now + lag_at(now) : now;
          for (const Round& round : {r.cost.first, r.cost.also}) {
            if (round.bytes > 0)
              r.done =
                  lane.run(at, cost(round.op, round.bytes, n, link, beside(link, lane, at, now + remaining)));
          }
          r.done = std::max(r.done, now);
          if (o.offload) r.landed = copy(d2h, r.done, pending.elements / owned * 4);  // behind its reduction
          mine.push_back(r);
        }
        pending = Part{};
      };
      if (pending.elements >= first_bucket_elements)
        flush(m.layers * layer_back + embeddings_back);  // Note [The first bucket]
      for (int k = m.layers - 1; k >= 0; --k) {
        now = compute.run(now, layer_back);
        pending.add(layer_part);
        if (pending.elements >= bucket_elements) flush(k * layer_back + embeddings_back);
      }
      pending.add(embeddings_part);
      now = compute.run(now, embeddings_back);  // the embeddings'
      flush(0);
      // The end of backward finishes every bucket due, waits for second rounds and, offloaded,
      // for the averages to land on the host.
      double landed_all = 0;
      if (due) {
        for (Reduction& r : *due) {
          if (!r.finished) finish(r);
          landed_all = std::max(landed_all, r.landed);
        }
      }
      wait_for_reduction(landed_all);
      if (exchanged > 0) {
        wait_for_reduction(exchanged);
        const double average = 32 * params / c.memory_bandwidth;  // two adds and a division, fp32
        now = compute.run(now, average);
        engine += average;
      }
      const double per_param = 12 + 2 * o.optimizer_state_bytes;
      t.optimizer_s = 0;
      if (o.offload) {
        // The host steps bucket by bucket; each stepped bucket goes back to the device (and
        // under ZeRO-1 is gathered from there).
        double back = now;
        const double host_before = host.busy;
        for (double b : buckets) {
          now = host_step(now, b / owned);
          back = copy(h2d, std::max(now, back), b / owned * send_bytes);
          if (zero1) back = lane.run(back, cost(Collective::AllGather, b * o.param_bytes, n, link));
        }
        t.optimizer_s = host.busy - host_before;
        if (back > now) waits.gathers += back - now;
        now = std::max(now, back);
      } else if (!zero1) {
        t.optimizer_s = params * per_param / c.memory_bandwidth;
        now = compute.run(now, t.optimizer_s);
      } else {
        // Note [Gathers behind the step]: each bucket's slice is gathered as soon as it is stepped.
        double gathered = now;
        double steps_left = 0;  // the steps' compute still to run after each gather's issue
        for (double b : buckets) steps_left += b / n * per_param / c.memory_bandwidth;
        for (double b : buckets) {
          const double step_s = b / n * per_param / c.memory_bandwidth;
          t.optimizer_s += step_s;
          steps_left -= step_s;
          now = compute.run(now, step_s);
          const double at = std::max(now, gathered);
          gathered = lane.run(at, cost(Collective::AllGather, b * o.param_bytes, n, link,
                                       beside(link, lane, at, now + steps_left)));
        }
        if (gathered > now) waits.gathers += gathered - now;
        now = std::max(now, gathered);
      }
    }
    t.engine_s = params * grad_passes + engine / window;
  }

  // The replicated strategies report the mean of their last `window` steps.
  t.step_s = (now - window_begin) / window;
  t.communication_s = (intra.busy + inter.busy - busy0) / window;
  t.copies_s = (h2d.busy + d2h.busy - copies0) / window;
  t.exposed_s = (waits.gathers + waits.reductions) / window;  // the compute stream's waits
  waits.host /= window;
  t.contended_s = (compute.contended - contended0) / window;
  t.tokens_per_s = tokens / t.step_s;
  const double model_flops = 3 * m.forward_flops_per_token(o.sequence_length) * tokens;
  t.mfu = c.peak_flops > 0 ? model_flops / t.step_s / c.peak_flops : 0;
  const double latency = (intra.latency + inter.latency - latency0) / window;
  // The host's step after backward is time the devices idle; stepping in backward, only
  // what is left of it after the last gradient landed.
  const double host_idle =
      o.step_in_backward ? waits.host : (host.busy - host0) / window;  // the devices' idle time for it
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
  // The strategies the engine runs with `base`'s hook, staleness and decentralized training.
  const bool hooked = base.hook.kind != HookModel::Kind::None;
  auto runs = [&](Strategy s, int group) {
    const bool replicated = s == Strategy::NoShard || s == Strategy::ShardOptimizerState;
    if (hooked && !replicated && !(s == Strategy::HybridShard && group < n)) return false;
    if (base.staleness > 0 && !replicated) return false;
    return base.decentralized_every == 0 || s == Strategy::NoShard;
  };
  auto add = [&](const std::string& name, Strategy s, int group) {
    if (!runs(s, group)) return;
    StrategyPlan r;
    r.name = name;
    r.options = base;
    r.options.strategy = s;
    r.options.shard_group_size = group;
    const bool replicated = s == Strategy::NoShard || s == Strategy::ShardOptimizerState;
    // The replicated strategies step after backward whatever base asks (the engine steps in
    // backward only for the sharded ones); their rows say so in time as in memory.
    r.options.step_in_backward = base.step_in_backward && !replicated;
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
  // Groups of a node, two nodes, ... and the one `base` names (a part of a node, say).
  std::set<int> groups;
  for (int k = 1; k < cluster.nodes; ++k) {
    if (cluster.nodes % k == 0) groups.insert(k * cluster.per_node);
  }
  if (base.shard_group_size > 0 && base.shard_group_size < n && n % base.shard_group_size == 0 &&
      groups_fit_nodes(cluster, base.shard_group_size))
    groups.insert(base.shard_group_size);
  for (int g : groups) add(fmt::format("hybrid (groups of {})", g), Strategy::HybridShard, g);
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
