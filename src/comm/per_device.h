// One object of a kind per device index, made on first use and kept for the process's life.
#pragma once

#include <map>
#include <memory>
#include <mutex>

namespace flatshard::comm {

// The `T` of device `device`. Never destroyed: worker threads may still use it while the
// process exits.
template <typename T>
T& one_per_device(int device) {
  static std::mutex mutex;
  static auto* all = new std::map<int, std::unique_ptr<T>>();
  std::lock_guard<std::mutex> lock(mutex);
  auto& one = (*all)[device];
  if (!one) one = std::make_unique<T>();
  return *one;
}

}  // namespace flatshard::comm
