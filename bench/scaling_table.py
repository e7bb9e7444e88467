#!/usr/bin/env python3
"""The scaling table of docs/scaling.md: flatshard-plan --cluster's predicted tokens/s per GPU for
each strategy from 1 to 1,024 H100s (8 per node beyond 8), its efficiency against one GPU, what
limits it, and whether it fits the GPU's memory.

    bench/scaling_table.py [BUILD_DIR]              # both models, Markdown
    bench/scaling_table.py BUILD_DIR algorithms   # the 1.04B GPT under each way to communicate less
"""
import subprocess
import sys

build = sys.argv[1] if len(sys.argv) > 1 else "build"
table = sys.argv[2] if len(sys.argv) > 2 else "strategies"
SIZES = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]
MODELS = [
    ("gpt-1b", ["--model", "gpt-1b", "--seq", "1024", "--batch", "16"], 78,
     "the 1.04B GPT, 16 sequences of 1,024 tokens per GPU, no recomputation"),
    ("llama3-8b", ["--model", "llama3-8b", "--seq", "8192", "--batch", "2", "--recompute", "selective"], 78,
     "Llama 3.1 8B, 2 sequences of 8,192 tokens per GPU, selective recomputation (torchtitan's settings)"),
]
STRATEGIES = ["full shard", "shard-grad-op", "hybrid (groups of 8)", "ZeRO-1", "DDP"]


def predict(n, args, gib):
    cluster = f"1x{n}" if n <= 8 else f"{n // 8}x8"
    out = subprocess.run([f"{build}/flatshard-plan", "--cluster", cluster, *args, "--device-gib", str(gib), "--csv", "1"],
                         check=True, capture_output=True, text=True).stdout
    rows = {}
    for line in out.splitlines():
        f = line.split(",")
        if f[0] == "TIME":
            rows[f[1]] = {"tps": float(f[3]), "exposed": float(f[4]), "limit": f[5], "gib": float(f[6]),
                          "contended": float(f[7])}
    return rows


# The ways to communicate less (docs/communication.md) at 8, 128 and 1,024 GPUs: DDP with
# each hook, staleness and decentralized training, hybrid groups of 8 with the hooks that
# pay across groups. The cells are tokens/s per GPU, what limits the step and its exposed
# share; the first column of each row is the strategy without any.
ALGORITHMS = [("DDP", ["", "--hook bf16", "--hook int8", "--hook top_k:0.01", "--hook random_k:0.01",
                       "--hook power_sgd:4", "--staleness 1", "--decentralized 1"]),
              ("hybrid (groups of 8)", ["", "--hook bf16", "--hook power_sgd:4"]),
              ("ZeRO-1", ["", "--hook bf16", "--staleness 1"])]
if table == "algorithms":
    name, args, gib, what = MODELS[0]
    print(f"#### {name}: {what}; {gib} GiB per GPU\n")
    for strategy, variants in ALGORITHMS:
        heads = [v.replace("--hook ", "").replace("--", "") or "none" for v in variants]
        print(f"{strategy}: tokens/s per GPU (limit, exposed share)\n")
        print("| GPUs | " + " | ".join(heads) + " |")
        print("|---:|" + "---:|" * len(variants))
        for n in [8, 128, 1024]:
            cells = []
            for v in variants:
                r = predict(n, args + v.split(), gib).get(strategy if n > 8 or not strategy.startswith("hybrid")
                                                          else "full shard")
                cells.append("" if r is None else f"{r['tps']:,.0f} ({r['limit']}, {100 * r['exposed']:.0f}%)")
            print(f"| {n} | " + " | ".join(cells) + " |")
        print()
    sys.exit(0)

for name, args, gib, what in MODELS:
    base = predict(1, args, gib)["full shard"]["tps"]
    print(f"#### {name}: {what}; {gib} GiB per GPU\n")
    print("tokens/s per GPU (efficiency against one GPU; limit when not compute; — where it does not fit)\n")
    print("| GPUs | " + " | ".join(STRATEGIES) + " |")
    print("|---:|" + "---:|" * len(STRATEGIES))
    for n in SIZES:
        rows = predict(n, args, gib)
        cells = []
        for s in STRATEGIES:
            if s.startswith("hybrid") and n <= 8:
                r = rows.get("full shard")  # one node: a group of 8 is the world
            else:
                r = rows.get(s)
            if r is None:
                cells.append("")
                continue
            text = f"{r['tps']:,.0f} ({100 * r['tps'] / base:.0f}%)"
            if r["limit"] == "contention":
                text += f" contention, {100 * r['contended']:.0f}% lost"
            elif r["limit"] != "compute":
                text += f" {r['limit']}, {100 * r['exposed']:.0f}% exposed"
            if r["gib"] > gib:
                text = f"— ({r['gib']:.0f} GiB)"
            cells.append(text)
        print(f"| {n} | " + " | ".join(cells) + " |")
    print()
