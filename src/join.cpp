#include "flatshard/join.h"

#include <ATen/ATen.h>

#include <fmt/format.h>

#include "flatshard/errors.h"

namespace flatshard {

bool Join::step(bool have_data) {
  if (have_data && joined_) {
    throw InvalidArgument(
        fmt::format("flatshard::Join::step (rank {}/{}): this rank had no data at step {} and has data again "
                    "at step {}; a "
                    "rank joins once: stop giving it batches after its first step without one",
                    comm_.rank(), comm_.world_size(), joined_at_, steps_));
  }
  if (!have_data && !joined_) {
    joined_ = true;
    joined_at_ = steps_;
  }
  auto count = at::full({1}, have_data ? 1 : 0, at::kInt);
  comm_.all_reduce(count, ReduceOp::Sum).wait();
  active_ = count.item<int>();
  if (active_ == 0) return false;
  ++steps_;
  return true;
}

}  // namespace flatshard
