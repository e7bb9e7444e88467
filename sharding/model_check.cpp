#include "sharding/model_check.h"

#include <chrono>
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

}  // namespace flatshard::sharding
