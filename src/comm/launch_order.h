// One order for launching collectives on a device, the same on every rank.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <set>

namespace flatshard::comm {

// Note [One launch order per device]
// NCCL runs each communicator's kernels on the device and documents two rules for
// several communicators on one device: operations must not be issued to them from
// several threads at once, and every rank must issue them in the same order, or the
// kernels of one communicator can wait on the SMs for peers that are waiting in another
// communicator's kernel (a deadlock across ranks). The NCCL transport has one
// communicator per stream role, each launched from its role's worker thread, and hybrid
// sharding adds a second transport (the replica groups') on the same device: three to
// six communicators, as many threads.
//
// The engine issues every collective from one logical thread of control: forward on the
// caller's thread, backward's hooks on the autograd thread while the caller waits in
// backward(), both under Engine::hooks_mutex_, and the optimizer's gathers after
// backward returned. Its issue order is therefore its program order, which is the same
// on every rank (every rank runs the same schedule over the same units: ops differ only
// in their bytes). A ticket taken when the op is issued (Backend::issue, on the issuing
// thread) carries that order to the workers, and each worker launches only when its
// ticket is next: the launches of all communicators of a device follow one order, the
// same on every rank, one at a time. Launching is asynchronous (a few microseconds), so
// the streams still overlap on the device; only the host-side launches are serialized.
//
// The order the kernels then start in on the device is not the launch order: a collective
// whose stream first waits on an event (a gather behind the compute that frees its buffer)
// may start after a later launch on another stream on one rank and before it on another.
// That cannot deadlock while the kernels of the device's communicators can all be resident
// at once: each NCCL kernel occupies a few SMs per channel, so a kernel waiting for its
// peers leaves room for the other communicators' kernels, and every collective completes
// once each rank has started it. Two settings take that room away, and then the device
// order must be the same on every rank: CUDA_DEVICE_MAX_CONNECTIONS=1 (every stream's
// kernels in one hardware queue, which is then in launch order, the same on every rank:
// safe) and communicators whose channels together exceed the SMs (many communicators, or
// NCCL_MIN_NCHANNELS raised). For the latter NCCL 2.26 and later offer
// NCCL_LAUNCH_ORDER_IMPLICIT=1, which starts the kernels of all communicators of a device
// in their launch order (the order above), at the cost of their overlap; FlatShard does not
// set it (docs/cuda.md says when to).
//
// A ticket that will never launch (its op failed, or its transport was aborted) is
// finished all the same, so that later tickets are not held up by it.
class LaunchOrder {
 public:
  // The order for CUDA device `device` (one per device and process).
  static LaunchOrder& for_device(int device);

  // The next ticket, in issue order.
  std::uint64_t take();
  // Blocks until `ticket` is next. Returns false (without taking the turn) when `stop`
  // says so or `deadline` passes first; `stop` is polled every few milliseconds.
  bool wait_turn(std::uint64_t ticket, std::chrono::steady_clock::time_point deadline,
                 const std::function<bool()>& stop);
  // The ticket is done: launched, or never to be launched. Idempotent per ticket.
  void finish(std::uint64_t ticket);
  // The ticket whose turn it is (for tests and messages).
  std::uint64_t next() const;

 private:
  mutable std::mutex mutex_;
  std::condition_variable cv_;
  std::uint64_t issued_ = 0;       // guarded by mutex_: tickets handed out
  std::uint64_t next_ = 0;         // guarded by mutex_: the ticket whose turn it is
  std::set<std::uint64_t> early_;  // guarded by mutex_: finished out of turn
};

// Holds a ticket's turn for a scope: finishes the ticket when it ends, launched or not.
class LaunchTurn {
 public:
  LaunchTurn(LaunchOrder& order, std::uint64_t ticket) : order_(order), ticket_(ticket) {}
  ~LaunchTurn() { order_.finish(ticket_); }
  LaunchTurn(const LaunchTurn&) = delete;
  LaunchTurn& operator=(const LaunchTurn&) = delete;

 private:
  LaunchOrder& order_;
  std::uint64_t ticket_;
};

}  // namespace flatshard::comm
