"""Plot a benchmark result next to its JSON (needs matplotlib, which the package itself does not).

    python benchmarks/plot.py benchmarks/results/collectives_<machine>.json   # bus bandwidth
    python benchmarks/plot.py benchmarks/results/overlap_<machine>.json       # speedup bars

collectives: bus bandwidth against message size, tdist and NCCL, one panel per op. overlap:
tdist's speedup over the sequential path and over torch's symm_mem fused op, per shape, one panel
per op (bars above 1.0: tdist is faster).
"""

import json
import os
import sys
import textwrap
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _bandwidth(ax, op, rows):
    rows.sort(key=lambda r: r["bytes_per_rank"])
    sizes = [r["bytes_per_rank"] for r in rows]
    ax.plot(sizes, [r["nccl_busbw_gbs"] for r in rows], "o-", label="NCCL")
    ax.plot(sizes, [r["tdist_busbw_gbs"] for r in rows], "s-", label="tdist")
    ax.set_xscale("log", base=2)
    ax.set_title(op)
    ax.set_xlabel("bytes per rank")
    ax.set_ylabel("bus bandwidth (GB/s)")


def _speedups(ax, op, rows):
    xs = range(len(rows))
    for offset, base, name in ((-0.2, "sequential_us", "over sequential"), (0.2, "symm_mem_us", "over symm_mem")):
        ax.bar([x + offset for x in xs], [(r[base] or 0) / r["tdist_us"] for r in rows], 0.4, label=name)
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xticks(list(xs), [f"{r['M']}x{r['N']}x{r['K']}" for r in rows], rotation=45, ha="right", fontsize=7)
    ax.set_title(f"{op} (tdist speedup)")


def main(path):
    result = json.load(open(path))
    rows = result["rows"]
    if os.path.basename(path).startswith("overlap"):
        draw, width, panel = _speedups, 7, lambda r: r["op"]
    else:
        draw, width, panel = _bandwidth, 4, lambda r: r["op"]
    by_op = defaultdict(list)
    for row in rows:
        by_op[panel(row)].append(row)
    fig, axes = plt.subplots(1, len(by_op), figsize=(width * len(by_op), 4), squeeze=False)
    for ax, (op, rows) in zip(axes[0], by_op.items()):
        draw(ax, op, rows)
        ax.grid(alpha=0.3)
    axes[0][0].legend()
    title = textwrap.fill(f"{result['machine']}: {result.get('method', '')}", width=13 * width * len(by_op))  # (about 13 characters an inch at 8 points)
    fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    out = path.rsplit(".", 1)[0] + ".png"
    fig.savefig(out, dpi=110)
    print("wrote", out)


if __name__ == "__main__":
    main(sys.argv[1])
