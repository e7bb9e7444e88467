#include <atomic>
#include <mutex>
#include <unordered_map>

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include "flatshard/memory.h"

namespace flatshard::memory {
namespace {

// Wraps the CPU allocator that was in place. LibTorch's raw_allocate() needs data ptr
// == context and a raw deleter, so the size (and the base allocator's own DataPtr, which
// frees the memory) are kept in a table keyed by the pointer.
class CountingAllocator final : public c10::Allocator {
 public:
  explicit CountingAllocator(c10::Allocator* base) : base_(base) {}

  c10::DataPtr allocate(std::size_t bytes) override {
    c10::DataPtr inner = base_->allocate(bytes);
    void* data = inner.get();
    const auto device = inner.device();
    if (data == nullptr) return inner;  // zero bytes: nothing to count
    {
      std::lock_guard<std::mutex> lock(table_mutex_);
      table_.emplace(data, Entry{std::move(inner), static_cast<std::int64_t>(bytes)});
    }
    add(static_cast<std::int64_t>(bytes));
    allocations_.fetch_add(1, std::memory_order_relaxed);
    return c10::DataPtr(data, data, &CountingAllocator::release, device);
  }

  c10::DeleterFnPtr raw_deleter() const override { return &CountingAllocator::release; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    base_->copy_data(dest, src, count);
  }

  AllocatorStats stats() const { return {true, current_.load(), peak_.load(), allocations_.load()}; }
  void reset_peak() { peak_.store(current_.load()); }

  static CountingAllocator* instance;

 private:
  struct Entry {
    c10::DataPtr inner;  // frees the memory through the base allocator's deleter
    std::int64_t bytes;
  };

  static void release(void* data) {
    CountingAllocator* self = instance;
    Entry entry;
    {
      std::lock_guard<std::mutex> lock(self->table_mutex_);
      auto it = self->table_.find(data);
      if (it == self->table_.end()) return;
      entry = std::move(it->second);
      self->table_.erase(it);
    }
    self->add(-entry.bytes);
  }  // entry.inner frees the memory here

  void add(std::int64_t delta) {
    const std::int64_t now = current_.fetch_add(delta) + delta;
    std::int64_t peak = peak_.load();
    while (now > peak && !peak_.compare_exchange_weak(peak, now)) {
    }
  }

  c10::Allocator* base_;
  std::mutex table_mutex_;
  std::unordered_map<void*, Entry> table_;  // guarded by table_mutex_
  std::atomic<std::int64_t> current_{0};
  std::atomic<std::int64_t> peak_{0};
  std::atomic<std::int64_t> allocations_{0};
};

CountingAllocator* CountingAllocator::instance = nullptr;

std::mutex g_mutex;
CountingAllocator* g_allocator = nullptr;  // never freed: tensors may outlive everything

}  // namespace

void install_counting_allocator() {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (g_allocator != nullptr) return;
  g_allocator = new CountingAllocator(c10::GetCPUAllocator());
  CountingAllocator::instance = g_allocator;
  c10::SetCPUAllocator(g_allocator, /*priority=*/100);
}

AllocatorStats allocator_stats() {
  std::lock_guard<std::mutex> lock(g_mutex);
  return g_allocator ? g_allocator->stats() : AllocatorStats{};
}

void reset_allocator_peak() {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (g_allocator) g_allocator->reset_peak();
}

namespace {
std::atomic<std::int64_t (*)(int)> cuda_total_query{nullptr};
}  // namespace

std::int64_t cuda_total_bytes(int device) {
  auto* query = cuda_total_query.load();
  return query ? query(device) : 0;
}

void detail::set_cuda_total_bytes(std::int64_t (*query)(int device)) { cuda_total_query.store(query); }

}  // namespace flatshard::memory
