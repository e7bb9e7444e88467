// The world: who this process is among the ranks of a job, and the store the ranks
// met through.
//
//   auto world = flatshard::init();   // torchrun-style env, Slurm, Open MPI, or
//                                     // init_method "env://", "tcp://h:p", "file:///p"
//
// docs/launching.md lists every variable each source reads.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include <torch/csrc/distributed/c10d/Store.hpp>

namespace flatshard {

// Where the rank and world size were read from.
enum class WorldSource { SingleProcess, TorchrunEnv, Slurm, OpenMpi };
const char* to_string(WorldSource source);

// What the environment says, before any network is touched. Pure data: built by
// resolve_world() and unit-tested without sockets.
struct WorldSpec {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  WorldSource source = WorldSource::SingleProcess;
  // Rendezvous: "tcp" (a TCPStore served by rank 0 at master_addr:master_port) or
  // "file" (a FileStore at file_path).
  std::string store_kind = "tcp";
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  std::string file_path;
};

struct InitOptions {
  // "" (detect from the environment), "env://", "tcp://HOST:PORT" or "file:///PATH".
  // FLATSHARD_INIT_METHOD is read when this is empty.
  std::string init_method;
  // Override the environment's rank and world size (both or neither).
  std::optional<int> rank;
  std::optional<int> world_size;
  // How long rendezvous waits for the other ranks and for the master.
  std::chrono::milliseconds timeout{std::chrono::seconds(60)};
};

// Reads one environment variable; std::nullopt when unset. Tests pass their own.
using EnvLookup = std::function<std::optional<std::string>(const std::string&)>;
EnvLookup process_env();

// Decides rank, world size and rendezvous from the options and the environment.
// Throws InitError naming the variable to set or fix.
WorldSpec resolve_world(const InitOptions& options, const EnvLookup& env);

struct World {
  WorldSpec spec;
  c10::intrusive_ptr<c10d::Store> store;  // null for a single-process world

  int rank() const { return spec.rank; }
  int world_size() const { return spec.world_size; }
  int local_rank() const { return spec.local_rank; }
  int local_world_size() const { return spec.local_world_size; }
};

// resolve_world() on this process's environment, then rendezvous through a LibTorch
// store. Throws InitError for bad settings, RendezvousError when the ranks cannot meet.
World init(const InitOptions& options = {});

// The ranks `ranks` of `world` (increasing, this rank among them) as a World of their own:
// rank = this rank's index in `ranks`, the same store under a prefix made of `name` and
// the ranks, so communicators over several subworlds never share keys. Local rank and
// rendezvous facts stay the world's. Every rank of a subworld calls it with the same
// arguments; it touches no network (Communicator::create does). Hybrid sharding makes its
// shard groups and replica groups so.
World subworld(const World& world, const std::vector<int>& ranks, const std::string& name);

}  // namespace flatshard
