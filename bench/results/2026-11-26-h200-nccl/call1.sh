#!/usr/bin/env bash
# First run: build, every GPU test at worlds 1-4 over NCCL (freed buffers poisoned),
# then, if under BENCH_BEFORE_S seconds so far, world 2 over NCCL: FlatShard full shard and DDP against FSDP2 and DDP.
set -o pipefail
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
t0=$SECONDS
FLATSHARD_GPU_BUILD_ONLY=1 scripts/gpu.sh 2>&1 | tail -20
echo "build done at $((SECONDS - t0)) s"
ls build-gpu/flatshard_cuda_tests || exit 1
nvidia-smi -L
timeout -k 10 "${TEST_S:-300}" env FLATSHARD_TEST_NCCL_HOST_PER_RANK=1 FLATSHARD_POISON_FREED=1 \
  build-gpu/flatshard_cuda_tests 2>&1 | tee "$OUT/tests_nccl_worlds.log" \
  | grep -E "^\[ +(OK|FAILED|PASSED) +\]|^\[==|Failure|what\(\)|error:|Error" | head -120
echo "tests rc=${PIPESTATUS[0]} done at $((SECONDS - t0)) s"
csv="$OUT/gpt_gpu.csv"
echo "impl,params,tokens_per_s,mfu,peak_gib,reserved_gib,retries,step_ms,comm_wait" > "$csv"
for mode in full ddp; do
  peer=$mode; [[ $mode == full ]] && peer=fsdp2
  if (( SECONDS - t0 < ${BENCH_BEFORE_S:-420} )); then
    timeout -k 5 100 build-gpu/flatshard-run -n 2 --nccl-host-per-rank --deadline-s 90 build-gpu/bench_gpt_gpu \
      --csv "$csv" --mode $mode --tag w2 2>&1 | tee -a "$OUT/bench_flatshard.log" | tail -4
    (cd bench && timeout -k 5 120 python3 -m torch.distributed.run --standalone --nproc-per-node 2 peer_fsdp2_gpu.py \
      --nccl-host-per-rank --csv "$csv" --mode $peer --tag w2) 2>&1 | grep -v "OMP_NUM\|^\*\*\*" \
      | tee -a "$OUT/bench_fsdp2.log" | tail -4
    echo "bench $mode done at $((SECONDS - t0)) s"
  fi
done
cat "$csv"
