#include "src/comm/launch_order.h"

#include "src/comm/per_device.h"

namespace flatshard::comm {

LaunchOrder& LaunchOrder::for_device(int device) { return one_per_device<LaunchOrder>(device); }

std::uint64_t LaunchOrder::take() {
  std::lock_guard<std::mutex> lock(mutex_);
  return issued_++;
}

bool LaunchOrder::wait_turn(std::uint64_t ticket, std::chrono::steady_clock::time_point deadline,
                            const std::function<bool()>& stop) {
  std::unique_lock<std::mutex> lock(mutex_);
  while (next_ != ticket) {
    if (ticket < next_) return true;  // finished out of turn before: nothing waits for it
    if (stop && stop()) return false;
    if (std::chrono::steady_clock::now() >= deadline) return false;
    cv_.wait_for(lock, std::chrono::milliseconds(5));
  }
  return true;
}

void LaunchOrder::finish(std::uint64_t ticket) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (ticket < next_) return;
    early_.insert(ticket);
    while (!early_.empty() && *early_.begin() == next_) {
      early_.erase(early_.begin());
      ++next_;
    }
  }
  cv_.notify_all();
}

std::uint64_t LaunchOrder::next() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return next_;
}

}  // namespace flatshard::comm
