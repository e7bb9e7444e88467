// Uneven inputs: ranks with different numbers of batches train to the end of the longest
// without hanging (PyTorch's Join context manager for DDP and ZeroRedundancyOptimizer).
//
//   flatshard::Join join(fsdp.comm());
//   auto it = batches.begin();
//   while (join.step(it != batches.end())) {        // every rank, every step
//     const Batch& b = join.joined() ? batches.back() : *it++;
//     auto loss = criterion(fsdp.forward(b.x), b.y) * join.scale();   // 0 once joined
//     loss.backward(); opt.step(); opt.zero_grad();
//   }
//
// A rank that is out of data keeps running steps with a zero loss: its forward, backward
// and optimizer step issue every collective the others wait for (gathers, bucket
// reductions, ZeRO-1's and the sharded strategies' parameter gathers), and its gradient
// contribution is zero. Gradients stay divided by the world size, so a step in which k
// of N ranks have data averages their gradients over N (PyTorch's default,
// divide_by_initial_world_size=True); scale the loss by N / active_ranks() for the mean
// over the ranks with data instead. Works in every strategy. See docs/communication.md.
#pragma once

#include <cstdint>

#include "flatshard/communicator.h"

namespace flatshard {

class Join {
 public:
  explicit Join(Communicator& comm) : comm_(comm) {}

  // Called by every rank before each step with whether it has a batch for it; false once
  // no rank has one (then every rank leaves its loop at the same step). A rank that said
  // it had none may not have one again (InvalidArgument naming it). A collective: one
  // all-reduce of one integer.
  bool step(bool have_data);
  bool joined() const { return joined_; }
  // 1 while this rank has data, 0 once it joined: what its loss is multiplied by.
  double scale() const { return joined_ ? 0.0 : 1.0; }
  int active_ranks() const { return active_; }           // ranks with data in this step
  std::int64_t steps() const { return steps_; }          // steps begun so far
  std::int64_t joined_at() const { return joined_at_; }  // this rank's first step without data; -1

 private:
  Communicator& comm_;
  bool joined_ = false;
  int active_ = 0;
  std::int64_t steps_ = 0;
  std::int64_t joined_at_ = -1;
};

}  // namespace flatshard
