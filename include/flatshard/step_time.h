// The step-time model: how long one training step takes in each strategy on a given
// cluster, from the model's shapes, a device's measured throughput and the links' costs.
//
//   auto model = flatshard::plan::llama3_8b();
//   flatshard::plan::Cluster c = flatshard::plan::h100_cluster(16, 8);   // 16 nodes of 8
//   flatshard::plan::TimeOptions o{.strategy = flatshard::Strategy::FullShard};
//   o.sequences = 2; o.sequence_length = 8192;
//   auto t = flatshard::plan::predict_time(model, c, o);   // t.step_s, t.tokens_per_s, t.mfu, ...
//   auto rows = flatshard::plan::plan_cluster(model, c, o, 80LL << 30);  // every strategy: time and memory
//   auto* best = flatshard::plan::fastest_that_fits(rows);
//
// flatshard-plan --cluster NODESxGPUS prints it for every strategy; docs/scaling.md states
// the model's assumptions and checks it against what the engine measured.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "flatshard/plan.h"
#include "flatshard/strategy.h"

namespace flatshard::plan {

// A decoder-only transformer by its shapes: GPT (models/gpt.h: LayerNorm, biases, a 4x
// GELU MLP, learned positions, untied head) or Llama (models/llama.h: RMSNorm, no biases,
// grouped-query attention, SwiGLU of width `ffn`, rotary positions).
struct TransformerShape {
  std::string name;
  bool llama = false;
  int layers = 0;
  std::int64_t dim = 0;
  int heads = 0;
  int kv_heads = 0;      // Llama: grouped-query attention (0: heads)
  std::int64_t ffn = 0;  // Llama: the SwiGLU's hidden width
  std::int64_t vocab = 0;
  std::int64_t context = 0;  // GPT: learned positions
  bool tied = false;         // the head shares the embedding's weights
  std::int64_t head_dim() const { return dim / heads; }
  std::int64_t layer_params() const;  // one decoder layer (one Unit)
  std::int64_t root_params() const;   // embeddings, final norm, head
  std::int64_t params() const { return layer_params() * layers + root_params(); }
  // Forward FLOPs of one token through the whole model at sequence length `seq`, in the
  // convention torchtitan and PaLM use: 2 per parameter and token over every weight but
  // the embeddings' (token and, for GPT, position), plus attention's 4 * layers * heads * head_dim * seq
  // (scores and their weighted sum, counted over the whole sequence, causal or not). Backward is twice the
  // forward.
  double forward_flops_per_token(std::int64_t seq) const;
  // The planner's view: each layer a unit, the rest the root.
  ModelShape model_shape() const;
};

// The GPT of examples/train_gpt and bench_modes (layers, dim, heads, vocab, context).
TransformerShape gpt(int layers, std::int64_t dim, int heads, std::int64_t vocab, std::int64_t context);
// The 1.04B GPT of the GPU benchmarks (bench_gpt_gpu: 18 layers, dim 2048, vocab 32768).
TransformerShape gpt_1b();
// Llama 3 / 3.1 8B and 70B as published (transformers' LlamaConfig of Meta-Llama-3.1-8B/70B).
TransformerShape llama3_8b();
TransformerShape llama3_70b();
// By name: "gpt-1b", "llama3-8b", "llama3-70b" (throws std::invalid_argument otherwise).
TransformerShape named_model(const std::string& name);

// A class of link: the cost of a ring collective step on it. nccl-tests' conventions: an
// all-gather or reduce-scatter of S bytes (the whole, gathered size) over n ranks takes
// S (n-1)/n / bus_bandwidth + (n-1) latency; an all-reduce twice that.
struct Link {
  double bus_bandwidth = 0;  // bytes/s, as nccl-tests reports busbw
  double latency = 0;        // seconds per ring step
  // An all-reduce's bus bandwidth where it is not the others' (0: bus_bandwidth, as NCCL's
  // ring runs it). The CPU rings' all-reduce runs in place, skipping the copies a
  // reduce-scatter and an all-gather each make apart, and at world 2 over TCP sends both
  // halves at once: on this CPU it reads 0.6 to 1.2 times the others' cost.
  double all_reduce_bus_bandwidth = 0;
};

// Where the ranks run: nodes of `per_node` devices, the links within and across nodes,
// and each device's throughput.
struct Cluster {
  std::string name;
  int nodes = 1;
  int per_node = 1;
  // Sustained FLOP/s of one device on this model's matmuls in the compute dtype: measured
  // (a calibration run, or a training run's MFU) rather than the datasheet's peak.
  double flops = 0;
  double peak_flops = 0;        // the datasheet's dense peak in the compute dtype, for MFU
  double memory_bandwidth = 0;  // bytes/s of the device's memory (the optimizer step)
  Link intra;                   // within a node
  Link inter;                   // across nodes, per device (a ring holding k devices of each
                                // node sends on their k NICs at once: Note [Rings across nodes])
  // CPU offload: the link between a device and its host (bytes/s in each direction, both
  // at once; seconds per copy) and the host memory's bandwidth for one device's optimizer
  // step on the host (a host serving 8 devices that step at once gives each an eighth).
  Link pcie;
  double host_bandwidth = 0;
  // The share of a device's compute that a collective takes from it while it moves bytes
  // (not in its ring steps' latency), 0 to 1 (Note [Collectives on the compute's cores] in
  // src/plan/compute_stream.h): about 0 on a GPU,
  // where NCCL's kernels take a few SMs (the H100 preset leaves it 0); 1 on a CPU host
  // whose cores the ranks' compute already fills, where the communicator's copies and
  // reductions run on those cores instead.
  double collective_compute_share = 0;
  // The intra-node link as it runs beside compute (Note [Collectives beside compute] in
  // src/plan/step_time.cpp): on a CPU host whose cores the ranks' compute fills, a collective
  // issued while its rank computes waits for a core at every ring step and shares the cores
  // it moves bytes on. Measured with every rank's compute thread busy; a bus bandwidth of 0
  // (the default, and a GPU's case, where NCCL's kernels hold their SMs) leaves `intra` for
  // every collective.
  Link intra_beside_compute;
  int world() const { return nodes * per_node; }
};

// H100 SXM nodes: NVLink within a node, 400 Gb/s RDMA per GPU across nodes (Note [The H100
// cluster's figures] in src/plan/step_time.cpp says where each number comes from).
Cluster h100_cluster(int nodes, int per_node);

// How activations are recomputed: none; selective, as torchtitan's per-op policy (every
// second matmul's output is kept, the others and the cheap ops are computed again: half a
// layer's matmul FLOPs again in backward, half its activations kept); or full (every
// block's forward again in backward: FlatShard's recompute.h).
enum class Recompute { None, Selective, Full };

// A communication hook as the step-time model sees it (comm_hooks.h; Note [Communication
// algorithms in the step-time model] in src/plan/step_time.cpp): what each bucket sends and
// the passes over its values that compress and decompress it.
struct HookModel {
  enum class Kind { None, AllReduce, LowPrecision, Int8, TopK, RandomK, PowerSGD };
  Kind kind = Kind::None;
  double ratio = 0.01;  // TopK, RandomK: the share of the values sent
  int rank = 4;         // PowerSGD
  int chunk = 256;      // Int8: values per fp32 scale
};
// The spec flatshard::hooks::parse takes: none, all_reduce, bf16, fp16, int8[:CHUNK],
// top_k:RATIO, random_k:RATIO, power_sgd:RANK[:START_STEP] (the model is the steady state:
// PowerSGD's START_STEP is read and left out). Throws std::invalid_argument otherwise.
HookModel parse_hook_model(const std::string& spec);

struct TimeOptions {
  Strategy strategy = Strategy::FullShard;
  int shard_group_size = 0;  // HybridShard: ranks per shard group (0: a node)
  int sequences = 1;         // per rank per step
  std::int64_t sequence_length = 1024;
  int param_bytes = 2;   // the compute dtype's (gathers move these)
  int reduce_bytes = 4;  // the gradients' reduction dtype: fp32, as torchtitan sets it (FSDP2's and
                         // FullyShardOptions' default reduce in the compute dtype: 2 for bf16)
  int prefetch = 1;
  Recompute recompute = Recompute::None;
  int optimizer_state_bytes = 8;
  // DDP's and ZeRO-1's gradient buckets (FullyShardOptions::first_bucket_bytes and
  // bucket_bytes), in the compute dtype's bytes as the engine counts them.
  std::int64_t first_bucket_bytes = 1 << 20;
  std::int64_t bucket_bytes = 25 << 20;
  // CPU offload (FullyShardOptions::cpu_offload): the fp32 masters, their gradients and the
  // optimizer state live on the host, which steps them (Note [Offload in the step-time
  // model] in src/plan/step_time.cpp).
  bool offload = false;
  bool offload_bf16_copy = true;  // the masters' bf16 copies cross to the device, not the fp32 masters
  bool step_in_backward =
      false;  // offloaded full shard / shard-grad-op / hybrid: each unit steps as its gradient lands
  // The sharded strategies' own work on the compute stream per step for a shard of the whole
  // model (one rank alone: its step less DDP's): the copies of its shard into the gather
  // buffers and of its reduced gradients into the shard, the units' hooks. Full shard,
  // shard-grad-op and hybrid spend it divided by the shard group, spread over forward and
  // backward (Note [The sharded path's own work] in src/plan/step_time.cpp). On a GPU it is
  // within the calibrated throughput (the H100 preset was calibrated on full shard's step).
  double sharding_work_s = 0;
  // The replicated strategies' ways to communicate less (docs/communication.md): a hook
  // reduces each bucket (NoShard, ShardOptimizerState; under HybridShard the all-reduce
  // across shard groups); `staleness` s averages each bucket while the next s steps compute
  // (NoShard, ShardOptimizerState); `decentralized_every` k exchanges the parameters with the
  // two ring neighbours every k-th step in place of any gradient average (NoShard, neither
  // of the others). A strategy or combination the engine refuses throws std::invalid_argument.
  HookModel hook{};
  // The hook's compression and decompression of the whole model on one rank alone (0: the
  // passes over memory of Note [Communication algorithms in the step-time model]): measured
  // (bench_modes --hook-work 1), it scales every bucket's work; the finish of int8 and top-k
  // still grows with the ranks as the passes say.
  double hook_work_s = 0;
  // Ranks doing the same work between two meetings drift apart (Note [Ranks drifting apart]
  // in src/plan/step_time.cpp): where a rank issues a round and waits for it at once (a
  // hook's second round, PowerSGD's Q; backward's last round, after which every rank
  // waits for its reductions), the last rank reaches it `peer_lag_s` after the
  // mean rank when `peer_lag_interval_s` of work lay between the meetings, and
  // sqrt(T / peer_lag_interval_s) times that after T. 0: ranks in lockstep (a GPU's
  // streams; CPU ranks that share cores, where a rank waiting for a peer lends it its core).
  double peer_lag_s = 0;
  double peer_lag_interval_s = 0.1;
  int staleness = 0;
  int decentralized_every = 0;
};

// One step, predicted.
struct StepTime {
  double forward_s = 0, backward_s = 0;  // compute only (recomputation in backward)
  double optimizer_s = 0;                // on the device, or on the host when offloaded
  // The engine's own work on the compute stream: the sharded path's (TimeOptions::
  // sharding_work_s over the shard group), ZeRO-1's bucket gradients, a hook's compression
  // and decompression, staleness's copies, decentralized training's averaging (per step).
  double engine_s = 0;
  double copies_s = 0;         // offload: every copy between host and device, overlapped or not
  double step_s = 0;           // the critical path through compute and the links
  double communication_s = 0;  // every collective's time on its link, overlapped or not
  double exposed_s = 0;        // of the step, the time compute waits for communication
  double contended_s =
      0;  // compute's time lost to collectives running beside it (Cluster::collective_compute_share)
  double tokens_per_s = 0;  // per device
  double mfu = 0;           // model FLOPs (6 per parameter and token + attention) over peak
  // "compute", "contention" (compute slowed by collectives beside it), "gathers",
  // "reductions", "latency", "host copies", "host step"
  std::string limit;
  double exposed_share() const { return step_s > 0 ? exposed_s / step_s : 0; }
};

// One rank's activations for `options.sequences` sequences (bytes), estimated from the
// shapes (Note [Activations from the shapes] in src/plan/step_time.cpp): what the memory
// planner's PlanOptions::activation_bytes takes when nothing was measured.
std::int64_t estimate_activation_bytes(const TransformerShape& model, const TimeOptions& options);

// Whether shard groups of `group` consecutive ranks each lie within one node or span whole
// nodes (a divisor or a multiple of the devices per node; any group on one node): the
// groups the model prices (Note [Rings across nodes] in src/plan/step_time.cpp).
bool groups_fit_nodes(const Cluster& cluster, int group);

// Throws std::invalid_argument for a world the strategy cannot use (a shard group that does
// not divide it, or that would straddle nodes).
StepTime predict_time(const TransformerShape& model, const Cluster& cluster, const TimeOptions& options);

// One strategy on a cluster: its memory per device (the planner's Plan) and its step.
struct StrategyPlan {
  std::string name;     // "full shard", "shard-grad-op", "hybrid (groups of 8)", "ZeRO-1", "DDP"
  TimeOptions options;  // `base` with this strategy (and shard group)
  Plan memory;          // PlanOptions from the same options, activations from the shapes
  StepTime time;
  bool fits = false;  // memory.peak <= device_bytes
};

// Every strategy on `cluster`, with hybrid sharding in groups of every whole number of
// nodes that divides the nodes (one node, two, three where there are six, ... up to half
// the world), and in groups of base.shard_group_size where that divides the world without
// straddling nodes (flatshard-plan --group): what flatshard-plan --cluster prints. `base` gives everything
// but the strategy (the strategies that refuse its hook, staleness or decentralized training are left out);
// activations are estimate_activation_bytes's.
std::vector<StrategyPlan> plan_cluster(const TransformerShape& model, const Cluster& cluster,
                                       const TimeOptions& base, std::int64_t device_bytes);

// The row with the most tokens/s per device among those that fit; nullptr if none fits.
const StrategyPlan* fastest_that_fits(const std::vector<StrategyPlan>& plans);

}  // namespace flatshard::plan
