"""Plot an overlap benchmark result: speedup of tdist over the sequential path and over torch's
symm_mem fused op, per shape, one panel per op (bars above 1.0: tdist is faster).

    python benchmarks/plot_overlap.py benchmarks/results/overlap_<machine>.json

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
    fig, axes = plt.subplots(1, len(by_op), figsize=(7 * len(by_op), 4), squeeze=False)
    for ax, (op, rows) in zip(axes[0], by_op.items()):
        labels = [f"{r['M']}x{r['N']}x{r['K']}" for r in rows]
        xs = range(len(rows))
        for offset, base, name in ((-0.2, "sequential_us", "over sequential"), (0.2, "symm_mem_us", "over symm_mem")):
            ax.bar([x + offset for x in xs], [(r[base] or 0) / r["tdist_us"] for r in rows], 0.4, label=name)
        ax.axhline(1.0, color="black", lw=0.8)
        ax.set_xticks(list(xs), labels, rotation=45, ha="right", fontsize=7)
        ax.set_title(f"{op} (tdist speedup)")
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].legend()
    fig.suptitle(f"{result['machine']}: {result.get('method', '')}", fontsize=8)
    fig.tight_layout()
    out = path.rsplit(".", 1)[0] + ".png"
    fig.savefig(out, dpi=110)
    print("wrote", out)


if __name__ == "__main__":
    main(sys.argv[1])
