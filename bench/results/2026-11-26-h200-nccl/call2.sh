#!/usr/bin/env bash
# Second run: rebuild, the stuck-rank test with NCCL's warnings, then a second world-2 pair.
set -o pipefail
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
t0=$SECONDS
FLATSHARD_GPU_BUILD_ONLY=1 scripts/gpu.sh 2>&1 | tail -20
echo "build done at $((SECONDS - t0)) s"
for i in 1 2; do
  timeout -k 5 60 env NCCL_DEBUG=WARN FLATSHARD_TEST_OUTPUT=1 FLATSHARD_TEST_NCCL_HOST_PER_RANK=1 FLATSHARD_POISON_FREED=1 \
    build-gpu/flatshard_cuda_tests --gtest_filter='CudaFailures.*' 2>&1 | tee -a "$OUT/stuck.log" | grep -v "^\[rank .\] *$" | tail -25
done
echo "tests done at $((SECONDS - t0)) s"
csv="$OUT/gpt_gpu.csv"
echo "impl,params,tokens_per_s,mfu,peak_gib,reserved_gib,retries,step_ms,comm_wait" > "$csv"
if (( SECONDS - t0 < 90 )); then
  timeout -k 5 75 build-gpu/flatshard-run -n 2 --nccl-host-per-rank --deadline-s 70 build-gpu/bench_gpt_gpu \
    --csv "$csv" --tag w2 2>&1 | tee -a "$OUT/bench_flatshard.log" | tail -3
fi
if (( SECONDS - t0 < 150 )); then
  (cd bench && timeout -k 5 80 python3 -m torch.distributed.run --standalone --nproc-per-node 2 peer_fsdp2_gpu.py \
    --nccl-host-per-rank --csv "$csv" --mode fsdp2 --tag w2) 2>&1 | grep -v "OMP_NUM\|^\*\*\*" \
    | tee -a "$OUT/bench_fsdp2.log" | tail -3
fi
cat "$csv"; echo "done at $((SECONDS - t0)) s"
