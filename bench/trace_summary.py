"""Breaks a Chrome trace (from bench_gpt_gpu --profile or peer_fsdp2_gpu.py --profile) down
by GPU kernel kind: time in matrix products, attention, communication, optimizer steps,
copies and the rest; the GPU's idle share of the span; and the share of the span in which
only communication runs (the GPU waiting for communication). Prints a Markdown table.

    python3 bench/trace_summary.py TRACE.json [TRACE2.json ...] [--top 12]
"""

import argparse
import json
import re
from collections import defaultdict

KINDS = [  # first match wins
    ("communication", re.compile(r"nccl", re.I)),
    ("attention", re.compile(r"flash|fmha|attention|sdpa|cudnn.*(mha|sdp)", re.I)),
    ("matrix products", re.compile(r"gemm|xmma|cutlass|nvjet|sm90_|cublas|wgmma", re.I)),
    ("optimizer", re.compile(r"adam|multi_tensor|fused_sgd|step_kernel", re.I)),
    ("copies and casts", re.compile(r"memcpy|memset|copy|cat_|_to_copy|CatArray", re.I)),
]


def kind_of(name):
    for kind, pattern in KINDS:
        if pattern.search(name):
            return kind
    return "elementwise and other"


def union_length(intervals):
    total, end = 0.0, None
    start = None
    for s, e in sorted(intervals):
        if end is None or s > end:
            if end is not None:
                total += end - start
            start, end = s, e
        else:
            end = max(end, e)
    if end is not None:
        total += end - start
    return total


def summarize(path, top):
    events = json.load(open(path))
    events = events["traceEvents"] if isinstance(events, dict) else events
    gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if not gpu:
        print(f"{path}: no GPU activity in the trace")
        return
    span_start = min(e["ts"] for e in gpu)
    span_end = max(e["ts"] + e["dur"] for e in gpu)
    span = span_end - span_start
    by_kind, by_name = defaultdict(float), defaultdict(lambda: [0.0, 0])
    comm, compute = [], []
    for e in gpu:
        k = kind_of(e["name"])
        by_kind[k] += e["dur"]
        by_name[e["name"]][0] += e["dur"]
        by_name[e["name"]][1] += 1
        (comm if k == "communication" else compute).append((e["ts"], e["ts"] + e["dur"]))
    busy = union_length(comm + compute)
    compute_busy = union_length(compute)
    comm_only = busy - compute_busy  # communication running while no compute kernel is
    print(f"\n### {path}\n")
    print(f"span of GPU activity {span / 1000:.1f} ms; GPU busy {100 * busy / span:.1f}%, idle "
          f"{100 * (span - busy) / span:.1f}%, only communication running {100 * comm_only / span:.1f}%\n")
    print("| kernel kind | ms | share of span |")
    print("|---|---|---|")
    for k, t in sorted(by_kind.items(), key=lambda kv: -kv[1]):
        print(f"| {k} | {t / 1000:.1f} | {100 * t / span:.1f}% |")
    print(f"\n| top kernels | calls | ms |")
    print("|---|---|---|")
    for name, (t, n) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"| {name[:110]} | {n} | {t / 1000:.1f} |")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("traces", nargs="+")
    p.add_argument("--top", type=int, default=12)
    a = p.parse_args()
    for path in a.traces:
        summarize(path, a.top)


if __name__ == "__main__":
    main()
