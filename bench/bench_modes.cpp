// End-to-end step time and per-rank peak memory of the GPT-style model in one training
// mode (start with flatshard-run -n N; bench/modes.sh and bench/fully_shard.sh run grids).
//
//   bench_modes --mode ddp|zero1|zero2|full|hybrid [--group G] [--layers 6 --dim 256 --heads 8 --vocab 4096
//               --context 64 --batch 4 --steps 6] [--hook SPEC] [--staleness S]
//               [--decentralized K] [--phases 1] [--step-in-backward 1] [--recompute 1]
//               [--freeze PART: parameters whose name contains PART are frozen, e.g. .attn.]
//   bench_modes --hook-work 1 --hook SPEC [--layers ... --steps 6]
//
// --hook-work 1 times the hook's own work instead of training: the model's parameters as one
// bucket, reduced by the hook over this world's communicator and finished, `steps` times
// after one untimed; rank 0 prints hook_work,SPEC,world,params,ms (the median). At world 1
// the collectives move nothing, so it is the hook's compression and decompression: what
// flatshard-plan --hook-work-ms takes (Note [Communication algorithms in the step-time
// model] in src/plan/step_time.cpp).
//
// FullyShard with optim::AdamW under the mode's strategy: ddp NoShard, zero1
// ShardOptimizerState, zero2 ShardGradOp, full FullShard, hybrid HybridShard over shard
// groups of G ranks (--group; default: the ranks of one machine). Rank 0 prints one CSV
// line: mode,world,params,step_ms,alloc_peak_bytes,rss_growth_bytes,param_shard,
// grad_shard,optim_state,peak_unsharded_params,peak_unsharded_grads,formula_bytes,
// bytes_sent_per_step,last_loss,comm_wait_share,peer_wait_share,core_wait_share,hook_ms,
// idle_share (figures are the largest over ranks but the last five: the ranks' mean share
// of the step their compute waited for communication, Note [Communication wait], of that the share spent
// before the last rank had issued the op, Note [Waiting for peers], the share spent woken
// with no core to run on, CommunicationWait::core_ms, and the hook's own time a step in
// milliseconds, TimedHook below, 0 without one, and the share of the timed steps the whole
// machine's cores sat idle (/proc/stat, read by rank 0: where ranks outnumber the cores,
// what their meetings leave unused); everything is measured from the second step on).
#include <ATen/Parallel.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <utility>

#include <unistd.h>

#include "flatshard/flatshard.h"
#include "tests/support/models.h"

using flatshard::testing::GPT;
using flatshard::testing::GPTConfig;

namespace {

// Resident set size now, or its high-water mark, in bytes (/proc/self/status).
std::int64_t rss_bytes(const char* field) {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind(field, 0) == 0) return std::stoll(line.substr(std::string(field).size())) * 1024;
  }
  return 0;
}

// A hook timed as the engine calls it in a step: its reduce() (compression, the first
// rounds issued) and its finish, less the communication waits inside the finish (PowerSGD
// waits there for its second round). What the model's hook work (--hook-work 1) stands for,
// measured in place.
class TimedHook final : public flatshard::CommHook {
 public:
  explicit TimedHook(std::shared_ptr<flatshard::CommHook> inner) : inner_(std::move(inner)) {}
  std::string describe() const override { return inner_->describe(); }
  flatshard::HookWork reduce(flatshard::Communicator& comm, const flatshard::GradBucket& bucket) override {
    const auto start = Clock::now();
    flatshard::HookWork work = inner_->reduce(comm, bucket);
    ms_ += since(start);
    if (work.finish) {
      work.finish = [this, &comm, finish = std::move(work.finish)] {
        const double waited = comm.waited().ms;
        const auto begin = Clock::now();
        finish();
        ms_ += since(begin) - (comm.waited().ms - waited);
      };
    }
    return work;
  }
  std::map<std::string, at::Tensor> state() const override { return inner_->state(); }
  void load_state(const std::map<std::string, at::Tensor>& state) override { inner_->load_state(state); }
  double take_ms() { return std::exchange(ms_, 0.0); }

 private:
  using Clock = std::chrono::steady_clock;
  static double since(Clock::time_point t) {
    return std::chrono::duration<double, std::milli>(Clock::now() - t).count();
  }
  std::shared_ptr<flatshard::CommHook> inner_;
  double ms_ = 0;  // reduce() and finish run on the engine's thread
};

// The machine's cores' busy and idle jiffies so far (/proc/stat's first line): where ranks
// outnumber the cores, the share of the timed steps the cores sat idle is what the ranks'
// meetings cost beyond their compute.
std::pair<double, double> cpu_jiffies() {
  std::ifstream stat("/proc/stat");
  std::string cpu;
  double v[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  stat >> cpu >> v[0] >> v[1] >> v[2] >> v[3] >> v[4] >> v[5] >> v[6] >> v[7];
  const double idle = v[3] + v[4];
  return {v[0] + v[1] + v[2] + v[5] + v[6] + v[7], idle};
}

}  // namespace

int main(int argc, char** argv) {
  at::set_num_threads(1);
  flatshard::memory::install_counting_allocator();
  std::string mode = "full";
  GPTConfig cfg{4096, 64, 256, 8, 6};
  int batch = 4, steps = 6;
  bool phases = false;        // --phases 1: each rank prints its mean forward, backward and step times
  std::string hook = "none";  // --hook SPEC: a communication hook (flatshard::hooks::parse)
  int staleness = 0;          // --staleness S: FullyShardOptions::staleness (asynchronous)
  int decentralized = 0;      // --decentralized K: FullyShardOptions::decentralized_every
  int group = 0;              // --group G: FullyShardOptions::shard_group_size (hybrid)
  bool in_backward = false;   // --step-in-backward 1: FullyShardBase::step_in_backward (zero2, full)
  bool recompute = false;     // --recompute 1: every block recomputed in backward (recompute.h)
  std::string freeze;         // --freeze PART: fine-tuning (requires_grad off before wrapping)
  bool hook_work = false;     // --hook-work 1: time the hook alone (above)
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--phases") phases = std::atoi(argv[i + 1]) != 0;
    if (a == "--hook") hook = argv[i + 1];
    if (a == "--freeze") freeze = argv[i + 1];
    if (a == "--hook-work") hook_work = std::atoi(argv[i + 1]) != 0;
    const int v = std::atoi(argv[i + 1]);
    if (a == "--mode")
      mode = argv[i + 1];
    else if (a == "--layers")
      cfg.layers = v;
    else if (a == "--dim")
      cfg.dim = v;
    else if (a == "--heads")
      cfg.heads = v;
    else if (a == "--vocab")
      cfg.vocab = v;
    else if (a == "--context")
      cfg.context = v;
    else if (a == "--batch")
      batch = v;
    else if (a == "--steps")
      steps = v;
    else if (a == "--staleness")
      staleness = v;
    else if (a == "--decentralized")
      decentralized = v;
    else if (a == "--step-in-backward")
      in_backward = v != 0;
    else if (a == "--recompute")
      recompute = v != 0;
    else if (a == "--group")
      group = v;
  }
  auto world = flatshard::init();
  const std::int64_t rss_before = rss_bytes("VmRSS:");
  torch::manual_seed(0);
  GPT model(cfg);
  std::int64_t params = 0;
  for (const auto& p : model->parameters()) params += p.numel();
  flatshard::set_recompute(*model, recompute);
  for (auto& item : model->named_parameters()) {
    if (!freeze.empty() && item.key().find(freeze) != std::string::npos) item.value().requires_grad_(false);
  }

  flatshard::FullyShardOptions options;
  if (!flatshard::parse_strategy(mode, options.strategy)) {
    std::fprintf(stderr, "bench_modes: --mode is ddp, zero1, zero2, full or hybrid, not %s\n", mode.c_str());
    return 2;
  }
  if (hook_work) {
    auto h = flatshard::hooks::parse(hook);
    if (!h) {
      std::fprintf(stderr, "bench_modes: --hook-work 1 needs a --hook\n");
      return 2;
    }
    flatshard::GradBucket bucket;
    std::int64_t numel = 0;
    for (const auto& item : model->named_parameters()) {
      bucket.params.push_back({item.key(), item.value().sizes().vec(), numel});
      numel += item.value().numel();
    }
    const at::Tensor grads = at::randn({numel}, at::TensorOptions().dtype(at::kFloat));
    flatshard::FullyShardOptions ddp;
    ddp.strategy = flatshard::Strategy::NoShard;
    flatshard::FullyShard<GPT> wrapped(model, world, ddp);
    std::vector<double> ms;
    for (int step = 0; step <= steps; ++step) {
      // Past any start step (PowerSGD's start_step: until then it averages the plain way).
      bucket.step = (std::int64_t{1} << 30) + step;
      bucket.buffer = grads.clone();
      const auto start = std::chrono::steady_clock::now();
      flatshard::HookWork work = h->reduce(wrapped.comm(), bucket);
      for (const auto& w : work.works) w.wait();
      if (work.finish) work.finish();
      const double took =
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
      if (step > 0) ms.push_back(took);
    }
    std::sort(ms.begin(), ms.end());
    if (world.rank() == 0 && !ms.empty())
      std::printf("hook_work,%s,%d,%lld,%.3f\n", hook.c_str(), world.world_size(),
                  static_cast<long long>(numel), ms[ms.size() / 2]);
    return 0;
  }
  options.staleness = staleness;
  options.decentralized_every = decentralized;
  options.shard_group_size = group;
  flatshard::FullyShard<GPT> fsdp(model, world, options);
  std::shared_ptr<TimedHook> timed;
  if (auto h = flatshard::hooks::parse(hook)) {
    timed = std::make_shared<TimedHook>(h);
    fsdp.register_comm_hook(timed);
  }
  flatshard::optim::AdamW opt(fsdp, flatshard::optim::AdamWOptions{3e-4});
  if (in_backward) fsdp.step_in_backward(&opt);
  const std::string label = mode + (in_backward ? "-stepinbwd" : "");
  flatshard::Communicator& comm = fsdp.comm();
  std::uint64_t sent_before = 0;
  double last_loss = 0;

  auto g = at::make_generator<at::CPUGeneratorImpl>(world.rank());
  double total_ms = 0;
  std::pair<double, double> jiffies0{0, 0};
  double phase_ms[3] = {0, 0, 0};  // forward (with the loss), backward, step and zero_grad
  for (int step = 0; step <= steps; ++step) {
    auto tokens = at::randint(cfg.vocab, {batch, cfg.context + 1}, g);
    if (step == 1) {  // the first step allocates optimizer state: measure from the second on
      flatshard::memory::reset_allocator_peak();
      fsdp.reset_peaks();
      comm.barrier().wait();
      sent_before = fsdp.bytes_sent();
      fsdp.time_communication_waits(true);  // Note [Communication wait]
      if (timed) timed->take_ms();
      jiffies0 = cpu_jiffies();
    }
    using Clock = std::chrono::steady_clock;
    const auto start = Clock::now();
    auto input = tokens.narrow(1, 0, cfg.context);
    auto logits = fsdp.forward(input);
    auto loss = torch::cross_entropy_loss(logits.reshape({-1, cfg.vocab}),
                                          tokens.narrow(1, 1, cfg.context).reshape({-1}));
    last_loss = loss.item<double>();
    const auto forwarded = Clock::now();
    loss.backward();
    const auto backwarded = Clock::now();
    opt.step();
    opt.zero_grad();
    const auto end = Clock::now();
    auto ms = [](Clock::time_point a, Clock::time_point b) {
      return std::chrono::duration<double, std::milli>(b - a).count();
    };
    if (step >= 1) {
      total_ms += ms(start, end);
      phase_ms[0] += ms(start, forwarded);
      phase_ms[1] += ms(forwarded, backwarded);
      phase_ms[2] += ms(backwarded, end);
    }
  }
  const std::pair<double, double> jiffies1 = cpu_jiffies();
  const double busy = jiffies1.first - jiffies0.first, idle = jiffies1.second - jiffies0.second;
  const double idle_share = busy + idle > 0 ? idle / (busy + idle) : 0;
  if (phases) {
    std::fprintf(stderr, "%s rank %d phases ms: forward %.1f, backward %.1f, step %.1f\n", mode.c_str(),
                 world.rank(), phase_ms[0] / steps, phase_ms[1] / steps, phase_ms[2] / steps);
  }
  const double sent_per_step = static_cast<double>(fsdp.bytes_sent() - sent_before) / steps;
  const flatshard::CommunicationWait waited = fsdp.communication_wait();
  const double wait_share = total_ms > 0 ? waited.ms / total_ms : 0;
  const double core_share = total_ms > 0 ? waited.core_ms / total_ms : 0;
  double peer_share = std::nan("");  // measured where the ranks share a host's clock
  try {
    peer_share = total_ms > 0 ? fsdp.communication_wait_for_peers().peer_ms / total_ms : 0;
  } catch (const flatshard::InvalidArgument& e) {
    if (world.rank() == 0) std::fprintf(stderr, "bench_modes: no peer share: %s\n", e.what());
  }
  const double hook_ms = timed ? timed->take_ms() / steps : 0;
  const std::int64_t rss_growth = rss_bytes("VmHWM:") - rss_before;
  const flatshard::ShardMemory m = fsdp.memory();
  const std::int64_t state = opt.state_bytes(), param_bytes = m.param_shard_bytes,
                     grad_bytes = m.param_shard_bytes;
  auto figures =
      at::tensor({static_cast<double>(flatshard::memory::allocator_stats().peak_bytes), total_ms / steps,
                  static_cast<double>(rss_growth), static_cast<double>(m.peak_unsharded_param_bytes),
                  static_cast<double>(m.peak_unsharded_grad_bytes), sent_per_step, last_loss, wait_share,
                  peer_share, core_share, hook_ms},
                 at::kDouble);
  constexpr int kFigures = 11;
  auto gathered = at::zeros({kFigures * world.world_size()}, at::kDouble);
  comm.all_gather(gathered, figures).wait();
  const auto by_rank = gathered.view({world.world_size(), kFigures});
  const auto worst = by_rank.amax(0);
  const double mean_wait_share = by_rank.select(1, 7).mean().item<double>();
  const double mean_peer_share = by_rank.select(1, 8).mean().item<double>();
  const double mean_core_share = by_rank.select(1, 9).mean().item<double>();
  const double mean_hook_ms = by_rank.select(1, 10).mean().item<double>();
  if (world.rank() == 0) {
    const double n = world.world_size();
    const double psi = static_cast<double>(params);
    const double formula = mode == "full"     ? 16 * psi / n
                           : mode == "hybrid" ? 16 * psi / fsdp.shard_group().size
                           : mode == "zero2"  ? 4 * psi + 12 * psi / n
                           : mode == "zero1"  ? 8 * psi + 8 * psi / n
                                              : 16 * psi;
    // mode, ranks, parameters, step ms, allocator peak, RSS growth, shard bytes (params,
    // grads, optimizer state), peak gathered params and grads, ZeRO formula, bytes sent
    // per step, last loss (the largest over ranks), the share of the step the ranks' compute
    // waited for communication, and of it the share before the last rank issued the op and
    // the share waiting for a core, and the hook's own time a step (their means), and the
    // share of the steps the machine's cores sat idle (rank 0's reading).
    std::printf(
        "%s,%d,%lld,%.1f,%.0f,%.0f,%lld,%lld,%lld,%.0f,%.0f,%.0f,%.0f,%.4f,%.4f,%.4f,%.4f,%.2f,%.4f\n",
        label.c_str(), world.world_size(), static_cast<long long>(params), worst[1].item<double>(),
        worst[0].item<double>(), worst[2].item<double>(), static_cast<long long>(param_bytes),
        static_cast<long long>(grad_bytes), static_cast<long long>(state), worst[3].item<double>(),
        worst[4].item<double>(), formula, worst[5].item<double>(), worst[6].item<double>(), mean_wait_share,
        mean_peer_share, mean_core_share, mean_hook_ms, idle_share);
  }
  return 0;
}
