// Save and load throughput of sharded and full checkpoints (start with flatshard-run -n N;
// bench/checkpoint.sh runs world 2 and 4).
//
//   bench_checkpoint [--dir D] [--layers 6 --dim 512 --vocab 8192 --context 64 --repeat 3]
//
// The GPT-style model under full shard with AdamW after one step (parameters plus two
// state tensors: 12 bytes per parameter). Sharded: every rank writes / reads its own
// file (save_sharded / load_sharded). Full: full_state_dict + full_optimizer_state_dict
// gathered to rank 0, written with save_tensors (torch.save format); loading reads both
// files back on rank 0 (load_tensors). Before each load the files are dropped from the
// page cache (fsynced, then POSIX_FADV_DONTNEED), so reads come from the disk. Rank 0
// prints CSV lines: kind,world,bytes,save_s,load_s,save_MBps,load_MBps (medians).
#include <ATen/Parallel.h>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <string>

#include "flatshard/flatshard.h"
#include "tests/support/models.h"

using flatshard::testing::GPT;
using flatshard::testing::GPTConfig;
namespace ckpt = flatshard::checkpoint;
namespace fs = std::filesystem;

namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

std::int64_t drop_from_cache(const fs::path& dir) {
  std::int64_t bytes = 0;
  for (const auto& e : fs::recursive_directory_iterator(dir)) {
    if (!e.is_regular_file()) continue;
    bytes += static_cast<std::int64_t>(e.file_size());
    const int fd = ::open(e.path().c_str(), O_RDONLY);
    if (fd < 0) continue;
    ::fdatasync(fd);
    ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    ::close(fd);
  }
  return bytes;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  at::set_num_threads(1);
  std::string dir = "/tmp/flatshard-bench-checkpoint";
  GPTConfig cfg{8192, 64, 512, 8, 6};
  int repeat = 3;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--dir") dir = argv[i + 1];
    if (a == "--layers") cfg.layers = std::atoi(argv[i + 1]);
    if (a == "--dim") cfg.dim = std::atoi(argv[i + 1]);
    if (a == "--vocab") cfg.vocab = std::atoi(argv[i + 1]);
    if (a == "--context") cfg.context = std::atoi(argv[i + 1]);
    if (a == "--repeat") repeat = std::atoi(argv[i + 1]);
  }
  auto world = flatshard::init();
  const int rank = world.rank(), n = world.world_size();
  dir += "-" + std::to_string(n);
  torch::manual_seed(1);
  GPT model(cfg);
  flatshard::FullyShard<GPT> fsdp(model, world);
  flatshard::optim::AdamW opt(fsdp, flatshard::optim::AdamWOptions{});
  {
    auto tokens = at::randint(cfg.vocab, {2, cfg.context + 1});
    auto logits = fsdp.forward(tokens.narrow(1, 0, cfg.context));
    torch::cross_entropy_loss(logits.reshape({-1, cfg.vocab}), tokens.narrow(1, 1, cfg.context).reshape({-1}))
        .backward();
    opt.step();
  }
  auto barrier = [&] { fsdp.comm().barrier().wait(); };
  if (rank == 0) fs::remove_all(dir);
  barrier();

  std::vector<double> sharded_save, sharded_load, full_save, full_load;
  std::int64_t sharded_bytes = 0, full_bytes = 0;
  for (int r = 0; r < repeat; ++r) {
    barrier();
    auto t0 = std::chrono::steady_clock::now();
    const auto info = ckpt::save_sharded(dir + "/sharded", fsdp, &opt, {.step = r, .keep_last = 1});
    barrier();
    sharded_save.push_back(seconds_since(t0));
    if (rank == 0) sharded_bytes = drop_from_cache(info.path);
    barrier();
    t0 = std::chrono::steady_clock::now();
    ckpt::load_sharded(dir + "/sharded", fsdp, &opt);
    barrier();
    sharded_load.push_back(seconds_since(t0));

    t0 = std::chrono::steady_clock::now();
    auto params = ckpt::full_state_dict(fsdp, *model, 0);
    auto state = ckpt::full_optimizer_state_dict(fsdp, opt, 0);
    if (rank == 0) {
      fs::create_directories(dir + "/full");
      ckpt::save_tensors(params, dir + "/full/model.pt");
      ckpt::save_tensors(state, dir + "/full/optim.pt");
    }
    barrier();
    full_save.push_back(seconds_since(t0));
    params.clear();
    state.clear();
    if (rank == 0) full_bytes = drop_from_cache(dir + "/full");
    barrier();
    t0 = std::chrono::steady_clock::now();
    if (rank == 0) {
      params = ckpt::load_tensors(dir + "/full/model.pt");
      state = ckpt::load_tensors(dir + "/full/optim.pt");
    }
    barrier();
    full_load.push_back(seconds_since(t0));
  }
  if (rank == 0) {
    auto line = [&](const char* kind, std::int64_t bytes, const std::vector<double>& save,
                    const std::vector<double>& load) {
      const double s = median(save), l = median(load), mb = static_cast<double>(bytes) / 1e6;
      std::printf("%s,%d,%lld,%.4f,%.4f,%.1f,%.1f\n", kind, n, static_cast<long long>(bytes), s, l, mb / s,
                  mb / l);
    };
    line("sharded", sharded_bytes, sharded_save, sharded_load);
    line("full", full_bytes, full_save, full_load);
    fs::remove_all(dir);
  }
  barrier();
  return 0;
}
