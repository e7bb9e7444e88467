// Note [Communication wait]: the clock a communicator's Works time their waits with.
// Internal to the communicator.
#pragma once

#include <cstdint>
#include <deque>
#include <mutex>

#include <c10/core/Device.h>
#include <c10/core/Event.h>

#include "flatshard/communicator.h"

namespace flatshard::comm {

class WaitClock {
 public:
  explicit WaitClock(c10::Device device) : device_(device) {}

  // Waits for `event` as Event::wait() does, timing the stall.
  void wait(const Event& event);
  // Every timed wait so far; on a device, blocks until their timing events have passed.
  CommunicationWait total();
  void reset();

 private:
  // A wait on a device stream: timing events recorded on it just before and after.
  struct DeviceWait {
    c10::Event before;
    c10::Event after;
  };
  // Adds the device waits whose `after` has passed (all of them when `block`).
  void resolve(bool block);

  const c10::Device device_;
  std::mutex mutex_;
  CommunicationWait total_;            // guarded by mutex_
  std::deque<DeviceWait> unresolved_;  // guarded by mutex_; in the order recorded
};

}  // namespace flatshard::comm
