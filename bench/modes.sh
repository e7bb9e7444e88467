#!/usr/bin/env bash
# Every training mode on one GPT-style model at 2 ranks (or $RANKS), in one run: our DDP,
# ZeRO-1, ZeRO-2 (shard-grad-op) and full shard next to PyTorch's DDP,
# ZeroRedundancyOptimizer and FSDP2 (fully_shard, with and without resharding after
# forward) from the pinned torch, each at its strongest CPU settings (fused AdamW,
# gradient_as_bucket_view, parameters_as_bucket_view). Two regimes: compute-bound (4
# sequences of 128 tokens per rank) and communication-bound (1 sequence of 32 tokens per
# rank), and full shard stepping in backward against FSDP2 as well. A third regime,
# recompute, is the compute-bound one with every block recomputed in backward on both sides
# (FlatShard's set_recompute; PyTorch's non-reentrant activation checkpointing of each
# block, applied before DDP or fully_shard). At 4 ranks or more (RANKS, even) hybrid
# sharding over groups of RANKS/2 ranks runs against FSDP2's 2-D mesh (HSDP) as well.
# Prints a Markdown table with ratios for each.
#   bench/modes.sh [BUILD_DIR] [model args, default: --dim 512 --layers 8 --vocab 8192 --steps 4]
#   REGIMES="compute comm recompute finetune" (default: compute comm; finetune: the compute-bound
#   regime with every block's attention frozen on both sides, the peers' optimizers over the
#   trained parameters only)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
. "$root/scripts/env.sh"
build="${1:-$root/build}"
shift || true
args=("$@")
[[ ${#args[@]} -gt 0 ]] || args=(--dim 512 --layers 8 --vocab 8192 --steps 4)
ranks="${RANKS:-2}"
# Rank 0's result line of one run; a run that fails is named on stderr with the end of its
# output (its row is then missing from the table, or, where rank 0 finished, kept)
# instead of ending the script.
row() {
  local out err
  err="$(mktemp)"
  if ! out="$("$build/flatshard-run" -n "$ranks" "$@" 2>"$err")"; then
    echo "modes.sh: failed: $*" >&2
    tail -n 20 "$err" >&2
  fi
  rm -f "$err"
  printf '%s\n' "$out" | sed -n 's/^\[rank 0\] //p'
}
table() {
"$FLATSHARD_VENV/bin/python" -c '
import sys
r = {}
for line in sys.stdin:
    f = line.strip().split(",")
    if len(f) >= 6: r[f[0]] = f
if not r: sys.exit("no results")
mib = lambda b: float(b) / 2**20
first = next(iter(r.values()))
print(f"### {sys.argv[1]}\n")
print(f"GPT-style model, {int(first[2]):,} parameters, fp32, AdamW, {first[1]} ranks on one machine; "
      "figures are the largest over ranks, from the second step on.\n")
print("| mode | FlatShard step ms | PyTorch step ms | step time ratio | FlatShard RSS growth MiB | PyTorch RSS growth MiB | RSS ratio | FlatShard allocator peak MiB | ZeRO formula MiB | FlatShard comm wait |")
print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
pairs = [("DDP", "ddp", "torch_ddp"), ("ZeRO-1 (ZeroRedundancyOptimizer)", "zero1", "torch_zero1"),
         ("ZeRO-2 (shard-grad-op / FSDP2 no reshard)", "zero2", "torch_fsdp2_grad_op"),
         ("full shard (FSDP2)", "full", "torch_fsdp2"),
         ("full shard stepping in backward (FSDP2)", "full-stepinbwd", "torch_fsdp2"),
         ("hybrid shard (FSDP2 2-D mesh, HSDP)", "hybrid", "torch_hsdp")]
for name, ours, theirs in pairs:
    o, t = r.get(ours), r.get(theirs)
    if not o: continue
    ts, tr = (float(t[3]), float(t[5])) if t else (None, None)
    ratio = lambda a, b: f"{a / b:.2f}" if b else "-"
    print(f"| {name} | {float(o[3]):.0f} | {ts if ts is None else round(ts)} | {ratio(float(o[3]), ts)} | "
          f"{mib(o[5]):.0f} | {tr if tr is None else round(mib(tr))} | {ratio(float(o[5]), tr)} | {mib(o[4]):.0f} | {mib(o[11]):.0f} | "
          f"{100 * float(o[14]):.0f}% |")
print("\nRatios are FlatShard / PyTorch: below 1 is faster or smaller. RSS growth is the resident-set high-water mark "
      "minus the resident set just before the model was built, measured the same way on both sides. Comm wait: the share "
      "of the step in which the compute of the FlatShard ranks waited for communication (mean over ranks; docs/communicator.md#communication-wait).")
' "$1"
}
for regime in ${REGIMES:-compute comm}; do
  case "$regime" in
    compute) shape=(--batch 4 --context 128) title="compute-bound: 4 sequences of 128 tokens per rank" ;;
    comm) shape=(--batch 1 --context 32) title="communication-bound: 1 sequence of 32 tokens per rank" ;;
    recompute)
      shape=(--batch 4 --context 128 --recompute 1)
      title="compute-bound, every block recomputed: 4 sequences of 128 tokens per rank" ;;
    finetune)
      shape=(--batch 4 --context 128 --freeze .attn.)
      title="fine-tuning, every block's attention frozen: 4 sequences of 128 tokens per rank" ;;
    *) echo "modes.sh: REGIMES holds compute, comm, recompute and/or finetune, not $regime" >&2; exit 2 ;;
  esac
  rows=""
  for m in ddp zero1 zero2 full; do
    rows+="$(row "$build/bench/bench_modes" --mode "$m" "${args[@]}" "${shape[@]}")"$'\n'
  done
  # Full shard stepping in backward (fully-shard.md#stepping-in-backward), against FSDP2.
  rows+="$(row "$build/bench/bench_modes" --mode full --step-in-backward 1 "${args[@]}" "${shape[@]}")"$'\n'
  if ((ranks >= 4 && ranks % 2 == 0)); then  # hybrid: two shard groups
    rows+="$(row "$build/bench/bench_modes" --mode hybrid --group $((ranks / 2)) "${args[@]}" "${shape[@]}")"$'\n'
    rows+="$(row "$FLATSHARD_VENV/bin/python" "$root/bench/peer_pytorch_modes.py" --mode torch_hsdp \
               --group $((ranks / 2)) "${args[@]}" "${shape[@]}")"$'\n'
  fi
  for m in torch_ddp torch_zero1 torch_fsdp2_grad_op torch_fsdp2; do
    rows+="$(row "$FLATSHARD_VENV/bin/python" "$root/bench/peer_pytorch_modes.py" --mode "$m" "${args[@]}" "${shape[@]}")"$'\n'
  done
  printf '%s' "$rows" | table "$title"
  echo
done
