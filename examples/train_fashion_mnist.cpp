// The CNN of PyTorch's MNIST DDP example, trained on Fashion-MNIST (Debian's
// dataset-fashion-mnist) under full shard, with a distributed sampler.
//
//   flatshard-run -n 2 build/examples/train_fashion_mnist [--epochs 1] [--batch 32]
//       [--lr 1e-3] [--mode full|zero2|zero1|ddp] [--data /usr/share/datasets/fashion-mnist]
//       [--train-limit N] [--min-accuracy PERCENT] [--hook SPEC (flatshard::hooks::parse; ddp, zero1)]
//       [--staleness S (ddp, zero1)] [--decentralized K (ddp)]
//
// With --min-accuracy the program exits 4 when the last epoch's test accuracy is lower
// (the ctest examples.fashion_mnist uses it).
//
// Each epoch the sampler shuffles the training set with the epoch as seed (the same
// order on every rank) and gives rank r every world-size-th index from r, padded so
// that every rank takes the same number of steps. Test accuracy is counted on each
// rank's share of the test set and summed across ranks.
#include <ATen/Parallel.h>
#include <zlib.h>

#include <chrono>
#include <cstdio>
#include <string>

#include "flatshard/flatshard.h"
#include "models/mnist_net.h"

using flatshard::models::MnistNet;

namespace {

// An IDX file (gzipped), as uint8 with its dimensions.
at::Tensor read_idx(const std::string& path) {
  gzFile f = ::gzopen(path.c_str(), "rb");
  if (!f) throw std::runtime_error("cannot open " + path + " (apt-get install dataset-fashion-mnist)");
  auto read_u32 = [&] {
    unsigned char b[4];
    if (::gzread(f, b, 4) != 4) throw std::runtime_error(path + " is truncated");
    return (std::uint32_t{b[0]} << 24) | (std::uint32_t{b[1]} << 16) | (std::uint32_t{b[2]} << 8) | b[3];
  };
  const std::uint32_t magic = read_u32();
  const int dims = static_cast<int>(magic & 0xff);
  std::vector<std::int64_t> shape;
  for (int i = 0; i < dims; ++i) shape.push_back(read_u32());
  auto t = at::empty(shape, at::kByte);
  const auto bytes = static_cast<unsigned>(t.numel());
  if (static_cast<unsigned>(::gzread(f, t.data_ptr(), bytes)) != bytes)
    throw std::runtime_error(path + " is truncated");
  ::gzclose(f);
  return t;
}

// Images normalized as in PyTorch's example (mean 0.1307, std 0.3081 there; Fashion-MNIST's own here).
at::Tensor images_of(const at::Tensor& raw) {
  return ((raw.to(at::kFloat) / 255.0 - 0.2860) / 0.3530).unsqueeze(1);
}

// Rank r's indices of one epoch: a seeded permutation, every n-th from r, padded by wrapping.
at::Tensor sampler(std::int64_t size, int epoch, int rank, int n) {
  auto g = at::make_generator<at::CPUGeneratorImpl>(epoch);
  auto order = at::randperm(size, g);
  const std::int64_t per_rank = (size + n - 1) / n;
  order = at::cat({order, order.narrow(0, 0, per_rank * n - size)});
  return order.narrow(0, rank, per_rank * n - rank).slice(0, 0, c10::nullopt, n);
}

}  // namespace

int main(int argc, char** argv) {
  std::string dir = "/usr/share/datasets/fashion-mnist", mode = "full", hook = "none";
  int epochs = 1, batch = 32, staleness = 0, decentralized = 0;
  std::int64_t limit = 0;
  double lr = 1e-3, min_accuracy = 0;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--data")
      dir = v;
    else if (k == "--epochs")
      epochs = std::stoi(v);
    else if (k == "--batch")
      batch = std::stoi(v);
    else if (k == "--lr")
      lr = std::stod(v);
    else if (k == "--mode")
      mode = v;
    else if (k == "--train-limit")
      limit = std::stoll(v);
    else if (k == "--min-accuracy")
      min_accuracy = std::stod(v);
    else if (k == "--hook")
      hook = v;
    else if (k == "--staleness")
      staleness = std::stoi(v);
    else if (k == "--decentralized")
      decentralized = std::stoi(v);
    else {
      std::fprintf(stderr, "train_fashion_mnist: unknown option %s\n", k.c_str());
      return 2;
    }
  }
  at::set_num_threads(1);
  try {
    auto world = flatshard::init();
    const int rank = world.rank(), n = world.world_size();
    auto train_x = images_of(read_idx(dir + "/train-images-idx3-ubyte.gz"));
    auto train_y = read_idx(dir + "/train-labels-idx1-ubyte.gz").to(at::kLong);
    const auto test_x = images_of(read_idx(dir + "/t10k-images-idx3-ubyte.gz"));
    const auto test_y = read_idx(dir + "/t10k-labels-idx1-ubyte.gz").to(at::kLong);
    if (limit > 0 && limit < train_x.size(0)) {
      train_x = train_x.narrow(0, 0, limit);
      train_y = train_y.narrow(0, 0, limit);
    }

    torch::manual_seed(1);
    MnistNet model(/*dropout=*/0.5);
    flatshard::FullyShardOptions o;
    if (!flatshard::parse_strategy(mode, o.strategy))
      throw std::invalid_argument("--mode is full, zero2, zero1, ddp or hybrid, not " + mode);
    o.staleness = staleness;
    o.decentralized_every = decentralized;
    flatshard::FullyShard<MnistNet> fsdp(model, world, o);
    if (auto h = flatshard::hooks::parse(hook)) fsdp.register_comm_hook(h);  // ddp and zero1
    flatshard::optim::Adam opt(fsdp, flatshard::optim::AdamOptions{lr});
    auto forward = [&](const at::Tensor& x) { return fsdp.forward(x); };
    auto& comm = fsdp.comm();

    double accuracy = 0;
    for (int epoch = 1; epoch <= epochs; ++epoch) {
      model->train();
      const auto mine = sampler(train_x.size(0), epoch, rank, n);
      const auto t0 = std::chrono::steady_clock::now();
      const std::uint64_t sent_before = comm.bytes_sent();
      const std::int64_t steps = (mine.numel() + batch - 1) / batch;
      for (std::int64_t s = 0; s < steps; ++s) {
        const auto idx = mine.narrow(0, s * batch, std::min<std::int64_t>(batch, mine.numel() - s * batch));
        auto loss = torch::nll_loss(forward(train_x.index_select(0, idx)), train_y.index_select(0, idx));
        loss.backward();
        opt.step();
        opt.zero_grad();
        if (rank == 0 && (s + 1) % 100 == 0) {
          std::printf("epoch %d  step %lld/%lld  loss %.4f\n", epoch, static_cast<long long>(s + 1),
                      static_cast<long long>(steps), loss.item<double>());
          std::fflush(stdout);
        }
      }
      const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      const double sent_per_step = static_cast<double>(comm.bytes_sent() - sent_before) / steps;

      // Test accuracy: each rank its share, summed.
      model->eval();
      torch::NoGradGuard no_grad;
      const auto share = flatshard::shard_range(test_x.size(0), n, rank);
      auto counts = at::zeros({2}, at::kDouble);
      for (std::int64_t b = 0; b < share.numel; b += 500) {
        const auto rows = std::min<std::int64_t>(500, share.numel - b);
        const auto pred = forward(test_x.narrow(0, share.offset + b, rows)).argmax(1);
        counts[0] += pred.eq(test_y.narrow(0, share.offset + b, rows)).sum().item<double>();
      }
      counts[1] = static_cast<double>(share.numel);
      comm.all_reduce(counts, flatshard::ReduceOp::Sum).wait();
      accuracy = 100 * counts[0].item<double>() / counts[1].item<double>();
      if (rank == 0) {
        std::printf("epoch %d: test accuracy %.2f%% (%d of %d), %.0f s, %.3f MB sent per step\n", epoch,
                    accuracy, static_cast<int>(counts[0].item<double>()),
                    static_cast<int>(counts[1].item<double>()), seconds, sent_per_step / 1e6);
        std::fflush(stdout);
      }
    }
    if (accuracy < min_accuracy) {
      std::fprintf(stderr, "train_fashion_mnist: test accuracy %.2f%% is below --min-accuracy %.2f%%\n",
                   accuracy, min_accuracy);
      return 4;
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "train_fashion_mnist: %s\n", e.what());
    return 1;
  }
}
