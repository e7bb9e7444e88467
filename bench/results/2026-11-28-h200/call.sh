#!/usr/bin/env bash
# One GPU run on an H200 (a rerun with the build kept runs
# what the environment selects): build; every GPU test at worlds 1-4 over NCCL with freed
# buffers poisoned, HybridShard with a bf16 hook among them (TESTS=0 skips it); then
# ROUNDS alternating rounds (default 5) at world 2 over NCCL (each rank its own NCCL host
# id) on the six-block model: FlatShard full shard, FSDP2 eager, FlatShard DDP, PyTorch
# DDP; DIAG=1 adds FSDP2 with compiled blocks and eager at world 1 (batch 4), the compiled
# run with TORCH_LOGS=graph_breaks,recompiles. Each run starts only while BUDGET_S allows.
source "$(dirname "$0")/../../gpu_call_lib.sh"
if [[ "${TESTS:-1}" == 1 ]]; then
  FLATSHARD_TEST_NCCL_HOST_PER_RANK=1 FLATSHARD_POISON_FREED=1 timeout -k 5 330 \
    build-gpu/flatshard_cuda_tests --gtest_brief=1 > "$OUT/tests_nccl_worlds.log" 2>&1
  echo "tests rc $?"; grep -E "^\[  (PASSED|FAILED) |tests? ran|Failure|FAILED" "$OUT/tests_nccl_worlds.log" | grep -v "^\[rank" | head -30
  stamp "tests done"
fi
if [[ "${DIAG:-0}" == 1 ]]; then
  w1=(--warmup 5 --steps 50 --batch 4)
  TORCH_LOGS="graph_breaks,recompiles" py 100 1 "${w1[@]}" --tag diag --mode fsdp2 --compile 1
  py 40 1 "${w1[@]}" --tag diag --mode fsdp2
fi
wn=(--layers 6 --warmup 2 --steps 8 --tag w2)
for ((r = 0; r < ${ROUNDS:-5}; ++r)); do
  fs 40 2 "${wn[@]}"; py 40 2 "${wn[@]}" --mode fsdp2
  fs 40 2 "${wn[@]}" --mode ddp; py 40 2 "${wn[@]}" --mode ddp
  stamp "round $((r + 1)) done"
done
print_table
