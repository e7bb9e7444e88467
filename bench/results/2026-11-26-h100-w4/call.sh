#!/usr/bin/env bash
# One device call (run twice on a warm machine: the second finds the build kept and runs
# what the environment selects: STUCK, W1_ROUNDS_A, W4, COMPILED, W1_ROUNDS_B, SWEEP): build; the stuck-rank test over NCCL
# at world 2; at world 1 FlatShard full shard against plain PyTorch (no wrapper, eager)
# and FSDP2, alternating, 5 warm-up and 50 timed steps; at world 4 over NCCL (each rank
# its own NCCL host id) full shard against FSDP2 and DDP against PyTorch DDP on a 6-block
# model; the compiled peers; a batch sweep. Each run starts only while BUDGET_S allows.
set -o pipefail
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/../../.."
t0=$SECONDS
budget="${BUDGET_S:-520}"
csv="$OUT/gpt_gpu.csv"
echo "impl,params,tokens_per_s,mfu,peak_gib,reserved_gib,retries,step_ms,comm_wait" > "$csv"
left() { echo $((budget - (SECONDS - t0))); }
stamp() { echo "== $* at $((SECONDS - t0)) s"; }
if [[ ! -x build-gpu/bench_gpt_gpu ]]; then
  FLATSHARD_GPU_BUILD_ONLY=1 OUT=/tmp/gpubuild scripts/gpu.sh 2>&1 | tail -20
fi
stamp "build done"
ls build-gpu/flatshard_cuda_tests build-gpu/bench_gpt_gpu || exit 1
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'
if [[ "${STUCK:-1}" == 1 ]]; then
  for i in 1 2; do
    timeout -k 5 90 env NCCL_DEBUG=WARN FLATSHARD_TEST_OUTPUT=1 FLATSHARD_TEST_NCCL_HOST_PER_RANK=1 \
      FLATSHARD_POISON_FREED=1 build-gpu/flatshard_cuda_tests --gtest_filter='CudaFailures.*' 2>&1 \
      | tee -a "$OUT/stuck.log" | grep -E "OK|FAILED|PASSED|Failure|rank .: the all-reduce|all_reduce #" | head -12
  done
  stamp "stuck-rank test done"
fi
# fs NEED RANKS ARGS...: FlatShard's bench; py NEED RANKS ARGS...: the PyTorch peer.
fs() {
  local need=$1 n=$2; shift 2
  (( $(left) > need )) || { echo "skipped (budget): flatshard -n $n $*"; return; }
  local host=(); (( n > 1 )) && host=(--nccl-host-per-rank)
  timeout -k 5 $((need + 60)) build-gpu/flatshard-run -n "$n" "${host[@]}" --deadline-s $((need + 50)) \
    build-gpu/bench_gpt_gpu --csv "$csv" "$@" 2>&1 | tee -a "$OUT/bench_flatshard.log" | grep -E "tokens/s|rror" | cut -c1-230
}
py() {
  local need=$1 n=$2; shift 2
  (( $(left) > need )) || { echo "skipped (budget): peer -n $n $*"; return; }
  local host=(); (( n > 1 )) && host=(--nccl-host-per-rank)
  (cd bench && timeout -k 5 $((need + 60)) python3 -m torch.distributed.run --standalone --nproc-per-node "$n" \
    peer_fsdp2_gpu.py "${host[@]}" --csv "$csv" "$@") 2>&1 | grep -v "OMP_NUM\|^\*\*\*" \
    | tee -a "$OUT/bench_fsdp2.log" | grep -E "tokens/s|rror" | cut -c1-230
}
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
stamp "all done"
python3 - "$csv" <<'PY' | tee "$OUT/table.md"
import csv, statistics, sys
rows = {}
for r in csv.DictReader(open(sys.argv[1])):
    rows.setdefault(r["impl"], []).append(r)
print("| impl | runs | tokens/s median (min-max) | step ms | MFU | peak GiB | reserved GiB |")
for k, v in rows.items():
    t = [float(r["tokens_per_s"]) for r in v]
    print(f"| {k} | {len(v)} | {statistics.median(t):.0f} ({min(t):.0f}-{max(t):.0f}) | "
          f"{statistics.median(float(r['step_ms']) for r in v):.1f} | {100*statistics.median(float(r['mfu']) for r in v):.1f}% | "
          f"{max(float(r['peak_gib']) for r in v):.2f} | {max(float(r['reserved_gib']) for r in v):.2f} |")
PY
