// Making a TCP ring's links: addresses through the store, one connection per channel
// each way, proving the job's secret (Note [Proving the job's secret]) and with a checked hello, then
// Note [Direct copies]'s agreement per link.
#include "src/tcp/ring_links.h"

#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <future>
#include <list>
#include <optional>
#include <random>

#include <fmt/format.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "flatshard/errors.h"
#include "src/errors.h"
#include "src/logging.h"
#include "src/tcp/auth.h"

namespace flatshard::comm {
namespace {

using tcp::Clock;
using tcp::IoError;
using tcp::Socket;

constexpr std::uint32_t kHelloMagic = 0x46534845;   // "FSHE"
constexpr std::uint32_t kDirectMagic = 0x46534443;  // "FSDC"
// How long a connection to a ring listener has to prove the job's secret: the job's own
// answer at once, and a stranger holds the listener no longer than this.
constexpr auto kProofTime = std::chrono::seconds(5);

// Note [Direct copies] (ring_links.h): what a link's sender offers and its receiver answers.
struct DirectOffer {
  std::uint32_t magic;
  std::int32_t pid;
  std::uint64_t address;  // of `nonce` in the sender
  std::uint64_t nonce[2];
  std::uint32_t wanted;  // 0: the sender's options turn direct copies off
  std::uint32_t pad;
};
struct DirectAnswer {
  std::uint32_t magic;
  std::uint32_t accepted;
};

struct Hello {
  std::uint32_t magic;
  std::int32_t rank;
  std::int32_t world_size;
  std::int32_t channel;
};

// A connection to a ring listener, once it has proved the job's secret and said hello
// (or why it was refused).
struct Arrival {
  Socket socket;
  Hello hello{};
  std::optional<std::string> refused;
  std::string address;
};

// At most this many connections prove the secret at once; more are refused at the door.
constexpr std::size_t kMaxPending = 64;

Arrival arrive(Socket s, const std::string& secret, Clock::time_point deadline) {
  Arrival a;
  a.address = tcp::peer_address(s);
  a.refused = tcp::check_secret(s, secret, tcp::kRingPurpose, deadline);
  if (!a.refused) {
    try {
      s.recv_all(&a.hello, sizeof(a.hello), deadline);
    } catch (const IoError& e) {
      a.refused = fmt::format("it proved the secret but sent no hello: {}", e.detail);
    }
  }
  a.socket = std::move(s);
  return a;
}

std::vector<std::uint8_t> to_bytes(const std::string& s) { return {s.begin(), s.end()}; }

bool wants_direct_copy(const CommunicatorOptions& options) {
  const char* env = std::getenv("FLATSHARD_DIRECT_COPY");
  return options.direct_copy && !(env != nullptr && std::string(env) == "0");
}

// Note [Direct copies]: each link's sender offers, its receiver tries and answers.
// Offers are sent on every link before any is read, so no rank waits on another's
// answer while its own offer is unsent.
void agree_on_direct_copies(std::vector<Channel>& channels, bool wanted, Clock::time_point deadline) {
  std::random_device random;
  std::uint64_t nonce[2];
  for (auto& word : nonce) word = (std::uint64_t{random()} << 32) ^ random();
  const DirectOffer offer{kDirectMagic,
                          static_cast<std::int32_t>(::getpid()),
                          reinterpret_cast<std::uintptr_t>(&nonce[0]),
                          {nonce[0], nonce[1]},
                          wanted ? 1u : 0u,
                          0};
  for (Channel& ch : channels) ch.to_next.send_all(&offer, sizeof(offer), deadline);
  for (Channel& ch : channels) {
    DirectOffer theirs{};
    ch.from_prev.recv_all(&theirs, sizeof(theirs), deadline);
    bool accepted = false;
    if (wanted && theirs.magic == kDirectMagic && theirs.wanted == 1 && theirs.pid > 0) {
      std::uint64_t read_back[2] = {0, 0};
      iovec local{read_back, sizeof(read_back)};
      iovec remote{reinterpret_cast<void*>(static_cast<std::uintptr_t>(theirs.address)), sizeof(read_back)};
      accepted = ::process_vm_readv(theirs.pid, &local, 1, &remote, 1, 0) ==
                     static_cast<ssize_t>(sizeof(read_back)) &&
                 read_back[0] == theirs.nonce[0] && read_back[1] == theirs.nonce[1];
    }
    ch.direct_in = accepted;
    ch.prev_pid = theirs.pid;
    const DirectAnswer answer{kDirectMagic, accepted ? 1u : 0u};
    ch.from_prev.send_all(&answer, sizeof(answer), deadline);
  }
  for (Channel& ch : channels) {
    DirectAnswer answer{};
    ch.to_next.recv_all(&answer, sizeof(answer), deadline);
    ch.direct_out = answer.magic == kDirectMagic && answer.accepted == 1;
  }
}

}  // namespace

std::vector<Channel> connect_ring(const World& world, const CommunicatorOptions& options, int num_channels,
                                  const std::string& prefix) {
  const int rank = world.rank();
  const int world_size = world.world_size();
  const auto deadline = Clock::now() + options.timeout;
  const auto fail = [&](const std::string& what) -> RendezvousError {
    return RendezvousError(fmt::format("flatshard::Communicator::create (rank {}/{}, communicator '{}'): {}",
                                       rank, world_size, options.name, what));
  };
  std::vector<Channel> channels;
  std::string host = world.spec.store_kind == "tcp"
                         ? tcp::local_address_toward(world.spec.master_addr, world.spec.master_port)
                         : "127.0.0.1";
  if (tcp::job_on_one_machine()) host = "127.0.0.1";  // every rank here: loopback
  const char* forced = std::getenv("FLATSHARD_SOCKET_ADDR");
  if (forced != nullptr) host = forced;
  // Across machines a ring on loopback is one no other machine reaches: its links would wait
  // out the deadline. The route toward a master that names this machine through its
  // /etc/hosts is loopback.
  if (forced == nullptr && tcp::is_loopback(host) && !tcp::job_on_one_machine() &&
      tcp::job_spans_machines() && world.spec.store_kind == "tcp" &&
      tcp::loopback_by_name(world.spec.master_addr)) {
    throw fail(
        fmt::format("the job spans machines, but this rank's ring would listen on the loopback address {} "
                    "(the route toward "
                    "MASTER_ADDR {}): set FLATSHARD_SOCKET_ADDR to this machine's address that the other "
                    "machines reach, or "
                    "MASTER_ADDR to rank 0's IP address (nodes simulated on this one machine: "
                    "FLATSHARD_SOCKET_ADDR=127.0.0.1)",
                    host, world.spec.master_addr));
  }
  // A ring reached over loopback (a job on one machine) listens on loopback only: no other
  // machine can open a link into it. One that listens beyond loopback (FLATSHARD_SOCKET_ADDR
  // naming another interface, or a file store across machines) needs the job's secret, as
  // init() requires of the store (Note [Proving the job's secret]).
  if (!tcp::is_loopback(host) && tcp::job_secret().empty()) {
    throw fail(
        fmt::format("its ring would listen on {}, beyond loopback, with no job secret to keep strangers "
                    "out: set FLATSHARD_JOB_SECRET to the same random string on every rank",
                    host));
  }
  tcp::Listener listener(tcp::is_loopback(host) ? host : std::string());
  try {
    world.store->set(prefix + std::to_string(rank), to_bytes(fmt::format("{}:{}", host, listener.port())));
    const std::string key = prefix + std::to_string((rank + 1) % world_size);
    world.store->wait({key}, options.timeout);
    const auto value = world.store->get(key);
    const std::string address(value.begin(), value.end());
    const auto colon = address.rfind(':');
    const std::string next_host = address.substr(0, colon);
    const int next_port = std::stoi(address.substr(colon + 1));
    channels.resize(num_channels);
    // Note [Proving the job's secret]: every link proves it both ways, so each rank proves
    // its links to the next rank (on a thread of its own) while it checks those from the
    // previous one; in sequence, every rank would wait on the next one's listener.
    const std::string secret = tcp::job_secret();
    auto outgoing = std::async(std::launch::async, [&] {
      for (int c = 0; c < num_channels; ++c) {
        channels[c].to_next = Socket::connect(next_host, next_port, (rank + 1) % world_size, deadline);
        tcp::prove_secret(channels[c].to_next, secret, tcp::kRingPurpose, deadline);
        Hello hello{kHelloMagic, rank, world_size, c};
        channels[c].to_next.send_all(&hello, sizeof(hello), deadline);
      }
    });
    const int prev = (rank + world_size - 1) % world_size;
    // Each accepted connection proves the secret and says hello on a thread of its own, so
    // that a silent stranger holds up nobody; the outgoing links' failure (another secret,
    // say) is reported as soon as it happens rather than at the deadline.
    std::vector<Socket> incoming(static_cast<std::size_t>(num_channels));
    // Each with its descriptor, open until the future is gone (the task or its result
    // holds the socket), so that the strangers still pending can be woken at the end.
    std::list<std::pair<std::future<Arrival>, int>> pending;
    bool outgoing_done = false;
    for (int accepted = 0; accepted < num_channels;) {
      // Checked each round: strangers arriving without pause would otherwise keep the
      // accept from ever timing out.
      if (Clock::now() >= deadline)
        throw IoError{IoError::Kind::Timeout, prev,
                      "the previous rank's links did not all arrive before the deadline"};
      if (!outgoing_done && outgoing.wait_for(std::chrono::seconds(0)) == std::future_status::ready) {
        outgoing.get();  // rethrows the outgoing links' failure
        outgoing_done = true;
      }
      try {
        Socket s = listener.accept(std::min(deadline, Clock::now() + std::chrono::milliseconds(20)));
        if (pending.size() >= kMaxPending) {
          log::at(log::Level::Warn,
                  "communicator '{}': refused a ring link from {}: {} others are still proving "
                  "the job secret",
                  options.name, tcp::peer_address(s), pending.size());
        } else {
          const int fd = s.fd();
          pending.emplace_back(std::async(std::launch::async,
                                          [s = std::move(s), &secret, deadline]() mutable {
                                            return arrive(std::move(s), secret,
                                                          std::min(deadline, Clock::now() + kProofTime));
                                          }),
                               fd);
        }
      } catch (const IoError& e) {
        if (e.kind != IoError::Kind::Timeout || Clock::now() >= deadline) throw;
      }
      for (auto it = pending.begin(); it != pending.end();) {
        if (it->first.wait_for(std::chrono::seconds(0)) != std::future_status::ready) {
          ++it;
          continue;
        }
        Arrival a = it->first.get();
        it = pending.erase(it);
        if (a.refused) {
          log::at(log::Level::Warn, "communicator '{}': refused a ring link from {}: {}", options.name,
                  a.address, *a.refused);
          continue;  // a stranger: the listener waits on for the job's own
        }
        const Hello& hello = a.hello;
        if (hello.magic != kHelloMagic || hello.world_size != world_size || hello.rank != prev ||
            hello.channel < 0 || hello.channel >= num_channels || incoming[hello.channel].valid()) {
          throw fail(
              fmt::format("unexpected connection (magic {:#x}, rank {}, world size {}, channel {}) "
                          "while waiting for rank {}: are two jobs using the same master address "
                          "and port?",
                          hello.magic, hello.rank, hello.world_size, hello.channel, prev));
        }
        a.socket.set_peer(prev);
        incoming[hello.channel] = std::move(a.socket);
        ++accepted;
      }
    }
    // Whoever is still proving is no link of this ring: woken and refused, each logged.
    for (auto& p : pending) ::shutdown(p.second, SHUT_RDWR);
    for (auto& p : pending) {
      const Arrival a = p.first.get();
      log::at(log::Level::Warn, "communicator '{}': refused a ring link from {}: {}", options.name, a.address,
              a.refused ? *a.refused : std::string("the ring was complete without it"));
    }
    pending.clear();
    if (!outgoing_done) outgoing.get();
    for (int c = 0; c < num_channels; ++c) channels[c].from_prev = std::move(incoming[c]);
    agree_on_direct_copies(channels, wants_direct_copy(options), deadline);
  } catch (const IoError& e) {
    throw fail(fmt::format("{}; check that every rank is running and can reach the others", e.detail));
  } catch (const RendezvousError&) {
    throw;
  } catch (const std::exception& e) {
    throw fail(e.what());
  }
  return channels;
}

}  // namespace flatshard::comm
