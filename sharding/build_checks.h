// Whether a unit being built into shards fits the memory budget and its device.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace flatshard::sharding {

struct UnitFit {
  std::string unit;                     // how errors name it
  std::int64_t unit_bytes = 0;          // its parameters at full size, as built
  std::int64_t shard_bytes_before = 0;  // the shards this rank built before it
  std::int64_t budget = 0;              // MemoryBudget::bytes; 0: none
  std::int64_t gathered_bytes = 0;      // its gathered buffer and gradient, on the device
  std::string device;
  std::int64_t device_bytes = 0;  // the device's total memory; 0: not checked
};

struct Misfit {
  std::string why;  // what does not fit and what to change, in words
  std::int64_t need = 0;
  std::int64_t limit = 0;  // the budget or the device's memory
};

// Why the unit cannot be built and trained, or nothing.
std::optional<Misfit> unit_does_not_fit(const UnitFit& fit);

}  // namespace flatshard::sharding
