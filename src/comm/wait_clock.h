// Note [Communication wait]: the clock a communicator's Works time their waits with.
// Internal to the communicator.
#pragma once

#include <cstdint>
#include <deque>
#include <mutex>
#include <string>
#include <vector>

#include <c10/core/Device.h>
#include <c10/core/Event.h>

#include "flatshard/communicator.h"

namespace flatshard::comm {

class WaitClock {
 public:
  // `name`: the communicator's, for the debug log's lines of stalled waits.
  WaitClock(c10::Device device, std::string name) : device_(device), name_(std::move(name)) {}

  // Waits for `event`, the completion of op `seq`, as Event::wait() does, timing the stall.
  void wait(const Event& event, std::uint64_t seq);
  // Every timed wait so far; on a device, blocks until their timing events have passed.
  CommunicationWait total();
  void reset();

  // Note [Waiting for peers]: on the CPU, while waits are timed, when this rank issued
  // each op and the span of each stalled wait, on the host's steady clock.
  struct Stall {
    std::uint64_t seq;
    std::int64_t start_ns;
    std::int64_t end_ns;
  };
  struct Trace {
    std::uint64_t first_seq = 0;          // the first op issued since the reset (0: none)
    std::vector<std::int64_t> issued_ns;  // issued_ns[i]: op first_seq + i
    std::vector<Stall> stalls;
    const char* broken = nullptr;  // why the trace stopped, if it did
  };
  static constexpr std::size_t kMaxTraced = std::size_t{1} << 18;
  // Op `seq` is being issued (in sequence order, from the issuing thread).
  void issued(std::uint64_t seq);
  // The trace and total(), read together (CPU only: no device waits to resolve).
  struct Snapshot {
    CommunicationWait total;
    Trace trace;
  };
  Snapshot snapshot();

 private:
  // A wait on a device stream: timing events recorded on it just before and after.
  struct DeviceWait {
    c10::Event before;
    c10::Event after;
  };
  // Adds the device waits whose `after` has passed (all of them when `block`).
  void resolve(bool block);

  const c10::Device device_;
  const std::string name_;
  std::mutex mutex_;
  CommunicationWait total_;            // guarded by mutex_
  std::deque<DeviceWait> unresolved_;  // guarded by mutex_; in the order recorded
  Trace trace_;                        // guarded by mutex_; CPU only
};

}  // namespace flatshard::comm
