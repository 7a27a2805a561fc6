"""Plot a collectives benchmark result: bus bandwidth (as the benchmark computed it) against
message size, tdist and NCCL.

    python benchmarks/plot_collectives.py benchmarks/results/collectives_<machine>.json

Writes the PNG next to the JSON (needs matplotlib, which the package itself does not).
"""

import json
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

def main(path):
    result = json.load(open(path))
    by_op = defaultdict(list)
    for row in result["rows"]:
        by_op[row["op"]].append(row)
    fig, axes = plt.subplots(1, len(by_op), figsize=(4 * len(by_op), 3.6), squeeze=False)
    for ax, (op, rows) in zip(axes[0], by_op.items()):
        rows.sort(key=lambda r: r["bytes_per_rank"])
        sizes = [r["bytes_per_rank"] for r in rows]
        ax.plot(sizes, [r["nccl_busbw_gbs"] for r in rows], "o-", label="NCCL")
        ax.plot(sizes, [r["tdist_busbw_gbs"] for r in rows], "s-", label="tdist")
        ax.set_xscale("log", base=2)
        ax.set_title(op)
        ax.set_xlabel("bytes per rank")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("bus bandwidth (GB/s)")
    axes[0][0].legend()
    fig.suptitle(f"{result['machine']}: {result.get('method', '')}", fontsize=9)
    fig.tight_layout()
    out = path.rsplit(".", 1)[0] + ".png"
    fig.savefig(out, dpi=110)
    print("wrote", out)


if __name__ == "__main__":
    main(sys.argv[1])
