#!/usr/bin/env bash
# Where the GPU step's time goes, on a GPU machine (after or instead of scripts/gpu.sh):
# builds as scripts/gpu.sh does, profiles three steps of the 1B GPT under FlatShard's full
# shard and under PyTorch FSDP2 (Chrome traces, summarised by bench/trace_summary.py: time
# per kernel kind, GPU idle share, share of the step in which only communication runs), then
# times both at the batch sizes in FLATSHARD_GPU_BATCHES (default "8 16"). Extra arguments go
# to every run. Output goes to $OUT (when set) or out/gpu.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="${OUT:-$root/out/gpu}"
mkdir -p "$out"
python="${FLATSHARD_GPU_PYTHON:-python3}"
build="$root/build-gpu"
FLATSHARD_GPU_BUILD_ONLY=1 "$root/scripts/gpu.sh" >/dev/null
status=0
flatshard() { "$build/flatshard-run" -n 1 --deadline-s 900 "$build/bench_gpt_gpu" "$@"; }
fsdp2() {
  (cd "$root/bench" && "$python" -m torch.distributed.run --standalone --nproc-per-node 1 peer_fsdp2_gpu.py "$@") \
    2>&1 | grep -v "^W.*OMP_NUM_THREADS\|^\*\*\*"
}
echo "== profiles (three steps each)"
flatshard --profile /tmp/flatshard_trace.json "$@" || status=1
fsdp2 --profile /tmp/fsdp2_trace.json "$@" || status=1
"$python" "$root/bench/trace_summary.py" /tmp/flatshard_trace.json /tmp/fsdp2_trace.json | tee "$out/profile.md" \
  || status=1
gzip -c /tmp/flatshard_trace.json > "$out/flatshard_trace.json.gz" || true
gzip -c /tmp/fsdp2_trace.json > "$out/fsdp2_trace.json.gz" || true
csv="$out/batches.csv"
echo "impl,params,tokens_per_s,mfu,peak_gib,reserved_gib,retries,step_ms,comm_wait,batch" > "$csv"
for b in ${FLATSHARD_GPU_BATCHES:-8 16}; do
  echo "== batch $b"
  flatshard --batch "$b" --csv /tmp/b.csv "$@" || status=1
  fsdp2 --batch "$b" --csv /tmp/b.csv "$@" || status=1
  [[ -f /tmp/b.csv ]] && sed "s/\$/,$b/" /tmp/b.csv >> "$csv" && rm /tmp/b.csv
done
cat "$csv"
exit $status
