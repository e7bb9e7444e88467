// The launchers' rendezvous of an elastic job (flatshard-run --nnodes MIN:MAX).
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace flatshard::launcher {

// Note [Rounds of an elastic job]
// An elastic job's nodes do not know their node ranks in advance: before every start (the
// first, each restart after a failure, each regroup) their launchers meet in a round. The launcher
// given --node-rank 0 hosts the rounds on --master-addr:--master-port for the job's whole
// life and is always node 0; every other launcher connects there, proves the job's secret
// (Note [Proving the job's secret], purpose "launcher rendezvous") and says which node it is
// (its --node-rank, an id kept across rounds) and how many ranks it runs. A round closes
// when MAX nodes are in, or when at least MIN are and --rdzv-wait-s has passed since it
// opened: a node that has not come back by then is taken to be gone for good. The host
// numbers the nodes present in the order of their ids, picks the ranks' MASTER_PORT for
// the start (a free port of its own), and tells every node its node rank, the number of
// nodes and the port; the start then runs as a fixed job of that many nodes. A start at
// fewer nodes than the one before is a smaller world: the program resumes from its latest
// checkpoint, resharded (load_sharded reads any world size). A node that arrives while a
// start is running is let in by the host and, while the job runs below MAX nodes, ends that
// start (Note [Growing an elastic job]). If fewer than MIN nodes arrive within
// --rdzv-timeout-s, the round fails and the job ends. When the job ends on the host, the
// nodes are told so, with the job's exit code: those waiting for a round on their new
// connection, the others (a node left out of the last rounds included) on the one they
// kept from the last round they were in, read when they next look for a round. A node whose proof of the
// secret is refused twice gives up at once. The host holds the rounds: if node 0 is lost, the other nodes
// cannot meet again and fail once --rdzv-timeout-s passes (as torchrun's c10d rendezvous, whose store lives
// on one node).

// Note [Growing an elastic job]
// A job below MAX nodes grows when a node arrives, as torchrun's elastic agent does. While
// every rank of its own runs, the host's launcher asks its rendezvous at each turn of its
// watch over them (RendezvousHost::grows): a connection waiting there is taken in as in a
// round (its proof of the secret and its hello, each within a second; a stranger is refused
// and logged) and kept for the next round. When one of them is a node that is not in the
// running start, the host tells the start's other nodes, on the connection each kept from
// the round, to regroup; each launcher stops its ranks (SIGTERM, SIGKILL after 5 s) and
// joins the next round, and the host stops its own half a second later, so that the others
// hear the word before their ranks fail on the lost peer. Once a launcher has the word, a
// rank that fails is taken to have failed on the regroup; a node whose ranks fail before
// the word reaches it waits 0.3 s for it before counting a failure; node 0, whose ranks
// may fail on the others' stop before its own, counts none unless they all finished by
// themselves (the job is then done, and the others, back at the rendezvous, are told so).
// The next round forms as any other, and the program resumes from its latest checkpoint at
// the larger world. A regroup is no failure: it spends no --max-restarts, and
// TORCHELASTIC_RESTART_COUNT, the host's count of starts after a failure that each node is
// told in its round's answer, does not count it (as torchrun's). A node that comes back after its own ranks
// failed (its id in the running start) is kept for the next round without a regroup, and waits for its answer
// as long as the host is there: that start is ending anyway.

// Thrown when `RendezvousOptions::stop` says to stop (the launcher got a signal).
struct RendezvousStopped {};

struct RendezvousOptions {
  std::string host;  // --master-addr
  int port = 0;      // --master-port
  int min_nodes = 1, max_nodes = 1;
  int node_id = 0;  // --node-rank: 0 hosts the rounds
  int nproc = 1;    // ranks on each node (every node runs as many)
  double wait_s = 10;
  double timeout_s = 600;
  std::string secret;  // FLATSHARD_JOB_SECRET
  // Asked at least every 200 ms while a round waits: true throws RendezvousStopped.
  std::function<bool()> stop;
};

// One node's place in a round.
struct Membership {
  int round = 0;
  int node_rank = 0;
  int nnodes = 1;
  int port = 0;               // the ranks' MASTER_PORT in this round
  int restarts = 0;           // the job's starts after a failure before this round's (the host's count)
  std::vector<int> node_ids;  // the ids of the round's nodes, by node rank
  // Set when the job ended on the host while this node waited: its exit code.
  std::optional<int> job_over;
};

// Node 0's side: binds host:port (on the loopback interface only when `host` is a loopback
// address) at construction, and serves every round through it.
class RendezvousHost {
 public:
  // Throws std::runtime_error naming the address when the port cannot be bound.
  explicit RendezvousHost(const RendezvousOptions& options);
  ~RendezvousHost();
  RendezvousHost(const RendezvousHost&) = delete;
  RendezvousHost& operator=(const RendezvousHost&) = delete;
  // Waits for the round's nodes (Note [Rounds of an elastic job]) and tells each its place.
  // Throws std::runtime_error when fewer than min_nodes arrive before timeout_s.
  // `restarts`: the job's starts after a failure so far, told to every node for its ranks.
  Membership next_round(int restarts);
  // Tells every node that was ever in a round (on its connection of the last round it was
  // in), and any node already waiting for another round, that the job ended with `code`.
  void finish(int code);
  // While a start of the nodes `running` runs (Note [Growing an elastic job]): takes in the
  // nodes waiting at the rendezvous, without blocking beyond one handshake each, and says
  // whether one of them would grow the job (not in `running`, fewer than max_nodes now).
  bool grows(const std::vector<int>& running);
  // Tells the running start's other nodes to stop their ranks and meet again.
  void regroup();

 private:
  struct State;
  std::unique_ptr<State> state_;
};

// Any other node's side. join() joins the next round at the host and returns this node's
// place in it. Throws std::runtime_error when the host refuses the node (an id taken or out
// of range, another number of ranks, a proof of the job secret it refused twice) or cannot
// be reached within timeout_s. The node keeps its connection of the last round it was in:
// the host says there when the job ends, so a node whose ranks fail after the host's job
// ended is told at once (Membership::job_over) instead of retrying until its timeout.
class RendezvousNode {
 public:
  explicit RendezvousNode(const RendezvousOptions& options);
  ~RendezvousNode();
  RendezvousNode(const RendezvousNode&) = delete;
  RendezvousNode& operator=(const RendezvousNode&) = delete;
  Membership join();
  // Whether the host said, on this node's connection of its last round, that the job grows
  // (Note [Growing an elastic job]); never blocks.
  bool regroup_requested();
  // The same, waiting up to `wait` for the word.
  bool await_regroup(std::chrono::milliseconds wait);

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace flatshard::launcher
