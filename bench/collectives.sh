#!/usr/bin/env bash
# Collective bandwidth at 2 ranks (or $1): FlatShard's Communicator, its transport
# called directly, and PyTorch's c10d Gloo from the pinned torch, in one run, with
# the ratios. Prints a Markdown table.
#
#   bench/collectives.sh [RANKS] [BUILD_DIR]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
. "$root/scripts/env.sh"
ranks="${1:-2}"
build="${2:-$root/build}"
out="$(mktemp -d)"
"$build/flatshard-run" -n "$ranks" "$build/bench/bench_collectives" \
    --benchmark_format=csv 2>/dev/null | sed -n 's/^\[rank 0\] //p' > "$out/ours.csv"
"$build/flatshard-run" -n "$ranks" "$FLATSHARD_VENV/bin/python" "$root/bench/peer_c10d_gloo.py" \
    2>/dev/null | sed -n 's/^\[rank 0\] //p' > "$out/peer.txt"
"$FLATSHARD_VENV/bin/python" - "$out/ours.csv" "$out/peer.txt" "$ranks" <<'PY'
import csv, sys
ours, peer, ranks = sys.argv[1], sys.argv[2], sys.argv[3]
mbps = {}
for row in csv.DictReader(line for line in open(ours) if line.count(",") > 3):
    family, op, size = row["name"].strip('"').split("/")[:3]
    mbps[(family, op, int(size))] = float(row["bytes_per_second"]) / 1e6
for line in open(peer):
    _, op, size, _, rate = line.split()
    mbps[("c10d_gloo", op, int(size))] = float(rate)
print(f"Collective bandwidth at {ranks} ranks (MB/s of the full buffer; higher is better)\n")
print("| op | bytes | FlatShard Communicator | transport direct | c10d Gloo | Communicator / transport | FlatShard / c10d Gloo |")
print("|---|---:|---:|---:|---:|---:|---:|")
for op in ["all_gather", "reduce_scatter", "all_reduce"]:
    for size in sorted({k[2] for k in mbps if k[1] == op}):
        c = mbps.get(("Communicator", op, size)); t = mbps.get(("Transport", op, size)); g = mbps.get(("c10d_gloo", op, size))
        f = lambda v: f"{v:.0f}" if v else "-"
        r = lambda a, b: f"{a / b:.2f}" if a and b else "-"
        print(f"| {op} | {size} | {f(c)} | {f(t)} | {f(g)} | {r(c, t)} | {r(c, g)} |")
PY
rm -rf "$out"
