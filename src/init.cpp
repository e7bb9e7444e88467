// flatshard::init(): resolve the world, then meet the other ranks through a LibTorch
// store (TCPStore served by rank 0, or FileStore on a shared file system).
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <optional>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "flatshard/errors.h"
#include "flatshard/world.h"
#include "src/errors.h"
#include "src/logging.h"
#include "src/tcp/auth.h"
#include "src/tcp/socket.h"
#include "src/tcp/store.h"

namespace flatshard {
namespace {

// Under torchrun the agent serves a TCPStore on the master port and tells the workers so
// (TORCHELASTIC_USE_AGENT_STORE): every rank, rank 0 too, is then its client.
bool torchrun_agent_store() {
  const char* v = std::getenv("TORCHELASTIC_USE_AGENT_STORE");
  return v != nullptr && std::string(v) == "True";
}

c10::intrusive_ptr<c10d::Store> make_agent_store(const WorldSpec& spec, std::chrono::milliseconds timeout) {
  c10d::TCPStoreOptions opts;
  opts.port = static_cast<std::uint16_t>(spec.master_port);
  opts.isServer = spec.rank == 0;  // TCPStore makes rank 0 a client of the agent's store
  opts.numWorkers = spec.world_size;
  opts.waitWorkers = false;  // the join count below waits, with a message that names who is missing
  opts.timeout = timeout;
  // The agent's store outlives the workers: a restart (torchrun --max-restarts) meets in a
  // store that still holds the last attempt's keys (the join count, the ranks' claims). Each
  // attempt keeps to its own keys, as PyTorch's workers do.
  const char* attempt = std::getenv("TORCHELASTIC_RESTART_COUNT");
  return c10::make_intrusive<c10d::PrefixStore>(fmt::format("/worker/attempt_{}", attempt ? attempt : "0"),
                                                c10::make_intrusive<c10d::TCPStore>(spec.master_addr, opts));
}

// The job's own store (Note [The job's store]), served by rank 0 on the master port: on
// the loopback interface only when the master is a loopback address or a name for one (a
// job on one machine), and joined only by ranks that prove the job's secret. A job that listens
// beyond loopback must have a secret (Note [Proving the job's secret]).
c10::intrusive_ptr<c10d::Store> make_tcp_store(const WorldSpec& spec, std::chrono::milliseconds timeout) {
  const std::string secret = tcp::job_secret();
  // Every rank on this machine: the store on loopback, whatever MASTER_ADDR names.
  const bool one_machine = tcp::job_on_one_machine();
  // Across machines, a master that names a loopback address here (a host name that this
  // machine's /etc/hosts maps to 127.0.1.1, as Debian's does) would serve the store, and
  // advertise the rings, where no other machine reaches. (torchrun's agents serve their
  // own store, on every interface.)
  if (!one_machine && !torchrun_agent_store() && tcp::job_spans_machines() &&
      tcp::loopback_by_name(spec.master_addr)) {
    throw InitError(
        "MASTER_ADDR",
        fmt::format("flatshard::init (rank {}/{}): the job spans machines, but MASTER_ADDR {} is the "
                    "loopback address {} on this one, where the other machines cannot reach the store: "
                    "set MASTER_ADDR (or --master-addr) to an address of rank 0's machine that the "
                    "others reach, such as its IP address (nodes simulated on one machine: 127.0.0.1)",
                    spec.rank, spec.world_size, spec.master_addr,
                    tcp::loopback_address_of(spec.master_addr)));
  }
  const std::string host = one_machine && tcp::loopback_address_of(spec.master_addr).empty()
                               ? std::string("127.0.0.1")
                               : spec.master_addr;
  if (secret.empty() && tcp::loopback_address_of(host).empty()) {
    throw RendezvousError(fmt::format(
        "flatshard::init (rank {}/{}): a job whose master {} is not a loopback address listens for other "
        "machines and needs a job secret that only its ranks know: set FLATSHARD_JOB_SECRET to the same "
        "random string on every rank (e.g. `export FLATSHARD_JOB_SECRET=$(openssl rand -hex 32)` in the "
        "batch "
        "script, passed on by srun, or by mpirun -x FLATSHARD_JOB_SECRET)",
        spec.rank, spec.world_size, spec.master_addr));
  }
  const auto fail = [&](const std::string& raw) {
    const std::string what = first_line(raw);
    if (spec.rank == 0 && !torchrun_agent_store()) {
      return RendezvousError(
          fmt::format("flatshard::init (rank 0/{}): cannot serve the rendezvous store on {}:{}: {}. If the "
                      "port is in use, set MASTER_PORT to a free port (flatshard-run picks one when "
                      "--master-port is omitted); if the address is not this host's, fix MASTER_ADDR.",
                      spec.world_size, spec.master_addr, spec.master_port, what));
    }
    return RendezvousError(
        fmt::format("flatshard::init (rank {}/{}): cannot reach the rendezvous store of rank 0 at {}:{} "
                    "within {} ms: {}. Check MASTER_ADDR and MASTER_PORT, that rank 0 was started, that no "
                    "firewall blocks the port, and that every rank has the same FLATSHARD_JOB_SECRET.",
                    spec.rank, spec.world_size, spec.master_addr, spec.master_port, timeout.count(), what));
  };
  try {
    if (torchrun_agent_store()) return make_agent_store(spec, timeout);
    return tcp::make_job_store(host, spec.master_port, spec.rank == 0, secret, timeout);
  } catch (const tcp::IoError& e) {
    throw fail(e.detail);
  } catch (const std::exception& e) {
    throw fail(e.what());
  }
}

// Every rank adds itself to a counter and waits until all have: a missing rank is
// reported by count instead of surfacing later as a collective's timeout.
void wait_for_everyone(c10d::Store& store, const WorldSpec& spec, std::chrono::milliseconds timeout) {
  const std::string key = "flatshard/init/joined";
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  try {
    // Each rank claims its number first: two processes given one RANK (two nodes given one
    // --node-rank) would otherwise count as two ranks joined, and the job would wait out a
    // collective's timeout for the rank nobody is.
    char host[256] = "";
    ::gethostname(host, sizeof(host) - 1);
    const std::string me = fmt::format("{} (pid {})", host, ::getpid());
    const std::vector<std::uint8_t> mine(me.begin(), me.end());
    const auto holder = store.compareSet(fmt::format("flatshard/init/rank/{}", spec.rank), {}, mine);
    if (holder != mine) {
      throw RendezvousError(fmt::format(
          "flatshard::init (rank {}/{}): rank {} was already claimed by {}, and this process on {} claims it "
          "too: give every process its own RANK (under flatshard-run, every node its own --node-rank)",
          spec.rank, spec.world_size, spec.rank, std::string(holder.begin(), holder.end()), me));
    }
    std::int64_t joined = store.add(key, 1);
    auto pause = std::chrono::milliseconds(1);
    while (joined < spec.world_size) {
      if (std::chrono::steady_clock::now() > deadline) {
        throw RendezvousError(fmt::format(
            "flatshard::init (rank {}/{}): only {} of {} ranks joined the rendezvous within {} ms. "
            "Start every rank with the same WORLD_SIZE and master, or raise InitOptions::timeout.",
            spec.rank, spec.world_size, joined, spec.world_size, timeout.count()));
      }
      std::this_thread::sleep_for(pause);
      pause = std::min(pause * 2, std::chrono::milliseconds(50));
      joined = store.add(key, 0);
    }
  } catch (const RendezvousError&) {
    throw;
  } catch (const std::exception& e) {
    throw RendezvousError(fmt::format("flatshard::init (rank {}/{}): the rendezvous store failed: {}",
                                      spec.rank, spec.world_size, first_line(e.what())));
  }
}

}  // namespace

World init(const InitOptions& options) {
  World world;
  world.spec = resolve_world(options, process_env());
  const WorldSpec& spec = world.spec;
  log::set_rank(spec.rank, spec.world_size);
  if (spec.world_size == 1) return world;
  if (spec.store_kind == "file") {
    try {
      world.store = c10::make_intrusive<c10d::FileStore>(spec.file_path, spec.world_size);
    } catch (const std::exception& e) {
      throw RendezvousError(
          fmt::format("flatshard::init (rank {}/{}): cannot open the file store {}: {}. "
                      "Use a path on a file system every rank shares, in a directory "
                      "that exists.",
                      spec.rank, spec.world_size, spec.file_path, e.what()));
    }
    world.store->setTimeout(options.timeout);
  } else {
    world.store = make_tcp_store(spec, options.timeout);
  }
  wait_for_everyone(*world.store, spec, options.timeout);
  log::at(
      log::Level::Info, "joined the world through {} ({})", to_string(spec.source),
      spec.store_kind == "file" ? spec.file_path : fmt::format("{}:{}", spec.master_addr, spec.master_port));
  return world;
}

World subworld(const World& world, const std::vector<int>& ranks, const std::string& name) {
  const int n = world.world_size();
  bool sorted = !ranks.empty();
  for (std::size_t i = 0; i < ranks.size(); ++i) {
    sorted = sorted && ranks[i] >= 0 && ranks[i] < n && (i == 0 || ranks[i] > ranks[i - 1]);
  }
  const auto me = std::find(ranks.begin(), ranks.end(), world.rank());
  if (!sorted || me == ranks.end() || name.empty()) {
    throw InvalidArgument(fmt::format(
        "flatshard::subworld (rank {}/{}): ranks {} must be distinct, increasing, within [0, {}) and include "
        "this rank, and the name must not be empty (got '{}')",
        world.rank(), n, fmt::join(ranks, ","), n, name));
  }
  World sub;
  sub.spec = world.spec;
  sub.spec.rank = static_cast<int>(me - ranks.begin());
  sub.spec.world_size = static_cast<int>(ranks.size());
  if (sub.spec.world_size > 1) {
    sub.store = c10::make_intrusive<c10d::PrefixStore>(
        fmt::format("subworld/{}/{}", name, fmt::join(ranks, ",")), world.store);
  }
  return sub;
}

}  // namespace flatshard
