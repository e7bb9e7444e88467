// An outside project: links flatshard::flatshard from the installed tree and runs a
// one-rank world.
#include <cstdio>

#include <ATen/ATen.h>
#include <flatshard/flatshard.h>

int main() {
  auto world = flatshard::init();
  auto comm = flatshard::Communicator::create(world);
  auto t = at::arange(10, at::kFloat);
  comm->all_reduce(t, flatshard::ReduceOp::Sum).wait();
  const bool ok = world.world_size() == 1 && at::equal(t, at::arange(10, at::kFloat)) &&
                  flatshard::shard_range(10, 4, 3).numel == 2;
  std::printf("consumer: %s\n", ok ? "ok" : "WRONG");
  return ok ? 0 : 1;
}
