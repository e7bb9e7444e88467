#include "flatshard/join.h"

#include <ATen/ATen.h>

#include <fmt/format.h>

#include "flatshard/errors.h"

namespace flatshard {

bool Join::step(bool have_data) {
  // A rank with data again after it joined is refused on every rank, through the count:
  // thrown here alone, it would leave the others waiting in the all-reduce until the
  // communicator's timeout.
  const bool again = have_data && joined_;
  if (!have_data && !joined_) {
    joined_ = true;
    joined_at_ = steps_;
  }
  // On the communicator's device (a CUDA wrapper's communicator takes no host tensor).
  auto count = at::tensor({have_data && !again ? 1 : 0, again ? 1 : 0}, at::TensorOptions().dtype(at::kInt))
                   .to(comm_.device());
  comm_.all_reduce(count, ReduceOp::Sum).wait();
  count = count.cpu();
  if (again) {
    throw InvalidArgument(
        fmt::format("flatshard::Join::step (rank {}/{}): this rank had no data at step {} and has data again "
                    "at step {}; a rank joins once: stop giving it batches after its first step without one",
                    comm_.rank(), comm_.world_size(), joined_at_, steps_));
  }
  if (count[1].item<int>() > 0) {
    throw InvalidArgument(fmt::format(
        "flatshard::Join::step (rank {}/{}): another rank had data again at step {} after it joined (its "
        "error names it); a rank joins once",
        comm_.rank(), comm_.world_size(), steps_));
  }
  active_ = count[0].item<int>();
  if (active_ == 0) return false;
  ++steps_;
  return true;
}

}  // namespace flatshard
