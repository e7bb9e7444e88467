#include "sharding/model_check.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <map>
#include <mutex>
#include <thread>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "flatshard/errors.h"

namespace flatshard::sharding {

void check_same_model_everywhere(const World& world, torch::nn::Module& model, const std::string& who,
                                 const std::vector<std::string>& extra) {
  if (world.world_size() == 1 || !world.store) return;
  static std::mutex mutex;
  static std::map<std::string, int>
      instances;  // checks are collective: the n-th of a name matches everywhere
  int instance;
  {
    std::lock_guard<std::mutex> lock(mutex);
    instance = instances[who]++;
  }
  std::string mine;
  for (const auto& item : model.named_parameters(/*recurse=*/true)) {
    // Frozen parameters are laid out, reduced and stepped apart from trained ones (Note
    // [Partly frozen units] in sharding/engine.cpp): ranks that freeze differently would
    // make different collectives.
    mine += fmt::format("parameter '{}' {} {}{}\n", item.key(), c10::toString(item.value().scalar_type()),
                        fmt::join(item.value().sizes(), "x"), item.value().requires_grad() ? "" : " frozen");
  }
  for (const auto& item : model.named_buffers(/*recurse=*/true)) {
    if (!item.value().defined()) continue;
    mine += fmt::format("buffer '{}' {} {}\n", item.key(), c10::toString(item.value().scalar_type()),
                        fmt::join(item.value().sizes(), "x"));
  }
  for (const auto& line : extra) mine += line + "\n";
  const std::string prefix = fmt::format("flatshard/model_check/{}/{}/", who, instance);
  world.store->set(prefix + std::to_string(world.rank()), std::vector<uint8_t>(mine.begin(), mine.end()));
  auto lines = [](const std::vector<uint8_t>& bytes) {
    std::vector<std::string> out;
    std::string current;
    for (char c : bytes) {
      if (c == '\n') {
        out.push_back(current);
        current.clear();
      } else {
        current += c;
      }
    }
    return out;
  };
  std::string difference;
  try {
    const auto reference = lines(world.store->get(prefix + "0"));
    for (int r = 1; r < world.world_size() && difference.empty(); ++r) {
      const auto theirs = lines(world.store->get(prefix + std::to_string(r)));
      for (std::size_t i = 0; i < std::max(theirs.size(), reference.size()); ++i) {
        const std::string a = i < reference.size() ? reference[i] : "nothing more";
        const std::string b = i < theirs.size() ? theirs[i] : "nothing more";
        if (a == b) continue;
        difference = fmt::format("entry #{}: rank 0 has {}, rank {} has {}", i, a, r, b);
        break;
      }
    }
    // Nobody leaves before everyone has read everything, and rank 0 — which serves the
    // store — leaves last: a rank that throws and exits must not take the store away
    // from another rank's last request.
    const auto pause = std::chrono::milliseconds(2);
    world.store->add(prefix + "read", 1);
    while (world.store->add(prefix + "read", 0) < world.world_size()) std::this_thread::sleep_for(pause);
    if (world.rank() != 0) {
      world.store->add(prefix + "left", 1);
    } else {
      while (world.store->add(prefix + "left", 0) < world.world_size() - 1)
        std::this_thread::sleep_for(pause);
    }
  } catch (const std::exception& e) {
    const std::string what = e.what();
    throw RendezvousError(
        fmt::format("{} (rank {}/{}): comparing the model across ranks through the store failed: "
                    "{}. Check that every rank is running.",
                    who, world.rank(), world.world_size(), what.substr(0, what.find('\n'))));
  }
  if (!difference.empty()) {
    throw InvalidArgument(
        fmt::format("{} (rank {}/{}): the model differs across ranks at {}. Build the same model "
                    "with the same options on every rank.",
                    who, world.rank(), world.world_size(), difference));
  }
}

std::uint64_t hash_bytes(std::uint64_t seed, const void* data, std::size_t bytes) {
  const auto mix = [](std::uint64_t h, std::uint64_t word) {
    h ^= word * 0x9E3779B97F4A7C15ULL;
    h = (h << 29) | (h >> 35);
    return h * 0xBF58476D1CE4E5B9ULL;
  };
  const auto* p = static_cast<const unsigned char*>(data);
  std::uint64_t h = seed;
  std::size_t i = 0;
  for (; i + 8 <= bytes; i += 8) {
    std::uint64_t word;
    std::memcpy(&word, p + i, 8);
    h = mix(h, word);
  }
  std::uint64_t tail = 0;
  if (bytes > i) std::memcpy(&tail, p + i, bytes - i);  // (a zero-size tensor has no data pointer)
  return mix(mix(h, tail), bytes);
}

// Note [Same values on every rank]
// A model built whole on every rank (no BuildIntoShards) must hold the same values
// everywhere: the sharded strategies keep rank r's slice of rank r's model, so ranks
// built from different seeds would train one model stitched from several, and HybridShard's
// replica groups (or NoShard's replicas) would each train their own. Nothing downstream
// would fail: the loss just behaves oddly. So each wrapper compares, for each unit, its
// element count and two 64-bit hashes of its values' bytes (24 bytes a unit), gathered over
// the world, before it shards anything; the model's buffers are one more entry. This
// hashes every byte of the model once on the host (a device model is copied over one
// tensor at a time), which is why SyncModuleStates::Trust exists. FromRank0 instead
// broadcasts every tensor from rank 0, as PyTorch FSDP's sync_module_states does.
void reconcile_values(Communicator& comm, const std::vector<NamedValues>& entries, SyncModuleStates mode,
                      const std::string& who) {
  const int n = comm.world_size(), rank = comm.rank();
  if (n == 1 || mode == SyncModuleStates::Trust || entries.empty()) return;
  at::NoGradGuard no_grad;
  if (mode == SyncModuleStates::FromRank0) {
    for (const auto& entry : entries) {
      for (const auto& t : entry.tensors) {
        at::Tensor moving =
            t.device() == comm.device() && t.is_contiguous() ? t : t.to(comm.device()).contiguous();
        // NCCL has no bool: a mask buffer crosses as bytes (the same bytes).
        comm.broadcast(moving.scalar_type() == at::kBool ? moving.view(at::kByte) : moving, 0).wait();
        if (!moving.is_same(t)) t.copy_(moving);
      }
    }
    return;
  }
  constexpr int kWords = 3;  // elements, and two hashes with different seeds
  const auto k = static_cast<std::int64_t>(entries.size());
  auto all = at::zeros({n * kWords * k}, at::TensorOptions().dtype(at::kLong));
  auto* mine = all.data_ptr<std::int64_t>() + rank * kWords * k;
  for (std::int64_t e = 0; e < k; ++e) {
    std::int64_t numel = 0;
    std::uint64_t a = 0x5EED, b = 0xC0FFEE;
    for (const auto& t : entries[e].tensors) {
      const at::Tensor bytes = t.detach().to(at::kCPU).contiguous();
      const auto size = static_cast<std::size_t>(bytes.nbytes());
      a = hash_bytes(a, bytes.data_ptr(), size);
      b = hash_bytes(b ^ static_cast<std::uint64_t>(numel), bytes.data_ptr(), size);
      numel += t.numel();
    }
    mine[kWords * e] = numel;
    mine[kWords * e + 1] = static_cast<std::int64_t>(a);
    mine[kWords * e + 2] = static_cast<std::int64_t>(b);
  }
  at::Tensor gathered = all.to(comm.device());
  comm.all_gather(gathered, gathered.narrow(0, rank * kWords * k, kWords * k)).wait();
  all = gathered.to(at::kCPU);
  const auto* v = all.data_ptr<std::int64_t>();
  for (std::int64_t e = 0; e < k; ++e) {
    std::map<std::vector<std::int64_t>, std::vector<int>> versions;  // values -> ranks holding them
    for (int r = 0; r < n; ++r) {
      const auto* at_r = v + (r * k + e) * kWords;
      versions[{at_r[0], at_r[1], at_r[2]}].push_back(r);
    }
    if (versions.size() == 1) continue;
    std::vector<std::vector<int>> holders;  // by their lowest rank
    for (const auto& [values, ranks] : versions) holders.push_back(ranks);
    std::sort(holders.begin(), holders.end());
    std::vector<std::string> sides;
    for (const auto& ranks : holders)
      sides.push_back(fmt::format("rank{} {}", ranks.size() > 1 ? "s" : "", fmt::join(ranks, ", ")));
    throw InvalidArgument(fmt::format(
        "{} (rank {}/{}): the values of {} differ across ranks ({} versions: {}). Each rank would train "
        "its slice of a different model. Seed every rank alike (torch::manual_seed with the same value) "
        "before building the model, load the same weights on every rank, or set "
        "FullyShardOptions::sync_module_states = SyncModuleStates::FromRank0 to copy rank 0's values to "
        "every rank. Nothing was sharded.",
        who, rank, n, entries[e].name, versions.size(), fmt::join(sides, " / ")));
  }
}

}  // namespace flatshard::sharding
