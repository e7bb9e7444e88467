#!/usr/bin/env bash
# Soak: full shard at 4 ranks for 1000 steps with a sharded checkpoint every 100 steps;
# rank 0's allocator figures and resident set every 50 steps. Passes when, after warm-up
# (step 100), the allocator's peak grows by less than 1%, live tensor memory between
# steps stays flat, and the resident set grows by less than 5%.
#   bench/soak.sh [BUILD_DIR] [STEPS]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${1:-$root/build}"
steps="${2:-1000}"
dir="$(mktemp -d /tmp/flatshard-soak.XXXXXX)"
trap 'rm -rf "$dir"' EXIT
start=$(date +%s)
"$build/flatshard-run" -n 4 "$build/examples/train_gpt" --mode full --steps "$steps" --layers 2 --dim 128 \
    --vocab 1024 --context 32 --batch 2 --log-every 100 --memory-every 50 --ckpt "$dir/ckpt" --save-every 100 \
    | tee "$dir/log" | grep -v MEMORY
echo "wall time: $(( $(date +%s) - start )) s"
python3 - "$dir/log" <<'PY'
import sys
rows = [l.split("MEMORY,")[1].strip().split(",") for l in open(sys.argv[1]) if "MEMORY," in l]
rows = [tuple(int(x) for x in r) for r in rows]
mib = lambda b: b / 2**20
print("| step | live tensors MiB (between steps) | allocator peak MiB | resident set MiB |")
print("|---:|---:|---:|---:|")
for s, c, p, rss in rows:
    if s % 100 == 0:
        print(f"| {s} | {mib(c):.2f} | {mib(p):.2f} | {mib(rss):.1f} |")
warm = [r for r in rows if r[0] >= 100]
growth = (warm[-1][2] - warm[0][2]) / warm[0][2]
rss_growth = (warm[-1][3] - warm[0][3]) / warm[0][3]
live = [r[1] for r in warm]
print(f"\nafter warm-up: allocator peak {100 * growth:+.2f}%, live tensors {mib(min(live)):.2f}..{mib(max(live)):.2f} MiB, "
      f"resident set {100 * rss_growth:+.2f}%")
ok = growth < 0.01 and max(live) - min(live) < 0.01 * max(live) + 65536 and rss_growth < 0.05
print("no leak" if ok else "LEAK")
sys.exit(0 if ok else 1)
PY
