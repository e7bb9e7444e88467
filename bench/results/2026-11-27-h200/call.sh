#!/usr/bin/env bash
# One GPU run on an H200 (a rerun with the build kept runs
# what the environment selects): build; every GPU test at worlds 1-4 over NCCL with freed
# buffers poisoned (TESTS=0 skips it); over NCCL at world 2 (each rank its own NCCL host
# id) on the six-block model: FlatShard full shard against FSDP2 eager and with compiled
# blocks, FlatShard's DDP against PyTorch DDP (W2=0 skips them); the same at world 3
# (W3=1 runs them); at world 1, batch 2 and 8, FlatShard full shard against FSDP2 and the
# unwrapped model (SWEEP="" skips it). Each run starts only while BUDGET_S allows.
source "$(dirname "$0")/../../gpu_call_lib.sh"
if [[ "${TESTS:-1}" == 1 ]]; then
  FLATSHARD_TEST_NCCL_HOST_PER_RANK=1 FLATSHARD_POISON_FREED=1 timeout -k 5 300 \
    build-gpu/flatshard_cuda_tests --gtest_brief=1 > "$OUT/tests_nccl_worlds.log" 2>&1
  echo "tests rc $?"; grep -E "^\[  (PASSED|FAILED) |tests? ran" "$OUT/tests_nccl_worlds.log" | grep -v "^\[rank"
  stamp "tests done"
fi
wn=(--layers 6 --warmup 2 --steps 8)
for w in $([[ "${W2:-1}" == 1 ]] && echo 2) $([[ "${W3:-0}" == 1 ]] && echo 3); do
  fs 50 "$w" "${wn[@]}" --tag "w$w"; py 50 "$w" "${wn[@]}" --tag "w$w" --mode fsdp2
  py 120 "$w" "${wn[@]}" --tag "w$w" --mode fsdp2 --compile 1
  fs 50 "$w" "${wn[@]}" --tag "w$w" --mode ddp; py 50 "$w" "${wn[@]}" --tag "w$w" --mode ddp
  stamp "world $w done"
done
w1=(--warmup 5 --steps 50)
for b in ${SWEEP-2 8}; do
  fs 30 1 "${w1[@]}" --batch "$b" --tag "b$b"; py 30 1 "${w1[@]}" --batch "$b" --tag "b$b" --mode fsdp2
  py 30 1 "${w1[@]}" --batch "$b" --tag "b$b" --mode plain
done
print_table
