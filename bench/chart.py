"""The results as a bar chart (matplotlib, from ``pip install -e '.[bench]'``): tokens/s,
milliseconds and MiB, each figure's median with its min-max over the repeats, per server."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from bench.servers import LMSERVE, PEER, SERVERS

if TYPE_CHECKING:
    from bench.report import Row


def write_chart(rows: Sequence[Row], path: Path, title: str) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("bench.serve: matplotlib is missing, so no chart; install it with "
              "`pip install -e '.[bench]'`", file=sys.stderr)
        return False
    groups = [g for g in (("tok/s", "tokens/s (higher is better)", False, 3),
                          ("ms", "milliseconds (lower is better, log)", True, 3),
                          ("MiB", "peak RSS, MiB (lower is better)", False, 1.6))
              if any(r.unit == g[0] for r in rows)]
    if not groups:
        return False
    fig, axes = plt.subplots(1, len(groups), figsize=(6 * len(groups), 9), squeeze=False,
                             gridspec_kw={"width_ratios": [g[3] for g in groups]})
    axes = axes[0]
    colors = {LMSERVE: "#3366cc", PEER: "#dd7733"}
    for ax, (unit, heading, log, _) in zip(axes, groups):
        chosen = [r for r in rows if r.unit == unit]
        labels = [f"{r.scenario}\n{r.metric}" for r in chosen]
        height = 0.38
        for k, server in enumerate(SERVERS):
            ys, xs, lo, hi = [], [], [], []
            for i, r in enumerate(chosen):
                s = r.spread(server)
                if s is None:
                    continue
                ys.append(i + (k - 0.5) * height)
                xs.append(s.median)
                lo.append(s.median - s.min)
                hi.append(s.max - s.median)
            ax.barh(ys, xs, height, xerr=[lo, hi], color=colors[server], label=server, capsize=2)
        ax.set_yticks(range(len(chosen)), labels, fontsize=7)
        ax.invert_yaxis()
        ax.set_title(heading, fontsize=10)
        if log:
            ax.set_xscale("log")
        ax.grid(axis="x", alpha=0.3)
    axes[0].legend(loc="lower right")
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
