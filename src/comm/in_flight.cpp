#include "src/comm/in_flight.h"

#include <cstdlib>
#include <cstring>

#include "src/comm/backend.h"

namespace flatshard::comm {
namespace {

std::pair<std::uintptr_t, std::uintptr_t> range_of(const at::Tensor& t) {
  const auto begin = reinterpret_cast<std::uintptr_t>(t.data_ptr());
  return {begin, begin + t.nbytes()};
}

}  // namespace

InFlightBuffers& InFlightBuffers::instance() {
  // Never destroyed: device memory must not be freed after the device runtime is gone.
  static auto* buffers = new InFlightBuffers();
  return *buffers;
}

std::vector<InFlightBuffers::Entry> InFlightBuffers::prune_locked() {
  std::vector<Entry> gone;
  for (std::size_t i = 0; i < entries_.size();) {
    auto done = entries_[i].done.lock();
    if (done && !done->query()) {
      ++i;
      continue;
    }
    gone.push_back(std::move(entries_[i]));
    entries_[i] = std::move(entries_.back());
    entries_.pop_back();
  }
  return gone;
}

void InFlightBuffers::track(const std::shared_ptr<DeviceEvent>& done, const Collective& op) {
  Entry e;
  e.done = done;
  e.key = done.get();
  for (const at::Tensor* t : {&op.input, &op.output}) {
    if (!t->defined() || t->nbytes() == 0) continue;
    e.ranges.push_back(range_of(*t));
    e.tensors.push_back(*t);
  }
  if (e.ranges.empty()) return;
  std::vector<Entry> gone;
  std::lock_guard<std::mutex> lock(mutex_);
  gone = prune_locked();
  entries_.push_back(std::move(e));
  // `gone` is destroyed after the lock is released (declared before the guard).
}

void InFlightBuffers::waited(const DeviceEvent* done) {
  std::vector<Entry> gone;
  std::lock_guard<std::mutex> lock(mutex_);
  for (std::size_t i = 0; i < entries_.size(); ++i) {
    if (entries_[i].key != done) continue;
    gone.push_back(std::move(entries_[i]));
    entries_[i] = std::move(entries_.back());
    entries_.pop_back();
    break;
  }
}

void InFlightBuffers::retire(c10::DataPtr data, std::size_t bytes) {
  const auto begin = reinterpret_cast<std::uintptr_t>(data.get());
  const auto end = begin + bytes;
  std::vector<Entry> gone;
  std::lock_guard<std::mutex> lock(mutex_);
  gone = prune_locked();
  for (auto& e : entries_) {
    for (const auto& [b, f] : e.ranges) {
      if (b < end && begin < f) {
        e.retired.push_back(std::move(data));
        return;
      }
    }
  }
  // Not covered: `data` is freed when this returns, after the lock.
}

void InFlightBuffers::release_completed() {
  std::vector<Entry> gone;
  std::lock_guard<std::mutex> lock(mutex_);
  gone = prune_locked();
}

std::size_t InFlightBuffers::tracked() {
  std::lock_guard<std::mutex> lock(mutex_);
  return entries_.size();
}

bool poison_freed() {
  // Read at every free (a few per unit and step), so that a program can switch it.
  const char* v = std::getenv("FLATSHARD_POISON_FREED");
  return v != nullptr && std::strcmp(v, "") != 0 && std::strcmp(v, "0") != 0;
}

}  // namespace flatshard::comm
