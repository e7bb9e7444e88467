#include "src/comm/in_flight.h"

#include <ATen/ATen.h>

#include <cstdlib>
#include <cstring>
#include <set>

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
    if (!entries_[i].done->query()) {
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
  for (const at::Tensor* t : {&op.input, &op.output}) {
    if (!t->defined() || t->nbytes() == 0) continue;
    e.ranges.push_back(range_of(*t));
    e.tensors.push_back(*t);
  }
  for (const Event& before : op.after) {
    if (auto d = before.device()) e.after.push_back(std::move(d));
  }
  if (e.ranges.empty() && e.after.empty()) return;
  std::vector<Entry> gone;
  std::lock_guard<std::mutex> lock(mutex_);
  gone = prune_locked();
  entries_.push_back(std::move(e));
  // `gone` is destroyed after the lock is released (declared before the guard).
}

void InFlightBuffers::waited(const DeviceEvent* done) {
  std::vector<Entry> gone;
  std::lock_guard<std::mutex> lock(mutex_);
  // The caller's stream is ordered after `done`, and so after every op `done`'s op waited
  // for on the device (CollectiveOptions::wait_for: hybrid's all-reduce after its
  // reduce-scatter), and so on back.
  std::set<const DeviceEvent*> ordered{done};
  for (bool found = true; found;) {
    found = false;
    for (std::size_t i = 0; i < entries_.size();) {
      if (!ordered.count(entries_[i].done.get())) {
        ++i;
        continue;
      }
      for (const auto& a : entries_[i].after) ordered.insert(a.get());
      gone.push_back(std::move(entries_[i]));
      entries_[i] = std::move(entries_.back());
      entries_.pop_back();
      found = true;
    }
  }
}

void InFlightBuffers::retire(c10::DataPtr data, std::size_t bytes, bool poison) {
  const auto begin = reinterpret_cast<std::uintptr_t>(data.get());
  const auto end = begin + bytes;
  std::vector<Entry> gone;
  std::shared_ptr<c10::DataPtr> shared;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    gone = prune_locked();
    for (auto& e : entries_) {
      for (const auto& [b, f] : e.ranges) {
        if (b < end && begin < f) {
          // Every op still using the bytes holds them: they go with the last to finish.
          if (!shared) shared = std::make_shared<c10::DataPtr>(std::move(data));
          e.retired.push_back(shared);
          break;
        }
      }
    }
  }
  if (shared || !poison || bytes == 0) return;
  // Not covered by any op: poisoned on the caller's stream, then freed (after the lock).
  at::from_blob(data.get(), {static_cast<std::int64_t>(bytes)},
                at::TensorOptions().dtype(at::kByte).device(data.device()))
      .fill_(0xFF);
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
