"""Turns train_gpt's RESULT lines into the main job's table, CSV and plot.

    python scripts/memory_report.py RESULTS.txt OUT_DIR

RESULT,mode,world,params,step_ms,peak_bytes,formula_bytes,planned_bytes,rank_peaks
writes OUT_DIR/memory.csv and OUT_DIR/memory.png (per-rank peak memory against world
size, one line per mode, the ZeRO formulas dashed) and prints a Markdown table.
"""
import csv
import os
import sys

NAMES = {"ddp": "DDP", "zero1": "ZeRO-1", "zero2": "ZeRO-2 (shard grad op)", "full": "full shard (ZeRO-3)"}
FORMULAS = {"ddp": "16Ψ", "zero1": "8Ψ + 8Ψ/N", "zero2": "4Ψ + 12Ψ/N", "full": "16Ψ/N"}
MIB = 2**20


def main(results, out_dir):
    rows = []
    with open(results) as f:
        for line in f:
            line = line.strip()
            if "RESULT," not in line:
                continue
            fields = line[line.index("RESULT,"):].split(",")
            _, mode, world, params, step_ms, peak, formula, planned, ranks = fields[:9]
            rows.append(dict(mode=mode, world=int(world), params=int(params), step_ms=float(step_ms),
                             peak_mib=int(peak) / MIB, formula_mib=int(formula) / MIB,
                             planned_states_mib=int(planned) / MIB,
                             rank_peaks_mib=";".join(f"{int(r) / MIB:.1f}" for r in ranks.split(";"))))
    if not rows:
        sys.exit("memory_report: no RESULT lines in " + results)
    os.makedirs(out_dir, exist_ok=True)
    csv_path = os.path.join(out_dir, "memory.csv")
    with open(csv_path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0].keys()))
        w.writeheader()
        for r in rows:
            w.writerow({k: (f"{v:.2f}" if isinstance(v, float) else v) for k, v in r.items()})

    psi = rows[0]["params"]
    worlds = sorted({r["world"] for r in rows})
    print(f"GPT-style model, Ψ = {psi:,} parameters, fp32, AdamW (K = 8); per-rank peak from the counting "
          "allocator (largest over ranks, from the second step on; activations included), ZeRO formula = model "
          "states only.\n")
    print("| mode | world | per-rank peak MiB | ZeRO formula | formula MiB | step ms | every rank's peak MiB |")
    print("|---|---:|---:|---|---:|---:|---|")
    for world in worlds:
        for mode in NAMES:
            for r in rows:
                if r["mode"] == mode and r["world"] == world:
                    print(f"| {NAMES[mode]} | {world} | {r['peak_mib']:.1f} | {FORMULAS[mode]} | "
                          f"{r['formula_mib']:.1f} | {r['step_ms']:.0f} | {r['rank_peaks_mib'].replace(';', ', ')} |")

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for mode, name in NAMES.items():
        pts = sorted((r["world"], r["peak_mib"], r["formula_mib"]) for r in rows if r["mode"] == mode)
        if not pts:
            continue
        line, = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{name} (measured)")
        ax.plot([p[0] for p in pts], [p[2] for p in pts], linestyle="--", color=line.get_color(), alpha=0.6,
                label=f"{FORMULAS[mode]}")
    ax.set_xlabel("world size (ranks)")
    ax.set_ylabel("peak memory per rank (MiB)")
    ax.set_xticks(worlds)
    ax.set_title(f"Per-rank memory by mode, GPT-style model ({psi / 1e6:.1f}M parameters, AdamW)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    png_path = os.path.join(out_dir, "memory.png")
    fig.savefig(png_path, dpi=120)
    print(f"\nwrote {csv_path} and {png_path}")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2])
