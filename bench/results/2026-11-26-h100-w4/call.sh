#!/usr/bin/env bash
# One GPU run (run twice: the second, with the build kept, runs
# what the environment selects: STUCK, W1_ROUNDS_A, W4, COMPILED, W1_ROUNDS_B, SWEEP): build; the stuck-rank test over NCCL
# at world 2; at world 1 FlatShard full shard against plain PyTorch (no wrapper, eager)
# and FSDP2, alternating, 5 warm-up and 50 timed steps; at world 4 over NCCL (each rank
# its own NCCL host id) full shard against FSDP2 and DDP against PyTorch DDP on a 6-block
# model; the compiled peers; a batch sweep. Each run starts only while BUDGET_S allows.
source "$(dirname "$0")/../../gpu_call_lib.sh"
if [[ "${STUCK:-1}" == 1 ]]; then
  for i in 1 2; do
    timeout -k 5 90 env NCCL_DEBUG=WARN FLATSHARD_TEST_OUTPUT=1 FLATSHARD_TEST_NCCL_HOST_PER_RANK=1 \
      FLATSHARD_POISON_FREED=1 build-gpu/flatshard_cuda_tests --gtest_filter='CudaFailures.*' 2>&1 \
      | tee -a "$OUT/stuck.log" | grep -E "OK|FAILED|PASSED|Failure|rank .: the all-reduce|all_reduce #" | head -12
  done
  stamp "stuck-rank test done"
fi
w1=(--warmup 5 --steps 50)
for ((r = 0; r < ${W1_ROUNDS_A:-2}; ++r)); do
  fs 30 1 "${w1[@]}"; py 30 1 "${w1[@]}" --mode plain; py 30 1 "${w1[@]}" --mode fsdp2
done
stamp "world 1, first rounds done"
w4=(--layers 6 --warmup 2 --steps 8 --tag w4)
if [[ "${W4:-1}" == 1 ]]; then
  fs 70 4 "${w4[@]}"; py 70 4 "${w4[@]}" --mode fsdp2
  fs 70 4 "${w4[@]}" --mode ddp; py 70 4 "${w4[@]}" --mode ddp
  stamp "world 4 done"
fi
if [[ "${COMPILED:-1}" == 1 ]]; then
  py 100 1 "${w1[@]}" --mode plain --compile 1; py 100 1 "${w1[@]}" --mode fsdp2 --compile 1
  stamp "compiled peers done"
fi
for ((r = 0; r < ${W1_ROUNDS_B:-3}; ++r)); do
  fs 30 1 "${w1[@]}"; py 30 1 "${w1[@]}" --mode plain; py 30 1 "${w1[@]}" --mode fsdp2
done
stamp "world 1, last rounds done"
for b in ${SWEEP-1 2 8 16}; do
  fs 30 1 "${w1[@]}" --batch "$b" --tag "b$b"; py 30 1 "${w1[@]}" --batch "$b" --tag "b$b" --mode plain
  py 30 1 "${w1[@]}" --batch "$b" --tag "b$b" --mode fsdp2
done
print_table
