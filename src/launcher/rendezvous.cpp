#include "src/launcher/rendezvous.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <map>
#include <stdexcept>
#include <thread>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "src/tcp/auth.h"
#include "src/tcp/socket.h"

namespace flatshard::launcher {
namespace {

using tcp::Clock;
using Seconds = std::chrono::duration<double>;

constexpr const char* kPurpose = "launcher rendezvous";
constexpr std::uint32_t kMagic = 0x46535256;  // "FSRV"
constexpr auto kHandshake = std::chrono::seconds(5);

// What the host answers a node.
enum Kind : std::int32_t { kMember = 0, kRefused = 1, kJobOver = 2, kRegroup = 3 };
// Why it refused one.
enum Refusal : std::int32_t { kIdTaken = 1, kIdOutOfRange = 2, kOtherNproc = 3 };

// Messages are 32-bit integers in network byte order.
void send_ints(tcp::Socket& s, const std::vector<std::int32_t>& values, Clock::time_point deadline) {
  std::vector<std::uint32_t> wire;
  for (std::int32_t v : values) wire.push_back(htonl(static_cast<std::uint32_t>(v)));
  s.send_all(wire.data(), wire.size() * sizeof(std::uint32_t), deadline);
}

// Sends `values` to a node that may be gone already: one that left is not told.
void tell(tcp::Socket& s, const std::vector<std::int32_t>& values, Clock::duration within = kHandshake) {
  try {
    send_ints(s, values, Clock::now() + within);
  } catch (const tcp::IoError&) {
  }
}

std::vector<std::int32_t> recv_ints(tcp::Socket& s, std::size_t count, Clock::time_point deadline) {
  std::vector<std::uint32_t> wire(count);
  s.recv_all(wire.data(), count * sizeof(std::uint32_t), deadline);
  std::vector<std::int32_t> values;
  for (std::uint32_t v : wire) values.push_back(static_cast<std::int32_t>(ntohl(v)));
  return values;
}

Clock::time_point after(double seconds) {
  return Clock::now() + std::chrono::duration_cast<Clock::duration>(Seconds(seconds));
}

// Waits until `s` has bytes to read (or is closed) or `until` passes, asking `o.stop` every
// 200 ms; false when `until` passed.
bool wait_readable(tcp::Socket& s, Clock::time_point until, const RendezvousOptions& o) {
  for (;;) {
    if (o.stop && o.stop()) throw RendezvousStopped{};
    const auto now = Clock::now();
    if (now >= until) return false;
    const auto slice = std::min<Clock::duration>(until - now, std::chrono::milliseconds(200));
    pollfd p{s.fd(), POLLIN, 0};
    if (::poll(&p, 1,
               static_cast<int>(std::chrono::duration_cast<std::chrono::milliseconds>(slice).count()) + 1) >
        0)
      return true;
  }
}

// Whether the node at the other end of `s` has gone (closed, reset): a node that died while
// it waited in a round must not be counted, nor keep its id from its next launcher.
bool gone(const tcp::Socket& s) {
  pollfd p{s.fd(), POLLIN | POLLRDHUP, 0};
  if (::poll(&p, 1, 0) <= 0) return false;
  if (p.revents & (POLLHUP | POLLERR | POLLRDHUP)) return true;
  char byte;
  return (p.revents & POLLIN) && ::recv(s.fd(), &byte, 1, MSG_PEEK | MSG_DONTWAIT) == 0;
}

// A node waiting in a round: its id and its connection.
struct Arrival {
  int id = 0;
  tcp::Socket socket;
};

// Drops the arrivals whose nodes have gone (Note [Rounds of an elastic job]).
void drop_gone(std::vector<Arrival>& arrivals) {
  arrivals.erase(
      std::remove_if(arrivals.begin(), arrivals.end(), [](const Arrival& a) { return gone(a.socket); }),
      arrivals.end());
}

}  // namespace

struct RendezvousHost::State {
  RendezvousOptions options;
  tcp::Listener listener;
  int round = 0;
  // Each node's connection of the last round it was in, by id: told when the job ends.
  std::map<int, tcp::Socket> known;
  // Nodes taken in while a start ran (Note [Growing an elastic job]), for the next round.
  std::vector<Arrival> early;
  void tell_known(int code) {
    for (auto& node : known) tell(node.second, {kJobOver, code}, std::chrono::seconds(1));
    known.clear();
  }
  State(const RendezvousOptions& o, int port, const std::string& loopback)
      : options(o), listener(port, loopback) {}

  // Accepts one node before `until`, checks its proof and its hello; nullopt when none came
  // or it was refused (a refused node is told why and logged).
  std::optional<Arrival> accept(Clock::time_point until, const std::vector<Arrival>& present,
                                Clock::duration handshake = kHandshake) {
    tcp::Socket s;
    try {
      s = listener.accept(until);
    } catch (const tcp::IoError&) {
      return std::nullopt;  // none before `until`
    }
    s.keep_alive();  // a node that vanishes while it waits is then seen as gone (Socket::keep_alive)
    if (auto refused = tcp::check_secret(s, options.secret, kPurpose, Clock::now() + handshake)) {
      std::fprintf(stderr, "flatshard-run: refused a connection to the launchers' rendezvous from %s: %s\n",
                   tcp::peer_address(s).c_str(), refused->c_str());
      return std::nullopt;
    }
    std::vector<std::int32_t> hello;
    try {
      hello = recv_ints(s, 3, Clock::now() + handshake);
    } catch (const tcp::IoError& e) {
      std::fprintf(stderr, "flatshard-run: a node left the rendezvous before saying who it is: %s\n",
                   e.detail.c_str());
      return std::nullopt;
    }
    if (static_cast<std::uint32_t>(hello[0]) != kMagic) return std::nullopt;
    const int id = hello[1], nproc = hello[2];
    std::int32_t refusal = 0;
    if (id <= 0 || id >= options.max_nodes) {
      refusal = kIdOutOfRange;
    } else if (nproc != options.nproc) {
      refusal = kOtherNproc;
    } else if (std::any_of(present.begin(), present.end(), [&](const Arrival& a) { return a.id == id; })) {
      refusal = kIdTaken;
    }
    if (refusal != 0) {
      std::fprintf(stderr, "flatshard-run: refused node %d (%d ranks) in round %d: %s\n", id, nproc,
                   round + 1,
                   refusal == kIdTaken        ? "another node of that --node-rank is in the round"
                   : refusal == kIdOutOfRange ? "its --node-rank is out of range"
                                              : "it runs another number of ranks");
      tell(s, {kRefused, refusal, options.max_nodes, options.nproc});
      return std::nullopt;
    }
    return Arrival{id, std::move(s)};
  }
};

RendezvousHost::RendezvousHost(const RendezvousOptions& options) {
  const std::string loopback = tcp::loopback_address_of(options.host);
  try {
    state_ = std::make_unique<State>(options, options.port, loopback);
  } catch (const tcp::IoError& e) {
    throw std::runtime_error(
        fmt::format("node 0 cannot host the launchers' rendezvous at {}:{}: {}; give a free --master-port",
                    options.host, options.port, e.detail));
  }
}

RendezvousHost::~RendezvousHost() = default;

Membership RendezvousHost::next_round(int restarts) {
  State& st = *state_;
  const RendezvousOptions& o = st.options;
  ++st.round;
  const auto last_call = after(o.wait_s), give_up = after(o.timeout_s);
  std::vector<Arrival> present = std::move(st.early);
  st.early.clear();
  drop_gone(present);
  for (;;) {
    const int count = 1 + static_cast<int>(present.size());
    const auto now = Clock::now();
    if (count >= o.max_nodes || (count >= o.min_nodes && now >= last_call)) break;
    if (o.stop && o.stop()) {
      st.early = std::move(present);  // told by finish(), as the nodes that came earlier
      throw RendezvousStopped{};
    }
    if (now >= give_up) {
      // The nodes that came are told the job ends (exit code 1) instead of finding out at
      // their own timeout.
      for (auto& a : present) tell(a.socket, {kJobOver, 1});
      st.tell_known(1);  // and those left out of this round
      throw std::runtime_error(
          fmt::format("round {} of the launchers' rendezvous: {} of at least {} nodes arrived within "
                      "--rdzv-timeout-s {:g}; "
                      "start the missing nodes' flatshard-run (same --master-addr, --master-port and secret) "
                      "or lower MIN in "
                      "--nnodes MIN:MAX",
                      st.round, count, o.min_nodes, o.timeout_s));
    }
    const auto until =
        std::min(count >= o.min_nodes ? last_call : give_up, now + std::chrono::milliseconds(200));
    if (auto arrival = st.accept(until, present)) present.push_back(std::move(*arrival));
    drop_gone(present);
  }
  std::sort(present.begin(), present.end(), [](const Arrival& a, const Arrival& b) { return a.id < b.id; });
  Membership m;
  m.round = st.round;
  m.restarts = restarts;
  m.node_rank = 0;
  m.nnodes = 1 + static_cast<int>(present.size());
  m.node_ids.push_back(0);
  for (const auto& a : present) m.node_ids.push_back(a.id);
  tcp::Listener free_now(0, tcp::loopback_address_of(o.host));
  m.port = free_now.port();  // released before the ranks start; rank 0 binds it again
  for (std::size_t k = 0; k < present.size(); ++k) {
    std::vector<std::int32_t> answer{kMember,  m.round, static_cast<std::int32_t>(k + 1),
                                     m.nnodes, m.port,  restarts};
    answer.insert(answer.end(), m.node_ids.begin(), m.node_ids.end());
    try {
      send_ints(present[k].socket, answer, Clock::now() + kHandshake);
    } catch (const tcp::IoError& e) {
      // It left between its hello and the answer: the start fails without it, and the
      // next round goes on without it.
      std::fprintf(stderr, "flatshard-run: node %d left round %d before its answer: %s\n", present[k].id,
                   m.round, e.detail.c_str());
    }
  }
  for (auto& a : present) st.known[a.id] = std::move(a.socket);  // its previous one closes
  return m;
}

bool RendezvousHost::grows(const std::vector<int>& running) {
  State& st = *state_;
  // A node relaunched after its launcher died finds its old entry gone, not its id taken.
  drop_gone(st.early);
  while (st.listener.pending()) {
    auto arrival = st.accept(Clock::now(), st.early, std::chrono::seconds(1));
    if (!arrival) break;
    st.early.push_back(std::move(*arrival));
  }
  if (static_cast<int>(running.size()) >= st.options.max_nodes) return false;
  return std::any_of(st.early.begin(), st.early.end(), [&](const Arrival& a) {
    return std::find(running.begin(), running.end(), a.id) == running.end();
  });
}

void RendezvousHost::regroup() {
  State& st = *state_;
  // A node that is gone is not told; the next round goes on without it.
  for (auto& node : st.known) tell(node.second, {kRegroup, st.round}, std::chrono::seconds(1));
}

void RendezvousHost::finish(int code) {
  State& st = *state_;
  st.tell_known(code);
  for (auto& a : st.early) tell(a.socket, {kJobOver, code});  // taken in while the last start ran
  st.early.clear();
  for (;;) {  // and those waiting for another round
    tcp::Socket s;
    try {
      s = st.listener.accept(Clock::now());
    } catch (const tcp::IoError&) {
      break;  // none left
    }
    if (tcp::check_secret(s, st.options.secret, kPurpose, Clock::now() + kHandshake)) continue;
    try {
      recv_ints(s, 3, Clock::now() + kHandshake);
      send_ints(s, {kJobOver, code}, Clock::now() + kHandshake);
    } catch (const tcp::IoError&) {
    }
  }
}

struct RendezvousNode::State {
  RendezvousOptions options;
  tcp::Socket last;  // this node's connection of the last round it was in
};

RendezvousNode::RendezvousNode(const RendezvousOptions& options)
    : state_(std::make_unique<State>(State{options, {}})) {}

RendezvousNode::~RendezvousNode() = default;

bool RendezvousNode::regroup_requested() { return await_regroup(std::chrono::milliseconds(0)); }

bool RendezvousNode::await_regroup(std::chrono::milliseconds wait) {
  tcp::Socket& last = state_->last;
  if (!last.valid()) return false;
  pollfd p{last.fd(), POLLIN, 0};
  if (::poll(&p, 1, static_cast<int>(wait.count())) <= 0) return false;
  std::uint32_t head[2];
  const ssize_t n = ::recv(last.fd(), head, sizeof(head), MSG_PEEK | MSG_DONTWAIT);
  if (n != static_cast<ssize_t>(sizeof(head)) || static_cast<std::int32_t>(ntohl(head[0])) != kRegroup)
    return false;  // the job's end (read at the next join), or the host gone
  recv_ints(last, 2, Clock::now() + kHandshake);
  return true;
}

Membership RendezvousNode::join() {
  const RendezvousOptions& o = state_->options;
  tcp::Socket& last = state_->last;
  // Whether the host said on the last round's connection that the job ended. Its closing
  // the connection says nothing: it does so when the next round forms without this node.
  auto ended = [&]() -> std::optional<int> {
    if (!last.valid()) return std::nullopt;
    for (;;) {
      pollfd p{last.fd(), POLLIN, 0};
      if (::poll(&p, 1, 0) <= 0) return std::nullopt;
      try {
        const auto head = recv_ints(last, 2, Clock::now() + kHandshake);
        if (head[0] == kJobOver) return head[1];
        if (head[0] == kRegroup) continue;  // heard after its start ended: the job's end may follow
      } catch (const tcp::IoError&) {
      }
      last = tcp::Socket();
      return std::nullopt;
    }
  };
  auto give_up = after(o.timeout_s);
  std::string last_error;
  int refused_proofs = 0;
  while (Clock::now() < give_up) {
    if (const auto code = ended()) {
      Membership m;
      m.job_over = *code;
      return m;
    }
    try {
      if (o.stop && o.stop()) throw RendezvousStopped{};
      tcp::Socket s = tcp::Socket::connect(o.host, o.port, 0, std::min(give_up, after(1)));
      s.keep_alive();
      // The host answers once it opens a round: while a start runs, not before it ends, so
      // a node that arrives then waits as long as the host is there; once it is gone, the
      // timeout counts from then.
      give_up = after(o.timeout_s);
      wait_readable(s, Clock::time_point::max(), o);
      try {
        tcp::prove_secret(s, o.secret, kPurpose, Clock::now() + kHandshake);
        refused_proofs = 0;
      } catch (const tcp::IoError& e) {
        // A refusal once may be the host going away just then; twice is a secret it does not
        // share. A connection that broke before the host answered is retried as any other.
        if (e.refused && ++refused_proofs >= 2)
          throw std::runtime_error(fmt::format(
              "node {} cannot join the launchers' rendezvous at {}:{}: {}; give every node the same "
              "FLATSHARD_JOB_SECRET",
              o.node_id, o.host, o.port, e.detail));
        throw;
      }
      send_ints(s, {static_cast<std::int32_t>(kMagic), o.node_id, o.nproc}, Clock::now() + kHandshake);
      // The answer comes when the round closes, or, taken in while a start runs (Note
      // [Growing an elastic job]), when that start ends: as long as the host is there.
      wait_readable(s, Clock::time_point::max(), o);
      const auto head = recv_ints(s, 2, Clock::now() + kHandshake);
      if (head[0] == kJobOver) {
        Membership m;
        m.job_over = head[1];
        return m;
      }
      if (head[0] == kRefused) {
        const auto rest = recv_ints(s, 2, Clock::now() + kHandshake);
        throw std::runtime_error(fmt::format(
            "the launchers' rendezvous at {}:{} refused node {}: {}", o.host, o.port, o.node_id,
            head[1] == kIdTaken ? "another node with this --node-rank is in the round; give each node its own"
            : head[1] == kIdOutOfRange
                ? fmt::format("--node-rank must be in 1..{} (node 0 hosts the rounds)", rest[0] - 1)
                : fmt::format("node 0 runs {} ranks per node and this node {}; give every node the same -n",
                              rest[1], o.nproc)));
      }
      Membership m;
      m.round = head[1];
      const auto rest = recv_ints(s, 4, Clock::now() + kHandshake);
      m.node_rank = rest[0];
      m.nnodes = rest[1];
      m.port = rest[2];
      m.restarts = rest[3];
      const auto ids = recv_ints(s, static_cast<std::size_t>(m.nnodes), Clock::now() + kHandshake);
      m.node_ids.assign(ids.begin(), ids.end());
      last = std::move(s);
      return m;
    } catch (const tcp::IoError& e) {
      last_error = e.detail;  // the host restarting its listener, or gone: try again until the timeout
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
    }
  }
  throw std::runtime_error(
      fmt::format("node {} could not join a round of the launchers' rendezvous at {}:{} within "
                  "--rdzv-timeout-s {:g} ({}); "
                  "node 0 (--node-rank 0) hosts the rounds and must be running",
                  o.node_id, o.host, o.port, o.timeout_s, last_error));
}

}  // namespace flatshard::launcher
