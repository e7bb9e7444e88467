# Sourced by the dated GPU run scripts under bench/results/: builds the GPU targets
# unless an earlier run's build is still there, prints the GPU and software, and defines
# fs and py (one budgeted run of FlatShard's bench and of the PyTorch peer, appending to
# $OUT's CSV) and print_table (medians with min and max per CSV row name).
set -o pipefail
export PYTHONUNBUFFERED=1
cd "$(dirname "${BASH_SOURCE[0]}")/.."
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
# fs NEED RANKS ARGS...: FlatShard's bench; py NEED RANKS ARGS...: the PyTorch peer.
fs() {
  local need=$1 n=$2; shift 2
  (( $(left) > need )) || { echo "skipped (budget): flatshard -n $n $*"; return; }
  local host=(); (( n > 1 )) && host=(--nccl-host-per-rank)
  timeout -k 5 $((need + 60)) build-gpu/flatshard-run -n "$n" "${host[@]}" --deadline-s $((need + 50)) \
    build-gpu/bench_gpt_gpu --csv "$csv" "$@" 2>&1 | tee -a "$OUT/bench_flatshard.log" | grep -E "tokens/s|rror" | cut -c1-230
  stamp "  run"
}
py() {
  local need=$1 n=$2; shift 2
  (( $(left) > need )) || { echo "skipped (budget): peer -n $n $*"; return; }
  local host=(); (( n > 1 )) && host=(--nccl-host-per-rank)
  (cd bench && timeout -k 5 $((need + 60)) python3 -m torch.distributed.run --standalone --nproc-per-node "$n" \
    peer_fsdp2_gpu.py "${host[@]}" --csv "$csv" "$@") 2>&1 | grep -v "OMP_NUM\|^\*\*\*" \
    | tee -a "$OUT/bench_fsdp2.log" | grep -E "tokens/s|rror" | cut -c1-230
  stamp "  run"
}
print_table() {
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
}
