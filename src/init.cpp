// flatshard::init(): resolve the world, then meet the other ranks through a LibTorch
// store (TCPStore served by rank 0, or FileStore on a shared file system).
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <optional>
#include <thread>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "flatshard/errors.h"
#include "flatshard/world.h"
#include "src/logging.h"
#include "src/tcp/socket.h"

namespace flatshard {
namespace {

// A job whose master is a loopback address runs on one machine: rank 0 serves the store
// on the loopback interface only, so no other machine can read or set its keys (LibTorch's
// TCPStore would listen on every interface). The store takes over the socket. Nothing when
// the port cannot be bound here: TCPStore then reports it (or, under torchrun, uses the
// agent's store on that port).
std::optional<int> loopback_listener(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return std::nullopt;
  int one = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(static_cast<std::uint16_t>(port));
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 || ::listen(fd, 1024) != 0) {
    ::close(fd);
    return std::nullopt;
  }
  return fd;
}

c10::intrusive_ptr<c10d::Store> make_tcp_store(const WorldSpec& spec, std::chrono::milliseconds timeout) {
  c10d::TCPStoreOptions opts;
  opts.port = static_cast<std::uint16_t>(spec.master_port);
  opts.isServer = spec.rank == 0;
  opts.numWorkers = spec.world_size;
  opts.waitWorkers = false;  // the join count below waits, with a message that names who is missing
  opts.timeout = timeout;
  if (opts.isServer && tcp::is_loopback(spec.master_addr))
    opts.masterListenFd = loopback_listener(spec.master_port);
  try {
    return c10::make_intrusive<c10d::TCPStore>(spec.master_addr, opts);
  } catch (const std::exception& e) {
    std::string what = e.what();
    what = what.substr(0, what.find('\n'));
    if (spec.rank == 0) {
      throw RendezvousError(
          fmt::format("flatshard::init (rank 0/{}): cannot serve the rendezvous store on {}:{}: {}. If the "
                      "port is in use, set MASTER_PORT to a free port (flatshard-run picks one when "
                      "--master-port is omitted); if the address is not this host's, fix MASTER_ADDR.",
                      spec.world_size, spec.master_addr, spec.master_port, what));
    }
    throw RendezvousError(
        fmt::format("flatshard::init (rank {}/{}): cannot reach the rendezvous store of rank 0 at {}:{} "
                    "within {} ms: {}. Check MASTER_ADDR and MASTER_PORT, that rank 0 was started, and that "
                    "no firewall blocks the port.",
                    spec.rank, spec.world_size, spec.master_addr, spec.master_port, timeout.count(), what));
  }
}

// Every rank adds itself to a counter and waits until all have: a missing rank is
// reported by count instead of surfacing later as a collective's timeout.
void wait_for_everyone(c10d::Store& store, const WorldSpec& spec, std::chrono::milliseconds timeout) {
  const std::string key = "flatshard/init/joined";
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  try {
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
    std::string what = e.what();
    throw RendezvousError(fmt::format("flatshard::init (rank {}/{}): the rendezvous store failed: {}",
                                      spec.rank, spec.world_size, what.substr(0, what.find('\n'))));
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
