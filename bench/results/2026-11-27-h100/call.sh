#!/usr/bin/env bash
# One GPU run (a rerun with the build kept runs what the
# environment selects: W1_ROUNDS, W3, W3_ROUNDS, B1, W2C, SWEEP): build; at world 1 FlatShard full
# shard against plain PyTorch (no wrapper, eager) and FSDP2, alternating, 5 warm-up and
# 50 timed steps; at world 3 over NCCL (each rank its own NCCL host id) full shard against
# FSDP2 on a 6-block model; FSDP2 at batch 1; at world 2 over NCCL full shard against
# FSDP2 eager and with compiled blocks; a batch sweep. Each run starts only while BUDGET_S
# allows.
source "$(dirname "$0")/../../gpu_call_lib.sh"
w1=(--warmup 5 --steps 50)
for ((r = 0; r < ${W1_ROUNDS:-5}; ++r)); do
  fs 30 1 "${w1[@]}"; py 30 1 "${w1[@]}" --mode plain; py 30 1 "${w1[@]}" --mode fsdp2
done
stamp "world 1 rounds done"
wn=(--layers 6 --warmup 2 --steps 8)
if [[ "${W3:-1}" == 1 ]]; then
  for ((r = 0; r < ${W3_ROUNDS:-1}; ++r)); do
    fs 60 3 "${wn[@]}" --tag w3; py 60 3 "${wn[@]}" --tag w3 --mode fsdp2
  done
  stamp "world 3 done"
fi
if [[ "${B1:-1}" == 1 ]]; then
  py 30 1 "${w1[@]}" --batch 1 --tag b1 --mode fsdp2; fs 30 1 "${w1[@]}" --batch 1 --tag b1
  stamp "batch 1 done"
fi
if [[ "${W2C:-1}" == 1 ]]; then
  fs 60 2 "${wn[@]}" --tag w2; py 60 2 "${wn[@]}" --tag w2 --mode fsdp2
  py 120 2 "${wn[@]}" --tag w2 --mode fsdp2 --compile 1
  stamp "world 2 done"
fi
for b in ${SWEEP-2 8}; do
  fs 30 1 "${w1[@]}" --batch "$b" --tag "b$b"; py 30 1 "${w1[@]}" --batch "$b" --tag "b$b" --mode plain
  py 30 1 "${w1[@]}" --batch "$b" --tag "b$b" --mode fsdp2
done
print_table
